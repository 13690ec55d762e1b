"""A tiny Wan text-to-video folder of the real architecture, built offline in seconds.

A diffusers folder as `WanPipeline.save_pretrained` writes it: diffusers' own WanTransformer3DModel and
AutoencoderKLWan (the real 4x temporal, 8x spatial compression), transformers' UMT5 encoder, Wan2.1's
UniPC flow scheduler settings, and the small byte-level BPE tokenizer of omni/models/tiny_folder.py.
Random weights, seeded per component: same seed -> byte-identical files.
`python -m omni.models.wan.tiny DIR`.
"""

from __future__ import annotations

from pathlib import Path

from omni.models import tiny_folder
from omni.models.tiny_folder import VOCAB

SPECIALS = ("<|endoftext|>", "<|im_end|>")

# Wan2.1-T2V-1.3B's scheduler_config.json: UniPC on flow sigmas, shifted by 3 (its 480p setting).
SCHEDULER = dict(beta_end=0.02, beta_schedule="linear", beta_start=0.0001, disable_corrector=[],
                 dynamic_thresholding_ratio=0.995, final_sigmas_type="zero", flow_shift=3.0, lower_order_final=True,
                 num_train_timesteps=1000, predict_x0=True, prediction_type="flow_prediction",
                 rescale_betas_zero_snr=False, sample_max_value=1.0, solver_order=2, solver_p=None, solver_type="bh2",
                 steps_offset=0, thresholding=False, timestep_spacing="linspace", trained_betas=None,
                 use_beta_sigmas=False, use_exponential_sigmas=False, use_flow_sigmas=True, use_karras_sigmas=False)

# The DiT at test size: 2 blocks of 2 heads x 16, the real (1, 2, 2) patch; the VAE at base width 8 with
# a 4-channel latent and the real three spatial (two temporal) downsamplings.
TINY_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
                latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 1.0, 0.8])
TINY_ENCODER = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, relative_attention_max_distance=32,
                    feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_encoder_decoder=False)


def build(out: str | Path, seed: int = 0) -> Path:
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    tiny_folder.build_tokenizer(tok_dir, seed, specials=SPECIALS, chat_template="", extra_special_tokens={})
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    config = UMT5Config(**TINY_ENCODER, pad_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    text_encoder = UMT5EncoderModel(config).eval()
    torch.manual_seed(seed + 1)
    transformer = WanTransformer3DModel(**TINY_TRANSFORMER).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(**TINY_VAE).eval()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**SCHEDULER))
    pipe.save_pretrained(out)
    return out


if __name__ == "__main__":
    tiny_folder.main(build, "omni.models.wan.tiny")
