//! A dense call on raw buffers that may be device memory (an all-reduce, or a reduce-scatter
//! or all-gather), as the dense entries (`cuda_ipc.rs`) hand it to the paths that take device
//! buffers without staging: CUDA IPC (`ipc_turn.rs`) and the shared-memory arena
//! (`arena_turn.rs`); and where its buffers are (`OnDevice`).

use super::device_all_reduce::staged;
use super::route::AllReduceCall;
use crate::algo::Algo;
use crate::coll::call::{Coll, CollCall};
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::staging::{self, CallBuf};
use std::sync::Arc;

/// A dense call that may take device buffers without staging.
#[derive(Clone, Copy)]
pub(super) enum DenseCall<'a> {
    AllReduce(&'a AllReduceCall),
    /// A reduce-scatter or an all-gather.
    Coll(&'a CollCall<'static>),
}

impl DenseCall<'_> {
    /// Bytes of one rank's part: the whole call for an all-reduce.
    pub(super) fn part(&self) -> usize {
        match self {
            DenseCall::AllReduce(c) => {
                let (count, dtype, _) = c.shape();
                count * dtype.size()
            }
            DenseCall::Coll(c) => c.count * c.dtype.size(),
        }
    }

    /// Its buffers' lengths on `size` ranks, (send, recv); in place the one buffer is the
    /// whole one (NCCL's layouts).
    pub(super) fn lens(&self, size: usize, in_place: bool) -> (usize, usize) {
        let part = self.part();
        match self {
            DenseCall::Coll(c) if c.coll == Coll::ReduceScatter && in_place => (0, part * size),
            DenseCall::Coll(c) if c.coll == Coll::ReduceScatter => (part * size, part),
            DenseCall::Coll(_) if in_place => (0, part * size),
            DenseCall::Coll(_) => (part, part * size),
            DenseCall::AllReduce(_) => (part, part),
        }
    }

    /// Bytes each rank stages (its input) on `size` ranks.
    pub(super) fn staged(&self, size: usize) -> usize {
        match self {
            DenseCall::Coll(c) if c.coll == Coll::ReduceScatter => self.part() * size,
            _ => self.part(),
        }
    }

    /// True when the call moves bytes (a part of at least one byte).
    pub(super) fn moves_bytes(&self) -> bool {
        self.part() > 0
    }

    /// True when the ranks agree on CUDA IPC before running it (a comm using it).
    pub(super) fn exchanges(&self, comm_uses_it: bool) -> bool {
        match self {
            DenseCall::AllReduce(c) => c.exchanges(),
            DenseCall::Coll(c) => {
                comm_uses_it
                    && self.part() > 0
                    && matches!(c.coll, Coll::ReduceScatter | Coll::AllGather)
            }
        }
    }

    /// Where rank `rank`'s input starts: `send`, or in place `recv` (an all-gather's own
    /// part of it).
    pub(super) fn src(&self, rank: usize, send: Option<u64>, recv: u64) -> u64 {
        match (self, send) {
            (_, Some(s)) => s,
            (DenseCall::Coll(c), None) if c.coll == Coll::AllGather => {
                recv + (rank * self.part()) as u64
            }
            (_, None) => recv,
        }
    }

    /// "all_reduce", for logs.
    pub(super) fn name(&self) -> &'static str {
        match self {
            DenseCall::AllReduce(_) => "all_reduce",
            DenseCall::Coll(c) => c.coll.name(),
        }
    }

    /// Runs the call on `e` over `hosts`, host addresses standing for `bufs` (send, if any,
    /// then recv); `exchange`: with its CUDA IPC descriptor ("host"), unless already made.
    /// The algorithm of an all-reduce.
    pub(super) fn run_hosts(
        &self,
        e: &mut Engine,
        bufs: &[CallBuf],
        hosts: &[*mut u8],
        exchange: bool,
    ) -> Result<Option<Algo>> {
        // SAFETY: each host address stands for its buffer's `len` bytes, valid until the call
        // ends (`on_buffers`, `Staging::run`), and they do not overlap (the entry's promise).
        let (send, recv) = unsafe {
            match (bufs, hosts) {
                ([s, r], [hs, hr]) => (Some(&*staged(*hs, s.len)), staged(*hr, r.len)),
                ([r], [hr]) => (None, staged(*hr, r.len)),
                _ => {
                    return Err(Error::Internal(format!(
                        "a {} got {} buffers, not one or two",
                        self.name(),
                        hosts.len()
                    )))
                }
            }
        };
        match (self, exchange) {
            (DenseCall::AllReduce(c), true) => c.run(e, send, recv).map(Some),
            (DenseCall::AllReduce(c), false) => c.run_agreed(e, send, recv).map(Some),
            (DenseCall::Coll(c), true) => e.run_call(c, send, recv).map(|()| None),
            (DenseCall::Coll(c), false) => e.run_call_agreed(c, send, recv).map(|()| None),
        }
    }
}

/// A dense call owned, for the queued entries (the call runs later, in the comm's turn).
pub(super) enum OwnedDense {
    AllReduce(Box<AllReduceCall>),
    /// A reduce-scatter or an all-gather.
    Coll(CollCall<'static>),
}

impl OwnedDense {
    /// The call, borrowed.
    pub(super) fn call(&self) -> DenseCall<'_> {
        match self {
            OwnedDense::AllReduce(c) => DenseCall::AllReduce(c),
            OwnedDense::Coll(c) => DenseCall::Coll(c),
        }
    }
}

/// A call's buffers when all are device memory: its driver, where they are, their device,
/// the input (send, or recv in place), the output, in place or not, and the caller's stream
/// (a `CUstream`).
pub(super) struct OnDevice {
    pub(super) driver: Arc<dyn crate::gpu::driver::Driver>,
    pub(super) place: staging::Placement,
    pub(super) ordinal: usize,
    pub(super) bufs: Vec<CallBuf>,
    pub(super) src: u64,
    pub(super) recv: u64,
    pub(super) in_place: bool,
    pub(super) stream: usize,
}
