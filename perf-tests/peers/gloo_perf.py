#!/usr/bin/env python3
"""gloo_perf.py -- torch.distributed (gloo backend, CPU) collective benchmark whose
output mirrors nccl-tests' all_reduce_perf; a peer for qccl (perf-tests/compare).
`--device cuda` puts the tensors on GPUs (gloo stages them), `--backend qccl` runs qccl's
torch backend through the same loop, for the same-run comparison on CUDA tensors.

It spawns its own ranks with torch.multiprocessing on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo,
MASTER_ADDR=127.0.0.1, a free port), so run it once, not under a launcher:

    python gloo_perf.py -np 2 -b 4K -e 256M -f 2 -n 1000 -w 5 -T 0.3 -J out.json

Under a launcher that sets torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (torchrun,
perf-tests/emucluster), it runs as that one rank instead (-np is ignored; GLOO_SOCKET_IFNAME as
the launcher set it).

Flags and method are those of mpi_coll_perf.c (see there): -b/-e sizes (K/M/G = 1024^k),
-f factor, -n iters (upper bound when -T > 0), -w warmup, -d float|double,
-C allreduce|reduce_scatter|allgather|bcast, -T target seconds per size, -J JSON out.
Extra: -np N ranks [2], --threads T torch intra-op threads per rank [1].
time = dist.barrier(), then iters back-to-back calls, elapsed/iters averaged over ranks;
algbw = size/time, busbw = algbw * 2(n-1)/n (allreduce), GB = 1e9 B.
"""
import argparse
import json
import os
import socket
import sys
import time

from ports import reserve_port
import warnings

# the torch wheel warns once per process when numpy is absent; gloo_perf does not use numpy
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

COLLS = ("allreduce", "reduce_scatter", "allgather", "bcast")


def parse_size(s):
    mul = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip()
    if s and s[-1].lower() in mul:
        return int(float(s[:-1]) * mul[s[-1].lower()])
    return int(float(s))


def val(r, idx):
    # small integers, exact in float: (3r + i mod 1000003) mod 11, as in mpi_coll_perf.c
    return ((idx % 1000003) + 3 * r) % 11


def worker(rank, args, addr):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    nr = args.np
    if args.backend == "qccl":
        import qccl.torch  # noqa: F401  (registers the backend)
    dev = torch.device("cpu")
    if args.device == "cuda":
        # Ranks share the GPUs round robin (one GPU: every rank on it, as qccl-perf does).
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group(args.backend, init_method=f"tcp://{addr}", rank=rank,
                            world_size=nr)
    dtype = torch.float64 if args.d == "double" else torch.float32
    es = 8 if args.d == "double" else 4
    coll = args.C
    busf = {"allreduce": 2.0 * (nr - 1) / nr, "bcast": 1.0}.get(coll, (nr - 1) / nr)

    maxel = args.e // es + nr
    # this rank's data for the largest size; smaller sizes use a prefix (val depends on i)
    full = val(rank, torch.arange(maxel, dtype=torch.int32)).to(dtype).to(dev)

    def sync():
        # Calls on CUDA tensors may return before the device is done (NCCL's semantics).
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    out = []
    if rank == 0:
        where = "cpu" if dev.type == "cpu" else f"cuda ({torch.cuda.get_device_name(dev)})"
        print(f"# gloo_perf: torch {torch.__version__} {args.backend}, nranks {nr}, host "
              f"{socket.gethostname()}, coll {coll}, type {args.d}, threads/rank {args.threads}, "
              f"tensors on {where}")
        print(f"# minBytes {args.b} maxBytes {args.e} step: {args.f:g}(factor) iters: {args.n} "
              f"warmup: {args.w} target: {args.T:g}s")
        print("#\n#%11s  %12s  %8s  %6s  %10s  %7s  %7s  %6s  %6s" %
              ("size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "iters"))
        print("#%11s  %12s  %8s  %6s  %10s  %7s  %7s  %6s  %6s" %
              ("(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", ""), flush=True)

    size = args.b
    wrong_total = 0
    while size <= args.e:
        if coll in ("allreduce", "bcast"):
            cnt = size // es
            total = cnt
        else:
            cnt = size // es // nr
            total = cnt * nr
        if cnt == 0:
            size = int(size * args.f)
            continue
        nbytes = total * es
        sendn = cnt if coll == "allgather" else total
        send = full[:sendn]
        if coll == "allreduce":
            # gloo's all_reduce is in place: time it on zeros (repeated sums of data would
            # grow to inf); correctness is checked on a fresh call with data below
            buf = torch.zeros(cnt, dtype=dtype, device=dev)
            call = lambda: dist.all_reduce(buf)
        elif coll == "reduce_scatter":
            recv = torch.empty(cnt, dtype=dtype, device=dev)
            call = lambda: dist.reduce_scatter_tensor(recv, send)
        elif coll == "allgather":
            recv = torch.empty(total, dtype=dtype, device=dev)
            call = lambda: dist.all_gather_into_tensor(recv, send)
        else:
            buf = send.clone()
            call = lambda: dist.broadcast(buf, 0)

        def timed(k):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                call()
            sync()
            d = time.perf_counter() - t0
            t = torch.tensor([d], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        call()
        done, k, warm_time, est = 1, 1, 0.0, 0.0
        if args.T <= 0 and args.w - done > 0:
            k = args.w - done
        while True:
            d = timed(k)
            warm_time += d
            done += k
            est = d / k
            if args.T <= 0:
                if done >= args.w:
                    break
                k = args.w - done
                continue
            if (done >= args.w and d >= 0.01) or warm_time >= args.T / 2 or done >= args.n:
                break
            k *= 2
        iters = args.n
        if args.T > 0:
            iters = min(args.n, int(args.T / max(est, 1e-9)))
            iters = max(iters, min(3, args.n))

        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        sync()
        el = (time.perf_counter() - t0) / iters
        tt = torch.tensor([el], dtype=torch.float64)
        dist.all_reduce(tt)
        t = tt.item() / nr

        # correctness on a fresh call (all_reduce/bcast are in place), checked on a sample
        # of ~4096 elements plus the last, as mpi_coll_perf.c does
        if coll in ("allreduce", "bcast"):
            buf.copy_(send)
            call()
            got = buf
        else:
            got = recv
        sync()
        got = got.cpu()
        outn = got.numel()
        i = torch.cat([torch.arange(0, outn, outn // 4096 + 1), torch.tensor([outn - 1])])
        if coll == "allreduce":
            exp = sum(val(r, i) for r in range(nr))
        elif coll == "bcast":
            exp = val(0, i)
        elif coll == "reduce_scatter":
            exp = sum(val(r, i + rank * cnt) for r in range(nr))
        else:
            exp = val(i // cnt, i % cnt)
        w = torch.tensor([int((got[i] != exp.to(dtype)).sum().item())], dtype=torch.int64)
        dist.all_reduce(w)
        wrong = int(w.item())
        wrong_total += wrong

        algbw = nbytes / t / 1e9
        busbw = algbw * busf
        redop = "none" if coll in ("allgather", "bcast") else "sum"
        if rank == 0:
            print("%12d  %12d  %8s  %6s  %10.2f  %7.2f  %7.2f  %6d  %6d" %
                  (nbytes, cnt, args.d, redop, t * 1e6, algbw, busbw, wrong, iters), flush=True)
        out.append({"size": nbytes, "count": cnt, "type": args.d, "redop": redop, "coll": coll,
                    "nranks": nr, "iters": iters, "time_us": round(t * 1e6, 3),
                    "algbw": round(algbw, 6), "busbw": round(busbw, 6), "wrong": wrong,
                    # torch's all_reduce and broadcast work on one buffer: compare's tables
                    # set them against qccl's in-place figures
                    "in_place": coll in ("allreduce", "bcast"),
                    "backend": args.backend, "device": args.device})
        if size * args.f > args.e:
            break
        size = int(size * args.f)

    if rank == 0:
        avg = sum(r["busbw"] for r in out) / len(out) if out else 0.0
        print(f"# Out of bounds values : {wrong_total} {'FAILED' if wrong_total else 'OK'}")
        print(f"# Avg bus bandwidth    : {avg:g}\n#", flush=True)
        if args.J:
            with open(args.J, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
    dist.barrier()
    dist.destroy_process_group()
    if wrong_total:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-np", type=int, default=2)
    ap.add_argument("-b", type=parse_size, default=parse_size("32M"))
    ap.add_argument("-e", type=parse_size, default=parse_size("32M"))
    ap.add_argument("-f", type=float, default=2.0)
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("-w", type=int, default=5)
    ap.add_argument("-d", choices=("float", "double"), default="float")
    ap.add_argument("-C", choices=COLLS, default="allreduce")
    ap.add_argument("-T", type=float, default=0.0)
    ap.add_argument("-J", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live (cuda: ranks share the GPUs round robin)")
    ap.add_argument("--backend", choices=("gloo", "qccl"), default="gloo",
                    help="torch.distributed backend (qccl: import qccl.torch)")
    args = ap.parse_args()
    if args.f <= 1:
        args.f = 2.0
    args.n = max(args.n, 1)
    args.w = max(args.w, 1)

    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # One rank of a launched job.
        args.np = int(env["WORLD_SIZE"])
        worker(int(env["RANK"]), args, f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
        return 0

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    hold, port = reserve_port()
    os.environ["MASTER_PORT"] = str(port)

    import torch.multiprocessing as mp
    try:
        mp.spawn(worker, args=(args, f"127.0.0.1:{port}"), nprocs=args.np, join=True)
    finally:
        hold.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a failed rank: say so, exit non-zero
        print(f"gloo_perf: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
