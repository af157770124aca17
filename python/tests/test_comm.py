"""qccl.Comm over numpy arrays and torch tensors, across processes."""

import numpy as np
import pytest

import qccl
from conftest import need, run_ranks

DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32, np.float64]
COUNTS = [0, 1, 7, 13]


def _data(rank, count, dtype):
    return ((np.arange(count) * 3 + rank * 5 + 1) % 7 + 1).astype(dtype)


def _collectives(rank, size, uid):
    c = qccl.Comm.init(uid, rank, size, timeout=60)
    assert (c.rank, c.size) == (rank, size)
    out = {}
    for dt in DTYPES:
        for n in COUNTS:
            parts = [_data(r, n, dt) for r in range(size)]
            for op in ["sum", "prod", "max", "min"]:
                a = _data(rank, n, dt)
                c.all_reduce(a, op=op)
                out[("all_reduce", dt.__name__, n, op)] = a
            r = np.empty(n, dt)
            c.all_reduce(_data(rank, n, dt), r, op=qccl.ReduceOp.MAX)
            out[("all_reduce_oop", dt.__name__, n)] = r
            g = np.empty(n * size, dt)
            c.all_gather(parts[rank], g)
            out[("all_gather", dt.__name__, n)] = g
            rs = np.empty(n, dt)
            c.reduce_scatter(np.concatenate([_data(rank, n, dt)] * size), rs, op="sum")
            out[("reduce_scatter", dt.__name__, n)] = rs
            b = _data(rank, n, dt)
            c.broadcast(b, size - 1)
            out[("broadcast", dt.__name__, n)] = b
            red = _data(rank, n, dt)
            c.reduce(None, red, op="sum", root=0)
            out[("reduce", dt.__name__, n)] = red if rank == 0 else None
            send = np.concatenate([_data(rank * size + p, n, dt) for p in range(size)]) if n else np.empty(0, dt)
            a2a = np.empty(n * size, dt)
            c.all_to_all(send, a2a)
            out[("all_to_all", dt.__name__, n)] = a2a
            gat = np.empty(n * size, dt) if rank == 0 else None
            c.gather(parts[rank], gat, root=0)
            out[("gather", dt.__name__, n)] = gat
            sc = np.empty(n, dt)
            c.scatter(np.concatenate(parts) if rank == size - 1 else None, sc, root=size - 1)
            out[("scatter", dt.__name__, n)] = sc
    for n in COUNTS:
        a = _data(rank, n, np.float32)
        c.all_reduce(a, op="avg")
        out[("avg", n)] = a
    if size > 1:
        buf = np.arange(5, dtype=np.float64) + rank
        if rank == 0:
            c.send(buf, 1)
        elif rank == 1:
            c.recv(buf, 0)
        out["p2p"] = buf
    c.barrier()
    c.close()
    return out


def _wrap_prod(parts, dt):
    acc = np.ones_like(parts[0])
    for p in parts:
        acc = (acc * p).astype(dt)
    return acc


@pytest.mark.parametrize("size", [1, 2, 3])
def test_collectives_exact(size):
    uid = qccl.unique_id()
    res = run_ranks(_collectives, size, uid)
    for dt in DTYPES:
        for n in COUNTS:
            parts = [_data(r, n, dt) for r in range(size)]
            with np.errstate(over="ignore"):
                exp = {
                    "sum": np.sum(np.stack(parts), axis=0, dtype=dt) if n else np.empty(0, dt),
                    "prod": _wrap_prod(parts, dt),
                    "max": np.max(np.stack(parts), axis=0),
                    "min": np.min(np.stack(parts), axis=0),
                }
            for rank, out in enumerate(res):
                for op, e in exp.items():
                    np.testing.assert_array_equal(out[("all_reduce", dt.__name__, n, op)], e, err_msg=f"{op} {dt} {n}")
                np.testing.assert_array_equal(out[("all_reduce_oop", dt.__name__, n)], exp["max"])
                np.testing.assert_array_equal(out[("all_gather", dt.__name__, n)], np.concatenate(parts))
                rs_exp = np.sum(np.stack([np.concatenate([p] * size) for p in parts]), axis=0, dtype=dt)[
                    rank * n : (rank + 1) * n
                ] if n else np.empty(0, dt)
                np.testing.assert_array_equal(out[("reduce_scatter", dt.__name__, n)], rs_exp)
                np.testing.assert_array_equal(out[("broadcast", dt.__name__, n)], parts[size - 1])
                if rank == 0:
                    np.testing.assert_array_equal(out[("reduce", dt.__name__, n)], exp["sum"])
                    np.testing.assert_array_equal(out[("gather", dt.__name__, n)], np.concatenate(parts))
                a2a_exp = np.concatenate([_data(q * size + rank, n, dt) for q in range(size)]) if n else np.empty(0, dt)
                np.testing.assert_array_equal(out[("all_to_all", dt.__name__, n)], a2a_exp)
                np.testing.assert_array_equal(out[("scatter", dt.__name__, n)], parts[rank])
    for n in COUNTS:
        fparts = np.stack([_data(r, n, np.float32) for r in range(size)])
        for out in res:
            np.testing.assert_allclose(out[("avg", n)], fparts.mean(axis=0) if n else np.empty(0), rtol=1e-6)
    if size > 1:
        np.testing.assert_array_equal(res[1]["p2p"], np.arange(5, dtype=np.float64))


def _torch_and_compressed(rank, size, uid):
    import torch

    c = qccl.Comm.init(uid, rank, size, timeout=60)
    out = {}
    t = torch.arange(10, dtype=torch.bfloat16) + rank
    c.all_reduce(t)
    out["bf16"] = t.float().tolist()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
    c.all_reduce(t, op="max")
    out["2d"] = t.tolist()
    g = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    rep = c.all_reduce_compressed(g, "qsgd:bits=4,bucket=128", op="avg", key="w")
    out["qsgd"] = g.numpy().tobytes()
    out["qsgd_sent"] = rep["sent"]
    h = torch.randn(4096, generator=torch.Generator().manual_seed(10 + rank))
    rep = c.topk_all_reduce(h, 0.05, key="h")
    out["topk"] = h.numpy().tobytes()
    out["topk_k"] = rep["k"]
    c.set_layout("l", [("w", 4000), ("fc.bias", 96)])
    lb = torch.randn(4096, generator=torch.Generator().manual_seed(20 + rank))
    c.all_reduce_compressed(lb, "topk:density=0.01,ef=1", key="l")
    out["layout"] = lb.numpy().tobytes()
    assert c.remove_layout("l") and not c.remove_layout("l")
    assert c.forget_residual("h") in (True, False)
    sub = c.split(rank % 2, rank)
    x = np.array([rank], np.int64)
    sub.all_reduce(x)
    out["split"] = (sub.size, int(x[0]))
    sub.close()
    c.close()
    return out


def test_torch_tensors_compressed_topk_split():
    need("torch")
    size = 3
    res = run_ranks(_torch_and_compressed, size, qccl.unique_id())
    for out in res:
        assert out["bf16"] == [float(3 * i + 3) for i in range(10)]
        assert out["2d"] == [[0.0, 3.0, 6.0], [9.0, 12.0, 15.0]]
        assert out["qsgd_sent"] > 0
        assert out["topk_k"] > 0
    for key in ["qsgd", "topk", "layout"]:
        assert len({o[key] for o in res}) == 1, f"{key}: ranks differ"
    # qsgd 4 bits stays near the exact mean.
    import torch

    exact = sum(torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(size)) / size
    got = np.frombuffer(res[0]["qsgd"], np.float32)
    assert np.abs(got - exact.numpy()).max() < 0.5
    assert [o["split"] for o in res] == [(2, 2), (1, 1), (2, 2)]
    # The layer named like a bias (QCCL_COMPRESSION_EXCLUDE's default) travelled in f32: its
    # part is the exact sum; the top-k layer is sparse.
    exact = sum(torch.randn(4096, generator=torch.Generator().manual_seed(20 + r)) for r in range(size)).numpy()
    got = np.frombuffer(res[0]["layout"], np.float32)
    np.testing.assert_allclose(got[4000:], exact[4000:], rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(got[:4000]) < 4000 // 4


def _errors(rank, size, uid):
    c = qccl.Comm.init(uid, rank, size, timeout=30)
    msgs = {}

    def catch(name, exc, f):
        with pytest.raises(exc) as e:
            f()
        msgs[name] = str(e.value)

    catch("bool", qccl.UnsupportedError, lambda: c.all_reduce(np.zeros(3, np.bool_)))
    catch("noncontig", qccl.InvalidArgumentError, lambda: c.all_reduce(np.zeros((4, 4), np.float32)[:, 1]))
    catch("size", qccl.InvalidArgumentError, lambda: c.all_gather(np.zeros(3, np.float32), np.zeros(5, np.float32)))
    catch("root", qccl.InvalidArgumentError, lambda: c.broadcast(np.zeros(3, np.float32), size + 3))
    catch("op", qccl.InvalidArgumentError, lambda: c.all_reduce(np.zeros(3, np.float32), op="xor"))
    catch("avg_int", qccl.InvalidArgumentError, lambda: c.all_reduce(np.zeros(3, np.int32), op="avg"))
    catch("spec", qccl.InvalidArgumentError, lambda: c.all_reduce_compressed(np.zeros(3, np.float32), "zip:x=1"))
    ro = np.zeros(3, np.float32)
    ro.setflags(write=False)
    catch("readonly", qccl.InvalidArgumentError, lambda: c.all_reduce(ro))
    catch("type", TypeError, lambda: c.all_reduce([1.0, 2.0]))
    # The comm still works after argument errors (nothing moved).
    a = np.ones(4, np.float32)
    c.all_reduce(a)
    msgs["after"] = a.tolist()
    # Disagreeing counts: every rank raises, none hangs.
    try:
        c.all_reduce(np.ones(10 + rank, np.float32))
        msgs["mismatch"] = None
    except qccl.QcclError as e:
        msgs["mismatch"] = type(e).__name__ + ": " + str(e)
    c.close()
    with pytest.raises(qccl.InvalidUsageError, match="closed"):
        c.barrier()
    return msgs


def test_errors_carry_qccls_message():
    res = run_ranks(_errors, 2, qccl.unique_id())
    for m in res:
        assert "not supported" in m["bool"]
        assert "not C-contiguous" in m["noncontig"]
        assert m["size"].startswith("invalid argument: all_gather")
        assert "root" in m["root"]
        assert "xor" in m["op"]
        assert m["after"] == [2.0] * 4
        assert m["mismatch"] is not None, "a rank with a different count did not raise"


def _killed(rank, size, uid):
    import os
    import time

    c = qccl.Comm.init(uid, rank, size, timeout=20)
    c.barrier()
    if rank == size - 1:
        os._exit(3)
    time.sleep(0.5)
    t0 = time.monotonic()
    with pytest.raises(qccl.QcclError) as e:
        for _ in range(1000):
            c.all_reduce(np.ones(1 << 16, np.float32))
    return time.monotonic() - t0, type(e.value).__name__, str(e.value)


def test_killed_rank_raises_on_survivors():
    res = run_ranks(_killed, 3, qccl.unique_id(), expect_exit=[2])
    for elapsed, kind, msg in res[:2]:
        assert elapsed < 20, f"took {elapsed:.1f} s"


def _abort(rank, size, uid):
    import threading
    import time

    c = qccl.Comm.init(uid, rank, size, timeout=60)
    if rank == 0:
        threading.Timer(0.5, c.abort).start()
        t0 = time.monotonic()
        with pytest.raises(qccl.QcclError):
            c.recv(np.zeros(4, np.float32), 1)  # rank 1 never sends
        return time.monotonic() - t0
    time.sleep(3)
    return None


def test_abort_unblocks_a_waiting_call():
    res = run_ranks(_abort, 2, qccl.unique_id())
    assert res[0] < 10


def test_readme_example_runs():
    """The README's Python example (python/examples/all_reduce.py) on 3 processes: every rank
    prints the expected average, and the torch line when torch is installed."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    example = os.path.join(here, "..", "examples", "all_reduce.py")
    out = subprocess.run(
        [sys.executable, example, "3"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(3):
        assert f"rank {r}: avg 1.00 (expected 1.00)" in out.stdout, out.stdout + out.stderr
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    assert out.stdout.count("torch max 3") == 3, out.stdout
