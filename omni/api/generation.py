"""One request's trip through the orchestrator: detokenize, apply stop strings, gather audio.

`Generation.start()` waits for the first pipeline output, so errors raised before any
output (no replica, bad request in a stage) still become a proper HTTP status;
`events()` then yields ("text", str) and ("audio", pcm_f32_bytes, sample_rate): one text
event per output that carries tokens, "" while its text is held back (as vLLM streams), and
last ("end", str) once, with `finish_reason` and `stop_reason` set: the text of the output that finished the
request (or hit a stop string) and whatever was held back, so a stream can put the finish
reason on the chunk that carries the last token, as vLLM's server does.
With logprobs asked for, `take_logprobs()` hands out the entries of the tokens handled since
its last call. With `audio` (an api.audio_metrics.AudioStream) each audio event is timed as it is
handed out and `usage()` carries the request's audio seconds and time to first audio.
The orchestrator's iterator is always closed at the end, which aborts the request
in every stage when the client went away or a stop string ended it early. With audio asked for,
a stop string ends only the text stage (`end_text`) and the audio is read to the end; audio only:
the text is read (transcript, usage, logprobs) but yields no text events.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable

import anyio

from omni import latency_trace
from omni.api.audio_metrics import AudioStream
from omni.api.detok import IncrementalDetokenizer, StopMatcher
from omni.api.metrics import FrontendMetrics
from omni.orchestrator.types import OrchestratorLike, PipelineOutput, PipelineRequest


class Generation:
    def __init__(self, orchestrator: OrchestratorLike, request: PipelineRequest, *,
                 decode: Callable[[list[int]], str], prompt_ids: list[int], stops: list[str],
                 include_stop: bool = False, metrics: FrontendMetrics, route: str, t0: float, eos_token_id: int | None = None,
                 audio: AudioStream | None = None, response_id: str | None = None):
        self.request = request
        self.id = response_id or request.request_id    # the answer's id (a client's vLLM request_id)
        self.audio = audio          # set when the request asked for audio: its figures and usage
        self._eos = None if request.sampling.ignore_eos else eos_token_id
        self.created = int(time.time())  # one value for every chunk of the stream
        # The prompt as templated; the engine's own count replaces it once reported (_count_prompt).
        self.prompt_tokens = len(prompt_ids)
        self._engine_prompt = bool(prompt_ids)     # speech has no token prompt: nothing to count
        self.engine_prompt_tokens: int | None = None   # the entry stage's own count (speech's input_tokens)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None   # vLLM's: the stop string or stop token id that ended it
        self.text = ""
        self.sample_rate = 0
        self._orch = orchestrator
        self._detok = IncrementalDetokenizer(decode, prompt_ids)
        self._stop = StopMatcher(stops, include_stop)
        self._include_stop = include_stop
        self._min_tokens = request.sampling.min_tokens   # stop strings count only past it (vLLM)
        self._metrics, self._route, self._t0 = metrics, route, t0
        self._it: AsyncIterator[PipelineOutput] | None = None
        self._first: PipelineOutput | None = None
        self._done = False
        # Spoken: a stop string ends only the text stage and the audio goes on (Orchestrator.end_text);
        # audio only: the text is the transcript, no text events.
        self._speaks, self._text_out = "audio" in request.modalities, "text" in request.modalities
        self._cut = False
        self._timed = False                # first output recorded (the frontend's time to first output)
        self.want_logprobs = request.sampling.logprobs is not None
        self._logprobs: list = []          # omni.api.logprobs.Entry, not yet taken

    async def start(self) -> None:
        if latency_trace.on():
            latency_trace.mark("arrived", self.request.request_id, at=self._t0)
        self._it = aiter(self._orch.generate(self.request))
        try:
            self._first = await anext(self._it)
        except StopAsyncIteration:
            self._done = True
        except BaseException:
            await self.close()
            raise
        self._count_prompt(self._first)     # a stream's first chunk carries usage before events()
        # Audio only: the transcript's text comes first, but the client's first output is audio.
        if self._text_out or self._first is None or self._first.modality != "text":
            self._time_first()

    def _time_first(self) -> None:
        if not self._timed:
            self._timed = True
            self._metrics.first_output(self._route, time.monotonic() - self._t0)

    @property
    def first_sample_rate(self) -> int:
        """The sample rate of the first output (after start()), 0 when it carries no audio."""
        return self._first.sample_rate if self._first is not None else 0

    async def close(self) -> None:
        it, self._it = self._it, None
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            # Shielded: the close runs even when the stream was cancelled by a disconnect.
            with anyio.CancelScope(shield=True):
                await aclose()

    async def events(self) -> AsyncIterator[tuple]:
        try:
            out = self._first
            last = ""
            while out is not None:
                for ev in self._handle(out):
                    if ev[0] == "text" and (self._ends(out) or not self._text_out):
                        last = ev[1] if self._text_out else ""     # rides on the "end" event
                    else:
                        yield ev
                if self._stop.stopped and self._speaks and not self._cut:
                    self._cut = True        # the text stage ends; the audio of what it sent goes on
                    self._orch.end_text(self.request.request_id)
                if self._ends(out):
                    break
                try:
                    out = await anext(self._it)
                except StopAsyncIteration:
                    out = None
            tail = self._stop.feed(self._detok.flush(), self.completion_tokens > self._min_tokens)
            tail += self._stop.flush()
            self.text += tail
            if self._stop.stopped or self.finish_reason is None:
                self.finish_reason = "stop"
            if self._stop.stopped:
                self.stop_reason = self._stop.matched
            if self.audio is not None:
                self.audio.completed()
            self._time_first()     # an audio-only answer with nothing to speak: its end is the first output
            yield ("end", last + tail if self._text_out else "")
        finally:
            self._metrics.tokens(self.prompt_tokens, self.completion_tokens)
            await self.close()

    def _ends(self, out: PipelineOutput) -> bool:
        return out.finished or (self._stop.stopped and not self._speaks)

    def _count_prompt(self, out: PipelineOutput | None) -> None:
        if out is None or out.num_prompt_tokens is None:
            return
        self.engine_prompt_tokens = out.num_prompt_tokens
        if self._engine_prompt:
            # vLLM's prompt with the audio placeholders expanded: what its own server's usage counts
            self.prompt_tokens = out.num_prompt_tokens

    def _handle(self, out: PipelineOutput):
        self._count_prompt(out)
        if out.modality == "text" and out.token_ids and not self._stop.stopped:
            ids = out.token_ids
            # As vLLM: the token a stop finish stopped on adds no text (also when audio follows the
            # text), unless include_stop_str_in_output.
            skip = not self._include_stop and isinstance(out.stop_reason, int) and ids[-1] == out.stop_reason
            text, kept = self._text_of(ids, skip)
            self.completion_tokens += kept
            if self.want_logprobs and out.logprobs is not None:
                self._logprobs.extend((t, lp, top) for t, (lp, top) in zip(ids[:kept], out.logprobs.rows()))
            if latency_trace.on():
                latency_trace.mark("text" if text else "no_text", self.request.request_id, len(out.token_ids))
            self.text += text
            if text or not self._stop.stopped:
                # One event per output, "" while text is held back (half a character, a
                # possible stop string), as vLLM streams: a skipped chunk would read as
                # one doubled inter-token gap to a client.
                yield ("text", text)
        elif out.modality == "audio" and out.audio_pcm:
            if latency_trace.on():
                latency_trace.mark("audio", self.request.request_id, len(out.audio_pcm))
            self.sample_rate = out.sample_rate or self.sample_rate
            if self.audio is not None:
                self.audio.chunk(len(out.audio_pcm) // 4, out.sample_rate)   # float32 samples
            self._time_first()
            yield ("audio", out.audio_pcm, out.sample_rate)
        if out.finished:
            # vLLM's server checks the tokenizer's EOS before stop_token_ids: that one stops with null
            self.finish_reason = out.finish_reason or "stop"
            self.stop_reason = None if out.stop_reason == self._eos else out.stop_reason

    def _text_of(self, ids: list[int], skip_last: bool) -> tuple[str, int]:
        """The text `ids` add (past stop strings) and how many of them count. With stop strings, one
        token at a time: as vLLM, the tokens after the one that completed a match are dropped."""
        n = len(ids) - skip_last
        if not self._stop.active:
            return self._detok.push(ids[:n]), len(ids)
        text = ""
        for i, t in enumerate(ids):
            delta = self._detok.push([t]) if i < n else ""
            text += self._stop.feed(delta, self.completion_tokens + i + 1 > self._min_tokens)
            if self._stop.stopped:
                return text, i + 1
        return text, len(ids)

    def take_logprobs(self) -> list:
        out, self._logprobs = self._logprobs, []
        return out

    def usage(self) -> dict:
        u = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
             "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.audio is not None:
            u.update(self.audio.usage())
        return u
