"""The transformers reference for the Qwen3-Omni stage tests: the tiny model's
`generate(return_audio=True)`, greedy end to end, with the talker's codes captured."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni.engines.base import EngineRequest, SamplingParams


def tone(seed: int = 0) -> np.ndarray:
    """A seeded 1 s sine + noise at 16 kHz: the audio input of the references."""
    rng = np.random.default_rng(seed)
    t = np.arange(16000) / 16000
    return (0.5 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(16000)).astype(np.float32)


@dataclass
class Ref:
    prompt: list[int]
    generated: list[int]
    codes: torch.Tensor          # [16, T]
    wav: torch.Tensor            # [n] float
    mm_hidden: torch.Tensor | None = None


class Reference:
    def __init__(self, folder):
        from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

        self.folder = folder
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.features = WhisperFeatureExtractor.from_pretrained(folder)
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self._captured: list[torch.Tensor] = []
        decode = self.model.code2wav.chunked_decode

        def capture(codes, **kw):
            self._captured.append(codes.clone())
            return decode(codes, **kw)
        self.model.code2wav.chunked_decode = capture

    def prompt(self, text: str, audio: bool = False) -> list[int]:
        content = [{"type": "audio"}, {"type": "text", "text": text}] if audio else text
        msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": content}]
        return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]

    def audio_inputs(self, seed: int = 0):
        """Whisper features of a seeded 1 s sine + noise at 16 kHz, and the audio tower's output length."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

        f = self.features(tone(seed), sampling_rate=16000, return_attention_mask=True, padding="longest",
                          return_tensors="pt")
        n = int(_get_feat_extract_output_lengths(f["attention_mask"].sum(-1)).item())
        return f["input_features"], f["attention_mask"], n

    @torch.no_grad()
    def run(self, text: str, speaker: str = "Ethan", thinker_tokens: int = 8, talker_tokens: int = 24,
            audio: bool = False, eos: int | None = None) -> Ref:
        prompt = self.prompt(text, audio)
        kwargs = {}
        mm_hidden = None
        if audio:
            feats, mask, n = self.audio_inputs()
            pad = self.tok.convert_tokens_to_ids("<|audio_pad|>")
            i = prompt.index(pad)
            prompt = prompt[:i] + [pad] * n + prompt[i + 1:]
            kwargs = dict(input_features=feats, feature_attention_mask=mask)
        ids = torch.tensor([prompt])
        self._captured.clear()
        seq, wav = self.model.generate(
            ids, speaker=speaker, return_audio=True, thinker_do_sample=False, talker_do_sample=False,
            thinker_max_new_tokens=thinker_tokens, thinker_eos_token_id=self.im_end if eos is None else eos,
            talker_max_new_tokens=talker_tokens, **kwargs)
        if audio:
            out = self.model.thinker(input_ids=ids, output_hidden_states=True, **kwargs)
            k = self.model.config.talker_config.accept_hidden_layer
            mm_hidden = out.hidden_states[k][0, ids[0] == pad].clone()
        return Ref(prompt, seq[0, len(prompt):].tolist(), self._captured[-1][0], wav.reshape(-1), mm_hidden)


def talker_pieces(ref: Ref, rid: str, speaker: str, per_token: bool, max_tokens: int,
                  **sampling) -> list[EngineRequest]:
    """The talker requests for one reference run: all generated ids at once, or one per piece."""
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    tensors = {"mm_hidden": ref.mm_hidden} if ref.mm_hidden is not None else {}
    gen = ref.generated
    if not per_token:
        return [EngineRequest(request_id=rid, prompt_token_ids=ref.prompt, sampling=params, tensors=tensors,
                              voice=speaker, generated_ids=gen, final=True)]
    first = EngineRequest(request_id=rid, prompt_token_ids=ref.prompt, sampling=params, tensors=tensors,
                          voice=speaker, generated_ids=gen[:1], final=len(gen) == 1)
    rest = [EngineRequest(request_id=rid, generated_ids=[t], final=i == len(gen) - 1)
            for i, t in enumerate(gen) if i > 0]
    return [first] + rest


def drive(engine, feeds: dict[str, list[EngineRequest]], on_output=None, limit: int = 10_000) -> dict:
    """Feed each request's pieces one per step (interleaved) and step until every request finished.
    Returns rid -> list of outputs."""
    outs: dict[str, list] = {rid: [] for rid in feeds}
    queues = {rid: list(pieces) for rid, pieces in feeds.items()}
    for _ in range(limit):
        for q in queues.values():
            if q:
                piece = q.pop(0)
                if piece is not None:     # None: nothing arrives for this request at this step
                    engine.add_request(piece)
        for o in engine.step():
            outs[o.request_id].append(o)
            if on_output is not None:
                on_output(o)
        if all(o and o[-1].finished for o in outs.values()):
            return outs
    raise AssertionError(f"requests did not finish in {limit} steps")


def path_args(path: str) -> dict:
    """A talker engine's arguments for the `talker_path` fixture's decode path (tests/conftest.py)."""
    if path == "graphed":
        return {"device": "cuda", "dtype": "float32"}
    return {"static_decode": path == "static"}
