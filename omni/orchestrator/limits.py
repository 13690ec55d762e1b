"""Replicas of one stage may differ in what they take (a headless replica started with a smaller
--max-model-len): each reports its limits to the master (capabilities), and a request goes only
to a replica that can take it. Failures a replica answered recently count as load, so a replica
that keeps failing stops being the least loaded one."""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable

from omni.config import StageConfig, prompt_stage
from omni.mm_limits import too_many_audios
from omni.errors import BadRequest
from omni.master.types import ReplicaInfo
from omni.orchestrator.types import PipelineRequest
from omni.stage.curve import MAX_MESSAGE_BYTES

FAILURE_WINDOW_S = 30.0
# A client's input tensors ride inline in the entry stage's AddRequest: under the channel's message cap,
# with room for the prompt's token ids and the rest of the message.
MAX_INLINE_BYTES = MAX_MESSAGE_BYTES - (8 << 20)


def replica_limits(engine) -> dict[str, str]:
    """Capabilities a stage replica registers with: the limits its engine was built with. max_prompt_len:
    the longest client prompt a later stage takes (a talker prefills it into its own KV cache); audio_limit:
    the audio parts a prompt may carry (a vLLM stage's limit_mm_per_prompt as vLLM read it); codec_stops: the
    codes a talker's own stop_token_ids may name (its codec's end), comma-separated."""
    out = {}
    for key in ("max_model_len", "max_prompt_len", "audio_limit"):
        limit = getattr(engine, key, None)
        if isinstance(limit, int):
            out[key] = str(limit)
    stops = getattr(engine, "codec_stops", None)
    if stops:
        out["codec_stops"] = ",".join(map(str, sorted(stops)))
    return out


def capability(r: ReplicaInfo, key: str, parse: Callable[[str], Any] = int) -> Any:
    """`key` as replica `r` registered it, parsed; None where it registered none (or no such value)."""
    try:
        return parse(r.capabilities[key])
    except (KeyError, ValueError):
        return None


def max_model_len(r: ReplicaInfo, key: str = "max_model_len") -> int | None:
    return capability(r, key)


def codes(value: str) -> frozenset[int]:
    return frozenset(int(c) for c in value.split(","))


def follow_capability(topology, key: str, reduce: Callable[[list], Any], apply: Callable[[Any], None],
                      stage_id: int | None = None, parse: Callable[[str], Any] = int) -> None:
    """On every topology change, apply(reduce(values)): `key` as each live replica of stage `stage_id` (None: of
    every stage) registered it, None for one that registered none; [] while none is live."""
    def update(_r=None, _kind=None) -> None:
        stages = [stage_id] if stage_id is not None else sorted({r.stage_id for r in topology.replicas.values()})
        apply(reduce([capability(r, key, parse) for s in stages for r in topology.stage_replicas(s)]))

    topology.on_change(update)
    update()


def follow_limits(fe, topology, config, follow_context: bool = True) -> None:
    """Keep the frontend's request checks at what the live replicas registered (replica_limits), not at the
    deploy config (a head's or headless replica's own flags are not in it):
    - max_model_len: the largest of the entry stage's (a request goes to one it fits); kept while none registered
      (the deploy's, or the model's own); follow_context False: the head's own --max-model-len stays;
    - audio_limit: the largest of the entry stage's; None (the stage checks) while a live one registered none;
    - audio_prompt_len: the smallest max_prompt_len of any stage's (talkers: the orchestrator picks one whatever
      its limit, so a prompt for audio must fit every one);
    - stage_codec_stops[stage]: the codes every live replica of that stage takes as stop_token_ids; left out
      (the talker checks) while one registered none."""
    entry = None if (first := prompt_stage(config)) is None else first.stage_id
    if entry is not None and follow_context:
        follow_capability(topology, "max_model_len", lambda v: max(filter(None, v), default=fe.max_model_len),
                          functools.partial(setattr, fe, "max_model_len"), entry)
    if entry is not None:
        follow_capability(topology, "audio_limit", lambda v: None if not v or None in v else max(v),
                          functools.partial(setattr, fe, "audio_limit"), entry)
    follow_capability(topology, "max_prompt_len", lambda v: min(filter(None, v), default=None),
                      functools.partial(setattr, fe, "audio_prompt_len"))
    for stage in sorted(s.stage_id for s in config.stages):
        follow_capability(topology, "codec_stops", lambda v: None if not v or None in v else frozenset.intersection(*v),
                          functools.partial(_set_stops, fe.stage_codec_stops, stage), stage, codes)


def _set_stops(stops: dict, stage: int, value: frozenset[int] | None) -> None:
    if value is None:
        stops.pop(stage, None)
    else:
        stops[stage] = set(value)


def fit(stage_id: int, replicas: list[ReplicaInfo], req: PipelineRequest | None) -> tuple[list[ReplicaInfo], str]:
    """The replicas whose limits take REQ at stage `stage_id`, and when none does, why: a sentence naming what
    it needs and the largest limit there is, `{which}` left for the replicas' description."""
    if req is None or req.prompt_token_ids is None or req.entry_stage != stage_id:
        return replicas, ""
    # as the frontend admitted it: an audio part is its tower's positions, not its one placeholder id
    n_prompt = req.prompt_positions if req.prompt_positions is not None else len(req.prompt_token_ids)
    need = n_prompt + req.sampling.max_tokens
    ok = [r for r in replicas if (max_model_len(r) or need) >= need]
    if not ok and replicas:
        largest = max(max_model_len(r) or 0 for r in replicas)
        return ok, (f"the request needs {need} tokens ({n_prompt} in the prompt, {req.sampling.max_tokens} max_tokens), "
                    f"more than the max_model_len of every {{which}} replica (the largest is {largest})")
    n_audio = req.num_audio_inputs
    # audio_limit: replicas may be built with different limit_mm_per_prompt (the frontend admits up to the largest)
    by_audio = [r for r in ok if (limit := max_model_len(r, "audio_limit")) is None or limit >= n_audio]
    if by_audio or not ok:
        return by_audio, ""
    largest = max(max_model_len(r, "audio_limit") or 0 for r in ok)
    return by_audio, too_many_audios(n_audio, largest, " to any {which} replica that fits its tokens")


def check_inline(req: PipelineRequest) -> None:
    """A 400 naming the limit for inline inputs the stage channel could not carry (before anything is sent)."""
    n = sum(len(t.data) for t in req.inputs.values())
    if n > MAX_INLINE_BYTES:
        raise BadRequest(f"This request's inline inputs ({', '.join(sorted(req.inputs))}) decode to {n} bytes, "
                         f"more than the {MAX_INLINE_BYTES} bytes a request may carry to a stage")


def fitting(stage: StageConfig, replicas: list[ReplicaInfo], req: PipelineRequest | None) -> list[ReplicaInfo]:
    """The replicas whose limits take REQ at this stage; a 400 naming the limit when none does."""
    ok, why = fit(stage.stage_id, replicas, req)
    if why:
        why = why.format(which=f"ready {stage.label}")
        raise BadRequest(f"{why[:1].upper()}{why[1:]}.")
    return ok


class RecentFailures:
    def __init__(self, window_s: float = FAILURE_WINDOW_S):
        self.window_s = window_s
        self._at: dict[str, collections.deque] = {}

    def add(self, replica_id: str, now: float) -> None:
        self._at.setdefault(replica_id, collections.deque(maxlen=64)).append(now)

    def count(self, replica_id: str, now: float) -> int:
        q = self._at.get(replica_id)
        while q and now - q[0] > self.window_s:
            q.popleft()
        return len(q) if q else 0
