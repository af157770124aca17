//! Kernels against independent scalar references: every dtype × op, awkward lengths, aligned and
//! misaligned buffers, reduce3 against copy + reduce_into, finish_avg, special float values, and
//! the vectorized f16/bf16 converters against `half`'s software conversions.

use super::elementwise::{Elementwise, Max, Min, Op, Prod, Sum};
use super::float16::{Bf16, Conv16, HalfF16, Through32};
use super::kernel::{Kernel, BLOCK};
use super::*;
use crate::types::Element;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fmt::Debug;

const LENS: [usize; 6] = [0, 1, 7, 63, 64, 65];
const BIG: usize = 1_000_003;

/// An element type with a random generator and scalar references.
trait Sample: Element + Debug {
    fn random(rng: &mut StdRng) -> Self;
    /// `a op b`, computed independently of the kernels.
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `x / n` as finish_avg must compute it.
    fn averaged(x: Self, n: usize) -> Self;
    /// True for a floating-point NaN.
    fn is_nan(self) -> bool {
        false
    }
}

macro_rules! int_sample {
    ($($t:ty),*) => {$(
        impl Sample for $t {
            fn random(rng: &mut StdRng) -> Self { rng.gen() }
            fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Max => if a >= b { a } else { b },
                    ReduceOp::Min => if a <= b { a } else { b },
                }
            }
            fn averaged(x: Self, _n: usize) -> Self { x }
        }
    )*};
}
int_sample!(i8, u8, i32, u32, i64, u64);

/// `a op b` in f64. Exact for two f32 or f16 operands' sum, product, max and min before the
/// final rounding, and f64 has more than 2p + 2 bits for p = 24, so rounding the f64 result to
/// f32 equals the correctly rounded f32 operation.
fn in_f64(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

fn in_f32(op: ReduceOp, a: f32, b: f32) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a * b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

impl Sample for f32 {
    fn random(rng: &mut StdRng) -> Self {
        rng.gen_range(-1000.0..1000.0)
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        in_f64(op, f64::from(a), f64::from(b)) as f32
    }
    fn averaged(x: Self, n: usize) -> Self {
        (f64::from(x) / n as f64) as f32
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
}

impl Sample for f64 {
    fn random(rng: &mut StdRng) -> Self {
        rng.gen_range(-1.0e6..1.0e6)
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        in_f64(op, a, b)
    }
    fn averaged(x: Self, n: usize) -> Self {
        x / n as f64
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

impl Sample for f16 {
    fn random(rng: &mut StdRng) -> Self {
        f16::from_f32(rng.gen_range(-100.0..100.0))
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        f16::from_f32(in_f32(op, a.to_f32(), b.to_f32()))
    }
    fn averaged(x: Self, n: usize) -> Self {
        f16::from_f32(x.to_f32() / n as f32)
    }
    fn is_nan(self) -> bool {
        f16::is_nan(self)
    }
}

impl Sample for bf16 {
    fn random(rng: &mut StdRng) -> Self {
        bf16::from_f32(rng.gen_range(-1000.0..1000.0))
    }
    fn reference(op: ReduceOp, a: Self, b: Self) -> Self {
        bf16::from_f32(in_f32(op, a.to_f32(), b.to_f32()))
    }
    fn averaged(x: Self, n: usize) -> Self {
        bf16::from_f32(x.to_f32() / n as f32)
    }
    fn is_nan(self) -> bool {
        bf16::is_nan(self)
    }
}

/// A byte buffer starting `off` bytes past an 8-aligned address.
struct Buf {
    store: Vec<u64>,
    off: usize,
    len: usize,
}

impl Buf {
    fn new(bytes: &[u8], off: usize) -> Buf {
        let mut store = vec![0u64; (off + bytes.len()) / 8 + 1];
        bytemuck::cast_slice_mut::<u64, u8>(&mut store)[off..off + bytes.len()]
            .copy_from_slice(bytes);
        Buf {
            store,
            off,
            len: bytes.len(),
        }
    }

    fn zeroed(len: usize, off: usize) -> Buf {
        Buf::new(&vec![0u8; len], off)
    }

    fn get(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.store)[self.off..self.off + self.len]
    }

    fn get_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.store)[self.off..self.off + self.len]
    }
}

/// Panics naming the first element where `got` (bytes) and `want` differ in bits.
fn assert_same<T: Sample>(got: &[u8], want: &[T], what: &str) {
    compare(got, want, what, false)
}

/// [`assert_same`] for max and min (selections: exact bits, NaNs included); for arithmetic
/// any NaN matches any NaN, since the sign and payload of e.g. `NaN + -NaN` depend on the
/// operand order the compiler chose, which may differ between differently compiled paths
/// (AVX2, portable, aligned, staged, scalar).
fn assert_op<T: Sample>(op: ReduceOp, got: &[u8], want: &[T], what: &str) {
    compare(
        got,
        want,
        what,
        !matches!(op, ReduceOp::Max | ReduceOp::Min),
    )
}

fn compare<T: Sample>(got: &[u8], want: &[T], what: &str, nan_is_nan: bool) {
    let size = std::mem::size_of::<T>();
    assert_eq!(got.len(), std::mem::size_of_val(want), "{what}: length");
    for (i, (g, w)) in got.chunks_exact(size).zip(want).enumerate() {
        let g: T = bytemuck::pod_read_unaligned(g);
        let same = bytemuck::bytes_of(&g) == bytemuck::bytes_of(w)
            || (nan_is_nan && g.is_nan() && w.is_nan());
        assert!(same, "{what}: element {i} is {g:?}, want {w:?}");
    }
}

fn check_dtype<T: Sample>(rng: &mut StdRng, lens: &[usize]) {
    let dtype = T::DTYPE;
    let size = dtype.size();
    for op in ReduceOp::ALL {
        for &len in lens {
            let a: Vec<T> = (0..len).map(|_| T::random(rng)).collect();
            let b: Vec<T> = (0..len).map(|_| T::random(rng)).collect();
            let want: Vec<T> = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| T::reference(op, x, y))
                .collect();
            let (ab, bb): (&[u8], &[u8]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
            let what = |path: &str| format!("{dtype} {op} len {len} {path}");

            // Aligned, then every mix of misaligned destination and source.
            for (od, os) in [(0, 0), (1, 0), (0, 1), (1, 1), (3, 5)] {
                let mut d = Buf::new(ab, od);
                let s = Buf::new(bb, os);
                if size > 1 && len > 0 && od != 0 {
                    assert!(bytemuck::try_cast_slice::<u8, T>(d.get()).is_err());
                }
                reduce_into(dtype, op, d.get_mut(), s.get());
                assert_same(d.get(), &want, &what(&format!("reduce_into off {od}/{os}")));
            }

            // reduce3 equals copy + reduce_into (checked above to equal the reference).
            for (od, oa, ob) in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 2, 3)] {
                let mut d = Buf::zeroed(ab.len(), od);
                let (x, y) = (Buf::new(ab, oa), Buf::new(bb, ob));
                reduce3(dtype, op, d.get_mut(), x.get(), y.get());
                assert_same(
                    d.get(),
                    &want,
                    &what(&format!("reduce3 off {od}/{oa}/{ob}")),
                );
            }
        }
    }

    // finish_avg: float types divide, integers are left alone.
    for &len in lens {
        for n in [1, 2, 3, 7] {
            let x: Vec<T> = (0..len).map(|_| T::random(rng)).collect();
            let want: Vec<T> = x.iter().map(|&v| T::averaged(v, n)).collect();
            for off in [0, 1] {
                let mut d = Buf::new(bytemuck::cast_slice(&x), off);
                finish_avg(dtype, d.get_mut(), n);
                assert_same(
                    d.get(),
                    &want,
                    &format!("{dtype} finish_avg n {n} len {len} off {off}"),
                );
            }
        }
    }
}

#[test]
fn every_dtype_and_op_matches_reference() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    check_dtype::<i8>(&mut rng, &LENS);
    check_dtype::<u8>(&mut rng, &LENS);
    check_dtype::<i32>(&mut rng, &LENS);
    check_dtype::<u32>(&mut rng, &LENS);
    check_dtype::<i64>(&mut rng, &LENS);
    check_dtype::<u64>(&mut rng, &LENS);
    check_dtype::<f16>(&mut rng, &LENS);
    check_dtype::<f32>(&mut rng, &LENS);
    check_dtype::<f64>(&mut rng, &LENS);
    check_dtype::<bf16>(&mut rng, &LENS);
}

#[test]
fn large_f32_matches_reference() {
    let mut rng = StdRng::seed_from_u64(0xb16);
    check_dtype::<f32>(&mut rng, &[BIG]);
}

#[test]
fn integer_extremes_wrap() {
    let mut d = [i32::MAX, i32::MIN, 1 << 30];
    let s = [1, -1, 4];
    reduce_into(
        DType::Int32,
        ReduceOp::Sum,
        bytemuck::cast_slice_mut(&mut d),
        bytemuck::cast_slice(&s),
    );
    assert_eq!(d, [i32::MIN, i32::MAX, (1 << 30) + 4]);
    let mut d = [u8::MAX, 16, 3];
    reduce_into(DType::Uint8, ReduceOp::Prod, &mut d, &[2, 16, 200]);
    assert_eq!(d, [254, 0, 88]);
}

#[test]
fn finish_avg_ignores_integers() {
    for dtype in DType::ALL.into_iter().filter(|d| !d.is_float()) {
        let mut d: Vec<u8> = (0..64u8).collect();
        finish_avg(dtype, &mut d, 3);
        assert_eq!(d, (0..64u8).collect::<Vec<_>>(), "{dtype}");
    }
}

#[test]
fn finish_divides_only_an_avg() {
    let six = bytemuck::cast_slice::<f32, u8>(&[6.0, -3.0]).to_vec();
    for op in ReduceOp::ALL {
        let mut d = six.clone();
        finish(DType::Float32, op, &mut d, 3);
        let want: &[f32] = if op == ReduceOp::Avg {
            &[2.0, -1.0]
        } else {
            &[6.0, -3.0]
        };
        assert_eq!(d, bytemuck::cast_slice::<f32, u8>(want), "{op}");
    }
}

#[test]
fn fold_keeps_the_order_it_is_given() {
    // f32 sums are not associative: ((1e8 + 1) - 1e8) = 0, while 1e8 - 1e8 + 1 = 1.
    let bytes = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
    let (a, b, c) = (bytes(&[1e8, 3.0]), bytes(&[1.0, 4.0]), bytes(&[-1e8, 5.0]));
    let (f32s, sum) = (DType::Float32, ReduceOp::Sum);
    let got = |d: &[u8]| -> Vec<f32> {
        d.chunks(4)
            .map(|x| f32::from_ne_bytes(x.try_into().unwrap()))
            .collect()
    };
    let mut d = vec![0u8; 8];
    fold(f32s, sum, &mut d, Some(&a), [&b[..], &c[..]]);
    assert_eq!(got(&d), [(1e8f32 + 1.0) - 1e8, 12.0]);
    fold(f32s, sum, &mut d, Some(&a), [&c[..], &b[..]]);
    assert_eq!(got(&d), [(1e8f32 - 1e8) + 1.0, 12.0]);
    // No base: dst's own contents come first.
    let mut d = a.clone();
    fold(f32s, sum, &mut d, None, [&b[..], &c[..]]);
    assert_eq!(got(&d), [0.0, 12.0]);
    // A base alone is copied; nothing at all leaves dst as it was.
    fold(f32s, sum, &mut d, Some(&c), []);
    assert_eq!(d, c);
    fold(f32s, sum, &mut d, None, []);
    assert_eq!(d, c);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "must be equal")]
fn unequal_lengths_are_caught_in_debug() {
    reduce_into(DType::Float32, ReduceOp::Sum, &mut [0; 8], &[0; 4]);
}

/// Special f32 values, as f32 bit patterns.
fn special_f32() -> Vec<f32> {
    vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.5,
        3.0e38,
        -3.0e38,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        1.0e-40,
        -1.0e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        65504.0,
        65520.0,
        6.0e-8,
        1.0 + f32::EPSILON,
    ]
}

/// All ordered pairs of `vals`, as two columns.
fn pairs<T: Copy>(vals: &[T]) -> (Vec<T>, Vec<T>) {
    let a = vals
        .iter()
        .flat_map(|&x| vals.iter().map(move |_| x))
        .collect();
    let b = vals.iter().flat_map(|_| vals.iter().copied()).collect();
    (a, b)
}

/// Runs `k` through the portable drivers (compiled without AVX2), in place.
fn portable_into<K: Kernel>(k: K, a: &[K::T], b: &[K::T]) -> Vec<K::T> {
    let mut d = a.to_vec();
    kernel::reduce_into(k, bytemuck::cast_slice_mut(&mut d), bytemuck::cast_slice(b));
    d
}

/// Public entry point (which takes the AVX2 path when the CPU has it), aligned and misaligned;
/// asserts both agree and returns the result.
fn public_into<T: Sample>(op: ReduceOp, a: &[T], b: &[T]) -> Vec<T> {
    let mut d = a.to_vec();
    reduce_into(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(&mut d),
        bytemuck::cast_slice(b),
    );
    let mut m = Buf::new(bytemuck::cast_slice(a), 1);
    let s = Buf::new(bytemuck::cast_slice(b), 3);
    reduce_into(T::DTYPE, op, m.get_mut(), s.get());
    assert_op(
        op,
        m.get(),
        &d,
        &format!("{} {op} misaligned specials", T::DTYPE),
    );
    d
}

/// A binary operation on one element type.
type BinFn<T> = fn(T, T) -> T;

/// The four ops with their scalar kernels.
fn ops_with<T: elementwise::Arith>() -> [(ReduceOp, BinFn<T>); 4] {
    [
        (ReduceOp::Sum, Sum::apply::<T>),
        (ReduceOp::Prod, Prod::apply::<T>),
        (ReduceOp::Max, Max::apply::<T>),
        (ReduceOp::Min, Min::apply::<T>),
    ]
}

#[test]
fn special_floats_agree_across_paths() {
    // f32 and f64: every path gives the bits of the scalar operation (for a NaN result of
    // arithmetic: a NaN).
    let (a, b) = pairs(&special_f32());
    for (op, f) in ops_with::<f32>() {
        let got = public_into(op, &a, &b);
        let portable = match op {
            ReduceOp::Sum => portable_into(Elementwise::<f32, Sum>::new(), &a, &b),
            ReduceOp::Prod => portable_into(Elementwise::<f32, Prod>::new(), &a, &b),
            ReduceOp::Max => portable_into(Elementwise::<f32, Max>::new(), &a, &b),
            _ => portable_into(Elementwise::<f32, Min>::new(), &a, &b),
        };
        let scalar: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect();
        assert_op(
            op,
            bytemuck::cast_slice(&got),
            &portable,
            &format!("f32 {op} portable"),
        );
        assert_op(
            op,
            bytemuck::cast_slice(&got),
            &scalar,
            &format!("f32 {op} scalar"),
        );
        if matches!(op, ReduceOp::Max | ReduceOp::Min) {
            // Exact semantics (the comparisons above were exact too, NaNs included).
            for ((&x, &y), &r) in a.iter().zip(&b).zip(&got) {
                let want = if x.is_nan() {
                    y // a NaN operand yields the other one (the first of two NaNs: x = NaN)
                } else if y.is_nan() {
                    x
                } else if x == 0.0 && y == 0.0 {
                    // -0 < +0
                    match op {
                        ReduceOp::Max if x.is_sign_positive() || y.is_sign_positive() => 0.0,
                        ReduceOp::Min if x.is_sign_negative() || y.is_sign_negative() => -0.0,
                        _ => x,
                    }
                } else if (op == ReduceOp::Max) == (x > y) {
                    x
                } else {
                    y
                };
                let want = if x.is_nan() && y.is_nan() { x } else { want };
                assert_eq!(r.to_bits(), want.to_bits(), "{op}({x}, {y}) = {r}");
            }
        }
    }
    let (a, b) = pairs(
        &special_f32()
            .iter()
            .map(|&x| f64::from(x))
            .collect::<Vec<_>>(),
    );
    for (op, f) in ops_with::<f64>() {
        let got = public_into(op, &a, &b);
        let scalar: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect();
        assert_op(
            op,
            bytemuck::cast_slice(&got),
            &scalar,
            &format!("f64 {op} scalar"),
        );
    }

    // f16 and bf16: every path gives the f32 operation rounded back by `half`.
    let (a, b) = pairs(
        &special_f32()
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect::<Vec<_>>(),
    );
    for (op, f) in ops_with::<f32>() {
        let got = public_into(op, &a, &b);
        let scalar: Vec<f16> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| f16::from_f32_const(f(x.to_f32_const(), y.to_f32_const())))
            .collect();
        assert_op(
            op,
            bytemuck::cast_slice(&got),
            &scalar,
            &format!("f16 {op}"),
        );
        let (a16, b16): (&[u16], &[u16]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
        let portable = match op {
            ReduceOp::Sum => portable_into(Through32::<HalfF16, Sum>::new(HalfF16), a16, b16),
            ReduceOp::Prod => portable_into(Through32::<HalfF16, Prod>::new(HalfF16), a16, b16),
            ReduceOp::Max => portable_into(Through32::<HalfF16, Max>::new(HalfF16), a16, b16),
            _ => portable_into(Through32::<HalfF16, Min>::new(HalfF16), a16, b16),
        };
        assert_op(
            op,
            bytemuck::cast_slice(&portable),
            &scalar,
            &format!("f16 {op} portable"),
        );
    }
    let (a, b) = pairs(
        &special_f32()
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect::<Vec<_>>(),
    );
    for (op, f) in ops_with::<f32>() {
        let got = public_into(op, &a, &b);
        let scalar: Vec<bf16> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| bf16::from_f32(f(x.to_f32(), y.to_f32())))
            .collect();
        assert_op(
            op,
            bytemuck::cast_slice(&got),
            &scalar,
            &format!("bf16 {op}"),
        );
    }
}

/// f32 inputs for the narrowing tests: random bit patterns, specials, and values at and around
/// every f16/bf16 rounding boundary.
fn narrowing_inputs() -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(0xf16);
    let mut v: Vec<f32> = (0..200_000).map(|_| f32::from_bits(rng.gen())).collect();
    v.extend(special_f32());
    for h in (0..=u16::MAX).step_by(7) {
        for base in [
            f16::from_bits(h).to_f32_const(),
            bf16::from_bits(h).to_f32(),
        ] {
            let bits = base.to_bits();
            for d in [0x0fff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001] {
                v.push(f32::from_bits(bits.wrapping_add(d)));
            }
        }
    }
    let pad = (BLOCK - v.len() % BLOCK) % BLOCK;
    v.extend(std::iter::repeat_n(1.0, pad));
    v
}

/// Every 16-bit pattern widened by `c`, in element order.
fn widen_all<C: Conv16>(c: C) -> Vec<f32> {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let mut out = Vec::with_capacity(all.len());
    for s in all.chunks_exact(BLOCK) {
        let mut w = [0f32; BLOCK];
        c.widen(s.try_into().unwrap(), &mut w);
        out.extend((0..BLOCK).map(|i| w[C::lane(i)]));
    }
    out
}

/// `v` (a multiple of BLOCK long, in element order) narrowed by `c`.
fn narrow_all<C: Conv16>(c: C, v: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; v.len()];
    for (s, d) in v.chunks_exact(BLOCK).zip(out.chunks_exact_mut(BLOCK)) {
        let mut w = [0f32; BLOCK];
        for (i, &x) in s.iter().enumerate() {
            w[C::lane(i)] = x;
        }
        c.narrow(&w, d.try_into().unwrap());
    }
    out
}

fn check_f16_converter<C: Conv16>(c: C, name: &str) {
    let widened = widen_all(c);
    for (h, w) in (0..=u16::MAX).zip(&widened) {
        let want = f16::from_bits(h).to_f32_const();
        assert_eq!(w.to_bits(), want.to_bits(), "{name} widen {h:#06x}");
    }
    let v = narrowing_inputs();
    for (x, h) in v.iter().zip(narrow_all(c, &v)) {
        let want = f16::from_f32_const(*x).to_bits();
        assert_eq!(h, want, "{name} narrow {:#010x}", x.to_bits());
    }
}

#[test]
fn f16_converters_match_software_conversion() {
    check_f16_converter(HalfF16, "half");
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = x86::Avx2::detect() {
        check_f16_converter(x86::F16c(cpu), "f16c");
    }
}

#[test]
fn bf16_converter_matches_half() {
    for (h, w) in (0..=u16::MAX).zip(widen_all(Bf16)) {
        assert_eq!(
            w.to_bits(),
            bf16::from_bits(h).to_f32().to_bits(),
            "widen {h:#06x}"
        );
    }
    let v = narrowing_inputs();
    for (x, h) in v.iter().zip(narrow_all(Bf16, &v)) {
        assert_eq!(
            h,
            bf16::from_f32(*x).to_bits(),
            "narrow {:#010x}",
            x.to_bits()
        );
    }
}
