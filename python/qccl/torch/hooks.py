"""Compressed DDP communication hooks, shaped like torch's own (`PowerSGDState` /
`powerSGD_hook`)::

    from qccl.torch.hooks import CompressionState, compressed_allreduce_hook, hitopk_hook

    state = CompressionState(process_group=None, spec="qsgd:bits=4,bucket=128", start_iter=2)
    ddp.register_comm_hook(state, compressed_allreduce_hook)

Each state owns a qccl comm of its own over the ranks of `process_group` (made once, through
one broadcast on that group), so the hooks work whatever backend the group uses ("gloo",
"qccl", ...). Gradients are averaged; every rank ends with bit-identical buckets. DDP rebuilds
its buckets after the first iteration, so compression starts at `start_iter` (default 2: once
buckets are final); before, buckets are averaged uncompressed. Error feedback is keyed per
bucket (its index), and a bucket whose length changes starts a fresh residual. CUDA buckets go
through qccl's device path, as calls that complete before returning (on the state's thread):
the codecs run on the GPU where the route has that path (docs/PYTHON.md), the buffers are
staged through page-locked memory otherwise; the future completes once the result is on the
device.
"""

import weakref
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .. import Comm, unique_id
from . import _Worker

__all__ = ["CompressionState", "compressed_allreduce_hook", "hitopk_hook"]


def _close(runner: _Worker, comm: Comm) -> None:
    runner.close()
    comm.close()


class CompressionState:
    """State of the compressed hooks for one DDP model.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        spec: qccl codec spec of `compressed_allreduce_hook` ("qsgd:bits=4,bucket=128",
            "topk:density=0.01,ef=1", "fp16", ...).
        start_iter: iterations averaged uncompressed first (DDP's buckets are final from the
            second iteration on).
        density: the fraction of elements `hitopk_hook` sends.
        layerwise: compress each parameter of a bucket on its own (a layout keyed per bucket):
            parameters named by `model` matching QCCL_COMPRESSION_EXCLUDE (default "bias, bn,
            norm") or smaller than QCCL_COMPRESSION_MINIMAL_SIZE elements travel uncompressed.
        model: the module, to name parameters for `layerwise`.
        timeout: seconds for the state's comm (default QCCL_TIMEOUT_MS).
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        spec: str = "qsgd:bits=4,bucket=128",
        start_iter: int = 2,
        density: float = 0.01,
        layerwise: bool = False,
        model: Optional[torch.nn.Module] = None,
        timeout: Optional[float] = None,
    ) -> None:
        group = process_group if process_group is not None else dist.group.WORLD
        self.process_group = group
        self.spec = spec
        self.start_iter = start_iter
        self.density = density
        self.layerwise = layerwise
        self.iter = 0
        rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        ids = [unique_id() if rank == 0 else None]
        dist.broadcast_object_list(ids, src=dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0, group=group)
        self.comm = Comm.init(ids[0], rank, size, timeout=timeout)
        self.size = size
        self._names: Dict[int, str] = {}
        if model is not None:
            self._names = {id(p): n for n, p in model.named_parameters()}
        self._lengths: Dict[int, int] = {}
        # One thread runs the state's qccl calls in order (DDP calls hooks from autograd).
        self._runner = _Worker("qccl-hook")
        self._finalizer = weakref.finalize(self, _close, self._runner, self.comm)

    def close(self) -> None:
        """Ends the state's thread and comm (also done when the state is collected or at exit)."""
        self._finalizer()

    def _key(self, bucket) -> str:
        """The bucket's tensor key; its residual and layout start afresh when its length changes."""
        idx = bucket.index()
        key = f"ddp-bucket-{idx}"
        n = bucket.buffer().numel()
        if self._lengths.get(idx) != n:
            if idx in self._lengths:
                self.comm.forget_residual(key)
                self.comm.remove_layout(key)
            self._lengths[idx] = n
            if self.layerwise:
                params = bucket.parameters()
                layers = [(self._names.get(id(p), f"param{i}"), p.numel()) for i, p in enumerate(params)]
                if sum(c for _, c in layers) == n:
                    self.comm.set_layout(key, layers)
        return key

    def _step(self, bucket) -> bool:
        """Counts iterations (a bucket of index 0 is the last of an iteration in DDP's reverse
        order, so `is_last()` marks the end); True when this call compresses."""
        on = self.iter >= self.start_iter
        if bucket.is_last():
            self.iter += 1
        return on


def _run(state: CompressionState, fn: Callable[[torch.Tensor], None], buf: torch.Tensor) -> torch.futures.Future:
    ready = None
    if buf.is_cuda:
        # A CUDA bucket is written on the caller's current stream: the call starts once that
        # work is done, and the future completes once the result is on the device.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(buf.device))

    def job() -> torch.Tensor:
        if ready is not None:
            ready.synchronize()
        fn(buf)
        if ready is not None:
            torch.cuda.synchronize(buf.device)
        return buf

    return state._runner.submit(job)


def compressed_allreduce_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket's average through qccl's compressed all-reduce with `state.spec`
    (uncompressed before `state.start_iter`), error feedback keyed per bucket."""
    buf = bucket.buffer()
    if not state._step(bucket) or not buf.dtype.is_floating_point:
        return _run(state, lambda b: state.comm.all_reduce(b, op="avg" if b.dtype.is_floating_point else "sum"), buf)
    key = state._key(bucket)
    spec = state.spec
    return _run(state, lambda b: state.comm.all_reduce_compressed(b, spec, op="avg", key=key), buf)


def hitopk_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: HiTopKComm (hierarchical top-k at `state.density`, error feedback keyed per
    bucket) of the bucket, divided by the number of ranks (uncompressed average before
    `state.start_iter`)."""
    buf = bucket.buffer()
    if not state._step(bucket) or not buf.dtype.is_floating_point:
        return _run(state, lambda b: state.comm.all_reduce(b, op="avg" if b.dtype.is_floating_point else "sum"), buf)
    key = state._key(bucket)
    density, size = state.density, state.size

    def run(b: torch.Tensor) -> None:
        state.comm.topk_all_reduce(b, density, key=key, scheme="hitopk")
        b.div_(size)

    return _run(state, run, buf)
