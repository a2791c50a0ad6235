"""`decode.py --explain`: one Medusa step in words, run with reference.py's functions in the order its
`medusa_generate` calls them (the heads' proposer fills the tree), so the printed step is the file a learner reads;
`--demo` makes a model to explain on the spot. The tree and its mask drawn as text, here and by `--show`."""

import codecs
import contextlib
import io

import numpy as np
import tiktoken
import torch

from .. import reference as ref
from ..heads import HeadsConfig, MedusaHeads
from ..io.loading import Checkpoint
from ..io.tokenizer import make_encoding, train_bpe
from ..model import GPT, GPTConfig
from ..sampling import Sampling, scaled, typical_threshold
from ..train.data import get_batch
from ..training import MedusaLM
from ..tree import Tree

DEMO_NOTE = ("DEMO: a 2-layer model and its 4 heads trained for a few seconds on the Zen of Python, which they "
             "know by heart;\nreal heads are right less often. Train one with train_tiny.py for real figures.")
ROOM = 3  # new positions an explained step needs past the prompt: its root, a candidate, the bonus
RULES = {  # section 6 on each rule (decode.py's rejection sampling draws its candidates)
    "greedy": "Greedy: from the root, descend while the backbone's argmax is a child's token.",
    "typical": "Typical acceptance: keep a candidate whose probability clears min(ε, δ·exp(-H(p))).",
    "rejection": "Rejection sampling: try a node's children in order against r = p, accepting x with chance\n"
                 "min(1, r(x)/q(x)), q without the earlier draws; a miss makes r norm(max(0, r - q)) (lossless)."}


def token_text(enc: tiktoken.Encoding, token: int) -> str:
    """One token as a quoted literal, so spaces and newlines stay visible: ' the', '\\n'."""
    return repr(enc.decode_single_token_bytes(token).decode("utf-8", errors="replace"))


def _header(number: int, title: str) -> str:
    line = f"{number}. {title}"
    return f"\n{line}\n{'-' * len(line)}"


def _snippet(text: str, limit: int = 70) -> str:
    return repr(text if len(text) <= limit else "…" + text[-limit:])  # the end is where the next token comes from


def _guesses(enc: tiktoken.Encoding, logits: torch.Tensor, k: int, ids: torch.Tensor | None = None, *,
             temperature: float) -> str:  # the probabilities at the rule's temperature (greedy's argmax: at 1)
    top = torch.softmax(scaled(logits, temperature or 1.0), dim=-1).topk(k)  # a tiny T: near greedy's, not NaN
    pairs = zip(top.values.tolist(), (top.indices if ids is None else ids[top.indices]).tolist())
    return ", ".join(f"#{r} {token_text(enc, t)} ({p:.2f})" for r, (p, t) in enumerate(pairs))


def draw_tree(tree: Tree, labels: list[str] | None = None, *, rank: str = "rank") -> str:
    """The tree as indented text, one node a line: `[i] head d rank r label` (rank="draw": drawn candidates')."""
    labels = [f" {label}" for label in labels] if labels is not None else [""] * tree.num_nodes
    lines = [f"[0] root{labels[0]}"]

    def visit(node: int, prefix: str) -> None:
        for kid in tree.children[node]:
            branch, indent = ("└─ ", "   ") if kid == tree.children[node][-1] else ("├─ ", "│  ")
            lines.append(f"{prefix}{branch}[{kid}] head {tree.depths[kid]} {rank} {tree.ranks[kid]}{labels[kid]}")
            visit(kid, prefix + indent)
    visit(0, "")
    return "\n".join(lines)


def draw_mask(tree: Tree) -> str:
    """The N x N tree attention mask: row = query node, column = key node, ■ = may attend."""
    mask, N, w = tree.tensors().ancestor_mask, tree.num_nodes, len(str(tree.num_nodes - 1))
    return "\n".join([" " * (w + 1) + " ".join(f"{j:>{w}}" for j in range(N))] + [
        f"{i:>{w}} " + " ".join(f"{'■' if mask[i, j] else '·':>{w}}" for j in range(N)) for i in range(N)])


def verify_section(out: list[str], labels: list[str], tree: Tree, tokens: list[int], logits: torch.Tensor,
                   drawn, enc, *, sampling: Sampling) -> None:
    """Section 5: what the backbone says at every node: its argmax (greedy), or p (and q) of each candidate."""
    if sampling.greedy:
        y = logits.argmax(dim=-1).tolist()  # [N]
        rows = [["node", "token", "backbone argmax", "confirms child"]]
        for i, kids in enumerate(tree.children):
            hit = next((c for c in kids if tokens[c] == y[i]), None)
            rows.append([f"[{i}]", labels[i], token_text(enc, y[i]),
                         f"[{hit}] ✓" if hit is not None else "none ✗" if kids else "- (leaf)"])
        intro = ["At each node, the backbone's argmax = the token it would write after that node's path; a",
                 "child holding exactly that token is confirmed (a leaf's argmax can only be a bonus token)."]
    else:
        p, typical = sampling.probs(logits), sampling.acceptance == "typical"  # [N, V]
        bar = typical_threshold(p, epsilon=sampling.epsilon, delta=sampling.delta).tolist()  # [N]: §2.3.1's, per node
        rows = [["node", "token", "p(token)", "q(token)" if drawn is not None else "bar at its parent" * typical]]
        for i, par in enumerate(tree.parents[1:], start=1):
            last = f"{bar[par]:.3f}" * typical if drawn is None else f"{drawn[par][0][tokens[i]].exp().item():.3f}"
            rows.append([f"[{i}]", labels[i], f"{p[par, tokens[i]].item():.3f}", last])
        intro = ["At each node, p = the backbone's distribution for the token after that node's path; a",
                 "candidate is judged by p at its parent" + (
                     ", and passes above the bar min(ε, δ·exp(-H(p))) there." if typical else "." if drawn is None
                     else ", and by q, the head's probability of drawing it;\nafter an elder sibling's miss, by r, "
                     "what that miss left of p.")]
    widths = [max(len(row[c]) for row in rows) + 2 for c in range(len(rows[0]) - 1)]  # the last column as it is
    out += [_header(5, "Verify: one forward pass over all nodes"), *intro,
            *("".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) + row[-1] for row in rows)]


@torch.no_grad()
def explain_step(model: GPT, heads, enc: tiktoken.Encoding, prompt_ids: list[int], *, tree: Tree,
                 sampling: Sampling = Sampling(), generator: torch.Generator | None = None) -> str:
    """One Medusa step after a prompt of 1 to block_size - ROOM tokens (decode.py checks), every stage described."""
    block, L, T = model.config.block_size, len(prompt_ids), sampling.temperature
    tree, full = tree.truncated(block - 2 - L), tree  # the deepest node's position must stay inside the context
    out = ["One Medusa decoding step, in full", "=" * 33, f"Prompt ({L} tokens): {_snippet(enc.decode(prompt_ids))}",
           f"Acceptance rule: {'greedy' if sampling.greedy else f'{sampling.acceptance}, temperature {T:g}'}"]

    # 1. The prefill: the root, and the hidden state every head reads.
    cache = [None] * model.config.n_layer
    logits, hidden = ref.forward(model, prompt_ids, list(range(L)), cache, torch.ones(L, L, dtype=torch.bool).tril())
    root = int(sampling.next_token(logits[-1], sampling.uniforms((), generator, device=logits.device)))
    out += [_header(1, "Prefill: the prompt goes through the backbone once"),
            f"The KV cache now holds the {L} prompt tokens.",
            f"Backbone's top guesses for the next token: {_guesses(enc, logits[-1], 3, temperature=T)}",
            f"Root token (the backbone's own next token, {'the argmax of these' if sampling.greedy else 'drawn from p'}"
            f"): {token_text(enc, root)}",
            "The root is already certain: it is emitted now, before the first Medusa step."]

    # 2 (§2.1.1). Each head's top guesses, as many as the tree uses, after the top guesses before it.
    out += [_header(2, "Heads: guesses further ahead, from the same last hidden state"), heads.description,
            "The root is token t+1; head k guesses token t+k+1."]
    K, chain = heads.num_heads, [root]  # the top guesses so far: what dependent heads read
    for k in range(K):
        following = torch.tensor([chain + [root] * (K - len(chain))], device=hidden.device)  # [1, K]
        guesses = heads(hidden[-1:], model, following=following, num=k + 1)[k, 0]  # [M] head k's logits
        chain.append(int(heads.draft_ids[guesses.argmax()]))
        used = max((r + 1 for r, d in zip(tree.ranks, tree.depths) if d == k + 1), default=0)
        out.append(f"head {k + 1} (t+{k + 2}): "
                   + (_guesses(enc, guesses, used, heads.draft_ids, temperature=T) or "not used by this tree"))
    out.append("Plain decoding needs one forward pass per token; one pass below checks the whole tree.")

    # 3-4 (§2.1.2). The tree the heads' proposer fills, and its mask.
    proposer = heads.proposer(model, tree)
    proposal = proposer.propose(torch.tensor([root], device=hidden.device), hidden[-1:], history=[[root]],
                                sampling=sampling, u=proposer.uniforms(sampling, 1, generator, device=hidden.device))
    tokens, drawn = proposal.tokens[0].tolist(), (None if proposal.drawn is None else proposal.drawn.per_node(0))
    labels = [token_text(enc, t) for t in tokens]
    cut = f" (of {full.num_nodes - 1}: deeper ones would pass the context)" * (tree.num_nodes < full.num_nodes)
    out += [_header(3, f"Tree: {tree.num_nodes - 1} candidate nodes{cut} + the root"),
            ("A node at depth d holds head d's guess of the listed rank" if drawn is None else
             "Rejection sampling draws the candidates: a node at depth d, draw k, holds the token drawn after k\n"
             "others (without replacement) from the q its parent's children come from")
            + "; a path from the root is one possible\ncontinuation. All paths are checked together next.",
            draw_tree(tree, labels, rank="rank" if drawn is None else "draw"), _header(4, "Tree attention mask"),
            "Row = a node asking, column = a node it may look at (■ yes, · no). Every node also sees the",
            "cached prompt, and sits at position prompt length + its depth, as if its path were the only",
            "continuation: a node sees itself and its ancestors, never its siblings.", draw_mask(tree)]

    # 5. Verify every node in one forward pass.
    logits, _ = ref.verify(model, tokens, tree, cache, prefix=L)  # [N, V]
    verify_section(out, labels, tree, tokens, logits, drawn, enc, sampling=sampling)

    # 6-7. Accept a path and its bonus token; what the step emitted and the cache kept.
    path, bonus = ref.accept(tree.parents, tokens, logits, sampling=sampling, generator=generator, drawn=drawn)
    emitted = [tokens[i] for i in path[1:]] + [bonus]
    out += [_header(6, "Accept: a path of accepted candidates, plus a bonus token"), RULES[sampling.acceptance],
            "accepted path: " + " → ".join(f"[{i}] {labels[i]}" + " (root, already emitted)" * (i == 0) for i in path),
            f"bonus token:   {token_text(enc, bonus)}, the backbone's own next token after [{path[-1]}], free "
            "from the same pass", _header(7, "Result"),
            f"This step emitted {len(emitted)} token{'s' * (len(emitted) > 1)} ({len(path) - 1} accepted + 1 bonus) "
            f"with one forward pass: {_snippet(enc.decode(emitted))}"]
    if len(path) == 1:
        out.append("No guess was confirmed, yet the bonus token still makes the step as good as a plain one.")
    out += ["(Plain decoding needs one forward pass per token; tokens/step counts the bonus token.)",
            f"The KV cache keeps the slots of {', '.join(f'[{i}]' for i in path)} and drops the rest: it now "
            f"holds {L + len(path)} tokens.",
            f"The bonus becomes the next root; the heads read the hidden state at node [{path[-1]}] next."]
    return "\n".join(out)


def demo_checkpoint(*, device: torch.device, dtype: torch.dtype, steps: int = 300) -> tuple[Checkpoint, str]:
    """A 2-layer GPT and four Medusa heads that learn the Zen of Python (the `this` module) by heart in a
    few seconds (Medusa-2's joint loss, §2.2.2), so the heads are confident; and a prompt. Seeded."""
    with contextlib.redirect_stdout(io.StringIO()):  # its first import prints the text
        import this
    text = codecs.decode(this.s, "rot13")  # the module stores it in rot13
    enc = make_encoding(train_bpe(text, vocab_size=300))
    ids = np.array(enc.encode_ordinary(text))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=enc.n_vocab, block_size=128, n_layer=2, n_head=4, n_embd=64))
    heads = MedusaHeads(HeadsConfig(num_heads=4, n_embd=64, vocab_size=enc.n_vocab))
    module, threads = MedusaLM(model, heads), torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small gain nothing from threads, and lose much on a busy machine
    optimizer, gen = torch.optim.AdamW(module.parameters(), lr=3e-3), torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = get_batch(ids, batch_size=16, block_size=64, generator=gen)  # [16, 64] each
        loss, _ = module(x, y, lm_weight=1.0, heads_weight=0.5, decay=0.8)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    line = text.splitlines()[9]  # "Special cases aren't special enough to break the rules."
    model, heads = (m.eval().to(device=device, dtype=dtype) for m in (model, heads))
    return Checkpoint("(demo)", model, heads, enc, None, {}), line[: len(line) // 2].rstrip()
