"""A chat answered with audio is bounded by the talker's context too: the talker's static KV cache
(max_model_len, 4096 by default) prefills the whole prompt, so each talker replica registers the
longest prompt it takes (max_prompt_len), the frontend follows the smallest, and a longer prompt
asking for audio is a 400 naming it, not a failure mid-stream after the thinker ran."""

from __future__ import annotations

import types

import msgspec
import pytest
import torch

from omni.master.types import TopologyEvent
from omni.orchestrator.limits import follow_limits, replica_limits
from omni.orchestrator.topology import Topology
from tests.unit.api_fakes import anyio_backend, assert_error, chat_body, make, tokenizer  # noqa: F401
from tests.unit.test_orchestrator_core import replica

L = 32     # the talkers' max_model_len here


def qwen3_rows(e, n: int) -> int:
    """Prefill rows of the longest-prefilling n-token prompt: one user turn, then the assistant header."""
    from omni.models.qwen3_omni import edges

    ids = e.ids
    prompt = [ids.im_start, ids.user] + [ids.user] * (n - 5) + [ids.im_start, ids.assistant, ids.user]
    with torch.no_grad():
        return edges.prefill_embeds(e.talker, e.embed, ids, prompt, ids.user, ids.codec_pad, None, e._tts).shape[0]


def qwen25_rows(e, n: int) -> int:
    from omni.models.qwen25_omni import edges

    with torch.no_grad():
        hidden = torch.zeros(n + 1, e.embed.shape[1], dtype=e.embed.dtype)
        return edges.prefill_rows(e.talker, e.embed, e.ids, [1] * n, 1, next(iter(e.speakers.values())),
                                  hidden).shape[0]


@pytest.mark.parametrize("kind", ["qwen3", "qwen25"])
def test_a_talker_registers_the_longest_prompt_its_kv_cache_prefills(tmp_path_factory, kind):
    torch.set_num_threads(1)
    if kind == "qwen3":
        from omni.models.qwen3_omni import tiny
        from omni.models.qwen3_omni.talker import Qwen3TalkerEngine as Engine
        rows = qwen3_rows
    else:
        from omni.models.qwen25_omni import tiny
        from omni.models.qwen25_omni.talker import Qwen25TalkerEngine as Engine
        rows = qwen25_rows
    folder = tiny.build(tmp_path_factory.mktemp(kind))
    e = Engine(folder, max_model_len=L, enforce_eager=True)
    caps = replica_limits(e)
    n = int(caps["max_prompt_len"])
    # Not max_model_len: that bounds prompt + max_tokens at the entry stage (limits.fitting).
    assert set(caps) == {"max_prompt_len", "codec_stops"}
    # The static step refuses a prefill of L rows or more (slots.py): n fits, n + 1 need not.
    assert rows(e, n) < L <= rows(e, n + 1)
    e.shutdown()
    eager = Engine(folder, static_decode=False)      # a DynamicCache: no such bound
    assert "max_prompt_len" not in replica_limits(eager)
    eager.shutdown()


def talker(rid: str, limit: int | None, state: str = "READY"):
    caps = {"max_prompt_len": str(limit)} if limit else {}
    return msgspec.structs.replace(replica(1, rid, state=state), capabilities=caps)


def test_the_frontend_follows_the_smallest_talker_limit():
    topo = Topology()
    topo.apply(TopologyEvent("SNAPSHOT", [replica(0, "s0r0"), talker("s1r0", 4089)], 1))
    fe = type("FE", (), {"stage_codec_stops": {}})()
    follow_limits(fe, topo, types.SimpleNamespace(stages=()))
    assert fe.audio_prompt_len == 4089
    topo.apply(TopologyEvent("UPDATED", [talker("s1r1", 1017)], 2))
    assert fe.audio_prompt_len == 1017                  # a request may be sent to either
    topo.apply(TopologyEvent("UPDATED", [talker("s1r1", 1017, state="SUSPECT")], 3))
    assert fe.audio_prompt_len == 4089
    topo.apply(TopologyEvent("SNAPSHOT", [replica(0, "s0r0")], 4))
    assert fe.audio_prompt_len is None



@pytest.mark.anyio
async def test_a_chat_with_audio_longer_than_the_talker_takes_is_a_400_naming_it(tokenizer):  # noqa: F811
    orch, c = make(tokenizer, speech_entry_stage=1, max_model_len=4096)
    orch.audio_chunks = 1
    c._transport.app.state.frontend.audio_prompt_len = 20
    long = chat_body(messages=[{"role": "user", "content": "hello world " * 20}])
    r = await c.post("/v1/chat/completions", json={**long, "modalities": ["text", "audio"]})
    assert_error(r, 400, "messages", "the talker that speaks it takes prompts of at most 20 tokens")
    assert not orch.requests
    assert (await c.post("/v1/chat/completions", json={**long, "modalities": ["text"]})).status_code == 200
    short = chat_body(modalities=["audio"], audio={"voice": "joe", "format": "wav"})
    assert (await c.post("/v1/chat/completions", json=short)).status_code == 200
