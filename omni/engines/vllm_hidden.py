"""The thinker's layer-k hidden states at a prompt's multi-modal positions, out of vLLM on CPU.

vLLM has no per-request hidden-state output for generation. Its `extract_hidden_states`
speculative method copies `hidden_states[k]` (transformers' indexing: the residual stream
entering layer k) of every scheduled token into a cache-only KV layer, and a KV connector
reads those rows back once the request ends. vLLM's example connector does that with CUDA
streams and pinned memory; `OmniHiddenStatesConnector` below is its CPU form: a synchronous
copy of only the rows at audio/image/video placeholder positions, written to
`<dir>/<request id>.safetensors` under a temporary name and renamed into place, and only for
requests that ask (`kv_transfer_params: {"omni_mm_hidden": true}`): other requests save and
delay nothing.

Timing: vLLM hands the finished output (with the file's path) to the client one engine step
before its worker writes the file, so the engine holds a request's final output until the
file is there (`HiddenStatesReader.poll`), bounded by a deadline.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

logger = logging.getLogger(__name__)

PARAM = "omni_mm_hidden"            # the request's kv_transfer_params flag
CONNECTOR = "OmniHiddenStatesConnector"
WRITE_DEADLINE_S = 60.0


def engine_args(layer: int, storage: str) -> dict[str, Any]:
    """The EngineArgs entries that turn capture on (layer `layer`, files under `storage`)."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(layer)]}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR, "kv_connector_module_path": __name__, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage, "use_synchronization_lock": False},
        },
    }


def mm_token_ids(hf_config: Any) -> list[int]:
    c = getattr(hf_config, "thinker_config", hf_config)
    ids = (getattr(c, n, None) for n in ("audio_token_id", "image_token_id", "video_token_id"))
    return [int(i) for i in ids if i is not None]


class OmniHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Runs in vLLM's scheduler (request_finished) and worker (the write) processes."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._mm_ids = torch.tensor(mm_token_ids(vllm_config.model_config.hf_config), dtype=torch.long)
        self._written: set[str] = set()

    def request_finished(self, request, block_ids):
        if not (request.kv_transfer_params or {}).get(PARAM):
            self._request_filenames.pop(request.request_id, None)
            return False, None   # nothing saved, blocks freed at once
        return super().request_finished(request, block_ids)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        token_ids = pending.token_ids.to(torch.long)
        positions = torch.nonzero(torch.isin(token_ids, self._mm_ids)).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots[positions], positions.numel())
        tmp = pending.filename + ".part"
        try:
            from safetensors.torch import save_file

            # rows: [n_mm, n_layers, hidden]; a copy, the cache blocks are freed next.
            save_file({"hidden_states": rows.contiguous().clone(), "positions": positions}, tmp)
            os.replace(tmp, pending.filename)
        except OSError as e:   # the engine's deadline turns a missing file into the request's error
            logger.error("hidden states of %s not written: %s", pending.req_id, e)
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            for pending in getattr(meta, "pending_saves", ()):
                self._submit_async_write(pending)
        done, self._written = self._written, set()
        return done or None, None


@dataclass
class _Waiting:
    path: Path
    deadline: float


class HiddenStatesReader:
    """The engine side: a private directory for the files, and the requests waiting on theirs."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="omni-mm-hidden-"))
        self._waiting: dict[str, _Waiting] = {}

    def expect(self, request_id: str, path: str) -> None:
        self._waiting[request_id] = _Waiting(Path(path), time.monotonic() + WRITE_DEADLINE_S)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def discard(self, request_id: str) -> None:
        w = self._waiting.pop(request_id, None)
        if w is not None:
            w.path.unlink(missing_ok=True)

    def poll(self) -> dict[str, torch.Tensor | str]:
        """request id -> its rows [n_mm, hidden] (float), or an error message, for each file that is
        there (or overdue)."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor | str] = {}
        now = time.monotonic()
        for rid, w in list(self._waiting.items()):
            if w.path.exists():
                data = load_file(str(w.path))
                w.path.unlink(missing_ok=True)
                out[rid] = data["hidden_states"][:, 0, :]
            elif now > w.deadline:
                out[rid] = f"vLLM wrote no hidden states for request {rid} within {WRITE_DEADLINE_S:.0f} s"
            else:
                continue
            del self._waiting[rid]
        return out

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
