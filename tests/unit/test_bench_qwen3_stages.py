"""The pure parts of benchmarks/qwen3_stages.py and benchmarks/real_size.py: a row's figures, the paths
per device, and the released sizes (built on the meta device: no memory, no weights); and
benchmarks/talker_frame.py run on the tiny model."""

from __future__ import annotations

import pytest

from tests.unit.test_qwen3_talker import folder  # noqa: F401 (the tiny model, shared)

pytest.importorskip("transformers")


def test_talker_row_figures():
    from benchmarks.qwen3_stages import talker_row

    runs = [{"steps": [0.010, 0.020, 0.030], "first": [0.1, 0.3]}, {"steps": [0.040] * 3, "first": [0.5]}]
    row = talker_row("qwen3", "static", 4, runs, None)
    assert row["talker_ms_per_step"] == 30.0                    # median of the rounds' medians (20, 40)
    assert row["talker_ms_per_frame"] == 7.5 and row["frames_per_s_per_stream"] == 33.3
    assert row["x_real_time_per_stream"] == 2.67 and row["first_audio_ms"] == 350.0


def test_paths_per_device():
    from benchmarks.qwen3_stages import modes_for

    assert modes_for("qwen3", "cpu") == ["eager", "static"]
    assert modes_for("qwen3", "cuda") == ["eager", "static", "graphed"]


@pytest.mark.parametrize("modes", ["graphed", "static,eagr", ","])
def test_modes_refused_by_name(modes, monkeypatch, capsys):
    """--modes names paths this device has; anything else is an argument error naming them."""
    from benchmarks.qwen3_stages import main

    monkeypatch.setattr("sys.argv", ["qwen3_stages.py", "--modes", modes])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "--modes: the paths on cpu are eager,static" in capsys.readouterr().err


def test_released_sizes():
    from benchmarks import real_size as rs

    config, talker, embed = rs.qwen3_talker_parts("meta")
    assert round(rs.parameters(talker) / 1e9, 2) == 3.32           # GPU.md: the talker is 3.3 B
    assert talker.model.layers[0].mlp.gate.top_k == 6 and embed.shape == (152064, 2048)
    assert round(rs.parameters(rs.qwen3_code2wav_parts("meta")[1]) / 1e6) == 216
    prompt = rs.prompt_ids(config, 5, 0)
    assert prompt[-3:] == [config.im_start_token_id, config.assistant_token_id, 198] and len(prompt) == 13
    assert rs.prompt_ids(rs.qwen25_config(), 5, 0)[-3:] == [151644, 77091, 198]    # its config names no im_start


def test_frame_taken_apart(folder, gpu):
    """benchmarks/talker_frame.py on the tiny model: the frame launched op by op on the CPU; on the
    device also replayed from its graphs (one per bucket), and the kernels in it on a real GPU."""
    from benchmarks.qwen3_stages import Source
    from benchmarks.talker_frame import bench
    from tests.unit.fake_cuda import real_cuda

    cpu = bench(Source("qwen3", folder, "cpu", False), [1, 2], 2)
    assert [r["batch"] for r in cpu["rows"]] == [1, 2] and cpu["capture_seconds"] is None
    assert all(r["launched_ms"] > 0 and "replayed_ms" not in r for r in cpu["rows"])
    doc = bench(Source("qwen3", folder, gpu, False), [1, 3], 2)
    assert doc["graph_sizes"] == [1, 2, 3] and doc["capture_seconds"] > 0
    for r in doc["rows"]:
        assert r["launched_ms"] > 0 and r["replayed_ms"] > 0
        assert ("kernels" in r) == real_cuda()
        if real_cuda():
            assert r["kernels"] > 100 and 0 < r["busy_ms"] and r["top"]


@pytest.mark.parametrize("where", ["building", "warm-up"])
def test_a_failing_path_keeps_the_others(folder, monkeypatch, where):
    """On a GPU one path that breaks (a graph that will not capture) must not cost the others' figures:
    its error is reported by name and the other path's rows are all there."""
    from benchmarks import qwen3_stages as qs

    build = qs.Source.talker

    def talker(self, mode, slots):
        if mode == "static" and where == "building":
            raise RuntimeError("operation not permitted when stream is capturing")
        engine = build(self, mode, slots)
        if mode == "static":
            engine.step = lambda: (_ for _ in ()).throw(RuntimeError("illegal memory access"))
        return engine

    monkeypatch.setattr(qs.Source, "talker", talker)
    doc = qs.bench(qs.Source("qwen3", folder, "cpu", False), [1, 2], 6, 1)
    assert [(r["mode"], r["streams"]) for r in doc["rows"]] == [("eager", 1), ("eager", 2)]
    want = "operation not permitted" if where == "building" else "illegal memory access"
    assert doc["errors"]["static"].startswith(where) and want in doc["errors"]["static"]
    assert doc["codes_equal_across_paths"] is None and doc["talker_ms_per_frame"].keys() == {"eager"}


@pytest.mark.parametrize("where", ["building", "2 streams"])
def test_a_failing_code2wav_keeps_the_document(folder, monkeypatch, where):
    """code2wav was not run under attempt(): its failure lost the whole JSON document, talker rows too.
    It is now reported under errors["code2wav"], with the RTFs measured before it."""
    from benchmarks import qwen3_stages as qs

    if where == "building":
        monkeypatch.setattr(qs.Source, "code2wav", lambda self: (_ for _ in ()).throw(RuntimeError("out of memory")))
    else:
        run = qs.run_code2wav
        monkeypatch.setattr(qs, "run_code2wav", lambda engine, n, codes: run(engine, n, codes) if n == 1
                            else (_ for _ in ()).throw(RuntimeError("out of memory")))
    doc = qs.bench(qs.Source("qwen3", folder, "cpu", False), [1, 2], 6, 1, ["eager"])
    assert [(r["mode"], r["streams"]) for r in doc["rows"]] == [("eager", 1), ("eager", 2)]
    assert doc["errors"].keys() == {"code2wav"} and doc["errors"]["code2wav"].startswith(where)
    assert "out of memory" in doc["errors"]["code2wav"]
    assert [c["streams"] for c in doc["code2wav"]] == ([] if where == "building" else [1])


def test_kernels_sorted_by_kind():
    """talker_frame's kernel kinds, from the names CUDA kernels carry (count and summed ms per kind)."""
    from benchmarks.talker_frame import by_kind, kind

    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "matmul"
    assert kind("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "matmul"
    assert kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"     # a cutlass kernel, but attention
    assert kind("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "reduce"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "elementwise"
    assert kind("void at::native::index_elementwise_kernel<128, 4>") == "index"
    assert kind("void at::native::bitonicSortKVInPlace<float, long>") == "sort"
    assert kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kind("void something_new()") == "other"
    times = {"ampere_gemm": [0.01, 0.02], "vectorized_elementwise_kernel<mul>": [0.001] * 3, "x": [0.5]}
    assert by_kind(times) == {"elementwise": {"count": 3, "ms": 0.003}, "matmul": {"count": 2, "ms": 0.03},
                              "other": {"count": 1, "ms": 0.5}}
