"""What an audio part costs in a chat: vLLM's Qwen-Omni processors expand its one placeholder to the audio
tower's output length (about 13 positions a second for Qwen3-Omni), which the talker prefills too, and refuse
audio shorter than the tower takes; a placeholder token typed in the text has no part to stand for. All three
are answered by the frontend with a 400 before the thinker runs."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from omni.api import build_app
from omni.api.audio_tokens import TOWERS, tower_of
from tests.unit.api_fakes import FakeOrchestrator, assert_error, chat_body
from tests.unit.test_audio_in import pcm_wav

SR = 16000


def vllm_positions(folder) -> callable:
    """n samples at 16 kHz -> the audio positions vLLM's own processor gives (None: it refuses them)."""
    from transformers import AutoTokenizer
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tok = AutoTokenizer.from_pretrained(folder)
    proc = MULTIMODAL_REGISTRY.create_processor(ModelConfig(
        model=str(folder), tokenizer=str(folder), dtype="float32",
        limit_mm_per_prompt={"audio": 1, "image": 0, "video": 0}))
    pad = tok.convert_tokens_to_ids(tok.audio_token)
    ids = tok.encode(tok.audio_bos_token + tok.audio_token + tok.audio_eos_token + "hi")

    def positions(n: int) -> int | None:
        items = proc.info.parse_mm_data({"audio": [(np.zeros(n, np.float32), SR)]})
        try:
            out = proc.apply(ProcessorInputs(list(ids), items), TimingContext(enabled=False))
        except Exception:
            return None
        return out["prompt_token_ids"].count(pad)
    return positions


@pytest.mark.parametrize("kind", ["qwen3", "qwen25"])
def test_the_audio_positions_and_the_shortest_audio_are_vllms(tmp_path_factory, kind):
    if kind == "qwen3":
        from omni.models.qwen3_omni import tiny
    else:
        from omni.models.qwen25_omni import tiny
    folder = tiny.build(tmp_path_factory.mktemp(kind))
    tower = tower_of(str(folder))
    assert tower is TOWERS["qwen3_omni_moe" if kind == "qwen3" else "qwen2_5_omni"]
    vllm = vllm_positions(folder)
    m = tower.min_samples
    assert vllm(m - 1) is None and vllm(m) == tower.positions(m) == 1
    # hop and window edges, and the 600 s a part may hold
    for n in (m + 1, 399, 479, 480, 481, 1600, 15999, 16000, 16001, 16159, 16160, 16161, 31999, 32161,
              479_999, 480_000, 480_001, 480_161, 1_190_752, 600 * SR):
        assert vllm(n) == tower.positions(n), n


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """A Qwen3-Omni tokenizer in a folder whose config.json names the model (what the frontend reads)."""
    from transformers import AutoTokenizer

    from omni.models import tiny_folder
    from omni.models.qwen3_omni import tiny

    folder = tmp_path_factory.mktemp("q3tok")
    tiny_folder.build_tokenizer(folder, 0, specials=tiny.SPECIALS, chat_template=tiny.CHAT_TEMPLATE,
                                extra_special_tokens=tiny.EXTRA_SPECIALS)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    return AutoTokenizer.from_pretrained(folder)


def audio_part(samples: int) -> dict:
    wav = pcm_wav(np.full(samples, 0.1, np.float32), SR, 1)
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def chat(tok, **kw):
    orch = FakeOrchestrator(tok)
    orch.audio_chunks = 1
    app = build_app(orch, tok, served_model_name="tiny", max_model_len=kw.pop("max_model_len", 4096),
                    speech_entry_stage=1)
    app.state.frontend.audio_prompt_len = kw.pop("audio_prompt_len", None)
    return orch, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def with_audio(samples: int, **kw) -> dict:
    return chat_body(messages=[{"role": "user", "content": [audio_part(samples), {"type": "text", "text": "hi"}]}],
                     **kw)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_chat_for_audio_counts_the_audio_positions_against_the_talker(qwen_tokenizer, anyio_backend):
    """10 s is 130 positions: past a talker taking 100, though the frontend's ids hold one placeholder."""
    orch, c = chat(qwen_tokenizer, audio_prompt_len=100)
    async with c:
        r = await c.post("/v1/chat/completions", json=with_audio(10 * SR, modalities=["text", "audio"]))
        assert_error(r, 400, "messages", "at most 100 tokens")
        assert "(130 of them for the audio)" in r.json()["error"]["message"]
        assert not orch.requests
        assert (await c.post("/v1/chat/completions", json=with_audio(10 * SR, modalities=["text"]))).status_code == 200
        assert (await c.post("/v1/chat/completions",
                             json=with_audio(5 * SR, modalities=["text", "audio"]))).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_max_tokens_counts_the_audio_positions_against_the_context(qwen_tokenizer, anyio_backend):
    orch, c = chat(qwen_tokenizer, max_model_len=256)
    async with c:
        r = await c.post("/v1/chat/completions", json=with_audio(10 * SR, max_tokens=200))
        assert_error(r, 400, "max_tokens", "maximum context length is 256")
        assert (await c.post("/v1/chat/completions", json=with_audio(10 * SR, max_tokens=100))).status_code == 200
        assert orch.requests[-1].sampling.max_tokens == 100
        req = orch.requests[-1]       # the router sizes it as admitted: 130 positions for the one placeholder id
        assert req.prompt_positions == len(req.prompt_token_ids) - 1 + 130


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_audio_shorter_than_the_tower_takes_is_a_400_naming_the_part(qwen_tokenizer, anyio_backend):
    orch, c = chat(qwen_tokenizer)
    async with c:
        for n in (1, 100, 160):
            r = await c.post("/v1/chat/completions", json=with_audio(n))
            assert_error(r, 400, "messages[0].content[0].input_audio.data",
                         "the Qwen3-Omni audio tower takes at least 10.1 ms (161 samples at 16000 Hz)")
            assert len(r.json()["error"]["message"]) < 200
        assert not orch.requests
        assert (await c.post("/v1/chat/completions", json=with_audio(161))).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("token", ["<|audio_pad|>", "<|image_pad|>", "<|video_pad|>"])
async def test_a_placeholder_token_typed_in_the_text_is_a_400_naming_messages(qwen_tokenizer, anyio_backend, token):
    orch, c = chat(qwen_tokenizer)
    async with c:
        r = await c.post("/v1/chat/completions",
                         json=chat_body(messages=[{"role": "user", "content": f"say {token} now"}]))
        kind = token[2:-6]     # the frontend and the stage say it alike (omni.mm_limits.placeholders_off)
        assert_error(r, 400, "messages", f"the prompt holds 1 {kind} placeholder(s) (`{token}`) for 0 {kind} part(s)")
        assert f"`{token}` typed in the messages is the special token" in r.json()["error"]["message"]
        # beside an audio part too
        body = with_audio(SR)
        body["messages"][0]["content"][1]["text"] = f"say {token} now"
        assert_error(await c.post("/v1/chat/completions", json=body), 400, "messages", f"`{token}`")
        # a completion's prompt, as text or as its token id
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": f"say {token} now"})
        assert_error(r, 400, "prompt", f"`{token}` typed in the prompt is the special token")
        tid = qwen_tokenizer.convert_tokens_to_ids(token)
        assert_error(await c.post("/v1/completions", json={"model": "tiny", "prompt": [1, tid]}), 400, "prompt")
        assert not orch.requests
        assert (await c.post("/v1/chat/completions", json=with_audio(SR))).status_code == 200


@pytest.mark.parametrize("content", ['{"model_type": "unknown_omni"}', "[1, 2]", "not json"])
def test_a_folder_whose_config_names_no_known_tower_has_none(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    assert tower_of(str(tmp_path)) is None
    assert tower_of(str(tmp_path / "missing")) is None and tower_of(None) is None
