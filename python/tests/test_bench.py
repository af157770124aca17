"""The benchmark scripts in python/bench run and print their figures (a smoke test: a few
steps of each mode, no timing asserted; figures come from runs on quiet machines)."""

import os
import subprocess
import sys

from conftest import need, reserve_port

need("torch")

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


def _ranks(script, size, args, port):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(BENCH, script), *args],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(size)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {script} {args}: exit {p.returncode}\n{out}"
    return outs[0]


def test_ddp_step_prints_every_mode():
    for backend, hook in [("gloo", "none"), ("qccl", "qsgd"), ("qccl", "noop")]:
        holder, port = reserve_port()
        holder.close()
        out = _ranks(
            "ddp_step.py",
            2,
            ["--backend", backend, "--hook", hook, "--batch", "4", "--threads", "1", "--warmup", "3", "--steps", "1",
             "--width", "512"],
            port,
        )
        assert f"ddp_step backend={backend}" in out and "step_ms=" in out and "forward" in out, out


def test_ddp_step_interleaves_gloo_and_the_hook():
    holder, port = reserve_port()
    holder.close()
    out = _ranks(
        "ddp_step.py",
        2,
        ["--interleave", "--batch", "4", "--threads", "1", "--warmup", "3", "--steps", "1", "--width", "512"],
        port,
    )
    assert "ddp_step interleaved" in out and "gloo/hook" in out, out


def test_dist_allreduce_prints_its_table():
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "dist_allreduce.py"), "-np", "2", "--min", "4K", "--max", "16K", "--iters", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [l for l in out.stdout.splitlines() if l.startswith("| 4 KiB") or l.startswith("| 16 KiB")]
    assert len(rows) == 2, out.stdout
