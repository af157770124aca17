"""qccl.Comm on device buffers: objects with __cuda_array_interface__ (and CUDA torch tensors)
across processes.

Without a GPU the ranks run over the emulated driver (QCCL_GPU_EMULATE, set for the children
only): its device memory faults when host code touches it, so a buffer the binding forgot to
stage crashes the rank instead of passing. The test helpers `_EmuArray` / `_EmuStream` of the
extension exist only there. Results are checked against float64 references of the inputs.

The torch CUDA tests need torch.cuda.is_available(); they skip otherwise, and fail instead with
QCCL_REQUIRE_GPU=1.
"""

import contextlib
import os
import types

import numpy as np
import pytest

import qccl
from conftest import run_ranks

DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32, np.float64]
COUNTS = [0, 1, 131]


@contextlib.contextmanager
def _env(name, value):
    """`name`=`value` for the rank processes started inside (None: unset)."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def emulated(devices):
    """QCCL_GPU_EMULATE=devices for the rank processes started inside (None: unset)."""
    return _env("QCCL_GPU_EMULATE", devices)


def _data(rank, count, dtype):
    return ((np.arange(count) * 3 + rank * 5 + 1) % 7 + 1).astype(dtype)


def _helpers():
    from qccl import _qccl

    assert hasattr(_qccl, "_EmuArray"), "the extension has no emulated-GPU helpers"
    return _qccl._EmuArray, _qccl._EmuStream


def _dev(a, device=0, stream=0):
    """Emulated device memory holding numpy array `a`."""
    EmuArray, _ = _helpers()
    d = EmuArray(a.shape, a.dtype.str, device)
    d.copy_in(a.tobytes(), stream)
    return d


def _host(d, dtype, stream=0):
    return np.frombuffer(d.copy_out(stream), dtype=dtype).copy()


class _Iface:
    """A device array's interface with some keys changed (strides, stream, typestr...)."""

    def __init__(self, arr, **changes):
        ai = dict(arr.__cuda_array_interface__)
        ai.update(changes)
        self.__cuda_array_interface__ = ai
        self.keep = arr


class _FakeCudaTensor:
    """What the binding reads of a CUDA torch tensor, over emulated memory (bfloat16 has no
    CUDA array interface typestr: tensors are its way in)."""

    def __init__(self, arr, numel, dtype="torch.bfloat16"):
        self.keep, self._numel, self.dtype = arr, numel, dtype
        self.device = types.SimpleNamespace(type="cuda")

    def data_ptr(self):
        return self.keep.ptr

    def is_contiguous(self):
        return True

    def numel(self):
        return self._numel


def _bf16(a):
    """float32 values (exact in bfloat16) as bfloat16 bits."""
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _collectives(rank, size, uid):
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    out = {}
    for dt in DTYPES:
        name = np.dtype(dt).name
        for n in COUNTS:
            mine = _data(rank, n, dt)
            d = _dev(mine)
            c.all_reduce(d, op="sum")
            out[("all_reduce", name, n)] = _host(d, dt)
            r = _dev(np.zeros(n, dt))
            algo = c.all_reduce(_dev(mine), r, op="max")
            assert algo is not None
            out[("algo", name, n)] = algo
            out[("all_reduce_max", name, n)] = _host(r, dt)
            # Mixed: host send, device recv.
            r = _dev(np.zeros(n, dt))
            c.all_reduce(mine.copy(), r, op="sum")
            out[("mixed", name, n)] = _host(r, dt)
            g = _dev(np.zeros(n * size, dt))
            c.all_gather(_dev(mine), g)
            out[("all_gather", name, n)] = _host(g, dt)
            rs = _dev(np.zeros(n, dt))
            c.reduce_scatter(_dev(np.concatenate([mine] * size)), rs, op="sum")
            out[("reduce_scatter", name, n)] = _host(rs, dt)
            b = _dev(mine)
            c.broadcast(b, size - 1)
            out[("broadcast", name, n)] = _host(b, dt)
            red = _dev(mine)
            c.reduce(None, red, op="sum", root=0)
            out[("reduce", name, n)] = _host(red, dt) if rank == 0 else None
            send = np.concatenate([_data(rank * size + p, n, dt) for p in range(size)])
            a2a = _dev(np.zeros(n * size, dt))
            c.all_to_all(_dev(send), a2a)
            out[("all_to_all", name, n)] = _host(a2a, dt)
            gat = _dev(np.zeros(n * size, dt)) if rank == 0 else None
            c.gather(_dev(mine), gat, root=0)
            out[("gather", name, n)] = _host(gat, dt) if rank == 0 else None
            sc = _dev(np.zeros(n, dt))
            parts = np.concatenate([_data(r, n, dt) for r in range(size)])
            c.scatter(_dev(parts) if rank == size - 1 else None, sc, root=size - 1)
            out[("scatter", name, n)] = _host(sc, dt)
            if size > 1:
                p2p = _dev(mine)
                if rank == 0:
                    c.send(p2p, 1)
                elif rank == 1:
                    c.recv(p2p, 0)
                out[("p2p", name, n)] = _host(p2p, dt)
    for n in COUNTS:
        # bfloat16 through the CUDA-tensor path.
        bits = _bf16(_data(rank, n, np.float32))
        t = _FakeCudaTensor(_dev(bits), n)
        c.all_reduce(t, op="sum")
        out[("bf16", n)] = _from_bf16(_host(t.keep, np.uint16))
        a = _dev(_data(rank, n, np.float32))
        c.all_reduce(a, op="avg")
        out[("avg", n)] = _host(a, np.float32)
        # Compressed (bit-identical on every rank) and top-k at full density (exact).
        a = _dev(_data(rank, n, np.float32))
        rep = c.all_reduce_compressed(a, "fp16")
        assert rep is not None and rep["algo"]
        out[("fp16", n)] = _host(a, np.float32)
        if n:
            a = _dev(_data(rank, n, np.float32))
            c.topk_all_reduce(a, 1.0, key=f"t{n}", scheme="naiveag", error_feedback=False)
            out[("topk", n)] = _host(a, np.float32)
    # Dense calls of device buffers through the arena so far: the all-gathers and
    # reduce-scatters above of 1 and 131 elements (no stream, no CUDA IPC, 3 ranks).
    out["arena"] = c.device_stats()["through_arena"]
    # An all-reduce past the arena's one-shot fold (3 x 200 KB): through it as well.
    big = _dev(_data(rank, 50_001, np.float32))
    out["big_algo"] = c.all_reduce(big, op="sum")
    out["big"] = _host(big, np.float32)
    out["arena_after"] = c.device_stats()["through_arena"]
    # HiTopKComm without a stream: its top-k on the GPU (one call counted), exact at density 1.
    h = _dev(_data(rank, 131, np.float32))
    calls = c.device_stats()["calls"]
    c.topk_all_reduce(h, 1.0, key="hk", scheme="hitopk", error_feedback=False)
    out["hitopk"] = _host(h, np.float32)
    out["hitopk_gpu"] = c.device_stats()["calls"] - calls
    c.barrier()
    c.close()
    return out


@pytest.mark.parametrize("size,ipc", [(1, False), (3, False), (3, True)])
def test_collectives_on_device_buffers(size, ipc):
    """Every collective on emulated device buffers; with QCCL_CUDA_IPC=1 the dense
    all-reduces of device buffers run over CUDA IPC (the ranks are processes of one machine),
    and those with a host buffer on some rank stage as before."""
    uid = qccl.unique_id()
    with emulated(1), _env("QCCL_CUDA_IPC", "1" if ipc else None):
        res = run_ranks(_collectives, size, uid, timeout=300)
    bad = []
    for dt in DTYPES:
        for n in COUNTS:
            for rank, out in enumerate(res):
                algo = out[("algo", np.dtype(dt).name, n)]
                if (algo == "cuda_ipc") != (ipc and n > 0):
                    bad.append(f"rank {rank}: {np.dtype(dt).name} count {n}: ran {algo}")

    def eq(key, rank, got, exp):
        exp = np.asarray(exp)
        if got is None or got.dtype != exp.dtype or not np.array_equal(got, exp):
            bad.append(f"rank {rank}: {key}: got {got} expected {exp}")

    for dt in DTYPES:
        name = np.dtype(dt).name
        for n in COUNTS:
            parts = [_data(r, n, dt).astype(np.float64) for r in range(size)]
            total = np.sum(parts, axis=0) if n else np.zeros(0)
            cast = lambda x: np.asarray(x).astype(dt)  # noqa: E731
            for rank, out in enumerate(res):
                eq(("all_reduce", name, n), rank, out[("all_reduce", name, n)], cast(total))
                eq(("mixed", name, n), rank, out[("mixed", name, n)], cast(total))
                mx = np.max(parts, axis=0) if n else np.zeros(0)
                eq(("all_reduce_max", name, n), rank, out[("all_reduce_max", name, n)], cast(mx))
                eq(("all_gather", name, n), rank, out[("all_gather", name, n)], cast(np.concatenate(parts)))
                eq(("reduce_scatter", name, n), rank, out[("reduce_scatter", name, n)], cast(total))
                eq(("broadcast", name, n), rank, out[("broadcast", name, n)], cast(parts[size - 1]))
                if rank == 0:
                    eq(("reduce", name, n), rank, out[("reduce", name, n)], cast(total))
                    eq(("gather", name, n), rank, out[("gather", name, n)], cast(np.concatenate(parts)))
                a2a = [_data(p * size + rank, n, dt) for p in range(size)]
                eq(("all_to_all", name, n), rank, out[("all_to_all", name, n)], cast(np.concatenate(a2a)))
                eq(("scatter", name, n), rank, out[("scatter", name, n)], cast(parts[rank]))
                if size > 1 and rank == 1:
                    eq(("p2p", name, n), rank, out[("p2p", name, n)], cast(parts[0]))
    for n in COUNTS:
        parts = [_data(r, n, np.float32).astype(np.float64) for r in range(size)]
        total = np.sum(parts, axis=0) if n else np.zeros(0)
        for rank, out in enumerate(res):
            eq(("bf16", n), rank, out[("bf16", n)], total.astype(np.float32))
            eq(("avg", n), rank, out[("avg", n)], (total / size).astype(np.float32))
            # fp16 carries these small integers exactly.
            eq(("fp16", n), rank, out[("fp16", n)], total.astype(np.float32))
            if n:
                eq(("topk", n), rank, out[("topk", n)], total.astype(np.float32))
    through = size > 1 and not ipc
    big = np.sum([_data(r, 50_001, np.float32).astype(np.float64) for r in range(size)], axis=0)
    hk = np.sum([_data(r, 131, np.float32).astype(np.float64) for r in range(size)], axis=0)
    for rank, out in enumerate(res):
        eq("hitopk", rank, out["hitopk"], hk.astype(np.float32))
        if out["hitopk_gpu"] != 1:
            bad.append(f"rank {rank}: HiTopK ran {out['hitopk_gpu']} calls with the top-k on the GPU")
    for rank, out in enumerate(res):
        # 9 dtypes x counts 1 and 131 x (all-gather, reduce-scatter).
        if out["arena"] != (36 if through else 0) or out["arena_after"] != out["arena"] + through:
            bad.append(f"rank {rank}: {out['arena']}, then {out['arena_after']} calls through the arena")
        want = "cuda_ipc" if ipc else ("sra" if size > 1 else None)
        if want is not None and out["big_algo"] != want:
            bad.append(f"rank {rank}: the large all-reduce ran {out['big_algo']}, not {want}")
        eq("big", rank, out["big"], big.astype(np.float32))
    assert not bad, "\n".join(bad[:20])


def _streams(rank, size, uid):
    """Calls on a stream of the caller's: enqueued and returning at once (None), ordered
    after the stream's earlier work and before its later work."""
    _, EmuStream = _helpers()
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    s = EmuStream()
    out = {}
    for n in COUNTS:
        a = _dev(np.zeros(n, np.float32))
        a.copy_in(_data(rank, n, np.float32).tobytes(), s.handle)
        assert c.all_reduce(a, op="sum", stream=s.handle) is None
        out[("explicit", n)] = _host(a, np.float32, s.handle)
        # The stream named by the v3 interface.
        b = _dev(_data(rank, n, np.float64))
        assert c.all_reduce(_Iface(b, stream=s.handle), op="max") is None
        s.synchronize()
        out[("v3", n)] = _host(b, np.float64)
        # stream=0: the legacy default stream, complete on return.
        g = _dev(np.zeros(n * size, np.int32))
        c.all_gather(_dev(_data(rank, n, np.int32)), g, stream=0)
        out[("null", n)] = _host(g, np.int32)
        # Host buffers with a stream (a driver is there): the call waits, then returns.
        h = _data(rank, n, np.int64)
        c.all_reduce(h, op="sum", stream=s.handle)
        out[("host", n)] = h
        # The buffer must outlive the stream's pass over the call (NCCL's contract).
        f = _dev(_data(rank, n, np.float32))
        assert c.all_reduce_compressed(f, "fp16", stream=s.handle) is None
        out[("fp16", n)] = _host(f, np.float32, s.handle)
    s.synchronize()
    assert c.async_error() is None
    c.close()
    return out


@pytest.mark.parametrize("size", [1, 3])
def test_stream_calls_enqueue(size):
    uid = qccl.unique_id()
    with emulated(1):
        res = run_ranks(_streams, size, uid, timeout=180)
    for n in COUNTS:
        parts = [_data(r, n, np.float64) for r in range(size)]
        total = np.sum(parts, axis=0) if n else np.zeros(0)
        for rank, out in enumerate(res):
            np.testing.assert_array_equal(out[("explicit", n)], total.astype(np.float32))
            np.testing.assert_array_equal(out[("v3", n)], np.max(parts, axis=0) if n else np.zeros(0))
            np.testing.assert_array_equal(
                out[("null", n)], np.concatenate([_data(r, n, np.int32) for r in range(size)])
            )
            np.testing.assert_array_equal(out[("host", n)], total.astype(np.int64))
            np.testing.assert_array_equal(out[("fp16", n)], total.astype(np.float32))


def _across_hosts(rank, size, uid):
    """Dense all-reduces of device arrays on 2 emulated hosts (the hierarchical route): with
    no stream, on a stream (its copy in enqueued just before) and out of place."""
    os.environ["QCCL_HOSTID"] = f"emuhost{rank % 2}"
    os.environ["QCCL_CHUNKSIZE"] = "16384"
    _, EmuStream = _helpers()
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    s = EmuStream()
    out = {}
    for dt in (np.float32, np.float16, np.int64):
        for n in (1, 131, 50_001):
            a = _dev(_data(rank, n, dt))
            c.all_reduce(a, op="sum")
            out[("null", np.dtype(dt).name, n)] = _host(a, dt)
            b = _dev(np.zeros(n, dt))
            b.copy_in(_data(rank, n, dt).tobytes(), s.handle)
            assert c.all_reduce(b, op="max", stream=s.handle) is None
            out[("stream", np.dtype(dt).name, n)] = _host(b, dt, s.handle)
    # A compressed one on a stream: float32 on the hierarchical route runs its codecs on the
    # GPU, enqueued (not staged in bands).
    coded = c.device_stats()["calls"]
    d = _dev(np.zeros(50_001, np.float32))
    d.copy_in(_data(rank, 50_001, np.float32).tobytes(), s.handle)
    assert c.all_reduce_compressed(d, "fp16", key="coded", stream=s.handle) is None
    out["coded"] = _host(d, np.float32, s.handle)
    out["coded_on_gpu"] = c.device_stats()["calls"] - coded
    # HiTopK on the stream (float32): its top-k on the GPU too, enqueued.
    stats = c.device_stats()
    t = _dev(np.zeros(50_001, np.float32))
    t.copy_in(_data(rank, 50_001, np.float32).tobytes(), s.handle)
    assert c.topk_all_reduce(t, 0.01, key="tk", scheme="hitopk", stream=s.handle) is None
    out["hitopk"] = _host(t, np.float32, s.handle)
    after = c.device_stats()
    out["hitopk_on_gpu"] = (after["calls"] - stats["calls"], after["enqueued"] - stats["enqueued"])
    # Reduce-scatter and all-gather across hosts (the ring), on the stream: in bands too.
    m = 20_011
    x = _dev(_data(rank, m * size, np.float32))
    y = _dev(np.zeros(m, np.float32))
    c.reduce_scatter(x, y, stream=s.handle)
    out["rs"] = _host(y, np.float32, s.handle)
    g = _dev(np.zeros(m * size, np.float32))
    mine = _dev(_data(rank, m, np.float32))  # alive until the stream passed the call
    c.all_gather(mine, g, stream=s.handle)
    out["ag"] = _host(g, np.float32, s.handle)
    # Broadcast and reduce (the chain, on any links): in bands of its slices too, on the
    # stream and with none.
    z = _dev(_data(rank, m, np.float32))
    c.broadcast(z, 1, stream=s.handle)
    out["bcast"] = _host(z, np.float32, s.handle)
    r_in, r_out = _dev(_data(rank, m, np.float32)), _dev(np.zeros(m, np.float32))
    c.reduce(r_in, r_out, op="sum", root=2)
    out["reduce"] = _host(r_out, np.float32)
    s.synchronize()
    out["bands"] = c.device_stats()["piecewise"]
    assert c.async_error() is None
    c.close()
    return out


def test_dense_calls_across_hosts_stage_in_bands():
    size = 4
    uid = qccl.unique_id()
    with emulated(1):
        res = run_ranks(_across_hosts, size, uid, timeout=180)
    for dt in (np.float32, np.float16, np.int64):
        for n in (1, 131, 50_001):
            parts = [_data(r, n, dt).astype(np.float64) for r in range(size)]
            name = np.dtype(dt).name
            for rank, out in enumerate(res):
                want = np.sum(parts, axis=0).astype(dt)
                np.testing.assert_array_equal(out[("null", name, n)], want, err_msg=f"{name} {n}")
                want = np.max(parts, axis=0).astype(dt)
                np.testing.assert_array_equal(out[("stream", name, n)], want, err_msg=f"{name} {n}")
    want = np.sum([_data(r, 50_001, np.float64) for r in range(size)], axis=0)
    for out in res:
        assert out["coded"].tobytes() == res[0]["coded"].tobytes()
        np.testing.assert_allclose(out["coded"], want, rtol=1 / 256, atol=np.abs(want).max() / 256)
    m = 20_011
    total = np.sum([_data(r, m * size, np.float64) for r in range(size)], axis=0)
    gathered = np.concatenate([_data(r, m, np.float32) for r in range(size)])
    for rank, out in enumerate(res):
        np.testing.assert_array_equal(out["rs"], total[rank * m : (rank + 1) * m].astype(np.float32))
        np.testing.assert_array_equal(out["ag"], gathered)
        np.testing.assert_array_equal(out["bcast"], _data(1, m, np.float32))
        summed = np.sum([_data(r, m, np.float64) for r in range(size)], axis=0)
        reduced = summed.astype(np.float32) if rank == 2 else np.zeros(m, np.float32)
        np.testing.assert_array_equal(out["reduce"], reduced)
    # Every dense call took the path: 3 dtypes x 3 counts x (no stream, stream), the
    # reduce-scatter, the all-gather, the broadcast and the reduce; the compressed one ran
    # its codecs on the GPU.
    assert [out["bands"] for out in res] == [22] * size
    assert [out["coded_on_gpu"] for out in res] == [1] * size
    for out in res:
        assert out["hitopk"].tobytes() == res[0]["hitopk"].tobytes()
        assert out["hitopk_on_gpu"] == (1, 1)
    assert np.count_nonzero(res[0]["hitopk"]) > 0


def _coded(rank, size, uid):
    """Compressed all-reduces with the codecs on the GPU (flat SRA, float32, device buffers),
    rank 0 on host memory: every rank ends with the same bytes."""
    _, EmuStream = _helpers()
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    s = EmuStream()
    out = []
    n = 4099
    for i, (spec, stream) in enumerate([("fp16", 0), ("qsgd:bits=4,bucket=128", s.handle)] * 2):
        x = (_data(rank, n, np.float32) / 7 + i).astype(np.float32)
        if rank == 0:
            c.all_reduce_compressed(x, spec, key="layer0", algo="sra")
            out.append(x.tobytes())
        else:
            a = _dev(x)
            c.all_reduce_compressed(a, spec, key="layer0", algo="sra", stream=stream)
            out.append(_host(a, np.float32, stream).tobytes())
    s.synchronize()
    stats = c.device_stats()
    # The naive all-gather top-k is a compressed all-reduce (MSTopK, the all-gather scheme):
    # on device buffers its codec runs on the GPU, one exchange.
    topk = []
    for i in range(2):
        x = (_data(rank, n, np.float32) / 3 - i).astype(np.float32)
        if rank == 0:
            rep = c.topk_all_reduce(x, 0.1, key="tk", scheme="naiveag")
            topk.append(x.tobytes())
        else:
            a = _dev(x)
            rep = c.topk_all_reduce(a, 0.1, key="tk", scheme="naiveag")
            topk.append(_host(a, np.float32).tobytes())
        assert rep["algo"] == "naiveag" and rep["k"] == 410, rep
    after = c.device_stats()
    assert c.async_error() is None
    c.close()
    return out, stats, topk, (after["calls"] - stats["calls"], after["exchanges"] - stats["exchanges"])


def test_compressed_calls_run_their_codecs_on_the_gpu():
    size = 3
    uid = qccl.unique_id()
    with emulated(1):
        res = run_ranks(_coded, size, uid, timeout=180)
    for rank, (out, stats, topk, topk_stats) in enumerate(res):
        assert out == res[0][0], f"rank {rank} differs from rank 0"
        assert topk == res[0][2], f"rank {rank}'s top-k differs from rank 0's"
        assert topk_stats == ((0, 0) if rank == 0 else (2, 2)), (rank, topk_stats)
        want = {"calls": 0} if rank == 0 else {"calls": 4}
        assert stats["calls"] == want["calls"], (rank, stats)
        if rank:
            assert stats["to_host"] > 0 and stats["to_device"] > 0, stats
            # Two exchanges (scatter, gather) per slice, at least one slice per call.
            assert stats["exchanges"] >= 2 * 4 and stats["exchanges"] % 2 == 0, stats
            assert 0 <= stats["overlapped"] <= stats["exchanges"], stats
    n = 4099
    for i, got in enumerate(res[0][0]):
        total = np.sum([(_data(r, n, np.float32) / 7 + i).astype(np.float64) for r in range(size)], axis=0)
        got = np.frombuffer(got, np.float32)
        assert np.max(np.abs(got - total)) <= 0.1 * (1 + np.max(np.abs(total))), i
    # The first top-k call (no residual yet): every element is the float32 sum, in rank order
    # from zero, of the inputs of the ranks that selected it, each rank selecting at most k.
    xs = [(_data(r, n, np.float32) / 3).astype(np.float32) for r in range(size)]
    got = np.frombuffer(res[0][2][0], np.float32)
    sums = []
    for mask in range(1 << size):
        acc = np.zeros(n, np.float32)
        for r in range(size):
            if mask >> r & 1:
                acc = (acc + xs[r]).astype(np.float32)
        sums.append(acc)
    assert np.all(np.any(np.stack(sums) == got, axis=0)), "a top-k element is no sum of inputs"
    assert 0 < np.count_nonzero(got) <= size * 410, np.count_nonzero(got)


def _async_failure(rank, size, uid):
    """Ranks that disagree on a call enqueued on a stream: both calls return at once, the
    stream is still released, and the comm's failure surfaces through async_error."""
    _, EmuStream = _helpers()
    c = qccl.Comm.init(uid, rank, size, timeout=20)
    s = EmuStream()
    a = _dev(np.ones(4 + rank, np.float32))
    assert c.all_reduce(a, stream=s.handle) is None
    s.synchronize(60)
    # The stream is released only once the comm recorded its failure.
    err = c.async_error()
    try:
        c.all_reduce(_dev(np.ones(4, np.float32)))
        later = None
    except qccl.QcclError as e:
        later = str(e)
    c.close()
    return err, later


def test_stream_call_failure_surfaces_through_async_error():
    uid = qccl.unique_id()
    with emulated(1):
        res = run_ranks(_async_failure, 2, uid, timeout=120)
    for rank, (err, later) in enumerate(res):
        assert err and "disagree" in err, f"rank {rank}: async error {err!r}"
        assert later, f"rank {rank}: a call on the failed comm did not raise"


def _errors(rank, size, uid):
    EmuArray, EmuStream = _helpers()
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    a = _dev(_data(rank, 6, np.float32))
    msgs = {}

    def expect(name, cls, fn):
        try:
            fn()
        except cls as e:
            msgs[name] = str(e)
            return
        raise AssertionError(f"{name}: no {cls.__name__}")

    expect("noncontig", qccl.InvalidArgumentError, lambda: c.all_reduce(_Iface(a, shape=(2, 3), strides=(4, 8))))
    expect("dtype", qccl.InvalidArgumentError, lambda: c.all_reduce(a, _dev(np.zeros(6, np.float64))))
    expect("typestr", qccl.UnsupportedError, lambda: c.all_reduce(_Iface(a, typestr="<c8", shape=(3,))))
    expect("readonly", qccl.InvalidArgumentError, lambda: c.all_reduce(_Iface(a, data=(a.ptr, True))))
    expect("stream0", qccl.InvalidArgumentError, lambda: c.all_reduce(_Iface(a, stream=0)))
    s1, s2 = EmuStream(), EmuStream()
    expect(
        "two streams",
        qccl.InvalidArgumentError,
        lambda: c.all_reduce(_Iface(a, stream=s1.handle), _Iface(_dev(np.zeros(6, np.float32)), stream=s2.handle)),
    )
    expect("bad stream", qccl.InvalidArgumentError, lambda: c.all_reduce(a, stream=12345))
    expect("stream type", qccl.InvalidArgumentError, lambda: c.all_reduce(a, stream="s"))
    other = EmuArray((6,), "<f4", 1)
    expect("two devices", qccl.InvalidArgumentError, lambda: c.all_reduce(a, other))
    expect("count", qccl.InvalidArgumentError, lambda: c.all_reduce(a, _dev(np.zeros(5, np.float32))))
    expect("register", qccl.UnsupportedError, lambda: c.register(a))
    # The comm still works.
    c.all_reduce(a, op="sum")
    got = _host(a, np.float32)
    c.close()
    return msgs, got


def test_device_errors():
    uid = qccl.unique_id()
    with emulated(2):
        [(msgs, got)] = run_ranks(_errors, 1, uid)
    assert "not C-contiguous" in msgs["noncontig"]
    assert "one element type" in msgs["dtype"]
    assert "'<c8'" in msgs["typestr"]
    assert "read-only" in msgs["readonly"]
    assert "stream" in msgs["stream0"]
    assert "two streams" in msgs["two streams"]
    assert "stream" in msgs["bad stream"]
    assert "cudaStream_t" in msgs["stream type"]
    assert "two devices" in msgs["two devices"]
    assert "all_reduce" in msgs["count"]
    assert "device buffers" in msgs["register"]
    np.testing.assert_array_equal(got, _data(0, 6, np.float32))


def _no_driver(rank, size, uid):
    from qccl import _qccl

    c = qccl.Comm.init(uid, rank, size, timeout=60)
    msgs = {}
    if _qccl._gpu_driver() is None:
        try:
            c.all_reduce(np.ones(4, np.float32), stream=1234)
        except qccl.UnsupportedError as e:
            msgs["host stream"] = str(e)

        class Fake:
            __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

        # Refused unread (its pointer is no memory of this process).
        try:
            c.all_reduce(Fake())
        except qccl.UnsupportedError as e:
            msgs["device"] = str(e)
    # Host calls are untouched, stream=0 included.
    h = np.ones(4, np.float32)
    c.all_reduce(h, stream=0)
    c.close()
    return _qccl._gpu_driver(), msgs, h


def test_without_a_driver_streams_and_cuda_arrays_are_refused():
    uid = qccl.unique_id()
    with emulated(None):
        [(driver, msgs, h)] = run_ranks(_no_driver, 1, uid)
    np.testing.assert_array_equal(h, np.ones(4, np.float32))
    if driver is None:  # CI: no GPU
        assert "host buffers take no stream" in msgs["host stream"]
        assert "no CUDA device can be used" in msgs["device"]


# ---- torch CUDA tensors (a GPU) ------------------------------------------------------------


def _need_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        if os.environ.get("QCCL_REQUIRE_GPU") == "1":
            pytest.fail("QCCL_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
        pytest.skip("needs an NVIDIA GPU and a CUDA build of torch")
    return torch


def _torch_comm(rank, size, uid):
    import torch

    c = qccl.Comm.init(uid, rank, size, timeout=60)
    dev = torch.device("cuda", 0)
    out = {}
    for dt in [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]:
        for n in COUNTS:
            t = ((torch.arange(n, device=dev) * 3 + rank * 5 + 1) % 7 + 1).to(dt)
            c.all_reduce(t, op="sum")
            # numpy, not torch tensors: a child's tensors travel as shared file descriptors
            # that vanish when it exits.
            out[(str(dt), n)] = t.cpu().double().numpy()
            s = torch.cuda.Stream(dev)
            u = ((torch.arange(n, device=dev) * 3 + rank * 5 + 1) % 7 + 1).to(dt)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                c.all_reduce(u, op="max", stream=s.cuda_stream)
                v = u * 1
            s.synchronize()
            out[(str(dt), n, "stream")] = v.cpu().double().numpy()
    c.close()
    return out


@pytest.mark.parametrize("size", [1, 3])
def test_torch_cuda_tensors_on_comm(size):
    torch = _need_cuda()
    uid = qccl.unique_id()
    res = run_ranks(_torch_comm, size, uid, timeout=300)
    for n in COUNTS:
        parts = [((torch.arange(n) * 3 + r * 5 + 1) % 7 + 1).double() for r in range(size)]
        total = sum(parts) if n else torch.zeros(0, dtype=torch.float64)
        mx = torch.stack(parts).max(0).values if n else torch.zeros(0, dtype=torch.float64)
        for out in res:
            for dt in ["torch.float32", "torch.float16", "torch.bfloat16", "torch.int32", "torch.int64", "torch.uint8"]:
                np.testing.assert_array_equal(out[(dt, n)], total.numpy(), err_msg=f"{dt} {n}")
                np.testing.assert_array_equal(out[(dt, n, "stream")], mx.numpy(), err_msg=f"{dt} {n}")


def test_backend_registers_cpu_and_cuda():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import qccl.torch  # noqa: F401

    caps = getattr(dist.Backend, "backend_capability", None)
    if caps is None or "qccl" not in caps:
        pytest.skip("this torch does not record a backend's devices")
    assert set(caps["qccl"]) == {"cpu", "cuda"}, caps["qccl"]
    assert torch is not None


def _dist_cuda(rank, size, init):
    """dist.* on CUDA tensors: enqueued on the current stream (NCCL's semantics)."""
    import datetime

    import torch
    import torch.distributed as dist

    import qccl.torch  # noqa: F401

    dist.init_process_group("qccl", init_method=init, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    bad = []

    def eq(name, got, exp):
        if not torch.equal(got.cpu().double(), exp.double()):
            bad.append(f"rank {rank}: {name}: got {got.tolist()} expected {exp.tolist()}")

    for dt in [torch.float32, torch.bfloat16, torch.int64]:
        for n in COUNTS:
            parts = [((torch.arange(n) * 3 + r * 5 + 1) % 7 + 1).to(dt) for r in range(size)]
            total = sum(p.double() for p in parts) if n else torch.zeros(0, dtype=torch.float64)
            t = parts[rank].to(dev)
            dist.all_reduce(t)
            eq(f"all_reduce {dt} {n}", t, total)
            # async: wait() orders the current stream after the call; the future completes.
            u = parts[rank].to(dev)
            w = dist.all_reduce(u, async_op=True)
            w.wait()
            eq(f"async {dt} {n}", u * 1, total)
            fut = dist.all_reduce(parts[rank].to(dev), async_op=True).get_future()
            eq(f"future {dt} {n}", fut.wait()[0], total)
            out = torch.empty(n * size, dtype=dt, device=dev)
            dist.all_gather_into_tensor(out, parts[rank].to(dev))
            eq(f"all_gather {dt} {n}", out, torch.cat(parts).double())
            b = parts[rank].to(dev)
            dist.broadcast(b, src=size - 1)
            eq(f"broadcast {dt} {n}", b, parts[size - 1].double())
    # Work queued behind a long kernel on the current stream still sees its result.
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    torch.cuda._sleep(50_000_000)
    x.mul_(2)
    dist.all_reduce(x)
    eq("ordered", x[:4], torch.full((4,), float(size * (size + 1))))
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("size", [1, 3])
def test_dist_on_cuda_tensors(size, tmp_path):
    _need_cuda()
    res = run_ranks(_dist_cuda, size, f"file://{tmp_path}/rendezvous", timeout=300)
    problems = [p for r in res for p in r]
    assert not problems, "\n".join(problems[:20])


class _TorchWithFakeCuda:
    """`torch` as qccl.torch sees it, with `torch.cuda` standing in over an emulated stream."""

    def __init__(self, torch, cuda):
        self._torch, self.cuda = torch, cuda

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _backend_cuda_branch(rank, size, init):
    """The backend's CUDA branch (`_call`, `_CudaWork`, every collective's `run(stream=)`) run
    with CPU tensors on a stream of the emulated driver: torch.cuda is replaced inside
    qccl.torch only, so what is checked is the branch's Python and the stream it hands qccl,
    not CUDA tensors (those need a GPU)."""
    import datetime

    import torch
    import torch.distributed as dist

    import qccl.torch as qt

    _, EmuStream = _helpers()
    s = EmuStream()
    log = []

    class Stream:
        cuda_stream = s.handle

        def wait_event(self, ev):
            log.append("wait_event")

    class Event:
        def record(self, stream):
            log.append("record")

        def query(self):
            s.synchronize()
            return True

        def synchronize(self):
            s.synchronize()

    cuda = types.SimpleNamespace(
        current_stream=lambda device=None: Stream(),
        device=lambda d: contextlib.nullcontext(),
        Event=Event,
    )
    qt.torch = _TorchWithFakeCuda(torch, cuda)
    check = qt._check_device
    qt._check_device = lambda coll, ts: (check(coll, ts), "fake-cuda")[1]
    dist.init_process_group("qccl", init_method=init, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    bad = []

    def eq(name, got, exp):
        if not torch.equal(got.double(), exp.double()):
            bad.append(f"rank {rank}: {name}: got {got.tolist()} expected {exp.tolist()}")

    for n in COUNTS:
        parts = [((torch.arange(n) * 3 + r * 5 + 1) % 7 + 1).float() for r in range(size)]
        total = sum(parts) if n else torch.zeros(0)
        t = parts[rank].clone()
        w = dist.all_reduce(t, async_op=True)
        assert isinstance(w, qt._CudaWork)
        w.wait()
        assert w.is_completed() and w.is_success()
        eq(f"all_reduce {n}", t, total)
        fut = dist.all_reduce(parts[rank].clone(), async_op=True).get_future()
        eq(f"future {n}", fut.wait()[0], total)
        out = torch.empty(n * size)
        dist.all_gather_into_tensor(out, parts[rank])
        eq(f"all_gather_into_tensor {n}", out, torch.cat(parts))
        outs = [torch.empty(n) for _ in range(size)]
        dist.all_gather(outs, parts[rank])
        eq(f"all_gather {n}", torch.cat(outs), torch.cat(parts))
        b = parts[rank].clone()
        dist.broadcast(b, src=size - 1)
        eq(f"broadcast {n}", b, parts[size - 1])
        rs = torch.empty(n)
        dist.reduce_scatter_tensor(rs, torch.cat([parts[rank]] * size))
        eq(f"reduce_scatter_tensor {n}", rs, total)
        r = parts[rank].clone()
        dist.reduce(r, dst=0)
        if rank == 0:
            eq(f"reduce {n}", r, total)
        a2a = torch.empty(n * size)
        dist.all_to_all_single(a2a, torch.cat([parts[rank] + p for p in range(size)]))
        eq(f"all_to_all_single {n}", a2a, torch.cat([parts[p] + rank for p in range(size)]))
        gl = [torch.empty(n) for _ in range(size)] if rank == 0 else None
        dist.gather(parts[rank], gl, dst=0)
        if rank == 0:
            eq(f"gather {n}", torch.cat(gl), torch.cat(parts))
        sc = torch.empty(n)
        dist.scatter(sc, list(parts) if rank == 0 else None, src=0)
        eq(f"scatter {n}", sc, parts[rank])
        if size > 1 and rank < 2:
            p = parts[rank].clone()
            if rank == 0:
                dist.send(p, 1)
            else:
                dist.recv(p, 0)
                eq(f"send/recv {n}", p, parts[0])
    s.synchronize()
    dist.destroy_process_group()
    assert "wait_event" in log and "record" in log
    return bad


@pytest.mark.parametrize("size", [1, 3])
def test_backend_cuda_branch_over_an_emulated_stream(size, tmp_path):
    pytest.importorskip("torch")
    with emulated(1):
        res = run_ranks(_backend_cuda_branch, size, f"file://{tmp_path}/rendezvous", timeout=300)
    problems = [p for r in res for p in r]
    assert not problems, "\n".join(problems[:20])
