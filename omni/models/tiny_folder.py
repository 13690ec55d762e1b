"""What the tiny same-architecture model folders share (omni/models/*/tiny.py): a byte-level BPE
tokenizer trained here on a seeded word salad, the processor files vLLM loads, and the writing of
the folder. Same seed -> byte-identical files, so tests build a folder instead of committing one.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Callable

VOCAB = 1024
ROLES = ("system", "user", "assistant")

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


def build_tokenizer(out: Path, seed: int, *, specials: tuple[str, ...], chat_template: str,
                    extra_special_tokens: dict[str, str], vocab: int = VOCAB) -> None:
    """Train the tiny byte-level BPE (specials first, then the role words as single tokens), padded to
    `vocab` ids."""
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
        extra_special_tokens=dict(extra_special_tokens),
    )
    fast.save_pretrained(out)


def write_processor_files(out: Path, processor_class: str, patch_size: int = 16) -> None:
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


def save(model, out: Path, eos_token_id: int, processor_class: str, patch_size: int) -> Path:
    """Write the model (20 MB shards), its processor files and a generation config ending at `eos_token_id`."""
    model.save_pretrained(out, max_shard_size="20MB")
    write_processor_files(out, processor_class, patch_size=patch_size)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return out


def main(build: Callable[[str], Path], module: str) -> None:
    """`python -m MODULE DIR`: build the tiny folder into DIR and print where it is."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m {module} DIR")
    print(build(sys.argv[1]))


def init_vocoder_convs(module, gen) -> None:
    """Uniform fan-in init of a vocoder's Conv1d / ConvTranspose1d layers: with from_config's std-0.02
    init a random vocoder's output is ~0 (call under torch.no_grad())."""
    import torch

    for m in module.modules():
        if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            bound = 1.0 / (m.weight.shape[1] * m.weight.shape[2]) ** 0.5
            m.weight.copy_((torch.rand(m.weight.shape, generator=gen) * 2 - 1) * bound)
            if m.bias is not None:
                m.bias.copy_((torch.rand(m.bias.shape, generator=gen) * 2 - 1) * bound)
