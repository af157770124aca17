//! Transports: byte movement between ranks, framed and checked (see `frame`).
//!
//! The unit is the per-peer *link* (`link.rs`: a socket set, a shared-memory ring pair, an
//! in-process channel pair; each kind in its own folder), opened lazily by the comm's
//! connector (`net/` chooses the kind per peer pair; `inproc/`). An algorithm step is one
//! [`Transport::exchange`]: send one frame to each of some peers while receiving one frame
//! from each of some others, all progressed together by the one engine (`engine.rs`), so a
//! ring never deadlocks. Every wait is bounded by the comm's timeout (measured from the last
//! progress) and by its abort flag.

mod endpoint;
pub mod engine;
pub mod frame;
pub mod ib;
pub mod inproc;
pub mod link;
pub mod net;
pub mod registry;
pub mod shm;
pub mod socket;
pub mod stall;
pub mod wait;

pub use endpoint::Transport;
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

/// A frame whose bytes are still being written when its exchange starts (by a GPU's copy,
/// say): the exchange posts its receives and ready sends at once, and starts this one as soon
/// as its [`SendSource`] hands the bytes over.
#[derive(Debug, Clone, Copy)]
pub struct LateSend {
    /// Destination rank.
    pub peer: usize,
    /// Bytes the frame will carry.
    pub len: usize,
}

/// Where the bytes of an exchange's [`LateSend`]s come from.
pub trait SendSource<'a> {
    /// The `len` bytes for `peer` once they are written, None while they are not. An error
    /// when they never will be (their writer failed, or its deadline passed). Asked on every
    /// pass of the exchange: must not block.
    fn ready(&mut self, peer: usize) -> crate::Result<Option<&'a [u8]>>;

    /// Blocks until the bytes for `peer` may be ready, at most `d` (the exchange has nothing
    /// else to wait for).
    fn wait(&mut self, peer: usize, d: Duration);
}

/// One frame to receive: exactly `data.len()` bytes from `peer`.
pub struct RecvReq<'a> {
    /// Source rank.
    pub peer: usize,
    /// Where the payload lands (or is reduced into).
    pub data: &'a mut [u8],
    /// None: copy the payload into `data`. Some: reduce it into `data` instead (see
    /// `Link::reduces_on_receive`).
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
    /// The buffers registered with the comm (`Comm::register`), which links that can send
    /// straight from registered memory look up.
    pub registry: Arc<registry::Registry>,
}
