"""The CUDA emulator the engine tests run on where no GPU is (tests/unit/fake_cuda.py): it must fail
where CUDA fails, or the fake-cuda runs prove nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.fake_cuda import CapturingError, DeviceTensor, FakeCuda


@pytest.fixture()
def cuda():
    with FakeCuda() as emulator, torch.no_grad():
        yield emulator


def test_tensors_claim_the_device_and_compute_on_the_cpu(cuda):
    x = torch.arange(6.0, device="cuda").view(2, 3)
    assert x.device == torch.device("cuda", 0) and x.is_cuda and isinstance(x, DeviceTensor)
    y = torch.tensor([1.0, 2.0, 3.0]).to("cuda", non_blocking=True)
    z = x * 2 + y
    assert z.is_cuda and torch.equal(z.cpu(), torch.tensor([[1.0, 4.0, 7.0], [7.0, 10.0, 13.0]]))
    assert (z + torch.tensor(1.0)).is_cuda                      # a 0-dim CPU tensor is a scalar, as on CUDA
    layer = torch.nn.Linear(3, 2).to("cuda")
    assert layer.weight.is_cuda and F.linear(x, layer.weight).is_cuda
    assert torch.cuda.is_available()


def test_mixing_devices_fails_as_on_cuda(cuda):
    x = torch.zeros(3, device="cuda")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.nn.Linear(3, 2)(x)                                # a module left on the host
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        x.numpy()
    with pytest.raises(RuntimeError, match="generator"):
        torch.multinomial(torch.ones(2, 3, device="cuda"), 1, generator=torch.Generator())
    x[torch.tensor([0, 2])] = 1.0                               # CPU index tensors are allowed
    assert x.cpu().tolist() == [1.0, 0.0, 1.0]


def test_host_reads_are_counted_and_refused_in_sync_debug_error_mode(cuda):
    x = torch.arange(4, device="cuda")
    x.sum().item(), x.tolist(), x.cpu(), x[x > 1]
    assert cuda.syncs == ["item", "tolist", "copy to host", "__getitem__"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            int(x[0])
        x.add_(1)                                               # device work alone is fine
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_replay_reruns_the_kernels_on_the_captured_tensors(cuda):
    static_in = torch.zeros(2, device="cuda")
    state = torch.zeros(2, device="cuda")
    scale = 3.0                                                 # a Python value: baked in at capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static_in * scale + 1
        state.add_(out)
    assert graph.ops, "capture recorded nothing"
    static_in.copy_(torch.tensor([1.0, 2.0]))                   # new inputs go into the captured tensor
    scale = 100.0
    graph.replay()
    assert out.cpu().tolist() == [4.0, 7.0] and state.cpu().tolist() == [1.0 + 4.0, 1.0 + 7.0]
    fresh = torch.tensor([5.0, 5.0], device="cuda")             # a new tensor: the graph never reads it
    static_in = fresh
    graph.replay()
    assert out.cpu().tolist() == [4.0, 7.0]


def test_capture_refuses_host_reads_and_host_copies(cuda):
    x = torch.ones(3, device="cuda")
    for bad in (lambda: x.sum().item(), lambda: x.cpu(), lambda: x + torch.ones(3).to("cuda"),
                lambda: x[x > 0], lambda: torch.tensor([1.0], device="cuda"), lambda: x[[0, 2]]):
        with pytest.raises(CapturingError), torch.cuda.graph(torch.cuda.CUDAGraph()):
            bad()


def test_memory_allocated_counts_live_device_storages(cuda):
    before = torch.cuda.memory_allocated()
    big = torch.zeros(1024, device="cuda")
    view = big[:10]
    assert torch.cuda.memory_allocated() - before == 4096        # a view shares its storage
    del big, view
    assert torch.cuda.memory_allocated() == before


def test_paused_gives_the_real_torch_back():
    if torch.cuda.is_available():
        pytest.skip("a real GPU is here")
    with FakeCuda() as emulator:
        with emulator.paused():
            assert not torch.cuda.is_available()
        assert torch.cuda.is_available()
    assert not torch.cuda.is_available()
