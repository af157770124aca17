//! Dense all-reduces on device buffers across hosts, staged through page-locked memory piece
//! by piece instead of whole (`device.rs` copied everything in before the collective and out
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
//! - A compressed all-reduce on the hierarchical route with no GPU path (`gpu_hier.rs`: on
//!   a caller's stream, or where its levels cannot run on device memory), the CPU codecs
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
//! `Comm::on_stream`), using CUDA IPC or on one host's arena (`arena_turn.rs` has that
//! path), on other schedules (the tree and the all-gather scheme, for small calls), and
//! where a buffer is host memory.

use super::device_all_reduce::staged;
use super::hier::{self, Hier};
use super::route::AllReduceCall;
use super::{Comm, PreparedAllReduce, Report};
use crate::algo::{chunk_slices, PieceIo};
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::driver::Driver;
use crate::gpu::staging::{self, Band, Banded, Staging};
use crate::tuning::{Flat, Links};
use crate::types::{DType, ReduceOp};
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Whose schedule the pieces are.
enum Schedule {
    Hier(Arc<Hier>),
    /// The flat SRA or ring over sockets.
    Flat(Flat),
    /// A compressed all-reduce on the hierarchy, the CPU codecs encoding.
    Coded(Arc<PreparedAllReduce>),
}

/// A dense all-reduce across hosts cut in bands, ready to start.
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
        self.cut_in_bands(schedule, (count, dtype, op), pieces, send, recv)
    }

    /// The compressed all-reduce `call` on the hierarchy cut in bands, its pieces the
    /// hierarchy's (QCCL_CHUNKSIZE of f32s each), when its buffers are all device memory and
    /// it has at least one element; None otherwise (as `bands_of`). For calls without a GPU
    /// path (`gpu_hier.rs`): on a caller's stream, or where its levels cannot run on
    /// device memory.
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
        self.cut_in_bands(Schedule::Coded(call.clone()), shape, pieces, send, recv)
    }

    /// True when this comm may stage calls in bands: no other rank in this process (see
    /// `Comm::on_stream`), no CUDA IPC.
    fn may_band(&self) -> bool {
        !self.place.process_peers && !self.place.cuda_ipc
    }

    /// A call of `shape` on `send` (None: in place) and `recv` cut in bands of its
    /// `pieces`' byte ranges, when all its buffers are device memory.
    fn cut_in_bands(
        &self,
        schedule: Schedule,
        (count, dtype, op): (usize, DType, ReduceOp),
        pieces: Vec<Vec<Range<usize>>>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        let len = count * dtype.size();
        let bufs = super::device::send_recv(send.map(|s| (s, len)), (recv, len));
        let Some((driver, _, ordinal)) = self.all_on_device(&bufs)? else {
            return Ok(None);
        };
        let ranges = pieces[0].len();
        // Larger calls put several pieces in a band.
        let per_band = pieces.len().div_ceil(staging::most_bands(ranges));
        let src = send.unwrap_or(recv);
        let bands: Vec<Band> = pieces
            .chunks(per_band)
            .map(|g| {
                // Range k of every piece of the band is contiguous (one chunk, or the
                // buffer): one copy each way.
                let (mut ins, mut outs) = (Vec::new(), Vec::new());
                for (first, last) in g[0].iter().zip(&g[g.len() - 1]) {
                    let (a, b) = (first.start, last.end);
                    if b > a {
                        ins.push((src + a as u64, a, b - a));
                        outs.push((recv + a as u64, a, b - a));
                    }
                }
                Band { ins, outs }
            })
            .collect();
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: all_reduce(count={count}, {dtype}, {op}) on device \
             {ordinal}: {}, staged in {} pieces, {} bands",
            self.rank,
            self.comm_id,
            match schedule {
                Schedule::Hier(_) => "hierarchical",
                Schedule::Flat(Flat::Ring) => "ring",
                Schedule::Flat(_) => "SRA",
                Schedule::Coded(_) => "compressed hierarchical",
            },
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

    /// As [`Comm::enqueue_all_reduce_dense_at`] for a dense all-reduce across hosts:
    /// enqueued on the caller's `stream` (not null) in bands and returning at once. False
    /// (nothing done) when the call does not take that path.
    ///
    /// # Safety
    /// As [`Comm::enqueue_all_reduce_dense_at`].
    pub(super) unsafe fn enqueue_in_bands(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        let Some(plan) = self.bands_of(call, send, recv)? else {
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
        };
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(report)
    }
}

/// Pieces of elements of `es` bytes as pieces of one byte range each.
fn byte_ranges(pieces: Vec<Range<usize>>, es: usize) -> Vec<Vec<Range<usize>>> {
    let bytes = pieces.into_iter().map(|r| r.start * es..r.end * es);
    bytes.map(|r| std::iter::once(r).collect()).collect()
}

/// The pieces of a call in bands of `per_band` pieces.
struct BandIo<'a> {
    banded: &'a Banded,
    per_band: usize,
    pieces: usize,
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
