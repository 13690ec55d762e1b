"""Child process for the transport contract tests (not collected by pytest).

  consume          read msgspec-JSON TensorRefs from stdin, one a line; print the sha256 of
                   each tensor's bytes; keep the tensors alive; on "hold" print "held" and wait
  produce KIND[:MEMORY] [TOKEN]  make a KIND producer (cuda_ipc: on MEMORY, "cuda" or "host"), put
                   `sample(i)` for i in 0..3 (owner "child"; on the GPU for cuda_ipc on "cuda"),
                   print each ref as JSON, then "ready", then wait on stdin
"""

from __future__ import annotations

import hashlib
import sys

import msgspec
import torch

from omni.transport.base import TensorRef
from omni.transport.factory import MultiConsumer, make_producer
from omni.transport.util import flat_bytes


def sample(i: int) -> torch.Tensor:
    return torch.arange(1000 * (i + 1), dtype=torch.float32).reshape(-1, 10) * (i + 1)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(flat_bytes(t.contiguous().cpu()).numpy().tobytes()).hexdigest()


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    enc = msgspec.json.Encoder()
    dec = msgspec.json.Decoder(TensorRef)
    if mode == "consume":
        consumer = MultiConsumer(token=sys.argv[2] if len(sys.argv) > 2 else None)
        held = []
        for line in sys.stdin:
            line = line.strip()
            if line == "hold":
                print("held", flush=True)
                continue
            t = consumer.get(dec.decode(line))
            held.append(t)
            print(digest(t), flush=True)
    elif mode == "produce":
        kind, _, memory = sys.argv[2].partition(":")
        opts = {"token": sys.argv[3]} if len(sys.argv) > 3 else {}
        producer = make_producer(kind, **opts, **({"memory": memory} if memory else {}))
        on_gpu = kind == "cuda_ipc" and memory in ("", "cuda")
        for i in range(4):
            t = sample(i).cuda() if on_gpu else sample(i)
            print(enc.encode(producer.put(t, owner="child")).decode(), flush=True)
        print("ready", flush=True)
        sys.stdin.read()
        producer.close()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
