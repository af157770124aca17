//! x86_64 fast paths: the generic drivers compiled for AVX2 + F16C, chosen at run time, and the
//! F16C float16 converter.
//!
//! Soundness rests on one token, [`Avx2`]: only [`Avx2::detect`] makes one, after the CPU said it
//! has AVX2 and F16C. Every function that needs those features takes the token (or is reached only
//! through a method that does).

use super::float16::Conv16;
use super::kernel::{self, Block, Kernel, MapKernel};
use std::arch::x86_64::{
    __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps, _mm_loadu_si128,
    _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
};
use std::sync::atomic::{AtomicU8, Ordering};

const UNKNOWN: u8 = 0;
const ABSENT: u8 = 1;
const PRESENT: u8 = 2;

/// What the CPU has, probed once.
static AVX2_F16C: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Proof that this CPU has AVX2 and F16C (and so AVX).
#[derive(Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, if the CPU has AVX2 and F16C. Probes the CPU once, then costs one atomic load.
    #[inline]
    pub(crate) fn detect() -> Option<Avx2> {
        let mut state = AVX2_F16C.load(Ordering::Relaxed);
        if state == UNKNOWN {
            state = if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                PRESENT
            } else {
                ABSENT
            };
            AVX2_F16C.store(state, Ordering::Relaxed);
        }
        (state == PRESENT).then_some(Avx2(()))
    }

    /// [`kernel::reduce_into`], compiled for AVX2.
    #[inline]
    pub(crate) fn reduce_into<K: Kernel>(self, k: K, dst: &mut [u8], src: &[u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2 and F16C (see `detect`).
        unsafe { reduce_into_avx2(k, dst, src) }
    }

    /// [`kernel::reduce3`], compiled for AVX2.
    #[inline]
    pub(crate) fn reduce3<K: Kernel>(self, k: K, dst: &mut [u8], a: &[u8], b: &[u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2 and F16C (see `detect`).
        unsafe { reduce3_avx2(k, dst, a, b) }
    }

    /// [`kernel::map`], compiled for AVX2.
    #[inline]
    pub(crate) fn map<K: MapKernel>(self, k: K, dst: &mut [u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2 and F16C (see `detect`).
        unsafe { map_avx2(k, dst) }
    }
}

// The generic drivers and kernels are `#[inline(always)]`, so each of these gets its own copy of
// the whole loop, vectorized with AVX2 (and F16C for the float16 converter).

#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_into_avx2<K: Kernel>(k: K, dst: &mut [u8], src: &[u8]) {
    kernel::reduce_into(k, dst, src)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce3_avx2<K: Kernel>(k: K, dst: &mut [u8], a: &[u8], b: &[u8]) {
    kernel::reduce3(k, dst, a, b)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn map_avx2<K: MapKernel>(k: K, dst: &mut [u8]) {
    kernel::map(k, dst)
}

/// IEEE binary16 with the F16C instructions, eight elements per instruction. Rounds to nearest
/// even whatever MXCSR says; same bits as `half`'s software conversion.
#[derive(Clone, Copy)]
pub(crate) struct F16c(pub(crate) Avx2);

impl Conv16 for F16c {
    #[inline(always)]
    fn widen(self, src: &Block<u16>, dst: &mut Block<f32>) {
        // SAFETY: `self.0` proves the CPU has F16C and AVX.
        unsafe { widen_f16c(src, dst) }
    }

    #[inline(always)]
    fn narrow(self, src: &Block<f32>, dst: &mut Block<u16>) {
        // SAFETY: `self.0` proves the CPU has F16C and AVX.
        unsafe { narrow_f16c(src, dst) }
    }
}

#[inline]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &Block<u16>, dst: &mut Block<f32>) {
    for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
        // SAFETY: `s` is 8 u16 = 16 readable bytes and `d` 8 f32 = 32 writable bytes; the
        // loadu/storeu intrinsics accept any alignment. The caller guarantees AVX and F16C.
        unsafe {
            let h = _mm_loadu_si128(s.as_ptr().cast::<__m128i>());
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
}

#[inline]
#[target_feature(enable = "avx,f16c")]
unsafe fn narrow_f16c(src: &Block<f32>, dst: &mut Block<u16>) {
    for (s, d) in src.chunks_exact(8).zip(dst.chunks_exact_mut(8)) {
        // SAFETY: `s` is 8 f32 = 32 readable bytes and `d` 8 u16 = 16 writable bytes; the
        // loadu/storeu intrinsics accept any alignment. The caller guarantees AVX and F16C.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
            _mm_storeu_si128(d.as_mut_ptr().cast::<__m128i>(), h);
        }
    }
}
