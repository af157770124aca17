//! Float16 and bfloat16 kernels: each block is widened to f32, reduced in f32 and rounded back
//! (round to nearest even) on every call, as `half::f16::from_f32(a.to_f32() op b.to_f32())`.
//!
//! Buffers are handled as `u16` bit patterns; a [`Conv16`] converts a block to and from f32.
//! This file has the portable converters; `x86.rs` has the F16C one.

use super::elementwise::{Float, Op};
use super::kernel::{Block, Kernel, MapKernel, BLOCK};
use half::slice::HalfFloatSliceExt;
use std::marker::PhantomData;

/// Converts a block of 16-bit floats to f32 and back. The f32 block may hold the elements in
/// any fixed order (element `i` at `lane(i)`, test builds only): the kernels are element-wise, and
/// `narrow` puts every element back in its place.
pub(crate) trait Conv16: Copy {
    fn widen(self, src: &Block<u16>, dst: &mut Block<f32>);
    fn narrow(self, src: &Block<f32>, dst: &mut Block<u16>);
    /// Where `widen` puts element `i`.
    #[cfg(test)]
    fn lane(i: usize) -> usize {
        i
    }
}

/// IEEE binary16 through the `half` crate's slice conversions (which use F16C/FP16 instructions
/// when the CPU has them, eight at a time, and software otherwise).
#[derive(Clone, Copy)]
pub(crate) struct HalfF16;

impl Conv16 for HalfF16 {
    #[inline(always)]
    fn widen(self, src: &Block<u16>, dst: &mut Block<f32>) {
        let src: &[half::f16] = bytemuck::cast_slice(src.as_slice());
        src.convert_to_f32_slice(dst);
    }

    #[inline(always)]
    fn narrow(self, src: &Block<f32>, dst: &mut Block<u16>) {
        let dst: &mut [half::f16] = bytemuck::cast_slice_mut(dst.as_mut_slice());
        dst.convert_from_f32_slice(src);
    }
}

/// bfloat16, converted with branch-free integer code the compiler vectorizes. Bit-identical to
/// `half::bf16::to_f32` / `half::bf16::from_f32` (NaNs are quieted, rounding is to nearest even).
///
/// A bfloat16 is the high half of an f32, so the block is read as 32-bit words of two elements:
/// `word << 16` and `word & 0xffff_0000` are the two elements as f32, with no shuffles (which
/// are what limit a per-element widening). The f32 block therefore holds the elements of the
/// low halves first, then those of the high halves; `narrow` puts them back.
#[derive(Clone, Copy)]
pub(crate) struct Bf16;

impl Bf16 {
    /// f32 bits of `x` rounded to nearest even at bit 16 (the bfloat16 is the high half), or
    /// for a NaN its bits with the quiet bit set, as `half::bf16::from_f32` does.
    #[inline(always)]
    fn round(x: f32) -> u32 {
        let b = x.to_bits();
        if x.is_nan() {
            b | 0x0040_0000
        } else {
            // Adding 0x7fff plus the lowest kept bit carries into the kept bits exactly when
            // round-to-nearest-even rounds up; it cannot overflow for a non-NaN.
            b.wrapping_add(0x7fff + ((b >> 16) & 1))
        }
    }
}

impl Conv16 for Bf16 {
    #[inline(always)]
    fn widen(self, src: &Block<u16>, dst: &mut Block<f32>) {
        // Quiet NaNs on the 16-bit values (16 per register), as `half::bf16::to_f32` does.
        let mut q = [0u16; BLOCK];
        for (q, &s) in q.iter_mut().zip(src) {
            *q = if s & 0x7fff > 0x7f80 { s | 0x0040 } else { s };
        }
        let words: &[u8] = bytemuck::cast_slice(q.as_slice());
        let (lo, hi) = dst.split_at_mut(BLOCK / 2);
        for ((w, lo), hi) in words.chunks_exact(4).zip(lo).zip(hi) {
            let w = u32::from_ne_bytes(w.try_into().expect("4 bytes"));
            *lo = f32::from_bits(w << 16);
            *hi = f32::from_bits(w & 0xffff_0000);
        }
    }

    #[inline(always)]
    fn narrow(self, src: &Block<f32>, dst: &mut Block<u16>) {
        let words: &mut [u8] = bytemuck::cast_slice_mut(dst.as_mut_slice());
        let (lo, hi) = src.split_at(BLOCK / 2);
        for ((w, &lo), &hi) in words.chunks_exact_mut(4).zip(lo).zip(hi) {
            let word = (Bf16::round(lo) >> 16) | (Bf16::round(hi) & 0xffff_0000);
            w.copy_from_slice(&word.to_ne_bytes());
        }
    }

    #[cfg(test)]
    fn lane(i: usize) -> usize {
        // Element 2j is the low half of word j on little-endian targets, the high half on
        // big-endian ones.
        if i.is_multiple_of(2) == cfg!(target_endian = "little") {
            i / 2
        } else {
            BLOCK / 2 + i / 2
        }
    }
}

/// `dst op= src` / `dst = a op b` on 16-bit floats, through f32.
#[derive(Clone, Copy)]
pub(crate) struct Through32<C, O> {
    conv: C,
    op: PhantomData<O>,
}

impl<C, O> Through32<C, O> {
    pub(crate) const fn new(conv: C) -> Self {
        Through32 {
            conv,
            op: PhantomData,
        }
    }
}

impl<C: Conv16, O: Op> Kernel for Through32<C, O> {
    type T = u16;

    #[inline(always)]
    fn block_into(self, dst: &mut Block<u16>, src: &Block<u16>) {
        let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
        self.conv.widen(dst, &mut x);
        self.conv.widen(src, &mut y);
        for (x, y) in x.iter_mut().zip(&y) {
            *x = O::apply(*x, *y);
        }
        self.conv.narrow(&x, dst);
    }

    #[inline(always)]
    fn block3(self, dst: &mut Block<u16>, a: &Block<u16>, b: &Block<u16>) {
        let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
        self.conv.widen(a, &mut x);
        self.conv.widen(b, &mut y);
        for (x, y) in x.iter_mut().zip(&y) {
            *x = O::apply(*x, *y);
        }
        self.conv.narrow(&x, dst);
    }
}

/// `dst /= n` on 16-bit floats, dividing in f32.
#[derive(Clone, Copy)]
pub(crate) struct Divide16<C> {
    pub(crate) conv: C,
    pub(crate) n: f32,
}

impl<C: Conv16> MapKernel for Divide16<C> {
    type T = u16;

    #[inline(always)]
    fn block_map(self, dst: &mut Block<u16>) {
        let mut x = [0f32; BLOCK];
        self.conv.widen(dst, &mut x);
        for x in x.iter_mut() {
            *x = f32::div(*x, self.n);
        }
        self.conv.narrow(&x, dst);
    }
}
