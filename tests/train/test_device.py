"""How training uses its device, checked on a CPU: CUDA's answers are faked where only a GPU has them."""

from __future__ import annotations

import pytest
import torch

from medusa_mini.cli.common import pick_dtype
from medusa_mini.train.config import TrainError
from medusa_mini.train.device import check_dtype, default_dtype


@pytest.fixture
def gpu_capability(monkeypatch):
    """Fakes torch.cuda's view of the GPUs: each has the compute capability set in the returned dict
    (every index: `caps["all"]`); records which device each question named."""
    caps = {"all": (8, 0)}
    asked = []

    def get_device_capability(device=None):
        asked.append(device)
        index = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
        return caps.get(index, caps["all"])

    def no_current_device_question(*args, **kwargs):
        raise AssertionError("the current device was asked; the target device must be")

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", no_current_device_question)
    monkeypatch.setattr(torch.cuda, "current_device", no_current_device_question)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    caps["asked"] = asked
    return caps


@pytest.mark.parametrize("cap, want", [((7, 5), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")])
def test_gpus_from_ampere_on_train_and_decode_in_bfloat16_older_ones_refuse_it_in_one_line(gpu_capability, cap, want):
    gpu_capability["all"] = cap  # (7, 5): a T4, bfloat16 only emulated
    assert default_dtype("cuda:1") == want
    assert pick_dtype(want, torch.device("cuda:1")) is getattr(torch, want)
    if want == "bfloat16":
        check_dtype("bfloat16", "cuda:1")
        return
    for error, refuse in ((TrainError, lambda: check_dtype("bfloat16", "cuda:1")),
                          (ValueError, lambda: pick_dtype("bfloat16", torch.device("cuda:1")))):
        with pytest.raises(error, match="float16") as err:
            refuse()
        assert len(str(err.value).splitlines()) == 1


def test_the_capability_is_asked_of_the_target_gpu_not_the_current_one(gpu_capability, monkeypatch):
    gpu_capability["all"], gpu_capability[1] = (7, 0), (8, 6)  # GPU 0 a V100, GPU 1 an A6000
    assert default_dtype("cuda:1") == "bfloat16"
    pick_dtype("bfloat16", torch.device("cuda:1"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun "cuda" is this rank's GPU, not GPU 0
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_dtype("cuda") == "bfloat16"
    check_dtype("bfloat16", "cuda")
    assert [torch.device("cuda", a).index if isinstance(a, int) else torch.device(a).index
            for a in gpu_capability["asked"]] == [1, 1, 1, 1]


def test_a_cpu_never_asks_cuda(gpu_capability):
    assert default_dtype("cpu") == "float32"
    check_dtype("bfloat16", "cpu")
    assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert gpu_capability["asked"] == []
