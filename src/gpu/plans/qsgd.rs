//! `qsgd` on a device, as kernels/shim/qsgd_driver.cpp launches kernels/qsgd.cu: the bucket
//! scales first (a warp per bucket, a thread per bucket under 32 elements, or for buckets over
//! `QSGD_RUN` elements a warp per run into scratch, then a thread per bucket merging the runs),
//! then the levels (a thread per group of 8 elements, reading the scales back from the
//! payload). Decode: the check kernel into `bad`, then the decode kernel unconditionally (it
//! reads only the payload's own bytes and writes only `out`, so a refused payload is safe to
//! decode).

use super::{grid_for, CodecPlan, BLOCK};
use crate::codec::{Codec, CodecId};
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Driver, Function, Stream};
use std::sync::Arc;

/// qsgd.cu's `QSGD_RUN`: elements a warp scans on the large-bucket scale path.
const RUN: usize = 4096;

/// Threads of a warp: qsgd.cu's scale scans take one per bucket or run (`BLOCK` is a
/// multiple of it).
const WARP: usize = 32;

/// Bytes of qsgd.cu's `QsgdLanes` (16 f32 lanes and an int flag; 4-byte aligned).
const LANES_BYTES: usize = 68;

/// The codec's fields, as `Qsgd::params` packs them (the wire header's parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fields {
    bits: u32,
    bucket: u32,
    maxabs: bool,
    nearest: bool,
}

impl Fields {
    /// Unpacks `params`: bits in bits 0..8, the bucket in 8..40, maxabs bit 40, nearest bit 41.
    fn from_params(params: u64) -> Result<Fields> {
        let f = Fields {
            bits: (params & 0xff) as u32,
            bucket: (params >> 8) as u32,
            maxabs: params >> 40 & 1 == 1,
            nearest: params >> 41 & 1 == 1,
        };
        if !(1..=8).contains(&f.bits) || !(1..=1 << 24).contains(&f.bucket) || params >> 42 != 0 {
            return Err(Error::invalid(format!(
                "qsgd launch plan: parameters {params:#x} are not a qsgd codec's"
            )));
        }
        Ok(f)
    }

    fn buckets(&self, count: usize) -> usize {
        count.div_ceil(self.bucket as usize)
    }

    /// Whether the scales are scanned in runs (through scratch), as the shim driver chooses.
    fn by_runs(&self) -> bool {
        self.bucket as usize > RUN
    }

    /// The runs of the large-bucket path: `QSGD_RUN`-element pieces of every bucket.
    fn runs(&self, count: usize) -> usize {
        self.buckets(count) * (self.bucket as usize).div_ceil(RUN)
    }
}

/// qsgd's kernels on one device, with the codec's fields.
pub struct QsgdPlan {
    fields: Fields,
    bounds: Arc<dyn Function>,
    bounds_ef: Arc<dyn Function>,
    runs: Arc<dyn Function>,
    runs_ef: Arc<dyn Function>,
    merge: Arc<dyn Function>,
    levels: Arc<dyn Function>,
    levels_ef: Arc<dyn Function>,
    check: Arc<dyn Function>,
    decode: Arc<dyn Function>,
    decode_add: Arc<dyn Function>,
}

impl QsgdPlan {
    /// The plan of the qsgd codec `codec` on device `ordinal` (loading its kernels);
    /// `InvalidArgument` for another codec.
    pub fn new(driver: &dyn Driver, ordinal: usize, codec: &dyn Codec) -> Result<QsgdPlan> {
        if codec.id() != CodecId::Qsgd {
            return Err(Error::invalid(format!(
                "qsgd launch plan: codec {} is not qsgd",
                codec.spec()
            )));
        }
        let fields = Fields::from_params(codec.params())?;
        let f = |step: &str| driver.function(ordinal, &format!("qccl_qsgd_{step}"));
        Ok(QsgdPlan {
            fields,
            bounds: f("bounds")?,
            bounds_ef: f("bounds_ef")?,
            runs: f("runs")?,
            runs_ef: f("runs_ef")?,
            merge: f("merge")?,
            levels: f("levels")?,
            levels_ef: f("levels_ef")?,
            check: f("check")?,
            decode: f("decode")?,
            decode_add: f("decode_add")?,
        })
    }

    /// The arguments every kernel ends its list with: (n, bucket, maxabs).
    fn shape(&self, count: usize) -> [Arg; 3] {
        [
            Arg::U64(count as u64),
            Arg::U32(self.fields.bucket),
            Arg::I32(self.fields.maxabs as i32),
        ]
    }

    /// Enqueues the scales into `payload`: by bucket, or by runs into `scratch` then merged.
    /// `res`: the error-feedback residual added to `x` (None: plain encode).
    ///
    /// # Safety
    /// As [`CodecPlan::encode_ef`]; `count` is not 0.
    unsafe fn scales(
        &self,
        s: &dyn Stream,
        x: u64,
        res: Option<u64>,
        payload: u64,
        count: usize,
        scratch: u64,
    ) -> Result<()> {
        let [n, bucket, maxabs] = self.shape(count);
        let nb = grid_for(self.fields.buckets(count));
        // The scans take a warp per run, or per bucket of 32 elements or more.
        let warps = |n: usize| grid_for(n * WARP);
        let by_runs = self.fields.by_runs();
        if by_runs && scratch == 0 {
            return Err(Error::invalid(format!(
                "qsgd launch plan: buckets of {} elements need {} bytes of scratch (got null)",
                self.fields.bucket,
                self.scratch_len(count)
            )));
        }
        // The first kernel writes the scales, or the runs' lanes into scratch.
        let (plain, ef, out, grid) = if by_runs {
            let grid = warps(self.fields.runs(count));
            (&self.runs, &self.runs_ef, scratch, grid)
        } else if self.fields.bucket as usize >= WARP {
            let grid = warps(self.fields.buckets(count));
            (&self.bounds, &self.bounds_ef, payload, grid)
        } else {
            (&self.bounds, &self.bounds_ef, payload, nb)
        };
        let (f, inputs) = match res {
            Some(res) => (ef, vec![Arg::Ptr(x), Arg::Ptr(res)]),
            None => (plain, vec![Arg::Ptr(x)]),
        };
        let args = [&inputs[..], &[Arg::Ptr(out), n, bucket, maxabs]].concat();
        // SAFETY: qccl_qsgd_bounds[_ef](x, [res,] payload, n, bucket, maxabs) or
        // qccl_qsgd_runs[_ef](x, [res,] runs, n, bucket, maxabs), the runs in the
        // scratch_len(count) bytes at `scratch`; the ranges are the caller's to keep valid (the
        // trait's contract).
        unsafe { s.launch(&**f, grid, BLOCK, &args) }?;
        if !by_runs {
            return Ok(());
        }
        let args = [Arg::Ptr(scratch), Arg::Ptr(payload), n, bucket, maxabs];
        // SAFETY: qccl_qsgd_merge(runs, payload, n, bucket, maxabs), after the runs on `s`.
        unsafe { s.launch(&*self.merge, nb, BLOCK, &args) }
    }

    /// The arguments after the levels kernels' pointers: (n, bits, bucket, maxabs, nearest, key).
    fn level_args(&self, count: usize, key: u64) -> [Arg; 6] {
        [
            Arg::U64(count as u64),
            Arg::U32(self.fields.bits),
            Arg::U32(self.fields.bucket),
            Arg::I32(self.fields.maxabs as i32),
            Arg::I32(self.fields.nearest as i32),
            Arg::U64(key),
        ]
    }
}

/// Blocks for the kernels that take a thread per group of 8 elements.
fn groups_grid(count: usize) -> u32 {
    grid_for(count.div_ceil(8))
}

impl CodecPlan for QsgdPlan {
    fn codec(&self) -> CodecId {
        CodecId::Qsgd
    }

    fn payload_len(&self, count: usize) -> usize {
        let meta = if self.fields.maxabs { 4 } else { 8 };
        self.fields.buckets(count) * meta + (count * self.fields.bits as usize).div_ceil(8)
    }

    /// The runs' lanes for buckets over `QSGD_RUN` elements (4-byte aligned: floats and an
    /// int); none otherwise.
    fn scratch_len(&self, count: usize) -> usize {
        if self.fields.by_runs() {
            self.fields.runs(count) * LANES_BYTES
        } else {
            0
        }
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
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's promise (the trait's contract).
        unsafe { self.scales(s, x, None, payload, count, scratch) }?;
        let args = [
            &[Arg::Ptr(x), Arg::Ptr(payload)],
            &self.level_args(count, key)[..],
        ]
        .concat();
        // SAFETY: qccl_qsgd_levels(x, payload, n, bits, bucket, maxabs, nearest, key), after
        // the scales it reads on `s`; as above.
        unsafe { s.launch(&*self.levels, groups_grid(count), BLOCK, &args) }
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
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's promise.
        unsafe { self.scales(s, x, Some(res), payload, count, scratch) }?;
        let ptrs = [
            Arg::Ptr(x),
            Arg::Ptr(res),
            Arg::Ptr(w_out),
            Arg::Ptr(payload),
        ];
        let args = [&ptrs[..], &self.level_args(count, key)[..]].concat();
        // SAFETY: qccl_qsgd_levels_ef(x, res, w_out, payload, n, bits, bucket, maxabs,
        // nearest, key), w_out may be null; after the scales on `s`; as above.
        unsafe { s.launch(&*self.levels_ef, groups_grid(count), BLOCK, &args) }
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
        if bad == 0 {
            return Err(Error::invalid(
                "qsgd launch plan: decode needs a flag word at `bad` (got null)",
            ));
        }
        if count == 0 {
            return Ok(());
        }
        let [n, bucket, maxabs] = self.shape(count);
        let args = [Arg::Ptr(payload), Arg::Ptr(bad), n, bucket, maxabs];
        let nb = grid_for(self.fields.buckets(count));
        // SAFETY: qccl_qsgd_check(payload, bad, n, bucket, maxabs); as above.
        unsafe { s.launch(&*self.check, nb, BLOCK, &args) }?;
        let f = if add { &self.decode_add } else { &self.decode };
        let bits = Arg::U32(self.fields.bits);
        let args = [Arg::Ptr(payload), Arg::Ptr(out), n, bits, bucket, maxabs];
        // SAFETY: qccl_qsgd_decode[_add](payload, out, n, bits, bucket, maxabs): in bounds
        // whatever the payload holds (the check's verdict only fails the call); as above.
        unsafe { s.launch(&**f, groups_grid(count), BLOCK, &args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::CodecSpec;

    #[test]
    fn fields_come_from_the_codecs_parameters() {
        for spec in [
            "qsgd:bits=1,bucket=1,scale=maxmin,rounding=stochastic",
            "qsgd:bits=8,bucket=16777216,scale=maxabs,rounding=nearest",
            "qsgd:bits=3,bucket=4097,scale=maxabs,rounding=stochastic",
        ] {
            let codec = CodecSpec::parse(spec).unwrap().codec().clone();
            let f = Fields::from_params(codec.params()).unwrap();
            let back = format!(
                "qsgd:bits={},bucket={},scale={},rounding={}",
                f.bits,
                f.bucket,
                if f.maxabs { "maxabs" } else { "maxmin" },
                if f.nearest { "nearest" } else { "stochastic" }
            );
            assert_eq!(back, codec.spec());
        }
        for bad in [
            0u64,
            9 | 1 << 8,
            4,
            4 | (1 << 24 | 1) << 8,
            4 | 1 << 8 | 1 << 42,
        ] {
            assert!(matches!(
                Fields::from_params(bad),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn scratch_holds_every_run_of_large_buckets_only() {
        let f = Fields::from_params(4 | 5000 << 8).unwrap();
        assert!(f.by_runs());
        // 3 buckets of 5000 (the last partial), 2 runs each.
        assert_eq!(f.runs(12_000), 6);
        let f = Fields::from_params(4 | 4096 << 8).unwrap();
        assert!(!f.by_runs());
    }
}
