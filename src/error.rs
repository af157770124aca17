//! The one error type of qccl. Each variant maps to one `qcclResult_t` code of the C ABI.

use std::fmt;

/// Result alias used by every fallible qccl function.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong. Messages are complete sentences naming the offending value, rank or peer.
///
/// `Error` is `Clone` so that a comm that failed can hand the same error to every pending and
/// later operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument is wrong (rank or root out of range, buffer length not matching count, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The call is not allowed in this state, or the ranks disagree on a collective.
    #[error("invalid usage: {0}")]
    InvalidUsage(String),
    /// An operating-system call failed (socket, bind, thread spawn, ...).
    #[error("system error: {0}")]
    System(String),
    /// A peer died, closed its connection, or reported an error of its own.
    #[error("remote error: rank {rank} ({addr}): {msg}")]
    Remote {
        /// The peer's rank in this comm.
        rank: usize,
        /// The peer's transport address, as known to this rank.
        addr: String,
        /// What happened.
        msg: String,
    },
    /// A wait passed its deadline (QCCL_TIMEOUT_MS, or the init deadline).
    #[error("timeout: {0}")]
    Timeout(String),
    /// The comm was aborted by `abort()`.
    #[error("comm aborted: {0}")]
    Aborted(String),
    /// The feature is not built or not implemented for these arguments.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A bug in qccl: an invariant did not hold.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A `System` error from an `io::Error`, with what was being done.
    pub fn io(what: impl fmt::Display, err: std::io::Error) -> Error {
        Error::System(format!("{what}: {err}"))
    }

    /// Shorthand for `Error::InvalidArgument(msg.into())`.
    pub fn invalid(msg: impl Into<String>) -> Error {
        Error::InvalidArgument(msg.into())
    }

    /// The same error (same kind, same code) with `prefix` before its message.
    pub fn prefixed(self, prefix: &str) -> Error {
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{prefix}{m}")),
            Error::InvalidUsage(m) => Error::InvalidUsage(format!("{prefix}{m}")),
            Error::System(m) => Error::System(format!("{prefix}{m}")),
            Error::Remote { rank, addr, msg } => Error::Remote {
                rank,
                addr,
                msg: format!("{prefix}{msg}"),
            },
            Error::Timeout(m) => Error::Timeout(format!("{prefix}{m}")),
            Error::Aborted(m) => Error::Aborted(format!("{prefix}{m}")),
            Error::Unsupported(m) => Error::Unsupported(format!("{prefix}{m}")),
            Error::Internal(m) => Error::Internal(format!("{prefix}{m}")),
        }
    }

    /// NCCL-style numeric code (the C ABI's `qcclResult_t`).
    pub fn code(&self) -> i32 {
        match self {
            Error::System(_) => 2,
            Error::Internal(_) => 3,
            Error::InvalidArgument(_) => 4,
            Error::InvalidUsage(_) | Error::Aborted(_) => 5,
            Error::Remote { .. } => 6,
            Error::Timeout(_) => 8,
            Error::Unsupported(_) => 9,
        }
    }
}
