"""HiddenPoolerEngine: a non-AR stage that consumes an LM's hidden states.

Each request brings pieces of hidden states [n, hidden] (one per upstream step);
on the final piece it emits the L2-normalised mean as tensors["embedding"].
"""

from __future__ import annotations

import torch

from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest


class HiddenPoolerEngine(Engine):
    def __init__(self) -> None:
        # No engine_args: a key given to this stage is refused by name (factory.accepted_args), not ignored.
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._ready: list[str] = []

    def add_request(self, request: EngineRequest) -> None:
        hidden = request.tensors.get("hidden_states")
        if hidden is None or hidden.dim() != 2:
            raise EngineError("hidden_pooler needs tensors['hidden_states'] of shape [n, hidden]")
        rid = request.request_id
        if rid in self._ready:   # a second final piece would pool twice and break step() for every request
            raise EngineError(f"request {rid}: hidden states after the piece marked final")
        part = hidden.to(torch.float32).sum(dim=0)
        if rid in self._sums:
            if self._sums[rid].shape != part.shape:
                raise EngineError(f"hidden size changed from {self._sums[rid].shape[0]} to {part.shape[0]}")
            self._sums[rid] += part
        else:
            self._sums[rid] = part.clone()
            self._counts[rid] = 0
        self._counts[rid] += hidden.shape[0]
        if request.final:
            self._ready.append(rid)

    def abort(self, request_id: str) -> None:
        self._sums.pop(request_id, None)
        self._counts.pop(request_id, None)
        if request_id in self._ready:
            self._ready.remove(request_id)

    def step(self) -> list[EngineOutput]:
        outs = []
        for rid in self._ready:
            mean = self._sums.pop(rid) / max(1, self._counts.pop(rid))
            emb = torch.nn.functional.normalize(mean, dim=0)
            outs.append(EngineOutput(request_id=rid, tensors={"embedding": emb},
                                     finished=True, finish_reason="stop"))
        self._ready = []
        return outs

    def has_unfinished(self) -> bool:
        return bool(self._ready)

    def num_running(self) -> int:
        return len(self._sums)
