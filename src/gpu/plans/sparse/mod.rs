//! The sparse codecs (`topk`, `mstopk`, `randk`) on a device, as kernels/shim/sparse_driver.cpp
//! launches kernels/topk.cu, mstopk.cu, randk.cu and the shared steps of sparse.cu: a codec's
//! selection (`select.rs`) fills the selection state, the ordered compaction writes the
//! payload of src/codec/sparse.rs (k u32 indices, then k f32 values), bit for bit the Rust
//! codec's `encode_payload`; decode checks the indices into `bad` and scatters (adds).
//!
//! Decode needs no host round trip between check and scatter: the scatter kernels skip every
//! index at or past the chunk's end, so a payload the check refuses (the caller then fails the
//! call; `out` is unspecified) writes nothing out of bounds. In-range indices that repeat or
//! decrease only race on elements of `out`.
//!
//! Chunks hold fewer than 2^32 elements on a device (the kernels count in u32): a count of
//! 2^32 or more is `Unsupported`.

mod scratch;
mod select;

use super::{grid_for, CodecPlan, BLOCK};
use crate::codec::{Codec, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Driver, Function, Stream};
use scratch::Scratch;
use select::{Selection, Thresholds};
use std::sync::Arc;

/// Threads of qccl_sparse_scan's one block (SPARSE_SCAN in sparse.cuh).
const SCAN_BLOCK: u32 = 256;

/// Threads a warp: the compaction gives each warp one segment.
const WARP: usize = 32;

/// Elements per compaction segment (SPARSE_SEG in sparse.cuh).
const SEGMENT: usize = 4096;

/// sparse.cuh's `SPARSE_TILE_WARPS`: the compaction's blocks hold at most this many warps
/// (a tile of shared memory each).
const TILE_WARPS: u32 = 8;
const _: () = assert!(BLOCK <= TILE_WARPS * WARP as u32 && BLOCK.is_multiple_of(WARP as u32));

/// Items (elements, pairs, lanes) a thread of a grid-stride kernel takes: a warp's sum and
/// atomic stay a small part of a counting thread's work, and a chunk reaches the grid cap
/// (a full device) from 4 Mi elements; below that a launch is short whatever its grid.
const PER_THREAD: usize = 16;

/// Blocks of a grid-stride launch over `items`.
fn grid_over(items: usize) -> u32 {
    grid_for(items.div_ceil(PER_THREAD))
}

/// A sparse codec's kernels on one device.
pub struct SparsePlan {
    /// The codec, rebuilt from its spec: the plan's k is its `k_of(density, n)`, from the
    /// exact f64 density (the header's params hold it only as an f32).
    codec: Arc<dyn Codec>,
    select: Selection,
    shared: Shared,
}

/// The shared steps of kernels/sparse.cu.
struct Shared {
    count: Arc<dyn Function>,
    scan: Arc<dyn Function>,
    write: Arc<dyn Function>,
    check: Arc<dyn Function>,
    zero: Arc<dyn Function>,
    decode: Arc<dyn Function>,
    decode_add: Arc<dyn Function>,
    compensate: Arc<dyn Function>,
    fold: Arc<dyn Function>,
    settle: Arc<dyn Function>,
    ef_sub: Arc<dyn Function>,
}

impl SparsePlan {
    /// The plan of `codec` on device `ordinal` (loading its kernels); `Unsupported` for a
    /// codec that is not sparse.
    pub fn new(driver: &dyn Driver, ordinal: usize, codec: &dyn Codec) -> Result<SparsePlan> {
        let id = codec.id();
        if !matches!(id, CodecId::TopK | CodecId::MsTopK | CodecId::RandK) {
            return Err(Error::Unsupported(format!(
                "no sparse launch plan for codec {} (sparse codecs only: topk, mstopk, randk)",
                codec.spec()
            )));
        }
        let codec = CodecSpec::parse(&codec.spec())?.codec().clone();
        let f = |name: &str| driver.function(ordinal, &format!("qccl_sparse_{name}"));
        let shared = Shared {
            count: f("count")?,
            scan: f("scan")?,
            write: f("write")?,
            check: f("check")?,
            zero: f("zero")?,
            decode: f("decode")?,
            decode_add: f("decode_add")?,
            compensate: f("compensate")?,
            fold: f("fold")?,
            settle: f("settle")?,
            ef_sub: f("ef_sub")?,
        };
        // mstopk's samplings are the low half of its params (sparse::params).
        let samplings = codec.params() as u32;
        let select = Selection::new(driver, ordinal, id, samplings)?;
        Ok(SparsePlan {
            codec,
            select,
            shared,
        })
    }

    /// Pairs of a chunk of `count` elements, after checking the count fits the kernels.
    fn pairs(&self, count: usize) -> Result<usize> {
        if u32::try_from(count).is_err() {
            return Err(Error::Unsupported(format!(
                "{} on a device encodes chunks of fewer than 2^32 elements, got {count}",
                self.codec.spec()
            )));
        }
        Ok(self.codec.payload_len(count) / 8)
    }

    /// The selection of `x`'s `k` pairs by `t`, then the compaction writing them into
    /// `payload`.
    ///
    /// # Safety
    /// The trait's contract: `x` holds `n` f32s, `payload` 8 k bytes, `at` scratch of this
    /// plan for `n` elements.
    #[allow(clippy::too_many_arguments)]
    unsafe fn select_and_write(
        &self,
        t: &dyn Thresholds,
        s: &dyn Stream,
        x: u64,
        payload: u64,
        n: usize,
        k: usize,
        key: u64,
        at: &Scratch,
    ) -> Result<()> {
        // SAFETY: the caller's promise; the selection fills at.state.
        unsafe { t.fill(s, x, n, k, key, at) }?;
        let (n64, warps) = (Arg::U64(n as u64), grid_for(n.div_ceil(SEGMENT) * WARP));
        // SAFETY: sparse.cu's qccl_sparse_count(const float* x, const sp_u64* st,
        // sp_u64* counts, sp_u64 n), qccl_sparse_scan(sp_u64* counts, sp_u64 n) and
        // qccl_sparse_write(x, st, counts, uint8_t* payload, n) with whole warps (BLOCK is a
        // multiple of 32, at most TILE_WARPS of them) and the scan's one block; counts hold 2
        // words a segment (Scratch).
        unsafe {
            let (st, counts) = (Arg::Ptr(at.state), Arg::Ptr(at.counts));
            s.launch(
                &*self.shared.count,
                warps,
                BLOCK,
                &[Arg::Ptr(x), st, counts, n64],
            )?;
            s.launch(&*self.shared.scan, 1, SCAN_BLOCK, &[counts, n64])?;
            let args = [Arg::Ptr(x), st, counts, Arg::Ptr(payload), n64];
            s.launch(&*self.shared.write, warps, BLOCK, &args)
        }
    }

    /// The scratch of `count` elements at `scratch`, checked.
    fn scratch_at(&self, count: usize, scratch: u64) -> Result<Scratch> {
        Scratch::at(self.select.needs(), count, scratch)
    }
}

impl CodecPlan for SparsePlan {
    fn codec(&self) -> CodecId {
        self.codec.id()
    }

    fn payload_len(&self, count: usize) -> usize {
        self.codec.payload_len(count)
    }

    fn scratch_len(&self, count: usize) -> usize {
        Scratch::len(self.select.needs(), count)
    }

    unsafe fn encode(
        &self,
        s: &dyn Stream,
        x: u64,
        payload: u64,
        count: usize,
        key: u64,
        scratch: u64,
    ) -> Result<()> {
        let k = self.pairs(count)?;
        let at = self.scratch_at(count, scratch)?;
        if k == 0 {
            return Ok(());
        }
        match &self.select {
            // SAFETY: the caller's promise (the trait's contract): n f32s at x, 8 k bytes at
            // payload.
            Selection::Strata(r) => unsafe { r.encode(s, x, payload, count, k, key) },
            // SAFETY: as above, and `at` is this plan's scratch for count elements.
            Selection::Thresholds(t) => unsafe {
                self.select_and_write(&**t, s, x, payload, count, k, key, &at)
            },
        }
    }

    unsafe fn encode_ef(
        &self,
        s: &dyn Stream,
        x: u64,
        res: u64,
        w_out: u64,
        payload: u64,
        count: usize,
        key: u64,
        scratch: u64,
    ) -> Result<()> {
        let k = self.pairs(count)?;
        let at = self.scratch_at(count, scratch)?;
        if count == 0 {
            return Ok(());
        }
        let (n64, grid) = (Arg::U64(count as u64), grid_over(count));
        let t = match &self.select {
            // The pairs of w first (x and res unchanged yet), then the element pass with no
            // stratum arithmetic, then what was sent off the residual.
            // SAFETY: the caller's promise (the trait's contract): n f32s at x, res and
            // w_out (unless 0), 8 k bytes at payload; sparse.cu's
            // qccl_sparse_compensate(x, res, w, n) takes a null w, and
            // qccl_sparse_ef_sub(payload, res, k) reads the pairs just written (indices
            // below count).
            Selection::Strata(r) => unsafe {
                r.encode_ef_pairs(s, x, res, payload, count, k, key)?;
                let args = [Arg::Ptr(x), Arg::Ptr(res), Arg::Ptr(w_out), n64];
                s.launch(&*self.shared.compensate, grid, BLOCK, &args)?;
                let args = [Arg::Ptr(payload), Arg::Ptr(res), Arg::U64(k as u64)];
                return s.launch(&*self.shared.ef_sub, grid_over(k), BLOCK, &args);
            },
            Selection::Thresholds(t) => &**t,
        };
        // w lives in w_out, or else in the residual until the payload is written.
        let w = if w_out != 0 { w_out } else { res };
        // SAFETY: sparse.cu's qccl_sparse_compensate(const float* x, float* res, float* w,
        // sp_u64 n) and qccl_sparse_fold(const float* x, float* res, sp_u64 n), then the
        // selection on w; the ranges are the caller's (the trait's contract), `at` this
        // plan's scratch for count elements.
        unsafe {
            if w_out != 0 {
                let args = [Arg::Ptr(x), Arg::Ptr(res), Arg::Ptr(w_out), n64];
                s.launch(&*self.shared.compensate, grid, BLOCK, &args)?;
            } else {
                s.launch(
                    &*self.shared.fold,
                    grid,
                    BLOCK,
                    &[Arg::Ptr(x), Arg::Ptr(res), n64],
                )?;
            }
            self.select_and_write(t, s, w, payload, count, k, key, &at)?;
        }
        // SAFETY: qccl_sparse_settle(float* res, sp_u64 n) and qccl_sparse_ef_sub(const
        // uint8_t* payload, float* res, sp_u64 k): the payload was just written by this
        // plan, its indices are below count.
        unsafe {
            if w_out == 0 {
                s.launch(&*self.shared.settle, grid, BLOCK, &[Arg::Ptr(res), n64])?;
            }
            let args = [Arg::Ptr(payload), Arg::Ptr(res), Arg::U64(k as u64)];
            s.launch(&*self.shared.ef_sub, grid_over(k), BLOCK, &args)
        }
    }

    unsafe fn decode(
        &self,
        s: &dyn Stream,
        payload: u64,
        out: u64,
        count: usize,
        add: bool,
        bad: u64,
        _scratch: u64,
    ) -> Result<()> {
        let k = self.pairs(count)?;
        if count == 0 {
            return Ok(());
        }
        if bad == 0 {
            return Err(Error::invalid(format!(
                "{} decode: bad is null (the index check stores its verdict there)",
                self.codec.spec()
            )));
        }
        let (n64, k64) = (Arg::U64(count as u64), Arg::U64(k as u64));
        // SAFETY: sparse.cu's qccl_sparse_check(const uint8_t* payload, int* bad, sp_u64 n,
        // sp_u64 k), qccl_sparse_zero(float* out, sp_u64 n) and qccl_sparse_decode(_add)(
        // const uint8_t* payload, float* out, sp_u64 n, sp_u64 k), which skips indices >= n,
        // so even a refused payload writes only inside out; the ranges are the caller's.
        unsafe {
            let args = [Arg::Ptr(payload), Arg::Ptr(bad), n64, k64];
            s.launch(&*self.shared.check, grid_over(k), BLOCK, &args)?;
            if !add {
                s.launch(
                    &*self.shared.zero,
                    grid_over(count),
                    BLOCK,
                    &[Arg::Ptr(out), n64],
                )?;
            }
            let f = if add {
                &self.shared.decode_add
            } else {
                &self.shared.decode
            };
            let args = [Arg::Ptr(payload), Arg::Ptr(out), n64, k64];
            s.launch(&**f, grid_over(k), BLOCK, &args)
        }
    }
}
