"""qccl: collective communication (NCCL-like) over shared memory and TCP, with compression
inside the collective.

`Comm` runs collectives over numpy arrays and torch CPU tensors in place (zero-copy: the
buffers must be C-contiguous). `unique_id()` on one process and `Comm.init(uid, rank, size)`
on every rank build a group; `Comm.from_env()` reads torchrun's, mpirun's or srun's variables.
`import qccl.torch` registers the torch.distributed backend "qccl"; `qccl.torch.hooks` holds
compressed DDP communication hooks.
"""

import enum

from . import errors
from ._qccl import Comm, __version__, unique_id
from .errors import (
    AbortedError,
    InternalError,
    InvalidArgumentError,
    InvalidUsageError,
    QcclError,
    QcclSystemError,
    QcclTimeoutError,
    RemoteError,
    UnsupportedError,
)


class ReduceOp(enum.IntEnum):
    """Reduction operators, numbered as NCCL numbers them. Calls also take the names
    ("sum", "prod", "max", "min", "avg")."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


__all__ = [
    "Comm",
    "ReduceOp",
    "unique_id",
    "errors",
    "__version__",
] + errors.__all__
