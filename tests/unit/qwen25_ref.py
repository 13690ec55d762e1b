"""The transformers reference for the Qwen2.5-Omni stage tests: the tiny model's `generate()`,
greedy on thinker and talker after `torch.manual_seed(seed)`, with the talker's codes and the
thinker's rows the talker reads captured."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni.engines.base import EngineRequest, SamplingParams


@dataclass
class Ref:
    prompt: list[int]
    generated: list[int]
    hidden: torch.Tensor          # [len(prompt) + len(generated) - 1, H]: final-normed last layer per fed token
    codes: torch.Tensor           # [T] codec ids, EOS cut
    wav: torch.Tensor             # [n] float
    last_layer: torch.Tensor      # the same rows as `hidden` before the thinker's final norm


def wave(seed: int = 0) -> np.ndarray:
    """A seeded 1 s sine + noise at 16 kHz (the reference's audio input)."""
    rng = np.random.default_rng(seed)
    t = np.arange(16000) / 16000
    return (0.5 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(16000)).astype(np.float32)


class Reference:
    def __init__(self, folder):
        from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

        self.folder = folder
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        # from_pretrained leaves tensors in the mmapped file, 8 bytes off a 64-byte boundary; CPU kernels
        # round differently there (the DiT's mel moves ~2e-7). Own, aligned copies: the same values.
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t.data = t.data.clone()
        self.features = WhisperFeatureExtractor.from_pretrained(folder)
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self._codes: list[torch.Tensor] = []
        self._thinker: list = []
        think = self.model.thinker.generate

        def capture_thinker(*a, **kw):
            self._thinker.append(think(*a, **kw))
            return self._thinker[-1]
        self.model.thinker.generate = capture_thinker
        self._last: list[torch.Tensor] = []

        def capture_last(module, args, out):
            self._last.append((out[0] if isinstance(out, tuple) else out)[0].clone())
        self.model.thinker.model.layers[-1].register_forward_hook(capture_last)
        t2w = self.model.token2wav
        forward = t2w.forward

        def capture(code, *a, **kw):
            self._codes.append(code.clone())
            return forward(code, *a, **kw)
        t2w.forward = capture

    def prompt(self, text: str, audio: bool = False) -> list[int]:
        content = [{"type": "audio"}, {"type": "text", "text": text}] if audio else text
        msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": content}]
        return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]

    def audio_inputs(self, seed: int = 0):
        """Whisper features of `wave(seed)` and the audio tower's output length."""
        f = self.features(wave(seed), sampling_rate=16000, return_attention_mask=True, padding="longest",
                          return_tensors="pt")
        _, n = self.model.thinker.audio_tower._get_feat_extract_output_lengths(f["attention_mask"].sum(-1))
        return f["input_features"], f["attention_mask"], int(n.item())

    @torch.no_grad()
    def run(self, text: str, speaker: str = "Chelsie", thinker_tokens: int = 8, talker_tokens: int = 40,
            audio: bool = False, seed: int = 0, eos: int | None = None) -> Ref:
        prompt = self.prompt(text, audio)
        kwargs = {}
        if audio:
            feats, mask, n = self.audio_inputs()
            pad = self.tok.convert_tokens_to_ids("<|AUDIO|>")
            i = prompt.index(pad)
            prompt = prompt[:i] + [pad] * n + prompt[i + 1:]
            kwargs = dict(input_features=feats, feature_attention_mask=mask)
        ids = torch.tensor([prompt])
        self._codes.clear()
        self._thinker.clear()
        self._last.clear()
        torch.manual_seed(seed)
        seq, wav = self.model.generate(
            ids, speaker=speaker, thinker_do_sample=False, talker_do_sample=False,
            thinker_max_new_tokens=thinker_tokens, thinker_eos_token_id=self.im_end if eos is None else eos,
            talker_max_new_tokens=talker_tokens, **kwargs)
        generated = seq[0, len(prompt):].tolist()
        # The rows the talker reads: the thinker's final-normed last layer at every fed position,
        # as generate computed them (prefill, then one per decode step).
        hidden = torch.cat([step[-1][0] for step in self._thinker[-1].hidden_states]).clone()
        assert hidden.shape[0] == len(prompt) + len(generated) - 1
        last = torch.cat(self._last)
        assert last.shape == hidden.shape
        return Ref(prompt, generated, hidden, self._codes[-1][0], wav.reshape(-1), last)


def talker_pieces(ref: Ref, rid: str, speaker: str, per_token: bool, max_tokens: int,
                  pre_norm: bool = False, **sampling) -> list[EngineRequest]:
    """The talker requests for one reference run: everything at once, or one generated id per piece
    carrying the row that id's step of the thinker computed (the prompt's rows come with the first).
    `pre_norm`: send the rows before the thinker's final norm (`thinker_last_layer`)."""
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    gen, n = ref.generated, len(ref.prompt)
    key = "thinker_last_layer" if pre_norm else "thinker_hidden"
    rows = ref.last_layer if pre_norm else ref.hidden
    if not per_token:
        return [EngineRequest(request_id=rid, prompt_token_ids=ref.prompt, sampling=params,
                              tensors={key: rows},
                              voice=speaker, generated_ids=gen, final=True)]
    first = EngineRequest(request_id=rid, prompt_token_ids=ref.prompt, sampling=params,
                          tensors={key: rows[:n]},
                          voice=speaker, generated_ids=gen[:1], final=len(gen) == 1)
    rest = [EngineRequest(request_id=rid, tensors={key: rows[n + i - 1:n + i]},
                          generated_ids=[t], final=i == len(gen) - 1)
            for i, t in enumerate(gen) if i > 0]
    return [first] + rest
