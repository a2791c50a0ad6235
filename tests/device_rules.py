"""CUDA's device rules on any device, for tests that run the GPU path on a CPU (test_meta_device.py, test_step.py)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostRead(Exception):
    """A device value was read on the host, where a GPU waits for its queued work."""


class CudaRules(TorchDispatchMode):
    """A dispatch mode: CUDA's device checks on every operator below Python, on any device. Each host read
    of a device value stops (`HostRead`) or, with answer_reads, gets made-up values of the right shape:
    zeros, True for booleans (so every node is usable, and a rule's walk runs). `uploads` counts what the
    host sends: tensors built from host data, copies to the device.

    An operator may mix devices only as CUDA lets it: a 0-dim CPU tensor counts as a scalar, advanced
    indexing takes CPU index tensors, a copy goes anywhere. A draw's generator must be on its device;
    `device_generator` is a CPU generator counted as the checked device's own."""

    COPIES = ("aten::_to_copy", "aten::copy_")
    INDEXING = ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_")
    DATA_DEPENDENT = ("aten::nonzero", "aten::masked_select", "aten::equal")  # shapes or answers need the data

    def __init__(self, device: torch.device, *, device_generator: torch.Generator | None = None,
                 answer_reads: bool = False) -> None:
        super().__init__()
        self.device, self.device_generator, self.answer_reads = device, device_generator, answer_reads
        self.reads = self.uploads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, func._schema.name
        self.uploads += self.sends(name, args, kwargs)
        if name == "aten::_local_scalar_dense" and args[0].device == self.device:  # item, int, bool
            return self.host_read(name, made_up(args[0].dtype))
        if name == "aten::_to_copy" and args[0].device == self.device != kwargs.get("device", self.device):
            dtype = kwargs.get("dtype") or args[0].dtype  # tolist, .cpu(), .to("cpu")
            return self.host_read(name, torch.full(args[0].shape, made_up(dtype), dtype=dtype, device=kwargs["device"]))
        if name == "aten::copy_" and args[1].device == self.device and args[0].device != self.device:
            return self.host_read(name, args[0].fill_(made_up(args[0].dtype)))
        if name in self.DATA_DEPENDENT and any(getattr(a, "device", None) == self.device for a in args):
            raise HostRead(name)  # answering would need a made-up shape
        if name not in self.COPIES:
            self.check_devices(func, name, args, kwargs)
        return func(*args, **kwargs)

    def sends(self, name: str, args, kwargs) -> bool:
        """A tensor built from host data, or copied from the host to the device (on a GPU, from pageable memory)."""
        return (name == "aten::lift_fresh"
                or name == "aten::_to_copy" and args[0].device != self.device == kwargs.get("device")
                or name == "aten::copy_" and args[0].device == self.device != args[1].device)

    def host_read(self, name: str, answer):
        if not self.answer_reads:
            raise HostRead(name)
        self.reads += 1
        return answer

    def check_devices(self, func, name: str, args, kwargs) -> None:
        leaves = tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if name in self.INDEXING:  # the indices may stay on the host: only self and the values count
            tensors = [args[0]] + ([args[2]] if len(args) > 2 and isinstance(args[2], torch.Tensor) else [])
        devices = {t.device for t in tensors if t.dim() > 0}
        if len(devices) > 1:
            raise RuntimeError(f"{func}: expected all tensors on one device, found {sorted(map(str, devices))}")
        target = kwargs.get("device") or (tensors[0].device if tensors else None)
        for gen in (g for g in leaves if isinstance(g, torch.Generator)):
            # The dispatcher hands over a new Python object for the same generator: compare the C++ one.
            where = self.device if gen._cdata == getattr(self.device_generator, "_cdata", None) else gen.device
            if target is not None and where.type != torch.device(target).type:
                raise RuntimeError(f"{func}: a generator on device {where} draws for device {target}")


def made_up(dtype: torch.dtype) -> bool | int:
    return True if dtype == torch.bool else 0
