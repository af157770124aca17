//! The device side of a compressed hierarchical all-reduce made on a caller's stream with
//! the codecs on the GPU (`comm/gpu_hier_stream.rs` runs the host side in the comm's turn).
//! Such a call must return once enqueued, with every device operation of it enqueued by
//! then (`staging.rs` says why), so the levels that run on the host (the intra-host
//! reduce-scatter and all-gather through the arena, on a page-locked copy staged in bands)
//! and those on the GPU (each piece's part, encoded and decoded by the codecs' kernels) are
//! tied together by waits enqueued now:
//! - the lane's stream: the input plus the residual folded into the receive buffer (f32, as
//!   the host's `coded_turn`), then (the caller's `stage`) each band's copy to the
//!   page-locked copy; then per piece a wait for the `summed` word (the worker stores it
//!   once the piece's intra-host sums are in the page-locked copy), this rank's part copied
//!   in, the part's compressed all-reduce (`enqueue_on`, as a flat call's, its script
//!   posted on the call's `PieceBoard` before its work), its result copied back and an
//!   event the worker waits for before the piece's all-gather;
//! - the caller's stream: each band's copies out behind its value of the staging word
//!   (released once the band's all-gathers are done), then Avg's division.
//!
//! Every allocation (the residual, the parts' room, the page-locked copy) comes before the
//! caller's stream is held: CUDA orders an allocation behind all earlier work, the held
//! stream included, which would wait for parts not yet enqueued.

use super::script::Script;
use super::state::{DeviceState, GpuLane, Words};
use super::GpuAllReduce;
use crate::error::{Error, Result};
use crate::gpu::driver::{Event, Stream};
use crate::types::ReduceOp;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One piece of a hierarchical call on a stream: this rank's part of it (elements of the
/// call) and the part's compressed all-reduce among the hosts (None: the part is empty, on
/// every rank of the inter-host comm alike).
pub(crate) struct StreamPiece {
    pub(crate) mine: Range<usize>,
    pub(crate) part: Option<GpuAllReduce>,
}

/// What the caller's thread (enqueueing) and the comm's worker (moving) share for one
/// hierarchical call on a stream (or HiTopK's, `topk_stream.rs`): the `summed` values the
/// lane's stream waits on (one per piece or step), each part's script and the event the
/// worker waits for before its next level (after a part's result was copied back).
pub(crate) struct PieceBoard {
    words: Arc<Words>,
    /// Piece p's sums are released by storing `base + p + 1`.
    base: u32,
    pieces: usize,
    posts: Mutex<Posts>,
    posted: Condvar,
}

struct Posts {
    scripts: Vec<Option<Script>>,
    events: Vec<Option<Box<dyn Event>>>,
    /// Why the call stopped: posts are refused, waits return it, every value is stored.
    failed: Option<Error>,
}

impl PieceBoard {
    fn new(words: Arc<Words>, base: u32, pieces: usize) -> PieceBoard {
        PieceBoard {
            words,
            base,
            pieces,
            posts: Mutex::new(Posts {
                scripts: (0..pieces).map(|_| None).collect(),
                events: (0..pieces).map(|_| None).collect(),
                failed: None,
            }),
            posted: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Posts> {
        self.posts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Piece `p`'s intra-host sums are in the page-locked copy (pieces in order): the
    /// lane's stream may copy its part in.
    pub(crate) fn summed(&self, p: usize) {
        let posts = self.lock();
        if posts.failed.is_none() {
            let value = self.base.wrapping_add(p as u32 + 1);
            self.words.summed().store(value, Ordering::Release);
        }
    }

    /// The call stopped (`why`): every wait of the lane's stream passes from now on (to an
    /// undefined result: the comm failed), posts are refused and waits for them fail. The
    /// scripts posted and not taken are dropped now, which releases their exchanges: the
    /// caller's thread may be blocked enqueueing behind their progress waits (a stream
    /// holds only so many operations), holding its reference to the board.
    pub(crate) fn fail(&self, why: Error) {
        let posted: Vec<Script> = {
            let mut posts = self.lock();
            if posts.failed.is_none() {
                posts.failed = Some(why);
            }
            let last = self.base.wrapping_add(self.pieces as u32);
            self.words.summed().store(last, Ordering::Release);
            self.posted.notify_all();
            posts.scripts.iter_mut().filter_map(Option::take).collect()
        };
        // Outside the lock: a script's drop waits for its part's enqueueing to end.
        drop(posted);
    }

    /// Part `p`'s script, once posted (waiting at most `timeout`).
    pub(crate) fn script(&self, p: usize, timeout: Duration) -> Result<Script> {
        self.wait(p, timeout, "its script", |posts| posts.scripts[p].take())
    }

    /// The event posted for piece `p` (after its result was copied back), once posted (at
    /// most `timeout`).
    pub(crate) fn event(&self, p: usize, timeout: Duration) -> Result<Box<dyn Event>> {
        self.wait(p, timeout, "its event", |posts| posts.events[p].take())
    }

    /// True once a decode on the lane found bytes its codec refuses (sticky: the comm
    /// fails).
    pub(crate) fn refused(&self) -> bool {
        self.words.bad()
    }

    fn wait<R>(
        &self,
        p: usize,
        timeout: Duration,
        what: &str,
        mut take: impl FnMut(&mut Posts) -> Option<R>,
    ) -> Result<R> {
        let deadline = Instant::now() + timeout;
        let mut posts = self.lock();
        loop {
            if let Some(r) = take(&mut posts) {
                return Ok(r);
            }
            if let Some(e) = &posts.failed {
                return Err(e.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(format!(
                    "piece {p} of a hierarchical compressed all-reduce on a stream: {what} \
                     was not enqueued after {timeout:?}"
                )));
            }
            posts = self
                .posted
                .wait_timeout(posts, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// True once the call stopped (`fail`).
    pub(super) fn stopped(&self) -> bool {
        self.lock().failed.is_some()
    }

    /// A board for a call of `pieces` pieces on the device state `st`, its `summed` values
    /// reserved, handed to the worker with `held` through `hand` (which gives `held` back
    /// when the comm failed: then an error naming `what`).
    pub(super) fn handed<B>(
        st: &mut DeviceState,
        pieces: usize,
        held: B,
        hand: impl FnOnce(B, Arc<PieceBoard>) -> std::result::Result<(), B>,
        what: &str,
    ) -> Result<Arc<PieceBoard>> {
        let base = st.summed_seq;
        st.summed_seq = base.wrapping_add(pieces as u32);
        let board = Arc::new(PieceBoard::new(st.words.clone(), base, pieces));
        if hand(held, board.clone()).is_err() {
            return Err(Error::Aborted(format!(
                "{what}: the comm failed before the call was enqueued"
            )));
        }
        Ok(board)
    }

    /// Ends the caller's enqueueing on `st` with `enqueued`: an error fails the board (and
    /// tells the lane's marks when the stream failed), unless the call had already stopped
    /// in the comm's turn (the worker failed first, refusing this call's later posts): the
    /// call was handed and then failed, which the comm's asynchronous error reports, so the
    /// caller's call returns as enqueued. Every wait of the streams passes either way.
    pub(super) fn end_enqueue(&self, st: &DeviceState, enqueued: Result<()>) -> Result<()> {
        if enqueued.is_err() {
            st.note_if_failed();
        }
        match enqueued {
            Err(_) if self.stopped() => Ok(()),
            Err(e) => {
                self.fail(e.clone());
                Err(e)
            }
            Ok(()) => Ok(()),
        }
    }

    /// Posts part `p`'s script; gives it back once the call stopped.
    fn post_script(&self, p: usize, script: Script) -> std::result::Result<(), Script> {
        let mut posts = self.lock();
        if posts.failed.is_some() {
            return Err(script);
        }
        posts.scripts[p] = Some(script);
        self.posted.notify_all();
        Ok(())
    }

    pub(super) fn post_event(&self, p: usize, event: Box<dyn Event>) {
        self.lock().events[p] = Some(event);
        self.posted.notify_all();
    }
}

impl Drop for PieceBoard {
    fn drop(&mut self) {
        // Every wait passes, those of pieces never summed too (a failed call).
        let last = self.base.wrapping_add(self.pieces as u32);
        self.words.summed().store(last, Ordering::Release);
    }
}

impl GpuAllReduce {
    /// Enqueues a hierarchical call on float32 (this, the whole call: its residual and Avg)
    /// as step `step` behind the work on `caller` (see the module): room for every part of
    /// `pieces` first, the residual folded in on the lane's stream, then `stage` (given the
    /// lane's stream) starts the bands (copies in behind the fold, copies out on the
    /// caller's stream) and returns them with the page-locked copy's address; `hand` gives
    /// them and the call's board to the worker (it gives them back when the comm failed),
    /// and each piece's part is enqueued. An error after `hand` fails the board.
    pub(crate) fn enqueue_pieces<B>(
        &self,
        lane: &GpuLane,
        step: u64,
        caller: &dyn Stream,
        pieces: &[StreamPiece],
        stage: impl FnOnce(&dyn Stream) -> Result<(B, *mut u8)>,
        hand: impl FnOnce(B, Arc<PieceBoard>) -> std::result::Result<(), B>,
    ) -> Result<()> {
        let mut guard = lane.locked((&*self.driver, self.ordinal))?;
        let st = guard.as_mut().expect("made by locked");
        let wait = (&*lane.moved, self.timeout);
        let key = self.key.as_ref().filter(|_| self.plan.error_feedback());
        let forgotten = lane.take_forgotten();
        let res = st.residual(&*self.driver, key, self.count, forgotten, wait)?;
        for g in pieces.iter().filter_map(|p| p.part.as_ref()) {
            let sizes = g.sizes(g.shape())?;
            st.reserve(&*self.driver, &sizes, g.n, &lane.moved, self.timeout)?;
        }
        st.stream.wait_event(&*caller.record()?)?;
        st.compensate(self.send.unwrap_or(self.recv), res, self.recv, self.count)?;
        let (bands, pinned) = stage(&*st.stream)?;
        let base = st.summed_seq;
        let what = "compressed all-reduce on device buffers";
        let board = PieceBoard::handed(st, pieces.len(), bands, hand, what)?;
        let enqueued = (|| -> Result<()> {
            for (i, p) in pieces.iter().enumerate() {
                let Some(g) = &p.part else {
                    continue;
                };
                let (at, len) = (4 * p.mine.start, 4 * p.mine.len());
                let dev = self.recv + at as u64;
                let summed = base.wrapping_add(i as u32 + 1);
                // SAFETY: the word is the lane's page-locked `summed` word, alive as long as
                // the lane; the part's `len` bytes lie in the call's receive buffer (valid
                // until the stream passed the call: the caller's promise) and in the
                // page-locked copy of the call's bytes, the call's until its bands end
                // (after this part's copy back: the worker waits for its event first).
                unsafe {
                    st.stream.wait_word(st.words.summed_ptr(), summed)?;
                    st.stream.copy_to_device(dev, pinned.add(at), len)?;
                }
                g.enqueue_on(st, lane, step, None, |script| board.post_script(i, script))?;
                // SAFETY: as above.
                unsafe { st.stream.copy_to_host(pinned.add(at), dev, len)? };
                board.post_event(i, st.mark()?);
            }
            if self.op == ReduceOp::Avg {
                // After every band's copies out, on the caller's stream.
                self.divide_on(caller, &*st.avg, self.recv)?;
            }
            Ok(())
        })();
        board.end_enqueue(st, enqueued)
    }

    /// Moves the bytes of a hierarchical call's part enqueued by `enqueue_pieces` on `e`
    /// (the inter-host comm's engine, in its turn) and returns once its device work is
    /// done: what its exchanges did.
    pub(crate) fn move_part(
        &self,
        e: &mut crate::coll::Engine,
        mut script: Script,
    ) -> Result<super::DeviceStats> {
        let moved = self.move_bytes(e, &mut script);
        self.wait_done(script, moved)
    }

    /// The receive buffer and the call's elements.
    pub(crate) fn recv_count(&self) -> (u64, usize) {
        (self.recv, self.count)
    }
}
