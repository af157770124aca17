//! Element-wise kernels on native types: the arithmetic per element type, the four operators,
//! and the block kernels built from them.

use super::kernel::{Block, Kernel, MapKernel};
use bytemuck::Pod;
use std::marker::PhantomData;

/// The four reductions on one element type. Integers wrap.
///
/// Floats follow IEEE arithmetic. Max and min are IEEE 754-2019 maximumNumber/minimumNumber
/// (a NaN operand yields the other operand, two NaNs yield the first, -0 < +0), written as
/// compares and selects so that every code path (vector or scalar) gives the same bits, NaNs
/// included (`f32::max` leaves the sign of a zero result unspecified). Sum and product are plain
/// `+` and `*`: exact IEEE results, except that the sign and payload of a NaN result are
/// whatever the hardware gives for the operand order the compiler chose (Rust leaves them
/// unspecified; making them canonical costs up to a third of the in-cache throughput).
pub(crate) trait Arith: Pod {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
        }
    )*};
}
int_arith!(i8, u8, i32, u32, i64, u64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a + b }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { a * b }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                let r = if a > b { a } else { b };
                // Equal values: only +0 and -0 differ in bits, and the max is +0.
                let r = if a == b { <$t>::from_bits(a.to_bits() & b.to_bits()) } else { r };
                if b.is_nan() { a } else { r }
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                let r = if a < b { a } else { b };
                // Equal values: only +0 and -0 differ in bits, and the min is -0.
                let r = if a == b { <$t>::from_bits(a.to_bits() | b.to_bits()) } else { r };
                if b.is_nan() { a } else { r }
            }
        }
    )*};
}
float_arith!(f32, f64);

/// Floats: division, for the average.
pub(crate) trait Float: Arith {
    fn div(a: Self, b: Self) -> Self;
}

macro_rules! float_div {
    ($($t:ty),*) => {$(
        impl Float for $t {
            #[inline(always)]
            fn div(a: Self, b: Self) -> Self { a / b }
        }
    )*};
}
float_div!(f32, f64);

/// A reduction operator, chosen at compile time so each kernel is monomorphized for it.
pub(crate) trait Op: Copy {
    fn apply<T: Arith>(a: T, b: T) -> T;
}

macro_rules! ops {
    ($($name:ident => $f:ident),*) => {$(
        #[derive(Clone, Copy)]
        pub(crate) struct $name;
        impl Op for $name {
            #[inline(always)]
            fn apply<T: Arith>(a: T, b: T) -> T { T::$f(a, b) }
        }
    )*};
}
ops!(Sum => add, Prod => mul, Max => max, Min => min);

/// `dst op= src` / `dst = a op b` on native elements of type `T`.
#[derive(Clone, Copy)]
pub(crate) struct Elementwise<T, O>(PhantomData<(T, O)>);

impl<T, O> Elementwise<T, O> {
    pub(crate) const fn new() -> Self {
        Elementwise(PhantomData)
    }
}

impl<T: Arith, O: Op> Kernel for Elementwise<T, O> {
    type T = T;

    #[inline(always)]
    fn block_into(self, dst: &mut Block<T>, src: &Block<T>) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = O::apply(*d, *s);
        }
    }

    #[inline(always)]
    fn block3(self, dst: &mut Block<T>, a: &Block<T>, b: &Block<T>) {
        for ((d, a), b) in dst.iter_mut().zip(a).zip(b) {
            *d = O::apply(*a, *b);
        }
    }
}

/// `dst /= n` on native floats (f32 divides in f32, f64 in f64).
#[derive(Clone, Copy)]
pub(crate) struct Divide<T>(pub(crate) T);

impl<T: Float> MapKernel for Divide<T> {
    type T = T;

    #[inline(always)]
    fn block_map(self, dst: &mut Block<T>) {
        for d in dst.iter_mut() {
            *d = T::div(*d, self.0);
        }
    }
}
