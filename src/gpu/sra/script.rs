//! What one call's enqueued device work leaves for the comm's worker (`Script`): where each
//! exchange's bytes are, the events that say they are written or read, and the progress
//! values the stream waits for. The worker only moves bytes and stores those values
//! (`moves.rs`); it enqueues nothing, so a caller's stream waiting for the call can be held
//! by nothing but the network.

use super::state::Words;
use crate::gpu::driver::Event;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One exchange of the schedule as enqueued.
pub(super) struct Exchange {
    /// The receive set (`x % SETS`).
    pub(super) rset: usize,
    /// The event after the decodes that last read that set (index into `events`), waited
    /// for before it receives again.
    pub(super) drained: Option<usize>,
    /// Per peer: the send slot's first byte, its length and the event after the encode that
    /// fills it (index into `events`; None: nothing encoded, ready).
    pub(super) sends: Vec<(usize, *const u8, usize, Option<usize>)>,
}

/// A call's device work, enqueued; dropped once its bytes are moved (or never will be).
pub struct Script {
    pub(super) exchanges: Vec<Exchange>,
    pub(super) events: Vec<Box<dyn Event>>,
    /// The events after the encodes (indices into `events`).
    pub(super) encodes: Vec<usize>,
    /// After the call's last kernel: the caller's stream waits for it (None while the call
    /// is being enqueued).
    pub(super) done: Option<Box<dyn Event>>,
    /// Page-locked wire: receive slot p of set k at `recv_slot(k, p)`.
    pub(super) wire: *mut u8,
    pub(super) slot: usize,
    pub(super) n: usize,
    pub(super) words: Arc<Words>,
    /// Exchange x's received bytes are released to the stream by storing `base + x + 1`.
    pub(super) base: u32,
    /// Exchanges released so far.
    pub(super) released: usize,
    /// The comm's count of calls done (bytes moved, device work run), raised on drop.
    pub(super) moved: Arc<AtomicU64>,
    /// True once `done` is known complete.
    pub(super) finished: bool,
    timeout: Duration,
}

// SAFETY: the raw pointers address the comm's page-locked wire, which is replaced only once
// every call enqueued before is done (`DeviceState::reserve` waits for `moved`), so it
// outlives the Script whichever thread holds it; the events are Send + Sync.
unsafe impl Send for Script {}

impl Script {
    /// The script of a call on `n` ranks over `wire` (slots of `slot` bytes), its exchanges
    /// released by progress values after `base`.
    pub(super) fn new(
        (wire, slot, n): (*mut u8, usize, usize),
        words: Arc<Words>,
        base: u32,
        (moved, timeout): (Arc<AtomicU64>, Duration),
    ) -> Script {
        Script {
            exchanges: Vec::new(),
            events: Vec::new(),
            encodes: Vec::new(),
            done: None,
            wire,
            slot,
            n,
            words,
            base,
            released: 0,
            moved,
            finished: false,
            timeout,
        }
    }

    /// Receive slot `p` of set `k`.
    pub(super) fn recv_slot(&self, k: usize, p: usize) -> *mut u8 {
        self.wire
            .wrapping_add((k * 2 * self.n + self.n + p) * self.slot)
    }

    /// Lets the stream run the decodes of exchanges up to `x` (exclusive).
    pub(super) fn release(&mut self, x: usize) {
        if x > self.released {
            self.released = x;
            self.words
                .progress()
                .store(self.base.wrapping_add(x as u32), Ordering::Release);
        }
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // Every wait of the call passes, done or failed: a stream held at a progress value
        // nobody stores would hold the caller's stream forever (on a failure the result is
        // undefined and the comm failed, as NCCL's).
        self.release(self.exchanges.len());
        if !self.finished {
            // Counted done only once the device no longer uses the comm's buffers (growing
            // them waits for that); a wait, never an enqueue, so safe on the worker.
            if let Some(d) = &self.done {
                let _ = d.synchronize(self.timeout);
            }
        }
        self.moved.fetch_add(1, Ordering::AcqRel);
    }
}
