"""`python -m medusa_mini.cli.measure --ckpt DIR`: measure again (train_tiny.py does after training), in
float32, how often the heads are accepted on greedy continuations of prompts.json, saved as
heads_accuracy.json, from which `decode.py --tree N` (and `auto`) builds trees; then under rejection
sampling: Σ min(p, q) per head, the chance that each head's r-th drawn candidate is the one accepted (saved
too: rejection sampling's trees), and with --marginal head 1's score were its q the exact marginal over the
root it cannot see."""

from __future__ import annotations

import math
import os
import sys

from ..io.files import check_writable
from ..io.loading import PROMPTS_FILE, load_for_decoding, prompt_ids
from ..sampling import SAMPLING_TEMPERATURE
from ..train import accuracy
from ..train.device import pick_device
from ..tree import build_tree
from .common import OneLineParser, seed


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_mini.cli.measure", description=__doc__)
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint directory (with prompts.json and a "
                   "tokenizer); its heads_accuracy.json is rewritten")
    p.add_argument("--prompts", type=int, default=32, help="prompts of prompts.json used (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="continuation length per prompt (default: 64)")
    p.add_argument("--top-k", type=int, default=10, help="ranks measured per head (default: 10)")
    p.add_argument("--temperature", type=float, default=SAMPLING_TEMPERATURE,
                   help=f"of the sampled continuations, p and q (default: {SAMPLING_TEMPERATURE:g})")
    p.add_argument("--seed", type=seed, default=0, help="seeds the sampled continuations (default: 0)")
    p.add_argument("--marginal", action="store_true", help="also head 1's score were its q the exact marginal "
                   "over the root it cannot see: a forward over the 64 likeliest roots at every 4th position (slower)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    a = p.parse_args(argv)
    try:  # everything checked before heads_accuracy.json is replaced
        for flag, value, least in (("--prompts", a.prompts, 1), ("--max-new-tokens", a.max_new_tokens, 3),
                                   ("--top-k", a.top_k, 1)):
            if value < least:
                raise ValueError(f"{flag} must be at least {least}, not {value}")
        if not 0 < a.temperature < math.inf:  # nan too
            raise ValueError(f"--temperature must be a finite number > 0, not {a.temperature}")
        ck = load_for_decoding(a.ckpt, device=pick_device(a.device))
        if ck.heads is None:
            raise ValueError(f"checkpoint {a.ckpt} has no Medusa heads; train heads first")
        prompts = prompt_ids(ck, count=a.prompts, max_new_tokens=a.max_new_tokens)
        try:
            check_writable(a.ckpt)
        except OSError as e:
            raise ValueError(f"{accuracy.ACCURACY_FILE} cannot be written in {a.ckpt} ({e.strerror})") from None
    except (ValueError, OSError) as e:
        p.error(str(e))
    lens, T = [len(ids) for ids in prompts], a.temperature
    greedy = accuracy.continuations(ck.model, prompts, max_new_tokens=a.max_new_tokens)
    top_k = min(a.top_k, ck.heads.draft_ids.numel())
    acc = accuracy.measure_head_accuracy(ck.model, ck.heads, greedy, prompt_lens=lens, top_k=top_k)
    sampled = accuracy.continuations(ck.model, prompts, max_new_tokens=a.max_new_tokens, temperature=T, seed=a.seed)
    accept = accuracy.measure_sampled_acceptance(ck.model, ck.heads, sampled, prompt_lens=lens, temperature=T)
    drawn = accuracy.measure_try_acceptance(ck.model, ck.heads, sampled, prompt_lens=lens, temperature=T,
                                            ranks=top_k, seed=a.seed)
    on = f"({a.max_new_tokens} new tokens) of the first {len(prompts)} prompts of {PROMPTS_FILE}"
    accuracy.save_accuracy(a.ckpt, acc, drawn=drawn, meta={
        "measured_on": f"greedy continuations {on}", "drawn_on": f"continuations sampled at T={T:g} {on}",
        "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens})

    def by_budget(table) -> str:
        return "  ".join(f"{n} nodes: {build_tree(table, n)[1]:.2f}" for n in (1, 2, 4, 8, 16, 32, 64))

    print(f"saved {os.path.join(a.ckpt, accuracy.ACCURACY_FILE)}\n{accuracy.format_accuracy(acc)}\n"
          f"expected tokens/step of build_tree (product rule, bonus token counted) by node budget:\n{by_budget(acc)}")
    print(f"rejection sampling at T={T:g}: each head's one drawn candidate is accepted with Σ min(p, q) = "
          + "  ".join(f"{v:.3f}" for v in accept.tolist()))
    print(f"drawn candidates at T={T:g}, accepted among each head's first r draws:\n"
          f"{accuracy.format_accuracy(drawn)}\nexpected tokens/step of rejection sampling's tree (drawn candidates) "
          f"by node budget:\n{by_budget(drawn)}")
    if a.marginal:
        score, covered = accuracy.measure_marginal_acceptance(ck.model, sampled, prompt_lens=lens, temperature=T)
        print(f"head 1 with q = the exact marginal over the root, what its training aims at: Σ min(p, q) = "
              f"{score:.3f} (the 64 likeliest roots, {covered:.0%} of the root's probability)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
