"""The tcp consumer's receive-buffer pool: reuse only buffers nothing refers to, within its bound."""

from __future__ import annotations

import gc

import torch

from omni.transport.factory import make_consumer, make_producer
from omni.transport.recvpool import MIN_POOLED, RecvPool

MiB = 1 << 20


def test_a_kept_tensor_is_never_handed_out_again():
    pool = RecvPool(16 * MiB)
    a = pool.empty((MiB // 4,), torch.float32, MiB)
    a.fill_(1.0)
    view = a[10:20]          # only a view survives: the buffer must stay taken
    del a
    b = pool.empty((MiB // 4,), torch.float32, MiB)
    b.fill_(2.0)
    assert torch.equal(view, torch.ones(10)) and pool.reused == 0
    kept_np = b.numpy()      # a numpy array of the tensor holds it too
    del b, view
    c = pool.empty((MiB,), torch.uint8, MiB)       # the first buffer is free again
    assert pool.reused == 1 and c.data_ptr() != kept_np.ctypes.data
    assert (kept_np == 2.0).all()


def test_reuse_after_drop_and_sizes():
    pool = RecvPool(16 * MiB)
    a = pool.empty((2, MiB), torch.uint8, 2 * MiB)
    ptr = a.data_ptr()
    del a
    gc.collect()
    b = pool.empty((MiB + 5,), torch.uint8, MiB + 5)   # fits in the 2 MiB buffer (at most twice the size)
    assert b.data_ptr() == ptr and b.shape == (MiB + 5,) and pool.reused == 1
    del b
    c = pool.empty((4, MiB), torch.bfloat16, 8 * MiB)  # too big for it: a new buffer
    assert c.data_ptr() != ptr and c.dtype == torch.bfloat16 and pool.bytes == 10 * MiB
    small = pool.empty((16,), torch.float32, 64)     # below MIN_POOLED: plain torch.empty
    assert small.shape == (16,) and pool.bytes == 10 * MiB and MIN_POOLED > 64


def test_bound_drops_idle_buffers_and_falls_back_when_all_are_taken():
    pool = RecvPool(4 * MiB)
    a = pool.empty((3 * MiB,), torch.uint8, 3 * MiB)
    b = pool.empty((3 * MiB,), torch.uint8, 3 * MiB)   # no room: a plain tensor, the pool stays at its bound
    assert pool.bytes == 3 * MiB and a.data_ptr() != b.data_ptr()
    del a
    c = pool.empty((4 * MiB,), torch.uint8, 4 * MiB)   # the idle 3 MiB buffer is dropped to make room
    assert pool.bytes == 4 * MiB and c.numel() == 4 * MiB
    pool.clear()
    assert pool.bytes == 0 and c.numel() == 4 * MiB    # a tensor outlives the pool's reference


def test_tcp_consumer_reuses_buffers_and_keeps_held_tensors_intact():
    producer = make_producer("tcp")
    consumer = make_consumer("tcp")
    try:
        x, y = torch.full((MiB,), 3.0), torch.full((MiB,), 4.0)
        rx, ry = producer.put(x), producer.put(y)
        held = consumer.get(rx)
        got = consumer.get(ry)               # held is still referenced: another buffer
        assert torch.equal(held, x) and torch.equal(got, y) and held.data_ptr() != got.data_ptr()
        ptr = got.data_ptr()
        del got
        again = consumer.get(rx)
        assert again.data_ptr() == ptr and torch.equal(again, x) and torch.equal(held, x)
    finally:
        consumer.close()
        producer.close()
