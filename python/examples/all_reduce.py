"""The README's Python example, runnable: N processes on this machine all-reduce a numpy
array and a torch tensor (if torch is installed) through qccl.Comm.

    python python/examples/all_reduce.py [N]
"""

import multiprocessing as mp
import sys

import numpy as np

import qccl


def rank_main(uid, rank, size):
    comm = qccl.Comm.init(uid, rank, size, timeout=60)
    grad = np.full(1 << 20, float(rank), np.float32)
    comm.all_reduce(grad, op="avg")  # in place, zero-copy, the GIL released
    q = np.random.default_rng(rank).standard_normal(1 << 16).astype(np.float32)
    report = comm.all_reduce_compressed(q, "qsgd:bits=4,bucket=128", op="avg", key="layer0")
    print(f"rank {rank}: avg {grad[0]:.2f} (expected {(size - 1) / 2:.2f}), qsgd sent {report['sent']} bytes")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.ones(8) * (rank + 1)
        comm.all_reduce(t, op="max")
        print(f"rank {rank}: torch max {t[0].item():.0f}")
    comm.close()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    uid = qccl.unique_id()  # the rendezvous root runs in this process
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(uid, r, n)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
