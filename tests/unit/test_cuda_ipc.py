"""cuda_ipc beyond the shared contract (test_transport_contract.py runs that on the host-memory
stand-in): what `auto` picks, the arena's rules, refusals, and the real CUDA path (marked `cuda`)."""

from __future__ import annotations

import types

import msgspec
import pytest
import torch

from omni.config import parse
from omni.orchestrator import events as ev
from omni.stage.producers import OutputProducers
from omni.stage.worker_state import InFlight
from omni.transport.base import ProducerFull, TransportError
from omni.transport.cuda_ipc import CudaIpcConsumer, CudaIpcProducer
from omni.transport.factory import auto_transport, make_consumer, make_producer
from omni.transport.ipc_memory import HostMemory
from tests.unit.test_orchestrator_core import chat, ids, make_core, of, output, replica
from tests.unit.test_transport_contract import Child, child_digest

IPC = frozenset({"cuda_ipc"})


# -- what auto picks (pure) -------------------------------------------------------------------
@pytest.mark.parametrize("same_host, tensor, producer, consumer, available, expected", [
    (False, "cuda:0", "1", "1", IPC, "tcp"),        # other host: as before
    (False, "cpu", "cpu", "cpu", IPC, "tcp"),
    (True, "cpu", "1", "1", IPC, "shm"),            # a CPU tensor: shm as before
    (True, "cuda:0", "1", "1", IPC, "cuda_ipc"),    # talker and code2wav on GPU 1
    (True, "cuda:0", "1", "1", frozenset(), "shm"), # no cuda_ipc in this process
    (True, "cuda:0", "0", "1", IPC, "shm"),         # another GPU
    (True, "cuda:0", "1", "cpu", IPC, "shm"),       # a CPU stage wants host tensors
    (True, "cuda:1", "2,3", "3", IPC, "cuda_ipc"),  # cuda:1 of a "2,3" stage is GPU 3
    (True, "cuda:0", "2,3", "3", IPC, "shm"),       # ... and cuda:0 is GPU 2
    (True, "cuda:0", "2,3", "2,3", IPC, "cuda_ipc"),
    (True, "cuda:5", "2,3", "3", IPC, "shm"),       # an index the stage does not have
    (True, "cuda:2", "cpu", "2", IPC, "cuda_ipc"),  # an unrestricted producer: its index is the GPU
    (True, "cuda", "cpu", " 0 ", IPC, "cuda_ipc"),
])
def test_auto_transport(same_host, tensor, producer, consumer, available, expected):
    assert auto_transport(same_host, tensor, producer, consumer, available) == expected


def test_orchestrator_sends_the_consumer_devices_for_auto_on_one_host():
    stages = [
        {"stage_id": 0, "name": "thinker", "engine": "count", "final_output": True, "final_output_type": "text"},
        {"stage_id": 1, "name": "talker", "engine": "count", "inputs": [0], "devices": "1",
         "processor": "omni.models.piper.processors:thinker_to_talker"},
        {"stage_id": 2, "name": "code2wav", "engine": "count", "inputs": [1], "devices": "1",
         "processor": "omni.models.piper.processors:talker_to_code2wav", "final_output": True,
         "final_output_type": "audio"},
    ]

    def talker_message(config, code2wav_host="h1"):
        core = make_core(replica(0, "s0r0"), replica(1, "s1r0"), replica(2, "s2r0", host=code2wav_host),
                         config=config)
        core.submit(chat())
        return of(core.handle(output("s0r0", 0, "r1", token_ids=ids("Hi. Yo"))), ev.Send)[0].message

    auto = parse({"model": "m", "pipeline": {"speech_entry_stage": 1}, "stages": stages}, source="test")
    msg = talker_message(auto)
    assert (msg.out_transport, msg.out_devices) == ("shm", "1")
    msg = talker_message(auto, code2wav_host="h2")
    assert (msg.out_transport, msg.out_devices) == ("tcp", "")
    stages[1] = {**stages[1], "connectors": {"2": {"transport": "shm"}}}   # configured: no change per tensor
    msg = talker_message(parse({"model": "m", "pipeline": {"speech_entry_stage": 1}, "stages": stages}, source="t"))
    assert (msg.out_transport, msg.out_devices) == ("shm", "")


def test_worker_takes_cuda_ipc_for_a_cuda_tensor_where_auto_allows():
    out = OutputProducers(None, "1", "talker", available=IPC)
    cuda = types.SimpleNamespace(is_cuda=True, device="cuda:0")

    def kind(out_devices, tensor, transport="shm"):
        return out.kind_for(InFlight(b"f", 0.0, transport, out_devices=out_devices), tensor)

    assert kind("1", cuda) == "cuda_ipc"
    assert kind("0", cuda) == "shm"
    assert kind("1", torch.ones(2)) == "shm"
    assert kind("", cuda) == "shm"                  # configured (or the frontend): as sent
    assert kind("", cuda, "nccl") == "nccl"


def test_worker_goes_back_to_shm_when_cuda_ipc_fails():
    puts: list[str] = []

    class Failing:
        def put(self, tensor, owner=""):
            raise TransportError("cuda_ipc: allocating and exporting arena segment 0 failed: out of memory")

    class Shm:
        def put(self, tensor, owner=""):
            puts.append(owner)
            return "ref"

    out = OutputProducers({"cuda_ipc": Failing(), "shm": Shm()}.__getitem__, "1", "talker", available=IPC)
    req = InFlight(b"f", 0.0, "shm", out_devices="1")
    cuda = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    assert out.put(req, cuda, "r1") == "ref" and puts == ["r1"]
    assert out.available == frozenset() and out.kind_for(req, cuda) == "shm"


def test_config_takes_cuda_ipc_and_refuses_an_unknown_transport_by_name():
    base = {"model": "m", "stages": [
        {"stage_id": 0, "engine": "count"},
        {"stage_id": 1, "engine": "count", "inputs": [0], "final_output": True, "final_output_type": "audio"}]}
    base["stages"][0]["connectors"] = {"1": {"transport": "cuda_ipc"}}
    assert parse(base, source="t").stage(0).connectors["1"].transport == "cuda_ipc"
    base["stages"][0]["connectors"] = {"1": {"transport": "cuda-ipc"}}
    with pytest.raises(Exception, match="'cuda-ipc'"):
        parse(base, source="t")


# -- the arena on host memory -----------------------------------------------------------------
@pytest.fixture
def pair():
    producer = make_producer("cuda_ipc", memory="host", arena_bytes=1 << 20, max_segments=2)
    consumer = make_consumer("cuda_ipc")
    yield producer, consumer
    consumer.close()
    producer.close()


def test_get_returns_the_consumers_own_copy(pair):
    producer, consumer = pair
    x = torch.arange(1000, dtype=torch.int32)
    ref = producer.put(x)
    a = consumer.get(ref)
    a.fill_(-1)                                      # the consumer's tensor: the slot keeps its bytes
    assert torch.equal(consumer.get(ref), x)
    producer.free([ref.key])
    again = producer.put(torch.zeros(1000, dtype=torch.int32))
    assert again.offset == ref.offset                # the slot is reused after the ack ...
    b = consumer.get(again)
    assert torch.equal(b, torch.zeros(1000, dtype=torch.int32)) and torch.equal(a, torch.full((1000,), -1))


def test_segments_grow_then_the_arena_is_full_until_an_ack(pair):
    producer, consumer = pair
    big = [producer.put(torch.full((600 << 10,), i, dtype=torch.uint8)) for i in range(2)]
    assert [r.endpoint.rsplit("/", 1)[1] for r in big] == ["0", "1"]
    with pytest.raises(ProducerFull, match="arena full"):
        producer.put(torch.zeros(600 << 10, dtype=torch.uint8))
    assert [int(consumer.get(r)[0]) for r in big] == [0, 1]
    producer.free([big[0].key])
    ref = producer.put(torch.full((600 << 10,), 9, dtype=torch.uint8))
    assert int(consumer.get(ref)[-1]) == 9 and producer.bytes_in_use() == 2 * (600 << 10)


def test_a_free_during_the_copy_is_caught(pair):
    producer, consumer = pair
    ref = producer.put(torch.ones(64))

    class FreedMeanwhile(HostMemory):
        def copy_out(self, *args):
            producer.free([ref.key])                 # the producer reuses the slot while we copy
            producer.put(torch.zeros(64))
            return super().copy_out(*args)

    consumer.get(producer.put(torch.ones(1)))        # maps the segment
    consumer._memory["host"] = FreedMeanwhile()
    with pytest.raises(TransportError, match="freed or the ref is foreign"):
        consumer.get(ref)


def test_refusals_name_the_cause():
    with pytest.raises(TransportError, match="memory 'tpu' is not supported"):
        make_producer("cuda_ipc", memory="tpu")
    producer = CudaIpcProducer(memory=HostMemory(device="GPU elsewhere"))
    consumer = CudaIpcConsumer()
    try:
        with pytest.raises(TransportError, match="takes CPU tensors, got one on meta"):
            producer.put(torch.empty(3, device="meta"))
        ref = producer.put(torch.ones(3))
        with pytest.raises(TransportError, match="lives on GPU elsewhere, which this process cannot map"):
            consumer.get(ref)
        other_host = msgspec.structs.replace(ref, endpoint="otherbox/" + ref.endpoint.split("/", 1)[1])
        with pytest.raises(TransportError, match="runs on host 'otherbox'.*within one host"):
            consumer.get(other_host)
        with pytest.raises(TransportError, match="bad cuda_ipc endpoint"):
            consumer.get(msgspec.structs.replace(ref, endpoint="nonsense"))
        with pytest.raises(TransportError, match="has no segment 3"):
            consumer.get(msgspec.structs.replace(ref, endpoint=ref.endpoint[:-1] + "3"))
    finally:
        consumer.close()
        producer.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_cuda_memory_without_a_gpu_is_refused_by_name():
    with pytest.raises(TransportError, match="cuda_ipc needs a CUDA GPU"):
        make_producer("cuda_ipc")


# -- the real thing: two processes on one GPU (skipped without one) -----------------------------
def test_the_copy_in_is_ordered_both_ways_with_the_callers_stream():
    """On the CUDA emulator (streams recorded, not run): the copy stream waits for the caller's stream
    (src is computed), records the fence after the copy, and the caller's stream then waits on that
    fence, so the caller's later in-place write to src cannot overtake the copy. The last wait was
    missing. (On a GPU: test_cuda_tensors_reach_a_consumer_process_in_order_of_the_fence.)"""
    from omni.transport.ipc_memory import CudaMemory
    from tests.unit.fake_cuda import FakeCuda

    calls: list[tuple[str, str, list]] = []

    class Rec:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, attr):
            return lambda *a, **k: calls.append((self.name, attr, [getattr(x, "name", x) for x in a]))

    with FakeCuda(), torch.no_grad():
        current, copy, fence = Rec("current"), Rec("copy"), Rec("fence")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "current_stream", lambda *a, **k: current)
            mem = CudaMemory.__new__(CudaMemory)
            mem.device, mem._streams, mem._event = torch.device("cuda", 0), {0: copy}, fence
            dst = torch.zeros(8, dtype=torch.uint8, device="cuda")
            src = torch.arange(8, dtype=torch.uint8, device="cuda")
            src.record_stream = lambda s: calls.append(("src", "record_stream", [s.name]))
            mem.copy_in(dst, src)
        assert torch.equal(dst.cpu(), torch.arange(8, dtype=torch.uint8))
    assert calls == [("copy", "wait_stream", ["current"]), ("fence", "record", ["copy"]),
                     ("current", "wait_event", ["fence"]), ("src", "record_stream", ["copy"])]


def test_the_copy_out_lands_in_memory_of_the_copy_stream_recorded_for_the_callers():
    """On the CUDA emulator: the consumer's tensor is allocated on the copy stream (one from the caller's
    stream's pool may be a block freed there that the caller's queued kernels still use, and the copy,
    ordered only by the producer's fence, would overwrite it), then marked used by the caller's stream,
    so its block is not reused before the caller's work on it is done. It was allocated on the caller's
    stream. (On a GPU the child of test_cuda_tensors_reach_a_consumer_process_in_order_of_the_fence
    gets through this copy_out.)"""
    import contextlib

    from omni.transport.ipc_memory import CudaMemory, Mapping
    from tests.unit.fake_cuda import DeviceTensor, FakeCuda

    calls: list[tuple[str, str, list]] = []
    active: list[str] = ["current"]

    class Rec:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, attr):
            return lambda *a, **k: calls.append((self.name, attr, [getattr(x, "name", x) for x in a]))

    @contextlib.contextmanager
    def on(stream):
        active.append(stream.name)
        try:
            yield
        finally:
            active.pop()

    with FakeCuda(), torch.no_grad():
        current, copy, fence = Rec("current"), Rec("copy"), Rec("fence")
        empty = torch.empty
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "current_stream", lambda *a, **k: current)
            patch.setattr(torch.cuda, "stream", on)
            patch.setattr(torch, "empty", lambda *a, **k: calls.append(("empty", "on", [active[-1]])) or empty(*a, **k))
            patch.setattr(DeviceTensor, "record_stream", lambda t, s: calls.append(("out", "record_stream", [s.name])),
                          raising=False)
            mem = CudaMemory.__new__(CudaMemory)
            mem.device, mem._streams, mem._event = torch.device("cuda", 0), {0: copy}, None
            src = torch.arange(32, dtype=torch.float32)
            buf = src.view(torch.uint8).to("cuda")
            out = mem.copy_out(Mapping(buf), fence, 0, torch.float32, (4, 8))
        assert torch.equal(out.cpu(), src.reshape(4, 8))
    assert calls[:3] == [("empty", "on", ["copy"]), ("out", "record_stream", ["current"]),
                         ("copy", "wait_event", ["fence"])]


@pytest.mark.cuda
def test_cuda_tensors_reach_a_consumer_process_in_order_of_the_fence():
    producer = make_producer("cuda_ipc", arena_bytes=64 << 20)
    child = Child("consume")
    try:
        # queued behind a long kernel and put at once: only the fence orders the consumer's copy
        x = torch.zeros(16 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)
        x.add_(7)
        refs = [producer.put(x, owner="c")]
        refs.append(producer.put(torch.arange(1000, device="cuda", dtype=torch.float32).reshape(10, 100)))
        for t, ref in zip([torch.full((16 << 20,), 7, dtype=torch.uint8),
                           torch.arange(1000, dtype=torch.float32).reshape(10, 100)], refs):
            child.send(msgspec.json.encode(ref).decode())
            assert child.read() == child_digest(t)
        with pytest.raises(TransportError, match="carries CUDA tensors"):
            producer.put(torch.ones(3))
    finally:
        child.close()
        producer.close()


@pytest.mark.parametrize("memory", ["host", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_slot_is_reused_after_the_ack_and_a_freed_ref_fails_in_the_consumer_process(memory):
    device = "cuda" if memory == "cuda" else "cpu"
    producer = make_producer("cuda_ipc", arena_bytes=1 << 20, max_segments=1, memory=memory)
    child = Child("consume")
    try:
        first = producer.put(torch.full((1 << 18,), 3, dtype=torch.int32, device=device))
        child.send(msgspec.json.encode(first).decode())
        assert child.read() == child_digest(torch.full((1 << 18,), 3, dtype=torch.int32))
        producer.free([first.key])
        second = producer.put(torch.full((1 << 18,), 5, dtype=torch.int32, device=device))
        assert second.offset == first.offset
        child.send(msgspec.json.encode(second).decode())
        assert child.read() == child_digest(torch.full((1 << 18,), 5, dtype=torch.int32))
        child.send(msgspec.json.encode(first).decode())   # the freed ref: the child's get raises
        with pytest.raises(AssertionError, match="child exited"):
            child.read()
    finally:
        child.close()
        producer.close()


# -- the benchmark's device rows ----------------------------------------------------------------
def test_benchmark_device_rows_run_without_a_gpu_and_say_so(monkeypatch, capsys):
    from benchmarks import transport as bench

    monkeypatch.setattr(bench, "DEVICE_SIZES", {4 << 10: 3, 1 << 20: 3})
    monkeypatch.setattr(bench, "DEVICE_ARENA", 2 << 20)
    bench.bench_device(as_json=True)
    out = capsys.readouterr()
    doc = msgspec.json.decode(out.out)
    labels = [label for label, *_ in bench.device_runs(torch.cuda.is_available())]
    assert [(r["transport"], r["bytes"]) for r in doc["rows"]] == [(k, n) for k in labels for n in (4 << 10, 1 << 20)]
    # each row also went to stderr as it was measured (a run cut at its limit keeps them)
    measured = [line for line in out.err.splitlines() if line.startswith("transport: ")]
    assert measured == [f"transport: {r['transport']} {bench.human(r['bytes'])}: p50 {r['p50_us']} us, "
                        f"p99 {r['p99_us']} us, {r['gbps']} GB/s ({r['vs_memcpy']}x memcpy)" for r in doc["rows"]]
    assert all(r["p50_us"] > 0 for r in doc["rows"])
    if not torch.cuda.is_available():
        assert doc["device"] == "cpu" and doc["skipped"].startswith("CUDA rows skipped")
        assert labels == ["shm", "cuda_ipc host"]
    bench.bench_device(as_json=False)
    table = capsys.readouterr().out
    assert "p50 us per tensor" in table and all(label in table for label in labels)
    assert ("CUDA rows skipped" in table) != torch.cuda.is_available()
