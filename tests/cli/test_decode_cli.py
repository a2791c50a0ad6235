"""decode.py end to end on a tiny saved checkpoint, each mode as a user runs it."""

import argparse
import functools
import io
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

import decode
import train_tiny
from benchmarks import gpu_report, sweep
from conftest import PROMPTS, ROOT, refused, save_tiny
from medusa_mini.cli.common import exit_with
from medusa_mini.cli.explain import token_text, verify_section
from medusa_mini.sampling import Sampling, typical_threshold
from medusa_mini.tree import Tree

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):  # tiny_ckpt(kind): the tiny checkpoint, its heads of that kind (hydra) or none
    return functools.cache(lambda kind: save_tiny(tmp_path_factory.mktemp(f"ckpt_{kind}"), kind=kind))


def run(capsys, *argv: str) -> str:
    assert decode.main(list(argv)) == 0
    return capsys.readouterr().out


def objects(capsys, *argv: str) -> list[dict]:
    return [json.loads(line) for line in run(capsys, *argv, "--json").splitlines()]


@pytest.mark.parametrize("heads, rule, needles", [
    ("medusa", [], ("Prefill", "Root token", "head 4", "■", "backbone argmax", "emitted", "[0] root", "accepted path")),
    ("medusa", ["--method", "rejection"], ("min(1, r(x)/q(x))", "draws the candidates", "head 1 draw 0", "bonus")),
    ("medusa", ["--method", "typical"], ("p(token)  bar at its parent", "passes above the bar min(ε")),
    ("hydra", [], ("Dependent (hydra) heads", "head 4", "accepted path"))])
def test_explain_walks_through_one_step_of_either_kind_of_heads(ckpt, tiny_ckpt, capsys, heads, rule, needles):
    out = run(capsys, "--ckpt", tiny_ckpt(heads) if heads == "hydra" else ckpt, "--explain", *rule)
    assert all(needle in out for needle in needles), out
    if rule:  # p and q shown at the rule's temperature: at another, other probabilities of the same tokens
        hot = run(capsys, "--ckpt", ckpt, "--explain", *rule, "--temperature", "2").splitlines()
        assert sum(s.startswith(("Backbone's top", "head 1 ")) and s not in hot for s in out.splitlines()) == 2, hot
        assert run(capsys, "--ckpt", ckpt, "--explain", *rule, "--seed", "1") != out
        assert "(nan)" not in run(capsys, "--ckpt", ckpt, "--explain", *rule, "--temperature", "1e-38")  # below tiny
    if heads == "medusa" and not rule:  # the step decides as decoding's first: the same root, then the same tokens
        o, enc = objects(capsys, "--ckpt", ckpt)[0], decode.load_for_decoding(ckpt, device="cpu").enc
        n = o["step_tokens"][0]  # a confirmed child (✓) where the step accepted one; the cache holds prompt + n
        assert f"({n - 1} accepted + 1 bonus) with one forward pass: {enc.decode(o['tokens'][1 : 1 + n])!r}" in out
        assert ("✓" in out) == (n > 1) and f"it now holds {o['prompt_tokens'] + n} tokens" in out, out
        assert f"bonus token:   {token_text(enc, o['tokens'][n])}, " in out  # the step's last token
        assert [s.count("#") for s in out.splitlines() if s.startswith("head ")] == [3, 2, 2, 2]  # the tree's ranks


def test_show_brackets_each_step_of_the_text_and_plain_decoding_needs_no_heads(ckpt, tiny_ckpt, capsys, tmp_path):
    argv = ["--ckpt", ckpt, "--prompt", PROMPTS[0], "--max-new-tokens", "20"]
    ref, medusa = (json.loads(run(capsys, *argv, "--json", *method)) for method in (["--method", "plain"], []))
    out = run(capsys, *argv, "--show")  # not a terminal: brackets, no colour; the clock ran while the text printed
    assert "\x1b[" not in out and "attention mask" in out and "(bonus token counted)" in out
    assert "tree cpu: 11 nodes + root, depth 4\n[0] root" in out and "ms/token as streamed (printing included" in out
    shown = out.split("the first from the prefill ===\n", 1)[1].rsplit("\nstats: ", 1)[0]  # the text, as streamed
    assert "[" not in ref["text"] and shown.replace("[", "").replace("]", "") == ref["text"]
    assert shown.count("[") == medusa["steps"] + 1  # the prefill's token, then one chunk per step
    drawn = run(capsys, "--ckpt", ckpt, "--prompt", "x", "--max-new-tokens", "2", "--show", "--method", "rejection")
    assert "head 1 draw 0" in drawn and "rank" not in drawn  # drawn candidates, as --explain names them
    shutil.copytree(tiny_ckpt(None), stopped := tmp_path / "run")  # no heads
    (stopped / "train_state.pt").touch()  # a run stopped before its end: decoded as last saved, with a note
    assert decode.main(["--ckpt", str(stopped), "--method", "plain", "--show", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert "holds an unfinished run, as last saved" in err and f"--out {stopped} --resume, with the flags" in err
    assert "=== plain greedy; one [chunk] per forward pass" in out and "1 step, 1.00 tokens/step, " in out  # no bonus
    assert "attention mask" not in out and "root" not in out
    (stopped / "prompts.json").unlink()  # no prompts yet: one line says how to finish the run, or what to pass
    err = refused(capsys, decode.main, ["--ckpt", str(stopped), "--method", "plain"])
    assert "prompts.json is missing; " in err and "--resume, with the flags" in err and "pass --prompt TEXT" in err


def test_generation_stops_cleanly_at_the_context_limit(ckpt, capsys):
    argv = ["--ckpt", ckpt, "--prompt", " ".join(["the cat sat on the mat"] * 6), "--max-new-tokens", "50"]  # 55 of 64
    for ref in ([], ["--reference"]):
        obj = json.loads(run(capsys, *argv, "--json", *ref))
        assert obj["stop_reason"] == "context" and obj["prompt_tokens"] + len(obj["tokens"]) == 64
        assert obj["step_tokens"] is None if ref else len(obj["step_tokens"]) == obj["steps"]  # reference: passes only
        # 55 + 9 = 64: a budget that ends with the context is what stopped it
        assert json.loads(run(capsys, *argv[:-1], "9", "--json", *ref))["stop_reason"] == "max_new_tokens"
    assert "stopped at the context limit: 55 prompt + 9 new tokens fill all 64 positions" in run(capsys, *argv)
    assert "stats: 0 steps, the prefill's token alone, " in run(capsys, *argv[:-1], "1")
    assert "(of 11: deeper" in run(capsys, "--ckpt", ckpt, "--explain", "--prompt", argv[3] + " the cat sat")
    out = run(capsys, "--ckpt", ckpt, "--method", "rejection", "--temperature", "2", "--seed", "2", "--num-prompts=1")
    assert "stopped at the end-of-text token" in out and "<|endoftext|>" not in out  # the end token is not text
    out = run(capsys, *argv, "--compare")  # rows stopped by the context say so
    assert "end-of-text" not in out and "7 of the generations stopped at the context limit" in out


@pytest.mark.parametrize("rule", [[], ["--method", "plain"]])
def test_json_is_an_object_per_prompt_and_a_batch_decodes_each_prompt_as_if_alone_when_greedy(ckpt, capsys, rule,
                                                                                              monkeypatch):
    argv = ["--ckpt", ckpt, "--max-new-tokens", "14", *rule]
    alone = objects(capsys, *argv)
    assert [(o["prompt"], o["method"], len(o["tokens"]), o["stop_reason"]) for o in alone] == [
        (p, "plain_greedy" if rule else "medusa_greedy", 14, "max_new_tokens") for p in PROMPTS]
    assert all(o["steps"] >= 1 and o["tokens_per_step"] >= 1.0 and o["seconds"] > 0 for o in alone)
    batched = objects(capsys, *argv, "--batch-size", "2")  # 3 prompts: batches of 2 and 1
    assert [(o["tokens"], o["batch_size"]) for o in batched] == [(o["tokens"], B) for o, B in zip(alone, (2, 2, 1))]
    assert run(capsys, *argv, "--batch-size", "2").count(" ms/token over its batch of 2,") == 2
    assert ", 3 per batch ===" in run(capsys, *argv, "--batch-size", "8")  # what a batch holds, not what it may
    monkeypatch.setattr(decode, "timed", lambda device, fn: (fn(), 2.8))  # each batch's decoding: 2.8 s
    assert run(capsys, *argv, "--batch-size", "2").count(" 100.0 ms/token over its batch of 2, stopped after "
                                                         "max-new-tokens (14)") == 2  # 2.8 s over 28 tokens
    assert [o["seconds"] for o in objects(capsys, *argv, "--batch-size", "2")] == [2.8] * 3  # the whole batch's
    if not rule:  # seeded anew for each batch: a prompt given twice samples the same text
        twice = objects(capsys, *argv, "--method", "rejection", *["--prompt", PROMPTS[0]] * 2)
        assert twice[0]["tokens"] == twice[1]["tokens"]
    for more, note in ([], ""), (["--num-prompts", "5"], "note: prompts.json holds 3 prompts, not 5: decoding those\n"):
        assert decode.main([*argv, "--json", *more]) == 0  # the default, 8, is no request for more than there are
        out, err = capsys.readouterr()
        assert (len(out.splitlines()), err) == (3, note)
    given = objects(capsys, "--ckpt", ckpt, "--max-new-tokens=2", *["--prompt=a", "--prompt=b"] * 2, "--num-prompts=3")
    assert decode.main(["--ckpt", ckpt, "--max-new-tokens=2", "--prompt=a", "--num-prompts=2"]) == 0
    assert capsys.readouterr().err == "note: --prompt gives 1 prompt, not 2: decoding those\n"
    assert [o["prompt"] for o in given] == ["a", "b", "a"]  # --num-prompts takes the first N of --prompt's too


@pytest.mark.slow
def test_the_demo_explains_a_step_without_any_checkpoint_and_refuses_a_tree_or_a_prompt_before_training(
        capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no out/tiny here
    steps, real = [], functools.partial(decode.demo_checkpoint, steps=5)  # trained for 5 steps, not 300
    monkeypatch.setattr(decode, "demo_checkpoint", lambda **kw: steps.append(kw.get("steps")) or real(**kw))
    for bad, needle in (["--tree", "4"], "(--demo) has none"), (["--prompt", ""], "is empty"):
        assert needle in refused(capsys, decode.main, ["--explain", "--demo", *bad])
    assert steps == [0, 0]  # the untrained demo only
    out = run(capsys, "--explain", "--demo")
    assert out.startswith("DEMO:") and "accepted path" in out and "7. Result" in out and steps == [0, 0, 0, None]


def test_a_console_that_cannot_encode_the_trees_lines_shows_escapes_and_json_its_own(ckpt, monkeypatch):
    monkeypatch.setattr(sys, "stdout", console := io.TextIOWrapper(io.BytesIO(), encoding="cp1252"))  # Windows'
    monkeypatch.setenv("HOME", os.path.dirname(ckpt))  # and --ckpt=~/..., which no shell expands
    assert decode.main([f"--ckpt=~/{os.path.basename(ckpt)}", "--show", "--max-new-tokens", "2"]) == 0
    assert console.flush() is None and "\\u251c\\u2500" in console.buffer.getvalue().decode("cp1252")  # ├─
    monkeypatch.setattr(sys, "stdout", console := io.TextIOWrapper(io.BytesIO(), encoding="cp1252"))
    assert decode.main(["--ckpt", ckpt, "--prompt", "café 🎉", "--max-new-tokens", "2", "--json"]) == 0
    assert console.flush() is None and json.loads(console.buffer.getvalue())["prompt"] == "café 🎉"


def test_as_a_process_a_sampled_run_repeats_its_tokens(ckpt, capsys):
    """As a user meets it: a fresh process's output and exit status (bad input, through the same main, below).
    Eager decoding of a small model never imports torch's compiler (2 s of start-up, -X importtime lists it)."""
    argv = ["--ckpt", ckpt, "--method", "rejection", "--seed", str(2**63 - 1), "--max-new-tokens", "16"]  # the top seed
    r = subprocess.run([sys.executable, "-X", "importtime", "decode.py", *argv, "--json"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and objs[0]["temperature"] == 0.8 and len(objs) == 3  # the sampling default
    assert not re.search(r"\|\s+torch\._dynamo$", r.stderr, re.M) and re.search(r"\|\s+torch$", r.stderr, re.M)
    assert [o["tokens"] for o in objs] == [o["tokens"] for o in objects(capsys, *argv)]  # and in this process


@pytest.mark.filterwarnings("ignore:'medusa_mini.cli.measure' found in sys.modules")  # run again as __main__
@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, 130), (BrokenPipeError, 1), (torch.OutOfMemoryError, 2)])
def test_ctrl_c_a_closed_pipe_or_a_full_device_ends_every_script_quietly(stop, status, monkeypatch, capsys):
    """Ctrl-C: status 130; a reader gone (`| head`): 1; out of memory: 2; no traceback, in decode's own run too."""
    monkeypatch.setattr(sys, "stdout", stdout := io.StringIO())  # no file: a closed pipe's end leaves pytest's fd be
    scripts = "decode train_tiny benchmarks/bench_step benchmarks/sweep benchmarks/gpu_report".split()
    runs = [functools.partial(runpy.run_path, os.path.join(ROOT, f"{s}.py"), run_name="__main__") for s in scripts]
    assert pytest.raises(SystemExit, exit_with, lambda: 2).value.code == 2  # else a script's own status
    disk_full = lambda: (_ for _ in ()).throw(OSError(28, "No space left on device"))  # noqa: E731 (stdout's, say)
    assert pytest.raises(SystemExit, exit_with, disk_full).value.code == 2 and "device\n" in capsys.readouterr().err
    monkeypatch.setattr(stdout, "write", lambda text: disk_full())  # --help too: argparse's own would exit 0
    assert pytest.raises(SystemExit, exit_with, lambda: decode.main(["--help"])).value.code == 2
    monkeypatch.setattr(decode, "run", lambda a: (_ for _ in ()).throw(stop()))
    pytest.raises(stop, decode.main, ["--prompt", "x"])  # no OSError to report with status 2: the script ends it
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", lambda *args: (_ for _ in ()).throw(stop()))
    for run in [*runs, functools.partial(runpy.run_module, "medusa_mini.cli.measure", run_name="__main__")]:
        assert pytest.raises(SystemExit, run).value.code == status
    monkeypatch.setattr(stdout, "flush", lambda: (_ for _ in ()).throw(BrokenPipeError()))  # what is still buffered
    assert pytest.raises(SystemExit, exit_with, lambda: 0).value.code == 1


def test_top_p_goes_with_sampling_a_temperature_names_or_compares_sampled_rows():
    """Never alone: refused, below. (A batch of 4096, the largest, is allowed.)"""
    for argv in (["--compare", "--batch-size", "1,4096"], ["--method", "rejection"], ["--temperature", "0.5"]):
        assert decode.parse_args([*argv, "--top-p", "0.9"]).sampling.top_p == 0.9
    assert decode.parse_args(["--compare", "--reference", "--compile"]).compile  # reference rows beside compiled ones


@pytest.mark.parametrize("case", [  # what the error names: what follows "->", else the first flag given
    "--ckpt {tmp}/nowhere -> nowhere does not exist", "--ckpt '' -> does not exist", "--ckpt {tmp} -> safetensors",
    "--ckpt {ckpt}/config.json -> is a file", "--prompt caf\udce9 -> not UTF-8 text",
    "--ckpt {hydra} --reference -> not Hydra heads", "--ckpt {ckpt} --explain --demo -> leave out --ckpt",
    "--tree chain6 -> 4 heads", "--tree [[100000]] -> --tree [[100000]]: the tree asks", "--tree ''", "--prompt ''",
    "--prompt '{long}' -> at most 63 tokens", "--temperature -1", "--temperature inf", "--max-new-tokens 0",
    "--max-new-tokens many", "--num-prompts 0", "--seed 9223372036854775808", "--method greedy --temperature 0.7",
    "--top-p 0.9 -> --temperature > 0", "--top-p 1.5 -> --top-p", "--batch-size 2 --show", "--batch-size 2 --reference",
    "--batch-size 2 --explain", "--batch-size 1,2", "--compare --temperature 0 -> give T > 0", "--batch-size ' '",
    "--batch-size ²", "--compare --batch-size 1,4097 -> from 1 to 4096", "--compare --batch-size 1,x -> --batch-size",
    "--plot {tmp}/b.png", "--demo", "--reference --method plain", "--method plain --tree 6 -> --tree",
    "--compare --plot {tmp}/b.png -> --batch-size 1,2,4",  # the batch table alone is drawn
    "--compare --batch-size 1,2 --plot {tmp}/no/b.png -> --plot", "--compare --max-new-tokens 1 -> --max-new-tokens",
    "--compare --method typical -> --method", "--explain --method plain", "--json --show", "--json --explain",
    "--method typical --temperature 0 -> --temperature", "--explain --max-new-tokens 5 -> leave out --max-new-tokens",
    "--explain --num-prompts 2 -> one --prompt", "--explain --prompt a --prompt b -> one --prompt",
    "--compare --batch-size 1,2 --reference -> --reference", "--explain --compile -> --compile",
    "--explain --reference -> --reference", "--reference --compile -> --compile", "--show --reference -> --show",
    f"--explain --prompt {'q' * 62} -> at most 61 tokens", f"--compare --prompt {'q' * 63} -> at most 62 tokens"])
def test_bad_input_exits_2_with_one_line(case, ckpt, tiny_ckpt, tmp_path, capsys):
    args, _, needle = case.partition(" -> ")
    argv = shlex.split(args.format(tmp=tmp_path, hydra=tiny_ckpt("hydra"), ckpt=ckpt, long="the cat " * 100))
    err = refused(capsys, decode.main, argv if "--ckpt" in argv else ["--ckpt", ckpt, *argv])
    assert err.startswith("decode.py: error: ") and (needle or argv[0]) in err, err


def test_verify_judges_each_candidate_by_p_and_the_bar_at_its_parent():
    tree, tokens = Tree.from_choices([(0,), (1,), (0, 0)]), [0, 1, 0, 2]  # [1], [2] the root's children, [3] [1]'s
    logits = torch.tensor([[0.3] + [0.1] * 7, [0.02] * 2 + [0.86] + [0.02] * 5, [0.125] * 8, [0.65] + [0.05] * 7]).log()
    sampling, out = Sampling(acceptance="typical", temperature=1.0), []
    verify_section(out, ["r", "a", "b", "c"], tree, tokens, logits, None, None, sampling=sampling)
    bar = typical_threshold(logits.softmax(-1), epsilon=sampling.epsilon, delta=sampling.delta).tolist()
    assert bar[0] != bar[1] != bar[2] and [line.split() for line in out if line.startswith("[")] == [
        ["[1]", "a", "0.100", f"{bar[0]:.3f}"], ["[2]", "b", "0.300", f"{bar[0]:.3f}"],
        ["[3]", "c", "0.860", f"{bar[1]:.3f}"]]  # node [0]'s entropy makes its bar lower than ε, node [1]'s not


def test_a_checkpoint_without_heads_points_to_plain_decoding_only_where_it_can_run(tiny_ckpt, capsys):
    for argv, plain_runs in [([], True), (["--compare"], False), (["--explain"], False), (["--reference"], False)]:
        err = refused(capsys, decode.main, ["--ckpt", tiny_ckpt(None), *argv])
        assert "has no Medusa heads: train heads" in err and ("or use --method plain" in err) == plain_runs, argv


def test_a_broken_heads_accuracy_file_refuses_medusa_decoding_which_reads_it_not_plain_decoding(ckpt, tmp_path, capsys):
    (shutil.copytree(ckpt, broken := tmp_path / "ck") / "heads_accuracy.json").write_text("[[0")
    assert "not readable JSON" in refused(capsys, decode.main, ["--ckpt", str(broken), "--max-new-tokens", "2"])
    assert decode.main(["--ckpt", str(broken), "--method", "plain", "--max-new-tokens", "2", "--num-prompts", "1"]) == 0


@pytest.mark.parametrize("mode", [["--method", "rejection"], ["--reference", "--method", "rejection"],
                                  ["--compare", "--json"], ["--explain", "--method", "rejection"]])
def test_every_generator_decode_makes_lives_on_the_models_device(ckpt, capsys, monkeypatch, mode):
    """On a GPU a CPU generator cannot draw for the device's tensors; on a CPU nothing would tell: each
    generator must name its device, the model's (by keyword or position)."""
    devices = []

    class Recorded(torch.Generator):  # a real generator that notes the device it was asked for
        def __new__(cls, *args, **kw):
            devices.append(kw.get("device", args[0] if args else None))
            return super().__new__(cls, *args, **kw)

    monkeypatch.setattr(torch, "Generator", Recorded)
    run(capsys, "--ckpt", ckpt, *["--max-new-tokens", "4", "--num-prompts", "1"] * ("--explain" not in mode), *mode)
    assert devices and all(d is not None and torch.device(d) == torch.device("cpu") for d in devices), devices


def test_a_tilde_in_a_path_flag_is_the_home_folder_though_no_shell_expanded_it(tmp_path, monkeypatch, capsys):
    """A shell expands ~ at a word's start only: `--out=~/run` reaches the command as written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    args = train_tiny.parse_args(["--out=~/run", "--data=~"])  # a folder of text
    a = decode.parse_args(["--compare", "--batch-size", "1,2", "--plot=~/b.png", "--tree=~/t.json"])
    s = gpu_report.parse_args(["--out=~/r.md", "--ckpt=~/c", "--device", "cpu", "--part", "step"])
    assert [args.out, args.data, a.plot, a.tree, s.out, s.ckpt] == [str(tmp_path / f) for f in (
        "run", "", "b.png", "t.json", "r.md", "c")]
    assert f"--plot {tmp_path}/no/p.png:" in refused(capsys, sweep.main, ["--ckpt", "x", "--plot=~/no/p.png"])
