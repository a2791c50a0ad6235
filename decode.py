"""Generate text from a checkpoint with plain or Medusa decoding; show the steps, explain one, or compare.

    python decode.py                      # Medusa, greedy, on the checkpoint's held-out prompts
    python decode.py --show               # the tree, then each forward pass's tokens in their own colour
    python decode.py --explain [--demo]   # one Medusa step, stage by stage (--demo: no checkpoint needed)
    python decode.py --compare            # plain, prompt lookup and Medusa: tokens/step, step cost, speedup
    python decode.py --compare --batch-size 1,2,4,8,16   # where batching ends Medusa's speedup
    python decode.py --reference          # the same tokens from reference.py, the readable decoder

Tokens/step counts the bonus token (the verify pass's own next token). Bad input: one line, exit status 2."""

import argparse
import codecs
import functools
import json
import os
import shlex
import sys
from dataclasses import replace
from typing import Callable

import tiktoken
import torch

from medusa_mini.cli.common import OneLineParser, at_least, check_plot_path, exit_with, numbers, seed, timed
from medusa_mini.cli.compiled import compile_steps, static_caches, warm_up, with_aligned_head
from medusa_mini.cli.explain import DEMO_NOTE, ROOM, demo_checkpoint, draw_mask, draw_tree, explain_step
from medusa_mini.cli.measure import resolve_tree
from medusa_mini.cli.runs import Engine, Method, compare, decode, format_table, plot_batch
from medusa_mini.io.loading import PROMPTS_FILE, load_for_decoding, load_prompts
from medusa_mini.proposal import PromptLookup
from medusa_mini.sampling import ACCEPTANCE_RULES, SAMPLING_TEMPERATURE, Sampling
from medusa_mini.train.device import DTYPES, pick_device, pick_dtype
from medusa_mini.train.state import STATE_FILE
from medusa_mini.tree import chain

NUM_PROMPTS, MAX_NEW_TOKENS = 8, 128  # the defaults, filled in after the checks: --explain refuses either given
BATCH_ROWS = ("plain_greedy", "medusa_greedy", "plain_sampling", "medusa_rejection")  # --compare's batch table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every impossible setting refused before any loading; batch sizes and sampling filled in."""
    p = OneLineParser(prog="decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=os.path.expanduser, metavar="DIR", help="checkpoint directory (default: out/tiny)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="repeat for several (default: prompts.json)")
    p.add_argument("--num-prompts", type=at_least(1), metavar="N",
                   help=f"the first N prompts (default: every --prompt, {NUM_PROMPTS} of prompts.json)")
    p.add_argument("--max-new-tokens", type=at_least(1), metavar="N", help=f"per prompt (default: {MAX_NEW_TOKENS})")
    p.add_argument("--method", choices=("plain", *ACCEPTANCE_RULES), help="plain: one forward pass "
                   "per token; else Medusa with that acceptance rule (default: greedy at T = 0, else rejection)")
    p.add_argument("--temperature", type=float, metavar="T",
                   help=f"0 = greedy (default: 0, or {SAMPLING_TEMPERATURE} for typical and rejection)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--seed", type=seed, default=0, metavar="N", help="seeds the sampling generator, anew for each "
                   "batch of prompts: a prompt given twice in two batches samples the same text (default: 0)")
    p.add_argument("--tree", type=os.path.expanduser, metavar="N|auto|NAME|FILE.json", help="N nodes built from "
                   "heads_accuracy.json; auto: 64 of them on CUDA, on a CPU up to 8 that pay for their cost; a preset "
                   "(cpu, gpu, chainN); or choices, in a JSON file or inline: '[[0],[1],[0,0]]' (default: auto, else "
                   "the device's preset)")
    p.add_argument("--batch-size", type=numbers(1, 4096), default="1", metavar="B",  # --compare fills B rows
                   help="prompts per batch; with --compare a list: 1,2,4,8 (default: 1)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="weights and KV cache (default: float32)")
    p.add_argument("--compile", action="store_true", help="compile the plain step and Medusa's (verify, acceptance, "
                   "the next tree's draft): CUDA graphs on a GPU; on a CPU minutes of compiling for little gain")
    p.add_argument("--reference", action="store_true", help="decode with reference.py (with --compare: add its rows)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--show", action="store_true", help="print the tree and its mask, then each pass's tokens")
    mode.add_argument("--explain", action="store_true", help="walk through one Medusa step on the first prompt")
    mode.add_argument("--compare", action="store_true", help="table: plain, prompt lookup and Medusa decoding")
    p.add_argument("--demo", action="store_true", help="with --explain: a tiny model trained on the spot")
    p.add_argument("--plot", type=os.path.expanduser, metavar="FILE.png",
                   help="with --compare --batch-size B1,B2,...: draw the table")
    p.add_argument("--json", action="store_true", help="JSON lines per prompt (with --compare: one object; "
                   "with --batch-size B, a row's seconds are its whole batch's)")
    a = p.parse_args(argv)
    a.batch_sizes, samples = list(a.batch_size), a.method in ("typical", "rejection")  # Medusa's sampling rules
    a.batch_size, a.batch_table = a.batch_sizes[0], a.compare and a.batch_sizes != [1]
    for wrong, message in (
        (a.compare and a.max_new_tokens == 1, "--compare needs --max-new-tokens 2 or more: the prefill makes one"),
        (a.explain and (a.max_new_tokens or a.num_prompts or len(a.prompt or []) > 1), "--explain walks through one "
         "step on one prompt: leave out --max-new-tokens and --num-prompts, give one --prompt at most"),
        (a.compare and a.method, "--compare decodes with every method: leave out --method"),
        (a.method == "plain" and (a.explain or a.reference), "--explain and --reference decode with Medusa heads"),
        (a.method == "plain" and a.tree is not None, "--method plain verifies no tree: leave out --tree"),
        (len(a.batch_sizes) > 1 and not a.compare, "--batch-size takes one size; a list goes with --compare"),
        (a.json and (a.show or a.explain), "--json cannot be combined with --show or --explain"),
        (a.batch_size > 1 and (a.show or a.reference or a.explain),
         "--batch-size decodes several prompts at once; --show, --reference and --explain take one at a time"),
        (a.demo and not a.explain, "--demo goes with --explain: python decode.py --explain --demo"),
        (a.demo and a.ckpt is not None, "--demo trains a model of its own: leave out --ckpt"),
        (a.plot is not None and not a.batch_table, "--plot draws the batch table: add --compare --batch-size 1,2,4"),
        (a.reference and a.batch_table, "--reference adds rows to the one-batch table: leave out the batch sizes"),
        (a.show and a.reference, "--show marks the engine's passes; reference.py returns its tokens at once"),
        (0 < a.top_p < 1 and not a.temperature and not a.compare and not samples,
         "--top-p filters what is sampled: add --temperature > 0 (greedy decoding samples nothing)"),
        (a.compare and a.temperature == 0, "--compare samples its sampled rows at --temperature: give T > 0 "
                                           f"(default {SAMPLING_TEMPERATURE}); its greedy rows are T = 0"),
        (samples and a.temperature == 0,
         f"--method {a.method} samples: give --temperature > 0, or use --method greedy"),
        (a.explain and (a.compile or a.reference), "--explain runs the reference's functions: leave out --compile "
                                                   "and --reference"),
        (a.reference and a.compile and not a.compare, "--reference decodes with reference.py, never compiled: leave "
                                                      "out --compile")):
        if wrong:
            p.error(message)
    a.ckpt = "out/tiny" if a.ckpt is None else a.ckpt  # no default above: --demo refuses a --ckpt given
    a.max_new_tokens = a.max_new_tokens or MAX_NEW_TOKENS
    a.temperature = (SAMPLING_TEMPERATURE if samples or a.compare else 0.0) if a.temperature is None else a.temperature
    rule = None if a.compare or a.method == "plain" else a.method  # --compare makes its own rows
    try:  # every sampling setting is checked here, once; plain decoding reads only T and top-p
        a.sampling = Sampling(acceptance=rule, temperature=a.temperature, top_p=a.top_p)
        if a.plot is not None:
            check_plot_path(a.plot)
    except ValueError as e:  # the library names a setting as Sampling does: name its flag instead
        head, _, rest = str(e).partition(" ")
        message = f"--{head.replace('_', '-')} {rest}" if head in ("temperature", "top_p") else str(e)
        p.error(message.replace("greedy acceptance", "--method greedy"))
    return a


def prepare(a: argparse.Namespace) -> tuple:
    """(checkpoint, TreeChoice, --compare's for drawn candidates, [(text, ids)]); a ValueError before any output."""
    dtype = pick_dtype(a.dtype, device := pick_device(a.device))
    if a.demo:  # the tree and prompts are checked on the untrained demo first, not after seconds of training
        ck, text = demo_checkpoint(device=device, dtype=dtype, steps=0)
    else:
        ck = load_for_decoding(a.ckpt, device=device, dtype=dtype)
    # A stopped run's last save has no prompts yet: said once, in a missing file's error or in a note at the end.
    unfinished = not a.demo and os.path.isfile(os.path.join(ck.directory, STATE_FILE)) and (
        f"{a.ckpt} holds an unfinished run, as last saved: python train_tiny.py --out {shlex.quote(ck.directory)} "
        "--resume, with the flags it began with, finishes it")
    # Prompts before heads: the missing heads' advice (--method plain) needs prompts too.
    hint = f"{unfinished}; or pass --prompt TEXT" if unfinished else "pass prompts with --prompt TEXT"
    texts = a.prompt or ([text] if a.demo else load_prompts(a.ckpt, hint=hint))
    texts = texts[: a.num_prompts or (len(texts) if a.prompt else NUM_PROMPTS)]  # --num-prompts takes the first N
    if not a.demo and len(texts) < (a.num_prompts or 0):  # fewer given or stored than asked for: say so
        print(f"note: {'--prompt gives' if a.prompt else PROMPTS_FILE + ' holds'} {len(texts)} prompt"
              f"{'s' * (len(texts) != 1)}, not {a.num_prompts}: decoding those", file=sys.stderr)
    medusa = a.method != "plain"  # --compare takes no --method, --explain refuses plain
    if ck.heads is None and medusa:
        plain_runs = not (a.compare or a.explain or a.reference)  # each of these decodes with heads
        raise ValueError(f"{a.ckpt} has no Medusa heads: train heads" + ", or use --method plain" * plain_runs)
    if a.reference and ck.heads.reads_the_draft:
        raise ValueError(f"--reference decodes with Medusa heads, not {ck.heads.name} heads: leave it out here")
    choice = drawn = None
    if medusa:  # plain decoding verifies no tree
        tree_for = functools.partial(resolve_tree, a.tree if a.tree is not None else "cpu" if a.demo else None,
                                     num_heads=ck.heads.num_heads, ckpt_dir="" if a.demo else a.ckpt, device=device)
        choice = tree_for(drawn=a.sampling.draws_candidates and not a.compare)
        drawn = tree_for(drawn=True) if a.compare else choice  # --compare's rejection row draws: its own tree
        for tree, name in {choice.tree: choice.name, drawn.tree: drawn.name}.items():
            try:  # a tree the heads cannot fill fails here
                ck.heads.proposer(ck.model, tree)
            except ValueError as e:
                raise ValueError(f"--tree {a.tree if a.tree is not None else name}: {e}") from None
    prompts, room = [], ROOM if a.explain else 2 if a.compare else 1  # new positions past a prompt (--compare: two)
    for i, text in enumerate(texts, start=1):
        which = f"prompt {i} ({'--prompt' if a.prompt else PROMPTS_FILE})"
        if any("\ud800" <= c <= "\udfff" for c in text):  # bytes a command line held that are not UTF-8, escaped
            raise ValueError(f"{which} is not UTF-8 text: give it in UTF-8")
        if not (ids := ck.enc.encode_ordinary(text)):
            raise ValueError(f"{which} is empty; give some text with --prompt")
        if len(ids) > ck.block_size - room:
            raise ValueError(f"{which} is {len(ids)} tokens long but the context holds {ck.block_size}; "
                             f"shorten it to at most {ck.block_size - room} tokens")
        prompts.append((text, ids))
    if unfinished:  # decoding goes ahead: every check has passed
        print(f"note: {unfinished}", file=sys.stderr)
    if a.demo:  # the same tokenizer and shapes, trained
        print("training the demo model and its heads (10-30 s on two CPU cores)...", file=sys.stderr)
        ck, _ = demo_checkpoint(device=device, dtype=dtype)
    return ck, choice, drawn, prompts


def compiled(engine: Engine, methods: list[Method], a: argparse.Namespace, prompts: int) -> Callable[[int], float]:
    """Compile the steps; warm(B) warms up every shape B rows at a time meet, before B's timing; returns its seconds."""
    model = engine.ck.model = with_aligned_head(engine.ck.model)  # this run's every step and prefill
    engine.steps, engine.caches = compile_steps(model.device), static_caches(model)
    # what fills each tree (prompt lookup: a chain), under which rule
    proposers = [(m.drafter.proposer(model, m.tree), m.sampling) for m in methods if m.drafter and not m.reference]
    n = max(max(a.batch_sizes), prompts) if a.batch_table else prompts  # the batch table cycles the prompts
    plain, warmed = {m.sampling for m in methods if m.drafter is None}, set()  # plain decoding's rules; rows warmed

    def warm(B: int) -> float:
        seconds = 0.0
        for rows in {min(B, n), n % B} - {0} - warmed:  # B at a time: the last batch is smaller
            seconds += warm_up(model, engine.steps, engine.caches, rows=rows, plain=plain, proposers=proposers)
            warmed.add(rows)
        what = " and ".join(["the plain step"] * bool(plain) + ["Medusa's steps"] * bool(proposers))  # those warmed
        print(f"compiled {what} in {seconds:.1f} s (batch {min(B, n)}; not in any timing)", file=sys.stderr)
        return seconds
    return warm


class StepPrinter:
    """An `on_step` callback that prints the text as it comes; with show_steps each step in its colour (on a
    terminal without NO_COLOR, no-color.org) or [brackets]. A UTF-8 character split across steps waits."""

    STYLES = ("\x1b[30;46m", "\x1b[30;43m")  # black text on two backgrounds: even a step of spaces shows

    def __init__(self, enc: tiktoken.Encoding, *, eot_id: int | None, show_steps: bool) -> None:
        self.enc, self.eot_id, self.show_steps, self.steps = enc, eot_id, show_steps, 0
        self.color = not os.environ.get("NO_COLOR") and sys.stdout.isatty()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens: list[int], *, final: bool = False) -> None:
        """A step's text; final: the bytes still held back (in the last step's style) and the line's end."""
        text = self.decoder.decode(self.enc.decode_bytes([t for t in tokens if t != self.eot_id]), final=final)
        self.steps += not final
        if self.show_steps and (text or not final):  # an empty step shows too: [] or a colour
            text = f"{self.STYLES[(self.steps - 1) % 2]}{text}\x1b[0m" if self.color else f"[{text}]"
        print(text, end="\n" if final else "", flush=True)  # the reader watches the text grow, step by step


def print_each(engine: Engine, method: Method, prompts: list[tuple[str, list[int]]], a, label: str) -> None:
    """Each prompt's continuation and statistics, B prompts at a time (one prompt streams its steps, a batch prints
    once done; ms/token is the decoding call's); --json: an object per prompt (`tokens`: new ids, an end token's;
    reference.py counts passes alone: its step_tokens and accepted_nodes are null)."""
    ck, B = engine.ck, a.batch_size

    def announce(n: int) -> StepPrinter:
        printer, (text, ids) = StepPrinter(ck.enc, eot_id=ck.eot_id, show_steps=a.show), prompts[n]
        how = f"; one {'colour' if printer.color else '[chunk]'} per forward pass, the first from the prefill" * a.show
        print(f"=== prompt {n + 1}/{len(prompts)} ({len(ids)} tokens) ===\n{text}\n=== {label}{how} ===")
        return printer

    for first in range(0, len(prompts), B):
        chunk, streamed = prompts[first : first + B], B == 1 and not (a.json or method.reference)  # reference: at once
        printer = announce(first) if streamed else None
        rows, seconds = timed(ck.model.device, lambda: decode(engine, method, [ids for _, ids in chunk], seed=a.seed,
                              max_new_tokens=a.max_new_tokens, on_step=(lambda b, t: printer(t)) if streamed else None))
        ms = 1000 * seconds / max(sum(len(t) for t, _ in rows), 1)
        speed = (" as streamed (printing included; --compare times decoding alone)" if streamed
                 else f" over its batch of {len(rows)}" if len(rows) > 1 else "")
        for row, ((text, _), (tokens, stats)) in enumerate(zip(chunk, rows)):
            stats.seconds = seconds  # the whole batch's
            if a.json:
                print(json.dumps({"prompt": text, "method": method.key, "tokens": tokens, "text": ck.enc.decode(
                    [t for t in tokens if t != ck.eot_id]), **vars(stats), "tokens_per_step": stats.tokens_per_step,
                    **dict.fromkeys(("step_tokens", "accepted_nodes") if method.reference else ()),
                    "batch_size": len(chunk), "temperature": a.temperature, "top_p": a.top_p}))
                continue  # JSON in ASCII (\u escapes): valid in any encoding of stdout
            if not streamed:
                printer = announce(first + row)
                printer(tokens)
            printer([], final=True)
            stop = {"context": f"at the context limit: {stats.prompt_tokens} prompt + {len(tokens)} new tokens fill "
                               f"all {ck.block_size} positions", "eos": "at the end-of-text token",
                    "max_new_tokens": f"after max-new-tokens ({len(tokens)})"}
            rate = (f"{stats.tokens_per_step:.2f} tokens/step" + " (bonus token counted)" * (method.drafter is not None)
                    if stats.steps else "the prefill's token alone")  # no step: no tokens per step to show
            print(f"stats: {stats.steps} step{'s' * (stats.steps != 1)}, {rate}, "
                  f"{ms:.1f} ms/token{speed}, stopped {stop[stats.stop_reason]}\n")


def run(a: argparse.Namespace) -> None:
    ck, choice, drawn, prompts = prepare(a)
    tree, tree_name = (None, None) if choice is None else choice[:2]
    engine = Engine(ck)
    if a.compare:  # greedy rows, then sampled at --temperature: plain, prompt lookup (a chain of the budget), the heads
        greedy, lookup, line = Sampling(top_p=a.top_p), PromptLookup(), chain(choice.budget)
        typical, rejection = (replace(a.sampling, acceptance=r) for r in ("typical", "rejection"))
        methods = [Method("plain", greedy), Method("prompt lookup", greedy, lookup, line),
                   Method("Medusa", greedy, ck.heads, tree), Method("Medusa", typical, ck.heads, tree),
                   Method("plain", rejection), Method("prompt lookup", rejection, lookup, line),
                   Method("Medusa", rejection, ck.heads, drawn.tree)]  # drawn candidates: on their own table's tree
        methods += [Method("reference", m.sampling, ck.heads, m.tree, reference=True)  # under the heads' rules
                    for m in methods if a.reference and m.name == "Medusa"]
        methods = [m for m in methods if m.key in BATCH_ROWS or not a.batch_table]  # the batch table's four
        warm = compiled(engine, methods, a, len(prompts)) if a.compile else None
        result = compare(engine, [ids for _, ids in prompts], methods, batch_sizes=a.batch_sizes,
                         max_new_tokens=a.max_new_tokens, seed=a.seed, warm=warm)
        result.update(device=str(ck.model.device), dtype=a.dtype, threads=torch.get_num_threads(), top_p=a.top_p,
                      candidates=a.sampling.candidates, heads=ck.heads.name, tree=tree_name, tree_nodes=tree.num_nodes,
                      lookup_nodes=choice.budget, drawn_tree_nodes=None if drawn.tree == tree else drawn.tree.num_nodes)
        print(json.dumps(result) if a.json else format_table(result))  # before the plot: a failed one keeps it
        if a.plot:
            plot_batch(result["rows"], a.plot, title=f"medusa_mini, {ck.directory}, {result['device']}")
    elif a.explain:
        print((DEMO_NOTE + "\n\n" if a.demo else "") + explain_step(ck.model, ck.heads, ck.enc, prompts[0][1],
              tree=tree, sampling=a.sampling, generator=torch.Generator(device=ck.model.device).manual_seed(a.seed)))
    else:  # the one --method; plain decoding verifies no tree
        method = Method("plain", a.sampling) if tree is None else Method(
            "reference" if a.reference else "Medusa", a.sampling, ck.heads, tree, reference=a.reference)
        if a.show and tree is not None:
            drawing = draw_tree(tree, rank="draw" if a.sampling.draws_candidates else "rank")  # as --explain names them
            print(f"tree {tree_name}: {tree.num_nodes - 1} nodes + root, depth {tree.depth}\n{drawing}\n")
            print(f"attention mask (row attends to column):\n{draw_mask(tree)}\n")
        if a.compile:  # its one batch size, before any timing
            compiled(engine, [method], a, len(prompts))(a.batch_size)
        B = min(a.batch_size, len(prompts))  # what a batch holds, not what it may
        print_each(engine, method, prompts, a, method.label + f", tree {tree_name}" * (tree is not None)
                   + f", {B} per batch" * (B > 1))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    with OneLineParser(prog="decode.py").refusing(ValueError, OSError):  # bad input, and the library's own checks
        run(a)
    return 0


if __name__ == "__main__":
    exit_with(main, memory_advice=": lower --batch-size or --tree's nodes, or use --dtype bfloat16")
