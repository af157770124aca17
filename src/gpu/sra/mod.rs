//! Compressed SRA all-reduce on device buffers with the codecs on the GPU (issue #22): the
//! CPU schedule (`algo::compressed::sra::run`), with a `Side` whose data stays in device
//! memory. A slice leaving this rank is encoded by its codec's kernels (error feedback fused)
//! into aligned device scratch and only its payload is copied to page-locked memory, after
//! the 32-byte header the host wrote there; a received chunk's header is checked on the host,
//! its payload copied into device scratch and decoded (added) there. Only encoded bytes cross
//! PCIe, and they are the CPU codecs' bytes: host and device ranks of one job end
//! bit-identical.
//!
//! The arithmetic is the CPU's, step for step: the input plus the residual (`qccl_ef_compensate`
//! for this rank's own slice, `encode_ef` for the peers'), own data exact and then the peers'
//! decoded contributions in rank order, the owner's sum encoded once and replaced by its
//! decoded value, Avg's division after the sum (`qccl_finish_avg_f32`).
//!
//! Every kernel and copy of a call runs on one stream of the comm's, in order, pipelined with
//! the exchanges (`side.rs`): the schedule enqueues slice j+1's scatter encodes before slice
//! j's exchange, into the other of `sra::SETS` sets of page-locked send and receive slots, so
//! the GPU encodes while the network moves bytes. An event follows each peer's encode and
//! copy; the exchange posts its receives at once and hands each peer's bytes to the progress
//! engine as that event completes (`sends.rs`), not after a whole-stream synchronise. The
//! decodes of an exchange's bytes run during the next exchange, which receives into the other
//! set; an event after them is waited for before their set receives again. The stream is
//! synchronised only at the end (and on an error, before the buffers go back to the caller).
//! `DeviceStats` counts the exchanges that began with encodes still queued.
//!
//! The residual of a tensor key lives in device memory, kept across calls; a key used on host
//! buffers before starts again from zero here (and the reverse).

use super::driver::{Arg, Driver};
use super::plans::{grid_for, plan_for, CodecPlan, BLOCK};
use crate::algo::compressed::sra;
use crate::algo::compressed::{chunk, nslices, slice};
use crate::algo::{Algo, Ctx};
use crate::codec::ef::TensorKey;
use crate::codec::layout::CodecMap;
use crate::codec::{Codec, Site};
use crate::coll::compressed::Coded;
use crate::coll::Engine;
use crate::comm::Report;
use crate::error::{Error, Result};
use crate::transport::frame::CollKind;
use crate::types::{DType, ReduceOp};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

mod sends;
mod side;
// Kept by the engine across calls (its own file, so the engine need not import the call).
pub(crate) mod state;

use side::DeviceSide;
use state::Sizes;
pub use state::{DeviceState, DeviceStats};

/// A compressed all-reduce on device buffers, checked and with its kernels loaded; runs on
/// its comm's engine (`run`).
pub struct GpuAllReduce {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    plan: CodecMap,
    /// Launch plan of each codec of `plan`, by spec.
    plans: HashMap<String, Arc<dyn CodecPlan>>,
    key: Option<TensorKey>,
    op: ReduceOp,
    count: usize,
    send: Option<u64>,
    recv: u64,
    seed: u64,
    timeout: Duration,
}

/// The call's shape: (plan, tensor key, op, count, seed).
pub(crate) type Shape<'a> = (&'a CodecMap, Option<&'a TensorKey>, ReduceOp, usize, u64);

impl GpuAllReduce {
    /// The all-reduce of `count` (> 0) f32s of device memory `recv` (in place) or from `send`,
    /// both on device `ordinal` and 4-byte aligned. `Unsupported` when a codec of the plan
    /// has no launch plan, or the kernels cannot be loaded (the caller then stages the call).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        (plan, key, op, count, seed): Shape<'_>,
        send: Option<u64>,
        recv: u64,
        timeout: Duration,
    ) -> Result<GpuAllReduce> {
        let mut plans = HashMap::new();
        for c in plan.codecs() {
            if let std::collections::hash_map::Entry::Vacant(v) = plans.entry(c.spec()) {
                v.insert(Arc::from(plan_for(&*driver, ordinal, &**c)?));
            }
        }
        // Loaded now, outside the comm's turn: a first load may build the kernel file.
        DeviceState::functions(&*driver, ordinal)?;
        Ok(GpuAllReduce {
            driver,
            ordinal,
            plan: plan.clone(),
            plans,
            key: key.cloned(),
            op,
            count,
            send,
            recv,
            seed,
            timeout,
        })
    }

    /// The driver it runs on.
    pub fn driver(&self) -> Arc<dyn Driver> {
        self.driver.clone()
    }

    /// The device it runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn plan_of(&self, codec: &dyn Codec) -> Result<&dyn CodecPlan> {
        self.plans
            .get(&codec.spec())
            .map(|p| &**p)
            .ok_or_else(|| Error::Internal(format!("no launch plan loaded for {}", codec.spec())))
    }

    /// Runs the call on `e` (its comm's engine, in its turn), after the caller's earlier work
    /// on the buffers is done; returns once the result is in `recv`. As the host's
    /// `coded_turn`: takes the call's step and the tensor's residual.
    ///
    /// The buffers must stay valid, and be touched by nothing else, until this returns (the
    /// promise `Comm::run_gpu_all_reduce`'s caller made).
    pub fn run(&self, e: &mut Engine) -> Result<Report> {
        crate::qlog!(
            Trace,
            "rank {}: all_reduce(count={}, {}, {}): compressed, codecs on device {}",
            e.rank,
            self.count,
            DType::Float32,
            self.op,
            self.ordinal
        );
        let step = e.coded_calls;
        e.coded_calls += 1;
        let key = self.key.as_ref().filter(|_| self.plan.error_feedback());
        if let Some(k) = key {
            // A key used on host buffers before starts again from zero here.
            e.residuals.remove(k);
        }
        let mut st = match e.gpu.take() {
            Some(st) => st,
            None => DeviceState::new(&*self.driver, self.ordinal)?,
        };
        let out = st.all_reduce(e, self, step, key);
        e.gpu = Some(st);
        out
    }
}

impl DeviceState {
    fn all_reduce(
        &mut self,
        e: &mut Engine,
        g: &GpuAllReduce,
        step: u64,
        key: Option<&TensorKey>,
    ) -> Result<Report> {
        let (count, n, rank) = (g.count, e.size, e.rank);
        let res = match key {
            Some(k) => Some(self.residual(&*g.driver, k, count, g.timeout)?),
            None => None,
        };
        let site = Site {
            seed: g.seed,
            step,
            chunk: 0,
            rank: rank as u64,
        };
        let w0 = e.wire;
        // SAFETY: page-locked memory of ours; the stream is idle.
        unsafe { self.bad_word().write_volatile(0) };
        if n == 1 {
            // As the host's: the residual added (or the input copied), nothing sent.
            self.compensate(g.send.unwrap_or(g.recv), res, g.recv, count)?;
        } else {
            let coded = Coded::new(&g.plan, site, 0, None, DType::Float32);
            let mut ctx = e.coded_ctx(CollKind::AllReduce, count, &coded, Algo::Sra);
            let sizes = sizes(&ctx, g)?;
            self.reserve(&*g.driver, &sizes, n)?;
            let mut side = DeviceSide::new(self, g, site, res, sizes.slot, (n, rank));
            let ran = sra::run(&mut ctx, &mut side, count, true);
            drop(side);
            if ran.is_err() {
                // The caller's buffers and the wire go back only once the stream is done with
                // them; the call's error is the one to report.
                let _ = self.stream.synchronize(g.timeout);
            }
            ran?;
        }
        if g.op == ReduceOp::Avg {
            let args = [Arg::Ptr(g.recv), Arg::U64(count as u64), Arg::U64(n as u64)];
            // SAFETY: reduce.cu's qccl_finish_avg_f32(float* x, uint64_t count, uint64_t n)
            // over the call's `count` f32s; as `compensate`.
            unsafe {
                self.stream
                    .launch(&*self.avg, grid_for(count.div_ceil(4)), BLOCK, &args)?
            };
        }
        self.sync(g.timeout)?;
        self.stats.calls += 1;
        Ok(Report::flat(Algo::Sra, e.wire - w0))
    }
}

/// The room `g` needs on `ctx`: the same chunks and slices as `sra::run`.
fn sizes(ctx: &Ctx<'_>, g: &GpuAllReduce) -> Result<Sizes> {
    let n = ctx.size;
    let chunks: Vec<_> = (0..n).map(|c| chunk(g.count, n, c)).collect();
    let nsl = nslices(ctx, chunks[n - 1].len());
    let mut s = Sizes {
        slot: 0,
        payload: 0,
        scratch: 0,
    };
    for c in &chunks {
        for j in 0..nsl {
            let r = slice(c, nsl, j);
            s.slot = s.slot.max(g.plan.encoded_len(r.clone()));
            for (q, codec) in g.plan.pieces(r) {
                let p = g.plan_of(&**codec)?;
                s.payload = s.payload.max(p.payload_len(q.len()));
                s.scratch = s.scratch.max(p.scratch_len(q.len()));
            }
        }
    }
    Ok(s)
}
