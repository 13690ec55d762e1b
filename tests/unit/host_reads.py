"""Counting the places where the host waits on the device, by watching torch calls.

On a GPU every read of a device tensor's values (`.item()`, `int()`, `bool()`, `.tolist()`,
`.numpy()`, `.cpu()`) and a few ops whose output size depends on values (`nonzero`, boolean
masks, `masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`) make the
host wait for the device. On a CPU those cost nothing, so a CPU test cannot time them: it counts
them. `HostReads` counts both kinds, at the torch-function level (value reads that never reach
the dispatcher: tolist, numpy) and at the dispatcher (scalar reads and value-sized ops, however
deep inside another op they happen).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {torch.Tensor.tolist, torch.Tensor.numpy}
_MOVES = {torch.Tensor.cpu, torch.Tensor.to}
_VALUE_SIZED = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "bincount",
                "masked_scatter", "_local_scalar_dense"}


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Functions(TorchFunctionMode):
    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self.seen.append(func.__name__)
        elif func in _MOVES and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if func is torch.Tensor.cpu or str(target).startswith("cpu"):
                self.seen.append(f"{func.__name__} to host")
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in _VALUE_SIZED:
            self.seen.append(name)
        elif name == "repeat_interleave" and func._overloadname == "Tensor" and (kwargs or {}).get("output_size") is None:
            self.seen.append(name)
        elif name in ("index", "index_put", "index_put_") and _is_bool_index(args[1]):
            self.seen.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


class HostReads:
    """`with HostReads() as reads: ...`, then `reads.seen` lists each host wait, `len(reads)` counts them."""

    def __init__(self):
        self.seen: list[str] = []
        self._modes = (_Functions(self.seen), _Dispatch(self.seen))

    def __enter__(self) -> "HostReads":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.seen)
