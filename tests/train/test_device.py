"""One rule for number formats, decoding and training alike, checked on a CPU: CUDA's answers are faked."""

import contextlib

import pytest
import torch

from medusa_mini.train.device import pick_device, pick_dtype, rank_device, training_dtype


@pytest.fixture
def gpu_capability(monkeypatch):
    """Fakes torch.cuda's view of the GPUs: GPU i has the compute capability caps[i], else caps["all"];
    caps["asked"] lists the GPUs asked. Asking the current device instead of the target fails."""
    caps = {"all": (8, 0), "asked": []}

    def get_device_capability(device):
        caps["asked"].append(index := torch.device(device).index)
        return caps.get(index, caps["all"])

    for name in ("is_bf16_supported", "current_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: pytest.fail("the current device was asked"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return caps


@pytest.mark.parametrize("cap, native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_gpus_from_ampere_on_train_and_decode_in_bfloat16_older_ones_refuse_it_in_one_line(gpu_capability, cap, native):
    gpu_capability["all"] = cap  # (7, 5): a T4, bfloat16 only emulated
    assert training_dtype(None, "cuda:1") == ("bfloat16" if native else "float16")
    for use in (lambda: pick_dtype("bfloat16", torch.device("cuda:1")), lambda: training_dtype("bfloat16", "cuda:1")):
        with contextlib.nullcontext() if native else pytest.raises(ValueError, match="float16") as err:
            use()
        assert native or "\n" not in str(err.value)


def test_the_capability_is_asked_of_each_ranks_gpu_not_the_current_one(gpu_capability, monkeypatch):
    gpu_capability["all"], gpu_capability[1] = (7, 0), (8, 6)  # GPU 0 a V100, GPU 1 an A6000
    assert training_dtype(None, "cuda:1") == "bfloat16" and training_dtype(None, "cuda:0") == "float16"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("cuda") == "cuda"  # one process: the current GPU
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun "cuda" is this rank's GPU, not GPU 0
    assert rank_device("cuda") == "cuda:1" and rank_device("cpu") == "cpu"


def test_a_cpu_trains_in_float32_by_default_never_in_float16_and_never_asks_cuda(gpu_capability):
    assert training_dtype(None, "cpu") == "float32" and training_dtype("bfloat16", "cpu") == "bfloat16"
    assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    pytest.raises(ValueError, training_dtype, "float16", "cpu").match("float16 needs CUDA")
    assert gpu_capability["asked"] == []


def test_a_device_must_be_one_this_machine_has(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU: cuda and cuda:0 name it
    assert [str(pick_device(name)) for name in ("cpu", "cuda", "cuda:0")] == ["cpu", "cuda", "cuda:0"]
    for name, message in (("cuda:1", "is not here"), ("mps", "not supported"), ("gpu", "unknown device")):
        pytest.raises(ValueError, pick_device, name).match(message)
