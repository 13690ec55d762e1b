"""Qwen2.5-Omni token2wav as an omni Engine (engine name `qwen25_token2wav`): codec ids ->
DiT flow matching (RK4, classifier-free guidance) -> mel -> BigVGAN -> 24 kHz float32 audio.

Request contract (omni.engines.streamed_vocoder): pieces of `tensors["codes"]` int64 [1, n] (or
[n]); the first names the voice (`voice`, chelsie / ethan, default chelsie) and the seed (the
stage's `seed` override, else `request.sampling.seed`, else a fresh random one).

Streamed (`stream: true`, the default): the audio of codes [done, done + n) (n =
`first_block_codes` for the first block, then `block_codes`) comes from one DiT decode of codes
[lo, done + n + `right_context`), lo = done - `left_context` rounded down to a DiT attention block
(the block mask then lines up with a whole decode's), then BigVGAN over the last
`vocoder_context` final mel frames + this block's mel + its right context's (not yet final) mel.
A block waits for its right context (or the stream's end), so the first audio needs
first_block_codes + right_context codes. The blocks depend only on where the stream stands, never on how the codes arrived.
The joined blocks differ from a whole decode only by the truncated DiT attention reach (the ODE
compounds one block of look-ahead per evaluation) and BigVGAN's truncated receptive field
(+-26 mel frames): figures in docs/architecture.md. `stream: false` decodes each utterance whole
once it is final (transformers' `Qwen2_5OmniToken2WavModel.forward`).

Noise: each request's `torch.Generator` on the CPU, seeded with its seed, never the process RNG:
a request's audio is the same whatever else runs and on any device. Streamed, it is drawn a DiT
block at a time as codes arrive; on the CPU those draws equal one whole draw (torch draws normals
16 at a time from one uniform stream), so both modes start from the same noise, equal to
transformers' after `torch.manual_seed(seed)`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch

from omni.engines.base import EngineError, EngineRequest
from omni.engines.streamed_vocoder import StreamedVocoder, VocoderStream, Window
from omni.models.qwen25_omni.weights import load_speakers, load_token2wav

logger = logging.getLogger(__name__)

DEFAULT_SPEAKER = "chelsie"


@dataclasses.dataclass(frozen=True)
class Token2WavParts:
    """A token2wav built in memory (a benchmark's real-size random weights), given as `model_dir`."""
    config: object                 # Qwen2_5OmniConfig
    model: torch.nn.Module         # Qwen2_5OmniToken2WavModel, float32
    speakers: dict                 # name -> {"cond": [enc_emb_dim], "ref_mel": [1, T, mel]}


@dataclasses.dataclass
class _Stream(VocoderStream):
    speaker: str = DEFAULT_SPEAKER
    generator: torch.Generator | None = None
    noise: torch.Tensor | None = None      # [frames, mel] from code `start`, drawn a DiT block at a time
    mel_tail: torch.Tensor | None = None   # [mel, k]: the final mel frames before code `done`


def _count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


class Qwen25Token2WavEngine(StreamedVocoder):
    name = "qwen25_token2wav"
    seconds_key = "token2wav_seconds"

    def __init__(self, model_dir: str | Path | Token2WavParts, *, device: str = "cpu", num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, stream: bool = True,
                 first_block_codes: int = 12, block_codes: int = 36, left_context: int = 24,
                 right_context: int = 12, vocoder_context: int = 32, max_num_seqs: int = 16,
                 threads: int | None = None):
        if num_steps < 2 or not math.isfinite(guidance_scale) or not math.isfinite(sway_coefficient):
            raise ValueError(f"need num_steps >= 2 and finite guidance_scale / sway_coefficient; got "
                             f"{num_steps}, {guidance_scale}, {sway_coefficient}")
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be true or false, got {stream!r}")
        self.first_block_codes = _count("first_block_codes", first_block_codes, 1)
        self.block_codes = _count("block_codes", block_codes, 1)
        self.left_context = _count("left_context", left_context, 0)
        self.right_context = _count("right_context", right_context, 0)
        self.vocoder_context = _count("vocoder_context", vocoder_context, 0)
        if threads:
            torch.set_num_threads(threads)
        if isinstance(model_dir, Token2WavParts):
            config, model, speakers = model_dir.config, model_dir.model.to(device), model_dir.speakers
        else:
            (config, model), speakers = load_token2wav(model_dir, device=device), load_speakers(model_dir)
        dit = config.token2wav_config.dit_config
        # A whole decode's positions end at the DiT's max_position_embeddings; streamed windows restart at 0.
        whole_limit = dit.max_position_embeddings // dit.repeats
        # Window starts are multiples of `align` codes: a whole number of DiT attention blocks.
        align = dit.block_size // math.gcd(dit.block_size, dit.repeats)
        widest = self.left_context + align + max(self.first_block_codes, self.block_codes) + self.right_context
        if stream and widest > whole_limit:
            raise ValueError(f"left_context + first_block_codes / block_codes + right_context must fit the DiT's "
                             f"{whole_limit} codes (max_position_embeddings / repeats), got {widest}")
        super().__init__(device=device, groups=1, vocab=dit.num_embeds + 1, sample_rate=24000,
                         max_num_seqs=max_num_seqs, max_codes=None if stream else whole_limit)
        self.config, self.model = config, model
        self.speakers = {k.lower(): (v["cond"].float().to(self.device), v["ref_mel"].float().to(self.device))
                         for k, v in speakers.items()}
        self.repeats, self.mel_dim = dit.repeats, dit.mel_dim
        self.align = align
        self.hop = math.prod(config.token2wav_config.bigvgan_config.upsample_rates)
        self.num_steps = num_steps
        self.guidance_scale = guidance_scale
        self.sway_coefficient = sway_coefficient
        self.stream = stream

    def move_to(self, device: torch.device) -> None:
        self.model.to(device)
        self.speakers = {k: (c.to(device), m.to(device)) for k, (c, m) in self.speakers.items()}

    # -- requests ------------------------------------------------------------

    def open_stream(self, req: EngineRequest, buf: torch.Tensor) -> _Stream:
        rid = req.request_id
        name = req.voice or DEFAULT_SPEAKER
        if not isinstance(name, str) or name.lower() not in self.speakers:
            raise EngineError(f"request {rid}: unknown speaker {name!r}; known speakers: "
                              f"{', '.join(sorted(self.speakers))}")
        seed = req.effective_sampling().seed
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            try:
                gen.manual_seed(int(seed))
            except (TypeError, ValueError, RuntimeError):
                raise EngineError(f"request {rid}: seed must be an integer, got {seed!r}") from None
        return _Stream(rid, buf, speaker=name.lower(), generator=gen,
                       noise=torch.zeros((0, self.mel_dim), device=self.device))

    def added(self, s: _Stream, n: int) -> None:
        if not self.stream:
            return            # a whole decode draws its noise at once
        have = s.start + s.noise.shape[0] // self.repeats
        need = -(-s.total // self.align) * self.align
        if need > have:
            fresh = torch.randn([(need - have) * self.repeats, self.mel_dim], generator=s.generator)
            s.noise = torch.cat([s.noise, fresh.to(self.device)])

    def trim(self, s: _Stream, keep: int) -> None:
        s.noise = s.noise[(keep - s.start) * self.repeats:]
        super().trim(s, keep)

    # -- windows ---------------------------------------------------------------

    def _want(self, s: VocoderStream) -> int:
        return self.first_block_codes if s.done == 0 else self.block_codes

    def ready(self, s: VocoderStream) -> bool:
        return s.final or (self.stream and s.total - s.done >= self._want(s) + self.right_context)

    def keep_from(self, s: VocoderStream) -> int:
        return max(0, s.done - self.left_context) // self.align * self.align if self.stream else 0

    def window(self, s: _Stream) -> Window:
        if not self.stream:
            return Window(0, s.total, s.total, key=("whole", s.rid))
        lo = self.keep_from(s)
        # A block's right context is cut only by the stream's end, so it never depends on how
        # the codes arrived.
        end = min(s.total, s.done + self._want(s))
        hi = min(s.total, end + self.right_context)
        tail = 0 if s.mel_tail is None else s.mel_tail.shape[1]
        refs = self.speakers[s.speaker][1].shape[1]
        return Window(lo, end, hi, key=(hi - lo, hi - s.done, tail, refs))

    # -- work ------------------------------------------------------------------

    @torch.no_grad()
    def mel(self, codes: torch.Tensor, noise: torch.Tensor, speakers: list[str]) -> torch.Tensor:
        """codes [B, T], noise [B, T * repeats, mel] -> mel [B, mel, T * repeats]: the DiT's flow."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.model.code2wav_dit_model
        cond = torch.stack([self.speakers[n][0] for n in speakers])
        ref_mel = torch.cat([self.speakers[n][1] for n in speakers])
        spk = cond[:, None].repeat(1, noise.shape[1], 1)
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
    def decode_whole(self, codes: torch.Tensor, speaker: str, generator: torch.Generator) -> torch.Tensor:
        """codes [1, T] -> waveform [T * repeats * hop] float32 in [-1, 1] on the CPU, in one decode."""
        noise = torch.randn([1, codes.shape[1] * self.repeats, self.mel_dim], generator=generator)
        mel = self.mel(codes, noise.to(self.device), [speaker])
        return self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()

    def decode(self, batch: list[tuple[_Stream, Window]]) -> list[torch.Tensor]:
        if not self.stream:
            (s, w), = batch
            self._stats["codes"] += s.total
            return [self.decode_whole(s.codes(0, s.total), s.speaker, s.generator)]
        r = self.repeats
        codes = torch.cat([s.codes(w.lo, w.hi) for s, w in batch])
        noise = torch.stack([s.noise[(w.lo - s.start) * r:(w.hi - s.start) * r] for s, w in batch])
        mel = self.mel(codes, noise, [s.speaker for s, _ in batch])
        # BigVGAN: the final frames before this block (left context), then the block and its right context.
        voc = []
        for i, (s, w) in enumerate(batch):
            new = mel[i, :, (s.done - w.lo) * r:]
            voc.append(new if s.mel_tail is None else torch.cat([s.mel_tail, new], dim=1))
        # One copy to the host for the batch (decode's contract: CPU audio), sliced there.
        wav = self.model.code2wav_bigvgan_model(torch.stack(voc)).reshape(len(batch), -1).float().cpu()
        out = []
        for i, (s, w) in enumerate(batch):
            k = 0 if s.mel_tail is None else s.mel_tail.shape[1]
            out.append(wav[i, k * self.hop:(k + (w.end - s.done) * r) * self.hop].contiguous())
            final = voc[i][:, :k + (w.end - s.done) * r]
            s.mel_tail = final[:, max(0, final.shape[1] - self.vocoder_context):] if self.vocoder_context else None
            self._stats["codes"] += w.end - s.done
        return out
