"""benchmarks/gpu_report.py: one command, every GPU figure as markdown tables; its smallest run on a CPU and,
with the commands faked, the paths only CUDA takes."""

import json
from argparse import Namespace
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT

from benchmarks import gpu_report
from benchmarks.bench_step import bench_config
from benchmarks.gpu_report import ScriptRun
from medusa_mini.model import GPTConfig

FAST_TRAIN = ("--backbone-steps 6 --heads-steps 4 --distill-prompts 8 --distill-tokens 12 --eval-prompts 2 "
              "--batch-size 4 --n-embd 32 --log-every 1000")


def table(text: str, first_header_cell: str) -> dict[str, list[str]]:
    """The markdown table whose header starts with `first_header_cell`, as {row label: its other cells}."""
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows:
            if rows[0][0].startswith(first_header_cell):
                return {row[0]: row[1:] for row in rows[2:]}
            rows = []
    raise AssertionError(f"no table headed {first_header_cell!r} in:\n{text}")


@pytest.mark.slow
def test_quick_cpu_report_holds_every_part_with_numbers_that_agree(tmp_path):
    out = tmp_path / "report.md"
    r = subprocess.run([sys.executable, "benchmarks/gpu_report.py", "--device", "cpu", "--quick", "--out", str(out),
                        "--ckpt", str(tmp_path / "ckpt"), "--dtypes", "float32", "--train-flags", FAST_TRAIN,
                        "--decode-flags", "--max-new-tokens 8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    about = table(text, "")
    assert about["device"][0].startswith("cpu") and about["torch"] == [torch.__version__]
    for part in gpu_report.PARTS:
        assert f"[{part}] done in" in r.stderr and f"_Part {part}: " in text
    steps = table(text, "tiny")
    plain, step = float(steps["plain step (1 token + argmax)"][0]), float(steps["cpu tree: whole medusa_step"][0])
    assert float(steps["verify, N = 16"][0]) > 0 and float(steps["cpu tree: whole step / plain step (x)"][0]) == pytest.approx(step / plain, rel=0.05)
    stages = table(text, "stage")
    assert {"tokenizer", "backbone", "distill", "heads", "summary"} <= set(stages)
    assert float(stages["whole command (start-up, data and saving too)"][0]) > sum(
        float(v[0]) for k, v in stages.items() if not k.startswith("whole"))
    rows = table(text, "method")  # the first table headed "method": decode.py --compare
    assert list(rows)[:2] == ["plain greedy", "Medusa greedy"] and rows["Medusa greedy"][-1] == "yes"
    assert rows["plain greedy"][2] == "1.00" and rows["plain greedy"][5] == "1.00"  # tokens/step, speedup
    for tokens, steps_, per_step, ms, per_s, *_ in rows.values():
        assert 0 < int(tokens) <= 16 and int(steps_) > 0 and float(per_step) >= 1
        assert float(per_s) == pytest.approx(1000 / float(ms), rel=0.02)
    batch = text.split("## Batch sizes")[1]
    cells = [line.strip("|").split(" | ") for line in batch.splitlines() if line.startswith("| ") and "batch" not in line]
    assert sorted({int(c[1]) for c in cells}) == [1, 2, 4] and all(float(c[2]) > 0 for c in cells)
    assert all(float(c[3]) == 1.0 for c in cells if c[0].strip().startswith("plain"))


def batch_rows() -> list[dict]:
    return [{"method": m, "batch_size": b, "tokens_per_s": 100.0 * b * g, "speedup": g, "tokens_per_step": t}
            for b in (1, 2, 4) for m, g, t in (("plain greedy", 1.0, 1.0), ("Medusa greedy", 2.5 / b, 3.2))]


def cuda_settings(tmp_path, **kw) -> Namespace:
    base = dict(out=str(tmp_path / "r.md"), parts=list(gpu_report.PARTS), device="cuda", quick=False, ckpt=str(tmp_path),
                configs=["gpt2"], dtypes=["bfloat16"], budget_s=100.0, train_flags=[], decode_flags=[], append=False,
                compile=["--compile"])
    return Namespace(**{**base, **kw})


def faked(monkeypatch, reply) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(gpu_report, "run_script", lambda argv, **_: calls.append(argv) or reply(argv))
    return calls


def test_batch_part_asks_decode_for_every_batch_size_compiled_on_cuda_and_tabulates_its_rows(tmp_path, monkeypatch):
    calls = faked(monkeypatch, lambda argv: ScriptRun(argv, 0, json.dumps({"rows": batch_rows()}), "", 0.5))
    section, ok = gpu_report.batch_part(cuda_settings(tmp_path))
    (argv,) = calls
    assert ok and argv[argv.index("--batch-size") + 1] == "1,2,4,8,16"
    assert {"--compile", "--json", "--compare"} <= set(argv) and "--batch-sizes" not in argv
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")][1:]
    assert [[r["method"], str(r["batch_size"])] for r in batch_rows()] == [[c.strip() for c in row[:2]] for row in rows]
    assert [float(row[2]) for row in rows] == pytest.approx([r["tokens_per_s"] for r in batch_rows()], rel=0.01)
    lacking = [{k: v for k, v in batch_rows()[0].items() if k != "speedup"}]  # a row without a needed field
    faked(monkeypatch, lambda argv: ScriptRun(argv, 0, json.dumps({"rows": lacking}), "", 0.5))
    section, ok = gpu_report.batch_part(cuda_settings(tmp_path))
    assert not ok and "Failed: a row lacks speedup" in section


def test_step_part_on_cuda_compiles_and_names_what_its_budget_did_not_reach(tmp_path, monkeypatch):
    small = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=32)
    measured = json.loads(json.dumps(bench_config(small, device=torch.device("cpu"), repeat=1, warmup=1, prefix_len=8,
                                                  nodes=(1, 64), compiled=True, dtype=torch.bfloat16,
                                                  compile_backend="eager")))  # the JSON keys bench_step prints
    calls = faked(monkeypatch, lambda argv: ScriptRun(argv, None, "", "", 99.0) if "gpt2-xl" in argv else
                  ScriptRun(argv, 0, json.dumps({"configs": {"gpt2 bfloat16 compiled": measured}}), "", 1.0))
    section, ok = gpu_report.step_part(cuda_settings(tmp_path, configs=["gpt2", "gpt2-xl"]))
    assert not ok and all("--compile" in argv for argv in calls) and measured["compiled"]
    summary = table(section, "shape and variant")["gpt2 bfloat16 compiled"]
    assert float(summary[1]) == pytest.approx(measured["verify_ms"]["64"], rel=0.01)
    assert float(summary[3]) == pytest.approx(measured["medusa"]["cpu"]["step_vs_verify"], rel=0.01)
    assert "gpt2-xl bfloat16: stopped at its budget" in section


def test_train_and_decode_parts_on_cuda_take_the_gpu_preset_and_compiled_bfloat16_steps(tmp_path, monkeypatch):
    log = ("tokenizer  4096 tokens, trained in 12.5s\nsummary    validation loss 3.210 nats/token\n"
           "           head   1   2\nstages     backbone 201.3 s (peak 7.25 GiB), distill 20.1 s (peak 1.50 GiB), "
           "heads 60.0 s (peak 5.00 GiB), summary 9.9 s (peak 0.75 GiB)\nsaved      out/x\n")
    calls = faked(monkeypatch, lambda argv: ScriptRun(argv, 0, log, "", 320.0))
    section, ok = gpu_report.train_part(cuda_settings(tmp_path))
    assert ok and calls[0][:3] == ["train_tiny.py", "--preset", "gpu"] and "cuda" in calls[0]
    stages = table(section, "stage")
    assert stages["backbone"] == ["201.30", "7.25"] and stages["tokenizer"] == ["12.50", "-"]
    assert stages["whole command (start-up, data and saving too)"][0] == "320.00" and "validation loss 3.210" in section
    calls = faked(monkeypatch, lambda argv: ScriptRun(argv, 1, "", "decode.py: error: boom\n", 2.0))
    section, ok = gpu_report.decode_part(cuda_settings(tmp_path))
    assert not ok and "Failed: exit status 1" in section and "boom" in section
    assert {"--compare", "--json", "--compile"} <= set(calls[0]) and calls[0][calls[0].index("--dtype") + 1] == "bfloat16"


def test_header_on_cuda_names_the_gpu_and_its_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    text = gpu_report.header(cuda_settings(tmp_path), ["--out", "r.md"])
    assert text.startswith("# medusa_mini on NVIDIA H100 80GB HBM3")
    assert table(text, "")["device"] == ["cuda: NVIDIA H100 80GB HBM3, 80 GiB"]


def test_a_command_past_its_budget_is_stopped_and_says_so():
    run = gpu_report.run_script(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout_s=1,
                                label="sleep")
    assert run.returncode is None and run.stdout == "started\n" and run.seconds < 30
    assert run.failure().startswith("stopped at its budget")


def test_a_failed_part_is_written_into_the_report_and_exits_1(tmp_path, capsys):
    out = tmp_path / "r.md"
    assert gpu_report.main(["--device", "cpu", "--quick", "--part", "train", "--out", str(out), "--ckpt",
                            str(tmp_path / "ckpt"), "--train-flags", "--n-embd 30 --n-head 4"]) == 1
    assert "Failed: exit status 2" in out.read_text() and "divisible" in out.read_text()
    assert "failed: train" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--part", "nope"], "--part"), (["--device", "tpu"], "unknown device"), (["--budget-s", "0"], "--budget-s"),
    (["--configs", "gpt5"], "--configs"), (["--dtypes", "float8"], "--dtypes"),
    (["--part", "decode", "--ckpt", "no/such/dir"], "no checkpoint"), (["--train-flags", "'unclosed"], "quotation"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        gpu_report.main(["--out", str(tmp_path / "r.md"), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and needle in err and not (tmp_path / "r.md").exists()
