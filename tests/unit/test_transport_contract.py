"""One contract, run against every tensor transport (shm, tcp, gloo, cuda_ipc), plus their parts.

cuda_ipc runs here on its host-memory stand-in (the same protocol, processes and sockets; the
CUDA memory itself: tests/unit/test_cuda_ipc.py, marked `cuda`)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from omni.transport.alloc import ALIGN, SlotAllocator
from omni.transport.base import TensorConsumer, TensorProducer, TensorRef, TransportError
from omni.transport.factory import MultiConsumer, choose_transport, make_consumer, make_producer
from omni.transport.sweep import Sweep

KINDS = ["shm", "tcp", "gloo", "cuda_ipc"]
REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("transport_child.py")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
ARENA = 80 << 20
DEADLINE = 60.0


def limit_opts(kind: str, nbytes: int) -> dict:
    return {"arena_bytes": nbytes} if kind in ("shm", "cuda_ipc") else {"max_tensor_bytes": nbytes}


def producer(kind: str, **opts) -> TensorProducer:
    """make_producer, with cuda_ipc on host memory (no GPU here)."""
    return make_producer(kind, **({"memory": "host"} if kind == "cuda_ipc" else {}), **opts)


def omni_shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "omni" in n}


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def pair(kind) -> Iterator[tuple[TensorProducer, TensorConsumer]]:
    prod = producer(kind, **limit_opts(kind, ARENA))
    consumer = make_consumer(kind)
    yield prod, consumer
    consumer.close()
    prod.close()


def sample(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 50
    return x > 0 if dtype == torch.bool else x.to(dtype)


def roundtrip(producer, consumer, x, owner=""):
    ref = producer.put(x, owner=owner)
    ref = msgspec.msgpack.decode(msgspec.msgpack.encode(ref), type=TensorRef)  # as refs travel
    return ref, consumer.get(ref)


def assert_same(x: torch.Tensor, y: torch.Tensor) -> None:
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape)
    assert torch.equal(y, x)


# -- children -------------------------------------------------------------------------------
class Child:
    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, str(CHILD), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        try:
            line = self.lines.get(timeout=DEADLINE)
        except queue.Empty:
            raise AssertionError(f"child {self.proc.args} said nothing for {DEADLINE} s") from None
        assert line is not None, f"child exited with {self.proc.wait()}"
        return line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=DEADLINE) == -signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEADLINE)


def child_digest(t: torch.Tensor) -> str:
    sys.path.insert(0, str(CHILD.parent))
    from transport_child import digest
    return digest(t)


# -- the contract ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtypes_and_shapes(pair, dtype):
    producer, consumer = pair
    for shape in [(), (0, 3), (17,), (3, 4, 5), (2, 1, 3, 8)]:
        x = sample(shape, dtype)
        _, y = roundtrip(producer, consumer, x)
        assert_same(x, y)
    # non-contiguous input: the producer makes it contiguous
    x = sample((6, 9, 4), dtype).permute(2, 0, 1)[:, ::2]
    assert not x.is_contiguous()
    ref, y = roundtrip(producer, consumer, x)
    assert_same(x, y)
    assert ref.nbytes == x.numel() * x.element_size()


def test_conjugate_and_negative_views_arrive_as_their_values(pair):
    """A lazy conj() or negative-bit view's memory holds other values than the view: shm and cuda_ipc
    raised on its byte view, tcp's server thread died at send time, gloo delivered them unconjugated."""
    producer, consumer = pair
    z = torch.randn((4, 3), dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    r = torch.randn((4, 3), generator=torch.Generator().manual_seed(2))
    views = {"conj": z.conj(), "conj_t": z.t().conj(), "neg": torch._neg_view(z), "neg_real": torch._neg_view(r),
             "imag_of_conj": z.conj().imag}
    for name, v in views.items():
        _, y = roundtrip(producer, consumer, v)
        want = v.resolve_conj().resolve_neg()
        assert not y.is_conj() and not y.is_neg(), name
        assert y.dtype == v.dtype and y.shape == v.shape and torch.equal(y, want), name


@pytest.mark.parametrize("nbytes", [1 << 10, 1 << 20, 64 << 20], ids=["1KiB", "1MiB", "64MiB"])
def test_sizes(pair, nbytes):
    producer, consumer = pair
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    ref, y = roundtrip(producer, consumer, x, owner="r")
    assert ref.nbytes == nbytes and torch.equal(x, y)
    assert producer.bytes_in_use() >= nbytes
    del y
    producer.free([ref.key])
    assert producer.bytes_in_use() == 0


def test_ordering(pair):
    producer, consumer = pair
    refs = [producer.put(torch.full((64,), i, dtype=torch.int32)) for i in range(40)]
    assert len({r.key for r in refs}) == 40
    for i, ref in list(enumerate(refs))[::-1] + list(enumerate(refs)):
        assert torch.equal(consumer.get(ref), torch.full((64,), i, dtype=torch.int32))


def test_concurrent_streams(pair):
    producer, consumer = pair
    errors: list[BaseException] = []

    def stream(s: int) -> None:
        try:
            for i in range(15):
                x = torch.full((1000 + s * 37 + i,), s * 100 + i, dtype=torch.int64)
                ref = producer.put(x, owner=f"s{s}")
                assert torch.equal(consumer.get(ref), x)
                producer.free([ref.key])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE)
        assert not t.is_alive(), "a stream hung"
    assert not errors, errors
    assert producer.bytes_in_use() == 0


def test_bad_refs_raise_and_producer_keeps_working(pair):
    producer, consumer = pair
    x = sample((8, 16), torch.float32)
    ref = producer.put(x)
    replace = msgspec.structs.replace
    bad = [
        replace(ref, key=ref.key + 1000),                           # foreign key
        replace(ref, nbytes=ref.nbytes + 4),                        # nbytes vs dtype/shape
        replace(ref, shape=(8, 17), nbytes=8 * 17 * 4),             # consistent, but not what the producer holds
        replace(ref, dtype="complex_float9"),                       # unknown dtype
        replace(ref, transport="carrier-pigeon"),
    ]
    for b in bad:
        with pytest.raises(TransportError):
            consumer.get(b)
    producer.free([ref.key])
    with pytest.raises(TransportError, match="freed|foreign"):
        consumer.get(ref)
    _, y = roundtrip(producer, consumer, x)
    assert_same(x, y)


def test_too_large(kind):
    prod = producer(kind, **limit_opts(kind, 1 << 20))
    try:
        with pytest.raises(TransportError, match=str(1 << 20)):
            prod.put(torch.zeros(2 << 20, dtype=torch.uint8))
        assert prod.bytes_in_use() == 0
        consumer = make_consumer(kind)
        x = torch.arange(1000)
        assert torch.equal(consumer.get(prod.put(x)), x)
        consumer.close()
    finally:
        prod.close()


def test_free_owner(pair):
    producer, consumer = pair
    a = [producer.put(torch.ones(100 * (i + 1)), owner="a") for i in range(3)]
    b = producer.put(torch.ones(50), owner="b")
    producer.free_owner("a")
    producer.free_owner("nobody")
    producer.free([a[0].key, 123456])  # double or unknown frees are no-ops
    for ref in a:
        with pytest.raises(TransportError):
            consumer.get(ref)
    assert torch.equal(consumer.get(b), torch.ones(50))
    producer.free_owner("b")
    assert producer.bytes_in_use() == 0


def test_consumer_in_other_process_then_sigkilled(pair, kind):
    producer, _ = pair
    before = omni_shm_names()
    tensors = [sample((256, 33), torch.float32, seed=i) for i in range(3)] + [torch.arange(1 << 20, dtype=torch.int32)]
    refs = [producer.put(t, owner="consumer-1") for t in tensors]
    child = Child("consume")
    try:
        for t, ref in zip(tensors, refs):
            child.send(msgspec.json.encode(ref).decode())
            assert child.read() == child_digest(t)
        child.send("hold")
        assert child.read() == "held"
        assert producer.bytes_in_use() > 0
        child.kill()
    finally:
        child.close()
    producer.free_owner("consumer-1")
    assert producer.bytes_in_use() == 0
    x = torch.arange(10.0)
    assert torch.equal(make_consumer(kind).get(producer.put(x)), x)
    assert omni_shm_names() <= before


def test_producer_sigkilled_leaves_nothing(kind):
    before = omni_shm_names()
    child = Child("produce", kind + (":host" if kind == "cuda_ipc" else ""))
    consumer = make_consumer(kind)
    try:
        refs = []
        while (line := child.read()) != "ready":
            refs.append(msgspec.json.decode(line, type=TensorRef))
        sys.path.insert(0, str(CHILD.parent))
        from transport_child import sample as child_sample
        first = consumer.get(refs[0])
        assert torch.equal(first, child_sample(0))
        child.kill()
        assert omni_shm_names() <= before
        if kind in ("shm", "cuda_ipc"):
            # the mapping outlives the producer until the consumer's next sweep (next test)
            assert torch.equal(first, child_sample(0))
            assert torch.equal(consumer.get(refs[1]), child_sample(1))
            shm_ref = msgspec.structs.replace(refs[1], endpoint=refs[1].endpoint.rsplit("/", 1)[0] + "/1")
            with pytest.raises(TransportError, match="unreachable"):
                consumer.get(shm_ref)
        else:
            t0 = time.monotonic()
            with pytest.raises(TransportError):
                consumer.get(refs[1])
            assert time.monotonic() - t0 < 10
    finally:
        child.close()
        consumer.close()
    assert omni_shm_names() <= before


def _held_for(consumer, kind: str) -> list[str]:
    """What the consumer keeps for producers: mapped memfds (shm, cuda_ipc) or idle connections."""
    if kind in ("shm", "cuda_ipc"):
        tag = "omni-shm" if kind == "shm" else "omni-ipc"
        return [line for line in open(f"/proc/{os.getpid()}/maps") if f"memfd:{tag}" in line]
    return [e for e, conns in consumer._idle.items() for _ in conns]


def test_a_consumer_lets_go_of_a_producer_that_died(kind):
    """A long-lived consumer (the frontend's, a consumer stage's) kept every segment it mapped and
    every idle connection: a SIGKILLed producer's memfd pages (its device memory, for cuda_ipc) stayed
    for the consumer's life. Its next sweep (at most once a SWEEP_S, on a get) finds the producer gone
    and lets go; a live producer's are kept."""
    child = Child("produce", kind + (":host" if kind == "cuda_ipc" else ""))
    consumer = make_consumer(kind)
    live = producer(kind)
    try:
        refs = []
        while (line := child.read()) != "ready":
            refs.append(msgspec.json.decode(line, type=TensorRef))
        consumer.get(refs[0])
        consumer.get(live.put(torch.ones(3)))
        held = _held_for(consumer, kind)
        assert held
        child.kill()
        consumer._sweep = Sweep(0.0)                       # sweeps at every get from now
        x = torch.arange(5.0)
        assert torch.equal(consumer.get(live.put(x)), x)
        left = _held_for(consumer, kind)
        assert left and len(left) < len(held)              # the live producer's are kept
        assert torch.equal(consumer.get(live.put(x)), x)
        with pytest.raises(TransportError):
            consumer.get(refs[1])
    finally:
        child.close()
        consumer.close()
        live.close()


def test_close_leaves_nothing_and_refuses_puts(kind):
    before = omni_shm_names()
    prod = producer(kind)
    consumer = make_consumer(kind)
    ref = prod.put(torch.ones(1000))
    assert torch.equal(consumer.get(ref), torch.ones(1000))
    consumer.close()
    prod.close()
    prod.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        prod.put(torch.ones(3))
    assert omni_shm_names() <= before


# -- transport-specific parts ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["shm", "tcp", "gloo", "cuda_ipc"])
def test_wrong_token_is_refused(kind):
    prod = producer(kind, token="sesame")
    try:
        ref = prod.put(torch.ones(4))
        bad = make_consumer(kind, token="guess")
        with pytest.raises(TransportError, match="bad token"):
            bad.get(ref)
        bad.close()
        good = make_consumer(kind, token="sesame")
        assert torch.equal(good.get(ref), torch.ones(4))
        good.close()
    finally:
        prod.close()


def test_shm_is_zero_copy_and_grows_segments():
    producer = make_producer("shm", arena_bytes=1 << 20, max_segments=2)
    consumer = make_consumer("shm")
    try:
        ref = producer.put(torch.arange(1000.0))
        a, b = consumer.get(ref), consumer.get(ref)
        assert a.data_ptr() == b.data_ptr()  # both views of the same mapped slot
        big = [producer.put(torch.zeros(600 << 10, dtype=torch.uint8)) for _ in range(2)]
        assert {r.endpoint.rsplit("/", 1)[1] for r in big} == {"0", "1"}
        with pytest.raises(TransportError, match="arena full"):
            producer.put(torch.zeros(600 << 10, dtype=torch.uint8))
        producer.free([r.key for r in big])
        x = torch.ones(600 << 10, dtype=torch.uint8)
        assert torch.equal(consumer.get(producer.put(x)), x)
    finally:
        consumer.close()
        producer.close()


def test_slot_allocator_first_fit_coalescing():
    al = SlotAllocator(1024)
    offs = [al.alloc(n) for n in (1, 64, 100, 200)]
    assert offs == [0, 64, 128, 256] and all(o % ALIGN == 0 for o in offs)
    assert al.bytes_in_use == 64 + 64 + 128 + 256
    al.free(64)
    assert al.alloc(64) == 64  # first fit reuses the hole
    assert al.alloc(1024) is None
    for o in offs:
        al.free(o)
    assert al.bytes_in_use == 0 and al.free_blocks() == [(0, 1024)]
    assert al.alloc(1024) == 0


def test_factory_and_choice():
    with pytest.raises(TransportError, match="unknown transport 'rdma'"):
        make_producer("rdma")
    with pytest.raises(TransportError, match="unknown transport"):
        choose_transport("a", "b", "carrier")
    assert choose_transport("10.0.0.1", "10.0.0.1", None) == "shm"
    assert choose_transport("127.0.0.1", "localhost", None) == "shm"
    assert choose_transport("10.0.0.1", "10.0.0.2", None) == "tcp"
    assert choose_transport("10.0.0.1", "10.0.0.1", "gloo") == "gloo"
    producers = [producer(k) for k in KINDS]
    multi = MultiConsumer()
    try:
        for i, p in enumerate(producers):
            x = torch.full((5,), i)
            assert torch.equal(multi.get(p.put(x)), x)
        with pytest.raises(TransportError, match="unknown transport"):
            multi.get(msgspec.structs.replace(producers[0].put(torch.ones(1)), transport="rdma"))
    finally:
        multi.close()
        for p in producers:
            p.close()
