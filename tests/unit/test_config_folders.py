"""A model folder picks its pipeline by config.json; platform sections; bundled names for --deploy-config."""

import json

import pytest

from omni import config as cfg
from omni.errors import ConfigError


def folder(tmp_path, model_type):
    d = tmp_path / "any-name-at-all"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["X"]}))
    return str(d)


def test_qwen3_omni_folder_uses_the_qwen3_pipeline_whatever_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    c = cfg.load(folder(tmp_path, "qwen3_omni_moe"))
    assert [(s.name, s.engine, s.devices) for s in c.stages] == [
        ("thinker", "vllm", "0"), ("talker", "qwen3_talker", "1"), ("code2wav", "qwen3_code2wav", "1")]
    assert c.model.endswith("any-name-at-all")         # the folder is every stage's weights
    assert all(s.model is None for s in c.stages)
    assert c.stages[0].engine_args["gpu_memory_utilization"] == 0.9
    assert c.stages[1].default_sampling_params.set() == {
        "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05, "max_tokens": 4096}
    assert "enforce_eager" not in c.stages[0].engine_args   # the cpu section is not applied on cuda
    assert c.final_stage("audio").stage_id == 2 and c.final_stage("text").stage_id == 0


def test_platform_section_merges_over_the_stages(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    c = cfg.load(folder(tmp_path, "qwen3_omni_moe"))
    assert c.stages[0].engine_args["enforce_eager"] is True
    assert c.stages[0].engine_args["max_num_seqs"] == 8                 # cpu value wins
    assert c.stages[0].engine_args["max_num_batched_tokens"] == 32768   # untouched keys stay
    assert c.stages[1].engine_args == {"gpu_memory_utilization": 0.6, "max_num_seqs": 64, "num_threads": 1}


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_a_users_values_win_over_a_bundled_bases_platform_section(tmp_path, monkeypatch, platform):
    """On CPU the bundled base's `platforms.cpu` was applied after the user's file: vllm-omni's qwen3_omni_moe.yaml
    with max_num_seqs 16 / max_model_len 8192 resolved to 8 / 4096, a dtype: bfloat16 overlay to float32, unsaid."""
    monkeypatch.setenv("OMNI_PLATFORM", platform)
    overlay = tmp_path / "overlay.yaml"       # vllm-omni's deploy schema: no model, no engine
    overlay.write_text("stages:\n  - {stage_id: 0, max_num_seqs: 16, max_model_len: 8192}\n")
    c = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", str(overlay))
    assert (c.stages[0].engine_args["max_num_seqs"], c.stages[0].engine_args["max_model_len"]) == (16, 8192)
    assert c.stages[0].engine_args.get("dtype") == ("float32" if platform == "cpu" else None)   # keys it left
    child = tmp_path / "child.yaml"
    child.write_text("base_config: smollm2-135m-instruct-vllm.yaml\nstages:\n"
                     "  - {stage_id: 0, engine_args: {dtype: bfloat16, max_num_seqs: 4}}\n"
                     "platforms: {cpu: {stages: [{stage_id: 0, engine_args: {max_num_seqs: 2}}]}}\n")
    args = cfg.load("smollm2-vllm", str(child)).stages[0].engine_args
    assert args["dtype"] == "bfloat16"
    assert args["max_num_seqs"] == (2 if platform == "cpu" else 4)   # the file's own section still wins over it


def test_a_bundled_variant_keeps_its_bases_platform_section(monkeypatch):
    """qwen3-omni-moe-1gpu's GPU sizes are not a user's choice: on CPU the base's CPU sizing still applies."""
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    args = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", "qwen3-omni-moe-1gpu").stages[0].engine_args
    assert (args["max_num_seqs"], args["max_model_len"], args["dtype"]) == (8, 4096, "float32")


def test_hub_id_and_thinker_only_variant():
    c = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct")
    assert len(c.stages) == 3 and c.model == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    t = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", deploy_config="qwen3-omni-moe-thinker-only")
    assert [s.name for s in t.stages] == ["thinker"] and t.modalities() == ["text"]
    assert t.model == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    assert len(cfg.load("Qwen/Qwen3-Omni-30B-A3B-Thinking").stages) == 1


def test_unknown_architecture_folder_keeps_one_lm_stage(tmp_path):
    c = cfg.load(folder(tmp_path, "llama"))
    assert [s.engine for s in c.stages] == ["torch_lm"]


def test_folder_without_config_json_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: not found") as e:
        cfg.load(str(tmp_path))
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not readable as JSON"):
        cfg.load(str(tmp_path))


def test_unknown_bundled_name_lists_the_known_ones():
    with pytest.raises(ConfigError, match="qwen3-omni-moe-thinker-only"):
        cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", deploy_config="no-such-pipeline")


@pytest.mark.parametrize("name, ours", [
    ("vllm_omni/deploy/qwen3_omni_moe.yaml", "qwen3-omni-moe"),       # as vllm-omni's docs write it
    ("qwen3_omni_moe_thinker_only.yaml", "qwen3-omni-moe-thinker-only"),
    ("qwen3_omni_moe_thinker_only", "qwen3-omni-moe-thinker-only"),
])
def test_vllm_omnis_bundled_deploy_paths_are_omnis_bundled_deploys(tmp_path, monkeypatch, capsys, name, ours):
    """They failed: "file not found: /work/main/qwen3_omni_moe.yaml", while base_config: qwen3_omni_moe.yaml
    mapped to omni's file."""
    monkeypatch.chdir(tmp_path)
    assert cfg.deploy_config_path(name) == cfg.DEPLOY_DIR / f"{ours}.yaml"
    assert f"{name} is vllm-omni's bundled deploy; omni's {ours} stands for it" in capsys.readouterr().err
    (tmp_path / "qwen3_omni_moe.yaml").write_text("stages: []\n")    # a file of that name is the user's
    assert str(cfg.deploy_config_path("qwen3_omni_moe.yaml")) == "qwen3_omni_moe.yaml"


def test_a_vllm_omni_deploy_omni_has_no_variant_of_is_refused_listing_what_it_has(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        cfg.deploy_config_path("vllm_omni/deploy/qwen3_omni_moe_multi_replicas.yaml")
    assert "no variant like vllm-omni's qwen3_omni_moe_multi_replicas.yaml" in str(e.value)
    assert "qwen3_omni_moe.yaml" in str(e.value) and "qwen3-omni-moe-1gpu" in str(e.value)
    with pytest.raises(ConfigError, match="file not found"):      # any other missing file: as before
        cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", "configs/mine.yaml")


def test_bad_platforms_section_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    p = tmp_path / "d.yaml"
    p.write_text("model: x\nstages:\n  - {stage_id: 0, engine: torch_lm, final_output: true, "
                 "final_output_type: text}\nplatforms: {cpu: 3}\n")
    with pytest.raises(ConfigError, match=r"platforms\.cpu"):
        cfg.load("x", deploy_config=str(p))


def test_stage_devices_become_cuda_visible_devices(monkeypatch):
    from omni.errors import OmniError
    from omni.stage.main import select_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    select_devices("cpu")
    import os
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    select_devices("1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    select_devices("0,2")                      # indices into the outer selection
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    with pytest.raises(OmniError, match="devices '7'"):
        select_devices("7")


def test_qwen25_omni_folder_and_hub_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    c = cfg.load(folder(tmp_path, "qwen2_5_omni"))
    assert [(s.name, s.engine, s.devices) for s in c.stages] == [
        ("thinker", "vllm", "0"), ("talker", "qwen25_talker", "1"), ("token2wav", "qwen25_token2wav", "1")]
    assert c.model.endswith("any-name-at-all") and all(s.model is None for s in c.stages)
    assert c.stages[0].engine_args["max_num_seqs"] == 1 and c.stages[0].engine_args["gpu_memory_utilization"] == 0.8
    assert c.stages[1].default_sampling_params.set() == {
        "temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_tokens": 2048, "repetition_penalty": 1.05}
    assert c.final_stage("audio").stage_id == 2 and c.final_stage("text").stage_id == 0
    seven = cfg.load("Qwen/Qwen2.5-Omni-7B")
    three = cfg.load("Qwen/Qwen2.5-Omni-3B")
    assert seven.model == "Qwen/Qwen2.5-Omni-7B" and three.model == "Qwen/Qwen2.5-Omni-3B"
    assert [s.engine for s in three.stages] == [s.engine for s in seven.stages]   # base_config: the 7B's
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    cpu = cfg.load("Qwen/Qwen2.5-Omni-3B")
    assert cpu.stages[1].engine_args == {"threads": 1} and cpu.stages[0].engine_args["max_num_seqs"] == 8


def test_qwen3_torch_stages_keep_their_deploy_keys(tmp_path, monkeypatch):
    """num_threads / gpu_memory_utilization / max_num_seqs reach the talker and code2wav (torch_stage_args
    turns them into constructor arguments); nothing of the bundled YAML is dropped."""
    from omni.engines.factory import engine_args_for

    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    c = cfg.load(folder(tmp_path, "qwen3_omni_moe"))
    for s in c.stages[1:]:
        assert engine_args_for(s) == dict(s.engine_args)
        assert {"num_threads", "gpu_memory_utilization", "max_num_seqs"} <= set(s.engine_args)


def test_one_gpu_variant_fits_one_80gb_card(monkeypatch):
    """`--deploy-config qwen3-omni-moe-1gpu`: the same pipeline, every stage on GPU 0, shares summing to <= 1,
    the thinker's share holding its 59 GiB of bf16 weights and the talker + code2wav's their measured 9.1 GiB."""
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    two = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct")
    one = cfg.load("Qwen/Qwen3-Omni-30B-A3B-Instruct", deploy_config="qwen3-omni-moe-1gpu")
    assert [(s.name, s.engine, s.devices) for s in one.stages] == [
        ("thinker", "vllm", "0"), ("talker", "qwen3_talker", "0"), ("code2wav", "qwen3_code2wav", "0")]
    assert [s.processor for s in one.stages] == [s.processor for s in two.stages]
    assert one.stages[0].engine_args["mm_hidden_layer"] == "talker"        # the base's keys stay
    shares = [s.engine_args["gpu_memory_utilization"] for s in one.stages]
    usable_gib = 79.0                                                       # an 80 GB card, as torch sees it
    assert sum(shares) <= 1 and shares[0] * usable_gib > 59 + 4
    assert (shares[1] + shares[2]) * usable_gib > 9.1
    assert one.model == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    # The bundled default for the hub id stays the two-GPU one (the variant names no model of its own).
    assert cfg.default_config_path("Qwen/Qwen3-Omni-30B-A3B-Instruct").name == "qwen3-omni-moe.yaml"


def diffusers_folder(tmp_path, class_name):
    d = tmp_path / "some-diffusers-folder"
    d.mkdir(parents=True)
    (d / "model_index.json").write_text(json.dumps({"_class_name": class_name, "transformer": ["diffusers", "X"]}))
    return str(d)


def test_a_diffusers_folder_picks_its_pipeline_by_model_index(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    c = cfg.load(diffusers_folder(tmp_path, "QwenImagePipeline"))
    assert [(s.engine, s.inputs, s.final_output_type) for s in c.stages] == [("qwen_image", ("text",), "image")]
    assert c.stages[0].engine_args["dtype"] == "float32" and c.stages[0].devices == "cpu"
    assert c.pipeline.images.default_size == "256x256" and c.pipeline.images.size_multiple == 16
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    assert cfg.load(diffusers_folder(tmp_path / "g", "QwenImagePipeline")).stages[0].engine_args["dtype"] == "bfloat16"


def test_a_wan_folder_gets_the_wan_video_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "cpu")
    c = cfg.load(diffusers_folder(tmp_path, "WanPipeline"))
    assert [(s.engine, s.inputs, s.final_output_type) for s in c.stages] == [("wan", ("text",), "video")]
    assert c.stages[0].engine_args["dtype"] == "float32" and c.stages[0].engine_args["max_frames"] == 17
    assert c.pipeline.videos.default_size == "64x64" and c.pipeline.videos.max_frames == 17
    assert cfg.default_config_path("Wan-AI/Wan2.1-T2V-1.3B-Diffusers").name == "wan2.1-t2v.yaml"


@pytest.mark.parametrize("videos, says", [
    ({"default_frames": 10}, "1 more than a multiple of frame_multiple 4"),
    ({"default_frames": 85}, "at most max_frames 81"),
    ({"frame_multiple": 0}, "frame_multiple must be >= 1"),
    ({"max_side": 512}, r"and max_side a side"),       # default_size 832x480
    ({"max_side": 0}, "max_side must be >= 1"),
])
def test_video_settings_are_checked_once(tmp_path, monkeypatch, videos, says):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")
    path = tmp_path / "d.yaml"
    path.write_text(json.dumps({"base_config": "wan2.1-t2v.yaml", "pipeline": {"videos": videos}}))
    with pytest.raises(ConfigError, match=says):
        cfg.load("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", deploy_config=str(path))


def test_a_diffusers_folder_of_another_pipeline_is_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="diffusers pipeline 'FluxPipeline' is not one omni serves "
                                          r"\(QwenImagePipeline, WanPipeline\)"):
        cfg.load(diffusers_folder(tmp_path, "FluxPipeline"))


@pytest.mark.parametrize("images, says", [
    ({"default_size": "100x100"}, "multiples of size_multiple 16"),
    ({"default_size": "2048x2048"}, "at most max_pixels"),
    ({"default_steps": 200}, "over max_steps"),
    ({"max_n": 0}, "max_n must be >= 1"),
])
def test_image_settings_are_checked_once(tmp_path, monkeypatch, images, says):
    monkeypatch.setenv("OMNI_PLATFORM", "cuda")    # the cpu section would set its own default_size
    path = tmp_path / "d.yaml"
    path.write_text(json.dumps({"base_config": "qwen-image.yaml", "pipeline": {"images": images}}))
    with pytest.raises(ConfigError, match=says):
        cfg.load("Qwen/Qwen-Image", deploy_config=str(path))


def test_a_bare_vllm_omni_variant_name_omni_has_none_of_is_refused_listing_what_it_has(tmp_path, monkeypatch):
    """vllm-omni's qwen3_omni_moe_multi_replicas.yaml given bare (no vllm_omni/ folder) said 'file not found'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"no such file, and omni has no variant like vllm-omni's "
                                          r"qwen3_omni_moe_multi_replicas\.yaml"):
        cfg.deploy_config_path("qwen3_omni_moe_multi_replicas.yaml")
