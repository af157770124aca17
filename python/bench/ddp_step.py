"""DDP step time of a ~25M-parameter MLP on CPU: backend "gloo" or "qccl", optionally with
qccl's compressed hook (qsgd 4-bit). Run it under a launcher that sets torchrun's variables,
e.g. the emulated cluster:

    perf-tests/emucluster -H 2 -R 1 --rate 1gbit -- python python/bench/ddp_step.py --backend gloo
    perf-tests/emucluster -H 2 -R 1 --rate 1gbit -- python python/bench/ddp_step.py --backend qccl --hook qsgd

Rank 0 prints the mean time of the measured steps (after warm-up steps that include the
hook's uncompressed start_iter steps).
"""

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import qccl.torch  # noqa: F401
from qccl.torch import hooks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="qccl")
    ap.add_argument("--hook", default="none", choices=["none", "qsgd"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024),
    )
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)
    state = None
    if a.hook == "qsgd":
        state = hooks.CompressionState(None, spec="qsgd:bits=4,bucket=128", start_iter=2, model=model)
        ddp.register_comm_hook(state, hooks.compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    times = []
    for step in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        hook = "qsgd:bits=4,bucket=128 hook" if state else "no hook"
        print(
            f"ddp_step backend={a.backend} {hook} ranks={dist.get_world_size()} params={params / 1e6:.1f}M "
            f"step_ms={1e3 * sum(times) / len(times):.0f} (min {1e3 * min(times):.0f})"
        )
    if state is not None:
        state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
