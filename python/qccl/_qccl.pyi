"""Typed stubs of qccl's native module. Buffers (`Buffer`) are numpy arrays (or objects with
`__array_interface__`), torch CPU and CUDA tensors, and device arrays with
`__cuda_array_interface__`, C-contiguous, of dtype int8, uint8, int32, uint32, int64, uint64,
float16, float32, float64 or bfloat16 (torch). Calls work on host buffers in place (zero-copy)
with the GIL released; do not resize or free a buffer while a call on it runs. Device buffers
are staged through page-locked host memory.

`stream` (every call but `barrier`): a `cudaStream_t` as an int (or a stream object with
`.cuda_stream`). Given and not 0, the call is enqueued on it and returns at once (NCCL's
semantics; the buffers must live until the stream passes the call; calls that return a result
return None). Absent, the v3 `stream` of the device arrays' interface, else the call completes
before returning. Every failure raises a `qccl.errors.QcclError` subclass carrying qccl's
message."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

Buffer = Any
Op = Union[str, int]
Key = Union[str, int]
Stream = Any

__version__: str

def unique_id() -> bytes:
    """A new 128-byte unique id; its rendezvous root runs in this process until every rank
    joined (or QCCL_INIT_TIMEOUT_MS passed). Hand it to every rank's `Comm.init`."""

def dtype_size(name: str) -> Optional[int]:
    """Element size of a torch dtype name ("torch.float32") or numpy type string ("<f4")."""

class Comm:
    """One rank of a qccl communicator."""

    @staticmethod
    def init(unique_id: bytes, rank: int, size: int, timeout: Optional[float] = None) -> "Comm":
        """Joins the `size`-rank group of `unique_id` as `rank`; `timeout` (seconds) bounds the
        rendezvous and every later wait (default QCCL_TIMEOUT_MS)."""
    @staticmethod
    def from_env() -> "Comm":
        """Joins the group the environment describes (torchrun, mpirun, srun, QCCL_*)."""
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def local_size(self) -> int: ...
    @property
    def transport(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def all_reduce(
        self,
        send: Buffer,
        recv: Optional[Buffer] = None,
        op: Optional[Op] = None,
        algo: Optional[str] = None,
        stream: Optional[Stream] = None,
    ) -> Optional[str]:
        """recv[i] = op over ranks of send[i] (in place in `send` when `recv` is None). `op`:
        "sum" (default), "prod", "max", "min", "avg" (floats) or NCCL's number; `algo`: ring,
        tree, sra, auto. Returns the algorithm that ran (None when enqueued on a stream)."""
    def reduce_scatter(
        self, send: Optional[Buffer], recv: Buffer, op: Optional[Op] = None, stream: Optional[Stream] = None
    ) -> None:
        """`send` holds size x len(recv) elements; rank r gets the reduction of part r. With
        send None, `recv` is the whole buffer and the result lands in this rank's part."""
    def all_gather(self, send: Optional[Buffer], recv: Buffer, stream: Optional[Stream] = None) -> None:
        """`recv` (size x len(send)) gets every rank's `send` in rank order. With send None (or
        send being this rank's part of recv) the call is in place."""
    def broadcast(self, buf: Buffer, root: int, stream: Optional[Stream] = None) -> None:
        """Copies root's `buf` into every rank's `buf`."""
    def reduce(
        self,
        send: Optional[Buffer],
        recv: Optional[Buffer],
        op: Optional[Op] = None,
        root: int = 0,
        stream: Optional[Stream] = None,
    ) -> None:
        """Reduction onto root's `recv` (in place in `recv` when `send` is None; `recv` may be
        None off the root)."""
    def all_to_all(self, send: Buffer, recv: Buffer, stream: Optional[Stream] = None) -> None:
        """Part p of `send` goes to rank p; part q of `recv` comes from rank q."""
    def gather(
        self, send: Buffer, recv: Optional[Buffer], root: int = 0, stream: Optional[Stream] = None
    ) -> None:
        """Root's `recv` (size x len(send)) gets every rank's `send`; `recv` may be None elsewhere."""
    def scatter(
        self, send: Optional[Buffer], recv: Buffer, root: int = 0, stream: Optional[Stream] = None
    ) -> None:
        """Part r of root's `send` lands in rank r's `recv`; `send` may be None off the root."""
    def send(self, buf: Buffer, peer: int, stream: Optional[Stream] = None) -> None:
        """Sends `buf` to `peer`, which calls `recv` with a buffer of the same size."""
    def recv(self, buf: Buffer, peer: int, stream: Optional[Stream] = None) -> None:
        """Receives into `buf` from `peer`."""
    def barrier(self) -> None:
        """Returns once every rank called `barrier`."""
    def all_reduce_compressed(
        self,
        send: Buffer,
        spec: str,
        recv: Optional[Buffer] = None,
        op: Optional[Op] = None,
        key: Optional[Key] = None,
        algo: Optional[str] = None,
        intra_host: bool = False,
        stream: Optional[Stream] = None,
    ) -> Optional[Dict[str, Any]]:
        """Compressed all-reduce (Sum or Avg, float buffers) with codec `spec` ("qsgd:bits=4,
        bucket=128", "topk:density=0.01,ef=1", "fp16", ...). `key` names the tensor across calls:
        it keys the error-feedback residual and the layout. Every rank ends bit-identical.
        Returns {"algo", "sent", "received"} (None when enqueued on a stream)."""
    def topk_all_reduce(
        self,
        buf: Buffer,
        density: float,
        key: Optional[Key] = None,
        scheme: str = "hitopk",
        error_feedback: bool = True,
        samplings: int = 30,
        stream: Optional[Stream] = None,
    ) -> Optional[Dict[str, Any]]:
        """Top-k all-reduce (sum) in place: HiTopKComm ("hitopk") or a baseline ("naiveag",
        "treear", "2dtar"), with error feedback keyed by `key`. Returns {"algo", "sent",
        "received", "k"} (None when enqueued on a stream)."""
    def set_layout(self, key: Key, layers: Sequence[Tuple[str, int]]) -> None:
        """Registers the layers (name, element count) of the buffer compressed with `key`."""
    def remove_layout(self, key: Key) -> bool: ...
    def forget_residual(self, key: Key) -> bool: ...
    def split(self, color: int, key: int = 0) -> Optional["Comm"]:
        """Collective: ranks with one `color` form a new comm ordered by `key`; a negative
        color gets None."""
    def create_group(self, members: Sequence[int], tag: int = 0) -> "Comm":
        """A comm of `members` (ascending ranks of this comm) made by the members alone, as
        MPI_Comm_create_group; ranks outside the list do not call it. `tag` tells apart
        groups of the same members."""
    def register(self, buf: Buffer) -> int:
        """Registers `buf` with the comm (NCCL's ncclCommRegister): collectives on it may be
        sent straight from it by links that can (RDMA); elsewhere nothing changes. Returns a
        handle for `deregister`. The same pages registered again give the same handle, counted:
        each registration needs its `deregister`. Local, not collective. The comm holds `buf`
        until then (or `close`), so it is not freed while registered. An empty or
        non-contiguous buffer raises `InvalidArgumentError`; a device buffer
        `UnsupportedError`."""
    def deregister(self, handle: int) -> None:
        """Drops one registration made by `register`. A handle this comm did not hand out, or
        already deregistered as often as registered, raises `InvalidArgumentError`."""
    def registrations(self) -> Dict[str, int]:
        """{"ranges": buffers registered, "made": device registrations links made of them (0
        until a link that sends from registered memory, RDMA, used one), "wire" and
        "wire_made": the same for qccl's own wire buffers that compressed calls encode into}."""
    def device_stats(self) -> Dict[str, int]:
        """{"calls": compressed all-reduces (and HiTopK calls) on device buffers that ran their
        codecs on the GPU, "enqueued": those made on a stream that returned once enqueued,
        "to_host" / "to_device": encoded bytes they copied each way, "exchanges": their
        exchanges, "overlapped": those that began with encodes still queued on the GPU,
        "late_sends": sends started once their encode finished, "through_arena": dense calls
        on device buffers that went through the shared-memory arena, the GPU copying into and
        out of it, "piecewise": calls on device buffers staged piece by piece, the copies
        overlapping the collective (across hosts: dense all-reduces, reduce-scatters and
        all-gathers, compressed all-reduces on the hierarchical route without a GPU path;
        anywhere: broadcasts and reduces)}
        (the rest are staged
        whole through page-locked memory, compressed by the CPU)."""
    def async_error(self) -> Optional[str]:
        """The message of the error that failed this comm, or None."""
    def abort(self) -> None:
        """Aborts the comm: the running call and every later one raise; peers are told."""
    def close(self) -> None:
        """Ends the comm's thread, connections and shared memory (after running calls)."""
