"""A CUDA device emulated on the CPU, so the engines' CUDA paths run in the CPU suite.

Every "cuda" tensor is a wrapper whose `.device` is cuda:0 around a real CPU tensor; ops run on
the CPU tensors, so the numbers are a CPU run's. What the emulator checks is what breaks when
code written on a CPU first meets a GPU:
  - devices: an op mixing a cuda tensor with a CPU tensor (other than a 0-dim scalar, index
    tensors, copies and `.to`) raises as CUDA does; `.numpy()` of a cuda tensor raises;
  - host reads: `.item()`, `.tolist()`, copies to the host and value-sized ops (`nonzero`, boolean
    masks, ...) are counted in `syncs`; with `torch.cuda.set_sync_debug_mode("error")` they raise;
  - CUDA graphs: `torch.cuda.graph(g)` records the ops it runs and `g.replay()` runs them again
    on the same tensors, writing each op's result into the tensor the capture made, so Python
    values baked in at capture stay baked in as on a GPU; a host read or a host <-> device copy
    inside a capture raises ("operation not permitted when stream is capturing").
Not modelled: streams and events (one in-order stream), memory pools, timing. Engines must run
under no_grad / inference_mode (a wrapper never requires grad).

`with FakeCuda() as cuda:` patches `torch.cuda` for the block (is_available() is True).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
_ACTIVE: list["FakeCuda"] = []
_VALUE_SIZED = {"nonzero", "masked_select", "unique", "unique_consecutive", "bincount", "masked_scatter"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}     # torch functions taking CPU indices
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__repr__", "__format__", "__str__"}
_METADATA = {"_has_compatible_shallow_copy_type", "is_same_size", "__len__", "dim", "size", "stride", "numel",
             "nelement", "element_size", "is_contiguous", "is_floating_point", "is_complex", "storage_offset",
             "__hash__", "get_device", "is_pinned", "__reduce_ex__", "__deepcopy__"}
_DEVICE_PROPS = {"device": CUDA, "is_cuda": True, "is_cpu": False}


class CapturingError(RuntimeError):
    pass


class DeviceTensor(torch.Tensor):
    """A tensor on the emulated cuda:0; `elem` holds its values (a CPU tensor)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=CUDA, requires_grad=False)
        r.elem = elem
        return r

    def __repr__(self):
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _emulator().dispatch(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _emulator().function(func, args, kwargs or {})


def real_cuda() -> bool:
    """A GPU is present (asked of the CUDA runtime, so an active emulator does not count)."""
    return torch.backends.cuda.is_built() and torch._C._cuda_getDeviceCount() > 0


def cuda_path(prefix: str = ""):
    """A test parameter for a CUDA path: on a GPU machine the real device (marked `cuda`), elsewhere
    the emulator (its value ends in "fake-cuda")."""
    return pytest.param(f"{prefix}cuda", marks=pytest.mark.cuda) if real_cuda() else f"{prefix}fake-cuda"


EMULATOR = pytest.StashKey()      # the emulator a module's fixture holds up, for conftest's pausing fixture


@contextlib.contextmanager
def emulated_cuda(config):
    """A module-scoped fixture's emulator: up while the tests of its parameter (one whose value ends
    in "fake-cuda") run; paused for any other test pytest runs meanwhile."""
    with FakeCuda() as emulator:
        config.stash[EMULATOR] = emulator
        try:
            yield emulator
        finally:
            config.stash[EMULATOR] = None


def _emulator() -> "FakeCuda":
    if not _ACTIVE:
        raise RuntimeError("a fake cuda tensor was used outside its FakeCuda block")
    return _ACTIVE[-1]


def _is_cuda(x) -> bool:
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.startswith("cuda")


def _unwrap(x):
    if isinstance(x, DeviceTensor):
        return x.elem
    return CPU if _is_cuda(x) else x


def _wrap(x):
    return DeviceTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, DeviceTensor) else x


def tree_map(fn, x):
    """fn over the leaves of nested tuples, lists and dicts (torch's pytree is ~10x slower here)."""
    if isinstance(x, (list, tuple)):
        items = [tree_map(fn, v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)     # namedtuples take fields
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    return fn(x)


def _tensors(tree, out: list | None = None) -> list[torch.Tensor]:
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _tensors(v, out)
    elif isinstance(tree, dict):
        for v in tree.values():
            _tensors(v, out)
    return out


class _Props:
    name = "emulated CUDA device (CPU)"
    major, minor = 9, 0
    total_memory = 80 << 30
    multi_processor_count = 132


_PROPS = _Props()


class _Noop:
    """A stream or an event of the one in-order stream: waits, records and synchronizes do nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: True if name == "query" else (_Noop() if name == "record_event" else None)


class _Graph:
    """A captured graph: the recorded ops, replayed in order."""

    def __init__(self, *args, **kwargs):
        self.ops: list[Callable[[], None]] = []

    def replay(self) -> None:
        emu = _emulator()
        emu.replays += 1
        for op in self.ops:
            op()

    def reset(self) -> None:
        self.ops = []


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _emulator().function(func, args, kwargs or {})


class FakeCuda:
    def __init__(self):
        self.syncs: list[str] = []        # every host read of device values, by op name
        self.capture: list | None = None  # the ops of the graph being captured
        self.sync_error = False
        self.replays = 0
        self._stack: contextlib.ExitStack | None = None

    # -- torch.cuda, patched ---------------------------------------------------------------
    def __enter__(self) -> "FakeCuda":
        self._install()
        return self

    def __exit__(self, *exc) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    @contextlib.contextmanager
    def paused(self):
        """The real torch for a while (a CPU test that runs while a module's emulator is up)."""
        if self._stack is None:
            yield
            return
        self.__exit__()
        try:
            yield
        finally:
            self._install()

    def _install(self) -> None:
        import torch.cuda as tc

        stack, patch = contextlib.ExitStack(), pytest.MonkeyPatch()
        stack.callback(patch.undo)
        patches = {
            "_lazy_init": lambda: None, "is_available": lambda: True, "device_count": lambda: 1,
            "current_device": lambda: 0, "synchronize": lambda *a, **k: None, "empty_cache": lambda: None,
            "set_per_process_memory_fraction": lambda *a, **k: None, "Stream": _Noop,
            "current_stream": lambda *a, **k: _Noop(), "stream": lambda s=None: contextlib.nullcontext(),
            "Event": _Noop, "CUDAGraph": _Graph, "graph_pool_handle": lambda: object(), "graph": self._graph,
            "get_device_capability": lambda *a, **k: (9, 0), "get_device_properties": lambda *a, **k: _PROPS,
            "get_device_name": lambda *a, **k: _PROPS.name, "memory_allocated": _allocated,
            "max_memory_allocated": _allocated, "reset_peak_memory_stats": lambda *a, **k: None,
            "set_sync_debug_mode": self._sync_mode, "get_sync_debug_mode": lambda: int(self.sync_error) * 2,
        }
        for name, value in patches.items():
            patch.setattr(tc, name, value, raising=False)
        # Module.to swaps each parameter for its moved copy (the default re-points `.data`, which
        # would leave a plain Parameter claiming cuda with no values behind it)
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        stack.callback(torch.__future__.set_swap_module_params_on_conversion, swap)
        _ACTIVE.append(self)
        stack.callback(_ACTIVE.pop)
        stack.enter_context(_Functions())
        self._stack = stack

    def _sync_mode(self, mode) -> None:
        self.sync_error = mode in ("error", 2)

    @contextlib.contextmanager
    def _graph(self, graph: _Graph, pool=None, stream=None, **kwargs):
        if self.capture is not None:
            raise CapturingError("a CUDA graph capture inside another")
        graph.ops = []
        self.capture = graph.ops
        try:
            yield graph
        finally:
            self.capture = None

    # -- checks ----------------------------------------------------------------------------
    def _crossing(self, from_device: bool, to_device: bool) -> None:
        """A copy between host and device: reading back waits for the device; an upload cannot
        be captured (the graph would read host memory that is gone by replay)."""
        if from_device and not to_device:
            self._read("copy to host")
        elif to_device and not from_device and self.capture is not None:
            raise CapturingError("host-to-device copy inside a capture")

    def _read(self, what: str) -> None:
        """The host waits for the device here."""
        if self.capture is not None:
            raise CapturingError(f"{what}: operation not permitted when stream is capturing")
        if self.sync_error:
            raise RuntimeError(f"called a synchronizing CUDA operation ({what})")
        self.syncs.append(what)

    # -- torch functions (before the dispatcher) ---------------------------------------------
    def function(self, func, args, kwargs):
        """Every torch call that touches a device tensor or names the cuda device runs here on the
        CPU values (some Python bindings would otherwise look for a CUDA runtime first)."""
        with torch._C.DisableTorchFunctionSubclass():
            name = getattr(func, "__name__", "")
            if name == "__get__":
                return self._property(func, args)
            if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
                return self._to(func, args, kwargs)
            if name in _METADATA:
                return func(*args, **kwargs)
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}      # no pinned allocator without CUDA
            tensors = _tensors((args, kwargs))
            if not any(isinstance(t, DeviceTensor) for t in tensors) and not _is_cuda(kwargs.get("device")):
                return func(*args, **kwargs)
            if name in _READS:
                self._read(name)
                return func(*tree_map(_unwrap, args), **kwargs)
            if func is torch.Tensor.numpy:
                raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                                "the tensor to host memory first.")
            if func is torch.Tensor.copy_:
                return self._copy_into(args[0], args[1])
            if func in (torch.Tensor.pin_memory, torch.Tensor.requires_grad_):
                return args[0]
            self._check(func, name, args, kwargs, tensors)
            if func in (torch.tensor, torch.as_tensor, torch.asarray) and self.capture is not None:
                raise CapturingError("host-to-device copy (torch.tensor) inside a capture")
            if _sized_by_values(name, args, kwargs):
                self._read(name)
            a, k = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
            k.pop("pin_memory", None)
            if name == "histc" and not a[0].is_floating_point():
                func, a = _histc_int, (a[0], *a[1:])        # CUDA counts integers; the CPU kernel does not
            out = func(*a, **k)
            if self.capture is not None:
                self.capture.append(_replayer(func, a, k, out))
            return _rewrap(out, args)

    def _property(self, func, args):
        prop = getattr(func.__self__, "__name__", "")
        x = args[0]
        if not isinstance(x, DeviceTensor):
            return func(*args)
        if prop in _DEVICE_PROPS:
            return _DEVICE_PROPS[prop]
        if prop == "data":
            return DeviceTensor(x.elem.data)
        if prop in ("grad", "_base", "grad_fn"):
            return None
        return _rewrap(func(x.elem), args)

    def _check(self, func, name, args, kwargs, tensors) -> None:
        """CUDA's device rules: one device per op, bar 0-dim CPU scalars, CPU index tensors and the
        value of an indexed assignment; a generator on the op's device; no host copy in a capture."""
        lenient = _tensors(args[1:]) if name in _INDEXING else []
        for t in tensors:
            if isinstance(t, DeviceTensor) or t.dim() == 0:
                continue
            if not any(t is x for x in lenient):
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, cuda:0 and cpu! ({name})")
            if self.capture is not None:
                raise CapturingError(f"host-to-device copy ({name} with a CPU tensor) inside a capture")
        if name in _INDEXING and self.capture is not None and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, list) for i in index):     # a Python list index is uploaded per call
                raise CapturingError(f"host-to-device copy ({name} with a list index) inside a capture")
        gen = kwargs.get("generator")
        if gen is not None and gen.device.type != "cuda":
            raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{gen.device.type}' ({name})")

    def _to(self, func, args, kwargs):
        x = args[0]
        if func is torch.Tensor.cpu:
            device, dtype = CPU, None
        elif func is torch.Tensor.cuda:
            device, dtype = CUDA, None
        else:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **parse)
        src = x.elem if isinstance(x, DeviceTensor) else x
        on_cuda = isinstance(x, DeviceTensor)
        to_cuda = on_cuda if device is None else device.type == "cuda"
        if on_cuda == to_cuda and (dtype is None or dtype == x.dtype) and not kwargs.get("copy"):
            return x
        self._crossing(on_cuda, to_cuda)
        out = src.to(dtype=dtype or x.dtype, copy=True)
        if to_cuda and on_cuda and self.capture is not None:
            self.capture.append(lambda: out.copy_(src))
        return DeviceTensor(out) if to_cuda else out

    def _copy_into(self, dst, src):
        into = isinstance(dst, DeviceTensor)
        self._crossing(isinstance(src, DeviceTensor), into)
        d, s = _unwrap(dst), _unwrap(src)
        d.copy_(s)
        if into and self.capture is not None:
            self.capture.append(lambda: d.copy_(s))
        return dst

    # -- the dispatcher: ops that reach a device tensor without passing `function` (C++ internals) --
    def dispatch(self, func, args, kwargs):
        name = func._overloadpacket.__name__
        if name == "_has_compatible_shallow_copy_type":
            return isinstance(args[0], DeviceTensor) == isinstance(args[1], DeviceTensor)
        if name == "_local_scalar_dense":
            self._read("item")
            return func(_unwrap(args[0]))
        to_cuda = _is_cuda(kwargs.get("device")) or (isinstance(args[0], DeviceTensor) and "device" not in kwargs)
        if name in ("copy_", "_to_copy"):
            self._crossing(isinstance(args[1] if name == "copy_" else args[0], DeviceTensor), to_cuda)
        elif any(not isinstance(t, DeviceTensor) and t.dim() > 0 for t in _tensors((args, kwargs))):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({func})")
        a, k = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        k.pop("pin_memory", None)
        out = func(*a, **k)
        if self.capture is not None:
            self.capture.append(_replayer(func, a, k, out))
        if name == "copy_":
            return args[0]
        return tree_map(_wrap, out) if to_cuda or name != "_to_copy" else out


def _sized_by_values(name: str, args, kwargs) -> bool:
    """A torch call whose output size depends on values: the host reads them to allocate it."""
    if name in _VALUE_SIZED:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and len(args) > 1 and isinstance(args[1], torch.Tensor)
    if name in _INDEXING:
        return any(t.dtype == torch.bool and t.dim() > 0 for t in _tensors(args[1]))
    return False


def _allocated(*args, **kwargs) -> int:
    """Bytes held by live device tensors (each storage once). Peaks are not tracked: the maximum is
    the current figure."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) is DeviceTensor and hasattr(obj, "elem"):      # type(): isinstance wakes lazy modules
            st = obj.elem.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _histc_int(x, *args, **kwargs):
    return torch.histc(x.double(), *args, **kwargs).to(x.dtype)


def _rewrap(out, args):
    """A device op's CPU results as device tensors; an in-place op's result is its input object."""
    inputs = {id(t.elem): t for t in _tensors(args) if isinstance(t, DeviceTensor)}
    return tree_map(lambda t: inputs.get(id(t), _wrap(t)) if isinstance(t, torch.Tensor) else t, out)


def _replayer(func, args, kwargs, out) -> Callable[[], None]:
    """Run the op again on the same tensors (a graph's kernels read and write the same addresses);
    each result the op allocated at capture takes the new values in place. Results that alias an
    input (views, in-place ops) need nothing: the op wrote through them."""
    inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
    outs = [t for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs]

    def replay() -> None:
        fresh = [t for t in _tensors(func(*args, **kwargs)) if t.untyped_storage().data_ptr() not in inputs]
        for old, new in zip(outs, fresh):
            old.copy_(new)
    return replay


def main(argv: list[str]) -> None:
    """python -m tests.unit.fake_cuda SCRIPT [ARGS...]: run a script (a benchmark's --device cuda
    path) on the emulated device, to find device and graph mistakes before spending GPU time."""
    import runpy
    import sys

    if not argv:
        raise SystemExit("usage: python -m tests.unit.fake_cuda SCRIPT [ARGS...]")
    sys.argv = list(argv)
    with FakeCuda() as emulator:
        try:
            runpy.run_path(argv[0], run_name="__main__")
        finally:
            print(f"[fake_cuda] host reads: {len(emulator.syncs)}, graph replays: {emulator.replays}",
                  file=sys.stderr)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
