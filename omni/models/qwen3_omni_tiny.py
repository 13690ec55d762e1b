"""A tiny Qwen3-Omni folder of the real architecture, built offline in seconds.

Random weights (seeded), the real module classes and the real codec / speaker ids, a
small byte-level BPE tokenizer trained here with the Qwen special tokens, and the
processor files vLLM needs for audio input. Same seed -> byte-identical files, so
tests build it instead of committing weights. `python -m omni.models.qwen3_omni_tiny DIR`.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB = 1024
SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eos>", "<tts_text_bos_single>",
)
ROLES = ("system", "user", "assistant")
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

_WORDS = (
    "the a an of to and in is it that was for on are with as his they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said each she which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more "
    "day could go come did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only round man year came "
    "show every good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air well also play "
    "small end put home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn plant cover food sun "
    "four between state keep eye never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem together next white children begin "
    "got walk example ease paper group always music those both mark often letter until mile river car feet care "
    "second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure "
    "watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird "
    "soon body dog family direct pose leave song measure door product black short numeral class wind question "
    "happen complete ship area half rock order fire south problem piece told knew pass since top whole king "
    "space heard best hour better true during hundred five remember step early hold west ground interest reach "
    "fast verb sing listen six table travel less morning ten simple several vowel toward war lay against "
    "pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit "
    "power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest "
    "correct able pound done beauty drive stood contain front teach week final gave green oh quick develop "
    "ocean warm free minute strong special mind behind clear tail produce fact street inch multiply nothing "
    "course stay wheel full force blue object decide surface deep moon island foot system busy test record boat "
    "common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought "
    "heat snow tire bring yes distant fill east paint language among Paris France capital Hello omni speech"
).split()


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return lines


QWEN3_EXTRA_SPECIALS = {
    "audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
}


def build_tokenizer(out: Path, seed: int = 0, *, specials: tuple[str, ...] = SPECIALS,
                    chat_template: str = CHAT_TEMPLATE, extra_special_tokens: dict[str, str] | None = None,
                    vocab: int = VOCAB) -> None:
    """Train the tiny byte-level BPE (specials first, then the role words as single tokens), padded to
    `vocab` ids. The defaults are Qwen3-Omni's; Qwen2.5-Omni's builder passes its own specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials) + list(ROLES),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab:   # every id the random model can sample must decode to something
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab - n)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(specials), chat_template=chat_template,
        extra_special_tokens=dict(QWEN3_EXTRA_SPECIALS if extra_special_tokens is None else extra_special_tokens),
    )
    fast.save_pretrained(out)


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
        for module in model.code2wav.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                fan_in = module.weight.shape[1] * module.weight.shape[2]
                bound = 1.0 / fan_in ** 0.5
                module.weight.copy_((torch.rand(module.weight.shape, generator=gen) * 2 - 1) * bound)
                if module.bias is not None:
                    module.bias.copy_((torch.rand(module.bias.shape, generator=gen) * 2 - 1) * bound)
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RuntimeError(f"tiny Qwen3-Omni has non-finite parameters: {bad[:5]}")


def write_processor_files(out: Path, processor_class: str = "Qwen3OmniMoeProcessor", patch_size: int = 16) -> None:
    """What transformers' Qwen3OmniMoeProcessor loads (vLLM builds it even for text): the Whisper
    feature extractor and the Qwen2-VL image processor share preprocessor_config.json, the video
    processor has its own file. Written as JSON so building needs no torchvision."""
    from transformers import WhisperFeatureExtractor

    pre = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000).to_dict()
    pixels = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": patch_size,
              "temporal_patch_size": 2, "merge_size": 2, "do_convert_rgb": True, "do_normalize": True,
              "do_rescale": True, "do_resize": True, "resample": 3, "rescale_factor": 1 / 255}
    pre.update(pixels, image_processor_type="Qwen2VLImageProcessor", processor_class=processor_class,
               size={"shortest_edge": 3136, "longest_edge": 1003520})
    video = dict(pixels, video_processor_type="Qwen2VLVideoProcessor", processor_class=processor_class,
                 size={"shortest_edge": 3136, "longest_edge": 1003520})
    for name, d in (("preprocessor_config.json", pre), ("video_preprocessor_config.json", video)):
        (out / name).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def build(out: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to `out` (created) and return it."""
    import torch
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, seed)
    tok = AutoTokenizer.from_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS + ROLES}
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(build_config(ids)).to(torch.float32)
    _init_weights(model, seed)
    model.save_pretrained(out, max_shard_size="20MB")
    write_processor_files(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids["<|im_end|>"]}))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m omni.models.qwen3_omni_tiny DIR")
    print(build(sys.argv[1]))
