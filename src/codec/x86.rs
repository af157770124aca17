//! x86_64 fast paths of the quantizing codecs: the portable kernels (all `#[inline(always)]`)
//! compiled again with AVX2 and FMA enabled, chosen at run time. Results are bit-identical to
//! the portable path: the kernels use only IEEE basic operations (no fused multiply-add is
//! written, and Rust never contracts on its own) and integer operations.
//!
//! Soundness rests on one token, [`Avx2`]: only [`Avx2::detect`] makes one, after the CPU said
//! it has AVX2 and FMA.

use super::qsgd::{self, Qsgd};
use super::sign::{self, OneBit};
use super::Rng;
use std::sync::atomic::{AtomicU8, Ordering};

const UNKNOWN: u8 = 0;
const ABSENT: u8 = 1;
const PRESENT: u8 = 2;

/// What the CPU has, probed once.
static AVX2_FMA: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Proof that this CPU has AVX2 and FMA (and so AVX).
#[derive(Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, if the CPU has AVX2 and FMA. Probes once, then costs one atomic load.
    #[inline]
    pub(crate) fn detect() -> Option<Avx2> {
        let mut state = AVX2_FMA.load(Ordering::Relaxed);
        if state == UNKNOWN {
            state = if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                PRESENT
            } else {
                ABSENT
            };
            AVX2_FMA.store(state, Ordering::Relaxed);
        }
        (state == PRESENT).then_some(Avx2(()))
    }

    /// [`qsgd::encode_kernel`], compiled for AVX2.
    pub(crate) fn qsgd_encode(self, q: &Qsgd, input: &[f32], rng: &mut Rng, out: &mut [u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2 and FMA (see `detect`).
        unsafe { qsgd_encode_avx2(q, input, rng, out) }
    }

    /// [`qsgd::decode_kernel`], compiled for AVX2.
    pub(crate) fn qsgd_decode(self, q: &Qsgd, payload: &[u8], out: &mut [f32], add: bool) {
        // SAFETY: `self` exists only if the CPU has AVX2 and FMA (see `detect`).
        unsafe {
            if add {
                qsgd_decode_avx2::<true>(q, payload, out)
            } else {
                qsgd_decode_avx2::<false>(q, payload, out)
            }
        }
    }

    /// [`sign::efsign_encode_kernel`], compiled for AVX2.
    pub(crate) fn efsign_encode(self, input: &[f32], out: &mut [u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2 and FMA (see `detect`).
        unsafe { efsign_encode_avx2(input, out) }
    }

    /// [`sign::onebit_encode_kernel`], compiled for AVX2.
    pub(crate) fn onebit_encode(self, c: &OneBit, input: &[f32], out: &mut [u8]) {
        // SAFETY: `self` exists only if the CPU has AVX2 and FMA (see `detect`).
        unsafe { onebit_encode_avx2(c, input, out) }
    }

    /// [`sign::signs_decode_kernel`], compiled for AVX2.
    pub(crate) fn signs_decode(
        self,
        bucket: usize,
        values: &[(f32, f32)],
        bits: &[u8],
        out: &mut [f32],
        add: bool,
    ) {
        // SAFETY: `self` exists only if the CPU has AVX2 and FMA (see `detect`).
        unsafe {
            if add {
                signs_decode_avx2::<true>(bucket, values, bits, out)
            } else {
                signs_decode_avx2::<false>(bucket, values, bits, out)
            }
        }
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn qsgd_encode_avx2(q: &Qsgd, input: &[f32], rng: &mut Rng, out: &mut [u8]) {
    qsgd::encode_kernel(q, input, rng, out)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn qsgd_decode_avx2<const ADD: bool>(q: &Qsgd, payload: &[u8], out: &mut [f32]) {
    qsgd::decode_kernel::<ADD>(q, payload, out)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn efsign_encode_avx2(input: &[f32], out: &mut [u8]) {
    sign::efsign_encode_kernel(input, out)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn onebit_encode_avx2(c: &OneBit, input: &[f32], out: &mut [u8]) {
    sign::onebit_encode_kernel(c, input, out)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn signs_decode_avx2<const ADD: bool>(
    bucket: usize,
    values: &[(f32, f32)],
    bits: &[u8],
    out: &mut [f32],
) {
    sign::signs_decode_kernel::<ADD>(bucket, values, bits, out)
}
