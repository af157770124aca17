//! Compressed schedules: the same ring, tree and scatter-reduce-allgather as the dense ones,
//! but every chunk is encoded where it leaves a rank and decoded where it arrives, because
//! quantized or sparsified values cannot be summed in compressed form.
//!
//! Two rules keep every rank bit-identical: a sum is encoded once by the rank that finished it,
//! which then replaces its own copy with the decoded value (CGX), and every other rank decodes
//! those same bytes; decoded contributions are always added in a fixed order.
//!
//! All schedules work on an f32 `work` buffer and sum; an average divides each final value by
//! the number of ranks (SRA as each slice is final, the others after their last exchange).

pub mod gather;
pub mod hop;
pub mod ring;
pub mod sra;
pub mod tree;

use super::Ctx;
use crate::codec::layout::CodecMap;
use crate::codec::{ef, Site};
use crate::Result;
use std::ops::Range;

/// Encodes and decodes element ranges of the work buffer for one call, keeping the
/// error-feedback residual and the wire counters.
pub struct Coder<'a> {
    plan: &'a CodecMap,
    site: Site,
    /// Plan position of `work[0]` (non-zero when a sub-range of a buffer is reduced).
    base: usize,
    /// What encodes lost, aligned with `work` (error feedback), if kept.
    residual: Option<&'a mut [f32]>,
    decoded: Vec<f32>,
}

impl<'a> Coder<'a> {
    /// A coder for `plan`, where `work[0]` is element `base` of the plan.
    pub fn new(
        plan: &'a CodecMap,
        site: Site,
        base: usize,
        residual: Option<&'a mut [f32]>,
        decoded: Vec<f32>,
    ) -> Self {
        Coder {
            plan,
            site,
            base,
            residual,
            decoded,
        }
    }

    /// Gives back the scratch it was lent (to keep for the next call).
    pub fn into_scratch(self) -> Vec<f32> {
        self.decoded
    }

    fn at(&self, r: &Range<usize>) -> Range<usize> {
        self.base + r.start..self.base + r.end
    }

    /// Bytes of the encoding of `work[r]`.
    pub fn len(&self, r: &Range<usize>) -> usize {
        self.plan.encoded_len(self.at(r))
    }

    /// Encodes `work[r]` into `out` (resized to fit); records the loss for error feedback.
    pub fn encode(&mut self, work: &[f32], r: Range<usize>, out: &mut Vec<u8>) -> Result<()> {
        self.encode_inner(work, &r, out)?;
        let at = self.at(&r);
        if let Some(res) = self.residual.as_deref_mut() {
            // residual += input − decoded, as two steps so sparse codecs stay O(k).
            let res = &mut res[r.clone()];
            for (e, x) in res.iter_mut().zip(&work[r]) {
                *e += x;
            }
            self.plan.decode_sub(at, out, res, &mut self.decoded)?;
        }
        Ok(())
    }

    /// Encodes `work[r]` into `out` and replaces `work[r]` by the decoded value, so this rank
    /// holds exactly what every receiver of `out` will hold.
    pub fn encode_own(
        &mut self,
        work: &mut [f32],
        r: Range<usize>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let at = self.at(&r);
        out.resize(self.plan.encoded_len(at.clone()), 0);
        if let Some(res) = self.residual.as_deref_mut() {
            // The input, kept to record what the encode lost.
            self.decoded.clear();
            self.decoded.extend_from_slice(&work[r.clone()]);
            self.plan
                .encode_own(at, &mut work[r.clone()], self.site, out)?;
            ef::record(&mut res[r.clone()], &self.decoded, &work[r]);
        } else {
            self.plan.encode_own(at, &mut work[r], self.site, out)?;
        }
        Ok(())
    }

    fn encode_inner(&mut self, work: &[f32], r: &Range<usize>, out: &mut Vec<u8>) -> Result<()> {
        let at = self.at(r);
        out.resize(self.plan.encoded_len(at.clone()), 0);
        self.plan.encode(at, &work[r.clone()], self.site, out)?;
        Ok(())
    }

    /// Decodes `bytes` (the encoding of `work[r]`) into `work[r]`, or adds it when `add`.
    pub fn decode(&self, bytes: &[u8], work: &mut [f32], r: Range<usize>, add: bool) -> Result<()> {
        self.plan.decode(self.at(&r), bytes, &mut work[r], add)
    }
}

/// Element range of chunk `c` of `count` elements cut in `n` near-equal chunks.
pub fn chunk(count: usize, n: usize, c: usize) -> Range<usize> {
    super::part(count, n, c, 1)
}

/// Slice `j` of `nsl` of element range `r`.
pub fn slice(r: &Range<usize>, nsl: usize, j: usize) -> Range<usize> {
    super::sub(r, nsl, j, 1)
}

/// Slices per chunk: the dense slice size applied to the uncompressed f32 bytes, so that
/// encoding slice j+1 overlaps the transfer of slice j as in the dense schedules.
pub fn nslices(ctx: &Ctx<'_>, elems: usize) -> usize {
    ctx.nslices(4 * elems)
}
