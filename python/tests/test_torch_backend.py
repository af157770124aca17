"""The torch.distributed backend "qccl": every dist.* collective against exact values."""

import datetime
import os

import pytest

from conftest import need  # noqa: E402

torch = need("torch")
import torch.distributed as dist  # noqa: E402

from conftest import reserve_port, run_ranks  # noqa: E402

COUNTS = [0, 1, 7, 13]


def _dtypes():
    return [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _t(r, n, dt, mod=7):
    return ((torch.arange(n) * 3 + r * 5 + 1) % mod + 1).to(dt)


def _init(rank, size, init, timeout=60, **kw):
    import qccl.torch  # noqa: F401

    dist.init_process_group(
        "qccl", init_method=init, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout), **kw
    )


def _suite(rank, size, init):
    _init(rank, size, init)
    assert dist.get_backend() == "qccl"
    bad = []

    def eq(name, got, exp, tol=0.0):
        ok = got.dtype == exp.dtype and got.shape == exp.shape
        if ok and tol:
            ok = torch.allclose(got.double(), exp.double(), rtol=tol, atol=tol)
        elif ok:
            ok = torch.equal(got, exp)
        if not ok:
            bad.append(f"rank {rank}: {name}: got {got.tolist()} expected {exp.tolist()}")

    for dt in _dtypes():
        for n in COUNTS:
            tag = f"{dt} n={n}"
            parts = [_t(r, n, dt) for r in range(size)]
            stack = torch.stack([p.double() for p in parts]) if n else torch.zeros(size, 0, dtype=torch.float64)
            for op, exp in [
                (dist.ReduceOp.SUM, stack.sum(0)),
                (dist.ReduceOp.MIN, stack.min(0).values if n else stack.sum(0)),
                (dist.ReduceOp.MAX, stack.max(0).values if n else stack.sum(0)),
            ]:
                t = parts[rank].clone()
                dist.all_reduce(t, op=op)
                eq(f"all_reduce {op} {tag}", t, exp.to(dt))
            small = [_t(r, n, dt, mod=3) for r in range(size)]
            t = small[rank].clone()
            dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
            prod = torch.ones(n, dtype=torch.float64)
            for s in small:
                prod = prod * s.double()
            eq(f"all_reduce PRODUCT {tag}", t, prod.to(dt))
            if dt.is_floating_point:
                t = parts[rank].clone()
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
                eq(f"all_reduce AVG {tag}", t, (stack.sum(0) / size).to(dt), tol=1e-2)
            t = parts[rank].clone()
            dist.broadcast(t, src=size - 1)
            eq(f"broadcast {tag}", t, parts[size - 1])
            t = parts[rank].clone()
            dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
            if rank == 0:
                eq(f"reduce {tag}", t, stack.sum(0).to(dt))
            outs = [torch.empty(n, dtype=dt) for _ in range(size)]
            dist.all_gather(outs, parts[rank])
            eq(f"all_gather {tag}", torch.cat(outs), torch.cat(parts))
            o = torch.empty(size * n, dtype=dt)
            dist.all_gather_into_tensor(o, parts[rank])
            eq(f"all_gather_into_tensor {tag}", o, torch.cat(parts))
            o = torch.empty(n, dtype=dt)
            dist.reduce_scatter(o, [_t(rank * size + p, n, dt) for p in range(size)])
            exp = sum(_t(r * size + rank, n, dt).double() for r in range(size)) if n else torch.zeros(0)
            eq(f"reduce_scatter {tag}", o, exp.to(dt))
            o = torch.empty(n, dtype=dt)
            dist.reduce_scatter_tensor(o, torch.cat([_t(rank * size + p, n, dt) for p in range(size)]))
            eq(f"reduce_scatter_tensor {tag}", o, exp.to(dt))
            # all_to_all with uneven parts: rank r sends p+r+n elements to rank p.
            ins = [_t(rank * 10 + p, p + rank + n, dt) for p in range(size)]
            outs = [torch.empty(rank + q + n, dtype=dt) for q in range(size)]
            dist.all_to_all(outs, ins)
            for q in range(size):
                eq(f"all_to_all from {q} {tag}", outs[q], _t(q * 10 + rank, rank + q + n, dt))
            inp = torch.cat([_t(rank * 10 + p, n, dt) for p in range(size)])
            o = torch.empty(size * n, dtype=dt)
            dist.all_to_all_single(o, inp)
            eq(f"all_to_all_single {tag}", o, torch.cat([_t(q * 10 + rank, n, dt) for q in range(size)]))
            in_splits = [p + 1 for p in range(size)]
            out_splits = [rank + 1] * size
            inp = torch.cat([_t(rank * 10 + p, p + 1, dt) for p in range(size)])
            o = torch.empty(sum(out_splits), dtype=dt)
            dist.all_to_all_single(o, inp, out_splits, in_splits)
            eq(f"all_to_all_single splits {tag}", o, torch.cat([_t(q * 10 + rank, rank + 1, dt) for q in range(size)]))
            gl = [torch.empty(n, dtype=dt) for _ in range(size)] if rank == 0 else None
            dist.gather(parts[rank], gl, dst=0)
            if rank == 0:
                eq(f"gather {tag}", torch.cat(gl), torch.cat(parts))
            o = torch.empty(n, dtype=dt)
            dist.scatter(o, parts if rank == size - 1 else None, src=size - 1)
            eq(f"scatter {tag}", o, parts[rank])
            if size > 1:
                if rank == 0:
                    dist.send(parts[0], 1)
                elif rank == 1:
                    o = torch.empty(n, dtype=dt)
                    dist.recv(o, 0)
                    eq(f"send/recv {tag}", o, parts[0])
    # 2-d tensors, non-contiguous ones, and dtypes moved as bytes.
    t = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)).t()
    dist.all_reduce(t)
    eq("all_reduce non-contiguous", t, (torch.arange(12, dtype=torch.float32).reshape(3, 4) * sum(range(1, size + 1))).t())
    c = torch.tensor([1 + 2j, rank * 1j], dtype=torch.complex64)
    dist.broadcast(c, src=0)
    eq("broadcast complex", c, torch.tensor([1 + 2j, 0j], dtype=torch.complex64))
    b = torch.tensor([rank == 0, True])
    dist.broadcast(b, src=0)
    eq("broadcast bool", b, torch.tensor([True, True]))
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank})
    if objs != [{"rank": r} for r in range(size)]:
        bad.append(f"all_gather_object: {objs}")
    # async_op: issue order per group, wait() and get_future().
    ts = [torch.full((1000,), float(rank + i)) for i in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future() for w in works]
    for i, w in enumerate(works):
        w.wait()
        eq(f"async {i}", ts[i], torch.full((1000,), float(sum(range(size)) + size * i)))
        eq(f"future {i}", futs[i].value()[0], ts[i])
    # Clear errors for unsupported dtypes and ops.
    import qccl

    for f, what in [
        (lambda: dist.all_reduce(torch.zeros(3, dtype=torch.bool)), "bool"),
        (lambda: dist.all_reduce(torch.zeros(3, dtype=torch.int16)), "int16"),
        (lambda: dist.all_reduce(torch.zeros(3, dtype=torch.int32), op=dist.ReduceOp.AVG), "avg int"),
        (lambda: dist.all_reduce(torch.zeros(3), op=dist.ReduceOp.BXOR), "bxor"),
    ]:
        try:
            f()
            bad.append(f"{what}: no error")
        except qccl.UnsupportedError as e:
            if "qccl backend" not in str(e):
                bad.append(f"{what}: message {e}")
    # new_group: a group of the first and the last rank.
    members = sorted({0, size - 1})
    g = dist.new_group(members, backend="qccl")
    if rank in members:
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=g)
        eq("new_group", t, torch.tensor([float(sum(m + 1 for m in members))]))
        dist.barrier(group=g)
    # A second group that leaves rank 0 out, made while rank 0 talks to nobody: torch calls the
    # backend only on members, and qccl makes the comm from the world comm by them alone.
    if size >= 3:
        rest = list(range(1, size))
        h = dist.new_group(rest, backend="qccl")
        if rank in rest:
            t = torch.full((1009,), float(rank))
            dist.all_reduce(t, group=h, op=dist.ReduceOp.MAX)
            eq("new_group without rank 0", t, torch.full((1009,), float(size - 1)))
    dist.barrier()
    dist.destroy_process_group()
    return bad


@pytest.mark.parametrize("size", [1, 2, 3])
def test_dist_collectives_exact(size, tmp_path):
    res = run_ranks(_suite, size, f"file://{tmp_path}/rendezvous", timeout=300)
    problems = [p for r in res for p in r]
    assert not problems, "\n".join(problems[:20])


def _resources():
    socks = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            socks += os.readlink(f"/proc/self/fd/{f}").startswith("socket:")
        except OSError:  # the directory's own descriptor, closed by now
            pass
    shm = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    threads = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                threads.append(f.read().strip())
        except OSError:
            pass
    return sorted(threads), socks, shm


def _lifecycle(rank, size, init):
    import gc
    import time

    import qccl.torch  # noqa: F401

    torch.ones(1 << 16).add_(1).sum()  # torch's own pools start here, not in the backend
    before = _resources()
    for i in range(2):
        # A rendezvous file each time: torch before 2.1 cannot init twice from one file.
        _init(rank, size, f"{init}-{i}")
        t = torch.ones(1 << 16)
        dist.all_reduce(t)
        assert t[0].item() == size
        dist.destroy_process_group()
    gc.collect()
    deadline = time.monotonic() + 10
    while _resources()[:2] != before[:2] and time.monotonic() < deadline:
        time.sleep(0.1)
    return before, _resources()


def test_destroy_leaves_no_thread_socket_or_shm(tmp_path):
    init = f"file://{tmp_path}/rendezvous"
    res = run_ranks(_lifecycle, 2, init)
    for before, after in res:
        assert after[0] == before[0], f"threads: {before[0]} before, {after[0]} after"
        assert after[1] == before[1], f"sockets: {before[1]} before, {after[1]} after"
        assert [s for s in after[2] if s not in before[2] and "qccl" in s] == [], after[2]


def _env_init(rank, size, port, via_entry_point):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    if not via_entry_point:
        import qccl.torch  # noqa: F401
    dist.init_process_group("qccl", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def test_env_init_like_torchrun():
    sock, port = reserve_port()
    with sock:
        assert run_ranks(_env_init, 2, port, False) == [1.0, 1.0]


def test_entry_point_finds_backend_without_import():
    from importlib.metadata import entry_points

    eps = entry_points()
    group = eps.select(group="torch.distributed.backends") if hasattr(eps, "select") else eps.get("torch.distributed.backends", [])
    if not any(e.name == "qccl" for e in group):
        pytest.skip("qccl is not installed with its entry points (pip install ./python)")
    if not hasattr(dist.Backend, "_ensure_backend_registered"):
        pytest.skip("this torch does not load torch.distributed.backends entry points")
    sock, port = reserve_port()
    with sock:
        assert run_ranks(_env_init, 2, port, True) == [1.0, 1.0]


def _tcp_init(rank, size, port):
    _init(rank, size, f"tcp://127.0.0.1:{port}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    dist.destroy_process_group()
    return t.item()


def test_tcp_init():
    sock, port = reserve_port()
    with sock:
        assert run_ranks(_tcp_init, 3, port) == [6.0, 6.0, 6.0]


def _mismatch(rank, size, init):
    import time

    _init(rank, size, init, timeout=20)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100 + rank))
        return None
    except Exception as e:
        return time.monotonic() - t0, type(e).__name__, str(e)


def test_disagreeing_counts_raise_on_every_rank(tmp_path):
    res = run_ranks(_mismatch, 2, f"file://{tmp_path}/rendezvous")
    for r in res:
        assert r is not None, "a rank did not raise"
        assert r[0] < 20


def _killed(rank, size, init):
    import time

    _init(rank, size, init, timeout=20)
    dist.barrier()
    if rank == size - 1:
        os._exit(3)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            w = dist.all_reduce(torch.ones(1 << 16), async_op=True)
            w.wait()
        return None
    except Exception as e:
        return time.monotonic() - t0, type(e).__name__, str(e)


def test_killed_rank_raises_on_survivors(tmp_path):
    res = run_ranks(_killed, 3, f"file://{tmp_path}/rendezvous", expect_exit=[2])
    for r in res[:2]:
        assert r is not None, "a survivor did not raise"
        assert r[0] < 20, r
