//! Dense collectives on device buffers across hosts (and broadcasts and reduces anywhere),
//! staged through page-locked memory piece by piece instead of whole (`device.rs` copied everything in before the collective and out
//! after it): the pieces of the host path's own schedule are the call's bands
//! (`Staging::start_banded`), so the copies in of one piece and the copies out of another
//! overlap the collective's work on a third.
//! - The hierarchical route (the multi-host default, `hier.rs`): a piece is one of its
//!   pipelined pieces (QCCL_CHUNKSIZE); it starts its intra-host reduce-scatter once landed
//!   and is done after its intra-host all-gather.
//! - The flat SRA over sockets (3 to 8 hosts of one rank each, or QCCL_ALGO=sra) and the
//!   ring (2 hosts of one rank from 64 KiB, or QCCL_ALGO=ring): a piece is slice j of every
//!   rank's chunk (`algo::chunk_slices`); the first step on slice j (the SRA's
//!   scatter-reduce, the ring's first reduce-scatter step) waits for it, the last (the
//!   all-gather's) ends it.
//! - Reduce-scatter and all-gather over the ring (their only schedule across hosts): a piece
//!   is slice j of every rank's part of the n-part buffer; a reduce-scatter's first step on
//!   slice j waits for it and its result (this rank's part) goes out at the end, an
//!   all-gather's first step waits for slice j of its own part and its last step on slice j
//!   ends it (`Comm::coll_bands_of`).
//! - Broadcast and reduce over the chain, on any links (one host's too): a piece is one of
//!   the chain's slices, started once this rank's input of it landed and done once passed
//!   on (`rooted_bands.rs`).
//! - A compressed all-reduce on the hierarchical route with no GPU path (`gpu_hier.rs`:
//!   another type than float32 on a caller's stream, or where its levels cannot run on
//!   device memory), the CPU codecs
//!   encoding: a piece is one of the hierarchy's pieces of f32s
//!   (`PreparedAllReduce::run_in_pieces`).
//!
//! Every copy is enqueued when the call starts: on a caller's stream the call returns then
//! (NCCL's semantics; the stream waits for each band's release), calls that return once done
//! (a null stream, queued calls in the comm's turn) copy out on a stream of qccl's own and
//! wait for it (`Staging::start_banded_waiting`). The worker runs the host path's collective
//! on the page-locked copy and enqueues no device work (`staging.rs` says why). The frames
//! are the host path's, so host and device ranks of one job mix freely and end
//! bit-identical.
//!
//! Not taken (staged whole) on comms with another rank in this process (see
//! `Comm::on_stream`) or using CUDA IPC, for all-reduces, reduce-scatters and all-gathers
//! on one host's arena (`arena_turn.rs` has that path), on other schedules (the tree and
//! the all-gather scheme, for small calls), and where a buffer is host memory.

use super::dense_call::DenseCall;
use super::device_all_reduce::staged;
use super::hier::{self, Hier};
use super::route::AllReduceCall;
use super::{Comm, PreparedAllReduce, Report};
use crate::algo::{chunk_slices, PieceIo};
use crate::coll::call::{Coll, CollCall};
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::driver::Driver;
use crate::gpu::staging::{self, Band, Banded, CallBuf, Staging};
use crate::tuning::{Flat, Links};
use crate::types::{DType, ReduceOp};
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Whose schedule the pieces are.
pub(super) enum Schedule {
    Hier(Arc<Hier>),
    /// The flat SRA or ring over sockets.
    Flat(Flat),
    /// A compressed all-reduce on the hierarchy, the CPU codecs encoding.
    Coded(Arc<PreparedAllReduce>),
    /// A reduce-scatter or all-gather over the ring, or a broadcast or reduce over the
    /// chain from its root.
    Coll(Coll, usize),
}

impl Schedule {
    /// The call and its schedule, for logs.
    fn names(&self) -> (&'static str, &'static str) {
        match self {
            Schedule::Hier(_) => ("all_reduce", "hierarchical"),
            Schedule::Flat(Flat::Ring) => ("all_reduce", "ring"),
            Schedule::Flat(_) => ("all_reduce", "SRA"),
            Schedule::Coded(_) => ("all_reduce", "compressed hierarchical"),
            Schedule::Coll(c @ (Coll::Broadcast | Coll::Reduce), _) => (c.name(), "chain"),
            Schedule::Coll(c, _) => (c.name(), "ring"),
        }
    }
}

/// The device addresses range k of a piece at offset `at` of a call's page-locked copy is
/// copied in from and out to (None: not copied that way).
pub(super) type Ends<'a> = &'a dyn Fn(usize, usize) -> (Option<u64>, Option<u64>);

/// A call across hosts cut in bands, ready to start.
pub(super) struct Bands {
    schedule: Schedule,
    shape: (usize, DType, ReduceOp),
    bands: Vec<Band>,
    pieces: usize,
    per_band: usize,
    /// The page-locked copy's bytes (the call's).
    len: usize,
    calls: Arc<AtomicU64>,
    /// The buffers' driver and device.
    pub(super) driver: Arc<dyn Driver>,
    pub(super) ordinal: usize,
}

impl Comm {
    /// The all-reduce `call` on `send` (None: in place) and `recv` cut in bands, when it is
    /// a dense one of at least one element on a schedule that has pieces (see the module)
    /// whose buffers are all device memory, on a comm that may hold a stream for it; None
    /// otherwise.
    pub(super) fn bands_of(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        let (count, dtype, op) = call.shape();
        if count == 0 || !self.may_band() {
            return Ok(None);
        }
        let es = dtype.size();
        // Each piece's byte ranges.
        let (schedule, pieces): (Schedule, Vec<Vec<Range<usize>>>) = match call.hier() {
            Some(h) => (
                Schedule::Hier(h.clone()),
                byte_ranges(h.pieces(count, es), es),
            ),
            None if self.size > 1 && self.links != Links::Arena => {
                let (f, slice) = match call.flat() {
                    Some(Flat::Sra) => (Flat::Sra, self.config.sra_slice_bytes(self.size)),
                    Some(Flat::Ring) => (Flat::Ring, self.config.slice_bytes()),
                    _ => return Ok(None),
                };
                (Schedule::Flat(f), chunk_slices(count, self.size, es, slice))
            }
            None => return Ok(None),
        };
        self.cut_all_reduce(schedule, (count, dtype, op), pieces, send, recv)
    }

    /// An all-reduce of `shape` on `send` (None: in place) and `recv` cut in bands of its
    /// `pieces` (`cut_in_bands`): the page-locked copy laid out as the buffers, every byte
    /// copied in from the input and out to `recv`.
    fn cut_all_reduce(
        &self,
        schedule: Schedule,
        shape: (usize, DType, ReduceOp),
        pieces: Vec<Vec<Range<usize>>>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        let len = shape.0 * shape.1.size();
        let bufs = super::device::send_recv(send.map(|s| (s, len)), (recv, len));
        let src = send.unwrap_or(recv);
        let ends = |_: usize, at: usize| (Some(src + at as u64), Some(recv + at as u64));
        self.cut_in_bands(schedule, shape, pieces, (len, bufs), &ends)
    }

    /// The dense reduce-scatter or all-gather `call` on `send` (None: in place, NCCL's
    /// layouts) and `recv` over the ring cut in bands of slices (`algo::chunk_slices` of
    /// the n parts with the ring's slice: slice j of every part), when it has at least one
    /// element per rank on a comm of more than one rank without a shared-memory arena that
    /// may band (`may_band`), its buffers all device memory; None otherwise. The
    /// page-locked copy is the whole n-part buffer: a reduce-scatter's input comes in whole
    /// and this rank's part goes out; an all-gather's own part comes in and every part goes
    /// out (in place, every other part).
    pub(super) fn coll_bands_of(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        let (n, r, coll) = (self.size, self.rank, call.coll);
        if matches!(coll, Coll::Broadcast | Coll::Reduce) {
            return self.rooted_bands_of(call, send, recv);
        }
        let collective = matches!(coll, Coll::ReduceScatter | Coll::AllGather);
        let arena = self.links == Links::Arena;
        if call.count == 0 || n < 2 || !collective || arena || !self.may_band() {
            return Ok(None);
        }
        let (es, part) = (call.dtype.size(), call.count * call.dtype.size());
        let in_place = send.is_none();
        let dense = DenseCall::Coll(call);
        let (send_len, recv_len) = dense.lens(n, in_place);
        let bufs = super::device::send_recv(send.map(|s| (s, send_len)), (recv, recv_len));
        let pieces = chunk_slices(call.count * n, n, es, self.config.slice_bytes());
        let (src, mine) = (dense.src(r, send, recv), (r * part) as u64);
        let ends = |k: usize, at: usize| {
            let at = at as u64;
            if coll == Coll::ReduceScatter {
                let out = if in_place {
                    recv + at
                } else {
                    recv + at - mine
                };
                (Some(src + at), (k == r).then_some(out))
            } else {
                let out = (!in_place || k != r).then_some(recv + at);
                ((k == r).then(|| src + at - mine), out)
            }
        };
        let shape = (call.count, call.dtype, call.op);
        let schedule = Schedule::Coll(coll, 0);
        self.cut_in_bands(schedule, shape, pieces, (part * n, bufs), &ends)
    }

    /// The dense call `call` cut in bands (`bands_of`, `coll_bands_of`), when it takes that
    /// path.
    pub(super) fn dense_bands_of(
        &self,
        call: DenseCall<'_>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        match call {
            DenseCall::AllReduce(c) => self.bands_of(c, send, recv),
            DenseCall::Coll(c) => self.coll_bands_of(c, send, recv),
        }
    }

    /// The compressed all-reduce `call` on the hierarchy cut in bands, its pieces the
    /// hierarchy's (QCCL_CHUNKSIZE of f32s each), when its buffers are all device memory and
    /// it has at least one element; None otherwise (as `bands_of`). For calls without a GPU
    /// path (`gpu_hier.rs`): another type than float32 on a caller's stream, or where its
    /// levels cannot run on device memory.
    pub(super) fn coded_bands_of(
        &self,
        call: &Arc<PreparedAllReduce>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        let shape = call.shape();
        let (count, dtype, _) = shape;
        let Some(h) = call.hier() else {
            return Ok(None);
        };
        if count == 0 || !self.may_band() {
            return Ok(None);
        }
        let es = dtype.size();
        let pieces = byte_ranges(h.pieces(count, 4), es);
        self.cut_all_reduce(Schedule::Coded(call.clone()), shape, pieces, send, recv)
    }

    /// True when this comm may stage calls in bands: no other rank in this process (see
    /// `Comm::on_stream`), no CUDA IPC.
    pub(super) fn may_band(&self) -> bool {
        !self.place.process_peers && !self.place.cuda_ipc
    }

    /// A call of `shape` on `bufs` through a page-locked copy of `len` bytes cut in bands of
    /// its `pieces`' byte ranges (offsets into the copy), each range's copies to and from
    /// the device where `ends` says, when all its buffers are device memory.
    pub(super) fn cut_in_bands(
        &self,
        schedule: Schedule,
        (count, dtype, op): (usize, DType, ReduceOp),
        pieces: Vec<Vec<Range<usize>>>,
        (len, bufs): (usize, Vec<CallBuf>),
        ends: Ends<'_>,
    ) -> Result<Option<Bands>> {
        let Some((driver, _, ordinal)) = self.all_on_device(&bufs)? else {
            return Ok(None);
        };
        let (bands, per_band) = group_in_bands(&pieces, ends);
        let (what, how) = schedule.names();
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: {what}(count={count}, {dtype}, {op}) on device \
             {ordinal}: {how}, staged in {} pieces, {} bands",
            self.rank,
            self.comm_id,
            pieces.len(),
            bands.len()
        );
        Ok(Some(Bands {
            schedule,
            shape: (count, dtype, op),
            bands,
            pieces: pieces.len(),
            per_band,
            len,
            calls: self.piecewise_calls.clone(),
            driver,
            ordinal,
        }))
    }

    /// As [`Comm::enqueue_all_reduce_dense_at`] for a dense call across hosts (an
    /// all-reduce, reduce-scatter or all-gather: `dense_bands_of`): enqueued on the caller's
    /// `stream` (not null) in bands and returning at once. False (nothing done) when the
    /// call does not take that path.
    ///
    /// # Safety
    /// As [`Comm::enqueue_all_reduce_dense_at`].
    pub(super) unsafe fn enqueue_in_bands(
        &self,
        call: DenseCall<'_>,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        let Some(plan) = self.dense_bands_of(call, send, recv)? else {
            return Ok(false);
        };
        // SAFETY: the caller's promise, passed on.
        unsafe { self.enqueue_plan(plan, stream) }?;
        Ok(true)
    }

    /// Enqueues the call `plan` (`bands_of`, `coded_bands_of`) on the caller's `stream` (not
    /// null) in bands and returns at once.
    ///
    /// # Safety
    /// As [`Comm::enqueue_all_reduce_dense_at`].
    pub(super) unsafe fn enqueue_plan(&self, mut plan: Bands, stream: *mut c_void) -> Result<()> {
        let (driver, ordinal, len) = (plan.driver.clone(), plan.ordinal, plan.len);
        let bands = std::mem::take(&mut plan.bands);
        let coded = Some(plan.coded_calls());
        // SAFETY: the caller's promise, passed on.
        unsafe {
            self.enqueue_banded(
                (driver, ordinal),
                (len, &bands),
                stream,
                coded,
                move |e, b| plan.run(e, b).map(drop),
            )
        }
    }

    /// Runs `plan` ordered on the caller's `stream` (null: the legacy default stream) in
    /// the comm's turn and returns once the result is on the device (blocking calls);
    /// a compressed call's report.
    ///
    /// # Safety
    /// The call's buffers must be valid, and touched by nothing else, until this returns;
    /// `stream` null or a live stream of their device.
    pub(super) unsafe fn run_bands_waiting(
        &self,
        plan: Bands,
        stream: *mut c_void,
    ) -> Result<Option<Report>> {
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, plan.driver.clone(), plan.ordinal)?;
        // SAFETY: the caller's promise, passed on.
        self.execute(|e| unsafe { plan.run_waiting(e, st, stream) })
    }

    /// Queues `plan` behind the comm's earlier operations and returns at once (the C
    /// ABI's non-blocking calls): in the comm's turn it waits for the work on the legacy
    /// default stream, and the request ends once the result is on the device.
    ///
    /// # Safety
    /// The call's buffers must stay valid until the request has ended.
    pub(super) unsafe fn submit_bands(&self, plan: Bands) -> Result<crate::Request<()>> {
        let (driver, ordinal) = (plan.driver.clone(), plan.ordinal);
        let coded = Some(plan.coded_calls());
        self.submit_with_staging(driver, ordinal, coded, move |e, st| {
            // SAFETY: the caller's promise, passed on; the legacy default stream.
            unsafe { plan.run_waiting(e, st, std::ptr::null_mut()) }.map(drop)
        })
    }

    /// Starts a call on device memory `device` (driver, ordinal) in `bands` through a
    /// page-locked buffer of `len` bytes on the caller's `stream` (`Staging::start_banded`)
    /// and queues `job`, which runs its collective on the buffer in the comm's turn and
    /// `coded` compressed calls (`Queue::submit_holding`). The
    /// request is not kept: the stream and `async_error` report the outcome; the Banded
    /// releases the stream when dropped, after a failure is recorded.
    ///
    /// # Safety
    /// Each band's device ranges must stay valid until the stream passes the call, and
    /// `stream` be a live stream of their device.
    pub(super) unsafe fn enqueue_banded(
        &self,
        (driver, ordinal): (Arc<dyn Driver>, usize),
        (len, bands): (usize, &[Band]),
        stream: *mut c_void,
        coded: Option<u64>,
        job: impl FnOnce(&mut Engine, &mut Banded) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        self.refuse_if_failed()?;
        let banded = {
            let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            let st = self.staging_on(&mut guard, driver, ordinal)?;
            // SAFETY: the caller's promise.
            unsafe { st.start_banded(len, bands, stream)? }
        };
        self.queue.submit_holding(banded, coded, job).map(drop)
    }

    /// How many dense all-reduces on device buffers across hosts ran staged piece by piece
    /// (see the module) on this comm so far.
    #[doc(hidden)]
    pub fn piecewise_calls(&self) -> u64 {
        self.piecewise_calls.load(Ordering::Relaxed)
    }
}

impl Bands {
    /// How many compressed calls it runs (`Queue::submit_holding`).
    pub(super) fn coded_calls(&self) -> u64 {
        u64::from(matches!(self.schedule, Schedule::Coded(_)))
    }

    /// Starts the call (its copies after `raw`'s earlier work, null: the legacy default
    /// stream) on `st` and runs it on `e`, the comm's engine in its turn; returns once the
    /// result is in the device buffer, with a compressed call's report. For calls that
    /// return once done.
    ///
    /// # Safety
    /// The call's buffers must be valid, and touched by nothing else, until this returns;
    /// `raw` null or a live stream of their device.
    pub(super) unsafe fn run_waiting(
        &self,
        e: &mut Engine,
        st: &mut Staging,
        raw: *mut c_void,
    ) -> Result<Option<Report>> {
        // SAFETY: the caller's promise.
        let banded = unsafe { st.start_banded_waiting(self.len, &self.bands, raw)? };
        let report = self.run(e, &banded)?;
        banded.finish()?;
        Ok(report)
    }

    /// The collective on the page-locked copy, piece by piece as the bands land; a
    /// compressed call's report.
    fn run(&self, e: &mut Engine, banded: &Banded) -> Result<Option<Report>> {
        // SAFETY: the page-locked buffer holds the call's `len` bytes and is this call's
        // alone while the Banded lives; a band's bytes are read once landed and written
        // before it is released.
        let buf = unsafe { staged(banded.ptr(), self.len) };
        let io = BandIo {
            banded,
            per_band: self.per_band,
            pieces: self.pieces,
        };
        let report = match &self.schedule {
            Schedule::Hier(h) => {
                hier::all_reduce_in_pieces(h, None, buf, self.shape, &io).map(|()| None)?
            }
            Schedule::Flat(f) => e
                .all_reduce_in_slices(buf, self.shape, *f, &io)
                .map(|()| None)?,
            Schedule::Coded(c) => Some(c.run_in_pieces(e, buf, &io)?),
            Schedule::Coll(c, root) => e
                .coll_in_slices(buf, (*c, *root), self.shape, &io)
                .map(|()| None)?,
        };
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(report)
    }
}

/// `pieces` (each its byte ranges, offsets into the page-locked copy) grouped into bands,
/// each range's copies to and from the device where `ends` says: the bands and how many
/// pieces each holds (larger calls put several pieces in a band: `staging::most_bands`).
pub(super) fn group_in_bands(pieces: &[Vec<Range<usize>>], ends: Ends<'_>) -> (Vec<Band>, usize) {
    let per_band = pieces.len().div_ceil(staging::most_bands(pieces[0].len()));
    let bands = pieces
        .chunks(per_band)
        .map(|g| {
            // Range k of every piece of the band is contiguous (one chunk, or the buffer):
            // one copy each way at most.
            let (mut ins, mut outs) = (Vec::new(), Vec::new());
            for (k, (first, last)) in g[0].iter().zip(&g[g.len() - 1]).enumerate() {
                let (a, b) = (first.start, last.end);
                if b > a {
                    let (from, to) = ends(k, a);
                    ins.extend(from.map(|d| (d, a, b - a)));
                    outs.extend(to.map(|d| (d, a, b - a)));
                }
            }
            Band { ins, outs }
        })
        .collect();
    (bands, per_band)
}

/// Pieces of elements of `es` bytes as pieces of one byte range each.
pub(super) fn byte_ranges(pieces: Vec<Range<usize>>, es: usize) -> Vec<Vec<Range<usize>>> {
    let bytes = pieces.into_iter().map(|r| r.start * es..r.end * es);
    bytes.map(|r| std::iter::once(r).collect()).collect()
}

/// The pieces of a call in bands of `per_band` pieces.
pub(super) struct BandIo<'a> {
    pub(super) banded: &'a Banded,
    pub(super) per_band: usize,
    pub(super) pieces: usize,
}

impl PieceIo for BandIo<'_> {
    fn landed(&self, i: usize) -> Result<()> {
        self.banded.wait_landed(i / self.per_band)
    }

    fn done(&self, i: usize) {
        if (i + 1).is_multiple_of(self.per_band) || i + 1 == self.pieces {
            self.banded.release(i / self.per_band);
        }
    }
}
