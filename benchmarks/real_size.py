"""Real-size Qwen3-Omni talker / code2wav and Qwen2.5-Omni-7B talker with random weights, built in
memory on a device (no download, nothing on disk), handed to omni's engines as `parts`.

Sizes are the released checkpoints' config.json values (Qwen3-Omni-30B-A3B-Instruct: talker 20
MoE layers of 128 experts, top 6, shared expert 768; code predictor 5 dense layers; thinker hidden
2048, vocab 152064. Qwen2.5-Omni-7B: talker hidden 896, 24 layers, 12 heads / 4 KV heads of 128,
MLP 18944, codec vocab 8448; thinker hidden 3584, vocab 152064). The talker comes to 3.3 B
parameters and code2wav to 216 M, as ../shared/GPU.md measured. Random weights measure speed and
memory, never quality.
"""

from __future__ import annotations

import torch

QWEN3_TALKER = dict(
    text_config=dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=20, num_attention_heads=16,
                     num_key_value_heads=2, head_dim=128, moe_intermediate_size=384, num_experts=128,
                     num_experts_per_tok=6, norm_topk_prob=True, shared_expert_intermediate_size=768,
                     vocab_size=3072, max_position_embeddings=65536, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                                      "interleaved": True}),
    code_predictor_config=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                               num_key_value_heads=8, head_dim=128, vocab_size=2048, num_code_groups=16,
                               max_position_embeddings=32768, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24, spatial_merge_size=2,
    codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
    codec_pad_id=2148, codec_bos_id=2149, speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
    audio_token_id=151675, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    audio_start_token_id=151669,
)
QWEN3_THINKER_TEXT = dict(vocab_size=152064, hidden_size=2048)
QWEN25_TALKER = dict(hidden_size=896, intermediate_size=18944, num_hidden_layers=24, num_attention_heads=12,
                     num_key_value_heads=4, head_dim=128, vocab_size=8448, embedding_size=3584,
                     rope_theta=1000000.0, rms_norm_eps=1e-6)
QWEN25_THINKER_TEXT = dict(vocab_size=152064, hidden_size=3584, eos_token_id=151645)   # <|im_end|>, as released


def qwen3_config():
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig(thinker_config={"text_config": dict(QWEN3_THINKER_TEXT), "audio_token_id": 151675,
                                              "image_token_id": 151655, "video_token_id": 151656},
                              talker_config=dict(QWEN3_TALKER))


def qwen25_config():
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig(thinker_config={"text_config": dict(QWEN25_THINKER_TEXT)},
                             talker_config=dict(QWEN25_TALKER))


def _random(cls, sub_config, device, dtype):
    """transformers' module with random weights on `device`; the talker's MoE experts and routers,
    which `_from_config` leaves empty, drawn N(0, 0.02) like the rest."""
    with torch.device(device):
        model = cls._from_config(sub_config, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02)
        if torch.device(device).type != "meta":
            bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
            if bad:
                raise RuntimeError(f"{cls.__name__}: parameters not finite after init: {bad[:5]}")
    return model.eval().requires_grad_(False)


def qwen3_talker_parts(device, dtype=torch.bfloat16):
    """(config, talker, thinker embedding table) for Qwen3TalkerEngine(parts=...)."""
    from transformers import Qwen3OmniMoeTalkerForConditionalGeneration

    config = qwen3_config()
    talker = _random(Qwen3OmniMoeTalkerForConditionalGeneration, config.talker_config, device, dtype)
    embed = torch.randn(QWEN3_THINKER_TEXT["vocab_size"], QWEN3_THINKER_TEXT["hidden_size"], device=device,
                        dtype=dtype) * 0.02
    return config, talker, embed


def qwen3_code2wav_parts(device, dtype=torch.bfloat16):
    """(config, code2wav) for Qwen3Code2WavEngine(parts=...)."""
    from transformers import Qwen3OmniMoeCode2Wav

    config = qwen3_config()
    model = _random(Qwen3OmniMoeCode2Wav, config.code2wav_config, device, dtype)
    for m in model.modules():       # std-0.02 convolutions give a silent vocoder; their own init does not
        if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            m.reset_parameters()
    return config, model


def qwen25_talker_parts(device, dtype=torch.bfloat16):
    """(config, talker, thinker embedding table, thinker final norm, speakers) for Qwen25TalkerEngine(parts=...)."""
    from transformers import Qwen2_5OmniTalkerForConditionalGeneration
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniRMSNorm

    config = qwen25_config()
    talker = _random(Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config, device, dtype)
    text = QWEN25_THINKER_TEXT
    embed = torch.randn(text["vocab_size"], text["hidden_size"], device=device, dtype=dtype) * 0.02
    norm = Qwen2_5OmniRMSNorm(text["hidden_size"]).to(device, dtype)
    bos = config.talker_config.tts_codec_start_token_id
    return config, talker, embed, norm, {"chelsie": bos, "ethan": bos}


def qwen_image_pipeline(device, layers: int = 60, dtype=torch.bfloat16):
    """diffusers' QwenImagePipeline at Qwen-Image's size (the DiT's and VAE's config defaults: 60 blocks of
    width 3072, 20 B parameters; `layers` fewer) with random weights built on `device`, a one-layer text
    encoder of the real width (3584) and the tiny folder's tokenizer."""
    import tempfile
    from pathlib import Path

    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    from omni.models import tiny_folder
    from omni.models.qwen_image import tiny

    tok_dir = Path(tempfile.mkdtemp(prefix="qwen-image-tok-"))
    tiny_folder.build_tokenizer(tok_dir, 0, specials=tiny.SPECIALS, chat_template="", extra_special_tokens={})
    tokenizer = Qwen2Tokenizer.from_pretrained(tok_dir)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIALS}
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)      # the weights are made in `dtype` on the device: no float32 copy
    try:
        with torch.device(device):
            transformer = QwenImageTransformer2DModel(num_layers=layers).eval()
            vae = AutoencoderKLQwenImage().eval()
            encoder = Qwen2_5_VLForConditionalGeneration(tiny.text_encoder_config(ids, 3584, 1)).eval()
    finally:
        torch.set_default_dtype(saved)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**tiny.SCHEDULER), vae=vae,
                             text_encoder=encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def prompt_ids(config, n_text: int, seed: int) -> list[int]:
    """A user turn of n_text random ids, then the assistant header, in the model's own ids."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1000, 20000, (n_text,), generator=g).tolist()
    im_start = getattr(config, "im_start_token_id", None) or 151644     # Qwen2.5-Omni's config names none
    user = getattr(config, "user_token_id", None) or config.thinker_config.user_token_id
    assistant = getattr(config, "assistant_token_id", None) or 77091
    im_end = getattr(config, "im_end_token_id", None) or im_start + 1
    return [im_start, user, 198] + text + [im_end, 198, im_start, assistant, 198]
