"""The thinker's hidden states out of vLLM on CPU: layer k at a prompt's multi-modal positions
(Qwen3-Omni), and one layer's rows for every token a request feeds (Qwen2.5-Omni).

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

Rows of every fed token (`omni_hidden_rows: <stem>`): each step that computes positions of the
request writes `<stem>.<seq>.safetensors` (`rows` [n, hidden], `start`: the first position),
seq = 0, 1, ... in step order. A step writes every position it computed, speculative ones too
(the method's draft is always the sampled token; a rejected one is computed again at the same
position next step, and later files win), so a position below the tokens the request has
emitted minus one holds its final row once the step's file is read (`RowStream`).
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
ROWS_PARAM = "omni_hidden_rows"     # kv_transfer_params key: the stem of every step's rows file
CONNECTOR = "OmniHiddenStatesConnector"
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+\.safetensors")
_SAFE_STEM = re.compile(r"[A-Za-z0-9_-]+")


def engine_args(mm_layer: int | None, rows_layer: int | None, storage: str) -> dict[str, Any]:
    """The EngineArgs entries that turn capture on (multi-modal rows at `mm_layer`, every fed
    token's rows at `rows_layer`; files under `storage`)."""
    layers = sorted({int(x) for x in (mm_layer, rows_layer) if x is not None})   # vLLM's aux order
    return {
        "speculative_config": {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR, "kv_connector_module_path": __name__, "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": storage,
                "mm_slot": None if mm_layer is None else layers.index(int(mm_layer)),
                "rows_slot": None if rows_layer is None else layers.index(int(rows_layer))},
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
class _RowsSave:
    path: str
    start: int
    end: int
    block_ids: list[int]


@dataclass
class _Meta(KVConnectorMetadata):
    saves: list[_PromptSave] = field(default_factory=list)
    rows: list[_RowsSave] = field(default_factory=list)


@dataclass
class _Tracked:
    path: str
    prompt: list[int]
    blocks: list[int]
    computed: int


@dataclass
class _RowsTracked:
    stem: str
    blocks: list[int]
    computed: int
    next: int = 0        # positions below this were written at least once
    seq: int = 0


class OmniHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Scheduler half: build_connector_meta / request_finished; worker half: wait_for_save."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._mm_ids = torch.tensor(mm_token_ids(vllm_config.model_config.hf_config), dtype=torch.long)
        self._tracked: dict[str, _Tracked] = {}
        self._rows: dict[str, _RowsTracked] = {}
        cfg = self._kv_transfer_config
        self._mm_slot = cfg.get_from_extra_config("mm_slot", 0)
        self._rows_slot = cfg.get_from_extra_config("rows_slot", None)

    # ---- scheduler side ----
    def _path_for(self, sampling_params, key: str = PARAM) -> str | None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        name = (extra.get("kv_transfer_params") or {}).get(key)
        pattern = _SAFE_NAME if key == PARAM else _SAFE_STEM
        if not isinstance(name, str) or not pattern.fullmatch(name):
            return None
        return os.path.join(self._storage_path, name)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        gid = self._cache_kv_group_id
        for new in scheduler_output.scheduled_new_reqs:
            path = self._path_for(new.sampling_params)
            if path is not None and new.prompt_token_ids is not None:
                self._tracked[new.req_id] = _Tracked(path, list(new.prompt_token_ids), list(new.block_ids[gid]),
                                                     new.num_computed_tokens)
            stem = self._path_for(new.sampling_params, ROWS_PARAM)
            if stem is not None and self._rows_slot is not None:
                self._rows[new.req_id] = _RowsTracked(stem, list(new.block_ids[gid]), new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            for t in (self._tracked.get(rid), self._rows.get(rid)):
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
        for rid, r in self._rows.items():
            n = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if n:   # from the first position not yet written (prefix-cache hits) or a recomputed one
                start, r.next = min(r.next, r.computed), r.computed + n
                meta.rows.append(_RowsSave(f"{r.stem}.{r.seq}.safetensors", start, r.next, list(r.blocks)))
                r.seq += 1
        return meta

    def request_finished(self, request, block_ids):
        self._tracked.pop(request.request_id, None)
        self._rows.pop(request.request_id, None)
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
        for r in getattr(meta, "rows", ()):
            self._write_rows(r)

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

            save_file({"hidden_states": rows[:, self._mm_slot, :].contiguous().clone(), "positions": positions}, tmp)
            os.replace(tmp, s.path)
        except OSError as e:   # the engine reports the missing file as the request's error
            logger.error("hidden states not written to %s: %s", s.path, e)

    def _write_rows(self, r: _RowsSave) -> None:
        assert self._kv_cache is not None
        positions = torch.arange(r.start, r.end, dtype=torch.long)
        blocks = torch.tensor(r.block_ids, dtype=torch.long)
        slots = blocks[positions // self._block_size] * self._block_size + positions % self._block_size
        rows = extract_from_kv_cache(self._kv_cache, slots, positions.numel())
        tmp = r.path + ".part"
        try:
            from safetensors.torch import save_file

            save_file({"rows": rows[:, self._rows_slot, :].contiguous().clone(),
                       "start": torch.tensor([r.start], dtype=torch.long)}, tmp)
            os.replace(tmp, r.path)
        except OSError as e:   # the engine reports the missing rows as the request's error
            logger.error("hidden rows not written to %s: %s", r.path, e)

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

    def new_stream(self) -> RowStream:
        return RowStream(self.dir, f"r{next(self._seq)}")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class RowStream:
    """One request's rows of every fed token, read from its per-step files in order.
    Positions are written contiguously from 0; a later file may rewrite positions (a rejected
    speculative row), so a row is final only below what the request has emitted minus one."""

    def __init__(self, directory: Path, stem: str) -> None:
        self.dir, self.stem = directory, stem
        self._seq = 0
        self._buf: torch.Tensor | None = None
        self._written = 0      # positions [0, _written) hold a row
        self.delivered = 0

    def _read(self) -> None:
        from safetensors.torch import load_file

        while True:
            path = self.dir / f"{self.stem}.{self._seq}.safetensors"
            if not path.exists():
                return
            d = load_file(str(path))
            path.unlink(missing_ok=True)
            self._seq += 1
            rows, start = d["rows"], int(d["start"][0])
            end = start + rows.shape[0]
            if self._buf is None:
                self._buf = rows.new_empty((max(64, end), rows.shape[1]))
            elif end > self._buf.shape[0]:
                grown = self._buf.new_empty((max(end, 2 * self._buf.shape[0]), self._buf.shape[1]))
                grown[:self._written] = self._buf[:self._written]
                self._buf = grown
            self._buf[start:end] = rows
            self._written = max(self._written, end)

    def take(self, upto: int) -> torch.Tensor | None:
        """The final rows not yet taken, up to position `upto` (exclusive); None if there are none."""
        self._read()
        end = min(upto, self._written)
        if end <= self.delivered:
            return None
        out = self._buf[self.delivered:end].clone()
        self.delivered = end
        return out

    def close(self) -> None:
        for path in self.dir.glob(f"{self.stem}.*"):
            path.unlink(missing_ok=True)
