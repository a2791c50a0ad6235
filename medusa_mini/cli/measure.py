"""heads_accuracy.json, the heads' acceptance tables: measured, and made into the tree a run decodes with.

`python -m medusa_mini.cli.measure --ckpt DIR` measures them again in float32 with training's functions, on
continuations of prompts.json (train_tiny.py measures held-out text of its own: the figures differ a little): how often
each head's guesses are accepted on the greedy ones; under rejection sampling, Σ min(p, q) per head and how often its
r-th drawn candidate is accepted (rejection sampling's trees); --marginal: head 1's, its q the exact marginal.

decode.py's `--tree` (`resolve_tree`): a preset, choices (JSON, a file or inline), N (the table's best N-node tree)
or 'auto': 64 nodes on a GPU, on a CPU at most 8 that pay for themselves (`CPU_MIN_GAIN`); no table: the device's."""

import json
import os
import shlex
import sys
from typing import NamedTuple

import torch

from ..io.files import check_writable, read_json
from ..io.loading import PROMPTS_FILE, load_for_decoding, prompt_ids
from ..sampling import SAMPLING_TEMPERATURE
from ..train import accuracy
from ..train.device import pick_device
from ..tree import MAX_NODES, Tree, build_tree, preset
from .common import OneLineParser, at_least, exit_with, seed, temperature

# On two CPU cores a node adds 2.5-3.5% to a Medusa step of the cpu preset (bench_step.py --configs tiny), so a
# node worth less than that share of the tokens per step so far costs more than it adds. 2.5% gave four-head
# checkpoints 6 nodes (Medusa) and 4 (Hydra), the node-budget sweep's fastest (BENCHMARKS.md); five heads: 5.
CPU_MIN_GAIN = 0.025
HINT = 'a tree file holds [[0], [1], [0, 0], ...] or {"choices": [...]}'


class TreeChoice(NamedTuple):
    """The heads' tree, its name, and the nodes a step may verify (N, auto's ceiling, else the tree's own):
    prompt lookup's chain, which verifies only what it finds, so the heads' cost rule is not its own."""

    tree: Tree
    name: str
    budget: int


def resolve_tree(spec: str | None, *, ckpt_dir: str, device: torch.device | str, num_heads: int,
                 drawn: bool = False) -> TreeChoice:
    """The tree of a node budget N, 'auto', a preset, or choices inline or in a JSON file (the working
    directory's, else the checkpoint's). `drawn`: for rejection sampling's drawn candidates, whose budget trees
    grow from their own table: they pass far less often than top-1 guesses, so siblings beat depth."""
    gpu = torch.device(device).type != "cpu"
    measured = bool(ckpt_dir) and os.path.isfile(os.path.join(ckpt_dir, accuracy.ACCURACY_FILE))  # "": no folder
    default, spec = spec is None, ("auto" if measured else "gpu" if gpu else "cpu") if spec is None else spec
    count = spec.isascii() and spec.isdigit()  # a node budget ('²' is a digit to str.isdigit, not to int)
    inline, budget = spec.lstrip().startswith(("[", "{")), None  # budget None: a tree given whole, its own size
    if spec == "auto" or count:
        if count and not 1 <= int(spec) <= MAX_NODES:
            raise ValueError(f"--tree {spec}: a node budget must be between 1 and {MAX_NODES}")
        if not measured:
            raise ValueError(f"--tree {spec} needs heads accuracies: " + (
                f"run python -m medusa_mini.cli.measure --ckpt {shlex.quote(ckpt_dir)}" if ckpt_dir else
                "a checkpoint without a folder (--demo) has none; give a preset or choices"))
        budget, min_gain = (int(spec), 0.0) if count else (64, 0.0) if gpu else (8, CPU_MIN_GAIN)
        if (acc := accuracy.load_accuracy(ckpt_dir, drawn=drawn)) is None:
            acc = accuracy.load_accuracy(ckpt_dir)  # measured before drawn candidates had a table: greedy's stands in
        tree = build_tree(acc[:num_heads], budget, min_gain=min_gain)[0]  # it may describe more heads
    elif inline or spec.endswith(".json") or os.path.sep in spec:
        path = None if inline else next((p for p in (spec, os.path.join(ckpt_dir, spec)) if os.path.isfile(p)), None)
        if not inline and path is None:
            why = "is a folder" if os.path.isdir(spec) else "is no file" if os.path.exists(spec) else "does not exist"
            raise ValueError(f"tree file {spec} {why}")
        where, name = (f"--tree {spec}", "inline") if inline else (f"tree file {path}", os.path.basename(spec))
        try:
            obj = json.loads(spec) if inline else read_json(path, hint=HINT)  # read_json's errors: one line each
        except (json.JSONDecodeError, RecursionError) as e:  # the last: nested too deeply
            why = getattr(e, "msg", "nested too deeply")
            raise ValueError(f"{where}: not JSON ({why}); write choices as '[[0], [1], [0, 0]]'") from None
        choices = obj.get("choices") if isinstance(obj, dict) else obj
        if not isinstance(choices, list) or not choices:
            raise ValueError(f'{where} has no choices: it must hold a list of choices or {{"choices": [...]}}')
        try:
            tree, spec = Tree.from_choices(choices, num_heads=num_heads), name
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    else:
        try:
            tree = preset(spec).truncated(num_heads) if default else preset(spec)  # the device's: as deep as the heads
        except ValueError:
            raise ValueError(f"unknown --tree {spec!r}: give a node budget N (1 to {MAX_NODES}), auto, a preset (cpu, "
                             f"gpu, chainN, N from 1 to {MAX_NODES}), or choices in a JSON file or inline: '[[0], [1], "
                             "[0, 0]]'") from None
    tree.check_heads(num_heads, name=f"--tree {spec}", owner="the checkpoint")
    return TreeChoice(tree, spec, budget or max(tree.num_nodes - 1, 1))


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_mini.cli.measure", description=__doc__)
    p.add_argument("--ckpt", type=os.path.expanduser, required=True, metavar="DIR",
                   help="checkpoint folder (with prompts.json and a tokenizer); its heads_accuracy.json is rewritten")
    p.add_argument("--num-prompts", type=at_least(1), help="the first prompts of prompts.json used (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt, > the heads (default: 64)")
    p.add_argument("--top-k", type=at_least(1), default=10, help="ranks measured per head (default: 10)")
    p.add_argument("--temperature", type=temperature, default=SAMPLING_TEMPERATURE,
                   help=f"of the sampled continuations, p and q (default: {SAMPLING_TEMPERATURE:g})")
    p.add_argument("--seed", type=seed, default=0, help="seeds the sampled continuations (default: 0)")
    p.add_argument("--marginal", action="store_true", help="also head 1's score were its q the exact marginal "
                   "over the root it cannot see: a forward over the 64 likeliest roots at every 4th position (slower)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    a = p.parse_args(argv)
    with p.refusing(ValueError, OSError):  # everything checked before heads_accuracy.json is replaced
        ck = load_for_decoding(a.ckpt, device=pick_device(a.device))
        if ck.heads is None:
            raise ValueError(f"checkpoint {a.ckpt} has no Medusa heads; train heads first")
        if a.max_new_tokens <= (K := ck.heads.num_heads):  # else the last heads have no target: a table of zeros
            raise ValueError(f"--max-new-tokens {a.max_new_tokens}: give at least {K + 1}, one more than the heads")
        prompts = prompt_ids(ck, count=a.num_prompts, max_new_tokens=a.max_new_tokens)
        check_writable(a.ckpt, f"--ckpt {a.ckpt}", files=(accuracy.ACCURACY_FILE,))
    lens, T, top_k = [len(ids) for ids in prompts], a.temperature, min(a.top_k, ck.heads.draft_ids.numel())
    for flag, asked, got, what in (("--num-prompts", a.num_prompts or 0, len(prompts), f"{PROMPTS_FILE} gives"),
                                   ("--top-k", a.top_k, top_k, "the heads guess among")):
        if got < asked:  # measured on what there is, and said so: the saved table names its own sizes
            print(f"note: {flag} {asked}: {what} {got}; measuring those", file=sys.stderr)
    greedy = accuracy.continuations(ck.model, prompts, max_new_tokens=a.max_new_tokens)
    acc = accuracy.measure_head_accuracy(ck.model, ck.heads, greedy, prompt_lens=lens, top_k=top_k)
    sampled = accuracy.continuations(ck.model, prompts, max_new_tokens=a.max_new_tokens, temperature=T, seed=a.seed)
    accept = accuracy.measure_sampled_acceptance(ck.model, ck.heads, sampled, prompt_lens=lens, temperature=T)
    drawn = accuracy.measure_try_acceptance(ck.model, ck.heads, sampled, prompt_lens=lens, temperature=T,
                                            ranks=top_k, seed=a.seed)
    on = f"({a.max_new_tokens} new tokens) of the first {len(prompts)} prompts of {PROMPTS_FILE}"
    accuracy.save_accuracy(a.ckpt, acc, drawn=drawn, meta={
        "measured_on": f"greedy continuations {on}", "drawn_on": f"continuations sampled at T={T:g} {on}",
        "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens})
    print(f"saved {os.path.join(a.ckpt, accuracy.ACCURACY_FILE)}")
    for what, table in (("greedy continuations", acc), (f"drawn candidates, sampled at T={T:g}", drawn)):
        print(f"{what}:\n{accuracy.format_accuracy(table)}\nexpected tokens/step of its tree (product rule, bonus "
              "token counted) by node budget:\n"
              + "  ".join(f"{n} nodes: {build_tree(table, n)[1]:.2f}" for n in (1, 2, 4, 8, 16, 32, 64)))
    print(f"rejection sampling at T={T:g}: each head's one drawn candidate is accepted with Σ min(p, q) = "
          + "  ".join(f"{v:.3f}" for v in accept.tolist()))
    if a.marginal:
        score, covered = accuracy.measure_marginal_acceptance(ck.model, sampled, prompt_lens=lens, temperature=T)
        print(f"head 1 with q = the exact marginal over the root, what its training aims at: Σ min(p, q) = "
              f"{score:.3f} (the 64 likeliest roots, {covered:.0%} of the root's probability)")
    return 0


if __name__ == "__main__":
    exit_with(main)
