"""Buffer registration (NCCL's ncclCommRegister): Comm.register / deregister / registrations,
the handle rules, argument errors, and collectives on registered buffers across processes
(also over the RDMA link on the emulated fabric)."""

import gc
import os
import weakref

import numpy as np
import pytest

import qccl
from conftest import need, run_ranks

PAGE = 4096


def _page_aligned(nbytes, dtype=np.uint8):
    """A C-contiguous array of `nbytes` bytes starting on a page boundary."""
    raw = np.zeros(nbytes + PAGE, np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off : off + nbytes].view(dtype)


def _one_rank():
    return qccl.Comm.init(qccl.unique_id(), 0, 1, timeout=30)


def test_same_pages_give_the_same_handle_counted():
    c = _one_rank()
    a = _page_aligned(2 * PAGE, np.float32)
    first = a[:25]  # 100 bytes of the first page
    h = c.register(first)
    assert isinstance(h, int) and h != 0
    # The same array, and another view inside the same page (registrations are whole
    # pages): the same handle.
    assert c.register(first) == h
    assert c.register(a[2:50]) == h
    assert c.registrations() == {"ranges": 1, "made": 0, "wire": 0, "wire_made": 0}
    # Other pages: another handle.
    b = _page_aligned(PAGE)
    hb = c.register(b)
    assert hb != h
    # Both pages of `a`: another range.
    h2 = c.register(a)
    assert h2 not in (h, hb)
    assert c.registrations()["ranges"] == 3
    c.deregister(h2)
    # Three registrations of `a`: three deregistrations, then one more is refused.
    for _ in range(3):
        c.deregister(h)
    with pytest.raises(qccl.InvalidArgumentError, match="not a registration of this comm"):
        c.deregister(h)
    c.deregister(hb)
    with pytest.raises(qccl.InvalidArgumentError, match="already deregistered"):
        c.deregister(hb)
    assert c.registrations() == {"ranges": 0, "made": 0, "wire": 0, "wire_made": 0}
    c.close()


def test_bad_arguments_are_named():
    c = _one_rank()
    a = np.zeros(100, np.float32)
    with pytest.raises(qccl.InvalidArgumentError, match="register: buf is empty"):
        c.register(np.empty(0, np.float32))
    with pytest.raises(qccl.InvalidArgumentError, match="not C-contiguous"):
        c.register(np.zeros((8, 8), np.float32)[:, 1])
    with pytest.raises(TypeError, match="register: buf: expected a numpy array"):
        c.register([1.0, 2.0])
    for bad in [None, "1", -1, 1.5]:
        with pytest.raises(qccl.InvalidArgumentError, match="deregister: handle must be the int"):
            c.deregister(bad)
    # Numbers never handed out.
    for never in [0, 12345, 2**64 - 1]:
        with pytest.raises(qccl.InvalidArgumentError, match="not a registration of this comm"):
            c.deregister(never)
    # A handle of another comm is not this comm's.
    other = _one_rank()
    h = other.register(a)
    with pytest.raises(qccl.InvalidArgumentError, match="not a registration of this comm"):
        c.deregister(h)
    other.deregister(h)
    other.close()
    # Nothing was registered by the failures; the comm still works.
    assert c.registrations()["ranges"] == 0
    c.all_reduce(a)
    c.close()
    with pytest.raises(qccl.InvalidUsageError, match="closed"):
        c.register(a)
    with pytest.raises(qccl.InvalidUsageError, match="closed"):
        c.deregister(1)


def test_a_registered_buffer_is_kept_alive_until_deregistered():
    c = _one_rank()
    a = np.zeros(1000, np.float32)
    ref = weakref.ref(a)
    h = c.register(a)
    assert c.register(a) == h
    del a
    gc.collect()
    assert ref() is not None, "a registered array was freed"
    c.deregister(h)
    gc.collect()
    assert ref() is not None, "freed after the first of two deregistrations"
    c.deregister(h)
    gc.collect()
    assert ref() is None, "still held after its last deregistration"
    # close() ends the registrations and lets go of their buffers.
    b = np.zeros(10, np.int32)
    ref = weakref.ref(b)
    c.register(b)
    del b
    c.close()
    gc.collect()
    assert ref() is None


COUNTS = [1, 1000, 262147]  # the last: a bit over 1 MiB of float32, odd
STEPS = 3


def _value(rank, step, n):
    return ((np.arange(n) * 7 + rank * 5 + step * 3) % 61 - 30).astype(np.float32)


def _registered_collectives(rank, size, uid, ib):
    if ib:
        os.environ.update(QCCL_IB_EMULATE="1", QCCL_NET="IB", QCCL_SHM_DISABLE="1")
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    if ib:
        assert c.transport == "tcp+ib-emulated", c.transport
    bad = []

    def steps(send, recv, what):
        for step in range(STEPS):
            send[:] = _value(rank, step, len(send))
            if recv is not send:
                recv[:] = np.nan
            c.all_reduce(send, None if recv is send else recv)
            want = sum(_value(r, step, len(send)) for r in range(size))
            if not np.array_equal(recv, want):
                bad.append(f"{what}, {len(send)} elements, step {step}")

    for n in COUNTS:
        send = _page_aligned(4 * n, np.float32)
        recv = _page_aligned(4 * n, np.float32)
        hs, hr = c.register(send), c.register(recv)
        steps(send, recv, "registered, out of place")
        steps(send, send, "registered, in place")
        c.deregister(hs)
        steps(send, recv, "recv registered")
        c.deregister(hr)
        # Dropped, then a new array (possibly at the same address) registered and used.
        del send
        gc.collect()
        send = _page_aligned(4 * n, np.float32)
        hs = c.register(send)
        steps(send, recv, "re-registered after free")
        send[:] = _value(rank, 9, n)
        c.broadcast(send, size - 1)
        if not np.array_equal(send, _value(size - 1, 9, n)):
            bad.append(f"broadcast from registered memory, {n} elements")
        c.deregister(hs)
    left = c.registrations()
    c.close()
    return bad, left


@pytest.mark.parametrize("size,ib", [(2, False), (3, True)], ids=["2-default", "3-ib-emulated"])
def test_collectives_on_registered_buffers(size, ib):
    uid = qccl.unique_id()
    for bad, left in run_ranks(_registered_collectives, size, uid, ib):
        assert bad == []
        assert left["ranges"] == 0


def _torch_registered(rank, size, uid):
    import torch

    c = qccl.Comm.init(uid, rank, size, timeout=60)
    t = torch.full((5000,), float(rank + 1), dtype=torch.bfloat16)
    h = c.register(t)
    assert c.register(t) == h
    c.all_reduce(t)
    c.deregister(h)
    c.deregister(h)
    with pytest.raises(qccl.InvalidArgumentError):
        c.deregister(h)
    with pytest.raises(qccl.InvalidArgumentError, match="not contiguous"):
        c.register(torch.zeros(8, 8)[:, 1])
    c.close()
    return float(t[0]), float(t[-1])


def test_torch_tensors_register():
    need("torch")
    uid = qccl.unique_id()
    want = float(sum(range(1, 3)))
    assert run_ranks(_torch_registered, 2, uid) == [(want, want)] * 2
