"""Medusa next to its peers in transformers: one checkpoint, the same prompts, token budget and device.

    python benchmarks/peers.py --ckpt out/tiny --draft out/draft
    python benchmarks/peers.py --ckpt out/tiny --draft out/draft --json

A checkpoint directory is a GPT-2 directory, so transformers' GPT2LMHeadModel loads the very weights
medusa_mini decodes with. The end-of-text token stops nothing: every row generates exactly
--max-new-tokens tokens per prompt.

steps = forward passes of the big model after the first (the prefill, which in transformers' assisted
and prompt-lookup decoding also verifies the first draft); tokens/step = (new tokens - 1 per prompt) /
steps, bonus token counted, as decode.py --compare counts them.

The draft for assisted decoding shares the checkpoint's tokenizer:
    python train_tiny.py --tokenizer out/tiny --out out/draft --n-layer 1 --n-head 4 --n-embd 128 \
        --medusa 1 --heads-steps 0 --distill-prompts 64
Needs transformers: pip install -e ".[peers]".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.clock import at_least_one, timed  # noqa: E402
from medusa_mini.cli.common import OneLineParser, encode_prompt, pick_device  # noqa: E402
from medusa_mini.decoding import generate, medusa_generate  # noqa: E402
from medusa_mini.io.loading import load_for_decoding, load_prompts  # noqa: E402
from medusa_mini.io.tokenizer import load_tokenizer  # noqa: E402
from medusa_mini.sampling import Sampling  # noqa: E402
from medusa_mini.tune.trees import resolve_tree  # noqa: E402

INSTALL_HINT = 'transformers is not installed; pip install -e ".[peers]"'
WARMUP_TOKENS = 16
NOTE = ("steps = big-model forward passes after the first (the prefill); tokens/step = (new tokens - 1 per "
        "prompt) / steps,\nbonus token counted; ms/token = wall time of whole generate calls / new tokens, the "
        "fastest of --repeat runs in turns")

# (prompt ids, new tokens) -> (new token ids, steps)
Runner = Callable[[list[int], int], tuple[list[int], int]]


@dataclass
class Method:
    key: str
    label: str
    greedy: bool  # greedy rows must reproduce transformers greedy token for token
    run: Runner


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="peers.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/tiny", metavar="DIR", help="checkpoint directory (default: %(default)s)")
    p.add_argument("--draft", metavar="DIR", help="draft checkpoint for assisted decoding (no row without it)")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts from prompts.json (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per prompt (default: 128)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="sampling rows (default: 0.8)")
    p.add_argument("--seed", type=int, default=0, help="seeds every sampling row, per prompt (default: 0)")
    p.add_argument("--tree", metavar="N|NAME|FILE.json", help="Medusa tree as in decode.py (default: decode.py's)")
    p.add_argument("--lookup-tokens", type=int, default=10, metavar="N",
                   help="prompt_lookup_num_tokens for prompt-lookup decoding (default: 10)")
    p.add_argument("--draft-tokens", type=int, default=20, metavar="N",
                   help="num_assistant_tokens for assisted decoding, transformers' default (default: 20)")
    p.add_argument("--repeat", type=int, default=3, metavar="R",
                   help="runs of every generation, methods in turns; the fastest counts (default: %(default)s)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the rows and settings as one JSON object")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    try:
        at_least_one(a, "num_prompts", "max_new_tokens", "lookup_tokens", "draft_tokens", "threads", "repeat")
    except ValueError as e:
        p.error(str(e))
    if a.temperature <= 0:
        p.error(f"--temperature must be > 0 (it is the sampling rows' temperature), not {a.temperature}")


# ---- the rows ------------------------------------------------------------------------------------


class PassCounter:
    """Counts forward calls of one module: the big model, not the draft."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        module.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def load_hf(transformers, directory: str, *, device: torch.device):
    model = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    # generate() fills unset fields from the model's own config, so a None passed in would bring the
    # saved end token back: clear it at the source to generate exactly max_new_tokens tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def hf_runner(transformers, model, counter: PassCounter, *, pad_id: int, seed: int | None = None,
              assistant=None, **flags) -> Runner:
    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
        config = transformers.GenerationConfig(max_new_tokens=max_new_tokens, use_cache=True, pad_token_id=pad_id,
                                               eos_token_id=None, **flags)
        x = torch.tensor([ids], device=model.device)
        if seed is not None:  # transformers samples from torch's global generator
            torch.manual_seed(seed)
        before = counter.calls
        extra = {"assistant_model": assistant} if assistant is not None else {}
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config, **extra)
        return out[0, len(ids):].tolist(), counter.calls - before - 1

    return run


def mm_runner(ck, *, tree, medusa: bool, sampling: Sampling, seed: int) -> Runner:
    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
        gen = torch.Generator(device=ck.model.device).manual_seed(seed)
        common = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_id=None, generator=gen)
        if not medusa:
            tokens, stats = generate(ck.model, ids, **common)
        else:
            tokens, stats = medusa_generate(ck.model, ck.heads, ids, tree=tree, **common)
        return tokens, stats.steps

    return run


def load_draft(transformers, a: argparse.Namespace, *, ck, device: torch.device, need: int):
    if not os.path.isfile(os.path.join(a.draft, "config.json")):
        raise ValueError(f"--draft {a.draft} is not a checkpoint directory (no config.json)")
    mine, its = ck.enc, load_tokenizer(a.draft)
    if mine.n_vocab != its.n_vocab or any(
        mine.decode_single_token_bytes(i) != its.decode_single_token_bytes(i) for i in range(mine.n_vocab)
    ):
        raise ValueError(f"the draft {a.draft} has another tokenizer than {a.ckpt}; train it with "
                         f"--tokenizer {a.ckpt}")
    draft = load_hf(transformers, a.draft, device=device)
    if draft.config.n_positions < need:
        raise ValueError(f"the draft's context ({draft.config.n_positions}) is shorter than the {need} positions "
                         "the prompts and --max-new-tokens need")
    draft.generation_config.num_assistant_tokens = a.draft_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"  # the same budget on every prompt
    return draft


def build_methods(transformers, ck, a: argparse.Namespace, *, tree, device: torch.device,
                  need: int) -> tuple[list[Method], list[str]]:
    """The rows in table order, and notes on rows left out."""
    target = load_hf(transformers, a.ckpt, device=device)
    counter = PassCounter(target)
    pad = ck.eot_id if ck.eot_id is not None else 0  # only pads finished rows of a batch; here none
    t = a.temperature

    def hf(key: str, label: str, greedy: bool, **kw) -> Method:
        return Method(key, label, greedy, hf_runner(transformers, target, counter, pad_id=pad, **kw))

    def mm(key: str, label: str, acceptance: str | None, temperature: float) -> Method:
        sampling = Sampling(acceptance=acceptance, temperature=temperature)  # None: plain decoding at T
        run = mm_runner(ck, tree=tree, medusa=acceptance is not None, sampling=sampling, seed=a.seed)
        return Method(key, label, sampling.greedy, run)

    notes: list[str] = []
    methods = [hf("transformers_greedy", "transformers greedy", True, do_sample=False),
               hf("transformers_prompt_lookup", f"transformers prompt lookup ({a.lookup_tokens})", True,
                  do_sample=False, prompt_lookup_num_tokens=a.lookup_tokens)]
    if a.draft is None:
        notes.append("transformers assisted: skipped, no --draft given")
    else:
        draft = load_draft(transformers, a, ck=ck, device=device, need=need)
        methods.append(hf("transformers_assisted", f"transformers assisted ({a.draft_tokens})", True,
                          do_sample=False, assistant=draft))
    methods.append(mm("plain_greedy", "medusa_mini plain greedy", None, 0.0))
    if ck.heads is None:
        notes.append(f"Medusa rows: skipped, {a.ckpt} has no Medusa heads")
    else:
        methods += [mm("medusa_greedy", "medusa_mini Medusa greedy", "greedy", 0.0),
                    mm("medusa_typical", f"medusa_mini Medusa typical (T={t:g})", "typical", t),
                    mm("medusa_rejection", f"medusa_mini Medusa rejection (T={t:g})", "rejection", t)]
    methods += [hf("transformers_sampling", f"transformers sampling (T={t:g})", False, seed=a.seed,
                   do_sample=True, temperature=t, top_k=0, top_p=1.0),
                mm("plain_sampling", f"medusa_mini plain sampling (T={t:g})", None, t)]
    return methods, notes


# ---- timing and the table ------------------------------------------------------------------------


def benchmark(methods: list[Method], prompts: list[list[int]], *, max_new_tokens: int,
              device: torch.device, repeat: int = 1) -> list[dict]:
    """Every method on every prompt, `repeat` times; per generation the fastest time counts (noise on a
    shared machine only ever adds time) and the repeats must make the same tokens."""
    for m in methods:  # untimed: first calls pay for allocation and kernel selection
        m.run(prompts[0], min(max_new_tokens, WARMUP_TOKENS))
    runs: dict[str, list[tuple[list[int], int, float]]] = {m.key: [] for m in methods}
    for rep in range(repeat):
        for i, ids in enumerate(prompts):  # prompt-major: a load spike slows every row alike
            for m in methods:
                (tokens, steps), seconds = timed(device, partial(m.run, ids, max_new_tokens))
                if rep == 0:
                    runs[m.key].append((tokens, steps, seconds))
                    continue
                first = runs[m.key][i]
                if (tokens, steps) != first[:2]:
                    raise RuntimeError(f"{m.label} made other tokens on a repeat of prompt {i}: not reproducible")
                runs[m.key][i] = (tokens, steps, min(seconds, first[2]))
    base = runs[methods[0].key]
    rows = []
    for m in methods:
        res = runs[m.key]
        if any(len(tokens) != max_new_tokens for tokens, _, _ in res):
            raise RuntimeError(f"{m.label} did not generate exactly {max_new_tokens} tokens per prompt")
        new = len(res) * max_new_tokens
        steps = sum(s for _, s, _ in res)
        seconds = sum(sec for _, _, sec in res)
        differ = sum(tokens != b[0] for (tokens, _, _), b in zip(res, base))
        rows.append({
            "key": m.key, "method": m.label, "ms_per_token": 1000 * seconds / new, "steps": steps,
            "tokens_per_step": (new - len(res)) / steps if steps else 0.0, "new_tokens": new,
            "seconds": seconds, "identical_to_greedy": differ == 0 if m.greedy else None,
            "prompts_differing": differ if m.greedy else None, "tokens": [tokens for tokens, _, _ in res],
        })
    for row in rows:
        row["speedup"] = rows[0]["ms_per_token"] / row["ms_per_token"] if row["ms_per_token"] else 0.0
    return rows


def cpu_model() -> str:
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            return names[0]
    return platform.processor() or platform.machine()


def format_table(result: dict) -> str:
    head = f"{'method':<40}{'ms/token':>9}{'steps':>7}{'tokens/step':>13}{'speedup':>9}  same as greedy"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        same = r["identical_to_greedy"]
        same = "-" if same is None else "yes" if same else f"no ({r['prompts_differing']} prompts differ)"
        lines.append(f"{r['method']:<40}{r['ms_per_token']:>9.2f}{r['steps']:>7}{r['tokens_per_step']:>13.2f}"
                     f"{r['speedup']:>8.2f}x  {same}")
    f = result["facts"]
    lines += [
        "",
        f"torch {f['torch']}, transformers {f['transformers']}, device {f['device']}, threads {f['threads']}, "
        f"CPU {f['cpu']}",
        f"{f['prompts']} prompts, max-new-tokens {f['max_new_tokens']} (no end-token stop), tree {f['tree']} "
        f"({f['tree_nodes']} nodes incl. root), sampling T={f['temperature']:g}, seed {f['seed']}",
        f"speedup and 'same as greedy' are against transformers greedy;\n{result['note']}.",
        *result["notes"],
        f"command: {f['command']}",
    ]
    return "\n".join(lines)


def prepare_prompts(ck, a: argparse.Namespace) -> list[list[int]]:
    prompts = []
    for i, text in enumerate(load_prompts(a.ckpt)[: a.num_prompts], start=1):
        ids = encode_prompt(ck.enc, text, block_size=ck.block_size)
        if len(ids) + a.max_new_tokens > ck.block_size:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, and {len(ids)} + {a.max_new_tokens} new tokens "
                             f"exceed the context ({ck.block_size}); use --max-new-tokens {ck.block_size - len(ids)}"
                             " or less")
        prompts.append(ids)
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = sys.argv[1:] if argv is None else list(argv)
    a = parser.parse_args(args)
    check_args(parser, a)
    try:
        import transformers
    except ImportError:
        parser.error(INSTALL_HINT)
    transformers.logging.set_verbosity_error()  # progress bars and notices would bury the table
    transformers.logging.disable_progress_bar()
    try:
        device = pick_device(a.device)
        if a.threads is not None:
            torch.set_num_threads(a.threads)
        ck = load_for_decoding(a.ckpt, device=device)
        tree, tree_name = (None, None) if ck.heads is None else resolve_tree(
            a.tree, ckpt_dir=a.ckpt, device=device, num_heads=ck.heads.num_heads)
        prompts = prepare_prompts(ck, a)
        need = max(len(ids) for ids in prompts) + a.max_new_tokens
        methods, notes = build_methods(transformers, ck, a, tree=tree, device=device, need=need)
        rows = benchmark(methods, prompts, max_new_tokens=a.max_new_tokens, device=device, repeat=a.repeat)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: a row that broke the token budget
        parser.error(str(e))
    by_key = {r["key"]: r for r in rows}
    if by_key["plain_greedy"]["identical_to_greedy"] is False:
        notes.append("WARNING: medusa_mini plain greedy differs from transformers greedy on the same weights: "
                     "check the checkpoint format (or near-tied logits)")
    facts = {
        "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "prompts": len(prompts),
        "max_new_tokens": a.max_new_tokens, "tree": tree_name, "tree_nodes": tree.num_nodes if tree else None,
        "temperature": a.temperature, "seed": a.seed, "lookup_tokens": a.lookup_tokens, "repeat": a.repeat,
        "draft": a.draft, "draft_tokens": a.draft_tokens if a.draft else None,
        "command": "python benchmarks/peers.py " + shlex.join(args),
    }
    result = {"rows": rows, "facts": facts, "notes": notes, "note": NOTE}
    print(json.dumps(result) if a.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
