"""The Qwen3-Omni talker's static decode step on the tiny model (float32): its pieces against
transformers' modules, its codes against the eager path's and transformers' generate(), and at
most one host read of device values per step (the step's codes)."""

from __future__ import annotations

import gc

import pytest
import torch

from omni.engines.base import EngineError, EngineRequest, SamplingParams
from tests.unit.host_reads import HostReads
from tests.unit.qwen3_ref import drive, talker_pieces
from tests.unit.test_qwen3_talker import folder, ref  # noqa: F401 (the tiny model and its reference, shared)

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

TOKENS = 24


@pytest.fixture(scope="module")
def static(folder):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    return Qwen3TalkerEngine(folder)


@pytest.fixture(scope="module")
def eager(folder):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    return Qwen3TalkerEngine(folder, static_decode=False)


@pytest.fixture(scope="module")
def runs(ref):
    return [ref.run("What is the capital of France?", "Ethan", talker_tokens=TOKENS),
            ref.run("Hello, tell me a story about the sea.", "Chelsie", thinker_tokens=6, talker_tokens=TOKENS),
            ref.run("Describe this sound.", "Aiden", audio=True, talker_tokens=TOKENS)]


def _codes(outs) -> torch.Tensor:
    return torch.cat([o.tensors["codes"] for o in outs], dim=1)


# -- the pieces against transformers' modules ------------------------------------


def test_stack_prefill_equals_transformers(static, runs):
    """The static forward's prefill = transformers' talker model on the same rows (float32)."""
    from omni.models.qwen3_omni import edges

    e, r = static, runs[2]      # the audio prompt: hidden_projection rows too
    with torch.no_grad():
        x = edges.prefill_embeds(e.talker, e.embed, e.ids, r.prompt, r.generated[0], 2303, r.mm_hidden, e._tts)
        want = e.talker.model(inputs_embeds=x[None]).last_hidden_state[0]
        got = e._static.dev.backbone.prefill(x, e._static.dev.slots - 1)
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_equals_transformers(static, gpu, dtype):
    """The static step's RMSNorm = transformers' (the stack's final norm, and q_norm per head): bit for
    bit on the CPU; on CUDA through torch's fused kernel, the same roundings in another order (bit for
    bit on the emulator, whose kernel is the CPU's; within a few units in the last place on a GPU)."""
    import copy

    from omni.models.qwen3_omni.layers import Norm
    from tests.unit.fake_cuda import real_cuda

    model = static.talker.model
    x = torch.randn(5, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    heads = x.view(5, -1, model.layers[0].self_attn.head_dim)
    close = {torch.float32: 1e-6, torch.bfloat16: 2 ** -6}[dtype] if real_cuda() else 0.0
    for module, rows in ((model.norm, x), (model.layers[0].self_attn.q_norm, heads)):
        module = copy.deepcopy(module).to(dtype)
        with torch.no_grad():
            want = module(rows)
            assert torch.equal(Norm(module.weight, module.variance_epsilon)(rows), want)
            on = copy.deepcopy(module).to(gpu)
            got = Norm(on.weight, on.variance_epsilon)(rows.to(gpu)).cpu()
        assert torch.allclose(got.float(), want.float(), rtol=close, atol=0), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("impl", ["grouped", "dense", "gather"])
def test_moe_equals_transformers(static, impl):
    """Every MoE formulation = transformers' experts loop: exactly for one row, and for several
    rows with grouped (each expert multiplies the rows transformers gives it); the others round
    their per-expert products differently (~1e-9)."""
    from omni.models.qwen3_omni.moe import Moe

    block = static.talker.model.layers[0].mlp
    moe = Moe.from_block(block, impl)
    x = torch.randn(7, block.gate.hidden_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (x[:1], x):
            want, got = block(rows[None])[0], moe(rows)
            if impl == "grouped" or rows.shape[0] == 1:
                assert torch.equal(got, want), (impl, rows.shape[0])
            else:
                assert torch.allclose(got, want, rtol=0, atol=1e-8)


def test_moe_default_is_probed_on_the_gpu(static, monkeypatch, caplog):
    """On CUDA (emulated here) the grouped MoE is checked once beside dense/gather at start-up: kept
    when it agrees, and a kernel that raises leaves the talker on the fallback, logged."""
    import copy

    from omni.models.qwen3_omni.moe import probed_impl
    from tests.unit.fake_cuda import FakeCuda

    assert probed_impl(static.talker.model.layers[0].mlp, torch.device("cpu"), torch.float32) == "grouped"
    with FakeCuda(), torch.no_grad():
        block = copy.deepcopy(static.talker.model.layers[0].mlp).to("cuda", torch.bfloat16)
        cuda = torch.device("cuda")
        assert probed_impl(block, cuda, torch.bfloat16) == "grouped"
        assert probed_impl(block, cuda, torch.float32) == "dense"          # the GPU kernel is bf16 only

        def refuse(*args, **kwargs):
            raise RuntimeError("grouped gemm: offsets must be aligned")

        grouped_mm = torch._grouped_mm

        def reads_offsets(*args, offs=None, **kwargs):   # the slow fallback some GPUs get: offsets to the host
            offs.cpu()
            return grouped_mm(*args, offs=offs, **kwargs)

        monkeypatch.setattr(torch, "_grouped_mm", reads_offsets)
        assert probed_impl(block, cuda, torch.bfloat16) == "dense"
        assert "called a synchronizing CUDA operation" in caplog.text
        assert torch.cuda.get_sync_debug_mode() == 0          # the probe left the mode as it found it
        monkeypatch.setattr(torch, "_grouped_mm", refuse)
        assert probed_impl(block, cuda, torch.bfloat16) == "dense"
    assert "torch._grouped_mm failed on this device (grouped gemm: offsets must be aligned); using dense" in caplog.text


def test_residual_codes_equal_eager(static):
    """The code predictor over the static cache = the eager one over transformers' modules."""
    from omni.models.qwen3_omni.codes import residual_codes

    dev = static._static.dev
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, dev.codec_head.shape[1], generator=g)
    code0 = torch.tensor([5, 700, 2149])
    greedy = torch.tensor([True, False, False])
    u = torch.rand(3, dev.groups, generator=g)
    with torch.no_grad():
        want, want_sum = residual_codes(static.talker, h, code0, greedy, u)
        got, got_sum = dev.residual(h, code0, u, greedy)
    assert torch.equal(got, want)
    assert torch.allclose(got_sum, want_sum, rtol=0, atol=1e-6)


def test_sampling_is_transformers_distribution():
    """sample(): for a grid of uniforms the codes' frequencies are transformers' warped probabilities
    (repetition penalty, temperature, top-k, top-p), row by row, with different options per row."""
    from transformers.generation.logits_process import (
        LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper)

    from omni.models.qwen3_omni.sampling import penalize, sample

    v, n = 300, 20000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(v, generator=g) * 3
    history = torch.tensor([[3, 17, 17, 250]])
    options = [(1.3, 0.7, 40, 0.8), (1.0, 1.0, 0, 1.0), (1.05, 0.9, 50, 1.0), (2.0, 1.5, 0, 0.5)]
    u = (torch.arange(n) + 0.5) / n
    rows, temps, ks, ps, pens = [], [], [], [], []
    for penalty, t, k, p in options:
        procs = [RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(t)]
        procs += [TopKLogitsWarper(k)] if k else []
        procs += [TopPLogitsWarper(p)] if p < 1 else []
        rows.append(torch.softmax(LogitsProcessorList(procs)(history, logits[None].clone())[0], -1))
        temps.append(t)
        ks.append(k)
        ps.append(p)
        pens.append(penalty)
    seen = torch.zeros(v, dtype=torch.bool)
    seen[history[0]] = True
    b = len(options)
    big = penalize(logits.expand(b, v), seen.expand(b, v), torch.tensor(pens)).repeat_interleave(n, 0)
    def per_row(values, dtype=None):
        return torch.tensor(values, dtype=dtype).repeat_interleave(n)
    codes = sample(big, u.repeat(b), per_row(temps), per_row(ks, torch.long), per_row(ps)).view(b, n)
    for want, got in zip(rows, codes):
        freq = torch.bincount(got, minlength=v).double() / n
        assert ((freq > 0) <= (want > 0)).all()                        # never outside the support
        assert (freq - want.double()).abs().max() < 2 / n + 1e-6        # a grid of n uniforms: within 1/n a bin
    one = sample(logits[None], u[:1], 0.9, 50, 1.0, torch.tensor([True]))
    assert int(one) == int(logits.argmax())                              # greedy rows take the argmax


# -- the engine -----------------------------------------------------------------


def test_static_equals_eager_and_reference_under_churn(static, eager, runs):
    """Three requests, one per piece with gaps, one late, one audio, plus two seeded sampled ones:
    the static codes equal the eager path's (and the greedy ones transformers')."""
    france, sea, sound = runs

    def feeds():
        gappy = [x for p in talker_pieces(sea, "b", "chelsie", True, TOKENS) for x in (p, None)]
        return {"a": talker_pieces(france, "a", "ethan", True, TOKENS),
                "b": gappy,
                "c": [None] * 5 + talker_pieces(sound, "c", "aiden", False, TOKENS),
                "s1": talker_pieces(france, "s1", "ethan", True, 16, temperature=0.9, top_k=50, seed=7),
                "s2": [None] * 2 + talker_pieces(sea, "s2", "chelsie", False, 16, temperature=0.7, top_p=0.9, seed=8)}

    got, want = drive(static, feeds()), drive(eager, feeds())
    for rid in got:
        assert torch.equal(_codes(got[rid]), _codes(want[rid])), rid
        assert got[rid][-1].finish_reason == want[rid][-1].finish_reason
    for rid, r in zip("abc", runs):
        assert torch.equal(_codes(got[rid]), r.codes)
    alone = drive(static, {"s1": talker_pieces(france, "s1", "ethan", False, 16, temperature=0.9, top_k=50,
                                                seed=7)})
    assert torch.equal(_codes(alone["s1"]), _codes(got["s1"]))          # the seed, not the batch, decides
    assert not static.has_open_streams() and static.stats()["batched_decodes"] > 0


def test_abort_in_the_middle_of_a_batch(static, runs):
    """Aborting the request in slot 1 of 3 moves slot 2's request there; the others stay exact."""
    france, sea, _ = runs
    for rid, run in (("x", france), ("y", france), ("z", sea)):
        static.add_request(talker_pieces(run, rid, "ethan" if run is france else "chelsie", False, TOKENS)[0])
    outs = {rid: [] for rid in "xyz"}
    for _ in range(3):
        for o in static.step():
            outs[o.request_id].append(o)
    assert [r.slot for r in static._static.owner] == [0, 1, 2]
    static.abort("y")
    assert static._reqs["z"].slot == 1
    while static.has_unfinished():
        for o in static.step():
            outs[o.request_id].append(o)
    assert torch.equal(_codes(outs["x"]), france.codes)
    assert torch.equal(_codes(outs["z"]), sea.codes)
    assert not static.has_open_streams() and static._static.owner == []


def test_more_requests_than_slots(folder, runs):
    """max_num_seqs 2, four requests: two wait for a slot (not counted runnable meanwhile), all exact."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    engine = Qwen3TalkerEngine(folder, max_num_seqs=2)
    france, sea, _ = runs
    feeds = {f"{rid}{i}": talker_pieces(run, f"{rid}{i}", voice, False, 10)
             for i in range(2) for rid, run, voice in (("f", france, "ethan"), ("s", sea, "chelsie"))}
    outs = drive(engine, feeds)
    for rid, o in outs.items():
        assert torch.equal(_codes(o), (france if rid[0] == "f" else sea).codes[:, :9]), rid


def test_at_most_one_host_read_per_step(static, eager, runs):
    """Each static step reads device values back once (its codes); the eager path reads many
    times a frame, which shows the counter sees them."""
    france, sea, _ = runs

    def reads_per_step(engine, sampled):
        opts = dict(temperature=0.9, top_k=50, seed=3) if sampled else {}
        for rid, run, voice in (("h1", france, "ethan"), ("h2", sea, "chelsie")):
            for piece in talker_pieces(run, rid, voice, False, 8, **opts):
                engine.add_request(piece)
        counts = []
        while engine.has_unfinished():
            with HostReads() as reads:
                outs = engine.step()
            counts.append((len(reads), reads.seen[:3], len(outs)))
        return counts

    for sampled in (False, True):
        counts = reads_per_step(static, sampled)
        assert len(counts) >= 7 and max(n for n, _, _ in counts) <= 1, counts
        old = reads_per_step(eager, sampled)
        assert min(n for n, _, _ in old) >= 2, old


def test_cache_length_ends_a_request(folder, runs):
    """max_model_len bounds prefill + frames: a reply that fills it ends 'length' (its codes exact), a
    prompt that fills it is refused with the reason."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    france = runs[0]
    engine = Qwen3TalkerEngine(folder, max_model_len=40, max_num_seqs=1)
    out = drive(engine, {"l": talker_pieces(france, "l", "ethan", False, TOKENS)})["l"]
    prefill = int(engine.stats()["prefill_tokens"])
    frames = 40 - prefill + 1            # one frame from the prefill, then one per cache row after it
    assert frames < TOKENS - 1           # (so the cache, not max_tokens, ends it)
    assert out[-1].finish_reason == "length" and torch.equal(_codes(out), france.codes[:, :frames])
    small = Qwen3TalkerEngine(folder, max_model_len=prefill, max_num_seqs=1)
    out = drive(small, {"l": talker_pieces(france, "l", "ethan", False, TOKENS)})["l"]
    assert out[-1].finish_reason == "error" and "max_model_len" in out[-1].error


def test_bad_engine_args(folder):
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    with pytest.raises(ValueError, match="moe_impl must be one of dense, grouped, gather"):
        Qwen3TalkerEngine(folder, moe_impl="fast")
    with pytest.raises(ValueError, match="batch_decode: false needs static_decode: false"):
        Qwen3TalkerEngine(folder, batch_decode=False)
    with pytest.raises(ValueError, match="max_model_len must be >= 2"):
        Qwen3TalkerEngine(folder, max_model_len=1)
    engine = Qwen3TalkerEngine(folder, enforce_eager=True, max_num_seqs=4)      # accepted; no graphs on CPU
    assert engine._static.graphs is None and engine._static.dev.slots == 4
    with pytest.raises(EngineError, match="unknown speaker"):
        engine.add_request(EngineRequest(request_id="q", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                                         voice="bob"))


def test_cuda_graphs_equal_eager_on_the_device(folder, runs, gpu):
    """On a GPU (real or emulated): the graphed static step (decode frames and first frames replayed) = the
    eager static step = the eager path (float32, same device), and a decode step makes no synchronising
    call beyond its one copy."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    graphed = Qwen3TalkerEngine(folder, device="cuda", dtype="float32", max_num_seqs=4)
    plain = Qwen3TalkerEngine(folder, device="cuda", dtype="float32", max_num_seqs=4, enforce_eager=True)
    old = Qwen3TalkerEngine(folder, device="cuda", dtype="float32", static_decode=False)
    assert graphed._static.graphs is not None and graphed._static.graphs.seconds > 0
    france, sea, sound = runs

    def feeds():
        return {"a": talker_pieces(france, "a", "ethan", True, TOKENS),
                "b": talker_pieces(sea, "b", "chelsie", False, TOKENS),
                "c": [None] * 3 + talker_pieces(sound, "c", "aiden", False, TOKENS),
                "s": talker_pieces(france, "s", "ethan", True, 12, temperature=0.9, top_k=50, seed=5)}

    a, b, c = drive(graphed, feeds()), drive(plain, feeds()), drive(old, feeds())
    for rid in a:
        assert torch.equal(_codes(a[rid]), _codes(b[rid])), rid
        assert torch.equal(_codes(b[rid]), _codes(c[rid])), rid
    assert graphed.stats()["graph_replays"] > 0 and graphed.stats()["first_frame_replays"] >= 2    # c joins late
    assert "graph_replays" not in plain.stats() and "first_frame_replays" not in plain.stats()
    for piece in talker_pieces(france, "y", "ethan", False, TOKENS):
        graphed.add_request(piece)
    graphed.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed._static.dev.load_inputs([[0], [1]])      # what a step queues before its one copy
        graphed._static.graphs.run(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _sleep_cycle_keeps_codes(engine, runs) -> None:
    france, _, _ = runs
    before = drive(engine, {"a": talker_pieces(france, "a", "ethan", True, TOKENS)})["a"]
    old = engine._static
    engine.offload._off()          # what sleep does once it is allowed (a GPU); CPU refuses sleep itself
    assert engine._static is None
    engine.offload._on()
    assert engine._static is not None and engine._static is not old      # built again: fresh addresses
    after = drive(engine, {"b": talker_pieces(france, "b", "ethan", True, TOKENS)})["b"]
    assert torch.equal(_codes(before), _codes(after))
    assert torch.equal(_codes(after), france.codes)


def test_sleep_cycle_rebuilds_the_static_state(folder, runs):
    """Sleep drops the static state (slot cache, stacked weights, graphs), wake-up builds it again,
    and the codes stay transformers'."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    _sleep_cycle_keeps_codes(Qwen3TalkerEngine(folder, max_num_seqs=2), runs)


def test_sleep_frees_the_device_and_graphs_replay_after_wake(folder, runs, gpu):
    """On a GPU (real or emulated): sleep gives the talker's memory back and the graphs captured again after wake-up
    give the same codes."""
    from omni.models.qwen3_omni.talker import Qwen3TalkerEngine

    engine = Qwen3TalkerEngine(folder, device="cuda", dtype="float32", max_num_seqs=4)
    france, _, _ = runs
    before = _codes(drive(engine, {"a": talker_pieces(france, "a", "ethan", True, TOKENS)})["a"])
    weights = sum(p.nbytes for p in engine.talker.parameters())
    gc.collect()            # earlier tests' engines (reference cycles) would otherwise still hold memory
    held = torch.cuda.memory_allocated()
    engine.sleep()
    # the process's figure, so measure what sleep gave back: at least the talker's weights
    assert engine.is_sleeping() and held - torch.cuda.memory_allocated() >= weights
    with pytest.raises(EngineError, match="asleep"):
        engine.add_request(talker_pieces(france, "x", "ethan", True, TOKENS)[0])
    engine.wake_up()
    after = _codes(drive(engine, {"b": talker_pieces(france, "b", "ethan", True, TOKENS)})["b"])
    assert torch.equal(before, after) and engine.stats()["graph_replays"] > 0
