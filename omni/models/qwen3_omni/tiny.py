"""A tiny Qwen3-Omni folder of the real architecture, built offline in seconds.

Random weights (seeded), the real module classes and the real codec / speaker ids, a
small byte-level BPE tokenizer trained here with the Qwen special tokens, and the
processor files vLLM needs for audio input. Same seed -> byte-identical files, so
tests build it instead of committing weights. `python -m omni.models.qwen3_omni.tiny DIR`.
"""

from __future__ import annotations

from pathlib import Path

from omni.models import tiny_folder
from omni.models.tiny_folder import ROLES, VOCAB

SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eos>", "<tts_text_bos_single>",
)
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('audio', 'input_audio', 'audio_url') %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

EXTRA_SPECIALS = {
    "audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
}


def build_config(ids: dict[str, int]):
    from transformers import Qwen3OmniMoeConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [6, 5, 5],
            "mrope_interleaved": True, "interleaved": True}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, moe_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096, rope_parameters=rope,
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=False)   # read by vLLM; the config class leaves it unset
    thinker = dict(
        text_config=text,
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                          d_model=64, output_dim=64, downsample_hidden_size=32, max_source_positions=1500),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[1], num_position_embeddings=64,
                           # read by vLLM, not declared by the config class
                           image_size=768, apply_vit_abs_pos_embed=True, spatial_patch_size=16, in_chans=3,
                           tokens_per_second=2),
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        user_token_id=ids["user"],
    )
    talker = dict(
        text_config=dict(vocab_size=3072, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64,
                         max_position_embeddings=4096, rope_parameters=rope),
        code_predictor_config=dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   num_code_groups=16, max_position_embeddings=4096),
        num_code_groups=16, thinker_hidden_size=64, accept_hidden_layer=1, spatial_merge_size=2,
        codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
        codec_pad_id=2148, codec_bos_id=2149, speaker_id=dict(SPEAKERS),
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        audio_start_token_id=ids["<|audio_start|>"],
    )
    code2wav = dict(codebook_size=2048, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=128, num_hidden_layers=2, num_quantizers=16, decoder_dim=128,
                    upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], max_position_embeddings=8000)
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eos>"], system_token_id=ids["system"], user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


def _init_weights(model, seed: int) -> None:
    """from_config leaves the talker's MoE experts uninitialised and its router zero (transformers 5.19),
    and std-0.02 convolutions make the vocoder's output ~0: set both, then check every value is finite."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("talker.") and (".experts." in name or ".gate." in name or "router" in name):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        tiny_folder.init_vocoder_convs(model.code2wav, gen)
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"tiny Qwen3-Omni has non-finite parameters: {bad[:5]}")


def build(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to `out` (created) and return it."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny_folder.build_tokenizer(out, seed, specials=SPECIALS, chat_template=CHAT_TEMPLATE,
                                extra_special_tokens=EXTRA_SPECIALS)
    tok = AutoTokenizer.from_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS + ROLES}
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(build_config(ids)).to(torch.float32)
    _init_weights(model, seed)
    return tiny_folder.save(model, out, ids["<|im_end|>"], "Qwen3OmniMoeProcessor", patch_size=16)


if __name__ == "__main__":
    tiny_folder.main(build, "omni.models.qwen3_omni.tiny")
