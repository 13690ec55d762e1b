"""A tiny Qwen2.5-Omni folder of the real architecture, built offline in seconds.

Random weights (seeded, ~3 M parameters), the real module classes, the real codec ids
(talker vocabulary 8448: pad 8292, bos 8293, eos 8294, mask 8296), speakers Chelsie and
Ethan in `spk_dict.pt` as the real checkpoint has them (`cond`, `ref_mel`, `bos_token`),
the Qwen3 builder's byte-level BPE tokenizer trained with Qwen2.5's special tokens, and
the processor files vLLM needs for audio input. Same seed -> byte-identical files.
`python -m omni.models.qwen25_omni.tiny DIR`.
"""

from __future__ import annotations

from pathlib import Path

from omni.models import tiny_folder
from omni.models.tiny_folder import VOCAB

SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
    "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>",
)
ROLES = ("system", "user", "assistant")
EXTRA_SPECIALS = {
    "audio_token": "<|AUDIO|>", "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
}
# The real checkpoint keeps the talker's text specials and the speakers' text-bos ids in
# embedding rows past the tokenizer (151859..); here they sit at the top of the padded vocab.
TTS_PAD, TTS_BOS, TTS_EOS = VOCAB - 8, VOCAB - 7, VOCAB - 6
SPEAKER_BOS = {"Chelsie": VOCAB - 4, "Ethan": VOCAB - 3}
CODEC = {"pad": 8292, "bos": 8293, "eos": 8294, "mask": 8296}
TALKER_VOCAB = 8448
REF_MEL_FRAMES = 64

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('audio', 'input_audio', 'audio_url') %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_config(ids: dict[str, int]):
    from transformers import Qwen2_5OmniConfig

    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,   # head_dim 32
                rope_parameters=rope, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=False)
    thinker = dict(
        text_config=text,
        audio_config=dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                          d_model=64, output_dim=64, max_source_positions=1500, n_window=100),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=112, patch_size=14, in_channels=3,
                           # read by vLLM, not declared by the config class
                           in_chans=3, spatial_patch_size=14, tokens_per_second=2),
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"], user_token_id=ids["user"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
    )
    talker = dict(
        vocab_size=TALKER_VOCAB, embedding_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        rope_parameters=rope, tts_text_start_token_id=TTS_BOS, tts_text_end_token_id=TTS_EOS,
        tts_text_pad_token_id=TTS_PAD, tts_codec_start_token_id=CODEC["bos"],
        tts_codec_end_token_id=CODEC["eos"], tts_codec_pad_token_id=CODEC["pad"],
        tts_codec_mask_token_id=CODEC["mask"], audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
    )
    token2wav = dict(
        dit_config=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32, ff_mult=2,
                        emb_dim=32, block_size=24, look_ahead_layers=[2], look_backward_layers=[0, 3],
                        repeats=2, num_embeds=8193, mel_dim=80, enc_emb_dim=32, enc_dim=32,
                        enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
                        enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_se_channels=16),
        bigvgan_config=dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3, 7, 11],
                            resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                            upsample_rates=[5, 3, 2, 2, 2, 2], upsample_kernel_sizes=[11, 7, 4, 4, 4, 4]),
    )
    config = Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav,
                               enable_audio_output=True)
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    return config


def _init_weights(model, seed: int) -> None:
    """std-0.02 convolutions leave the vocoder's output ~0: reset them. A trained talker never picks a
    code the DiT cannot embed (ids past its codebook other than pad / eos): zero those codec_head rows
    so random weights do not either. Then check every value is finite."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        head = model.talker.codec_head.weight
        keep = {CODEC["pad"], CODEC["eos"]}
        head[[i for i in range(model.config.token2wav_config.dit_config.num_embeds + 1, head.shape[0])
              if i not in keep]] = 0.0
        tiny_folder.init_vocoder_convs(model.token2wav.code2wav_bigvgan_model, gen)
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        bad += [n for n, b in model.named_buffers() if b.is_floating_point() and not torch.isfinite(b).all()]
    if bad:
        raise RuntimeError(f"tiny Qwen2.5-Omni has non-finite parameters: {bad[:5]}")


def _speakers(config, seed: int) -> dict:
    """spk_dict.pt as the real checkpoint holds it: name -> cond [enc_emb_dim], ref_mel [1, T, mel],
    bos_token (the talker's text-bos id for that voice)."""
    import torch

    dit = config.token2wav_config.dit_config
    gen = torch.Generator().manual_seed(seed + 2)
    return {name: {"cond": torch.randn(dit.enc_emb_dim, generator=gen),
                   "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim, generator=gen) * 2 - 6,
                   "bos_token": bos}
            for name, bos in SPEAKER_BOS.items()}


def build(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to `out` (created) and return it."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tiny_folder.build_tokenizer(out, seed, specials=SPECIALS, chat_template=CHAT_TEMPLATE, extra_special_tokens=EXTRA_SPECIALS)
    tok = AutoTokenizer.from_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS + ROLES}
    config = build_config(ids)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32)
    _init_weights(model, seed)
    torch.save(_speakers(config, seed), out / "spk_dict.pt")
    return tiny_folder.save(model, out, ids["<|im_end|>"], "Qwen2_5OmniProcessor", patch_size=14)


if __name__ == "__main__":
    tiny_folder.main(build, "omni.models.qwen25_omni.tiny")
