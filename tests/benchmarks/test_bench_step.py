"""benchmarks/bench_step.py reports every stage of a step it promises (no timing assertions: machines are noisy)."""

import json
import re

import pytest
import torch

import benchmarks.bench_step as bench_step
from benchmarks.bench_step import CONFIGS, OP_RULES, STAGES, bench_config, check_config, count_ops, main, verify_tree
from conftest import refused
from medusa_mini.cli.compiled import CompiledMedusa
from medusa_mini.model import GPTConfig

SMALL = GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)
ONCE_ON_SMALL = ["--configs", "small", "--repeat", "1", "--warmup", "1", "--prefix", "16", "--threads", "1"]
pytestmark = pytest.mark.usefixtures("one_thread")  # restores the thread count that --threads sets process-wide


def test_the_table_prints_every_stage_the_heads_share_of_a_plain_step_and_the_step_over_its_verify(capsys, monkeypatch):
    monkeypatch.setitem(bench_step.CONFIGS, "small", SMALL)
    main([*ONCE_ON_SMALL, "--nodes", "1,4", "--draft-vocab", "16", "--prefix", "59"])  # the longest: 64 - depth 4 - 1
    lines = capsys.readouterr().out.splitlines()
    cells = dict(re.split(r"\s{2,}", line.strip()) for line in lines if re.search(r"\S\s{2,}\S", line))
    assert cells["layers / heads / width / vocabulary / draft"] == "2 / 2 / 32 / 64 / 16"
    labels = ["plain step (1 token + argmax)", "verify, N = 1", "verify, N = 4"]
    for tree, nodes in (("cpu", 12), ("gpu", 68)):
        labels += [f"{tree} tree ({nodes} nodes incl. root): {stage}" for stage in STAGES]
        labels += [f"{tree} tree: {what}" for what in ("heads / plain step (%)", "whole step / verify alone (x)")]
    assert all(float(cells[label]) >= 0 for label in labels)  # a stage of a fast machine may print 0.00
    plain = [int(n) for n in cells["plain step, device operations (greedy / sampling)"].split(" / ")]
    ops = {rule: cells[f"cpu tree: {rule} step, device operations (x plain)"].split() for rule in OP_RULES}
    assert plain[0] < plain[1] and all(int(n) > plain[0] for n, _ in ops.values())  # a Medusa step adds to plain's
    for rule, (n, ratio) in ops.items():  # against the plain step of its temperature: greedy's, else sampling's
        assert ratio == f"({int(n) / plain[rule != 'greedy']:.2f})", rule
    assert bench_step.parse_args(["--configs", "tiny,gpt2,tiny"]).configs == ["tiny", "gpt2"]  # one column a name


def test_the_operation_count_sees_every_device_operation_but_views_and_host_reads():
    x = torch.arange(6.0)
    assert count_ops(lambda: (x.view(2, 3).t()[0], x[1:].tolist(), x.sum().item())) == {"aten::sum": 1}
    assert count_ops(lambda: (x + x).argmax().half()) == {f"aten::{n}": 1 for n in ("add", "argmax", "_to_copy")}


def test_the_draft_vocabulary_is_4096_tokens_for_gpt2_shapes_and_all_for_tiny_unless_asked():
    for config, asked, size in (("gpt2", None, 4096), ("tiny", None, 0), ("gpt2", 0, 0), ("tiny", 2048, 2048)):
        assert check_config(CONFIGS[config], prefix_len=128, draft_vocab=asked) == size


def test_compiled_steps_are_measured_like_eager_ones(monkeypatch):
    def proposal(self, *args, **kwargs):  # the whole step verifies the tree the step before drafted: no eager heads
        ahead, got = self.ahead, real(self, *args, **kwargs)
        drafted.append(ahead is not None and got is ahead[1])
        return got

    real, drafted, eager, verify = CompiledMedusa.proposal, [], [], bench_step.verify
    monkeypatch.setattr(CompiledMedusa, "proposal", proposal)  # and every verify timed is a graph, the trees' too:
    monkeypatch.setattr(bench_step, "verify", lambda *a, **kw: verify(*a, **kw) if torch.compiler.is_compiling()
                        else eager.append(a) or verify(*a, **kw))  # (a graph holds no append: one graph a shape)
    r = bench_config(SMALL, device=torch.device("cpu"), repeat=1, warmup=1, prefix_len=1, nodes=(1, 64),
                     compiled=True, compile_backend="eager")
    assert r["compiled"] and set(r["verify_ms"]) == {1, 64} and r["first_round_s"] > 0 and eager == []
    assert [verify_tree(n).num_nodes for n in (1, 2, 64, 128, 256)] == [1, 2, 64, 128, 256]  # verified: N nodes
    assert all(t > 0 for info in r["medusa"].values() for t in info["stages_ms"].values()) and drafted and all(drafted)


@pytest.mark.parametrize("case", [  # the error names what follows "->", else the first flag given
    "--configs gpt5", "--device tpu -> unknown device", "--prefix 0", "--configs tiny --prefix 252 -> --prefix",
    "--threads 0", "--warmup 0", "--dtypes float8", "--dtypes ,", "--nodes 4,x", "--nodes 300", "--draft-vocab 100000",
    "--draft-vocab 9",  # more tokens than the trees' ranks (9 is the last): 10 or more
    "--seed 99999999999999999999", "--seed -1", f"--threads {'9' * 9}"])
def test_bad_input_is_one_line_and_exit_status_2_before_any_measuring(case, capsys):
    args, _, needle = case.partition(" -> ")
    err = refused(capsys, main, args.split())
    assert err.startswith("python benchmarks/bench_step.py: error: ") and (needle or args.split()[0]) in err


def test_json_holds_every_stage_of_both_trees_per_dtype_and_names_the_command(capsys, monkeypatch):
    monkeypatch.setitem(bench_step.CONFIGS, "small", SMALL)
    main([*ONCE_ON_SMALL, "--dtypes", "float32,bfloat16", "--nodes", "2,100", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and out["threads"] == 1 and "--json" in out["command"]
    assert list(out["configs"]) == ["small", "small bfloat16"]
    for r, dtype in zip(out["configs"].values(), ["float32", "bfloat16"]):
        assert r["dtype"] == dtype and set(r["verify_ms"]) == {"2", "100"} and not r["compiled"]
        assert {name: info["nodes"] for name, info in r["medusa"].items()} == {"cpu": 12, "gpu": 68}
        for info in r["medusa"].values():
            assert list(ms := info["stages_ms"]) == list(STAGES) and all(t > 0 for t in ms.values())
            assert (info["heads_share"], info["step_vs_plain"], info["step_vs_verify"]) == (
                ms["heads"] / r["plain_ms"], ms["whole step"] / r["plain_ms"], ms["whole step"] / ms["verify"])
            assert 0 <= info["accepted"] < info["nodes"]
