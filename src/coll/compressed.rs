//! Compressed collectives over an f32 work buffer: build the descriptor
//! (which carries the codec plan's fingerprint, so ranks using different codecs are named),
//! run. Sums; the all-reduce also averages (`Coded::avg`), the others leave Avg to the caller,
//! which also converts other float types.

use super::Engine;
use crate::algo::compressed::{self as coded, Coder};
use crate::algo::Algo;
use crate::algo::Ctx;
use crate::codec::layout::CodecMap;
use crate::codec::Site;
use crate::reduce;
use crate::transport::frame::CollKind;
use crate::tuning::Flat;
use crate::types::{DType, ReduceOp};
use crate::Result;

/// One compressed call's context: the plan, where its random streams start, which element of
/// the plan `work[0]` is, and the error-feedback residual (aligned with `work`).
pub struct Coded<'a> {
    /// What every element is encoded with.
    pub plan: &'a CodecMap,
    /// Seed, step and encoding rank (chunk is set per piece).
    pub site: Site,
    /// Plan position of `work[0]`.
    pub base: usize,
    /// Error-feedback residual, if the call keeps one.
    pub residual: Option<&'a mut [f32]>,
    /// The dtype the user called with (for the descriptor).
    pub dtype: DType,
    /// Out of place: the input, aligned with `work`, which then holds nothing yet. Read where
    /// the schedule first reads each element, so no pass copies it into `work` first.
    pub input: Option<&'a [f32]>,
    /// Avg: the all-reduce divides its sums by the number of ranks (SRA as each slice is
    /// final, while it is in cache; the other schedules after the last exchange).
    pub avg: bool,
}

impl<'a> Coded<'a> {
    /// The context of a call (or of one level of it: `base` is the plan position of
    /// `work[0]`).
    pub fn new(
        plan: &'a CodecMap,
        site: Site,
        base: usize,
        residual: Option<&'a mut [f32]>,
        dtype: DType,
    ) -> Coded<'a> {
        Coded {
            plan,
            site,
            base,
            residual,
            dtype,
            input: None,
            avg: false,
        }
    }

    /// Out of place: `work` holds nothing yet, the data is `input` (None: in place).
    pub fn input(mut self, input: Option<&'a [f32]>) -> Coded<'a> {
        self.input = input;
        self
    }

    /// Whether the all-reduce averages (divides its sums by the number of ranks).
    pub fn avg(mut self, on: bool) -> Coded<'a> {
        self.avg = on;
        self
    }
}

/// Copies `input` into `work` (out of place, for schedules that read `work` only).
fn fill(work: &mut [f32], input: Option<&[f32]>) {
    if let Some(i) = input {
        work.copy_from_slice(i);
    }
}

impl Engine {
    /// The context of a compressed call: its frames carry the plan's fingerprint.
    pub(crate) fn coded_ctx(
        &mut self,
        coll: CollKind,
        count: usize,
        c: &Coded<'_>,
        algo: Algo,
    ) -> Ctx<'_> {
        let mut ctx = self.ctx(coll, count, c.dtype, ReduceOp::Sum, 0, algo as u8);
        ctx.desc.root = c.plan.fingerprint();
        ctx
    }

    /// Compressed all-reduce (sum, or average with `c.avg`) of `work` in place with schedule
    /// `algo` (chosen by `tuning`).
    pub fn all_reduce_coded(&mut self, work: &mut [f32], c: Coded<'_>, algo: Flat) -> Result<()> {
        if work.is_empty() {
            return Ok(());
        }
        let (input, n) = (c.input, self.size);
        let avg = c.avg.then_some(n);
        if algo != Flat::Sra {
            fill(work, input);
        }
        let scratch = std::mem::take(&mut self.scratch.decoded);
        let mut ctx = self.coded_ctx(CollKind::AllReduce, work.len(), &c, algo.algo());
        let mut cd = Coder::new(c.plan, c.site, c.base, c.residual, scratch);
        let done = match algo {
            Flat::Ring => coded::ring::all_reduce(&mut ctx, &mut cd, work),
            Flat::Tree => coded::tree::all_reduce(&mut ctx, &mut cd, work),
            Flat::AllGather => coded::gather::all_reduce(&mut ctx, &mut cd, work),
            // Reads the input where it encodes it, and copies only its own chunk.
            Flat::Sra => coded::sra::all_reduce(&mut ctx, &mut cd, input, work, avg),
        };
        self.scratch.decoded = cd.into_scratch();
        if avg.is_some() && algo != Flat::Sra && done.is_ok() {
            reduce::finish_avg(DType::Float32, bytemuck::cast_slice_mut(work), n);
        }
        done
    }

    /// Compressed reduce-scatter (sum): afterwards part `rank` of `work`
    /// (`algo::part(len, size, rank)`) holds its sum. Out of place (`c.input`), the other
    /// parts of `work` are left as they were.
    pub fn reduce_scatter_coded(&mut self, work: &mut [f32], c: Coded<'_>) -> Result<()> {
        if work.is_empty() {
            return Ok(());
        }
        let input = c.input;
        let scratch = std::mem::take(&mut self.scratch.decoded);
        let mut ctx = self.coded_ctx(CollKind::ReduceScatter, work.len(), &c, Algo::Sra);
        let mut cd = Coder::new(c.plan, c.site, c.base, c.residual, scratch);
        let done = coded::sra::reduce_scatter(&mut ctx, &mut cd, input, work);
        self.scratch.decoded = cd.into_scratch();
        done
    }

    /// Compressed all-gather in place: part `rank` of `work` is encoded once and every rank
    /// (this one included) ends with the decoded parts of all ranks.
    pub fn all_gather_coded(&mut self, work: &mut [f32], c: Coded<'_>) -> Result<()> {
        if work.is_empty() {
            return Ok(());
        }
        let n = self.size;
        let chunks: Vec<_> = (0..n).map(|p| coded::chunk(work.len(), n, p)).collect();
        let scratch = std::mem::take(&mut self.scratch.decoded);
        let mut ctx = self.coded_ctx(CollKind::AllGather, work.len(), &c, Algo::Ring);
        let mut cd = Coder::new(c.plan, c.site, c.base, c.residual, scratch);
        let done = if n == 1 {
            // One rank still ends with the decoded value, as it would among several.
            cd.encode_own(work, chunks[0].clone(), &mut Vec::new())
        } else {
            coded::ring::all_gather(&mut ctx, &mut cd, work, &chunks, |q| q)
        };
        self.scratch.decoded = cd.into_scratch();
        done
    }
}
