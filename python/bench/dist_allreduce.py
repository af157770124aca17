"""dist.all_reduce through backend "qccl" against "gloo": time per call and bus bandwidth
(nccl-tests' busbw = bytes x 2(n-1)/n / time), float32 sum, 4 KiB to 64 MiB.

    python python/bench/dist_allreduce.py -np 2 [--iters 20] [--max 64M]

Both backends run in the same processes, one after the other, each size warmed up first; the
time is the median of 5 rounds of the slowest rank's mean over a round's iterations (the
median, as the machines this ran on are shared and noisy).
"""

import argparse
import datetime
import multiprocessing as mp
import os
import tempfile
import time


ROUNDS = 5


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def sizes(lo, hi):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def worker(rank, n, init_dir, lo, hi, iters, q):
    import torch
    import torch.distributed as dist

    import qccl.torch  # noqa: F401

    torch.set_num_threads(1)
    out = {}
    for backend in ["gloo", "qccl"]:
        dist.init_process_group(
            backend, init_method=f"file://{init_dir}/{backend}", rank=rank, world_size=n,
            timeout=datetime.timedelta(seconds=300),
        )
        for size in sizes(lo, hi):
            t = torch.ones(size // 4)
            reps = max(2, min(iters, (64 << 20) // size))
            for _ in range(3):
                dist.all_reduce(t)
            rounds = []
            for _ in range(ROUNDS):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(t)
                el = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
                dist.all_reduce(el, op=dist.ReduceOp.MAX)
                rounds.append(el.item())
            out[(backend, size)] = sorted(rounds)[len(rounds) // 2]
        dist.destroy_process_group()
    q.put((rank, out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-np", type=int, default=2)
    ap.add_argument("--min", default="4K")
    ap.add_argument("--max", default="64M")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    lo, hi = parse_size(a.min), parse_size(a.max)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        ps = [ctx.Process(target=worker, args=(r, a.np, d, lo, hi, a.iters, q)) for r in range(a.np)]
        for p in ps:
            p.start()
        res = dict(q.get() for _ in ps)
        for p in ps:
            p.join()
    out = res[0]
    n = a.np
    print(f"dist.all_reduce float32 sum, {n} processes, torch {__import__('torch').__version__}, {os.cpu_count()} CPUs")
    print("| size | gloo time (us) | gloo busbw (GB/s) | qccl time (us) | qccl busbw (GB/s) | qccl/gloo busbw |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in sizes(lo, hi):
        g, c = out[("gloo", size)], out[("qccl", size)]
        f = 2 * (n - 1) / n if n > 1 else 1
        bg, bc = size * f / g / 1e9, size * f / c / 1e9
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {label} | {g * 1e6:.0f} | {bg:.2f} | {c * 1e6:.0f} | {bc:.2f} | {bc / bg:.2f} |")


if __name__ == "__main__":
    main()
