"""Qwen2.5-Omni token2wav as an omni Engine (engine name `qwen25_token2wav`): codec ids ->
DiT flow matching (RK4, classifier-free guidance) -> mel -> BigVGAN -> 24 kHz float32 audio.

Request contract: one continuing request, pieces with the same request_id carrying
`tensors["codes"]` int64 [1, n] (or [n]); `final` (default True) marks the last
piece (it may carry no codes). The first piece names the voice (`voice`, chelsie / ethan,
default chelsie) and the seed (the stage's `seed` override, else `request.sampling.seed`, else
a fresh random one). Output: one `tensors["audio"]` float32
1-D at `sample_rate` when the stream is final.

Whole-utterance decode: the DiT's attention reaches one block (24 mel frames = 12 codes)
ahead in one layer and two blocks back, but the ODE applies it 36 times (9 RK4 steps x 4
evaluations), so a block's mel depends on codes ~36 blocks ahead: a blockwise decode does not
equal a whole one (see docs/architecture.md). The starting noise comes from a per-request
`torch.Generator` seeded with the request's seed, never the process RNG: a request's audio
is the same whatever else runs, and equals transformers' after `torch.manual_seed(seed)`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from pathlib import Path

import torch

from omni.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from omni.models.qwen25_omni.weights import load_speakers, load_token2wav

logger = logging.getLogger(__name__)

DEFAULT_SPEAKER = "chelsie"


@dataclasses.dataclass
class _Stream:
    rid: str
    speaker: str
    generator: torch.Generator
    parts: list[torch.Tensor] = dataclasses.field(default_factory=list)
    final: bool = False


class Qwen25Token2WavEngine(Engine):
    def __init__(self, model_dir: str | Path, *, device: str = "cpu", num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, threads: int | None = None):
        if num_steps < 2 or not math.isfinite(guidance_scale) or not math.isfinite(sway_coefficient):
            raise ValueError(f"need num_steps >= 2 and finite guidance_scale / sway_coefficient; got "
                             f"{num_steps}, {guidance_scale}, {sway_coefficient}")
        if threads:
            torch.set_num_threads(threads)
        self.config, self.model = load_token2wav(model_dir, device=device)
        self.device = torch.device(device)
        self.speakers = {k.lower(): (v["cond"].float().to(self.device), v["ref_mel"].float().to(self.device))
                         for k, v in load_speakers(model_dir).items()}
        dit = self.config.token2wav_config.dit_config
        self.num_codes = dit.num_embeds + 1           # the DiT's codec table
        self.repeats = dit.repeats
        self.max_codes = dit.max_position_embeddings // dit.repeats
        self.hop = math.prod(self.config.token2wav_config.bigvgan_config.upsample_rates)
        self.sample_rate = 24000
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.sway_coefficient = sway_coefficient
        self._streams: collections.OrderedDict[str, _Stream] = collections.OrderedDict()
        self._stats: collections.Counter = collections.Counter()
        self._sleeping = False

    # -- requests ------------------------------------------------------------

    def _codes(self, req: EngineRequest) -> torch.Tensor | None:
        t = (req.tensors or {}).get("codes")
        if t is None:
            return None
        t = torch.as_tensor(t)
        if t.ndim == 2 and t.shape[0] == 1:
            t = t[0]
        if t.ndim != 1:
            raise EngineError(f"request {req.request_id}: codes must be int64 [1, n] or [n], got shape {list(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise EngineError(f"request {req.request_id}: codes must be integers, got {t.dtype}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_codes):
            raise EngineError(f"request {req.request_id}: codes must lie in [0, {self.num_codes}), "
                              f"got [{int(t.min())}, {int(t.max())}]")
        return t.to(self.device, torch.long)

    def _open(self, req: EngineRequest) -> _Stream:
        rid = req.request_id
        name = req.voice or DEFAULT_SPEAKER
        if not isinstance(name, str) or name.lower() not in self.speakers:
            raise EngineError(f"request {rid}: unknown speaker {name!r}; known speakers: "
                              f"{', '.join(sorted(self.speakers))}")
        seed = req.effective_sampling().seed
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()
        else:
            try:
                gen.manual_seed(int(seed))
            except (TypeError, ValueError, RuntimeError):
                raise EngineError(f"request {rid}: seed must be an integer, got {seed!r}") from None
        return _Stream(rid, name.lower(), gen)

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        if self._sleeping:
            raise EngineError(f"request {rid}: qwen25_token2wav is asleep (wake_up first)")
        final = request.final
        codes = self._codes(request)
        s = self._streams.get(rid)
        if s is not None and s.final:
            raise EngineError(f"request {rid}: codes after the piece marked final")
        if codes is None and not final:
            raise EngineError(f"request {rid}: no 'codes' tensor (only a final piece may omit it)")
        if s is None:
            s = self._open(request)
        n = sum(p.shape[0] for p in s.parts) + (0 if codes is None else codes.shape[0])
        if n > self.max_codes:
            raise EngineError(f"request {rid}: {n} codes exceed the DiT's {self.max_codes} "
                              f"(max_position_embeddings / repeats)")
        self._streams[rid] = s
        if codes is not None and codes.shape[0]:
            s.parts.append(codes)
        s.final = final

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- work ------------------------------------------------------------------

    @torch.no_grad()
    def mel(self, codes: torch.Tensor, speaker: str, generator: torch.Generator) -> torch.Tensor:
        """codes [1, T] -> mel [1, mel_dim, T * repeats]: the DiT's flow from seeded noise."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.model.code2wav_dit_model
        cond, ref_mel = self.speakers[speaker]
        frames = codes.shape[1] * self.repeats
        noise = torch.randn([1, frames, dit.mel_dim], dtype=ref_mel.dtype, device=self.device, generator=generator)
        spk = cond[None, None].repeat(1, frames, 1)
        guided = self.guidance_scale >= 1e-5

        def velocity(t, x):
            out = dit(hidden_states=x, speaker_embedding=spk, condition_vector=ref_mel, quantized_code=codes,
                      time_step=t, drop_audio_conditioning=False, drop_code=False, apply_cfg=guided)
            if not guided:
                return out
            cond_v, null_v = torch.chunk(out, 2, dim=0)
            return cond_v + (cond_v - null_v) * self.guidance_scale

        t = torch.linspace(0, 1, self.num_steps, device=self.device, dtype=spk.dtype)
        t = t + self.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(t)[-1].permute(0, 2, 1)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, speaker: str, generator: torch.Generator) -> torch.Tensor:
        """codes [1, T] -> waveform [T * repeats * hop] float32 in [-1, 1]."""
        return self.model.code2wav_bigvgan_model(self.mel(codes, speaker, generator)).reshape(-1).float()

    @torch.no_grad()
    def step(self) -> list[EngineOutput]:
        if self._sleeping:
            return []
        s = next((s for s in self._streams.values() if s.final), None)
        if s is None:
            return []
        del self._streams[s.rid]
        codes = torch.cat(s.parts)[None] if s.parts else None
        audio = torch.zeros(0)
        if codes is not None:
            t0 = time.perf_counter()
            audio = self.decode(codes, s.speaker, s.generator).cpu()
            self._stats["token2wav_seconds"] += time.perf_counter() - t0
            self._stats["codes"] += codes.shape[1]
            self._stats["samples"] += audio.shape[0]
        return [EngineOutput(request_id=s.rid, tensors={"audio": audio}, finished=True, finish_reason="stop",
                             sample_rate=self.sample_rate)]

    # -- bookkeeping -------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return not self._sleeping and any(s.final for s in self._streams.values())

    def has_open_streams(self) -> bool:
        return bool(self._streams)

    def num_waiting(self) -> int:
        return sum(1 for s in self._streams.values() if not s.final)

    def num_running(self) -> int:
        return sum(1 for s in self._streams.values() if s.final)

    def can_sleep(self) -> bool:
        return self.device.type != "cpu"

    def sleep(self, level: int = 1) -> None:
        if not self.can_sleep():
            raise EngineError("qwen25_token2wav on CPU cannot sleep: its weights have no device memory to free")
        if self._streams:
            raise EngineError(f"qwen25_token2wav cannot sleep with {len(self._streams)} stream(s) open")
        self.model.to("cpu")
        self._sleeping = True

    def wake_up(self) -> None:
        if self._sleeping:
            self.model.to(self.device)
            self._sleeping = False

    def is_sleeping(self) -> bool:
        return self._sleeping

    def stats(self) -> dict[str, float]:
        out = dict(self._stats)
        if out.get("samples"):
            out["rtf"] = out.get("token2wav_seconds", 0.0) / (out["samples"] / self.sample_rate)
        return out
