"""The exceptions qccl raises. Each carries qccl's own message; all derive from `QcclError`."""


class QcclError(RuntimeError):
    """A qccl call failed."""


class InvalidArgumentError(QcclError, ValueError):
    """An argument is wrong (rank or root out of range, buffer size not matching, ...)."""


class InvalidUsageError(QcclError):
    """The call is not allowed now, or the ranks disagree on a collective."""


class QcclSystemError(QcclError):
    """An operating-system call failed (socket, bind, thread spawn, ...)."""


class RemoteError(QcclError):
    """A peer died, closed its connection, or reported an error of its own."""


class QcclTimeoutError(QcclError, TimeoutError):
    """A wait passed its deadline (the comm's timeout)."""


class AbortedError(QcclError):
    """The comm was aborted."""


class UnsupportedError(QcclError, NotImplementedError):
    """Not supported for these arguments (dtype, device, op, ...)."""


class InternalError(QcclError):
    """A bug in qccl: an invariant did not hold."""


__all__ = [
    "QcclError",
    "InvalidArgumentError",
    "InvalidUsageError",
    "QcclSystemError",
    "RemoteError",
    "QcclTimeoutError",
    "AbortedError",
    "UnsupportedError",
    "InternalError",
]
