"""decode.py --compare on a tiny saved checkpoint: plain, prompt lookup, Medusa and reference rows, same prompts."""

import functools
import json
import runpy
import shutil
import sys

import pytest
import torch

import decode
from conftest import DRAWN, VICUNA, random_heads, refused
from medusa_mini.cli import runs as runs_mod
from medusa_mini.cli.compiled import compile_steps
from medusa_mini.cli.measure import CPU_MIN_GAIN
from medusa_mini.cli.runs import Method, format_table, summarise, why_line
from medusa_mini.decoding import GenerationStats
from medusa_mini.sampling import Sampling
from medusa_mini.train.accuracy import load_accuracy, save_accuracy
from medusa_mini.tree import build_tree, chain

pytestmark = pytest.mark.usefixtures("one_thread", "one_run_each")
ROWS = ["plain_greedy", "prompt_lookup_greedy", "medusa_greedy", "medusa_typical", "plain_sampling",
        "prompt_lookup_rejection", "medusa_rejection"]


def compared(capsys, *argv: str) -> dict:
    assert decode.main(["--compare", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_greedy_rows_are_plain_greedys_the_reference_the_engines_each_on_its_tree(ckpt, capsys, tmp_path, monkeypatch):
    """On a CPU `auto` keeps only the heads' nodes that pay for their cost (6 of 8 for this table); prompt
    lookup verifies only what it finds, so its chain is the whole budget of 8. The drawn candidates' tree
    grows from their own table: the Medusa rejection row and its reference decode on it, the rest on greedy's."""
    directory, trees, real = shutil.copytree(ckpt, tmp_path / "measured"), {}, runs_mod.decode
    save_accuracy(directory, VICUNA, drawn=DRAWN)
    monkeypatch.setattr(runs_mod, "decode", lambda engine, method, *a, **kw: trees.setdefault(
        method.key, set()).add(method.tree.choices if method.tree else None) or real(engine, method, *a, **kw))
    calls, generate = [], runs_mod.reference.medusa_generate  # the reference rows run reference.py's decoder
    monkeypatch.setattr(runs_mod.reference, "medusa_generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    result = compared(capsys, "--ckpt", str(directory), "--reference", "--max-new-tokens", "12")
    rows = {row["key"]: row for row in result["rows"]}
    for rule, nodes in (([], 6), (["--method", "rejection"], 3)):  # greedy's tree, then the drawn table's
        assert decode.main(["--ckpt", str(directory), "--show", *rule, "--max-new-tokens=1", "--num-prompts=1"]) == 0
        assert f"tree auto: {nodes} nodes + root" in capsys.readouterr().out
    assert [r["key"] for r in result["rows"]] == ROWS + ["reference_greedy", "reference_typical", "reference_rejection"]
    for key in ("prompt_lookup_greedy", "medusa_greedy", "reference_greedy"):
        assert rows[key]["tokens"] == rows["plain_greedy"]["tokens"] and rows[key]["same_as_plain_greedy"] is True
    for rule in ("greedy", "typical", "rejection"):  # the reference decodes as the engine, and stops as it does
        ref, engine = rows[f"reference_{rule}"], rows[f"medusa_{rule}"]
        assert all(ref[k] == engine[k] for k in ("tokens", "stop_reasons", "tokens_per_step", "steps")), rule
    assert all(0 < row["seconds"] < 60 for row in rows.values())  # a wall clock's interval, not its reading
    assert rows["plain_greedy"]["tokens_per_step"] == 1.0 and calls  # reference.py's decoder ran
    drawn, greedy = (build_tree(load_accuracy(directory, drawn=d), 8, min_gain=CPU_MIN_GAIN)[0].choices
                     for d in (True, False))
    assert drawn != greedy and trees == {key: {{"plain": None, "prompt": chain(8).choices}.get(
        key.split("_")[0], drawn if key.endswith("rejection") else greedy)} for key in rows}
    out, hydra = format_table(result), format_table({**result, "heads": "Hydra"})  # the settings name the heads
    settings = next(line for line in hydra.splitlines() if line.startswith("device "))
    assert "Hydra rejection's" in settings and "Medusa" not in settings and "prompt lookup   Hydra" in hydra
    for key, r in rows.items():  # every column from its own field
        line = next(line for line in out.splitlines() if line.startswith(r["method"] + " "))
        assert line[32:].split()[:6] == [str(r["new_tokens"]), str(r["steps"]), f"{r['tokens_per_step']:.2f}",
                                         f"{r['step_cost']:.2f}", f"{r['ms_per_token']:.2f}", f"{r['speedup']:.2f}"]
    for label, same in (("plain greedy", "yes"), ("prompt lookup greedy", "yes"), ("Medusa greedy", "yes"),
                        ("Medusa typical (T=0.8)", "-"), ("plain sampling (T=0.8)", "-")):
        line = next(line for line in out.splitlines() if line.startswith(label))
        assert line.split()[-1] == same, line
        if label.startswith("plain"):  # the plain decoders set the step cost: 1.00 under its header
            assert line[: out.splitlines()[0].index("step cost") + 9].split()[-1] == "1.00", line
    for needle in ("bonus token", "prefill's too", "3 prompts", "max-new-tokens 12", f"tree auto (7 nodes incl. root;"
                   f" Medusa rejection's, from its own table: {len(drawn) + 1}; prompt lookup: a chain of up to 8)",
                   "1 thread;", "reference rejection (T=0.8): the engine's tokens on 3/3 prompts\n"):
        assert needle in out, needle


def test_heads_rows_are_named_by_the_heads_kind_and_keyed_as_medusa_decoding(model):
    for kind, shown in (("medusa", "Medusa"), ("hydra", "Hydra")):
        row = Method("Medusa", Sampling(temperature=0.8), random_heads(model, kind=kind), chain(2))
        assert (row.label, row.key) == (f"{shown} rejection (T=0.8)", "medusa_rejection")


def test_lookup_gains_on_repeats_and_a_row_that_leaves_plain_greedy_is_named_where(ckpt, capsys, monkeypatch):
    def one_token_off(engine, method, prompts, *, real=runs_mod.decode, **kw):
        """Medusa greedy's last token changed on the repeats, else dropped: a row stopped early parts where it stops."""
        out, changed = real(engine, method, prompts, **kw), len(set(prompts[0])) == 1
        return [(t[:-1] + [(t[-1] + 1) % 50] * changed if method.key == "medusa_greedy" else t, st) for t, st in out]

    monkeypatch.setattr(runs_mod, "decode", one_token_off)
    result = compared(capsys, "--ckpt", ckpt, "--max-new-tokens", "16", "--prompt=nnnnnnnn", "--prompt=a big dog ran")
    repeated, plain = result["per_prompt"]  # one token repeated, and a prompt without repeats
    assert repeated["prompt_lookup_greedy"] > 1.5 and plain["prompt_lookup_greedy"] == 1.0
    rows, ck = {r["key"]: r for r in result["rows"]}, decode.load_for_decoding(ckpt, device="cpu", dtype=torch.float32)
    ids, want = ck.enc.encode_ordinary("nnnnnnnn"), rows["plain_greedy"]["tokens"][0]
    seq, top2 = ids[-1:] + want, ck.model(torch.tensor([ids + want[:15]]))[0][0, -1].topk(2).values  # where they part
    assert repeated["repeats"] == sum(a == b for a, b in zip(seq, seq[1:])) / 16 > 0.5 and plain["repeats"] == 0
    assert rows["medusa_greedy"]["differences"][0]["margin"] == pytest.approx((top2[0] - top2[1]).item())
    assert [rows[k]["same_as_plain_greedy"] for k in ("medusa_greedy", "prompt_lookup_greedy")] == [False, True]
    assert [(d["prompt"], d["position"]) for d in rows["medusa_greedy"]["differences"]] == [(0, 15), (1, 15)]
    out = format_table(result)
    assert "Medusa greedy differs from plain greedy on prompt 1 at new token 16" in out and " 0/2 prompts" in out
    assert [("near-tie" in s) for s in out.splitlines() if "differs from plain" in s] == [
        d["margin"] < 0.1 for d in rows["medusa_greedy"]["differences"]]
    flagged = [{**r, "repeats_differ": r["key"] == "medusa_greedy"} for r in result["rows"]]
    assert "Medusa greedy: repeated runs made different tokens" in format_table({**result, "rows": flagged})
    footer = [line.split() for line in out.split("repeats")[-1].splitlines()[1:]]
    assert [cells[0] for cells in footer] == ["1", "2"] and (footer[1][1], footer[1][-1]) == ("1.00", "0%")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compare_in_half_precision_runs_every_row(ckpt, capsys, dtype):
    """Every row makes its tokens; any parting it names lies inside them (a forced one: above)."""
    result = compared(capsys, "--ckpt", ckpt, "--dtype", dtype, "--max-new-tokens", "12", "--num-prompts", "2",
                      "--temperature", "0.5")
    assert result["dtype"] == dtype and [r["key"] for r in result["rows"]] == ROWS
    for row in result["rows"]:
        assert [len(t) for t in row["tokens"]] == [12, 12] and row["temperature"] in (0, 0.5)
        assert all(0 <= d["position"] < 12 and d["margin"] >= 0 for d in row.get("differences", []))


@pytest.mark.parametrize("compiling", [False, True])  # compiled, each size is warmed up just before its timing
def test_the_batch_table_says_where_medusa_stops_paying_and_ends_where_memory_does(ckpt, capsys, tmp_path, monkeypatch,
                                                                                   compiling):
    def fails_at_4(rows: int) -> None:  # batch 4, run or warmed up, is more than the device holds
        if rows == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB. GPU 0 has 4 GiB in all")
    turns, warm = runs_mod.run_in_turns, decode.warm_up  # the real ones; each warm-up takes 1 s
    monkeypatch.setattr(runs_mod, "run_in_turns", lambda e, m, b, **kw: fails_at_4(len(b[0])) or turns(e, m, b, **kw))
    monkeypatch.setattr(decode, "warm_up", lambda *a, rows, **k: fails_at_4(rows) or warm(*a, rows=rows, **k) and 1.0)
    monkeypatch.setattr(decode, "compile_steps", functools.partial(compile_steps, backend="eager"))  # dynamo alone
    result = compared(capsys, "--ckpt", ckpt, "--batch-size", "1,2,4", "--max-new-tokens", "8", "--plot",
                      str(tmp_path / "batch.png"), *["--compile"] * compiling)
    assert result["stopped"] in format_table(result) and result["stopped"] == "batch 4 does not fit (CUDA out of " \
        "memory. Tried to allocate 9.00 GiB" + "; compiled, every smaller size's static caches are still held" * \
        compiling + "): the table ends at batch 2"
    monkeypatch.setattr(sys, "argv", ["decode.py", "--compare", "--ckpt", ckpt, "--batch-size", "4", "--plot",
                                      str(tmp_path / "b4.png")])  # none fits (a batch table, which --plot draws)
    assert refused(capsys, lambda _: runpy.run_path(decode.__file__, run_name="__main__"), []).startswith(
        "decode.py: error: CUDA out of memory. Tried to allocate 9.00 GiB: lower --batch-size or --tree's nodes")
    assert result["compile_warmup_s"] == (2.0 if compiling else None)  # batches 1 and 2
    rows, table = result["rows"], format_table(result)
    assert "4 prompts (3 distinct, cycled)" in table and "distinct" not in format_table({**result, "prompts": 3})
    assert "prompt lookup" not in table  # none of its rows
    assert [(r["key"], r["batch_size"]) for r in rows] == [(k, b) for b in (1, 2) for k in (
        "plain_greedy", "medusa_greedy", "plain_sampling", "medusa_rejection")]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] >= 1.0 for r in rows)
    assert all(r["same_as_plain_greedy"] for r in rows if r["temperature"] == 0)  # batch 1's greedy tokens
    plain_at = {(p["temperature"], p["batch_size"]): p for p in rows if p["plain"]}  # each row against plain
    for row, plain in ((r, plain_at[r["temperature"], r["batch_size"]]) for r in rows):  # at its T and batch size
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["step_cost"] == pytest.approx(row["ms_per_step"] / plain["ms_per_step"])
    verdicts = [line for line in table.splitlines()
                if any(v in line for v in ("paying at batch", "pays at batch", "does not pay at any"))]
    assert len(verdicts) == 2 and (tmp_path / "batch.png").stat().st_size > 0  # the figure: test_plots.py


def test_a_rows_numbers_count_passes_per_batch_and_every_token_once():
    """Batches of 2 and 1 rows (3 prompts at B = 2): a batch makes as many passes as its slowest row."""
    def stats(steps: int, tokens: int):  # `tokens` new tokens: the prefill's, then `steps` steps sharing the rest
        per_step = [(tokens - 1) // steps + (i < (tokens - 1) % steps) for i in range(steps)]
        return list(range(tokens)), GenerationStats(prompt_tokens=4, steps=steps, step_tokens=per_step)

    r = summarise([([stats(5, 11), stats(3, 7)], 0.2), ([stats(4, 9)], 0.1)])
    assert (r["steps"], r["passes"], r["row_passes"], r["new_tokens"]) == (12, 9, 14, 27)
    assert r["tokens_per_step"] == 24 / 12 and (r["seconds"], r["ms_per_token"]) == pytest.approx((0.3, 300 / 27))
    assert r["ms_per_step"] == pytest.approx(300 / 9) and r["tokens_per_s"] == pytest.approx(27 / 0.3)
    rows = [{"method": "Medusa greedy", "batch_size": b, **r, "step_cost": 1.5, "speedup": 1.2} for b in (1, 2)]
    tail = f"a step costs 1.50x a plain step at batch 2, and a batch of 2 makes {14 / 12:.2f}x the passes its rows need"
    assert f"pays at batch 2, the largest measured: a step costs 1.50x a plain step at batch 1 and 1.50x at batch 2, " \
           f"and a batch of 2 makes {14 / 12:.2f}x the passes its rows need" in why_line(rows)
    assert f"Medusa greedy pays at batch 2: {tail}" in why_line(rows[1:])  # one size: no "largest"
    assert f"Medusa greedy does not pay at any batch size here: {tail}" in why_line([{**rows[1], "speedup": 0.9}])
    three = [{**rows[0], "batch_size": b, "speedup": s} for b, s in ((1, 1.2), (2, 0.9), (4, 1.1))]
    assert "Medusa greedy pays at batch 4, the largest measured" in why_line(three)  # it pays again at 4
    assert "Medusa greedy stops paying at batch 2: " in why_line(three[:2])
    assert "here: a step costs 1.50x a plain step at batch 2, and a batch of 2 makes" in why_line(
        [{**r, "speedup": 0.9} for r in three[1:]])  # never paid: said of the first size
