//! HiTopKComm on device buffers with its top-k on the GPU (`hitopk.rs` is the algorithm on
//! the host): the intra-host reduce-scatter and all-gather through the shared-memory arena
//! with the GPU at both ends (`gpu_hier.rs`'s levels), MSTopK with error feedback fused on
//! this rank's owned slice on the GPU, only the (index, value) pairs copied to the host for
//! the inter-host all-gather, and the scatter-add of every host's pairs on the GPU
//! (`gpu::sra::DeviceTopK`). The selection's bytes are the host's, keyed alike, so host and
//! device ranks of one job end bit-identical.
//!
//! Float16, bfloat16 and float64 run on an f32 copy in device memory (`DeviceTopK::widen`,
//! `narrow`), as the host's `with_f32`. Taken by calls that return once done (NULL stream)
//! when the ranks of each host share the arena (or a host has one rank); on float32 on a
//! stream the same steps run from a plan enqueued whole (`gpu_topk_stream.rs`); staged
//! through page-locked memory otherwise.

use super::arena_turn::ArenaTurn;
use super::gpu_hier::{intra_level, levels_on_device};
use super::hitopk::{selection_key, TopKOnDevice};
use super::{Comm, PreparedTopK, TopKReport};
use crate::algo::arena::Shape;
use crate::algo::{part, Wire};
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::driver::Driver;
use crate::gpu::sra::DeviceTopK;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A HiTopKComm call on device buffers, checked and with its kernels loaded.
struct GpuTopK<'a> {
    call: TopKOnDevice<'a>,
    intra: ArenaTurn,
    topk: DeviceTopK,
    driver: Arc<dyn Driver>,
    ordinal: usize,
    send: Option<u64>,
    recv: u64,
}

impl Comm {
    /// HiTopKComm `call` on device buffers `send` (None: in place) and `recv`, returning
    /// once done (the legacy default stream's earlier work first): its report, or None
    /// (nothing done) when the call has no GPU path (see the module docs) and the caller
    /// stages it.
    ///
    /// # Safety
    /// `send` and `recv` must not overlap and must each be valid for the call's bytes until
    /// this returns.
    #[doc(hidden)]
    pub unsafe fn hitopk_on_device(
        &self,
        call: &PreparedTopK,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<TopKReport>> {
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(None);
        };
        let Some(t) = call.on_device() else {
            return Ok(None);
        };
        let (hier, o, count, dtype) = (t.hier, t.opts, t.count, t.dtype);
        if count == 0 || !levels_on_device(hier) {
            return Ok(None);
        }
        let es = dtype.size();
        let Some(ordinal) = self.coded_device(&*driver, (send, recv), es * count, es)? else {
            return Ok(None);
        };
        let key = o.key.clone().filter(|_| o.error_feedback);
        let how = (o.density, o.samplings);
        let timeout = self.config.timeout;
        let topk = match DeviceTopK::new(driver.clone(), (ordinal, dtype), how, key, timeout) {
            Ok(t) => t,
            Err(e) => {
                crate::qlog!(
                    Info,
                    "rank {}: HiTopK on device buffers staged, MSTopK on the CPU: {e}",
                    self.rank
                );
                return Ok(None);
            }
        };
        crate::qlog!(
            Trace,
            "rank {}: HiTopK of {count} elements on device {ordinal}: the top-k on the GPU",
            self.rank
        );
        let g = GpuTopK {
            intra: hier.intra.arena_turn(),
            call: t,
            topk,
            driver: driver.clone(),
            ordinal,
            send,
            recv,
        };
        // Undeclared (one compressed call, but the count is not given): a compressed call
        // made on a stream meanwhile then waits for this one to end before it enqueues, so
        // its progress waits cannot land on the device side's stream between this call's
        // steps, ahead of kernels the worker waits for (`Queue::submit_declared`).
        // SAFETY: the legacy default stream; the caller's promise covers the buffers.
        let report = unsafe {
            self.in_turn_after((driver, ordinal), std::ptr::null_mut(), |e| {
                hier.aborting(g.run(e))
            })
        }?;
        Ok(Some(report))
    }
}

impl GpuTopK<'_> {
    /// Algorithm 2 on the device, in the comm's turn (on `e`), as `PreparedTopK::hitopk`.
    fn run(&self, e: &mut Engine) -> Result<TopKReport> {
        let t = &self.call;
        let (o, count, seed, rank) = (t.opts, t.count, t.seed, t.rank);
        let step = e.coded_calls;
        e.coded_calls += 1;
        if let Some(k) = o.key.as_ref().filter(|_| o.error_feedback) {
            // A key used on host buffers before starts again from zero here.
            e.residuals.remove(k);
        }
        let lane = e.gpu.clone();
        let (local, me) = self.call.hier.intra_shape();
        let mine = part(count, local, me, 1);
        let mut report = TopKReport {
            scheme: super::TopKScheme::HiTopK,
            wire: Wire::default(),
            steps: [Duration::ZERO; 4],
            scatter_add: Duration::ZERO,
            k: 0,
            indices: None,
        };
        let work = self.topk.widen(&lane, self.send, self.recv, count)?;
        let device = (&self.driver, self.ordinal);
        let at = (0..count, mine.start);
        let level = |shape| {
            // SAFETY: the call's f32 work buffer (its receive buffer, valid until it returns:
            // the caller's promise; or the lane's copy, the call's until it ends).
            unsafe { intra_level(self.call.hier, &self.intra, device, work, at.clone(), shape) }
        };
        // 1. Intra-host reduce-scatter.
        let t = Instant::now();
        report.wire += level(Shape::ReduceScatter)?;
        report.steps[0] = t.elapsed();
        // 2. MSTopK on the owned slice, compensated by its residual.
        let t = Instant::now();
        let slice = work + 4 * mine.start as u64;
        let site_key = selection_key(seed, step, mine.start, rank);
        let pairs = self.topk.select(&lane, slice, mine.len(), site_key)?;
        report.k = pairs.len() / 8;
        report.steps[1] = t.elapsed();
        // 3. All-gather of the pairs among the ranks with this local rank; scatter-add in
        //    host order.
        let t = Instant::now();
        let (all, wire) = self.call.hier.inter_all_gather(&pairs)?;
        report.wire += wire;
        let t_add = Instant::now();
        self.topk.scatter_add(&lane, slice, mine.len(), &all)?;
        report.scatter_add = t_add.elapsed();
        report.steps[2] = t.elapsed();
        // 4. Intra-host all-gather.
        let t = Instant::now();
        report.wire += level(Shape::AllGather)?;
        self.topk.narrow(&lane, work, self.recv, count)?;
        report.steps[3] = t.elapsed();
        if o.record_indices {
            let k = report.k;
            let idx = pairs[..4 * k]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            report.indices = Some(idx);
        }
        lane.count_calls(1, Default::default());
        Ok(report)
    }
}
