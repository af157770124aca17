//! A compressed hierarchical all-reduce on float32 device buffers made on a caller's stream
//! with the codecs on the GPU: NCCL's semantics (the call returns once enqueued, the stream
//! waits for it) on the route a multi-host job takes by default, which a call that returns
//! once done runs in `gpu_hier.rs`. Every device operation is enqueued when the call is
//! made (`gpu::sra::pieces` lays them out: the residual folded in, the bands of a
//! page-locked copy, each piece's part encoded and decoded on the GPU between waits for
//! the host); the worker then runs the host's levels on the page-locked copy in the
//! comm's turn, enqueueing nothing: each piece's intra-host reduce-scatter once its band
//! landed, then the `summed` word for the GPU to take the part, the part's bytes moved on
//! the inter-host comm (`GpuAllReduce::move_part`), and once its result is back the
//! intra-host all-gather, then the band's release for the caller's stream to copy it out.
//!
//! The arithmetic is `gpu_hier.rs`'s: the residual folded into the whole input first, the
//! arena's f32 sums (the host path's), each part a `GpuAllReduce::part` of the call, Avg's
//! division over the whole result at the end; so host and device ranks of one job end
//! bit-identical. Other float types are staged in bands, the CPU codecs encoding
//! (`bands.rs`): their f32 copy lives in the lane, which a later call on the stream would
//! reuse before this one is done.

use super::bands::{byte_ranges, group_in_bands, BandIo};
use super::gpu_hier::GpuHier;
use super::{pipeline, Comm};
use crate::algo::PieceIo;
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::sra::{DeviceStats, PieceBoard, StreamPiece};
use crate::gpu::staging::Banded;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// What the worker gets once the call's bands started: them and the call's board.
pub(super) type Held = (Banded, Arc<PieceBoard>);

impl Comm {
    /// Enqueues `h` on the caller's `stream` (not null) and queues its host side; false
    /// (nothing done) when its step could not be known within the comm's timeout (an
    /// undeclared operation still running: `Queue::submit_declared`). An error after the
    /// call took its turn fails the comm: its peers expect this rank in it.
    ///
    /// # Safety
    /// The call's buffers must stay valid until the stream passed the call, and `stream`
    /// be a live stream of their device.
    pub(super) unsafe fn start_gpu_hier(
        &self,
        h: &Arc<GpuHier>,
        stream: *mut c_void,
    ) -> Result<bool> {
        let g = &h.whole;
        self.check_device(g.ordinal())?;
        self.refuse_if_failed()?;
        // SAFETY: the caller's promise about the stream.
        let caller = unsafe { g.driver().borrow_stream(g.ordinal(), stream)? };
        let (recv, count) = g.recv_count();
        // The page-locked copy is the call's f32 work (its receive buffer once the
        // residual is folded in): each piece comes in whole and goes out whole.
        let ranges = byte_ranges(h.pieces.iter().map(|p| p.at.clone()).collect(), 4);
        let ends = |_: usize, off: usize| (Some(recv + off as u64), Some(recv + off as u64));
        let (bands, per_band) = group_in_bands(&ranges, &ends);
        let parts: Arc<Vec<StreamPiece>> = Arc::new(h.stream_pieces());
        // The comm's staging before the lane (the order of calls that return once done),
        // held until every piece is enqueued.
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, g.driver(), g.ordinal())?;
        let (plan, moving) = (h.clone(), parts.clone());
        let Some((step, tx)) =
            self.queue
                .submit_declared(self.config.timeout, move |e, step, held: Held| {
                    let (banded, board) = held;
                    plan.finish_on_stream(e, step, (&banded, &board), per_band, &moving)
                })?
        else {
            return Ok(false);
        };
        let stage = |after: &dyn crate::gpu::driver::Stream| {
            // SAFETY: the bands' device ranges are the receive buffer's (valid until the
            // stream passed the call: the caller's promise); `stream` the caller's.
            let banded = unsafe { st.start_banded_after(4 * count, &bands, after, stream)? };
            let at = banded.ptr();
            Ok((banded, at))
        };
        self.enqueue_handing(&tx, |hand| {
            let hand = |banded, board| hand((banded, board)).map_err(|(banded, _)| banded);
            g.enqueue_pieces(&self.gpu_lane, step, &*caller, &parts, stage, hand)
        })
    }
}

impl GpuHier {
    /// Each piece's part as the GPU runs it: `gpu_hier.rs`'s `across`, on the receive
    /// buffer (the call's f32 work once the residual is folded in).
    fn stream_pieces(&self) -> Vec<StreamPiece> {
        let (recv, _) = self.whole.recv_count();
        self.pieces
            .iter()
            .map(|p| StreamPiece {
                mine: p.mine.clone(),
                part: (!p.mine.is_empty()).then(|| {
                    let level = (p.mine.start, p.mine.len(), p.scheme);
                    let at = recv + 4 * p.mine.start as u64;
                    self.whole.part(level, (None, at), self.inter)
                }),
            })
            .collect()
    }

    /// The host side of the call enqueued as step `step` (`start_gpu_hier`), on `e` in the
    /// comm's turn: the levels on the page-locked copy of `banded` (pieces in bands of
    /// `per_band`), tied to the device work by `board`. A failure fails the board, so that
    /// every wait of the lane's stream passes (the result undefined, the comm failed).
    fn finish_on_stream(
        &self,
        e: &mut Engine,
        step: u64,
        (banded, board): (&Banded, &PieceBoard),
        per_band: usize,
        parts: &[StreamPiece],
    ) -> Result<()> {
        let ran = self.levels_on_stream(e, step, banded, board, (per_band, parts));
        if let Err(err) = &ran {
            board.fail(err.clone());
        }
        ran
    }

    /// `finish_on_stream`'s levels.
    fn levels_on_stream(
        &self,
        e: &mut Engine,
        step: u64,
        banded: &Banded,
        board: &PieceBoard,
        (per_band, parts): (usize, &[StreamPiece]),
    ) -> Result<()> {
        if e.coded_calls != step {
            return Err(Error::Internal(format!(
                "a compressed call enqueued as step {step} runs as step {}",
                e.coded_calls
            )));
        }
        e.coded_calls += 1;
        self.whole.forget_host_residual(e);
        let timeout = self.inter.3;
        let io = BandIo {
            banded,
            per_band,
            pieces: self.pieces.len(),
        };
        let base = banded.ptr();
        // SAFETY (all three): the page-locked copy holds the call's f32s and is this
        // call's while the Banded lives; the pipeline's stages work on distinct pieces,
        // each piece read once its band landed and its part's copy back is done.
        let work = |at: &Range<usize>| unsafe {
            std::slice::from_raw_parts_mut(base.cast::<f32>().add(at.start), at.len())
        };
        let did = Mutex::new(DeviceStats::default());
        self.hier.aborting(pipeline::run(
            self.pieces.iter().zip(parts).enumerate().collect(),
            |(i, (p, _))| {
                io.landed(*i)?;
                self.hier.intra_reduce_scatter(work(&p.at))?;
                board.summed(*i);
                Ok(())
            },
            |(i, (_, s))| {
                let Some(g) = &s.part else {
                    return Ok(());
                };
                let script = board.script(*i, timeout)?;
                let d = self.hier.inter.execute(|x| g.move_part(x, script))?;
                let mut all = did.lock().unwrap_or_else(|p| p.into_inner());
                all.exchanges += d.exchanges;
                all.overlapped += d.overlapped;
                all.late_sends += d.late_sends;
                Ok(())
            },
            |(i, (p, s))| {
                if s.part.is_some() {
                    board.event(*i, timeout)?.synchronize(timeout)?;
                }
                self.hier.intra_all_gather(work(&p.at))?;
                io.done(*i);
                Ok(())
            },
        ))?;
        let did = did.into_inner().unwrap_or_else(|p| p.into_inner());
        e.gpu.count_calls(1, did);
        Ok(())
    }
}
