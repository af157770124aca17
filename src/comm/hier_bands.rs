//! Dense hierarchical all-reduces on device buffers (the route a multi-host job takes by
//! default, `hier.rs`), staged through page-locked memory piece by piece: the call's
//! pipelined pieces are its bands (`Staging::start_banded`), so the copies in of one piece
//! and the copies out of another overlap the host levels of a third, where staging the
//! whole buffers (`device.rs`) copied everything in before the first level and out after
//! the last.
//!
//! Every copy is enqueued when the call starts: on a caller's stream the call returns
//! then (NCCL's semantics; the stream waits for each band's release), calls that return
//! once done (a null stream, queued calls in the comm's turn) copy out on a stream of
//! qccl's own and wait for it (`Staging::start_banded_waiting`). The worker runs the host's
//! levels on the page-locked copy, each piece once its band landed, and releases a band
//! once its pieces' all-gathers are done; it enqueues no device work (`staging.rs` says
//! why). The pieces and collectives are the host path's, so host and device ranks of one
//! job mix freely and end bit-identical.
//!
//! Not taken (staged whole, as before) on comms with another rank in this process (see
//! `Comm::on_stream`) or using CUDA IPC, and where a buffer is host memory.

use super::device_all_reduce::staged;
use super::hier::{self, Hier, PieceIo};
use super::route::AllReduceCall;
use super::Comm;
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::driver::Driver;
use crate::gpu::staging::{Band, Banded, Staging};
use crate::types::{DType, ReduceOp};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Most bands a call is cut into: each puts an event and a copy on qccl's stream and a wait
/// and a copy on the stream copying out (CUDA holds some 1000 pending operations per
/// stream before an enqueue blocks). Larger calls put several pieces in a band.
const MAX_BANDS: usize = 128;

/// A dense hierarchical all-reduce cut in bands, ready to start.
pub(super) struct HierBands {
    hier: Arc<Hier>,
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
    /// a dense hierarchical one of at least one element whose buffers are all device memory
    /// on a comm that may hold a stream for it (see the module); None otherwise.
    pub(super) fn hier_bands(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<HierBands>> {
        let Some(hier) = call.hier() else {
            return Ok(None);
        };
        let (count, dtype, op) = call.shape();
        if count == 0 || self.place.process_peers || self.place.cuda_ipc {
            return Ok(None);
        }
        let es = dtype.size();
        let len = count * es;
        let bufs = super::device::send_recv(send.map(|s| (s, len)), (recv, len));
        let Some((driver, _, ordinal)) = self.all_on_device(&bufs)? else {
            return Ok(None);
        };
        let pieces = hier::pieces_of(hier, count, es);
        let per_band = pieces.len().div_ceil(MAX_BANDS);
        let src = send.unwrap_or(recv);
        let bands: Vec<Band> = pieces
            .chunks(per_band)
            .map(|g| {
                let (a, b) = (g[0].start * es, g[g.len() - 1].end * es);
                Band {
                    ins: vec![(src + a as u64, a, b - a)],
                    outs: vec![(recv + a as u64, a, b - a)],
                }
            })
            .collect();
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: all_reduce(count={count}, {dtype}, {op}) on device \
             {ordinal}: hierarchical, staged in {} pieces, {} bands",
            self.rank,
            self.comm_id,
            pieces.len(),
            bands.len()
        );
        let plan = HierBands {
            hier: hier.clone(),
            shape: (count, dtype, op),
            bands,
            pieces: pieces.len(),
            per_band,
            len,
            calls: self.hier_band_calls.clone(),
            driver,
            ordinal,
        };
        Ok(Some(plan))
    }

    /// As [`Comm::enqueue_all_reduce_dense_at`] for a dense hierarchical all-reduce: enqueued
    /// on the caller's `stream` (not null) in bands and returning at once. False (nothing
    /// done) when the call does not take that path.
    ///
    /// # Safety
    /// As [`Comm::enqueue_all_reduce_dense_at`].
    pub(super) unsafe fn enqueue_hier_bands(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        let Some(plan) = self.hier_bands(call, send, recv)? else {
            return Ok(false);
        };
        let banded = {
            let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            let st = self.staging_on(&mut guard, plan.driver.clone(), plan.ordinal)?;
            // SAFETY: the caller's promise: device memory of the call's bytes until the
            // stream passes the call, a live stream of their device.
            unsafe { st.start_banded(plan.len, &plan.bands, stream)? }
        };
        // The request is not kept: the stream and `async_error` report the outcome; the
        // Banded releases the stream when dropped, after a failure is recorded.
        let _ = self
            .queue
            .submit_holding(banded, Some(0), move |_, b| plan.run(b))?;
        Ok(true)
    }
}

impl HierBands {
    /// Starts the call (its copies after `raw`'s earlier work, null: the legacy default
    /// stream) on `st` and runs it; returns once the result is in the device buffer. For
    /// calls that return once done, in the comm's turn (`_e`: its engine; the levels run
    /// on the hierarchy's comms).
    ///
    /// # Safety
    /// The call's buffers must be valid, and touched by nothing else, until this returns;
    /// `raw` null or a live stream of their device.
    pub(super) unsafe fn run_waiting(
        &self,
        _e: &mut Engine,
        st: &mut Staging,
        raw: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's promise.
        let banded = unsafe { st.start_banded_waiting(self.len, &self.bands, raw)? };
        self.run(&banded)?;
        banded.finish()
    }

    /// The levels on the page-locked copy, piece by piece as the bands land.
    fn run(&self, banded: &Banded) -> Result<()> {
        // SAFETY: the page-locked buffer holds the call's `len` bytes and is this call's
        // alone while the Banded lives; a band's bytes are read once landed and written
        // before it is released.
        let buf = unsafe { staged(banded.ptr(), self.len) };
        let io = BandIo {
            banded,
            per_band: self.per_band,
            pieces: self.pieces,
        };
        hier::all_reduce_in_pieces(&self.hier, None, buf, self.shape, &io)?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
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

impl Comm {
    /// How many dense hierarchical all-reduces on device buffers ran staged piece by piece
    /// (see the module) on this comm so far.
    #[doc(hidden)]
    pub fn hier_band_calls(&self) -> u64 {
        self.hier_band_calls.load(Ordering::Relaxed)
    }
}
