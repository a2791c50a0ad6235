"""decode.py's other modes on a tiny saved checkpoint: the reference decoder, batches, the batch table
and the demo that needs no checkpoint."""

from __future__ import annotations

import functools
import json

import pytest

import decode  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *argv: str) -> str:
    assert decode.main(list(argv)) == 0
    return capsys.readouterr().out


def tokens_of(capsys, *argv: str) -> list[list[int]]:
    return [json.loads(line)["tokens"] for line in run(capsys, *argv, "--json").splitlines() if line.strip()]


@pytest.mark.parametrize("rule", [["--method", "greedy"], ["--method", "typical"], ["--method", "rejection"]])
def test_the_reference_decoder_prints_the_engines_tokens(ckpt, capsys, rule):
    argv = ["--ckpt", ckpt, "--max-new-tokens", "16", "--seed", "2", *rule]
    assert tokens_of(capsys, *argv, "--reference") == tokens_of(capsys, *argv)


def test_compare_with_the_reference_adds_its_rows_with_the_engines_tokens(ckpt, capsys):
    result = json.loads(run(capsys, "--ckpt", ckpt, "--compare", "--reference", "--json", "--max-new-tokens", "10"))
    rows = {r["key"]: r for r in result["rows"]}
    for rule in ("greedy", "typical", "rejection"):
        assert rows[f"reference_{rule}"]["tokens"] == rows[f"medusa_{rule}"]["tokens"]
        assert rows[f"reference_{rule}"]["same_as_engine"] == result["prompts"]
    out = run(capsys, "--ckpt", ckpt, "--compare", "--reference", "--max-new-tokens", "8")
    assert "reference greedy" in out and "the engine's tokens on 3/3 prompts" in out


@pytest.mark.parametrize("rule", [[], ["--method", "plain"]])
def test_a_batch_of_prompts_decodes_each_as_if_alone_when_greedy(ckpt, capsys, rule):
    argv = ["--ckpt", ckpt, "--max-new-tokens", "14", *rule]
    assert tokens_of(capsys, *argv, "--batch-size", "2") == tokens_of(capsys, *argv)


def test_the_batch_table_has_every_method_at_every_size_and_says_where_medusa_stops_paying(ckpt, capsys, tmp_path):
    plot = tmp_path / "batch.png"
    argv = ["--ckpt", ckpt, "--compare", "--batch-size", "1,2", "--max-new-tokens", "8"]
    result = json.loads(run(capsys, *argv, "--json"))
    rows = result["rows"]
    assert {(r["key"], r["batch_size"]) for r in rows} == {(k, b) for b in (1, 2) for k in (
        "plain_greedy", "medusa_greedy", "plain_sampling", "medusa_rejection")}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0 and r["tokens_per_step"] >= 1.0
        if r["key"].endswith("greedy"):
            assert r["same_as_plain_greedy"] is True  # every batch size makes batch 1's greedy tokens
    assert set(result["crossover"]) == {"medusa_greedy", "medusa_rejection"}
    out = run(capsys, *argv, "--plot", str(plot))
    verdicts = [line for line in out.splitlines()
                if any(v in line for v in ("stops paying at batch", "still pays at batch", "does not pay at any"))]
    assert len(verdicts) == 2  # one measured sentence per Medusa method
    assert plot.stat().st_size > 0  # what it draws: tests/cli/test_plots.py


@pytest.mark.slow
def test_the_demo_explains_a_step_without_any_checkpoint(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no out/tiny here
    # A third of the demo's training keeps the suite fast; the full demo's time is a benchmark (BENCHMARKS.md).
    monkeypatch.setattr(decode, "demo_checkpoint", functools.partial(decode.demo_checkpoint, steps=100))
    out = run(capsys, "--explain", "--demo")
    assert out.startswith("DEMO:") and "accepted path" in out and "7. Result" in out
