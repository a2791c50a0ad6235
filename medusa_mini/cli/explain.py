"""One Medusa decoding step, walked through in words: what each head guesses, what the tree looks like,
what the backbone says at every node, and which tokens the step keeps.

It calls the pieces medusa_generate runs, in the same order: prefill, the heads, then the parts of
`step.medusa_step` one by one (propose, verify, accept, keep_path), so what it prints is
what decoding does, not a retelling of it.
"""

from __future__ import annotations

import tiktoken
import torch
import torch.nn.functional as F

from ..decoding import prefill
from ..heads import MedusaHeads
from ..hydra import HydraContext, HydraHeads, heads_input
from ..model import GPT, KVCache
from ..sampling import Sampling
from ..step import choose_path, keep_path, propose, verify
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
    choice = logits.argmax(dim=-1).tolist()  # [N]
    out = ["At each node, the backbone's argmax = the token it would write after that node's path.",
           "If a child of the node holds exactly that token, the child's guess is confirmed.",
           "(A leaf has no child to confirm: its argmax can only be a bonus token.)"]
    args = [token_text(enc, c) for c in choice]
    w_tok = max(len("token"), *map(len, labels)) + 2
    w_arg = max(len("backbone argmax"), *map(len, args)) + 2
    out.append(f"{'node':<6}{'token':<{w_tok}}{'backbone argmax':<{w_arg}}confirms child")
    for i in range(tree.num_nodes):
        hit = next((c for c in tree.children[i] if toks[c] == choice[i]), None)
        mark = f"[{hit}] ✓" if hit is not None else ("- (leaf)" if not tree.children[i] else "none ✗")
        out.append(f"{f'[{i}]':<6}{labels[i]:<{w_tok}}{args[i]:<{w_arg}}{mark}")
    return out


def _sampled_scores(enc, tree: Tree, toks: list[int], labels: list[str], logits: torch.Tensor, drawn, *,
                    sampling: Sampling) -> list[str]:
    """Section 5 for the sampling rules: p of every candidate after its parent's path (and q, if drawn)."""
    p = sampling.probs(logits)  # [N, V]
    out = ["At each node, p = the backbone's distribution for the next token after that node's path.",
           "A candidate is judged by p at its parent: the column shows p(candidate)."]
    if drawn is not None:
        out.append("q(candidate) is the head's probability of drawing it; the first child tried is accepted")
        out.append("with probability min(1, p/q).")
    w_tok = max(len("token"), *map(len, labels)) + 2
    out.append(f"{'node':<6}{'token':<{w_tok}}{'p(token)':<10}" + ("q(token)" if drawn is not None else ""))
    for i in range(1, tree.num_nodes):
        par, d = tree.parents[i], tree.depth_list[i]
        row = f"{f'[{i}]':<6}{labels[i]:<{w_tok}}{p[par, toks[i]].item():<10.3f}"
        if drawn is not None:
            log_q, _ = drawn.for_children_of(par, d - 1)  # head d's q, or (hydra) the parent's own q
            row += f"{log_q[toks[i]].exp().item():.3f}"
        out.append(row)
    return out


@torch.no_grad()
def explain_step(
    model: GPT,
    heads: MedusaHeads | HydraHeads,
    enc: tiktoken.Encoding,
    prompt_ids: list[int],
    *,
    tree: Tree,
    sampling: Sampling = Sampling(),
    generator: torch.Generator | None = None,
) -> str:
    """Run one Medusa step after the prompt and describe every stage of it as text."""
    tree.check_heads(heads.num_heads)
    device, block = model.device, model.config.block_size
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    L = ids.numel()
    if L == 0 or L >= block:
        raise ValueError(f"the prompt must have 1 to {block - 1} tokens, not {L}")
    if L + tree.depth >= block:  # the deepest node's position id must stay inside the context
        tree = tree.truncated(max(block - 1 - L, 0))
    out: list[str] = ["One Medusa decoding step, in full", "================================="]
    out.append(f"Prompt ({L} tokens): {_snippet(enc.decode(prompt_ids))}")
    rule = "greedy" if sampling.greedy else f"{sampling.rule}, temperature {sampling.temperature:g}"
    out.append(f"Acceptance rule: {rule}")

    out.append(_header(1, "Prefill: the prompt goes through the backbone once"))
    # As in medusa_generate: slots past block_size hold the tree's nodes (positions stay inside).
    dtype = model.lm_head.weight.dtype
    cache = KVCache(model.config, max_len=block + tree.num_nodes, device=device, dtype=dtype)
    logits, hidden = prefill(model, ids, cache)
    root = sampling.choose(logits, generator)
    out.append(f"The KV cache now holds the {L} prompt tokens.")
    out.append(f"Backbone's top guesses for the next token: {_guesses(enc, logits, 3)}")
    how = "the argmax of" if sampling.greedy else "drawn from"
    out.append(f"Root token (the backbone's own next token, {how} these): {token_text(enc, root)}")
    out.append("The root is already certain: it is emitted now, before the first Medusa step.")

    out.append(_header(2, "Heads: guesses further ahead, from the same last hidden state"))
    head_logits = heads_input(heads, hidden, model)  # [K, V], or a HydraContext for dependent heads
    used = tree.top_k()
    if isinstance(head_logits, HydraContext):
        out.append("Dependent (hydra) heads: head k reads this hidden state and the k tokens before its guess")
        out.append("(the root, then the drafted path), so every node's children come from that node's own q,")
        out.append("filled depth by depth, one head call per depth (step 3).")
        first = heads.head_logits(1, hidden, torch.tensor([root], device=device), lm_head=model.lm_head,
                                  wte=model.transformer.wte)  # [V]
        if used:
            out.append(f"head 1 (2nd token after the root), reading the root: {_guesses(enc, first, used[0])}")
    for k in range(heads.num_heads if not isinstance(head_logits, HydraContext) else 0):
        shown = used[k] if k < len(used) else 0
        nth = _ordinal(k + 1)
        if shown == 0:
            out.append(f"head {k + 1} ({nth} token after the root): not used by this tree")
            continue
        out.append(f"head {k + 1} ({nth} token after the root): {_guesses(enc, head_logits[k], shown)}")
    out.append("The backbone alone would need one forward pass per token to check these one by one.")

    out.append(_header(3, f"Tree: {tree.num_nodes - 1} candidate nodes + the root"))
    tokens, drawn = propose(tree, root, head_logits, sampling=sampling, generator=generator)  # [N]
    labels = [token_text(enc, t) for t in tokens.tolist()]
    if drawn is None:
        if isinstance(head_logits, HydraContext):
            out.append("A node at depth d holds head d's guess of the listed rank, given the node's own path")
            out.append("(its siblings' paths differ, so its children may too); a path from the root is one")
        else:
            out.append("A node at depth d holds head d's guess of the listed rank; a path from the root is one")
    else:
        out.append("Rejection sampling draws the candidates: a node at depth d holds the r-th token drawn")
        whose = "its parent's own q" if drawn.rows is not None else "head d's distribution q"
        out.append(f"from {whose} (without replacement, r = its rank); a path from the root is one")
    out.append("possible continuation. All paths are checked together in the next pass.")
    out.append(tree.draw(labels))

    out.append(_header(4, "Tree attention mask"))
    out.append("Row = a node asking, column = a node it may look at (■ yes, · no). Every node also sees")
    out.append(f"all {L} cached prompt tokens, and sits at position {L} + its depth, as if its path were")
    out.append("the only continuation: a node sees itself and its ancestors, never its siblings.")
    out.append(tree.draw_mask())

    out.append(_header(5, "Verify: one forward pass over all nodes"))
    logits, hidden = verify(model, cache, tree, tokens)  # [N, V], [N, C]
    toks = tokens.tolist()
    if not sampling.greedy:
        out.extend(_sampled_scores(enc, tree, toks, labels, logits, drawn, sampling=sampling))
    else:
        out.extend(_greedy_scores(enc, tree, toks, labels, logits))

    out.append(_header(6, "Accept: a path of accepted candidates, plus a bonus token"))
    choice = choose_path(tree, tokens, logits, sampling=sampling, generator=generator, draft=drawn)
    keep_path(cache, choice, start=L)
    path, bonus = choice.to_host()
    if sampling.rule == "rejection" and drawn is not None:
        out.append("Rejection sampling: try a node's children in order, accepting x with probability")
        out.append("min(1, p(x)/q(x)) and moving p to norm(max(0, p - q)) after a miss (lossless).")
    elif sampling.rule == "rejection":
        out.append("Rejection sampling: at each node draw y from p; descend if a child holds y (lossless).")
    elif sampling.rule == "typical":
        out.append("Typical acceptance: keep a candidate whose probability clears min(ε, δ·exp(-H(p))).")
    else:
        out.append("Greedy: from the root, descend while the backbone's argmax is a child's token.")
    steps = [f"[{i}] {labels[i]}" + (" (root, already emitted)" if i == 0 else "") for i in path]
    out.append("accepted path: " + " → ".join(steps))
    out.append(
        f"bonus token:   {token_text(enc, bonus)}, the backbone's own next token after [{path[-1]}], "
        "free from the same pass"
    )

    out.append(_header(7, "Result"))
    emitted = [toks[i] for i in path[1:]] + [bonus]
    noun = "token" if len(emitted) == 1 else "tokens"
    out.append(
        f"This step emitted {len(emitted)} {noun} ({len(path) - 1} accepted + 1 bonus) with one forward pass: "
        f"{_snippet(enc.decode(emitted))}"
    )
    if len(path) == 1:
        out.append("No guess was confirmed, yet the bonus token still makes the step as good as a plain one.")
    out.append("(Plain decoding needs one forward pass per token; tokens/step counts the bonus token.)")
    kept = ", ".join(f"[{i}]" for i in path)
    out.append(f"The KV cache keeps the slots of {kept} and drops the rest: it now holds {int(cache.length)} tokens.")
    out.append(f"The bonus becomes the next root, and the heads read the hidden state at node [{path[-1]}]")
    out.append("to fill the next tree.")
    return "\n".join(out)
