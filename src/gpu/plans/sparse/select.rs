//! How each sparse codec chooses its k pairs on a device, as kernels/shim/sparse_driver.cpp
//! launches them: topk and mstopk fill the selection state (sparse.cuh) that the shared
//! compaction then writes out; randk draws every pair alone and writes the payload itself.

use super::grid_over;
use super::scratch::{Needs, Scratch};
use crate::codec::CodecId;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Driver, Function, Stream};
use crate::gpu::plans::{grid_for, BLOCK};
use std::sync::Arc;

/// Radix passes over the 31-bit magnitude key (digits of 11, 10 and 10 bits: sparse.cuh's
/// `SP_RADIX_PASSES`).
const RADIX_PASSES: i32 = 3;

/// The lanes of mstopk's mean (mstopk.cu): 16 per part of 16384 elements.
const MEAN_PART: usize = 16384;
const MEAN_LANES: usize = 16;

/// mstopk.cu's `MSTOPK_LEVELS`: samplings whose thresholds one count pass counts.
const LEVELS: u32 = 3;

/// A codec's way of choosing its pairs.
pub(super) enum Selection {
    /// A threshold selection into the state, written by the shared compaction.
    Thresholds(Box<dyn Thresholds>),
    /// randk: a thread per pair, no state.
    Strata(RandK),
}

impl Selection {
    /// The selection of codec `id` (a sparse codec) on device `ordinal`.
    pub fn new(driver: &dyn Driver, ordinal: usize, id: CodecId, samplings: u32) -> Result<Self> {
        let f = |name: &str| driver.function(ordinal, name);
        Ok(match id {
            CodecId::TopK => Selection::Thresholds(Box::new(TopK {
                init: f("qccl_topk_init")?,
                radix: Radix::new(driver, ordinal, "topk")?,
            })),
            CodecId::MsTopK => Selection::Thresholds(Box::new(MsTopK {
                samplings,
                partials: f("qccl_mstopk_partials")?,
                init: f("qccl_mstopk_init")?,
                count: f("qccl_mstopk_count")?,
                step: f("qccl_mstopk_step")?,
                radix: Radix::new(driver, ordinal, "mstopk")?,
                finish: f("qccl_mstopk_finish")?,
            })),
            CodecId::RandK => Selection::Strata(RandK {
                encode: f("qccl_randk_encode")?,
                encode_ef: f("qccl_randk_encode_ef")?,
            }),
            other => {
                return Err(Error::Unsupported(format!(
                    "{} is not a sparse codec",
                    other.name()
                )))
            }
        })
    }

    /// The scratch regions it uses.
    pub fn needs(&self) -> Needs {
        match self {
            Selection::Thresholds(t) => t.needs(),
            Selection::Strata(_) => Needs::Nothing,
        }
    }
}

/// A selection that leaves its thresholds and window in the state (sparse.cuh).
pub(super) trait Thresholds: Send + Sync {
    /// The scratch regions it uses.
    fn needs(&self) -> Needs;

    /// Enqueues the selection of the `k` (1..=n) pairs of `x`'s `n` elements into
    /// `at.state`, draws keyed by `key`.
    ///
    /// # Safety
    /// `x` holds `n` f32s and `at` is scratch of this selection for `n` elements, valid until
    /// the work is done (the plan's contract).
    unsafe fn fill(
        &self,
        s: &dyn Stream,
        x: u64,
        n: usize,
        k: usize,
        key: u64,
        at: &Scratch,
    ) -> Result<()>;
}

/// One thread, for the serial steps.
///
/// # Safety
/// As [`Stream::launch`].
unsafe fn serial(s: &dyn Stream, f: &dyn Function, args: &[Arg]) -> Result<()> {
    // SAFETY: the caller's promise.
    unsafe { s.launch(f, 1, 1, args) }
}

/// The three-pass radix select of the k-th largest key (sparse.cuh), a codec's hist and digit
/// entries.
struct Radix {
    hist: Arc<dyn Function>,
    digit: Arc<dyn Function>,
}

impl Radix {
    fn new(driver: &dyn Driver, ordinal: usize, codec: &str) -> Result<Radix> {
        Ok(Radix {
            hist: driver.function(ordinal, &format!("qccl_{codec}_hist"))?,
            digit: driver.function(ordinal, &format!("qccl_{codec}_digit"))?,
        })
    }

    /// # Safety
    /// As [`Thresholds::fill`].
    unsafe fn run(&self, s: &dyn Stream, x: u64, n: usize, at: &Scratch) -> Result<()> {
        let (st, hist) = (Arg::Ptr(at.state), Arg::Ptr(at.hist));
        for pass in 0..RADIX_PASSES {
            let args = [Arg::Ptr(x), st, hist, Arg::U64(n as u64), Arg::I32(pass)];
            // SAFETY: qccl_<codec>_hist(const float* x, const sp_u64* st, unsigned* hist,
            // sp_u64 n, int pass), any grid, and qccl_<codec>_digit(sp_u64* st,
            // unsigned* hist, int pass), one thread; the caller's ranges.
            unsafe {
                s.launch(&*self.hist, grid_over(n), BLOCK, &args)?;
                serial(s, &*self.digit, &[st, hist, Arg::I32(pass)])?;
            }
        }
        Ok(())
    }
}

/// topk.cu: the radix select of the k-th largest key t; everything above it and the first
/// ties.
struct TopK {
    init: Arc<dyn Function>,
    radix: Radix,
}

impl Thresholds for TopK {
    fn needs(&self) -> Needs {
        Needs::Select
    }

    unsafe fn fill(
        &self,
        s: &dyn Stream,
        x: u64,
        n: usize,
        k: usize,
        _key: u64,
        at: &Scratch,
    ) -> Result<()> {
        let args = [Arg::Ptr(at.state), Arg::Ptr(at.hist), Arg::U64(k as u64)];
        // SAFETY: qccl_topk_init(sp_u64* st, unsigned* hist, sp_u64 k), one thread; then the
        // radix passes; the caller's ranges.
        unsafe {
            serial(s, &*self.init, &args)?;
            self.radix.run(s, x, n, at)
        }
    }
}

/// mstopk.cu: the Rust codec's mean, `samplings` counts of the bisection (three a pass over
/// x), the radix select for non-finite input (its launches return at once otherwise), the
/// random window.
struct MsTopK {
    samplings: u32,
    partials: Arc<dyn Function>,
    init: Arc<dyn Function>,
    count: Arc<dyn Function>,
    step: Arc<dyn Function>,
    radix: Radix,
    finish: Arc<dyn Function>,
}

impl Thresholds for MsTopK {
    fn needs(&self) -> Needs {
        Needs::SelectAndMean
    }

    unsafe fn fill(
        &self,
        s: &dyn Stream,
        x: u64,
        n: usize,
        k: usize,
        key: u64,
        at: &Scratch,
    ) -> Result<()> {
        let (st, n64) = (Arg::Ptr(at.state), Arg::U64(n as u64));
        let (psum, pmax) = (Arg::Ptr(at.psum), Arg::Ptr(at.pmax));
        let lanes = n.div_ceil(MEAN_PART) * MEAN_LANES;
        // SAFETY: mstopk.cu's qccl_mstopk_partials(const float* x, float* psum, float* pmax,
        // sp_u64 n), a thread per lane; qccl_mstopk_init(const float* psum,
        // const float* pmax, sp_u64* st, unsigned* hist, sp_u64 n, sp_u64 k), one thread;
        // per LEVELS samplings qccl_mstopk_count(const float* x, sp_u64* st, sp_u64 n), whole
        // warps (BLOCK is a multiple of 32), and qccl_mstopk_step(sp_u64* st,
        // unsigned levels), one thread; the radix passes; qccl_mstopk_finish(sp_u64* st,
        // sp_u64 key), one thread. The ranges are the caller's.
        unsafe {
            s.launch(
                &*self.partials,
                grid_for(lanes),
                BLOCK,
                &[Arg::Ptr(x), psum, pmax, n64],
            )?;
            let args = [psum, pmax, st, Arg::Ptr(at.hist), n64, Arg::U64(k as u64)];
            serial(s, &*self.init, &args)?;
            for first in (0..self.samplings).step_by(LEVELS as usize) {
                let levels = (self.samplings - first).min(LEVELS);
                s.launch(&*self.count, grid_over(n), BLOCK, &[Arg::Ptr(x), st, n64])?;
                serial(s, &*self.step, &[st, Arg::U32(levels)])?;
            }
            self.radix.run(s, x, n, at)?;
            serial(s, &*self.finish, &[st, Arg::U64(key)])
        }
    }
}

/// randk.cu: one index per stratum, drawn by the thread that writes its pair.
pub(super) struct RandK {
    encode: Arc<dyn Function>,
    encode_ef: Arc<dyn Function>,
}

impl RandK {
    /// Enqueues the payload of `k` pairs of `x`'s `n` elements.
    ///
    /// # Safety
    /// `x` holds `n` f32s and `payload` 8 k bytes, valid until the work is done.
    pub unsafe fn encode(
        &self,
        s: &dyn Stream,
        x: u64,
        payload: u64,
        n: usize,
        k: usize,
        key: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(payload),
            Arg::U64(n as u64),
            Arg::U64(k as u64),
            Arg::U64(key),
        ];
        // SAFETY: qccl_randk_encode(const float* x, uint8_t* payload, sp_u64 n, sp_u64 k,
        // sp_u64 key), any grid; the caller's ranges.
        unsafe { s.launch(&*self.encode, grid_over(k), BLOCK, &args) }
    }

    /// Enqueues the payload of `k` pairs of `w = x + res` (error feedback's input, before
    /// the element pass changes either: `SparsePlan::encode_ef`).
    ///
    /// # Safety
    /// `x` and `res` hold `n` f32s, `payload` 8 k bytes, valid until the work is done.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn encode_ef_pairs(
        &self,
        s: &dyn Stream,
        x: u64,
        res: u64,
        payload: u64,
        n: usize,
        k: usize,
        key: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(res),
            Arg::Ptr(payload),
            Arg::U64(n as u64),
            Arg::U64(k as u64),
            Arg::U64(key),
        ];
        // SAFETY: qccl_randk_encode_ef(const float* x, const float* res, uint8_t* payload,
        // sp_u64 n, sp_u64 k, sp_u64 key), a thread per pair; the caller's ranges.
        unsafe { s.launch(&*self.encode_ef, grid_over(k), BLOCK, &args) }
    }
}
