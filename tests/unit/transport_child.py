"""Child process for the transport contract tests (not collected by pytest).

  consume          read msgspec-JSON TensorRefs from stdin, one a line; print the sha256 of
                   each tensor's bytes; keep the tensors alive; on "hold" print "held" and wait
  produce KIND [TOKEN]  make a KIND producer, put `sample(i)` for i in 0..3 (owner "child"),
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
    return hashlib.sha256(flat_bytes(t.contiguous()).numpy().tobytes()).hexdigest()


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
        producer = make_producer(sys.argv[2], **({"token": sys.argv[3]} if len(sys.argv) > 3 else {}))
        for i in range(4):
            print(enc.encode(producer.put(sample(i), owner="child")).decode(), flush=True)
        print("ready", flush=True)
        sys.stdin.read()
        producer.close()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
