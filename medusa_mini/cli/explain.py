"""One Medusa decoding step, walked through in words: what each head guesses, the tree, what the
backbone says at every node, and which tokens the step keeps.

It runs reference.py's own functions in the order its `medusa_generate` does, so the printed step is
the file a learner reads; dependent (hydra) heads fill the tree through the engine's proposer.
"""

from __future__ import annotations

import tiktoken
import torch
import torch.nn.functional as F

from .. import reference as ref
from ..hydra import HydraProposer
from ..model import GPT
from ..sampling import Sampling
from ..tree import Tree
from .common import token_text


def _header(number: int, title: str) -> str:
    line = f"{number}. {title}"
    return f"\n{line}\n{'-' * len(line)}"


def _snippet(text: str, limit: int = 70) -> str:
    # Long prompts matter only by their end: that is where the next token comes from.
    return repr(text if len(text) <= limit else "…" + text[-limit:])


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _guesses(enc: tiktoken.Encoding, logits: torch.Tensor, k: int) -> str:
    probs = F.softmax(logits.float(), dim=-1)
    top = probs.topk(k)
    pairs = zip(top.values.tolist(), top.indices.tolist())
    return ", ".join(f"#{r} {token_text(enc, t)} ({p:.2f})" for r, (p, t) in enumerate(pairs))


def _greedy_scores(enc, tree: Tree, toks: list[int], labels: list[str], logits: torch.Tensor) -> list[str]:
    """Section 5 for greedy acceptance: the backbone's argmax at every node, and the child it confirms."""
    y = logits.argmax(dim=-1).tolist()  # [N]
    out = ["At each node, the backbone's argmax = the token it would write after that node's path.",
           "If a child of the node holds exactly that token, the child's guess is confirmed.",
           "(A leaf has no child to confirm: its argmax can only be a bonus token.)"]
    args = [token_text(enc, c) for c in y]
    w_tok = max(len("token"), *map(len, labels)) + 2
    w_arg = max(len("backbone argmax"), *map(len, args)) + 2
    out.append(f"{'node':<6}{'token':<{w_tok}}{'backbone argmax':<{w_arg}}confirms child")
    for i in range(tree.num_nodes):
        kids = ref.children(tree.parents, i)
        hit = next((c for c in kids if toks[c] == y[i]), None)
        mark = f"[{hit}] ✓" if hit is not None else ("- (leaf)" if not kids else "none ✗")
        out.append(f"{f'[{i}]':<6}{labels[i]:<{w_tok}}{args[i]:<{w_arg}}{mark}")
    return out


def _sampled_scores(tree: Tree, toks: list[int], labels: list[str], logits: torch.Tensor, drafts, *,
                    sampling: Sampling) -> list[str]:
    """Section 5 for the sampling rules: p of every candidate after its parent's path (and q, if drawn)."""
    p = sampling.probs(logits)  # [N, V]
    out = ["At each node, p = the backbone's distribution for the next token after that node's path.",
           "A candidate is judged by p at its parent: the column shows p(candidate)."]
    if drafts is not None:
        out.append("q(candidate) is the head's probability of drawing it; the first child tried is accepted")
        out.append("with probability min(1, p/q).")
    w_tok = max(len("token"), *map(len, labels)) + 2
    out.append(f"{'node':<6}{'token':<{w_tok}}{'p(token)':<10}" + ("q(token)" if drafts is not None else ""))
    for i in range(1, tree.num_nodes):
        par = tree.parents[i]
        row = f"{f'[{i}]':<6}{labels[i]:<{w_tok}}{p[par, toks[i]].item():<10.3f}"
        if drafts is not None:
            row += f"{drafts[par][0][toks[i]].exp().item():.3f}"  # the q the parent's children came from
        out.append(row)
    return out


def _propose(model, heads, tree: Tree, root: int, hidden: torch.Tensor, *, sampling: Sampling, generator):
    """(tokens [N], drafts per node or None): the reference's propose, the engine's proposer for hydra."""
    if heads.config.kind == "hydra":
        roots = torch.tensor([root], device=hidden.device)
        proposal = HydraProposer(model, heads, tree).propose(roots, hidden[None], max_depth=tree.depth,
                                                             sampling=sampling, generator=generator)
        draft = proposal.draft
        return proposal.tokens[0].tolist(), draft.per_node(0, draft.samples.tolist()) if draft is not None else None
    head_logits = heads(hidden[None], model.lm_head)[:, 0]  # [K, V]
    return ref.propose(head_logits, tree, root, sampling=sampling, generator=generator)


@torch.no_grad()
def explain_step(
    model: GPT,
    heads,
    enc: tiktoken.Encoding,
    prompt_ids: list[int],
    *,
    tree: Tree,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> str:
    """Run one Medusa step after the prompt with the reference's functions; describe every stage."""
    tree.check_heads(heads.num_heads)
    block, L = model.config.block_size, len(prompt_ids)
    if L == 0 or L >= block - 1:
        raise ValueError(f"the prompt must have 1 to {block - 2} tokens, not {L}")
    tree = tree.truncated(block - 2 - L)  # the deepest node's position must stay inside the context
    out: list[str] = ["One Medusa decoding step, in full", "================================="]
    out.append(f"Prompt ({L} tokens): {_snippet(enc.decode(prompt_ids))}")
    rule = "greedy" if sampling.greedy else f"{sampling.rule}, temperature {sampling.temperature:g}"
    out.append(f"Acceptance rule: {rule}")

    out.append(_header(1, "Prefill: the prompt goes through the backbone once"))
    cache = [None] * model.config.n_layer
    logits, hidden = ref.forward(model, prompt_ids, list(range(L)), cache, torch.ones(L, L, dtype=torch.bool).tril())
    root, hidden = ref.next_token(logits[-1], sampling, generator), hidden[-1]
    out.append(f"The KV cache now holds the {L} prompt tokens.")
    out.append(f"Backbone's top guesses for the next token: {_guesses(enc, logits[-1], 3)}")
    how = "the argmax of" if sampling.greedy else "drawn from"
    out.append(f"Root token (the backbone's own next token, {how} these): {token_text(enc, root)}")
    out.append("The root is already certain: it is emitted now, before the first Medusa step.")

    out.append(_header(2, "Heads: guesses further ahead, from the same last hidden state"))
    used = tree.top_k()
    if heads.config.kind == "hydra":
        out.append("Dependent (hydra) heads: head k reads this hidden state and the k tokens before its guess")
        out.append("(the root, then the drafted path), so every node's children come from that node's own q,")
        out.append("filled depth by depth, one head call per depth (step 3).")
        first = heads.head_logits(1, hidden, torch.tensor([root], device=hidden.device), lm_head=model.lm_head,
                                  wte=model.transformer.wte)  # [V]
        if used:
            out.append(f"head 1 (2nd token after the root), reading the root: {_guesses(enc, first, used[0])}")
    else:
        head_logits = heads(hidden[None], model.lm_head)[:, 0]  # [K, V]
        for k in range(heads.num_heads):
            shown = used[k] if k < len(used) else 0
            nth = _ordinal(k + 1)
            guesses = _guesses(enc, head_logits[k], shown) if shown else "not used by this tree"
            out.append(f"head {k + 1} ({nth} token after the root): {guesses}")
    out.append("The backbone alone would need one forward pass per token to check these one by one.")

    tokens, drafts = _propose(model, heads, tree, root, hidden, sampling=sampling, generator=generator)
    out.append(_header(3, f"Tree: {tree.num_nodes - 1} candidate nodes + the root"))
    labels = [token_text(enc, t) for t in tokens]
    if drafts is None:
        out.append("A node at depth d holds head d's guess of the listed rank"
                   + (", given the node's own path;" if heads.config.kind == "hydra" else ";"))
        out.append("a path from the root is one possible continuation. All paths are checked together next.")
    else:
        out.append("Rejection sampling draws the candidates: a node at depth d holds the r-th token drawn from")
        out.append("the q its parent's children come from (without replacement, r = its rank); a path from the")
        out.append("root is one possible continuation. All paths are checked together next.")
    out.append(tree.draw(labels))

    out.append(_header(4, "Tree attention mask"))
    out.append("Row = a node asking, column = a node it may look at (■ yes, · no). Every node also sees")
    out.append(f"all {L} cached prompt tokens, and sits at position {L} + its depth, as if its path were")
    out.append("the only continuation: a node sees itself and its ancestors, never its siblings.")
    out.append(tree.draw_mask())

    out.append(_header(5, "Verify: one forward pass over all nodes"))
    N = tree.num_nodes
    mask = torch.cat([torch.ones(N, L, dtype=torch.bool), ref.tree_attention_mask(tree.parents)], dim=1)
    logits, _ = ref.forward(model, tokens, [L + d for d in tree.depth_list], cache, mask)  # [N, V]
    if sampling.greedy:
        out.extend(_greedy_scores(enc, tree, tokens, labels, logits))
    else:
        out.extend(_sampled_scores(tree, tokens, labels, logits, drafts, sampling=sampling))

    out.append(_header(6, "Accept: a path of accepted candidates, plus a bonus token"))
    path, bonus = ref.accept(tree.parents, tokens, logits, sampling=sampling, generator=generator, drafts=drafts)
    if sampling.rule == "rejection" and drafts is not None:
        out.append("Rejection sampling: try a node's children in order, accepting x with probability")
        out.append("min(1, p(x)/q(x)) and moving p to norm(max(0, p - q)) after a miss (lossless).")
    elif sampling.rule == "rejection":
        out.append("Rejection sampling of top-k candidates: draw y from p at each node and descend while y is")
        out.append("a child's token; the first y that is not becomes the bonus (lossless: the same as trying")
        out.append("each child x with probability p(x), then setting p(x) to 0 and renormalising).")
    elif sampling.rule == "typical":
        out.append("Typical acceptance: keep a candidate whose probability clears min(ε, δ·exp(-H(p))).")
    else:
        out.append("Greedy: from the root, descend while the backbone's argmax is a child's token.")
    steps = [f"[{i}] {labels[i]}" + (" (root, already emitted)" if i == 0 else "") for i in path]
    out.append("accepted path: " + " → ".join(steps))
    out.append(f"bonus token:   {token_text(enc, bonus)}, the backbone's own next token after [{path[-1]}], "
               "free from the same pass")

    out.append(_header(7, "Result"))
    emitted = [tokens[i] for i in path[1:]] + [bonus]
    noun = "token" if len(emitted) == 1 else "tokens"
    out.append(f"This step emitted {len(emitted)} {noun} ({len(path) - 1} accepted + 1 bonus) with one forward "
               f"pass: {_snippet(enc.decode(emitted))}")
    if len(path) == 1:
        out.append("No guess was confirmed, yet the bonus token still makes the step as good as a plain one.")
    out.append("(Plain decoding needs one forward pass per token; tokens/step counts the bonus token.)")
    kept = ", ".join(f"[{i}]" for i in path)
    out.append(f"The KV cache keeps the slots of {kept} and drops the rest: it now holds {L + len(path)} tokens.")
    out.append(f"The bonus becomes the next root, and the heads read the hidden state at node [{path[-1]}]")
    out.append("to fill the next tree.")
    return "\n".join(out)
