//! x86_64 fast paths of the codecs: [`Avx2::run`] runs a portable kernel (all are
//! `#[inline(always)]`) compiled again with AVX2 and FMA enabled, chosen at run time; fp16
//! uses the F16C conversion instructions directly, and qsgd's draws are written out for AVX2.
//! A leaf: the codecs call it, it knows none of them (only `rng`'s constants). Results are bit-identical to
//! the portable path: the kernels use only IEEE basic operations (no fused multiply-add is
//! written, and Rust never contracts on its own) and integer operations.
//!
//! fp16 uses the F16C conversion instructions (same bits as `half`'s software conversion).
//!
//! Soundness rests on two tokens, [`Avx2`] and [`Avx512`]: only their `detect` makes one, after
//! the CPU said it has the features they enable. AVX-512 serves kernels that multiply u64
//! vectors (qsgd's counter-based draws).

use super::rng::{GOLDEN, MIX1, MIX2};
use std::arch::x86_64::{
    __m128i, __m256i, _mm256_add_epi64, _mm256_cvtepi32_ps, _mm256_cvtph_ps, _mm256_cvtps_ph,
    _mm256_loadu_ps, _mm256_mul_epu32, _mm256_mul_ps, _mm256_set1_epi64x, _mm256_set1_ps,
    _mm256_setr_epi64x, _mm256_slli_epi64, _mm256_srli_epi32, _mm256_srli_epi64, _mm256_storeu_ps,
    _mm256_xor_si256, _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
};
use std::sync::atomic::{AtomicU8, Ordering};

const UNKNOWN: u8 = 0;
const ABSENT: u8 = 1;
const PRESENT: u8 = 2;

/// What the CPU has, probed once.
static AVX2_FMA_F16C: AtomicU8 = AtomicU8::new(UNKNOWN);
/// Whether it also has AVX-512 F, DQ, VL and BW, probed once.
static AVX512: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Proof that this CPU has AVX2, FMA and F16C (and so AVX).
#[derive(Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, if the CPU has AVX2, FMA and F16C. Probes once, then costs one atomic load.
    #[inline]
    pub(crate) fn detect() -> Option<Avx2> {
        let mut state = AVX2_FMA_F16C.load(Ordering::Relaxed);
        if state == UNKNOWN {
            state = if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                PRESENT
            } else {
                ABSENT
            };
            AVX2_FMA_F16C.store(state, Ordering::Relaxed);
        }
        (state == PRESENT).then_some(Avx2(()))
    }

    /// Runs `kernel` compiled for AVX2, FMA and F16C: the portable kernels are
    /// `#[inline(always)]`, so inside this function they are generated again with those
    /// instructions (the codecs call `cpu.run(#[inline(always)] || kernel(...))`).
    #[inline(always)]
    pub(crate) fn run<R>(self, kernel: impl FnOnce() -> R) -> R {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn with_avx2<R>(kernel: impl FnOnce() -> R) -> R {
            kernel()
        }
        // SAFETY: `self` exists only if the CPU has AVX2, FMA and F16C (see `detect`).
        unsafe { with_avx2(kernel) }
    }

    /// qsgd's stochastic-rounding uniforms of elements `i0..` (`i0` even, `u` a multiple of 8
    /// long), bit for bit those of the portable `qsgd::fill_uniforms`: written out because
    /// LLVM's own vectorization of it shuffles the two halves of each draw apart.
    #[inline(always)]
    pub(crate) fn fill_uniforms(self, key: u64, i0: usize, u: &mut [f32]) {
        // SAFETY: `self` exists only if the CPU has AVX2, FMA and F16C (see `detect`).
        unsafe { fill_uniforms_avx2(key, i0, u) }
    }

    /// fp16 encode with F16C.
    pub(crate) fn f16_encode(self, input: &[f32], out: &mut [u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2, FMA and F16C (see `detect`).
        unsafe { f16_encode_f16c(input, out) }
    }

    /// fp16 decode with F16C.
    pub(crate) fn f16_decode(self, payload: &[u8], out: &mut [f32], add: bool) {
        // SAFETY: `self` exists only if the CPU has AVX2, FMA and F16C (see `detect`).
        unsafe {
            if add {
                f16_decode_f16c::<true>(payload, out)
            } else {
                f16_decode_f16c::<false>(payload, out)
            }
        }
    }
}

/// Proof that this CPU has AVX-512 F, DQ, VL and BW besides AVX2, FMA and F16C. DQ brings the
/// 64-bit vector multiply (`vpmullq`) that the counter-based draw needs twice per draw; AVX2
/// emulates each with three 32-bit multiplies.
#[derive(Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// The token, if the CPU has AVX-512 F, DQ, VL, BW and [`Avx2`]'s features.
    #[inline]
    pub(crate) fn detect() -> Option<Avx512> {
        let mut state = AVX512.load(Ordering::Relaxed);
        if state == UNKNOWN {
            state = if Avx2::detect().is_some()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
            {
                PRESENT
            } else {
                ABSENT
            };
            AVX512.store(state, Ordering::Relaxed);
        }
        (state == PRESENT).then_some(Avx512(()))
    }

    /// Runs `kernel` compiled for AVX-512 (as [`Avx2::run`] does for AVX2).
    #[inline(always)]
    pub(crate) fn run<R>(self, kernel: impl FnOnce() -> R) -> R {
        #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")]
        unsafe fn with_avx512<R>(kernel: impl FnOnce() -> R) -> R {
            kernel()
        }
        // SAFETY: `self` exists only if the CPU has these features (see `detect`).
        unsafe { with_avx512(kernel) }
    }
}

/// `a · c` per u64 lane (AVX2 has no 64-bit multiply): lo·lo in full plus the two cross
/// products, shifted up.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn mul_u64(a: __m256i, c: u64) -> __m256i {
    let lo = _mm256_set1_epi64x((c & 0xffff_ffff) as i64);
    let hi = _mm256_set1_epi64x((c >> 32) as i64);
    let cross = _mm256_add_epi64(
        _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), lo),
        _mm256_mul_epu32(a, hi),
    );
    _mm256_add_epi64(_mm256_mul_epu32(a, lo), _mm256_slli_epi64::<32>(cross))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn fill_uniforms_avx2(key: u64, i0: usize, u: &mut [f32]) {
    debug_assert!(i0.is_multiple_of(2) && u.len().is_multiple_of(8));
    // Draws j0.. four at a time: splitmix64 states key + (j + 1)·GOLDEN, stepped by 4·GOLDEN.
    let z0 = key.wrapping_add(((i0 / 2) as u64 + 1).wrapping_mul(GOLDEN));
    let g = |m: u64| GOLDEN.wrapping_mul(m) as i64;
    let mut z = _mm256_add_epi64(
        _mm256_set1_epi64x(z0 as i64),
        _mm256_setr_epi64x(0, g(1), g(2), g(3)),
    );
    let step = _mm256_set1_epi64x(g(4));
    let scale = _mm256_set1_ps(1.0 / (1u32 << 24) as f32);
    for c in u.chunks_exact_mut(8) {
        let mut x = z;
        x = mul_u64(_mm256_xor_si256(x, _mm256_srli_epi64::<30>(x)), MIX1);
        x = mul_u64(_mm256_xor_si256(x, _mm256_srli_epi64::<27>(x)), MIX2);
        x = _mm256_xor_si256(x, _mm256_srli_epi64::<31>(x));
        // The four draws' 32-bit halves are the eight elements' bits in order (x86 is little
        // endian); their top 24 bits, exactly converted and scaled.
        let f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(x)), scale);
        // SAFETY: `c` is 8 f32 = 32 writable bytes; storeu accepts any alignment.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), f) };
        z = _mm256_add_epi64(z, step);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_encode_f16c(input: &[f32], out: &mut [u8]) {
    let chunks = input.chunks_exact(8);
    let rest = chunks.remainder();
    let mut outs = out.chunks_exact_mut(16);
    for (x, o) in chunks.zip(&mut outs) {
        // SAFETY: `x` is 8 f32 = 32 readable bytes and `o` 16 writable bytes; loadu/storeu
        // accept any alignment. The caller guarantees AVX and F16C.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr()));
            _mm_storeu_si128(o.as_mut_ptr().cast::<__m128i>(), h);
        }
    }
    for (o, &x) in outs.into_remainder().chunks_exact_mut(2).zip(rest) {
        o.copy_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes());
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_decode_f16c<const ADD: bool>(payload: &[u8], out: &mut [f32]) {
    let mut outs = out.chunks_exact_mut(8);
    let ins = payload.chunks_exact(16);
    let rest = ins.remainder();
    for (o, b) in (&mut outs).zip(ins) {
        let mut v = [0.0f32; 8];
        // SAFETY: `b` is 16 readable bytes and `v` 32 writable bytes; loadu/storeu accept any
        // alignment. The caller guarantees AVX and F16C.
        unsafe {
            let h = _mm_loadu_si128(b.as_ptr().cast::<__m128i>());
            _mm256_storeu_ps(v.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        for j in 0..8 {
            o[j] = if ADD { o[j] + v[j] } else { v[j] };
        }
    }
    for (o, b) in outs.into_remainder().iter_mut().zip(rest.chunks_exact(2)) {
        let v = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        *o = if ADD { *o + v } else { v };
    }
}
