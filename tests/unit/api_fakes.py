"""The fakes and helpers of the HTTP API's unit tests: a tiny byte-level BPE tokenizer with a chat
template, an orchestrator that replies one token per output (and can fail, hang or sleep), an app on
an in-memory ASGI client or served by omni's Hypercorn on a thread, and the checks of SSE framing and of
OpenAI's error body."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from omni.api import build_app
from omni.api.limits import HttpLimits
from omni.api.serve import serve
from omni.errors import StageFailed
from omni.orchestrator.types import PipelineOutput, PipelineRequest

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.",
          "system user assistant: you are a helpful assistant. say hello!"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    t.chat_template = CHAT_TEMPLATE
    return t


class FakeOrchestrator:
    """Replies with `reply` (a string) one token per output; can fail, hang, be unhealthy or sleep."""

    def __init__(self, tokenizer, reply: str = "hello world"):
        self.tok = tokenizer
        self.reply = reply
        self.fail: Exception | None = None        # raised before the first output
        self.fail_after: int | None = None         # raise StageFailed after this many outputs
        self.hang_after: int | None = None         # wait forever after this many outputs
        self.audio_chunks = 0                      # audio outputs after the text
        self.ok, self.reason = True, ""
        self.sleeping = False
        self.end_token: int | None = None          # ends the reply instead of EOS (a stop_token_ids entry)
        self.requests: list[PipelineRequest] = []
        self.closed: list[str] = []
        self.closed_event = asyncio.Event()
        self.started_event = asyncio.Event()

    async def generate(self, request: PipelineRequest):
        self.requests.append(request)
        self.started_event.set()
        try:
            if self.fail is not None:
                raise self.fail
            end = self.tok.eos_token_id if self.end_token is None else self.end_token
            ids = self.tok.encode(self.reply, add_special_tokens=False) + [end]
            if request.entry_stage != 0:
                ids = []
            n = request.sampling.max_tokens
            out_ids, reason = (ids[:n], "length") if len(ids) > n else (ids, "stop")
            total = len(out_ids) + self.audio_chunks
            for i, t in enumerate(out_ids):
                if self.fail_after is not None and i == self.fail_after:
                    raise StageFailed(0, "r0", "boom")
                if self.hang_after is not None and i == self.hang_after:
                    await asyncio.Event().wait()
                last = i == total - 1
                yield PipelineOutput(request_id=request.request_id, stage_id=0, modality="text", token_ids=[t],
                                     finished=last, finish_reason=reason if last else None,
                                     # as the torch engine: the token a "stop" finish stopped on
                                     stop_reason=t if last and reason == "stop" else None)
            for j in range(self.audio_chunks):
                pcm = (np.full(100, 0.5 if j % 2 == 0 else -0.5, dtype="<f4")).tobytes()
                last = j == self.audio_chunks - 1
                yield PipelineOutput(request_id=request.request_id, stage_id=2, modality="audio", audio_pcm=pcm,
                                     sample_rate=22050, finished=last, finish_reason="stop" if last else None)
        finally:
            self.closed.append(request.request_id)
            self.closed_event.set()

    def health(self):
        return self.ok, self.reason

    async def sleep(self, level: int = 1, mode: str = "abort", stage_ids: tuple[int, ...] = ()) -> dict:
        self.sleeping = True
        return {"sleeping": True, "level": level, "mode": mode, "stage_ids": list(stage_ids)}

    async def wake_up(self, stage_ids: tuple[int, ...] = ()) -> dict:
        self.sleeping = False
        return {"sleeping": False, "stage_ids": list(stage_ids)}

    async def is_sleeping(self) -> bool:
        return self.sleeping

    def metrics_text(self) -> str:
        return "# TYPE omni_orchestrator_requests gauge\nomni_orchestrator_requests 7\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make(tokenizer, **kw):
    orch = FakeOrchestrator(tokenizer, kw.pop("reply", "hello world"))
    kw.setdefault("served_model_name", "tiny")
    kw.setdefault("max_model_len", 128)
    app = build_app(orch, tokenizer, **kw)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return orch, client


@contextlib.contextmanager
def served_in_thread(app, limits: HttpLimits):
    """(host, port) of `app` served by omni's `serve` on its own thread's loop, for blocking clients;
    stopped (its graceful stop, 1 s) and joined on exit."""
    loop = asyncio.new_event_loop()
    ready, addr, stop = threading.Event(), [], []

    async def main():
        stop.append(asyncio.Event())
        await serve(app, shutdown_event=stop[0], graceful_timeout=1.0, limits=limits,
                    on_ready=lambda h, p: (addr.append((h, p)), ready.set()))

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "the server did not start"
        yield addr[0]
    finally:
        if stop:
            loop.call_soon_threadsafe(stop[0].set)
        thread.join(10)
        if not thread.is_alive():
            loop.close()


def sse_events(body: str) -> list:
    assert body.endswith("\n\n"), body[-50:]
    frames = body.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[6:]) for f in frames[:-1]]


def chat_body(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "say hello"}], **kw}


def assert_error(r, status, param=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err
