"""Qwen3-Omni's or Qwen2.5-Omni's three engines in one process, as a user of the modules would run them.

The same engine classes omni's stages run, built from the same resolved deploy config
(VllmEngine for the thinker; Qwen3TalkerEngine and Qwen3Code2WavEngine, or Qwen25TalkerEngine
and Qwen25Token2WavEngine), stepped in one loop: thinker tokens (Qwen2.5: with their
last-layer rows) go to the talker as they come, talker code chunks to the vocoder as they
come. The only differences to `omni serve` are the process split and the transport
(and the HTTP/SSE layer). vLLM keeps its EngineCore in its own process here too, as
vLLM's offline `LLM` does.

Used by benchmarks/qwen3_omni.py; no CLI of its own.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM = {"role": "system", "content": "You are helpful."}
# What omni's stages get from the benchmark's server environment (tests/e2e/test_qwen3_omni.py).
ENGINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_CI_ENV": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
              "VLLM_LOGGING_STREAM": "ext://sys.stderr"}   # stdout is for the table or JSON


@dataclass
class Rec:
    """One request's times in seconds from its submission (None: did not happen)."""
    prompt: int
    ttft: float | None = None          # first thinker token
    text_done: float | None = None     # the thinker's last output
    sentence: float | None = None      # the thinker's first sentence ended (or the thinker ended)
    talker_first: float | None = None  # first code chunk
    ttfa: float | None = None          # first audio sample
    done: float | None = None
    samples: int = 0
    text: str = ""
    ids: list[int] = field(default_factory=list)


class InProcess:
    def __init__(self, folder: Path, overrides: dict, voice: str, seed: int | None = None):
        for k, v in ENGINE_ENV.items():
            os.environ.setdefault(k, v)
        import torch
        from transformers import AutoTokenizer

        from omni import config as omni_config
        from omni.engines.vllm import engine as vllm_engine
        from omni.engines.factory import build_engine

        torch.set_num_threads(1)
        self.cfg = omni_config.load(str(folder), stage_overrides=overrides)
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.voice = voice
        self.seed = seed       # the request's seed (Qwen2.5's token2wav draws its noise from it)
        self._vllm = vllm_engine
        self._wait_s = vllm_engine.STEP_WAIT_S
        t0 = time.perf_counter()
        self.thinker, self.talker, self.code2wav = (build_engine(self.cfg, self.cfg.stage(i)) for i in (0, 1, 2))
        self.load_seconds = time.perf_counter() - t0
        # The orchestrator sends a later stage its defaults as the request's overrides: the same here.
        self.talker_defaults = self.cfg.stage(1).default_sampling_params
        self.names = tuple(self.cfg.stage(i).name for i in (0, 1, 2))    # thinker, talker, code2wav|token2wav
        # Qwen2.5's token2wav takes the voice on its first piece (Qwen3's code2wav has no voice).
        self.vocoder_voice = self.cfg.stage(2).engine == "qwen25_token2wav"
        self.busy = {n: 0.0 for n in self.names}

    def prompt_ids(self, text: str) -> list[int]:
        """As omni's frontend: render the chat template, then encode without special tokens."""
        rendered = self.tok.apply_chat_template([SYSTEM, {"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=False)
        return list(self.tok.encode(rendered, add_special_tokens=False))

    def burst(self, prompts: list[tuple[int, str]], max_tokens: int, tag: str,
              sentence_done) -> list[Rec]:
        """Submit every prompt at once, step the three engines until every audio stream ends."""
        from omni.engines.base import EngineRequest, SamplingParams

        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=self.seed)
        t0 = time.perf_counter()
        recs: dict[str, Rec] = {}
        for i, (idx, text) in enumerate(prompts):
            rid = f"{tag}-{i}"
            recs[rid] = Rec(idx)
            # audio_out: as omni's chat sets it when audio is asked for (Qwen2.5's thinker then sends rows).
            self.thinker.add_request(EngineRequest(request_id=rid, prompt_token_ids=self.prompt_ids(text),
                                                   sampling=sampling, audio_out=True))
        started: set[str] = set()
        voiced: set[str] = set()
        open_ = set(recs)
        while open_:
            # The thinker's step waits a little for vLLM's outputs: only when nothing else can step.
            others = self.talker.has_unfinished() or self.code2wav.has_unfinished()
            self._vllm.STEP_WAIT_S = 0.0 if others else self._wait_s
            try:
                if self.thinker.has_unfinished():
                    self._thinker_step(recs, started, sampling, t0, sentence_done)
            finally:
                self._vllm.STEP_WAIT_S = self._wait_s
            if self.talker.has_unfinished():
                s = time.perf_counter()
                outs = self.talker.step()
                self.busy[self.names[1]] += time.perf_counter() - s
                now = time.perf_counter()
                for out in outs:
                    _check(out)
                    codes = out.tensors.get("codes")
                    r = recs[out.request_id]
                    if r.talker_first is None:
                        r.talker_first = now - t0
                    voice = None
                    if self.vocoder_voice and out.request_id not in voiced:
                        voiced.add(out.request_id)
                        voice = self.voice
                    self.code2wav.add_request(EngineRequest(
                        request_id=out.request_id, tensors={"codes": codes} if codes is not None else {},
                        sampling=sampling, final=out.finished, voice=voice))
            if self.code2wav.has_unfinished():
                s = time.perf_counter()
                outs = self.code2wav.step()
                now = time.perf_counter()
                self.busy[self.names[2]] += now - s
                for out in outs:
                    _check(out)
                    r = recs[out.request_id]
                    n = out.tensors["audio"].numel()
                    if n and r.ttfa is None:
                        r.ttfa = now - t0
                    r.samples += n
                    if out.finished:
                        r.done = now - t0
                        open_.discard(out.request_id)
        return list(recs.values())

    def _thinker_step(self, recs, started, sampling, t0, sentence_done) -> None:
        from omni.engines.base import EngineRequest

        s = time.perf_counter()
        outs = self.thinker.step()
        # Drain what vLLM has queued (one step returns one EngineCore step's tokens), else
        # the talker's steps would pace the thinker's text.
        while True:
            more = self.thinker.step() if outs and self.thinker.has_unfinished() else []
            if not more:
                break
            outs += more
        now = time.perf_counter()
        self.busy[self.names[0]] += now - s
        for out in outs:
            _check(out)
            rid = out.request_id
            r = recs[rid]
            if out.token_ids and r.ttft is None:
                r.ttft = now - t0
            r.ids += out.token_ids
            r.text = self.tok.decode(r.ids, skip_special_tokens=True)
            if r.sentence is None and (sentence_done(r.text) or out.finished):
                r.sentence = now - t0
            if out.finished:
                r.text_done = now - t0
            piece = dict(sampling=sampling, overrides=self.talker_defaults, generated_ids=list(out.token_ids),
                         final=out.finished)
            # Qwen2.5: the thinker's last-layer rows, as the stage processor passes them on.
            rows = {"thinker_last_layer": out.tensors["hidden_rows"]} if "hidden_rows" in out.tensors else {}
            if rid in started:
                self.talker.add_request(EngineRequest(request_id=rid, tensors=rows, **piece))
                continue
            started.add(rid)
            prompt = out.tensors["prompt_token_ids"].tolist()    # emit_prompt_ids, as the deploy sets
            self.talker.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, voice=self.voice,
                                                  tensors=rows, **piece))

    def shutdown(self) -> None:
        self.thinker.shutdown()


def _check(out) -> None:
    if out.error:
        raise RuntimeError(f"{out.request_id}: {out.error}")
