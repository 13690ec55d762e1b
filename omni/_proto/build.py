"""Regenerate the committed gRPC modules from proto/: `python -m omni._proto.build [--out DIR]`.

protoc writes `omni/v1/master_pb2.py` that imports its siblings as `omni.v1.*`; we flatten the
output into omni/_proto/ and rewrite those imports so they load as `omni._proto.master_pb2`.
The output depends only on the .proto files and the grpcio-tools version (pinned in pyproject).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_FILES = ["omni/v1/master.proto"]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_IMPORT_RE = re.compile(r"^from omni\.v1 import (\w+_pb2)", re.MULTILINE)


def generated_names() -> list[str]:
    return [Path(p).stem + suffix for p in PROTO_FILES for suffix in GENERATED_SUFFIXES]


def build(out_dir: Path) -> list[Path]:
    """Run protoc into a scratch dir, fix the imports, write the modules into out_dir."""
    from grpc_tools import protoc  # a build-time dependency only (test extra)

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="omni-protoc-") as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *PROTO_FILES,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} for {PROTO_FILES} under {PROTO_ROOT}")
        for proto in PROTO_FILES:
            src_dir = Path(scratch) / Path(proto).parent
            for suffix in GENERATED_SUFFIXES:
                name = Path(proto).stem + suffix
                text = (src_dir / name).read_text()
                text = _IMPORT_RE.sub(r"from omni._proto import \1", text)
                target = out_dir / name
                target.write_text(text)
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="output folder (default: omni/_proto)")
    ns = parser.parse_args(argv)
    for path in build(ns.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
