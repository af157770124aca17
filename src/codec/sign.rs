//! One-bit codecs, both meant to run with error feedback (on by default in their specs):
//!
//! - `efsign`: scaled sign (Karimireddy et al., EF-SignSGD). Payload: one f32 scale s = ‖x‖₁ / n,
//!   then one bit per element (set for x >= 0); decodes to ±s.
//! - `onebit:bucket=N`: Seide et al.'s 1-bit SGD. Per bucket of N elements (default 512, in the
//!   range of the matrix columns CNTK quantizes one at a time) the mean of the non-negative
//!   elements and the mean of the negative ones (two f32, all buckets' first), then one bit per
//!   element choosing between them.
//!
//! Bits are dense, element k at bit k mod 8 of byte k / 8. NaN has its bit clear (NaN >= 0 is
//! false). A scale computed from non-finite input is sent as NaN and decodes to NaN; a negative
//! or infinite scale is rejected by the decoder.

use super::bits;
use super::fields::Fields;
use super::{Codec, CodecId, Rng};
use crate::error::{Error, Result};

/// Elements per tile of the encode loops (L1-resident).
const TILE: usize = 2048;

/// Largest accepted onebit bucket.
pub const MAX_BUCKET: u32 = 1 << 24;

/// The `efsign` codec: sign bits with one scale (the mean magnitude) per chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EfSign;

/// The `onebit` codec: sign bits with per-bucket means of each sign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneBit {
    bucket: u32,
}

/// Sum of |x| and whether any x is non-finite, over a slice, in eight f32 lanes.
#[inline(always)]
fn abs_sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j].abs();
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        acc[j] += x.abs();
    }
    acc.iter().sum()
}

/// The sum of the non-negative elements, their count and the sum of all, over a slice in eight
/// f32 lanes (the count is exact: slices are at most a tile long). One comparison per element
/// keeps the loop vectorized; the negatives' sum and count follow by difference, and a
/// non-finite total reveals NaN or infinite input.
#[inline(always)]
fn sign_sums(xs: &[f32]) -> (f32, f32, f32) {
    let mut ps = [0.0f32; 8];
    let mut pc = [0.0f32; 8];
    let mut tot = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        let c: &[f32; 8] = c.try_into().expect("8 lanes");
        for j in 0..8 {
            let x = c[j];
            let p = x >= 0.0;
            ps[j] += if p { x } else { 0.0 };
            pc[j] += if p { 1.0 } else { 0.0 };
            tot[j] += x;
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        let p = x >= 0.0;
        ps[j] += if p { x } else { 0.0 };
        pc[j] += if p { 1.0 } else { 0.0 };
        tot[j] += x;
    }
    let sum = |a: [f32; 8]| a.iter().sum::<f32>();
    (sum(ps), sum(pc), sum(tot))
}

/// efsign's encoder kernel: `out` is the whole payload.
#[inline(always)]
pub(super) fn efsign_encode_kernel(input: &[f32], out: &mut [u8]) {
    let (head, stream) = out.split_at_mut(4);
    let mut total = 0.0f64;
    for (i, tile) in input.chunks(TILE).enumerate() {
        let b0 = i * TILE / 8;
        bits::pack_signs_tail(tile, &mut stream[b0..b0 + tile.len().div_ceil(8)]);
        // f32 lanes within a tile, f64 across tiles: accurate for any n.
        total += abs_sum(tile) as f64;
    }
    let s = if input.is_empty() {
        0.0
    } else {
        (total / input.len() as f64) as f32
    };
    let s = if s.is_finite() { s } else { f32::NAN };
    head.copy_from_slice(&s.to_le_bytes());
}

/// onebit's encoder kernel: `out` is the whole payload.
#[inline(always)]
pub(super) fn onebit_encode_kernel(c: &OneBit, input: &[f32], out: &mut [u8]) {
    let n = input.len();
    let b = c.bucket as usize;
    let (meta, stream) = out.split_at_mut(n.div_ceil(b) * 8);
    // Running sums of the current bucket (f64 across tiles).
    let (mut ps, mut pc, mut tot) = (0.0f64, 0.0f64, 0.0f64);
    let mut t0 = 0;
    while t0 < n {
        let len = TILE.min(n - t0);
        let tile = &input[t0..t0 + len];
        let b0 = t0 / 8;
        bits::pack_signs_tail(tile, &mut stream[b0..b0 + len.div_ceil(8)]);
        let mut p = t0;
        while p < t0 + len {
            let bi = p / b;
            let bend = ((bi + 1) * b).min(n);
            let end = bend.min(t0 + len);
            let (a, k, t) = sign_sums(&input[p..end]);
            ps += a as f64;
            pc += k as f64;
            tot += t as f64;
            if end == bend {
                let nc = (bend - bi * b) as f64 - pc;
                let mean = |s: f64, c: f64| if c == 0.0 { 0.0 } else { (s / c) as f32 };
                // The negatives' mean is at most 0 even after rounding of the difference.
                let (pos, neg) = (mean(ps, pc), mean(tot - ps, nc).min(0.0));
                let ok = tot.is_finite() && pos.is_finite() && neg.is_finite();
                let (pos, neg) = if ok { (pos, neg) } else { (f32::NAN, f32::NAN) };
                meta[8 * bi..8 * bi + 4].copy_from_slice(&pos.to_le_bytes());
                meta[8 * bi + 4..8 * bi + 8].copy_from_slice(&neg.to_le_bytes());
                (ps, pc, tot) = (0.0, 0.0, 0.0);
            }
            p = end;
        }
        t0 += len;
    }
}

/// The shared decoder kernel: bucket i of `bucket` elements decodes set bits to `values[i].0`
/// and clear bits to `values[i].1`.
#[inline(always)]
pub(super) fn signs_decode_kernel<const ADD: bool>(
    bucket: usize,
    values: &[(f32, f32)],
    bits: &[u8],
    out: &mut [f32],
) {
    for (i, (o, &(one, zero))) in out.chunks_mut(bucket).zip(values).enumerate() {
        bits::decode_signs::<ADD>(bits, i * bucket, o, one, zero);
    }
}

/// Runs the decoder kernel on the best path available (`simd` false forces the portable one).
fn signs_decode_with(
    simd: bool,
    bucket: usize,
    values: &[(f32, f32)],
    bits: &[u8],
    out: &mut [f32],
    add: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        if let Some(cpu) = super::x86::Avx2::detect() {
            return if add {
                cpu.run(
                    #[inline(always)]
                    || signs_decode_kernel::<true>(bucket, values, bits, out),
                )
            } else {
                cpu.run(
                    #[inline(always)]
                    || signs_decode_kernel::<false>(bucket, values, bits, out),
                )
            };
        }
    }
    let _ = simd;
    if add {
        signs_decode_kernel::<true>(bucket, values, bits, out)
    } else {
        signs_decode_kernel::<false>(bucket, values, bits, out)
    }
}

fn bad_scale(spec: String, what: &str, v: f32) -> Error {
    Error::invalid(format!("{spec}: invalid {what} {v}"))
}

impl EfSign {
    fn encode_with(&self, simd: bool, input: &[f32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            if let Some(cpu) = super::x86::Avx2::detect() {
                return cpu.run(
                    #[inline(always)]
                    || efsign_encode_kernel(input, out),
                );
            }
        }
        let _ = simd;
        efsign_encode_kernel(input, out)
    }

    fn decode_with(&self, simd: bool, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        let s = f32::from_le_bytes(payload[..4].try_into().expect("4 bytes"));
        if !(s.is_nan() || (s.is_finite() && s >= 0.0)) {
            return Err(bad_scale(self.spec(), "scale", s));
        }
        let bucket = out.len().max(1);
        signs_decode_with(simd, bucket, &[(s, -s)], &payload[4..], out, add);
        Ok(())
    }
}

impl Codec for EfSign {
    fn id(&self) -> CodecId {
        CodecId::EfSign
    }
    fn params(&self) -> u64 {
        0
    }
    fn spec(&self) -> String {
        "efsign".into()
    }
    fn payload_len(&self, n: usize) -> usize {
        4 + n.div_ceil(8)
    }
    fn encode_payload(&self, input: &[f32], _: &mut Rng, out: &mut [u8]) {
        self.encode_with(true, input, out)
    }
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        self.decode_with(true, payload, out, add)
    }
    /// With s = ‖x‖₁/n, ‖x − s·sign(x)‖² = ‖x‖² − ‖x‖₁²/n <= ‖x‖² (plus f32 rounding).
    fn error_bound(&self) -> Option<f64> {
        Some(1.0 + 1e-4)
    }
}

impl OneBit {
    /// A onebit codec with buckets of `bucket` elements (1..=[`MAX_BUCKET`]).
    pub fn new(bucket: u32) -> Result<OneBit> {
        if !(1..=MAX_BUCKET).contains(&bucket) {
            return Err(Error::invalid(format!(
                "onebit: bucket must be in 1..={MAX_BUCKET}, got {bucket}"
            )));
        }
        Ok(OneBit { bucket })
    }

    /// Parses the spec field `bucket` (default 512).
    pub fn from_fields(f: &mut Fields<'_>) -> Result<OneBit> {
        OneBit::new(f.int("bucket", 512, 1..=MAX_BUCKET as u64)? as u32)
    }

    fn encode_with(&self, simd: bool, input: &[f32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            if let Some(cpu) = super::x86::Avx2::detect() {
                return cpu.run(
                    #[inline(always)]
                    || onebit_encode_kernel(self, input, out),
                );
            }
        }
        let _ = simd;
        onebit_encode_kernel(self, input, out)
    }

    fn decode_with(&self, simd: bool, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        let nb = out.len().div_ceil(self.bucket as usize);
        let (meta, stream) = payload.split_at(nb * 8);
        let mut values = Vec::with_capacity(nb);
        for m in meta.chunks_exact(8) {
            let pos = f32::from_le_bytes(m[..4].try_into().expect("4 bytes"));
            let neg = f32::from_le_bytes(m[4..].try_into().expect("4 bytes"));
            let ok = (pos.is_nan() && neg.is_nan())
                || (pos.is_finite() && neg.is_finite() && pos >= 0.0 && neg <= 0.0);
            if !ok {
                return Err(Error::invalid(format!(
                    "{}: invalid bucket means {pos}, {neg}",
                    self.spec()
                )));
            }
            values.push((pos, neg));
        }
        signs_decode_with(simd, self.bucket as usize, &values, stream, out, add);
        Ok(())
    }
}

impl Codec for OneBit {
    fn id(&self) -> CodecId {
        CodecId::OneBit
    }
    fn params(&self) -> u64 {
        self.bucket as u64
    }
    fn spec(&self) -> String {
        format!("onebit:bucket={}", self.bucket)
    }
    fn payload_len(&self, n: usize) -> usize {
        n.div_ceil(self.bucket as usize) * 8 + n.div_ceil(8)
    }
    fn encode_payload(&self, input: &[f32], _: &mut Rng, out: &mut [u8]) {
        self.encode_with(true, input, out)
    }
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        self.decode_with(true, payload, out, add)
    }
    /// Each sign group is replaced by its mean, and Σ(x − mean)² <= Σx² (plus f32 rounding).
    fn error_bound(&self) -> Option<f64> {
        Some(1.0 + 1e-4)
    }
}

#[cfg(test)]
mod tests;
