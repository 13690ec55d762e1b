"""Make PyPI's (CUDA-linked) torchvision importable next to a CPU-only torch.

vLLM's Qwen2-VL / Qwen3-Omni model files and transformers' Qwen3-Omni processor (its image
and video processors) import torchvision even for text and audio. The only torchvision
wheels the package indexes offer here are CUDA builds: their Python code runs on CPU, their
C++ ops library (`_C.so`) cannot load next to the CPU torch, and the import then dies
registering fake kernels for two ops that library would have defined
("operator torchvision::nms does not exist").

`install()` puts a finder first on sys.meta_path that, the first time anything imports
torchvision, declares those two ops' schemas (no kernels: nothing on CPU calls them) unless
`_C.so` loads, and then steps aside. `make` installs a .pth file that calls it at every
interpreter start in the venv (cheap: it imports nothing until torchvision is imported), so
it reaches every process, vLLM's spawned EngineCore included, before its first import of
transformers. `python -m omni.engines.torchvision_cpu` writes that .pth file. The same hook
first gives vLLM's spawned EngineCore and Worker their death signal (omni/deathsig.py).
"""

from __future__ import annotations

import importlib.machinery
import site
import sys
from pathlib import Path

PTH_NAME = "omni_torchvision_cpu.pth"
PTH_LINE = ("import sys; exec('try:\\n import omni.engines.torchvision_cpu as m\\nexcept ImportError:\\n m = None\\n"
            "if m is not None:\\n m.install()')\n")
# The ops torchvision's import registers fake kernels for without checking that its library loaded (0.28).
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_lib = None   # the torch.library fragment holding the schemas, alive for the process


class _Finder:
    """A meta path finder that never finds anything: it only runs `prepare` once, on the first
    lookup of torchvision, and leaves the import to the normal finders."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torchvision":
            _remove()
            prepare()
        return None


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if f is not _Finder]


def prepare() -> None:
    """Declare the ops torchvision's import needs if its own library cannot load. Idempotent."""
    global _lib
    if _lib is not None:
        return
    spec = importlib.machinery.PathFinder.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    so = Path(list(spec.submodule_search_locations)[0]) / "_C.so"
    try:
        torch.ops.load_library(str(so))
        return   # a CPU build (or CUDA torch): its library defines the ops
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        lib.define(schema)
    _lib = lib


def install() -> None:
    """What the .pth file runs at every interpreter start in the venv."""
    from omni.deathsig import at_interpreter_start

    at_interpreter_start()
    if "torchvision" in sys.modules or _Finder in sys.meta_path:
        return
    sys.meta_path.insert(0, _Finder)


def write_pth(site_dir: str | None = None) -> Path:
    d = Path(site_dir or site.getsitepackages()[0])
    p = d / PTH_NAME
    p.write_text(PTH_LINE)
    return p


if __name__ == "__main__":
    print(write_pth(sys.argv[1] if len(sys.argv) > 1 else None))
