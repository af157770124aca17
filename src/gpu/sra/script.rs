//! What one call's enqueued device work leaves for the comm's worker: where each exchange's
//! bytes are, the events that say they are written or read, and the progress values the
//! stream waits for. The worker only moves bytes and stores those values (`moves.rs`); it
//! enqueues nothing, so a caller's stream waiting for the call can be held by nothing but the
//! network.
//!
//! The enqueueing side posts each exchange on the call's [`Board`] as it enqueues it, and the
//! worker takes them from there as the schedule reaches them, while the rest is still being
//! enqueued. It must not wait for the whole call: a stream holds only so many operations
//! pending (about 1000 on CUDA; an enqueue past that blocks until one ends), and everything
//! after the call's first progress wait stays pending until the worker stores that value.

use super::state::Words;
use crate::error::{Error, Result};
use crate::gpu::driver::Event;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One exchange of the schedule as enqueued.
pub(super) struct Exchange {
    /// The receive set (`x % SETS`).
    pub(super) rset: usize,
    /// The event after the decodes that last read that set (index into the events), waited
    /// for before it receives again.
    pub(super) drained: Option<usize>,
    /// Per peer: the send slot's first byte, its length and the event after the encode that
    /// fills it (index into the events; None: nothing encoded, ready).
    pub(super) sends: Vec<(usize, *const u8, usize, Option<usize>)>,
    /// The peers it receives from (SRA's: those it sends to; the ring's: the previous rank).
    pub(super) from: Vec<usize>,
}

/// A peer's bytes of an exchange as the worker sends them: the peer, the send slot's first
/// byte, its length, the event after its encode (None: ready).
pub(super) type PostedSend = (usize, *const u8, usize, Option<Arc<dyn Event>>);

/// An exchange as the worker runs it: its events resolved.
pub(super) struct Posted {
    pub(super) rset: usize,
    pub(super) drained: Option<Arc<dyn Event>>,
    pub(super) sends: Vec<PostedSend>,
    pub(super) from: Vec<usize>,
}

/// What the enqueueing side posted so far.
struct Posts {
    exchanges: Vec<Exchange>,
    events: Vec<Arc<dyn Event>>,
    /// The events after the encodes (indices into `events`).
    encodes: Vec<usize>,
    /// Once the call is enqueued: the event after its last kernel (the caller's stream waits
    /// for it), or why enqueueing stopped.
    end: Option<Result<Arc<dyn Event>>>,
    /// Exchanges released to the stream so far.
    released: usize,
}

/// One call's device work, shared by the side that enqueues it and the worker.
pub(super) struct Board {
    /// Page-locked wire: send slot i of set k at `k·2n + i`, receive slot p at `k·2n + n + p`.
    wire: *mut u8,
    pub(super) slot: usize,
    pub(super) n: usize,
    pub(super) words: Arc<Words>,
    /// Exchange x's received bytes are released to the stream by storing `base + x + 1`.
    pub(super) base: u32,
    /// The exchanges the schedule makes.
    pub(super) total: usize,
    posts: Mutex<Posts>,
    posted: Condvar,
    /// True once the device is known done with the call (its `done` event, or the stream
    /// synchronised after a failed enqueue).
    finished: AtomicBool,
}

// SAFETY: the raw pointers address the comm's page-locked wire, which is replaced only once
// every call enqueued before is done (`DeviceState::reserve` waits for `moved`), so it
// outlives the Board whichever thread holds it; the events are Send + Sync, the rest is
// behind the mutex or atomic.
unsafe impl Send for Board {}
// SAFETY: as above.
unsafe impl Sync for Board {}

impl Board {
    /// The board of a call on `n` ranks over `wire` (slots of `slot` bytes), making `total`
    /// exchanges released by progress values after `base`.
    pub(super) fn new(
        (wire, slot, n): (*mut u8, usize, usize),
        words: Arc<Words>,
        base: u32,
        total: usize,
    ) -> Arc<Board> {
        Arc::new(Board {
            wire,
            slot,
            n,
            words,
            base,
            total,
            posts: Mutex::new(Posts {
                exchanges: Vec::new(),
                events: Vec::new(),
                encodes: Vec::new(),
                end: None,
                released: 0,
            }),
            posted: Condvar::new(),
            finished: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Posts> {
        self.posts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Send slot `i` of set `k`.
    pub(super) fn send_slot(&self, k: usize, i: usize) -> *mut u8 {
        self.wire.wrapping_add((k * 2 * self.n + i) * self.slot)
    }

    /// Receive slot `p` of set `k`.
    pub(super) fn recv_slot(&self, k: usize, p: usize) -> *mut u8 {
        self.send_slot(k, self.n + p)
    }

    /// Posts an event; its index.
    pub(super) fn post_event(&self, e: Box<dyn Event>, encode: bool) -> usize {
        let mut p = self.lock();
        p.events.push(Arc::from(e));
        let i = p.events.len() - 1;
        if encode {
            p.encodes.push(i);
        }
        i
    }

    /// Posts the next exchange (the worker may run it from now on); its index.
    pub(super) fn post_exchange(&self, ex: Exchange) -> usize {
        let mut p = self.lock();
        p.exchanges.push(ex);
        self.posted.notify_all();
        p.exchanges.len() - 1
    }

    /// Exchanges posted so far.
    pub(super) fn exchanges(&self) -> usize {
        self.lock().exchanges.len()
    }

    /// Ends the posting: the call's `done` event, or why it stopped.
    pub(super) fn end(&self, end: Result<Box<dyn Event>>) {
        let mut p = self.lock();
        p.end = Some(end.map(Arc::from));
        self.posted.notify_all();
    }

    /// Waits (at most `timeout`) for `f` to give an answer from the posts.
    fn wait_for<R>(
        &self,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut(&Posts) -> Option<Result<R>>,
    ) -> Result<R> {
        let deadline = Instant::now().checked_add(timeout);
        let mut p = self.lock();
        loop {
            if let Some(r) = f(&p) {
                return r;
            }
            let left = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(Error::Timeout(format!(
                    "compressed all-reduce on device buffers: {what} was not enqueued after \
                     {timeout:?}"
                )));
            }
            p = self
                .posted
                .wait_timeout(p, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Exchange `x`, once posted (waiting at most `timeout`); an error if enqueueing stopped
    /// before it.
    pub(super) fn exchange(&self, x: usize, timeout: Duration) -> Result<Posted> {
        self.wait_for(timeout, &format!("exchange {x} of the call"), |p| {
            if let Some(ex) = p.exchanges.get(x) {
                let ev = |i: Option<usize>| i.map(|i| p.events[i].clone());
                return Some(Ok(Posted {
                    rset: ex.rset,
                    drained: ev(ex.drained),
                    sends: ex
                        .sends
                        .iter()
                        .map(|&(peer, at, len, e)| (peer, at, len, ev(e)))
                        .collect(),
                    from: ex.from.clone(),
                }));
            }
            match &p.end {
                Some(Err(e)) => Some(Err(e.clone())),
                Some(Ok(_)) => Some(Err(Error::Internal(format!(
                    "exchange {x} of the call was not enqueued (it enqueued {})",
                    p.exchanges.len()
                )))),
                None => None,
            }
        })
    }

    /// The call's `done` event once it is all enqueued (waiting at most `timeout`), or why
    /// enqueueing stopped.
    pub(super) fn done(&self, timeout: Duration) -> Result<Arc<dyn Event>> {
        self.wait_for(timeout, "the end of the call", |p| p.end.clone())
    }

    /// Moves `*cursor` past the posted encodes that are done (one stream runs them in
    /// order); true when one posted is still queued.
    pub(super) fn encodes_queued(&self, cursor: &mut usize) -> bool {
        let p = self.lock();
        while let Some(&i) = p.encodes.get(*cursor) {
            if !p.events[i].query().unwrap_or(true) {
                break;
            }
            *cursor += 1;
        }
        *cursor < p.encodes.len()
    }

    /// Lets the stream run the decodes of exchanges up to `x` (exclusive). Either side may
    /// call it: the value only grows.
    pub(super) fn release(&self, x: usize) {
        let mut p = self.lock();
        if x > p.released {
            p.released = x;
            self.words
                .progress()
                .store(self.base.wrapping_add(x as u32), Ordering::Release);
        }
    }

    /// Where the call stands, for a timeout's message: what was posted and released, and
    /// the progress word the stream waits on (a hang on a GPU shows only there).
    pub(super) fn state(&self) -> String {
        let p = self.lock();
        let end = match &p.end {
            None => "still enqueueing",
            Some(Ok(_)) => "all enqueued",
            Some(Err(_)) => "enqueueing failed",
        };
        format!(
            "exchanges posted {} of {}, released {} (progress word {}, the call's waits from \
             {}), {} encode events posted, {end}",
            p.exchanges.len(),
            self.total,
            p.released,
            self.words.progress().load(Ordering::Acquire),
            self.base.wrapping_add(1),
            p.encodes.len(),
        )
    }

    /// Marks the device done with the call.
    pub(super) fn set_finished(&self) {
        self.finished.store(true, Ordering::Release);
    }
}

/// The worker's hold on a call's board; dropped once its bytes are moved (or never will be).
pub struct Script {
    pub(super) board: Arc<Board>,
    /// The comm's count of calls done (bytes moved, device work run), raised on drop.
    moved: Arc<AtomicU64>,
    timeout: Duration,
}

impl Script {
    /// The hold on `board`, counted in `moved` when dropped.
    pub(super) fn new(board: Arc<Board>, (moved, timeout): (Arc<AtomicU64>, Duration)) -> Script {
        Script {
            board,
            moved,
            timeout,
        }
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let b = &self.board;
        // Every wait of the call passes, done or failed, those not enqueued yet too: a stream
        // held at a progress value nobody stores would hold the caller's stream forever (on a
        // failure the result is undefined and the comm failed, as NCCL's).
        b.release(b.total);
        if !b.finished.load(Ordering::Acquire) {
            // Counted done only once the device no longer uses the comm's buffers (growing
            // them waits for that); waits, never an enqueue, so safe on the worker. A failed
            // enqueue synchronised its stream itself.
            if let Ok(d) = b.done(self.timeout) {
                let _ = d.synchronize(self.timeout);
            }
        }
        self.moved.fetch_add(1, Ordering::AcqRel);
    }
}
