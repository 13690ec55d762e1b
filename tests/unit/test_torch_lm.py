"""TorchLMEngine against HF transformers on a tiny random Llama (fp32)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, SamplingParams
from omni.engines.torch_lm import TorchLMEngine
from omni.errors import ConfigError

EOS = 255


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                      rope_theta=10000.0, initializer_range=0.3, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def engine(tiny):
    eng = TorchLMEngine(tiny[0], dtype="float32", max_num_seqs=4, max_model_len=128,
                        emit_hidden_states=True)
    yield eng
    eng.shutdown()


def hf_greedy(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def req(rid, prompt, **sampling):
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(**sampling))


def run(engine, schedule=None, max_steps=500):
    """Step until idle. schedule: {step_index: [requests to add before that step]}.

    Returns ({rid: [outputs]}, max number running at once).
    """
    schedule = dict(schedule or {})
    outs: dict[str, list] = {}
    peak = 0
    for i in range(max_steps):
        for r in schedule.pop(i, []):
            engine.add_request(r)
        if not engine.has_unfinished() and not schedule:
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        peak = max(peak, engine.num_running())
    assert not engine.has_unfinished()
    return outs, peak


def tokens(outs):
    return [t for o in outs for t in o.token_ids]


PROMPTS = {"a": [5, 9, 13], "b": list(range(20, 37)), "c": [7] * 2 + list(range(100, 110)),
           "d": list(range(40, 80)), "e": [3]}


def test_greedy_matches_hf_with_requests_joining_at_different_steps(engine, tiny):
    _, model = tiny
    n = 12
    schedule = {0: [req("a", PROMPTS["a"], max_tokens=n), req("b", PROMPTS["b"], max_tokens=n)],
                3: [req("c", PROMPTS["c"], max_tokens=n)],
                5: [req("d", PROMPTS["d"], max_tokens=n), req("e", PROMPTS["e"], max_tokens=n)]}
    outs, peak = run(engine, schedule)
    assert peak == 4                     # max_num_seqs: "e" waited for a free slot
    for rid, prompt in PROMPTS.items():
        expected = hf_greedy(model, prompt, n)
        assert tokens(outs[rid]) == expected, rid
        assert outs[rid][0].num_prompt_tokens == len(prompt)
        assert all(len(o.token_ids) == 1 for o in outs[rid])
        assert [o.finished for o in outs[rid]] == [False] * (len(outs[rid]) - 1) + [True]
        expect_reason = "stop" if expected[-1] == EOS and len(expected) < n else "length"
        assert outs[rid][-1].finish_reason == expect_reason
        # the token a "stop" finish stopped on (EOS here; the frontend nulls the tokenizer's EOS), else null
        assert [o.stop_reason for o in outs[rid]] == [None] * (len(outs[rid]) - 1) + \
            [EOS if expect_reason == "stop" else None]


def test_hidden_states_match_hf(engine, tiny):
    _, model = tiny
    outs, _ = run(engine, {0: [req("h1", PROMPTS["b"], max_tokens=6), req("h2", PROMPTS["a"], max_tokens=6)]})
    for rid, prompt in (("h1", PROMPTS["b"]), ("h2", PROMPTS["a"])):
        got = torch.cat([o.tensors["hidden_states"] for o in outs[rid]])
        out_tokens = tokens(outs[rid])
        fed = prompt + out_tokens[:-1]
        assert got.shape == (len(fed), 64)
        assert outs[rid][0].tensors["hidden_states"].shape[0] == len(prompt)
        with torch.inference_mode():
            ref = model.model(input_ids=torch.tensor([fed])).last_hidden_state[0]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_non_contiguous_slots_after_abort_still_match_hf(engine, tiny):
    _, model = tiny
    for rid, p in (("x0", PROMPTS["a"]), ("x1", PROMPTS["b"]), ("x2", PROMPTS["c"])):
        engine.add_request(req(rid, p, max_tokens=10, ignore_eos=True))
    outs: dict[str, list] = {}
    for _ in range(2):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.abort("x0")                   # frees slot 0: the batch is now slots 1, 2
    assert engine.num_running() == 2
    rest, _ = run(engine)
    assert "x0" not in rest
    for rid, p in (("x1", PROMPTS["b"]), ("x2", PROMPTS["c"])):
        got = tokens(outs[rid] + rest[rid])
        assert len(got) == 10
        ref = hf_greedy(model, p, 10)
        assert got[:len(ref)] == ref


def test_abort_waiting_and_unknown(engine):
    engine.add_request(req("w", PROMPTS["a"], max_tokens=3))
    assert engine.num_waiting() == 1
    engine.abort("w")
    engine.abort("never-added")
    assert engine.num_waiting() == 0 and not engine.has_unfinished()
    assert engine.step() == []


def test_seeded_sampling_is_reproducible(engine):
    sp = dict(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _ = run(engine, {0: [req("s1", PROMPTS["b"], **sp)]})
    # Same seed again, this time sharing the batch with other requests.
    crowd, _ = run(engine, {0: [req("o1", PROMPTS["a"], max_tokens=20, temperature=1.0),
                                req("s2", PROMPTS["b"], **sp), req("o2", PROMPTS["c"], max_tokens=20)]})
    assert tokens(alone["s1"]) == tokens(crowd["s2"])
    other, _ = run(engine, {0: [req("s3", PROMPTS["b"], **{**sp, "seed": 99})]})
    assert tokens(other["s3"]) != tokens(alone["s1"])


def test_top_k_1_and_tiny_top_p_are_greedy(engine, tiny):
    _, model = tiny
    outs, _ = run(engine, {0: [req("k", PROMPTS["c"], max_tokens=8, temperature=2.0, top_k=1, ignore_eos=True),
                               req("p", PROMPTS["c"], max_tokens=8, temperature=2.0, top_p=1e-6,
                                   ignore_eos=True)]})
    ref = hf_greedy(model, PROMPTS["c"], 8)
    assert tokens(outs["k"])[:len(ref)] == ref
    assert tokens(outs["p"])[:len(ref)] == ref


def test_stop_token_ids_and_max_tokens(engine, tiny):
    _, model = tiny
    ref = hf_greedy(model, PROMPTS["d"], 10)
    stop = ref[3]
    first = ref.index(stop)
    outs, _ = run(engine, {0: [req("st", PROMPTS["d"], max_tokens=10, stop_token_ids=(stop,)),
                               req("mt", PROMPTS["d"], max_tokens=1)]})
    assert tokens(outs["st"]) == ref[:first + 1]
    assert outs["st"][-1].finish_reason == "stop"
    assert outs["st"][-1].stop_reason == stop and all(o.stop_reason is None for o in outs["st"][:-1])
    assert tokens(outs["mt"]) == ref[:1] and outs["mt"][0].finished
    assert outs["mt"][0].finish_reason == "length" and outs["mt"][0].stop_reason is None


def test_stop_reason_is_the_token_a_stop_finish_stopped_on(engine, tiny):
    # a stop_token_ids entry, or an EOS id of the model: the engine reports which; whether it shows
    # as null (the tokenizer's EOS, as vLLM's server) is the frontend's call (tests/unit/test_api.py)
    first = hf_greedy(tiny[1], PROMPTS["d"], 1)[0]
    saved = engine.eos_token_ids
    engine.eos_token_ids = type(saved)([*saved, first])   # the first greedy token counts as an EOS
    try:
        outs, _ = run(engine, {0: [req("eos", PROMPTS["d"], max_tokens=5)]})
    finally:
        engine.eos_token_ids = saved
    assert (tokens(outs["eos"]), outs["eos"][-1].finish_reason, outs["eos"][-1].stop_reason) == ([first], "stop", first)


def test_context_full_finishes_with_length(tiny):
    eng = TorchLMEngine(tiny[0], dtype="float32", max_num_seqs=2, max_model_len=8)
    outs, _ = run(eng, {0: [req("full", [1, 2, 3, 4, 5], max_tokens=50, ignore_eos=True),
                            req("exact", list(range(8)), max_tokens=50, ignore_eos=True)]})
    assert len(tokens(outs["full"])) == 3          # 5 prompt + 3 generated = max_model_len
    assert outs["full"][-1].finish_reason == "length"
    assert len(tokens(outs["exact"])) == 1 and outs["exact"][-1].finish_reason == "length"
    with pytest.raises(EngineError, match="max_model_len"):
        eng.add_request(req("long", list(range(9))))


@pytest.mark.parametrize("bad, match", [
    (EngineRequest(request_id="e1", prompt_token_ids=[]), "empty"),
    (EngineRequest(request_id="e2", prompt_token_ids=list(range(129))), "max_model_len"),
    (EngineRequest(request_id="e3", prompt_token_ids=[1, 256]), "256 is outside the vocabulary"),
    (EngineRequest(request_id="e4", prompt_token_ids=[-1]), "outside the vocabulary"),
    (EngineRequest(request_id="e5", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=0)), "max_tokens"),
    (EngineRequest(request_id="e6", prompt_token_ids=[1], sampling=SamplingParams(top_p=0.0)), "top_p"),
    (EngineRequest(request_id="e7", prompt_token_ids=[1], sampling=SamplingParams(temperature=-1)),
     "temperature"),
    (EngineRequest(request_id="e8"), "neither prompt_token_ids nor text"),
    (EngineRequest(request_id="e9", text="hello"), "no usable tokenizer"),
])
def test_bad_requests_raise_and_engine_keeps_serving(engine, tiny, bad, match):
    with pytest.raises(EngineError, match=match):
        engine.add_request(bad)
    assert not engine.has_unfinished()
    outs, _ = run(engine, {0: [req("ok", PROMPTS["a"], max_tokens=4)]})
    assert tokens(outs["ok"]) == hf_greedy(tiny[1], PROMPTS["a"], 4)


def test_duplicate_request_id_is_refused(engine):
    engine.add_request(req("dup", PROMPTS["a"], max_tokens=2))
    with pytest.raises(EngineError, match="already"):
        engine.add_request(req("dup", PROMPTS["a"], max_tokens=2))
    run(engine)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake(engine, tiny, level):
    assert engine.can_sleep()
    engine.add_request(req("busy", PROMPTS["a"], max_tokens=2))
    with pytest.raises(EngineError, match="unfinished"):
        engine.sleep(level)
    run(engine)
    engine.sleep(level)
    assert engine.is_sleeping()
    assert engine._lm is None if level == 2 else engine._lm.k_cache is None
    with pytest.raises(EngineError, match="engine is sleeping"):
        engine.add_request(req("z", PROMPTS["a"]))
    assert engine.step() == []
    engine.wake_up()
    assert not engine.is_sleeping()
    outs, _ = run(engine, {0: [req("after", PROMPTS["b"], max_tokens=6)]})
    assert tokens(outs["after"]) == hf_greedy(tiny[1], PROMPTS["b"], 6)


def test_stats_count_work(engine):
    before = engine.stats()
    run(engine, {0: [req("st1", PROMPTS["a"], max_tokens=3, ignore_eos=True)]})
    after = engine.stats()
    assert after["steps"] - before["steps"] == 3
    assert after["generation_tokens"] - before["generation_tokens"] == 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == 3
    assert after["step_ms_avg"] > 0


def test_bad_constructor_args(tiny):
    with pytest.raises(ConfigError, match="dtype"):
        TorchLMEngine(tiny[0], dtype="float16")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        TorchLMEngine(tiny[0], dtype="float32", max_model_len=4096)


# ---- model resolution (no real model here) ----------------------------------------

def test_resolve_local_dir_and_unknown_names(tiny, tmp_path):
    from omni.models import resolve_model

    assert resolve_model(tiny[0]) == str(Path(tiny[0]).resolve())
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match=r"'org/nope'.*HuggingFaceTB/SmolLM2-135M-Instruct"):
        resolve_model("org/nope")
    with pytest.raises(ConfigError, match="empty"):
        resolve_model(" ")
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_prepare_converts_once_under_concurrent_callers(tmp_path, monkeypatch):
    import json
    import threading

    from omni.models import smollm2

    calls = []

    def fake_convert(folder):
        calls.append(folder)
        folder.mkdir(parents=True)
        (folder / smollm2.MARKER).write_text(json.dumps({"format_version": smollm2.FORMAT_VERSION}))

    monkeypatch.setattr(smollm2, "_convert", fake_convert)
    dest = tmp_path / "m"
    start = threading.Barrier(3)
    results = []

    def worker():
        start.wait(timeout=10)
        results.append(smollm2.prepare(dest))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [dest] * 3
    assert calls == [dest]
    assert smollm2.is_prepared(dest)
    (dest / smollm2.MARKER).write_text("{not json")      # a damaged marker means "prepare again"
    assert not smollm2.is_prepared(dest)


def test_a_step_marks_progress_from_each_decoder_layer(engine):
    """A CPU prefill of max_model_len can outlast pipeline.loop_stall_s: the step says it moves from inside
    (each of the 2 layers), not only when it returns."""
    marks = []
    engine.progress_hook = lambda: marks.append(1)
    try:
        engine.add_request(req("mark", [5, 6, 7], max_tokens=1, temperature=0.0))
        while not any(o.finished for o in engine.step()):
            pass
        assert len(marks) >= 2
    finally:
        engine.progress_hook = None
