//! Reduction kernels: `dst op= src` on byte buffers of any [`DType`], vectorized.
//!
//! Entry points are [`reduce_into`], [`reduce3`], [`fold`], [`finish`] and `finish_avg`. Each
//! picks a kernel for the dtype and op (monomorphized, so the inner loop has no per-element dispatch) and runs it over
//! the buffers block by block. Integer Sum and Prod wrap. Float Max and Min ignore a NaN operand
//! and order -0 below +0 (IEEE 754-2019 maximumNumber/minimumNumber). Float16 and Bfloat16 are
//! reduced in f32 and rounded back (to nearest even) on every call.
//!
//! Results are bit-identical whatever the buffer alignment and length and whatever the CPU path
//! (AVX2 or portable), with one exception: the sign and payload of a NaN produced by sum,
//! product or average (e.g. `NaN + -NaN`), which Rust leaves unspecified; it is a NaN.
//!
//! Files: `kernel.rs` (block drivers, aligned and misaligned), `elementwise.rs` (native types),
//! `float16.rs` (f16/bf16 through f32), `x86.rs` (AVX2 + F16C paths chosen at run time).

mod elementwise;
mod float16;
mod kernel;
pub mod stream;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::types::{DType, ReduceOp};
use elementwise::{Arith, Divide, Elementwise, Max, Min, Prod, Sum};
use float16::{Bf16, Conv16, Divide16, HalfF16, Through32};
use kernel::{Kernel, MapKernel};

/// `dst[i] = dst[i] op src[i]` for the `dst.len() / dtype.size()` elements of `dtype` in native
/// byte order. [`ReduceOp::Avg`] reduces as Sum (the division happens once, in `finish_avg`).
///
/// The slices must have equal lengths, a multiple of `dtype.size()` (checked by `debug_assert`;
/// in release builds only the common whole elements are reduced). They need not be aligned for
/// the element type; aligned slices take the fast path.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let n = common_len(dtype, dst.len(), src.len(), src.len());
    dispatch(
        dtype,
        op,
        InPlace {
            dst: &mut dst[..n],
            src: &src[..n],
        },
    );
}

/// `dst[i] = a[i] op b[i]`: [`reduce_into`] without first copying `a` to `dst`. Same rules.
pub fn reduce3(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    let n = common_len(dtype, dst.len(), a.len(), b.len());
    dispatch(
        dtype,
        op,
        OutOfPlace {
            dst: &mut dst[..n],
            a: &a[..n],
            b: &b[..n],
        },
    );
}

/// `dst = base op s0 op s1 op ...`, in exactly this order (`base` = `dst`'s own contents when
/// None; `base` alone is copied). The contributions of a collective are folded in one fixed
/// order (e.g. by rank), whatever order they arrived in, so every rank gets the same bits.
pub fn fold<'a>(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    base: Option<&[u8]>,
    srcs: impl IntoIterator<Item = &'a [u8]>,
) {
    let mut srcs = srcs.into_iter();
    if let Some(base) = base {
        match srcs.next() {
            Some(first) => reduce3(dtype, op, dst, base, first),
            None => dst.copy_from_slice(base),
        }
    }
    for s in srcs {
        reduce_into(dtype, op, dst, s);
    }
}

/// Finishes a reduction of `n` contributions: `finish_avg` for [`ReduceOp::Avg`], nothing for
/// the other ops (their result is complete once every contribution is folded in).
pub fn finish(dtype: DType, op: ReduceOp, dst: &mut [u8], n: usize) {
    if op == ReduceOp::Avg {
        finish_avg(dtype, dst, n);
    }
}

/// Finishes an Avg: `dst[i] /= n` for the float dtypes. f32 divides in f32, f64 in f64, and
/// Float16/Bfloat16 in f32, rounding back. For integer dtypes it does nothing (Avg on integers is
/// rejected before any reduction). `n` is the number of contributions, at least 1.
pub fn finish_avg(dtype: DType, dst: &mut [u8], n: usize) {
    debug_assert!(n > 0, "finish_avg over {n} contributions");
    let len = common_len(dtype, dst.len(), dst.len(), dst.len());
    let dst = &mut dst[..len];
    match dtype {
        DType::Float32 => run_map(Divide(n as f32), dst),
        DType::Float64 => run_map(Divide(n as f64), dst),
        DType::Float16 => {
            #[cfg(target_arch = "x86_64")]
            if let Some(cpu) = x86::Avx2::detect() {
                return run_map(divide16(x86::F16c(cpu), n), dst);
            }
            run_map(divide16(HalfF16, n), dst)
        }
        DType::Bfloat16 => run_map(divide16(Bf16, n), dst),
        DType::Int8
        | DType::Uint8
        | DType::Int32
        | DType::Uint32
        | DType::Int64
        | DType::Uint64 => {}
    }
}

/// Checks the lengths (debug builds) and returns the byte length to work on: the common prefix
/// of whole elements.
fn common_len(dtype: DType, dst: usize, a: usize, b: usize) -> usize {
    let size = dtype.size();
    debug_assert!(
        dst == a && dst == b && dst.is_multiple_of(size),
        "reduce of {dtype}: byte lengths {dst}, {a}, {b} must be equal and a multiple of {size}"
    );
    let n = dst.min(a).min(b);
    n - n % size
}

fn divide16<C: Conv16>(conv: C, n: usize) -> Divide16<C> {
    Divide16 { conv, n: n as f32 }
}

/// One call's buffers, waiting for its kernel: `dispatch` picks the kernel type from the dtype
/// and op, `run` picks the CPU path.
trait Job {
    fn run<K: Kernel>(self, k: K);
}

struct InPlace<'a> {
    dst: &'a mut [u8],
    src: &'a [u8],
}

impl Job for InPlace<'_> {
    fn run<K: Kernel>(self, k: K) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = x86::Avx2::detect() {
            return cpu.reduce_into(k, self.dst, self.src);
        }
        kernel::reduce_into(k, self.dst, self.src)
    }
}

struct OutOfPlace<'a> {
    dst: &'a mut [u8],
    a: &'a [u8],
    b: &'a [u8],
}

impl Job for OutOfPlace<'_> {
    fn run<K: Kernel>(self, k: K) {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = x86::Avx2::detect() {
            return cpu.reduce3(k, self.dst, self.a, self.b);
        }
        kernel::reduce3(k, self.dst, self.a, self.b)
    }
}

fn run_map<K: MapKernel>(k: K, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = x86::Avx2::detect() {
        return cpu.map(k, dst);
    }
    kernel::map(k, dst)
}

fn dispatch<J: Job>(dtype: DType, op: ReduceOp, job: J) {
    match dtype {
        DType::Int8 => native::<i8, J>(op, job),
        DType::Uint8 => native::<u8, J>(op, job),
        DType::Int32 => native::<i32, J>(op, job),
        DType::Uint32 => native::<u32, J>(op, job),
        DType::Int64 => native::<i64, J>(op, job),
        DType::Uint64 => native::<u64, J>(op, job),
        DType::Float32 => native::<f32, J>(op, job),
        DType::Float64 => native::<f64, J>(op, job),
        DType::Float16 => {
            #[cfg(target_arch = "x86_64")]
            if let Some(cpu) = x86::Avx2::detect() {
                return through32(x86::F16c(cpu), op, job);
            }
            through32(HalfF16, op, job)
        }
        DType::Bfloat16 => through32(Bf16, op, job),
    }
}

fn native<T: Arith, J: Job>(op: ReduceOp, job: J) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => job.run(Elementwise::<T, Sum>::new()),
        ReduceOp::Prod => job.run(Elementwise::<T, Prod>::new()),
        ReduceOp::Max => job.run(Elementwise::<T, Max>::new()),
        ReduceOp::Min => job.run(Elementwise::<T, Min>::new()),
    }
}

fn through32<C: Conv16, J: Job>(conv: C, op: ReduceOp, job: J) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => job.run(Through32::<C, Sum>::new(conv)),
        ReduceOp::Prod => job.run(Through32::<C, Prod>::new(conv)),
        ReduceOp::Max => job.run(Through32::<C, Max>::new(conv)),
        ReduceOp::Min => job.run(Through32::<C, Min>::new(conv)),
    }
}
