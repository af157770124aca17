"""The torch.distributed backend "qccl".

`import qccl.torch` registers it (recent torch also finds it through the
`torch.distributed.backends` entry point without the import); then::

    dist.init_process_group("qccl")                       # torchrun (env://)
    dist.init_process_group("qccl", init_method="tcp://10.0.0.1:29500", rank=r, world_size=n)
    dist.init_process_group("qccl", init_method="file:///shared/rendezvous", rank=r, world_size=n)

The process group is written in Python (a `torch.distributed.ProcessGroup` subclass): one
source for every torch version. Rank 0 of each group creates a qccl unique id and hands it to
the others through the group's c10d store. Each group runs its calls on one worker thread, in
issue order; `async_op=True` returns at once with a Work whose `wait()` raises the
collective's error and whose `get_future()` completes with the tensors.

CUDA tensors go as ProcessGroupNCCL's do: each call is enqueued on
`torch.cuda.current_stream(tensor.device)` and returns (the stream waits for the result; qccl
stages the bytes through page-locked host memory); the Work's `wait()`/`synchronize()` make
the caller's current stream wait for it without blocking the host, `is_completed()` asks
whether the stream passed it, and `get_future()` completes (from a helper thread) once it
did. A call on CUDA tensors first lets the group's queued CPU calls reach qccl, so every rank
issues its calls in one order. Tensors of one call are all CPU or all CUDA.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import hashlib
import inspect
import queue
import threading
import weakref
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .._qccl import Comm
from .._qccl import unique_id as _unique_id
from ..errors import QcclError, UnsupportedError

__all__ = ["ProcessGroupQCCL", "register", "BACKEND"]

BACKEND = "qccl"

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# The element types qccl reduces; data movement takes any dtype (as bytes).
_REDUCIBLE = {
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
}
for _name in ("uint32", "uint64"):
    if hasattr(torch, _name):
        _REDUCIBLE.add(getattr(torch, _name))

# torch numbers its ops differently from qccl: map by identity, never by number.
_OPS = [
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.PRODUCT, "prod"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"),
]
if hasattr(dist.ReduceOp, "AVG"):
    _OPS.append((dist.ReduceOp.AVG, "avg"))


def _op(opts) -> str:
    op = opts.reduceOp
    for t, name in _OPS:
        if op == t:
            return name
    raise UnsupportedError(
        f"qccl backend: reduce op {op} is not supported (supported: SUM, PRODUCT, MIN, MAX, AVG)"
    )


def _check_reducible(coll: str, t: torch.Tensor, op: str) -> None:
    if t.dtype not in _REDUCIBLE:
        raise UnsupportedError(
            f"qccl backend: {coll} cannot reduce dtype {t.dtype} (supported: "
            + ", ".join(sorted(str(d) for d in _REDUCIBLE))
            + ")"
        )
    if op == "avg" and not t.dtype.is_floating_point:
        raise UnsupportedError(
            f"qccl backend: {coll} with AVG needs a floating-point tensor, got {t.dtype}"
        )


def _check_device(coll: str, ts: Sequence[torch.Tensor]) -> Optional[torch.device]:
    """The CUDA device of the call's tensors, or None for CPU tensors; raises for other
    devices, sparse tensors, and CPU and CUDA tensors mixed in one call."""
    kinds = set()
    cuda = None
    for t in ts:
        if t.device.type not in ("cpu", "cuda"):
            raise UnsupportedError(
                f"qccl backend: {coll} got a tensor on {t.device}; qccl handles CPU and CUDA tensors"
            )
        if t.is_sparse:
            raise UnsupportedError(f"qccl backend: {coll} got a sparse tensor")
        kinds.add(t.device.type)
        if t.device.type == "cuda" and cuda is None:
            cuda = t.device
    if len(kinds) > 1:
        raise UnsupportedError(f"qccl backend: {coll} got CPU and CUDA tensors in one call")
    return cuda


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-d view of `t` (a copy if `t` is not contiguous)."""
    return t.contiguous().view(-1)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor qccl can move: itself, or its bytes for other dtypes."""
    t = _flat(t)
    if t.dtype in _REDUCIBLE:
        return t
    return t.view(torch.uint8)


class _InPlace:
    """A contiguous stand-in for `t`, copied back by `done()` when it had to be a copy."""

    def __init__(self, t: torch.Tensor, raw: bool = False):
        self.t = t
        self.c = t if t.is_contiguous() else t.contiguous()
        self.buf = self.c.view(-1)
        if raw and self.buf.dtype not in _REDUCIBLE:
            self.buf = self.buf.view(torch.uint8)

    def done(self) -> None:
        if self.c is not self.t:
            self.t.copy_(self.c)


# cuda.h's handle of the legacy default stream as a stream argument.
_CU_STREAM_LEGACY = 0x1

# torch.distributed.Work; older torch names it _Work.
_WorkBase = getattr(dist, "Work", None) or getattr(dist, "_Work")


class _Work(_WorkBase):
    """A queued call: `wait()` raises its error, `get_future()` completes with its tensors."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
            return True
        except Exception:
            return False

    def exception(self):
        try:
            self._fut.value()
        except Exception as e:
            return e
        return None

    def result(self):
        return self._fut.value()

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        return self._fut


class _CudaWork(_WorkBase):
    """A call enqueued on a CUDA stream, as ProcessGroupNCCL's Work: `event` marks its end on
    that stream."""

    def __init__(self, pg: "ProcessGroupQCCL", event, device: torch.device, result):
        super().__init__()
        self._pg = pg
        self._event = event
        self._device = device
        self._result = result
        self._fut: Optional[torch.futures.Future] = None

    def _error(self) -> Optional[Exception]:
        err = self._pg._comm.async_error() if not self._pg._closed else None
        return QcclError(f"qccl backend: the comm failed: {err}") if err else None

    def wait(self, timeout=None) -> bool:
        # NCCL's semantics: the caller's current stream waits for the work; the host does not.
        torch.cuda.current_stream(self._device).wait_event(self._event)
        err = self._error()
        if err is not None:
            raise err
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._event.query()

    def is_success(self) -> bool:
        return self.is_completed() and self._error() is None

    def exception(self):
        return self._error()

    def result(self):
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            ev, result = self._event, self._result

            def done():
                ev.synchronize()
                err = self._error()
                if err is not None:
                    raise err
                return result

            self._fut = self._pg._completions().submit(done)
        return self._fut


class _Worker:
    """One thread running a group's calls in issue order."""

    def __init__(self, name: str):
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> torch.futures.Future:
        fut = torch.futures.Future()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            try:
                r = fn()
            except BaseException as e:  # the Work carries it to the caller
                fut.set_exception(e)
                continue
            fut.set_result(r)

    def drain(self) -> None:
        """Returns once every call submitted so far ran (their errors stay with their Work)."""
        fut = self.submit(lambda: None)
        fut.wait()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


_live: "weakref.WeakSet[ProcessGroupQCCL]" = weakref.WeakSet()

# The qccl default (world) group, whose comm new_group's subgroups are made from.
_WORLD: Optional["weakref.ref[ProcessGroupQCCL]"] = None


def _world() -> Optional["ProcessGroupQCCL"]:
    pg = _WORLD() if _WORLD is not None else None
    return pg if pg is not None and not pg._closed else None


def _store_unique_id(store, rank: int, size: int) -> bytes:
    """The group's qccl unique id, made by rank 0 and read by the others from the c10d store."""
    # One id per creation, even where a store outlives a group (a file:// store used
    # again): every rank counts itself in once before it joins, and no rank of the next
    # creation can count before all of this one did (they wait in the rendezvous).
    generation = (store.add("qccl/joined", 1) - 1) // size
    key = f"qccl/unique_id/{generation}"
    if rank == 0:
        uid = _unique_id()
        store.set(key, uid)
        return uid
    return bytes(store.get(key))


class ProcessGroupQCCL(dist.ProcessGroup):
    """A torch.distributed process group over a qccl comm (see the module's doc)."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        timeout: Optional[datetime.timedelta] = None,
        global_ranks: Sequence[int] = (),
        group_name: str = "",
    ):
        super().__init__(rank, size)
        secs = timeout.total_seconds() if timeout is not None else None
        world = _world()
        if global_ranks and world is not None:
            # A subgroup of the qccl default group (torch's new_group): made from the world
            # comm by its members alone, in the world group's issue order.
            members = sorted(global_ranks)
            tag = int.from_bytes(hashlib.sha256(group_name.encode()).digest()[:8], "little")
            fut = world._submit(lambda: world._comm.create_group(members, tag)).get_future()
            fut.wait()
            self._comm = fut.value()
        else:
            self._comm = Comm.init(_store_unique_id(store, rank, size), rank, size, timeout=secs)
        if not global_ranks:
            global _WORLD
            _WORLD = weakref.ref(self)
        self._rank = rank
        self._size = size
        self._worker = _Worker(f"qccl-pg-r{rank}")
        # Completes the futures of calls on CUDA streams (made on first use).
        self._done: Optional[_Worker] = None
        # Before torch 2.7 C++ can outlive a Python Work: keep recent ones alive.
        self._keep: "collections.deque" = collections.deque(maxlen=256 if _TORCH < (2, 7) else 0)
        self._closed = False
        _live.add(self)

    # ---- plumbing ------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], object]) -> _Work:
        if self._closed:
            raise QcclError("qccl backend: the process group was shut down")
        w = _Work(self._worker.submit(fn))
        self._keep.append(w)
        return w

    def _call(self, device: Optional[torch.device], run: Callable[..., object]):
        """Runs `run(stream=...)`: on the worker for CPU tensors (stream None); for CUDA
        tensors on `device`, now, enqueued on its current stream (NCCL's semantics), after the
        calls queued before it reached qccl."""
        if device is None:
            return self._submit(run)
        if self._closed:
            raise QcclError("qccl backend: the process group was shut down")
        self._worker.drain()
        stream = torch.cuda.current_stream(device)
        # torch's default stream is the legacy one (handle 0, which qccl takes as "complete
        # before returning"): name it CU_STREAM_LEGACY, so the call is enqueued there too.
        handle = stream.cuda_stream or _CU_STREAM_LEGACY
        with torch.cuda.device(device):
            result = run(stream=handle)
            event = torch.cuda.Event()
            event.record(stream)
        w = _CudaWork(self, event, device, result)
        self._keep.append(w)
        return w

    def _completions(self) -> _Worker:
        if self._done is None:
            self._done = _Worker(f"qccl-pg-done-r{self._rank}")
        return self._done

    @property
    def comm(self) -> Comm:
        """The qccl comm under this group."""
        return self._comm

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def shutdown(self) -> None:
        """Runs what was queued, ends the worker thread and closes the comm (its thread,
        sockets and shared memory)."""
        if self._closed:
            return
        self._closed = True
        self._worker.close()
        if self._done is not None:
            self._done.close()
        self._comm.close()

    def abort(self) -> None:
        """Aborts the comm (queued calls raise), then shuts down."""
        if not self._closed:
            self._comm.abort()
        self.shutdown()

    _shutdown = shutdown
    _abort = abort

    # ---- collectives ---------------------------------------------------------------------
    #
    # Each call's `run(stream=None)` does the work: on the worker for CPU tensors, or now on
    # the current CUDA stream for CUDA tensors (`_call`), where temporaries live on the same
    # device and every copy is enqueued on that stream in order.

    def allreduce(self, tensors: List[torch.Tensor], opts=None) -> _Work:
        op = _op(opts) if opts is not None else "sum"
        dev = _check_device("all_reduce", tensors)
        for t in tensors:
            _check_reducible("all_reduce", t, op)

        def run(stream=None):
            for t in tensors:
                ip = _InPlace(t)
                self._comm.all_reduce(ip.buf, op=op, stream=stream)
                ip.done()
            return tensors

        return self._call(dev, run)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts=None) -> _Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: List[torch.Tensor], opts=None) -> _Work:
        dev = _check_device("broadcast", tensors)
        root = opts.rootRank if opts is not None else 0

        def run(stream=None):
            for t in tensors:
                ip = _InPlace(t, raw=True)
                self._comm.broadcast(ip.buf, root, stream=stream)
                ip.done()
            return tensors

        return self._call(dev, run)

    def reduce(self, tensors: List[torch.Tensor], opts=None) -> _Work:
        op = _op(opts)
        root = opts.rootRank
        dev = _check_device("reduce", tensors)
        for t in tensors:
            _check_reducible("reduce", t, op)

        def run(stream=None):
            for t in tensors:
                ip = _InPlace(t)
                self._comm.reduce(None, ip.buf, op=op, root=root, stream=stream)
                ip.done()
            return tensors

        return self._call(dev, run)

    def _gather_into(self, out: torch.Tensor, inp: torch.Tensor, stream=None) -> None:
        """All-gather of `inp` into contiguous-or-not `out` (size·numel elements)."""
        if out.numel() != inp.numel() * self._size:
            raise ValueError(
                f"qccl backend: all_gather output has {out.numel()} elements, expected "
                f"{self._size} x {inp.numel()}"
            )
        if out.dtype != inp.dtype:
            raise ValueError(
                f"qccl backend: all_gather output is {out.dtype} but input is {inp.dtype}"
            )
        ip = _InPlace(out, raw=True)
        # An input that is this rank's slot of the output is the in-place form.
        self._comm.all_gather(_raw(inp), ip.buf, stream=stream)
        ip.done()

    def allgather(self, output_lists, inputs, opts=None) -> _Work:
        dev = _check_device("all_gather", list(inputs) + [o for outs in output_lists for o in outs])

        def run(stream=None):
            for outs, inp in zip(output_lists, inputs):
                if len(outs) != self._size:
                    raise ValueError(
                        f"qccl backend: all_gather needs {self._size} output tensors, got {len(outs)}"
                    )
                flat = torch.empty(inp.numel() * self._size, dtype=inp.dtype, device=inp.device)
                self._gather_into(flat, inp, stream)
                for r, o in enumerate(outs):
                    o.copy_(flat[r * inp.numel() : (r + 1) * inp.numel()].view_as(o))
            return output_lists

        return self._call(dev, run)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> _Work:
        dev = _check_device("all_gather_into_tensor", [output, inp])

        def run(stream=None):
            self._gather_into(output, inp, stream)
            return [output]

        return self._call(dev, run)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> _Work:
        dev = _check_device("all_gather_into_tensor", list(outputs) + list(inputs))

        def run(stream=None):
            for o, i in zip(outputs, inputs):
                self._gather_into(o, i, stream)
            return list(outputs)

        return self._call(dev, run)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _scatter_reduce(self, out: torch.Tensor, flat: torch.Tensor, op: str, stream=None) -> None:
        if flat.numel() != out.numel() * self._size:
            raise ValueError(
                f"qccl backend: reduce_scatter input has {flat.numel()} elements, expected "
                f"{self._size} x {out.numel()}"
            )
        ip = _InPlace(out)
        self._comm.reduce_scatter(_flat(flat), ip.buf, op=op, stream=stream)
        ip.done()

    def reduce_scatter(self, outputs, input_lists, opts=None) -> _Work:
        op = _op(opts)
        dev = _check_device("reduce_scatter", list(outputs) + [i for ins in input_lists for i in ins])
        for o in outputs:
            _check_reducible("reduce_scatter", o, op)

        def run(stream=None):
            for o, ins in zip(outputs, input_lists):
                if len(ins) != self._size:
                    raise ValueError(
                        f"qccl backend: reduce_scatter needs {self._size} input tensors, got {len(ins)}"
                    )
                flat = torch.cat([i.reshape(-1) for i in ins])
                self._scatter_reduce(o, flat, op, stream)
            return outputs

        return self._call(dev, run)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts=None) -> _Work:
        op = _op(opts)
        dev = _check_device("reduce_scatter_tensor", [output, inp])
        _check_reducible("reduce_scatter_tensor", output, op)

        def run(stream=None):
            self._scatter_reduce(output, inp, op, stream)
            return [output]

        return self._call(dev, run)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> _Work:
        op = _op(opts)
        dev = _check_device("reduce_scatter_tensor", list(outputs) + list(inputs))
        for o in outputs:
            _check_reducible("reduce_scatter_tensor", o, op)

        def run(stream=None):
            for o, i in zip(outputs, inputs):
                self._scatter_reduce(o, i, op, stream)
            return list(outputs)

        return self._call(dev, run)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _all_to_all_parts(self, outs: List[torch.Tensor], ins: List[torch.Tensor], stream=None) -> None:
        """All-to-all of byte parts of any sizes: padded to the largest part of any rank."""
        n = self._size
        ins_b = [_flat(i).view(torch.uint8) for i in ins]
        outs_ip = [_InPlace(o) for o in outs]
        outs_b = [ip.buf.view(torch.uint8) for ip in outs_ip]
        local = max([i.numel() for i in ins_b] + [o.numel() for o in outs_b] + [0])
        # The sizes are host values: a host all-reduce (in this call's turn).
        m = torch.tensor([local], dtype=torch.int64)
        self._comm.all_reduce(m, op="max")
        width = int(m.item())
        dev = ins_b[0].device if ins_b else None
        send = torch.zeros(n * width, dtype=torch.uint8, device=dev)
        for p, i in enumerate(ins_b):
            send[p * width : p * width + i.numel()] = i
        recv = torch.empty(n * width, dtype=torch.uint8, device=dev)
        self._comm.all_to_all(send, recv, stream=stream)
        for q, o in enumerate(outs_b):
            o.copy_(recv[q * width : q * width + o.numel()])
        for ip in outs_ip:
            ip.done()

    def alltoall(self, outputs, inputs, opts=None) -> _Work:
        dev = _check_device("all_to_all", list(outputs) + list(inputs))
        if len(outputs) != self._size or len(inputs) != self._size:
            raise ValueError(
                f"qccl backend: all_to_all needs {self._size} input and output tensors"
            )

        def run(stream=None):
            self._all_to_all_parts(list(outputs), list(inputs), stream)
            return list(outputs)

        return self._call(dev, run)

    def all_to_all_single(self, output, inp, output_split_sizes, input_split_sizes, opts=None) -> _Work:
        dev = _check_device("all_to_all_single", [output, inp])
        n = self._size

        def rows(t, splits, what):
            if t.dim() == 0:
                raise ValueError(f"qccl backend: all_to_all_single {what} is a scalar")
            if not splits:
                if t.shape[0] % n:
                    raise ValueError(
                        f"qccl backend: all_to_all_single {what} has {t.shape[0]} rows, not a multiple of {n}"
                    )
                splits = [t.shape[0] // n] * n
            if len(splits) != n or sum(splits) != t.shape[0]:
                raise ValueError(
                    f"qccl backend: all_to_all_single {what} splits {list(splits)} do not cover {t.shape[0]} rows in {n} parts"
                )
            return list(torch.split(t, list(splits)))

        def run(stream=None):
            if not output_split_sizes and not input_split_sizes and output.is_contiguous():
                if inp.numel() % n:
                    raise ValueError(
                        f"qccl backend: all_to_all_single input has {inp.numel()} elements, not a multiple of {n}"
                    )
                self._comm.all_to_all(_raw(inp), _raw(output), stream=stream)
                return [output]
            outs = rows(output, output_split_sizes, "output")
            ins = rows(inp, input_split_sizes, "input")
            flat_out = [torch.empty_like(o) for o in outs]
            self._all_to_all_parts(flat_out, [i.contiguous() for i in ins], stream)
            for o, f in zip(outs, flat_out):
                o.copy_(f)
            return [output]

        return self._call(dev, run)

    alltoall_base = all_to_all_single

    def gather(self, output_lists, inputs, opts=None) -> _Work:
        root = opts.rootRank
        dev = _check_device("gather", list(inputs) + [o for outs in output_lists for o in outs])

        def run(stream=None):
            for idx, inp in enumerate(inputs):
                src = _raw(inp)
                if self._rank == root:
                    outs = output_lists[idx]
                    if len(outs) != self._size:
                        raise ValueError(
                            f"qccl backend: gather needs {self._size} output tensors on the root, got {len(outs)}"
                        )
                    flat = torch.empty(src.numel() * self._size, dtype=src.dtype, device=src.device)
                    self._comm.gather(src, flat, root, stream=stream)
                    for r, o in enumerate(outs):
                        ip = _InPlace(o, raw=True)
                        ip.buf.copy_(flat[r * src.numel() : (r + 1) * src.numel()])
                        ip.done()
                else:
                    self._comm.gather(src, None, root, stream=stream)
            return output_lists

        return self._call(dev, run)

    def scatter(self, outputs, input_lists, opts=None) -> _Work:
        root = opts.rootRank
        dev = _check_device("scatter", list(outputs) + [i for ins in input_lists for i in ins])

        def run(stream=None):
            for idx, out in enumerate(outputs):
                ip = _InPlace(out, raw=True)
                if self._rank == root:
                    ins = input_lists[idx]
                    if len(ins) != self._size:
                        raise ValueError(
                            f"qccl backend: scatter needs {self._size} input tensors on the root, got {len(ins)}"
                        )
                    flat = torch.cat([_raw(i) for i in ins])
                    self._comm.scatter(flat, ip.buf, root, stream=stream)
                else:
                    self._comm.scatter(None, ip.buf, root, stream=stream)
                ip.done()
            return outputs

        return self._call(dev, run)

    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        dev = _check_device("send", tensors)

        def run(stream=None):
            for t in tensors:
                self._comm.send(_raw(t), dst, stream=stream)
            return tensors

        return self._call(dev, run)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> _Work:
        dev = _check_device("recv", tensors)

        def run(stream=None):
            for t in tensors:
                ip = _InPlace(t, raw=True)
                self._comm.recv(ip.buf, src, stream=stream)
                ip.done()
            return tensors

        return self._call(dev, run)

    def recvAnysource(self, tensors, tag=0):
        raise UnsupportedError("qccl backend: recv from any source is not supported")

    def barrier(self, opts=None) -> _Work:
        def run():
            self._comm.barrier()
            return []

        return self._submit(run)


def _create(opts, backend_options=None):
    """torch's extended creator API: `opts` carries the store, the group's rank and size, its
    timeout, name and global ranks (empty for the default group)."""
    return ProcessGroupQCCL(
        opts.store,
        opts.group_rank,
        opts.group_size,
        opts.timeout,
        global_ranks=list(getattr(opts, "global_ranks_in_group", []) or []),
        group_name=str(getattr(opts, "group_id", "")),
    )


def register() -> None:
    """Registers backend "qccl" with torch.distributed (idempotent; `import qccl.torch` calls
    it, and so does torch through the `torch.distributed.backends` entry point)."""
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    try:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    except TypeError:  # torch without `devices`
        dist.Backend.register_backend(BACKEND, _create, extended_api=True)


def _shut_down_on_destroy() -> None:
    """Torch before 2.3 drops a group in `destroy_process_group` without shutting its backend
    down, which would leave this backend's thread and comm running: there, wrap the function
    to shut down the qccl groups it destroys (all of them for the default group)."""
    c10d = dist.distributed_c10d
    destroy = c10d.destroy_process_group
    try:
        if "shutdown" in inspect.getsource(destroy) or getattr(destroy, "_qccl", False):
            return
    except (OSError, TypeError):  # no source: go by the version
        if _TORCH >= (2, 3):
            return

    def destroy_process_group(group=None):
        everything = group is None or group is dist.group.WORLD
        doomed = [pg for pg in list(_live) if everything or pg is group]
        destroy(group)
        for pg in doomed:
            pg.shutdown()

    destroy_process_group.__doc__ = destroy.__doc__
    destroy_process_group._qccl = True
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


@atexit.register
def _at_exit() -> None:
    # A worker thread still running at exit would outlive the interpreter: join them all.
    for pg in list(_live):
        try:
            pg.shutdown()
        except Exception:
            pass


register()
_shut_down_on_destroy()
