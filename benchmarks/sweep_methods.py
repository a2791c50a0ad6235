"""The node-budget sweep's methods and their measurement (benchmarks/sweep.py prints and draws them).

A method is one way to decode the sweep's prompts: plain decoding under an acceptance rule's
sampling (the baseline, measured once per rule), or Medusa under that rule with a tree of a budget:

- a static tree of budget N is build_tree(acc, N) from heads_accuracy.json: the greedy table, and for
  rejection sampling the table measured under sampling when there is one (as `decode.py --tree N`);
  it comes with the tokens per step the table expects;
- a dynamic tree of budget N is tune/trees.py's `dynamic:N` (`decode.py --tree dynamic:N`): every
  step keeps its N most confident candidates (medusa_mini/dynamic.py).

Rejection sampling drafts the heads' top-k candidates by default (`draft="topk"`, lossless too), the
drafts a dynamic tree can rank. With `draft="sampled"` (what `decode.py` draws by default) the
rejection rows are static trees only: a dynamic tree keeps its fixed tree for drawn drafts, so its
rows would repeat the static ones, and the sampled table's expectation describes exactly these drafts. Every method decodes every prompt `repeat` times, methods taking turns
prompt by prompt, and the fastest run of each counts, as `decode.py --compare` times its rows.
Each prompt has its own seeded generator, the same for every method.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from medusa_mini.cli.compare import generate_once
from medusa_mini.decoding import GenerationStats
from medusa_mini.dynamic import DynamicTree
from medusa_mini.io.loading import Checkpoint
from medusa_mini.sampling import Sampling
from medusa_mini.tree import Tree, build_tree
from medusa_mini.tune.acceptance_tables import (
    ACCURACY_FILE,
    load_accuracy,
    load_greedy_ranks,
    sampled_temperature,
)
from medusa_mini.tune.replay import greedy_ranks, replay_ceiling, replay_greedy
from medusa_mini.tune.trees import dynamic_trees

RULES = ("greedy", "rejection")
TREE_KINDS = ("static", "dynamic")
Runs = list[tuple[list[int], GenerationStats]]  # per prompt: the new tokens and the fastest run's statistics


def rule_sampling(rule: str, *, temperature: float, draft: str = "topk") -> Sampling:
    """The sampling a rule's rows decode with: greedy, or rejection sampling at T with `draft` drafts."""
    if rule == "greedy":
        return Sampling()
    return Sampling(acceptance="rejection", temperature=temperature, draft=draft)


@dataclass(frozen=True)
class Tables:
    """heads_accuracy.json's tables: the greedy acc [K, R], its rank strings (None when not stored),
    and the table measured under sampling with its temperature (None, None when there is none)."""

    acc: torch.Tensor
    ranks: list[str] | None
    sampled: torch.Tensor | None
    sampled_temperature: float | None

    def describe(self, *, draft: str = "topk") -> str:
        greedy = "greedy table" + (" (expected = replayed on its greedy continuations)" if self.ranks
                                   else " (product rule)")
        if self.sampled is None:
            return f"{ACCURACY_FILE}, {greedy}; no sampled table: rejection trees from the greedy table, no expectation"
        rows = "as the rejection rows draw them" if draft == "sampled" else "the rejection rows draft the top-k"
        return (f"{ACCURACY_FILE}, {greedy}; sampled table at T={self.sampled_temperature:g} (product rule; "
                f"it describes drafts drawn from q, {rows})")


def load_tables(ckpt_dir: str, *, num_heads: int) -> Tables:
    """The tables both kinds of tree are built from; a one-line ValueError when they are missing,
    describe more heads than the checkpoint has, or build no tree at all."""
    acc = load_accuracy(ckpt_dir)  # its error says how to measure it
    if acc.shape[0] > num_heads:
        raise ValueError(f"{ACCURACY_FILE} describes {acc.shape[0]} heads but the checkpoint has {num_heads}; "
                         f"recompute it with python -m medusa_mini.cli.measure --ckpt {ckpt_dir}")
    if build_tree(acc, 1)[0].num_nodes == 1:  # no node has a nonzero value: every tree is the root alone
        raise ValueError(f"{ACCURACY_FILE}: no head's top guess was ever right on the greedy continuations, so "
                         "every tree is the root alone; train the heads, then measure again")
    t = sampled_temperature(ckpt_dir)
    sampled = load_accuracy(ckpt_dir, sampled=True) if t is not None else None
    return Tables(acc, load_greedy_ranks(ckpt_dir), sampled, t)


@dataclass(frozen=True)
class Method:
    """One way to decode the prompts: `tree_kind` None is plain decoding (no tree, budget 0)."""

    tree_kind: str | None
    rule: str
    budget: int
    sampling: Sampling
    tree: Tree | DynamicTree | None = None
    expected: float | None = None  # tokens per step the accuracy table promises (static trees)

    @property
    def key(self) -> str:
        return f"plain {self.rule}" if self.tree_kind is None else f"{self.tree_kind} {self.rule} {self.budget}"

    @property
    def verified_nodes(self) -> int:
        """Candidates each step verifies, root excluded (a table with few nonzero entries builds fewer
        than the budget)."""
        if self.tree is None:
            return 0
        return self.tree.budget if isinstance(self.tree, DynamicTree) else self.tree.num_nodes - 1


def static_method(tables: Tables, *, rule: str, budget: int, sampling: Sampling) -> Method:
    """build_tree of `budget` nodes from the rule's table, with its expected tokens per step."""
    if rule == "greedy":
        tree, expected = build_tree(tables.acc, budget)
        if tables.ranks is not None:  # exact on the measured continuations, not the product rule
            expected = replay_greedy(tables.ranks, tree)
    elif tables.sampled is not None:
        tree, expected = build_tree(tables.sampled, budget)
    else:  # the greedy table's tree, but it promises nothing about rejection sampling
        tree, expected = build_tree(tables.acc, budget)[0], None
    return Method("static", rule, budget, sampling, tree, expected)


def sweep_methods(
    ckpt_dir: str, *, tables: Tables, budgets: tuple[int, ...], rules: tuple[str, ...], kinds: tuple[str, ...],
    temperature: float, num_heads: int, device: torch.device, draft: str = "topk",
) -> list[Method]:
    """Plain decoding once per rule, then per rule and budget a static and a dynamic tree (of `kinds`);
    rejection sampling with drawn drafts (`draft="sampled"`) gets static trees only."""
    methods = [Method(None, rule, 0, rule_sampling(rule, temperature=temperature, draft=draft)) for rule in rules]
    for rule in rules:
        sampling = rule_sampling(rule, temperature=temperature, draft=draft)
        for n in budgets:
            if "static" in kinds:
                methods.append(static_method(tables, rule=rule, budget=n, sampling=sampling))
            if "dynamic" in kinds and not sampling.draws_candidates:
                trees = dynamic_trees(f"dynamic:{n}", base=None, ckpt_dir=ckpt_dir, device=device,
                                      num_heads=num_heads)
                methods.append(Method("dynamic", rule, n, sampling, trees.for_rule(sampling)))
    for m in methods:
        if m.tree is not None:
            m.tree.check_heads(num_heads)
    return methods


def measure(
    ck: Checkpoint, methods: list[Method], prompts: list[list[int]], *, max_new_tokens: int, repeat: int, seed: int,
) -> tuple[dict[str, Runs], set[str]]:
    """Every method on every prompt, `repeat` times in turns; per method key its per-prompt runs (the
    fastest of the repeats), and the keys whose repeats made different tokens (the first run's kept).

    The end-of-text token is ignored, so every row writes max_new_tokens per prompt."""
    ck = dataclasses.replace(ck, eot_id=None)

    def once(m: Method, i: int, n: int) -> tuple[list[int], GenerationStats]:
        return generate_once(ck, prompts[i], method="plain" if m.tree is None else "medusa", sampling=m.sampling,
                             tree=m.tree, seed=seed + i, max_new_tokens=n)

    for m in methods:  # untimed: the first calls pay for allocation, kernel setup and tree tensors
        once(m, 0, min(8, max_new_tokens))
    # Prompt-major, every method once per round: a load spike on a shared machine slows every method
    # alike, and the fastest of the repeats is the one it did not touch.
    runs: dict[str, Runs] = {m.key: [] for m in methods}
    unsteady: set[str] = set()
    for i in range(len(prompts)):
        best: dict[str, tuple[list[int], GenerationStats]] = {}
        for _ in range(repeat):
            for m in methods:
                tokens, stats = once(m, i, max_new_tokens)
                if m.key in best and best[m.key][0] != tokens:  # seeded: the same tokens, or we say so
                    unsteady.add(m.key)
                    tokens = best[m.key][0]
                if m.key not in best or stats.seconds < best[m.key][1].seconds:
                    best[m.key] = (tokens, stats)
        for key, result in best.items():
            runs[key].append(result)
    return runs, unsteady


def speed(runs: Runs) -> dict:
    """Tokens, steps and speed of a method's per-prompt runs (times include the prefill)."""
    steps = sum(st.steps for _, st in runs)
    new = sum(len(tokens) for tokens, _ in runs)
    seconds = sum(st.seconds for _, st in runs)
    ms_per_token = 1000 * seconds / max(new, 1)
    return {"new_tokens": new, "steps": steps, "ms_per_token": ms_per_token,
            "tokens_per_s": 1000 / ms_per_token if ms_per_token > 0 else 0.0,
            "ms_per_step": 1000 * seconds / max(steps, 1),
            "tokens_per_step": sum(sum(st.step_tokens) for _, st in runs) / max(steps, 1)}


def tree_row(m: Method, runs: Runs, *, plain: dict, plain_greedy: Runs | None) -> dict:
    """One row of the sweep: a tree kind, rule and budget, measured; `plain` is speed() of the plain
    decoder of the same rule; `plain_greedy`: its runs, which a greedy row must reproduce."""
    row = {"tree": m.tree_kind, "rule": m.rule, "nodes": m.budget, "verified_nodes": m.verified_nodes,
           "expected_tokens_per_step": m.expected, **speed(runs)}
    row["speedup"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] > 0 else 0.0
    row["same_as_plain_greedy"] = row["prompts_same_as_plain_greedy"] = None
    if m.rule == "greedy" and plain_greedy is not None:
        same = sum(out == ref for (out, _), (ref, _) in zip(runs, plain_greedy))
        row["prompts_same_as_plain_greedy"] = same
        row["same_as_plain_greedy"] = same == len(plain_greedy) == len(runs)
    return row


def greedy_ceiling(ck: Checkpoint, prompts: list[list[int]], plain_greedy: Runs) -> float:
    """The most tokens per step any tree of the heads' top-10 guesses, fixed or dynamic, could make on
    these prompts: the heads' ranks along plain greedy's continuations (which every greedy row
    writes), replayed by replay.replay_ceiling. What choosing nodes could still win."""
    seqs = [p + tokens for p, (tokens, _) in zip(prompts, plain_greedy)]
    ranks = greedy_ranks(ck.model, ck.heads, seqs, prompt_lens=[len(p) for p in prompts])
    return replay_ceiling(ranks)


def best_per_rule(rows: list[dict]) -> dict[str, dict]:
    """Per rule, the row with the most measured tokens per second (its tree, budget, speed)."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["rule"] not in best or r["tokens_per_s"] > best[r["rule"]]["tokens_per_s"]:
            best[r["rule"]] = {k: r[k] for k in ("tree", "nodes", "tokens_per_s", "speedup", "tokens_per_step")}
    return best


def run_sweep(
    ck: Checkpoint, methods: list[Method], prompts: list[list[int]], *, max_new_tokens: int, repeat: int, seed: int,
) -> dict:
    """Measure `methods` and gather rows: the plain baselines per rule, one row per tree, the best per rule."""
    if not prompts:
        raise ValueError("the sweep needs at least one prompt")
    runs, unsteady = measure(ck, methods, prompts, max_new_tokens=max_new_tokens, repeat=repeat, seed=seed)
    plain = {m.rule: {"rule": m.rule, **speed(runs[m.key]), "repeats_differ": m.key in unsteady}
             for m in methods if m.tree_kind is None}
    rows = [{**tree_row(m, runs[m.key], plain=plain[m.rule], plain_greedy=runs.get("plain greedy")),
             "repeats_differ": m.key in unsteady} for m in methods if m.tree_kind is not None]
    ceiling = greedy_ceiling(ck, prompts, runs["plain greedy"]) if "plain greedy" in runs else None
    return {"plain": plain, "rows": rows, "best": best_per_rule(rows), "greedy_ceiling": ceiling, "num_prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "repeat": repeat}
