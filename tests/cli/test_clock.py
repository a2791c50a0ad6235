"""The clock every figure is read from (cli/common.py): on CUDA it waits for the device before starting
and after the last kernel; runs take turns; and of repeated runs the fastest counts, warm-ups never."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from medusa_mini.cli import common, runs
from medusa_mini.decoding import GenerationStats


class FakeEvent:
    """A CUDA event on the host: the log says when it was recorded and waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record(self) -> None:
        self.log.append(f"{self.name} recorded")

    def synchronize(self) -> None:
        self.log.append(f"{self.name} waited for")

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 250.0  # ms


def test_on_cuda_the_clock_waits_for_the_device_before_starting_and_for_the_end_event_before_reading(monkeypatch):
    log: list[str] = []
    names = iter(["start", "end"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("device idle"))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: FakeEvent(log, next(names)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    result, seconds = common.timed("cuda", lambda: log.append("kernels launched") or 7)
    assert (result, seconds) == (7, 0.25)
    assert log == ["device idle", "start recorded", "kernels launched", "end recorded", "end waited for"]


def test_calls_take_turns_round_by_round():
    order: list[str] = []
    common.in_turns({k: (lambda k=k: order.append(k)) for k in "abc"}, rounds=2, device="cpu",
                    before_each=lambda: order.append("reset"))
    assert order == ["reset", "a", "reset", "b", "reset", "c"] * 2


@pytest.mark.parametrize("seconds", [[0.3, 0.1, 0.2], [0.1, 0.3, 0.2]])
def test_of_repeated_runs_the_fastest_counts_and_the_warm_up_is_never_one_of_them(monkeypatch, seconds):
    """run_in_turns: one short untimed run per method, then `repeat` timed ones; the fastest per batch."""
    timed_rounds: list[int] = []

    def fake_in_turns(calls, *, rounds, device):
        timed_rounds.append(rounds)
        stats = GenerationStats(prompt_tokens=1, steps=1, step_tokens=[1])
        return {key: [([([5, 6], stats)], s) for s in (seconds[:rounds] if rounds > 1 else [9.0])] for key in calls}

    monkeypatch.setattr(runs, "in_turns", fake_in_turns)
    method = runs.Method("plain", runs.Sampling())
    engine = runs.Engine(ck=SimpleNamespace(model=SimpleNamespace(device=torch.device("cpu"))))
    got, unsteady = runs.run_in_turns(engine, [method], [[[1, 2]]], max_new_tokens=4, seed=0,
                                      repeat=3)
    assert timed_rounds == [1, 3] and got["plain_greedy"][0][1] == 0.1 and not unsteady
