"""The thinker's layer-k hidden states at a prompt's multi-modal positions, out of vLLM on CPU.

vLLM has no per-request hidden-state output for generation. Its `extract_hidden_states`
speculative method copies `hidden_states[k]` (transformers' indexing: the residual stream
entering layer k) of every scheduled token into a cache-only KV layer, for a KV connector to
read. vLLM's example connector reads a request's rows once it ends, with CUDA streams and pinned
memory. `OmniHiddenStatesConnector` is a CPU connector that reads them as soon as the prompt's
prefill is done: its scheduler half sees, in each step's schedule, which asking request
completes its prefill in that step and passes its block ids to the worker half, whose
`wait_for_save` runs after the drafter wrote that step's rows and before the step's outputs
leave the worker. It copies only the rows at audio/image/video placeholder positions into
`<dir>/<name>` (a temporary file renamed into place). So the file is complete before the
request's first token reaches the engine, which reads it with that first output.

Only requests whose `kv_transfer_params` carry `omni_mm_hidden: <file name>` are saved; no
request's blocks are ever held back.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

logger = logging.getLogger(__name__)

PARAM = "omni_mm_hidden"            # kv_transfer_params key: the file name to write
CONNECTOR = "OmniHiddenStatesConnector"
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+\.safetensors")


def engine_args(layer: int, storage: str) -> dict[str, Any]:
    """The EngineArgs entries that turn capture on (layer `layer`, files under `storage`)."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(layer)]}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR, "kv_connector_module_path": __name__, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        },
    }


def mm_token_ids(hf_config: Any) -> list[int]:
    c = getattr(hf_config, "thinker_config", hf_config)
    ids = (getattr(c, n, None) for n in ("audio_token_id", "image_token_id", "video_token_id"))
    return [int(i) for i in ids if i is not None]


@dataclass
class _PromptSave:
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class _Meta(KVConnectorMetadata):
    saves: list[_PromptSave] = field(default_factory=list)


@dataclass
class _Tracked:
    path: str
    prompt: list[int]
    blocks: list[int]
    computed: int


class OmniHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Scheduler half: build_connector_meta / request_finished; worker half: wait_for_save."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._mm_ids = torch.tensor(mm_token_ids(vllm_config.model_config.hf_config), dtype=torch.long)
        self._tracked: dict[str, _Tracked] = {}

    # ---- scheduler side ----
    def _path_for(self, sampling_params) -> str | None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        name = (extra.get("kv_transfer_params") or {}).get(PARAM)
        if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
            return None
        return os.path.join(self._storage_path, name)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        gid = self._cache_kv_group_id
        for new in scheduler_output.scheduled_new_reqs:
            path = self._path_for(new.sampling_params)
            if path is not None and new.prompt_token_ids is not None:
                self._tracked[new.req_id] = _Tracked(path, list(new.prompt_token_ids), list(new.block_ids[gid]),
                                                     new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:   # preempted and back: a fresh block table
                t.blocks = list(new_blocks[gid]) if new_blocks is not None else []
            elif new_blocks is not None:
                t.blocks.extend(new_blocks[gid])
            t.computed = cached.num_computed_tokens[i]
        meta = _Meta()
        for rid, t in list(self._tracked.items()):
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if n and t.computed + n >= len(t.prompt):   # the prompt's last rows are computed this step
                meta.saves.append(_PromptSave(t.path, t.prompt, t.blocks))
                del self._tracked[rid]
        return meta

    def request_finished(self, request, block_ids):
        self._tracked.pop(request.request_id, None)
        return False, None   # nothing to send later: blocks are freed at once

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, None)

    # ---- worker side ----
    def wait_for_save(self) -> None:
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for s in getattr(meta, "saves", ()):
            self._write(s)

    def _write(self, s: _PromptSave) -> None:
        assert self._kv_cache is not None
        token_ids = torch.tensor(s.token_ids, dtype=torch.long)
        positions = torch.nonzero(torch.isin(token_ids, self._mm_ids)).flatten()
        blocks = torch.tensor(s.block_ids, dtype=torch.long)
        slots = blocks[positions // self._block_size] * self._block_size + positions % self._block_size
        rows = extract_from_kv_cache(self._kv_cache, slots, positions.numel())   # [n, n_layers, hidden]
        tmp = s.path + ".part"
        try:
            from safetensors.torch import save_file

            save_file({"hidden_states": rows[:, 0, :].contiguous().clone(), "positions": positions}, tmp)
            os.replace(tmp, s.path)
        except OSError as e:   # the engine reports the missing file as the request's error
            logger.error("hidden states not written to %s: %s", s.path, e)

    def get_finished(self, finished_req_ids):
        return None, None


class HiddenStatesReader:
    """The engine side: a private directory for the files, one file name per asking request."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="omni-mm-hidden-"))
        self._seq = itertools.count()

    def new_name(self) -> str:
        return f"{next(self._seq)}.safetensors"

    def take(self, name: str) -> torch.Tensor | None:
        """The rows [n_mm, hidden] written under `name` (then removed), or None if there is no file."""
        from safetensors.torch import load_file

        path = self.dir / name
        if not path.exists():
            return None
        rows = load_file(str(path))["hidden_states"]
        path.unlink(missing_ok=True)
        return rows

    def discard(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
