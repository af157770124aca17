"""Helpers: run a function on N ranks, each a fresh process (spawn)."""

import multiprocessing as mp
import os
import socket
import sys
import traceback

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def need(module):
    """Imports `module`, or skips the test module without it; with QCCL_PYTHON_REQUIRE=1 (CI)
    a missing module fails instead, so CI cannot pass by skipping."""
    if os.environ.get("QCCL_PYTHON_REQUIRE") == "1":
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def _child(target, rank, size, args, q):
    try:
        q.put((rank, "ok", target(rank, size, *args)))
    except BaseException as e:  # reported to the parent
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(target, size, *args, timeout=120, expect_exit=None):
    """Runs target(rank, size, *args) in `size` spawned processes; returns the results by rank.
    A rank that raised fails the test with its traceback. `expect_exit` lists ranks allowed to
    die without reporting."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(target, r, size, args, q)) for r in range(size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    waiting = size - len(expect_exit or ())
    try:
        for _ in range(waiting):
            rank, status, value = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                errors.append(f"rank {procs.index(p)} did not exit")
    if errors:
        pytest.fail("\n".join(errors))
    return [results.get(r) for r in range(size)]


def reserve_port():
    """A free port on 127.0.0.1 and the socket that holds it: bound with SO_REUSEADDR, never
    listening, so no bind to port 0 and no outgoing connection takes it, while a server that
    binds it explicitly with SO_REUSEADDR (torch's TCPStore) can listen on it. (Closing a probe
    socket instead leaves a window for another process to take the port.)"""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]
