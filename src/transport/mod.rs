//! Transports: byte movement between ranks, framed and checked (see `frame`).
//!
//! An algorithm step is one [`Transport::exchange`]: send one frame to each of some peers while
//! receiving one frame from each of some others, all progressed together, so a ring never
//! deadlocks. Every wait is bounded by the comm's timeout (measured from the last progress)
//! and by its abort flag.

pub mod frame;
pub mod inproc;
pub mod shm;
pub mod stall;
pub mod tcp;
pub mod wait;

use crate::error::Result;
use frame::OpDesc;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// How an `Error::Remote` message that carries a peer's abort reason begins.
pub const PEER_ABORTED: &str = "peer aborted: ";

/// One frame to send: `data` goes to `peer`.
pub struct SendReq<'a> {
    /// Destination rank.
    pub peer: usize,
    /// Payload.
    pub data: &'a [u8],
}

/// One frame to receive: exactly `data.len()` bytes from `peer`.
pub struct RecvReq<'a> {
    /// Source rank.
    pub peer: usize,
    /// Where the payload lands (or is reduced into).
    pub data: &'a mut [u8],
    /// None: copy the payload into `data`. Some: reduce it into `data` instead (see
    /// `Transport::reduces_on_receive`).
    pub reduce: Option<RecvReduce<'a>>,
}

/// A receive that reduces the payload on arrival: `data = with op payload`, or
/// `data = data op payload` when `with` is None.
#[derive(Clone, Copy)]
pub struct RecvReduce<'a> {
    /// Element type.
    pub dtype: crate::DType,
    /// Reduction (Avg reduces as Sum).
    pub op: crate::ReduceOp,
    /// The other operand, when it is not `data` itself (same length as `data`).
    pub with: Option<&'a [u8]>,
}

impl<'a> RecvReq<'a> {
    /// Receives the payload into `data`.
    pub fn new(peer: usize, data: &'a mut [u8]) -> RecvReq<'a> {
        RecvReq {
            peer,
            data,
            reduce: None,
        }
    }

    /// Reduces the payload into `data` as it arrives.
    pub fn reducing(peer: usize, data: &'a mut [u8], reduce: RecvReduce<'a>) -> RecvReq<'a> {
        RecvReq {
            peer,
            data,
            reduce: Some(reduce),
        }
    }
}

impl RecvReduce<'_> {
    /// Applies the reduction to `dst` (at offset `at` of the frame's data) with `payload`.
    pub fn apply(&self, dst: &mut [u8], at: usize, payload: &[u8]) {
        match self.with {
            Some(w) => {
                crate::reduce::reduce3(self.dtype, self.op, dst, &w[at..at + dst.len()], payload)
            }
            None => crate::reduce::reduce_into(self.dtype, self.op, dst, payload),
        }
    }
}

/// Settings every transport honours.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks in the comm.
    pub size: usize,
    /// An exchange fails when no byte moved for this long.
    pub timeout: Duration,
    /// How long a wait spins before it yields.
    pub spin: Duration,
    /// How long a wait then yields the core before it blocks.
    pub yield_for: Duration,
    /// Set by `Comm::abort`; every wait checks it at least every 100 ms.
    pub abort: Arc<AtomicBool>,
    /// Largest bytes per owner and round of the shared-memory arena (QCCL_SHM_ARENA_CHUNK);
    /// None: by the comm's size.
    pub arena_chunk: Option<usize>,
    /// The stall inspector of a comm over TCP (set by the transport); None for threads.
    pub inspector: Option<Arc<stall::Inspector>>,
}

/// A way to move frames between the ranks of one comm.
pub trait Transport: Send {
    /// Sends each of `sends` as one frame and receives one frame into each of `recvs`, all
    /// under the operation descriptor `desc`, which every received frame must match.
    /// At most one send and one receive per peer; never to or from this rank.
    fn exchange(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'_>],
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()>;

    /// True when a receive from `peer` can reduce straight out of the transport's memory
    /// (`RecvReq::reducing`), saving the copy into a landing buffer. May connect to `peer`.
    fn reduces_on_receive(&mut self, peer: usize) -> Result<bool> {
        let _ = peer;
        Ok(false)
    }

    /// The comm-wide shared-memory arena (`shm::arena`) when every peer shares this host over
    /// shared memory, else None. Set up on first use: every rank must call this at the same
    /// point of the same collective.
    fn arena(&mut self) -> Result<Option<&mut shm::arena::Arena>> {
        Ok(None)
    }

    /// Tells every connected peer that this rank failed (best effort, bounded to about a
    /// second) and closes the connections. Later exchanges fail.
    fn abort(&mut self, reason: &str);

    /// The comm's stall inspector (over TCP), for a server that takes the listener over.
    fn inspector(&self) -> Option<Arc<stall::Inspector>> {
        None
    }

    /// Human-readable name of `peer` for error messages (its address).
    fn peer_name(&self, peer: usize) -> String;

    /// "tcp" or "inproc".
    fn name(&self) -> &'static str;
}
