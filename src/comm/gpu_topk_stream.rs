//! HiTopKComm on float32 device buffers made on a caller's stream with its top-k on the
//! GPU: NCCL's semantics (the call returns once enqueued, the stream waits for it), where
//! a call that returns once done runs `gpu_topk.rs`. Every device operation is enqueued when
//! the call is made (`gpu::sra::topk_stream` lays them out); the worker runs the host's
//! steps on a page-locked copy of the buffer in the comm's turn, enqueueing nothing: the
//! intra-host reduce-scatter once the copy landed, then the `summed` word for the GPU to
//! select this rank's pairs, the inter-host all-gather of the pairs once they are copied
//! out, the word again for the GPU's scatter-add, and once the slice is back the intra-host
//! all-gather and the copy's release. The steps, keys and bytes are the host's and
//! `gpu_topk.rs`'s, so host and device ranks of one job end bit-identical. Other float
//! types on a stream are staged whole (their f32 copy lives in the lane).

use super::bands::{byte_ranges, group_in_bands};
use super::gpu_hier::levels_on_device;
use super::gpu_hier_stream::Held;
use super::hier::Hier;
use super::hitopk::selection_key;
use super::{Comm, PreparedTopK};
use crate::algo::part;
use crate::codec::ef::TensorKey;
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::driver::Stream;
use crate::gpu::sra::{DeviceStats, DeviceTopK, PieceBoard, TopKShape};
use crate::gpu::staging::Banded;
use crate::types::DType;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// What the worker needs of a HiTopK call on a stream.
struct TopKSteps {
    hier: Arc<Hier>,
    /// The tensor whose residual the device keeps (a host residual of it is dropped).
    key: Option<TensorKey>,
    count: usize,
    /// Bytes of one rank's pairs.
    pairs: usize,
    timeout: Duration,
}

impl Comm {
    /// HiTopKComm `call` on float32 device buffers `send` (None: in place) and `recv`,
    /// enqueued on the caller's `stream` with its top-k on the GPU and returning at once:
    /// the k this rank selects. None (nothing done) where the call has no such path: a null stream, another
    /// type than float32, the ranks of a host not on the shared-memory arena, another rank
    /// of the comm in this process, kernels that do not load, or an undeclared operation
    /// still running after the comm's timeout; the caller then stages it.
    ///
    /// # Safety
    /// `send` and `recv` must not overlap and must each be valid for the call's bytes until
    /// the stream passed the call; `stream` null or a live stream of their device.
    #[doc(hidden)]
    pub unsafe fn enqueue_hitopk_on_device(
        &self,
        call: &PreparedTopK,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<Option<usize>> {
        if stream.is_null() || self.place.process_peers {
            return Ok(None);
        }
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(None);
        };
        let Some(t) = call.on_device() else {
            return Ok(None);
        };
        let (hier, o, count) = (t.hier, t.opts, t.count);
        if count == 0 || t.dtype != DType::Float32 || !levels_on_device(hier) {
            return Ok(None);
        }
        let Some(ordinal) = self.coded_device(&*driver, (send, recv), 4 * count, 4)? else {
            return Ok(None);
        };
        let key = o.key.clone().filter(|_| o.error_feedback);
        let (how, timeout) = ((o.density, o.samplings), self.config.timeout);
        let topk = match DeviceTopK::new(
            driver.clone(),
            (ordinal, t.dtype),
            how,
            key.clone(),
            timeout,
        ) {
            Ok(t) => t,
            Err(e) => {
                crate::qlog!(
                    Info,
                    "rank {}: HiTopK on device buffers on a stream staged, MSTopK on the CPU: {e}",
                    self.rank
                );
                return Ok(None);
            }
        };
        self.refuse_if_failed()?;
        // SAFETY: the caller's promise about the stream.
        let caller = unsafe { driver.borrow_stream(ordinal, stream)? };
        let (local, me) = hier.intra_shape();
        let mine = part(count, local, me, 1);
        let hosts = hier.inter.size();
        let pairs = topk.pairs_len(mine.len());
        // The page-locked copy: the call's f32s (in and out), this rank's pairs, every
        // host's.
        let total = 4 * count + pairs * (hosts + 1);
        let ends = |_: usize, off: usize| (Some(recv + off as u64), Some(recv + off as u64));
        let (bands, _) =
            group_in_bands(&byte_ranges(std::iter::once(0..count).collect(), 4), &ends);
        crate::qlog!(
            Trace,
            "rank {}: HiTopK of {count} elements on device {ordinal} on a stream: the top-k \
             on the GPU",
            self.rank
        );
        let steps = TopKSteps {
            hier: hier.clone(),
            key,
            count,
            pairs,
            timeout,
        };
        // The comm's staging before the lane, as `start_gpu_hier`.
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, driver.clone(), ordinal)?;
        let Some((step, tx)) =
            self.queue
                .submit_declared(timeout, move |e, step, held: Held| {
                    let (band, board) = held;
                    steps.run(e, step, &band, &board)
                })?
        else {
            return Ok(None);
        };
        let site_key = selection_key(t.seed, step, mine.start, t.rank);
        let shape = TopKShape {
            send,
            recv,
            count,
            mine,
            site_key,
            hosts,
        };
        let stage = |after: &dyn Stream| {
            // SAFETY: the band's device ranges are the receive buffer's (valid until the
            // stream passed the call: the caller's promise); `stream` the caller's.
            let band = unsafe { st.start_banded_after(total, &bands, after, stream)? };
            let at = band.ptr();
            Ok((band, at))
        };
        self.enqueue_handing(&tx, |hand| {
            let hand = |band, board| hand((band, board)).map_err(|(band, _)| band);
            topk.enqueue_stream(&self.gpu_lane, &*caller, &shape, stage, hand)
        })?;
        // The pairs: k indices, then k values.
        Ok(Some(pairs / 8))
    }
}

impl TopKSteps {
    /// The host's steps of the call enqueued as step `step`, on `e` in the comm's turn,
    /// on the page-locked copy of `band`, tied to the device work by `board`. A failure
    /// fails the board (every wait of the lane's stream passes: the comm failed).
    fn run(&self, e: &mut Engine, step: u64, band: &Banded, board: &PieceBoard) -> Result<()> {
        let ran = self.steps(e, step, band, board);
        if let Err(err) = &ran {
            board.fail(err.clone());
        }
        ran
    }

    fn steps(&self, e: &mut Engine, step: u64, band: &Banded, board: &PieceBoard) -> Result<()> {
        if e.coded_calls != step {
            return Err(Error::Internal(format!(
                "a compressed call enqueued as step {step} runs as step {}",
                e.coded_calls
            )));
        }
        e.coded_calls += 1;
        if let Some(k) = &self.key {
            // A key used on host buffers before starts again from zero on the device.
            e.residuals.remove(k);
        }
        let (h, count, timeout) = (&self.hier, self.count, self.timeout);
        let base = band.ptr();
        // SAFETY (both): the page-locked copy holds the call's f32s, then this rank's
        // pairs, then every host's, and is this call's while the Banded lives; each is
        // read or written only while the device does not touch it (after the events below).
        let work = || unsafe { std::slice::from_raw_parts_mut(base.cast::<f32>(), count) };
        let at =
            |off: usize, len: usize| unsafe { std::slice::from_raw_parts_mut(base.add(off), len) };
        h.aborting((|| {
            band.wait_landed(0)?;
            h.intra_reduce_scatter(work())?;
            board.summed(0);
            board.event(0, timeout)?.synchronize(timeout)?;
            let (all, _) = h.inter_all_gather(at(4 * count, self.pairs))?;
            at(4 * count + self.pairs, all.len()).copy_from_slice(&all);
            board.summed(1);
            board.event(1, timeout)?.synchronize(timeout)?;
            if board.refused() {
                return Err(Error::invalid(
                    "HiTopK on device buffers: a gathered block of pairs failed its checks on \
                     the device",
                ));
            }
            h.intra_all_gather(work())?;
            Ok(())
        })())?;
        band.release(0);
        e.gpu.count_calls(1, DeviceStats::default());
        Ok(())
    }
}
