"""benchmarks/gpu_report.py: one command, every GPU figure in one markdown report; its smallest run on a CPU
(the commands run in this process) and, with the commands faked, the paths only CUDA takes."""

import contextlib
import io
import os
import re
import shlex
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import decode
import train_tiny
from benchmarks import bench_step, gpu_report
from conftest import FAST, refused

TRAIN = " ".join(FAST[2:])  # train_tiny.py's fast flags after "--preset smoke": the report picks the preset
DECODE = "--max-new-tokens 4 --prompt 'def main():'"  # one short prompt: the report's decode part, fast
MAINS = {"benchmarks/bench_step.py": bench_step.main, "train_tiny.py": train_tiny.main, "decode.py": decode.main}


def faked(monkeypatch, reply) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(gpu_report, "run_script", lambda argv, **_: calls.append(argv) or reply(argv))
    return calls


@pytest.mark.usefixtures("one_thread", "one_run_each")
def test_quick_cpu_report_holds_every_part_down_to_the_heads_share(tmp_path, capsys, monkeypatch):
    def in_this_process(argv: list[str]) -> tuple[int, str, float]:  # run_script, the command's main in this process
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), pytest.raises(SystemExit) as end:
            sys.exit(MAINS[argv[0]](argv[1:]))  # as the script ends
        return end.value.code, out.getvalue(), 1.0

    faked(monkeypatch, in_this_process)
    monkeypatch.chdir(tmp_path)  # a relative --ckpt is this folder's, though the parts run in the repository's
    assert gpu_report.main(["--device", "cpu", "--quick", "--out", str(out := tmp_path / "report.md"), "--ckpt", "ckpt",
                            "--dtypes", "float32", "--train-flags", TRAIN, "--decode-flags", DECODE]) == 0
    text, err = out.read_text(), capsys.readouterr().err
    assert f"--out {tmp_path / 'ckpt'} --overwrite" in text and f"--ckpt {tmp_path / 'ckpt'} --compare" in text
    assert text.startswith("# medusa_mini on CPU") and f"torch {torch.__version__}" in text and "Failed" not in text
    assert re.search(r"\n- code: (unknown|[\w.-]+); date", text)  # `git describe`'s name of the commit, not git's path
    budget = f"{gpu_report.QUICK_BUDGET_S:.0f}"
    for part in gpu_report.PARTS:  # each part's section, and its seconds against its budget
        assert f"[{part}] done in" in err and re.search(rf"\n_Part {part}: \d+ s of its {budget} s budget._\n", text)
    parts = {part.split("\n")[0]: part for part in text.split("\n## ")[1:]}  # title: section
    step = parts["What one step costs"]
    assert "### tiny" in step and "torch 2" not in step and step.count(" tree: heads / plain step (%)") == 2  # cpu, gpu
    assert "stages " in parts["Training"] and "validation loss" in parts["Training"]
    assert "plain greedy" in parts["decode.py --compare"] and "--batch-size 1,2,4" in parts["Batch sizes"]


def test_on_cuda_each_part_compiles_keeps_its_lines_and_names_what_failed(tmp_path, monkeypatch):
    def cuda_settings(**kw) -> SimpleNamespace:  # the settings parse_args makes, on CUDA
        return SimpleNamespace(**dict(out=str(tmp_path / "r.md"), parts=list(gpu_report.PARTS), device="cuda",
            quick=False, ckpt=str(tmp_path), configs=["gpt2"], dtypes=["bfloat16"], budget_s=100.0, step_flags=[],
            train_flags=[], decode_flags=[], append=False, compile=["--compile"]) | kw)

    table = "       gpt2\nlayers / heads / width / vocabulary / draft   12 / 12 / 768 / 50257 / 8192\nplain step  1"
    calls = faked(monkeypatch, lambda argv: (None, "", 99.0) if "gpt2-xl" in argv else
                  (0, f"torch 2.x, cuda\ncommand: ...\n\n{table}\n", 1.0))
    section, ok = gpu_report.run_part(cuda_settings(configs=["gpt2", "gpt2-xl"], step_flags=["--nodes", "1,9"]), "step")
    assert not ok and len(calls) == 2 and all("--compile" in argv and argv[-2:] == ["--nodes", "1,9"] for argv in calls)
    assert f"```\n{table}\n```" in section and "torch 2.x" not in section
    assert "### gpt2-xl" in section and "Failed: stopped at its budget" in section
    assert not gpu_report.run_part(cuda_settings(configs=["gpt2-xl", "gpt2"]), "step")[1]  # fails, then passes: failed
    log = ("tokenizer  4096 tokens, trained in 12.5s\nbackbone   step 10\nsummary    validation loss 3.210 nats/token\n"
           "           head   1   2\nstages     backbone 201.3 s (peak 7.25 GiB), heads 60.0 s (peak 5.00 GiB)\n"
           "saved      out/x\n")
    calls = faked(monkeypatch, lambda argv: (0, log, 320.0))
    section, ok = gpu_report.run_part(cuda_settings(), "train")
    assert ok and calls[0][:3] == ["train_tiny.py", "--preset", "gpu"] and {"cuda", "--overwrite"} <= set(calls[0])
    assert "validation loss 3.210" in section and "head   1   2" in section and "(peak 7.25 GiB)" in section
    assert "step 10" not in section and "saved" not in section and "320 s" in section
    assert "Not run: the part's 1 s were spent" in gpu_report.run_part(cuda_settings(budget_s=1.0), "train")[0]
    calls = faked(monkeypatch, lambda argv: (1, "decode.py: error: boom\n", 2.0))
    section, ok = gpu_report.run_part(cuda_settings(), "decode")
    assert not ok and "Failed: exit status 1 after 2 s: decode.py: error: boom" in section
    assert {"--compare", "--compile"} <= set(calls[0]) and calls[0][calls[0].index("--dtype") + 1] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    text = gpu_report.header(cuda_settings(), ["--out", "r.md"])
    assert text.startswith("# medusa_mini on NVIDIA H100 80GB HBM3") and "cuda: NVIDIA H100 80GB HBM3, 80 GiB" in text


@pytest.mark.parametrize("case", [  # the error names what follows "->", else the first flag given
    "--part nope", "--device tpu -> device", "--budget-s 1", "--budget-s nan", "--budget-s inf", "--configs gpt5",
    "--dtypes float8", "--part decode --ckpt no/such/dir -> --ckpt", "--out {tmp}/sub/",
    "--out {tmp}/stopped/r.md -> r.md: {tmp}/stopped/r.md.partial is a folder",  # written there while r.md is older
    "--part batch --ckpt {tmp}/stopped -> no finished checkpoint",  # heads half trained: the train part must end
    "--train-flags \"'unclosed\" -> --train-flags: No closing quotation",
    # forwarded flags, checked by their script's own parser before any part runs
    "--step-flags '--repeat 0' -> --step-flags: bench_step.py refuses its flags: argument --repeat",
    "--step-flags=--help -> --step-flags: bench_step.py refuses its flags: --help",
    "--train-flags '--n-embd 30 --n-head 4' -> --train-flags: train_tiny.py refuses its flags: --n-embd 30",
    "--part train --part batch --decode-flags '--plot {tmp}/b.txt' -> decode.py refuses its flags: --plot",
    "--part train --part decode --decode-flags '--num-prompts 0' -> --num-prompts",
    "--train-flags '--out x' -> the report sets --out itself",  # set by the part itself: forwarded, the last would win
    "--decode-flags '--batch-size 2' -> the report sets --batch-size itself",
    "--decode-flags=--dtype=float32 -> the report sets --dtype itself", "--step-flags=--json -> sets --json itself",
    "--step-flags '--configs tiny' -> --step-flags: the report sets --configs itself",
    "--decode-flags '--dev cpu' -> the report sets --dev itself"])  # argparse takes a prefix as the flag
def test_bad_flags_exit_2_with_one_line_before_any_part_runs(tmp_path, capsys, monkeypatch, case):
    faked(monkeypatch, lambda argv: pytest.fail(f"ran {argv} despite a bad flag"))
    (stopped := tmp_path / "stopped").mkdir()  # what a train part stopped after a save leaves
    (stopped / "r.md.partial").mkdir()  # beside an older r.md, where this run's would be written
    for name in ("config.json", "train_state.pt", "r.md"):
        (stopped / name).touch()
    args, _, needle = case.partition(" -> ")
    argv = ["--device", "cpu", "--out", str(tmp_path / "r.md"), *shlex.split(args.format(tmp=tmp_path))]
    assert (needle.format(tmp=tmp_path) or args.split()[0]) in refused(capsys, gpu_report.main, argv)
    assert list(tmp_path.iterdir()) == [stopped]


@pytest.mark.parametrize("case", ["anew", "append", "disk full", "every part failed"])
def test_each_part_is_written_as_it_ends_and_an_older_report_is_replaced_by_a_whole_one(tmp_path, capsys, monkeypatch,
                                                                                         case):
    """Appended to, the older report grows part by part; else the new one grows in r.md.partial beside it, and
    replaces it unless every part failed."""
    out, seen, writes, real = tmp_path / "r.md", [], [], gpu_report.atomic_write
    new = out if case == "append" else tmp_path / "r.md.partial"
    out.write_text("# an older report\n")
    if case != "append":  # what an earlier run, stopped, left: replaced, not added to
        new.write_text("# a stopped run's\n")
    trained = (0, "summary    validation loss 3.1\n", 1.0) if case != "every part failed" else (1, "boom\n", 1.0)
    faked(monkeypatch, lambda argv: seen.append(new.read_text() if new.exists() else "") or
          (trained if argv[0] == "train_tiny.py" else pytest.fail("decoded an older checkpoint")
           if argv[0] == "decode.py" else (1, "boom\n", 1.0)))

    def write(path, writer):  # a disk that fills after the first part's section, in case "disk full"
        if case == "disk full" and writes:
            raise OSError(28, "No space left on device")
        real(path, writer)
        writes.append(new.read_text())

    monkeypatch.setattr(gpu_report, "atomic_write", write)
    assert gpu_report.main(["--device", "cpu", "--part", "step", "--part", "train", "--out", str(out), "--ckpt",
                            str(tmp_path / "ckpt"), *(["--append"] if case == "append" else ["--part", "decode"] * (
                                case == "every part failed"))]) == 1
    steps, err = len(gpu_report.GPT2_SHAPES.split(",")), capsys.readouterr().err
    assert seen[:steps] == ["# an older report\n" * (case == "append")] * steps  # untouched while the first part runs
    assert "## What one step costs" in seen[steps] and "## Training" not in seen[steps]  # then its section
    if case in ("disk full", "every part failed"):  # the new report beside the older one, which stays whole
        assert out.read_text() == "# an older report\n" and new.read_text() == writes[0 if case == "disk full" else -1]
        last = err.splitlines()[-1]  # disk full: the run ends at once, with one line saying so
        assert last.startswith("gpu_report.py: error: ") and "after part train (No space left" in last if case == \
            "disk full" else last == f"report: {new} ({out} kept: every part failed); failed: step, train, decode"
        return
    assert [p.name for p in tmp_path.iterdir()] == ["r.md"]  # no temporary or partial file left beside it
    text = out.read_text()
    assert text.startswith("# an older report\n\n## What one step costs" if case == "append" else "# medusa_mini")
    assert "## Training" in text and "summary    validation loss 3.1" in text and text.count("Failed: ") == steps
    assert err.endswith(f"report: {out}; failed: step\n")


def test_a_command_keeps_its_output_is_stopped_at_its_budget_and_on_sigterm_leaves_nothing_running(tmp_path, request):
    """Budgets far from any start-up time: 600 s for a command that ends at once, 1 s for one that sleeps 600.
    SIGTERM (or Ctrl-C) once a command has started: it and what it started are killed and reaped."""
    assert gpu_report.run_script(["-c", "print('done')"], timeout_s=600, label="quick")[:2] == (0, "done\n")
    assert gpu_report.run_script(["-c", "import time; time.sleep(600)"], timeout_s=1, label="sleeper")[:2] == (None, "")
    pid_file = tmp_path / "pid"
    child = (f"import os, time; open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); "
             f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(600)")

    def stop_once_started() -> None:
        while not pid_file.exists():
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as gpu_report.main installs it
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    threading.Thread(target=stop_once_started, daemon=True).start()
    pytest.raises(SystemExit, gpu_report.run_script, ["-c", child], timeout_s=600, label="sleeper")
    pytest.raises(ProcessLookupError, os.kill, int(pid_file.read_text()), 0)
