"""A tiny Qwen-Image folder of the real architecture, built offline in seconds.

A diffusers folder (`model_index.json`, one subfolder per component) as `QwenImagePipeline.save_pretrained`
writes it: diffusers' own QwenImageTransformer2DModel and AutoencoderKLQwenImage, transformers'
Qwen2.5-VL as the text encoder, Qwen-Image's flow-matching scheduler settings, and the small byte-level
BPE tokenizer of omni/models/tiny_folder.py with the Qwen special tokens. Random weights, seeded per
component: same seed -> byte-identical files. `python -m omni.models.qwen_image.tiny DIR`.
"""

from __future__ import annotations

from pathlib import Path

from omni.models import tiny_folder
from omni.models.tiny_folder import VOCAB

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")

# Qwen-Image's scheduler settings (its scheduler_config.json): dynamic shifting by image size.
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192, max_shift=0.9,
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, stochastic_sampling=False,
                 time_shift_type="exponential", use_beta_sigmas=False, use_dynamic_shifting=True,
                 use_exponential_sigmas=False, use_karras_sigmas=False)

# The DiT and VAE at test size: 2 dual-stream blocks of width 64, a 4-channel latent, the VAE's real
# 8x downsampling (three stages) at base width 8.
TINY_TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
                        num_attention_heads=2, joint_attention_dim=64, axes_dims_rope=(8, 12, 12))
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 1.0, 0.8])


def text_encoder_config(ids: dict[str, int], hidden_size: int = 64, layers: int = 2):
    from transformers import Qwen2_5_VLConfig

    heads = 2 if hidden_size == 64 else 28
    half = hidden_size // heads // 2      # mrope sections split half of a head's dimensions
    section = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
    text = dict(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1 if heads == 2 else 4,
                max_position_embeddings=2048, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"])


def build(out: str | Path, seed: int = 0) -> Path:
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    tiny_folder.build_tokenizer(tok_dir, seed, specials=SPECIALS, chat_template="", extra_special_tokens={})
    tokenizer = Qwen2Tokenizer.from_pretrained(tok_dir)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_encoder_config(ids)).eval()
    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(**TINY_VAE).eval()
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(out)
    return out


if __name__ == "__main__":
    tiny_folder.main(build, "omni.models.qwen_image.tiny")
