//! `qsgd`: bucketed max-min (or max-abs) quantization as CGX uses it (Alistarh et al.'s QSGD
//! with per-bucket scaling): each bucket of `bucket` elements is mapped onto 2^B − 1 evenly
//! spaced levels between its scale bounds, with stochastic (unbiased) or nearest rounding.
//!
//! Payload of n elements: the scales of all ⌈n / bucket⌉ buckets (maxmin: min and max as f32;
//! maxabs: one f32 m, levels spread over [−m, m]), then the levels as one dense B-bit stream
//! (least significant bit first), ⌈n·B / 8⌉ bytes. A bucket holding a non-finite value is sent
//! with NaN scales and decodes to NaN (as an uncompressed sum would be non-finite); any other
//! non-finite or inverted scale is rejected by the decoder.
//!
//! Stochastic rounding takes element i's uniform from the counter-based draw keyed by the encode
//! site ([`super::rng`]: 24 bits of one half of `draw(K, i / 2)`), so it depends on nothing but
//! (site, i): not on the bucket size, the tiling, the CPU path or a GPU's thread layout.

use super::bits;
use super::fields::Fields;
use super::rng::{mix, GOLDEN};
use super::{Codec, CodecId, Rng};
use crate::error::{Error, Result};

/// How a bucket's levels are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Between the bucket's minimum and maximum (two f32 per bucket).
    MaxMin,
    /// Symmetric over [−m, m], m the bucket's largest magnitude (one f32 per bucket).
    MaxAbs,
}

/// How a value between two levels is rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// Up with probability equal to the fractional position: unbiased.
    Stochastic,
    /// To the nearest level (ties up): biased, half the error.
    Nearest,
}

/// The `qsgd` codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qsgd {
    bits: u8,
    bucket: u32,
    scale: Scale,
    rounding: Rounding,
}

/// Which compiled encode kernel to run: the best one the CPU has, at most this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    #[cfg_attr(not(test), allow(dead_code))] // the tests' reference
    Portable,
    Avx2,
    Avx512,
}

/// Largest accepted bucket (bucket indices and lengths then stay far from overflow).
pub const MAX_BUCKET: u32 = 1 << 24;

/// Elements per tile of the encode and decode loops: small enough that a tile's input, random
/// numbers and levels stay in L1.
const TILE: usize = 2048;

impl Qsgd {
    /// A qsgd codec: `bits` in 1..=8, `bucket` in 1..=[`MAX_BUCKET`].
    pub fn new(bits: u32, bucket: u32, scale: Scale, rounding: Rounding) -> Result<Qsgd> {
        if !(1..=8).contains(&bits) {
            return Err(Error::invalid(format!(
                "qsgd: bits must be in 1..=8, got {bits}"
            )));
        }
        if !(1..=MAX_BUCKET).contains(&bucket) {
            return Err(Error::invalid(format!(
                "qsgd: bucket must be in 1..={MAX_BUCKET}, got {bucket}"
            )));
        }
        Ok(Qsgd {
            bits: bits as u8,
            bucket,
            scale,
            rounding,
        })
    }

    /// Parses the spec fields `bits`, `bucket`, `scale`, `rounding`.
    pub fn from_fields(f: &mut Fields<'_>) -> Result<Qsgd> {
        let bits = f.int("bits", 4, 1..=8)? as u32;
        let bucket = f.int("bucket", 128, 1..=MAX_BUCKET as u64)? as u32;
        let scale = [Scale::MaxMin, Scale::MaxAbs][f.choice("scale", &["maxmin", "maxabs"])?];
        let rounding = [Rounding::Stochastic, Rounding::Nearest]
            [f.choice("rounding", &["stochastic", "nearest"])?];
        Qsgd::new(bits, bucket, scale, rounding)
    }

    /// The top level, 2^B − 1 (levels are 0..=L).
    fn top(&self) -> u32 {
        (1 << self.bits) - 1
    }

    /// Scale bytes per bucket.
    fn meta_len(&self) -> usize {
        match self.scale {
            Scale::MaxMin => 8,
            Scale::MaxAbs => 4,
        }
    }

    fn meta_bytes(&self, n: usize) -> usize {
        n.div_ceil(self.bucket as usize) * self.meta_len()
    }

    /// The (lo, hi) bounds of bucket `i` as stored, checked: both NaN (a non-finite bucket), or
    /// finite with lo <= hi.
    fn bounds(&self, meta: &[u8], i: usize) -> Result<(f32, f32)> {
        let f = |k: usize| f32::from_le_bytes(meta[k..k + 4].try_into().expect("4 bytes"));
        let (lo, hi) = match self.scale {
            Scale::MaxMin => (f(8 * i), f(8 * i + 4)),
            Scale::MaxAbs => {
                let m = f(4 * i);
                (-m, m)
            }
        };
        if (lo.is_nan() && hi.is_nan()) || (lo.is_finite() && hi.is_finite() && lo <= hi) {
            Ok((lo, hi))
        } else {
            Err(Error::invalid(format!(
                "{}: bucket {i} has invalid scale bounds [{lo}, {hi}]",
                self.spec()
            )))
        }
    }

    /// Encode through the given path, or the best one below it that this CPU has (tests
    /// compare them).
    fn encode_with<D: Data>(&self, path: Path, input: D, rng: &Rng, out: &mut [u8]) {
        let key = rng.key();
        #[cfg(target_arch = "x86_64")]
        {
            if path >= Path::Avx512 {
                if let Some(cpu) = super::x86::Avx512::detect() {
                    // With vpmullq the compiler's vectorization of the draws is good. A closure,
                    // not the fn item: the fn item's call shim was not inlined here and ran
                    // without AVX-512 (measured: 30% slower encode).
                    #[allow(clippy::redundant_closure)]
                    return cpu.run(
                        #[inline(always)]
                        || {
                            encode_kernel(
                                self,
                                input,
                                key,
                                out,
                                #[inline(always)]
                                |k, i, u| fill_uniforms(k, i, u),
                            )
                        },
                    );
                }
            }
            if path >= Path::Avx2 {
                if let Some(cpu) = super::x86::Avx2::detect() {
                    return cpu.run(
                        #[inline(always)]
                        || {
                            encode_kernel(
                                self,
                                input,
                                key,
                                out,
                                #[inline(always)]
                                |k, i, u| cpu.fill_uniforms(k, i, u),
                            )
                        },
                    );
                }
            }
        }
        let _ = path;
        encode_kernel(self, input, key, out, fill_uniforms)
    }

    fn decode_with(&self, simd: bool, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        let nb = out.len().div_ceil(self.bucket as usize);
        for i in 0..nb {
            self.bounds(payload, i)?;
        }
        #[cfg(target_arch = "x86_64")]
        if simd {
            if let Some(cpu) = super::x86::Avx2::detect() {
                if add {
                    cpu.run(
                        #[inline(always)]
                        || decode_kernel::<true>(self, payload, out),
                    );
                } else {
                    cpu.run(
                        #[inline(always)]
                        || decode_kernel::<false>(self, payload, out),
                    );
                }
                return Ok(());
            }
        }
        let _ = simd;
        if add {
            decode_kernel::<true>(self, payload, out)
        } else {
            decode_kernel::<false>(self, payload, out)
        }
        Ok(())
    }
}

impl Codec for Qsgd {
    fn id(&self) -> CodecId {
        CodecId::Qsgd
    }

    fn params(&self) -> u64 {
        self.bits as u64
            | (self.bucket as u64) << 8
            | ((self.scale == Scale::MaxAbs) as u64) << 40
            | ((self.rounding == Rounding::Nearest) as u64) << 41
    }

    fn spec(&self) -> String {
        format!(
            "qsgd:bits={},bucket={},scale={},rounding={}",
            self.bits,
            self.bucket,
            match self.scale {
                Scale::MaxMin => "maxmin",
                Scale::MaxAbs => "maxabs",
            },
            match self.rounding {
                Rounding::Stochastic => "stochastic",
                Rounding::Nearest => "nearest",
            }
        )
    }

    fn payload_len(&self, n: usize) -> usize {
        self.meta_bytes(n) + (n * self.bits as usize).div_ceil(8)
    }

    fn encode_payload(&self, input: &[f32], rng: &mut Rng, out: &mut [u8]) {
        self.encode_with(Path::Avx512, input, rng, out)
    }

    /// One pass: each element's decoded value is computed from its level and written back
    /// while the tile is in cache, with the decoder's arithmetic (bit for bit).
    fn encode_payload_own(&self, data: &mut [f32], rng: &mut Rng, out: &mut [u8]) -> Result<()> {
        self.encode_with(Path::Avx512, data, rng, out);
        Ok(())
    }

    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        self.decode_with(true, payload, out, add)
    }

    /// Every element but a bucket's extremes lands within one level step (half a step with
    /// nearest rounding) of its value; a step is (max − min) / L <= sqrt(2)·‖bucket‖ / L for
    /// maxmin (‖bucket‖² >= max² + min²) and 2m / L <= 2‖bucket‖ / L for maxabs. Summed over a
    /// bucket: relative error <= sqrt(2·bucket) / L (maxmin) or 2·sqrt(bucket) / L (maxabs),
    /// halved for nearest, plus a little for f32 rounding. Loose for large buckets (it may
    /// exceed 1); Gaussian data sees far less.
    fn error_bound(&self) -> Option<f64> {
        let b = self.bucket as f64;
        let l = self.top() as f64;
        let base = match self.scale {
            Scale::MaxMin => (2.0 * b).sqrt() / l,
            Scale::MaxAbs => 2.0 * b.sqrt() / l,
        };
        let base = match self.rounding {
            Rounding::Stochastic => base,
            Rounding::Nearest => base / 2.0,
        };
        Some(base * (1.0 + 1e-4) + 1e-6 * b.sqrt())
    }
}

/// Fills `u` (a multiple of 8 long) with the stochastic-rounding uniforms of elements `i0..`
/// (`i0` even): element i's 24 bits are one half of `draw(key, i / 2)` ([`super::rng`]), so a
/// tile needs only its first index, and each 64-bit draw serves two elements.
#[inline(always)]
fn fill_uniforms(key: u64, i0: usize, u: &mut [f32]) {
    debug_assert!(i0.is_multiple_of(2) && u.len().is_multiple_of(8));
    // Four draws side by side, their splitmix64 states z = key + (j + 1)·GOLDEN stepped by
    // additions; a step's 4 × 64 bits are the 8 elements' 32-bit halves in order.
    let z0 = key.wrapping_add(((i0 / 2) as u64 + 1).wrapping_mul(GOLDEN));
    let mut z: [u64; 4] = std::array::from_fn(|l| z0.wrapping_add((l as u64).wrapping_mul(GOLDEN)));
    for c in u.chunks_exact_mut(8) {
        let d: [u64; 4] = std::array::from_fn(|l| mix(z[l]));
        for l in 0..4 {
            z[l] = z[l].wrapping_add(GOLDEN.wrapping_mul(4));
            // The top 24 bits of each half; through i32 because x86 has no vector u32 -> f32
            // conversion (the values are below 2^24: both conversions are exact).
            c[2 * l] = ((d[l] as u32) >> 8) as i32 as f32 * (1.0 / (1u32 << 24) as f32);
            c[2 * l + 1] = (d[l] >> 40) as i32 as f32 * (1.0 / (1u32 << 24) as f32);
        }
    }
}

/// The bounds (lo, hi) of one bucket as the encoder chooses them; (NaN, NaN) if it holds a
/// non-finite value.
#[inline(always)]
fn bucket_bounds(scale: Scale, xs: &[f32]) -> (f32, f32) {
    // Lane-wise accumulators, written with comparisons (not f32::min) so they map onto vector
    // min/max. `bad` turns NaN when any x is infinite or NaN (x * 0).
    let mut lo = [f32::INFINITY; 8];
    let mut hi = [f32::NEG_INFINITY; 8];
    let mut bad = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    let step = |lo: &mut [f32; 8], hi: &mut [f32; 8], bad: &mut [f32; 8], j: usize, x: f32| {
        let v = match scale {
            Scale::MaxMin => x,
            Scale::MaxAbs => x.abs(),
        };
        if scale == Scale::MaxMin {
            lo[j] = if v < lo[j] { v } else { lo[j] };
        }
        hi[j] = if v > hi[j] { v } else { hi[j] };
        bad[j] += x * 0.0;
    };
    for c in chunks {
        for (j, &x) in c.iter().enumerate() {
            step(&mut lo, &mut hi, &mut bad, j, x);
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        step(&mut lo, &mut hi, &mut bad, j, x);
    }
    let mut l = f32::INFINITY;
    let mut h = f32::NEG_INFINITY;
    let mut b = 0.0f32;
    for j in 0..8 {
        l = if lo[j] < l { lo[j] } else { l };
        h = if hi[j] > h { hi[j] } else { h };
        b += bad[j];
    }
    let (l, h) = match scale {
        Scale::MaxMin => (l, h),
        Scale::MaxAbs => (-h, h),
    };
    if b.is_nan() || !l.is_finite() || !h.is_finite() {
        (f32::NAN, f32::NAN)
    } else {
        (l, h)
    }
}

/// floor(t) for t in [0, 255], without a float-to-int conversion (Rust's saturating `as`
/// does not vectorize, and f32::floor is a libm call without SSE4.1): adding 2^23 rounds t to
/// the nearest integer k, which lands in the low mantissa bits; k − 1 if that rounded up.
#[inline(always)]
fn floor_small(t: f32) -> u8 {
    const MAGIC: f32 = (1u32 << 23) as f32;
    let m = t + MAGIC;
    let up = (m - MAGIC > t) as u32;
    m.to_bits().wrapping_sub(up) as u8
}

/// What the encoder reads, and whether it writes each element's decoded value back over it:
/// the input alone (`encode_payload`), or one buffer read and then overwritten
/// (`encode_payload_own`).
pub(super) trait Data {
    /// Decoded values are written back.
    const OWN: bool;
    /// The elements to encode (those not yet overwritten, for the encoder reads ahead).
    fn x(&self) -> &[f32];
    /// Elements `r`, to overwrite with their decoded values (empty unless `OWN`).
    fn keep(&mut self, r: std::ops::Range<usize>) -> &mut [f32];
}

impl Data for &[f32] {
    const OWN: bool = false;
    #[inline(always)]
    fn x(&self) -> &[f32] {
        self
    }
    #[inline(always)]
    fn keep(&mut self, _: std::ops::Range<usize>) -> &mut [f32] {
        &mut []
    }
}

impl Data for &mut [f32] {
    const OWN: bool = true;
    #[inline(always)]
    fn x(&self) -> &[f32] {
        self
    }
    #[inline(always)]
    fn keep(&mut self, r: std::ops::Range<usize>) -> &mut [f32] {
        &mut self[r]
    }
}

/// The decoder's value of level `l` in a bucket with bounds (lo, hi), `mid` = lo/2 + hi/2 and
/// `hs` = (hi/2 − lo/2) / L: mid + (2l − L)·hs, clamped to [lo, hi] (so rounding never leaves
/// the bucket's range, nor overflows). NaN bounds give NaN. Shared by the decoder and the
/// encoder that keeps what it sent, so both give the same bits.
#[inline(always)]
fn level_value(l: u8, top: i32, (lo, hi, mid, hs): (f32, f32, f32, f32)) -> f32 {
    let k = (2 * l as i32 - top) as f32;
    let v = mid + k * hs;
    let v = if v < hi { v } else { hi };
    if v > lo {
        v
    } else {
        lo
    }
}

/// The dequantizer (lo, hi, mid, hs) of a bucket with bounds (`l`, `h`) (see [`level_value`]).
#[inline(always)]
fn dequantizer(l: f32, h: f32, top: i32) -> (f32, f32, f32, f32) {
    (l, h, l * 0.5 + h * 0.5, (h * 0.5 - l * 0.5) / top as f32)
}

/// The encoder's kernel (dispatched in `Qsgd::encode_with`): `out` is the whole payload; `fill`
/// is [`fill_uniforms`] or a SIMD copy of it.
#[inline(always)]
pub(super) fn encode_kernel<D: Data>(
    q: &Qsgd,
    mut data: D,
    key: u64,
    out: &mut [u8],
    fill: impl Fn(u64, usize, &mut [f32]),
) {
    let n = data.x().len();
    let b = q.bucket as usize;
    let nbits = q.bits as usize;
    let top = q.top() as f32;
    // The decoder's integer form of it (`level_value`), for `D::OWN`.
    let top_level = q.top() as i32;
    let (meta, stream) = out.split_at_mut(q.meta_bytes(n));
    let stochastic = q.rounding == Rounding::Stochastic;
    // Nearest rounding is stochastic rounding with u = 1/2 throughout.
    let mut u = [0.5f32; TILE];
    let mut lv = [0u8; TILE];
    // The current bucket's quantizer: t = (x/2 − lo/2) · inv, in halves so that no difference
    // of finite values overflows.
    let (mut lo2, mut inv) = (0.0f32, 0.0f32);
    // Its dequantizer, for `D::OWN`.
    let mut deq = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    let mut t0 = 0;
    while t0 < n {
        let len = TILE.min(n - t0);
        let padded = len.next_multiple_of(8);
        let ahead = (t0 + len + TILE).min(n);
        bits::prefetch(&data.x()[t0 + len..ahead]);
        if stochastic {
            fill(key, t0, &mut u[..padded]);
        }
        let mut p = t0;
        while p < t0 + len {
            let bi = p / b;
            let end = ((bi + 1) * b).min(t0 + len);
            if p == bi * b {
                let (l, h) = bucket_bounds(q.scale, &data.x()[p..((bi + 1) * b).min(n)]);
                match q.scale {
                    Scale::MaxMin => {
                        meta[8 * bi..8 * bi + 4].copy_from_slice(&l.to_le_bytes());
                        meta[8 * bi + 4..8 * bi + 8].copy_from_slice(&h.to_le_bytes());
                    }
                    Scale::MaxAbs => meta[4 * bi..4 * bi + 4].copy_from_slice(&h.to_le_bytes()),
                }
                let d = h * 0.5 - l * 0.5;
                // d > 0 is false for NaN bounds and constant buckets: every level is then 0.
                (lo2, inv) = if d > 0.0 {
                    (l * 0.5, top / d)
                } else {
                    (0.0, 0.0)
                };
                if D::OWN {
                    // The bounds as the decoder reads them back (maxabs stores only h: a NaN
                    // bucket's lower bound is then −NaN, whose sign decoding keeps).
                    let l = match q.scale {
                        Scale::MaxMin => l,
                        Scale::MaxAbs => -h,
                    };
                    deq = dequantizer(l, h, top_level);
                }
            }
            let (xs, us, ls) = (
                &data.x()[p..end],
                &u[p - t0..end - t0],
                &mut lv[p - t0..end - t0],
            );
            for ((l, &x), &r) in ls.iter_mut().zip(xs).zip(us) {
                let t = (x * 0.5 - lo2) * inv + r;
                // Clamped to [0, L] (the first comparison also maps NaN to 0).
                let t = if t > 0.0 { t } else { 0.0 };
                let t = if t < top { t } else { top };
                *l = floor_small(t);
            }
            if D::OWN {
                for (o, &l) in data.keep(p..end).iter_mut().zip(&lv[p - t0..end - t0]) {
                    *o = level_value(l, top_level, deq);
                }
            }
            p = end;
        }
        let full = len / 8;
        let s0 = t0 / 8 * nbits;
        bits::pack(nbits, &lv[..full * 8], &mut stream[s0..s0 + full * nbits]);
        if padded > len {
            lv[len..padded].fill(0);
            let mut g = [0u8; 8];
            bits::pack(nbits, &lv[full * 8..padded], &mut g[..nbits]);
            let rest = &mut stream[s0 + full * nbits..];
            let k = rest.len();
            rest.copy_from_slice(&g[..k]);
        }
        t0 += len;
    }
}

/// The decoder's kernel (dispatched in `Qsgd::decode_with`, which validated every bucket's
/// bounds first): `payload` is the whole payload.
#[inline(always)]
pub(super) fn decode_kernel<const ADD: bool>(q: &Qsgd, payload: &[u8], out: &mut [f32]) {
    let n = out.len();
    let b = q.bucket as usize;
    let nbits = q.bits as usize;
    let top = q.top() as i32;
    let (meta, stream) = payload.split_at(q.meta_bytes(n));
    let mut lv = [0u8; TILE];
    // The current bucket's dequantizer ([`level_value`]).
    let mut deq = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    let mut t0 = 0;
    while t0 < n {
        let len = TILE.min(n - t0);
        let padded = len.next_multiple_of(8);
        let full = len / 8;
        let s0 = t0 / 8 * nbits;
        bits::unpack(nbits, &stream[s0..s0 + full * nbits], &mut lv[..full * 8]);
        if padded > len {
            let rest = &stream[s0 + full * nbits..];
            let mut g = [0u8; 8];
            g[..rest.len()].copy_from_slice(rest);
            bits::unpack(nbits, &g[..nbits], &mut lv[full * 8..padded]);
        }
        let mut p = t0;
        while p < t0 + len {
            let bi = p / b;
            let end = ((bi + 1) * b).min(t0 + len);
            if p == bi * b || p == t0 {
                // Checked by the caller; a failure here cannot happen, and would only
                // leave the previous bucket's (valid) dequantizer in place.
                if let Ok((l, h)) = q.bounds(meta, bi) {
                    deq = dequantizer(l, h, top);
                }
            }
            for (o, &l) in out[p..end].iter_mut().zip(&lv[p - t0..end - t0]) {
                let v = level_value(l, top, deq);
                *o = if ADD { *o + v } else { v };
            }
            p = end;
        }
        t0 += len;
    }
}

#[cfg(test)]
mod tests;
