//! The CUDA kernels (kernels/*.cu) run on the CPU through the shim, compared bit for bit with
//! qccl's Rust reductions and codecs at the counts in `shim::COUNTS`. See kernels/README.md.

mod shim;

use qccl::internal::{finish_avg, reduce3};
use qccl::{DType, ReduceOp};
use shim::{assert_same, driver, Gen, Job, COUNTS};

/// The kernels' dtype suffix.
fn suffix(d: DType) -> &'static str {
    match d {
        DType::Int8 => "i8",
        DType::Uint8 => "u8",
        DType::Int32 => "i32",
        DType::Uint32 => "u32",
        DType::Int64 => "i64",
        DType::Uint64 => "u64",
        DType::Float16 => "f16",
        DType::Float32 => "f32",
        DType::Float64 => "f64",
        DType::Bfloat16 => "bf16",
        _ => unreachable!("a dtype this test does not know"),
    }
}

/// True when element bytes `b` of dtype `d` are a NaN.
fn is_nan(d: DType, b: &[u8]) -> bool {
    match d {
        DType::Float16 => u16::from_le_bytes([b[0], b[1]]) & 0x7fff > 0x7c00,
        DType::Bfloat16 => u16::from_le_bytes([b[0], b[1]]) & 0x7fff > 0x7f80,
        DType::Float32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::Float64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

/// Bit-for-bit equality, except that a NaN matches any NaN where `any_nan` (sum, product and
/// division: Rust leaves the sign and payload of their NaN results unspecified).
fn check(what: &str, d: DType, got: &[u8], want: &[u8], any_nan: bool) {
    if any_nan {
        let size = d.size();
        let (mut g, mut w) = (got.to_vec(), want.to_vec());
        for (g, w) in g.chunks_mut(size).zip(w.chunks_mut(size)) {
            if is_nan(d, g) && is_nan(d, w) {
                g.fill(0);
                w.fill(0);
            }
        }
        assert_same(what, &g, &w, size)
    } else {
        assert_same(what, got, want, d.size())
    }
}

/// Random elements of `d`: integers uniform over their bits, floats mixing ordinary values
/// with random bit patterns (NaN, infinity, subnormal) and signed zeros.
fn random(g: &mut Gen, d: DType, n: usize) -> Vec<u8> {
    match d {
        DType::Float32 => g
            .f32s(n, false)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::Float64 => g
            .f32s(n, false)
            .iter()
            .zip(g.f32s(n, false))
            .flat_map(|(&v, w)| {
                // Keep a NaN's payload and fill the low bits, so f64 NaNs are varied too.
                let x = if v.is_nan() {
                    f64::from_bits((v as f64).to_bits() | w.to_bits() as u64)
                } else {
                    v as f64 + w as f64 * 1e-9
                };
                x.to_le_bytes()
            })
            .collect(),
        DType::Float16 => g
            .f32s(n, false)
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        DType::Bfloat16 => g
            .f32s(n, false)
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        _ => g.bytes(n * d.size()),
    }
}

#[test]
fn reduce_matches_rust() {
    let Some(drv) = driver("reduce") else { return };
    let mut g = Gen::new(1);
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            if op.check_dtype(d).is_err() {
                continue;
            }
            for (ci, n) in COUNTS.into_iter().enumerate() {
                let a = random(&mut g, d, n);
                let b = random(&mut g, d, n);
                let mut want = vec![0u8; a.len()];
                reduce3(d, op, &mut want, &a, &b);
                let entry = format!("qccl_reduce_{}_{}", op.name(), suffix(d));
                let inplace = ci % 2;
                let got = Job::new(&entry)
                    .arg("count", n)
                    .arg("inplace", inplace)
                    .input("a", &a)
                    .input("b", &b)
                    .output("out")
                    .run(&drv);
                let any_nan = matches!(op, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg);
                check(&format!("{entry} n={n}"), d, &got["out"], &want, any_nan);
            }
        }
    }
}

#[test]
fn finish_avg_matches_rust() {
    let Some(drv) = driver("reduce") else { return };
    let mut g = Gen::new(2);
    for d in DType::ALL.into_iter().filter(|d| d.is_float()) {
        for (n, ranks) in COUNTS.into_iter().zip([1usize, 2, 3, 7, 16777217]) {
            let x = random(&mut g, d, n);
            let mut want = x.clone();
            finish_avg(d, &mut want, ranks);
            let entry = format!("qccl_finish_avg_{}", suffix(d));
            let got = Job::new(&entry)
                .arg("count", n)
                .arg("n", ranks)
                .input("x", &x)
                .output("out")
                .run(&drv);
            check(
                &format!("{entry} n={n} ranks={ranks}"),
                d,
                &got["out"],
                &want,
                true,
            );
        }
    }
}
