"""Clocks around decoding calls: on CUDA they must time the device the model runs on. Checked on a CPU
with fakes of torch.cuda's events, device contexts and synchronisation."""

from __future__ import annotations

import pytest
import torch

from medusa_mini.tune.clock import time_in_turns


class FakeCuda:
    """Stands in for torch.cuda: a current device changed by `device(...)` contexts, and events that
    remember which device was current when they were made and recorded (their stream's device)."""

    def __init__(self) -> None:
        self.current = 0
        self.log: list[tuple[str, int]] = []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.made_on, self.recorded_on = fake.current, None
                fake.log.append(("event", fake.current))

            def record(self, stream=None) -> None:
                assert stream is None  # the current device's current stream
                self.recorded_on = fake.current
                fake.log.append(("record", fake.current))

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end) -> float:
                return 2.5

        class device:
            def __init__(self, dev) -> None:
                dev = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
                self.index = dev.index if dev.index is not None else fake.current

            def __enter__(self):
                self.previous, fake.current = fake.current, self.index
                return self

            def __exit__(self, *exc) -> None:
                fake.current = self.previous

        self.Event, self.device = Event, device

    def synchronize(self, device=None) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def test_cuda_events_are_recorded_on_the_models_device_not_the_current_one(fake_cuda):
    seen = []
    steps = {"a": lambda: seen.append(("a", fake_cuda.current)), "b": lambda: seen.append(("b", fake_cuda.current))}
    ms, _ = time_in_turns(steps, reset=lambda: None, device=torch.device("cuda:1"), repeat=2, warmup=1)
    assert ms == {"a": 2.5, "b": 2.5}  # the events' own time, not a wall clock
    events = [d for what, d in fake_cuda.log if what == "event"]
    records = [d for what, d in fake_cuda.log if what == "record"]
    assert len(events) == len(records) == 2 * 3 * 2  # two events per call, two steps, three rounds
    assert set(events) == set(records) == {1}  # made and recorded on cuda:1, whose stream runs the step
    assert {d for _, d in seen} == {1} and fake_cuda.current == 0  # the current device is given back


def test_on_a_cpu_a_wall_clock_times_the_steps_and_cuda_is_never_touched(fake_cuda):
    ms, first = time_in_turns({"a": lambda: None}, reset=lambda: None, device=torch.device("cpu"),
                              repeat=3, warmup=0)
    assert fake_cuda.log == [] and ms["a"] >= 0.0 and first >= 0.0
