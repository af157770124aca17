//! Deterministic inputs and independently computed expected results.
//!
//! Element i of rank r's input is a hash of (r, i), so every rank can rebuild every other
//! rank's input and compute the expected output without communicating. Integer inputs use
//! every bit and are reduced here with the type's own wrapping arithmetic (exact). Float
//! inputs are small integers (sum, avg, min, max) or ±2^{-1,0,1} (prod), so that every partial
//! result, in any order, is exactly representable even in half and bfloat16; the expected
//! value is computed in f64 and compared with a tolerance of ε·n·|expected| (ε the type's
//! machine epsilon, n the rank count), which only avg (one rounding of sum/n) needs.
//!
//! With a codec (`-Z`), and for the sparse top-k collectives (`--coll hitopk`, `naiveag`), the
//! float inputs are instead uniform in [-1, 1) (rounded to the type):
//! the small-integer inputs would overflow fp16 in float and double (up to ±2^20), and would
//! make lossless-looking results out of codecs that round (integers are exact in fp16), so the
//! error column would say nothing. Gradients, the data codecs are made for, look more like
//! this.

use half::{bf16, f16};
use qccl::{Element, ReduceOp};

/// An element type the benchmark can fill and check.
pub trait Elem: Element + PartialEq + std::fmt::Debug {
    /// Floating point (checked with a tolerance) or integer (checked exactly).
    const FLOAT: bool;
    /// Machine epsilon (0 for integers).
    const EPS: f64;
    /// Integers of magnitude up to this are exact (floats).
    const EXACT: f64;
    /// Integer types: the low bits of `h`, wrapping. Float types: unused.
    fn from_bits(h: u64) -> Self;
    /// Nearest value (exact for the values the filler makes).
    fn from_f64(v: f64) -> Self;
    /// As f64.
    fn to_f64(self) -> f64;
    /// Integer types: `op(a, b)` with wrapping; float types: the f64 op rounded back.
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const FLOAT: bool = false;
            const EPS: f64 = 0.0;
            const EXACT: f64 = 0.0;
            fn from_bits(h: u64) -> Self { h as $t }
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    other => unreachable!("no reference for {other}: args.rs refuses it"),
                }
            }
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

macro_rules! float_elem {
    ($($t:ty, $eps:expr, $exact:expr, $from:expr, $to:expr);* $(;)?) => {$(
        impl Elem for $t {
            const FLOAT: bool = true;
            const EPS: f64 = $eps;
            const EXACT: f64 = $exact;
            fn from_bits(h: u64) -> Self { Self::from_f64((h % 1024) as f64) }
            fn from_f64(v: f64) -> Self { $from(v) }
            fn to_f64(self) -> f64 { $to(self) }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                let (x, y) = (a.to_f64(), b.to_f64());
                Self::from_f64(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                    other => unreachable!("no reference for {other}: args.rs refuses it"),
                })
            }
        }
    )*};
}
float_elem!(
    f16, 1.0 / 1024.0, 2048.0, f16::from_f64, f16::to_f64;
    bf16, 1.0 / 128.0, 256.0, bf16::from_f64, bf16::to_f64;
    f32, f32::EPSILON as f64, 16_777_216.0, |v| v as f32, |x: f32| x as f64;
    f64, f64::EPSILON, 9_007_199_254_740_992.0, |v| v, |x: f64| x;
);

/// What a checked element must be.
#[derive(Debug, Clone, Copy)]
pub enum Want<T> {
    /// Exactly this (moved data, integer reductions).
    Exact(T),
    /// Within `tol` of this value (float reductions).
    Near(f64, f64),
}

impl<T: Elem> Want<T> {
    /// True when `got` passes.
    pub fn accepts(&self, got: T) -> bool {
        match *self {
            Want::Exact(t) => got == t,
            // NaN fails both comparisons.
            Want::Near(e, tol) => (got.to_f64() - e).abs() <= tol,
        }
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Makes rank r's input deterministically from (r, index), for a given op and world size.
#[derive(Debug, Clone, Copy)]
pub struct Filler {
    /// The op the data is for (chooses the float value range).
    pub op: ReduceOp,
    /// Ranks whose values are combined.
    pub n: usize,
    /// A codec will encode the data: float inputs uniform in [-1, 1) instead of integers.
    pub lossy: bool,
}

const SEED: u64 = 0x5143_434C_5045_5246; // "QCCLPERF"
const GARBAGE: u64 = 0xDEAD_BEEF_0BAD_F00D;

impl Filler {
    fn hash(rank: usize, i: usize, seed: u64) -> u64 {
        splitmix64(seed ^ ((rank as u64) << 48) ^ i as u64)
    }

    /// Element `i` of rank `rank`'s input.
    #[inline]
    pub fn value<T: Elem>(&self, rank: usize, i: usize) -> T {
        let h = Self::hash(rank, i, SEED);
        if !T::FLOAT {
            return T::from_bits(h);
        }
        if self.op == ReduceOp::Prod {
            // ±2^e: products stay exact; |e| ≤ 1 keeps n ≤ 14 ranks inside half's range.
            let sign = if h & 1 == 0 { 1.0 } else { -1.0 };
            let e = if self.n <= 14 { (h >> 1) % 3 } else { 1 } as i32 - 1;
            return T::from_f64(sign * 2f64.powi(e));
        }
        if self.lossy {
            // 53 random bits scaled to [0, 2), shifted to [-1, 1).
            return T::from_f64((h >> 11) as f64 / (1u64 << 52) as f64 - 1.0);
        }
        // Integers in [-m, m] with n·m ≤ EXACT: every partial sum is exact.
        let m = ((T::EXACT / self.n as f64).floor() as u64).clamp(1, 1 << 20);
        T::from_f64(((h >> 1) % (2 * m + 1)) as f64 - m as f64)
    }

    /// `buf[j] = value(rank, offset + j)`.
    pub fn fill<T: Elem>(&self, buf: &mut [T], rank: usize, offset: usize) {
        for (j, x) in buf.iter_mut().enumerate() {
            *x = self.value(rank, offset + j);
        }
    }

    /// Values no correct output can equal by design: NaN for floats, another hash for ints.
    pub fn garbage<T: Elem>(&self, buf: &mut [T], rank: usize) {
        for (j, x) in buf.iter_mut().enumerate() {
            *x = if T::FLOAT {
                T::from_f64(f64::NAN)
            } else {
                T::from_bits(Self::hash(rank, j, GARBAGE))
            };
        }
    }

    /// The reduction over all `n` ranks of element `i`.
    #[inline]
    pub fn reduced<T: Elem>(&self, op: ReduceOp, n: usize, i: usize) -> Want<T> {
        if T::FLOAT {
            let mut acc = self.value::<T>(0, i).to_f64();
            for q in 1..n {
                let v = self.value::<T>(q, i).to_f64();
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v,
                    ReduceOp::Prod => acc * v,
                    ReduceOp::Min => acc.min(v),
                    ReduceOp::Max => acc.max(v),
                    other => unreachable!("no reference for {other}: args.rs refuses it"),
                };
            }
            if op == ReduceOp::Avg {
                acc /= n as f64;
            }
            Want::Near(acc, T::EPS * n as f64 * acc.abs())
        } else {
            let mut acc = self.value::<T>(0, i);
            for q in 1..n {
                acc = T::combine(acc, self.value(q, i), op);
            }
            Want::Exact(acc)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reducing in the dtype itself, in any order, gives exactly the f64 answer.
    fn exact_in_dtype<T: Elem>(op: ReduceOp, n: usize) {
        let f = Filler {
            op,
            n,
            lossy: false,
        };
        for i in 0..2000 {
            let fwd = (1..n).fold(f.value::<T>(0, i), |a, q| T::combine(a, f.value(q, i), op));
            let rev = (0..n - 1).rev().fold(f.value::<T>(n - 1, i), |a, q| {
                T::combine(a, f.value(q, i), op)
            });
            let Want::Near(e, _) = f.reduced::<T>(op, n, i) else {
                unreachable!()
            };
            assert_eq!(fwd.to_f64(), e, "{op} n={n} i={i}");
            assert_eq!(rev.to_f64(), e, "{op} n={n} i={i}");
        }
    }

    #[test]
    fn float_fills_reduce_exactly() {
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
            for n in [1, 2, 3, 4, 8, 14] {
                exact_in_dtype::<f16>(op, n);
                exact_in_dtype::<bf16>(op, n);
                exact_in_dtype::<f32>(op, n);
            }
        }
    }

    #[test]
    fn lossy_fill_is_spread_in_unit_interval() {
        let f = Filler {
            op: ReduceOp::Sum,
            n: 3,
            lossy: true,
        };
        let v: Vec<f64> = (0..4000).map(|i| f.value::<f32>(1, i).to_f64()).collect();
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        // Not integers (a rounding codec must show an error) and both signs.
        assert!(v.iter().filter(|x| x.fract() != 0.0).count() > 3900);
        assert!(v.iter().any(|x| *x < -0.5) && v.iter().any(|x| *x > 0.5));
        assert_eq!(f.value::<f32>(1, 7), f.value::<f32>(1, 7));
    }

    #[test]
    fn wrong_values_are_caught() {
        let f = Filler {
            op: ReduceOp::Sum,
            n: 4,
            lossy: false,
        };
        let w = f.reduced::<bf16>(ReduceOp::Sum, 4, 7);
        let Want::Near(e, tol) = w else {
            unreachable!()
        };
        assert!(w.accepts(bf16::from_f64(e)));
        assert!(!w.accepts(bf16::from_f64(e + 2.0 * tol + 2.0)));
        assert!(!w.accepts(bf16::NAN));
        let w = f.reduced::<i32>(ReduceOp::Sum, 4, 7);
        let Want::Exact(x) = w else { unreachable!() };
        assert!(!w.accepts(x.wrapping_add(1)));
        let mut g = [0i64; 16];
        f.garbage(&mut g, 0);
        let mut v = [0i64; 16];
        f.fill(&mut v, 0, 0);
        assert!(g.iter().zip(&v).all(|(a, b)| a != b));
    }
}
