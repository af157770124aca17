//! Test support: deterministic per-rank inputs, and references computed independently of
//! qccl's kernels (float64 for floats, wrapping arithmetic in i128 for integers).
#![allow(dead_code)]

pub mod coded;
pub mod job;
pub mod suite;
pub mod threads;
pub mod topk;

use half::{bf16, f16};
use qccl::{DType, ReduceOp};

/// True when a real GPU is usable (the CUDA driver sees a device), for the `--ignored`
/// tests that need one; false (skipped, saying why) without one, unless QCCL_REQUIRE_GPU=1
/// makes that a failure.
pub fn real_gpu() -> bool {
    match qccl::gpu::available() {
        Ok(()) => true,
        Err(e) if std::env::var("QCCL_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("QCCL_REQUIRE_GPU=1 but no GPU: {e}")
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            false
        }
    }
}

/// Deterministic pseudo-random u64 from (a, b, c).
pub fn mix(a: u64, b: u64, c: u64) -> u64 {
    let mut x = a
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(b.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(c.wrapping_mul(0x94D0_49BB_1331_11EB))
        .wrapping_add(0x2545_F491_4F6C_DD1D);
    x ^= x >> 31;
    x = x.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^ (x >> 29)
}

/// Input of `rank` for a case: floats in [-4, 4) (or [0.5, 2) for Prod), integers small
/// and signed where the type allows, so Prod and Sum wrap only for the narrow types.
pub fn input(dtype: DType, op: ReduceOp, rank: usize, count: usize, salt: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for i in 0..count {
        let r = mix(rank as u64, i as u64, salt);
        let unit = (r >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        if dtype.is_float() {
            let v = if op == ReduceOp::Prod {
                0.5 + 1.5 * unit
            } else {
                8.0 * unit - 4.0
            };
            push_float(dtype, v, &mut out);
        } else {
            let v = (r % 200) as i64 - 100;
            push_int(dtype, v, &mut out);
        }
    }
    out
}

fn push_float(dtype: DType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DType::Float16 => out.extend_from_slice(&f16::from_f64(v).to_ne_bytes()),
        DType::Bfloat16 => out.extend_from_slice(&bf16::from_f64(v).to_ne_bytes()),
        DType::Float32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
        DType::Float64 => out.extend_from_slice(&v.to_ne_bytes()),
        _ => unreachable!(),
    }
}

fn push_int(dtype: DType, v: i64, out: &mut Vec<u8>) {
    match dtype {
        DType::Int8 => out.push(v as i8 as u8),
        DType::Uint8 => out.push(v as u8),
        DType::Int32 => out.extend_from_slice(&(v as i32).to_ne_bytes()),
        DType::Uint32 => out.extend_from_slice(&(v as u32).to_ne_bytes()),
        DType::Int64 => out.extend_from_slice(&v.to_ne_bytes()),
        DType::Uint64 => out.extend_from_slice(&(v as u64).to_ne_bytes()),
        _ => unreachable!(),
    }
}

/// Element `i` of `b` as f64 (floats only).
#[inline]
pub fn float_at(dtype: DType, b: &[u8], i: usize) -> f64 {
    let s = dtype.size();
    let e = &b[i * s..(i + 1) * s];
    match dtype {
        DType::Float16 => f16::from_ne_bytes([e[0], e[1]]).to_f64(),
        DType::Bfloat16 => bf16::from_ne_bytes([e[0], e[1]]).to_f64(),
        DType::Float32 => f32::from_ne_bytes(e.try_into().unwrap()) as f64,
        DType::Float64 => f64::from_ne_bytes(e.try_into().unwrap()),
        _ => unreachable!(),
    }
}

/// Element `i` of `b` as i128, sign- or zero-extended per its type (integers only).
#[inline]
pub fn int_at(dtype: DType, b: &[u8], i: usize) -> i128 {
    let s = dtype.size();
    let e = &b[i * s..(i + 1) * s];
    match dtype {
        DType::Int8 => e[0] as i8 as i128,
        DType::Uint8 => e[0] as i128,
        DType::Int32 => i32::from_ne_bytes(e.try_into().unwrap()) as i128,
        DType::Uint32 => u32::from_ne_bytes(e.try_into().unwrap()) as i128,
        DType::Int64 => i64::from_ne_bytes(e.try_into().unwrap()) as i128,
        DType::Uint64 => u64::from_ne_bytes(e.try_into().unwrap()) as i128,
        _ => unreachable!(),
    }
}

/// Truncates `v` to the width and signedness of `dtype` (wrapping).
fn wrap(dtype: DType, v: i128) -> i128 {
    match dtype {
        DType::Int8 => v as i8 as i128,
        DType::Uint8 => v as u8 as i128,
        DType::Int32 => v as i32 as i128,
        DType::Uint32 => v as u32 as i128,
        DType::Int64 => v as i64 as i128,
        DType::Uint64 => v as u64 as i128,
        _ => unreachable!(),
    }
}

fn eps(dtype: DType) -> f64 {
    match dtype {
        DType::Float16 => 9.77e-4,
        DType::Bfloat16 => 7.82e-3,
        DType::Float32 => 1.2e-7,
        _ => 2.3e-16,
    }
}

/// Checks `got` (element range `range` of the reduction) against the reference reduction of
/// `inputs` (one buffer per rank, same range). Err names the first wrong element.
pub fn check_reduce(
    dtype: DType,
    op: ReduceOp,
    inputs: &[Vec<u8>],
    range: std::ops::Range<usize>,
    got: &[u8],
) -> Result<(), String> {
    Reference::new(dtype, op, inputs, range)?.check(got)
}

/// The reference reduction of a range of the ranks' inputs, computed once and checked
/// against every result of the same reduction (suites check several algorithms and roots of
/// millions of elements each; recomputing it per check was most of their time).
pub struct Reference<'a> {
    dtype: DType,
    op: ReduceOp,
    inputs: &'a [Vec<u8>],
    range: std::ops::Range<usize>,
    /// Floats: the float64 value and its tolerance per element; integers: the exact value.
    want: Vec<(f64, f64)>,
    exact: Vec<i128>,
}

impl<'a> Reference<'a> {
    /// The reduction with `op` of `range` of `inputs` (one buffer per rank): float64 for
    /// floats (with a tolerance of (n + 1) ulps of the type on the magnitudes summed),
    /// wrapping arithmetic in i128 for integers.
    pub fn new(
        dtype: DType,
        op: ReduceOp,
        inputs: &'a [Vec<u8>],
        range: std::ops::Range<usize>,
    ) -> Result<Reference<'a>, String> {
        let n = inputs.len();
        let (mut want, mut exact) = (Vec::new(), Vec::new());
        let mut xf: Vec<f64> = Vec::with_capacity(n);
        let mut xi: Vec<i128> = Vec::with_capacity(n);
        for i in range.clone() {
            if dtype.is_float() {
                xf.clear();
                xf.extend(inputs.iter().map(|b| float_at(dtype, b, i)));
                let v = match op {
                    ReduceOp::Sum => xf.iter().sum::<f64>(),
                    ReduceOp::Avg => xf.iter().sum::<f64>() / n as f64,
                    ReduceOp::Prod => xf.iter().product::<f64>(),
                    ReduceOp::Max => xf.iter().cloned().fold(f64::MIN, f64::max),
                    ReduceOp::Min => xf.iter().cloned().fold(f64::MAX, f64::min),
                    other => return Err(format!("no float64 reference for {other}")),
                };
                let scale = match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        xf.iter().map(|x| x.abs()).sum::<f64>().max(1.0)
                    }
                    ReduceOp::Prod => v.abs().max(1e-3) * 2.0,
                    _ => 0.0,
                };
                want.push((v, (n as f64 + 1.0) * eps(dtype) * scale));
            } else {
                xi.clear();
                xi.extend(inputs.iter().map(|b| int_at(dtype, b, i)));
                exact.push(wrap(
                    dtype,
                    match op {
                        ReduceOp::Sum => xi.iter().fold(0i128, |a, &x| a.wrapping_add(x)),
                        ReduceOp::Prod => xi.iter().fold(1i128, |a, &x| a.wrapping_mul(x)),
                        ReduceOp::Max => *xi.iter().max().unwrap(),
                        ReduceOp::Min => *xi.iter().min().unwrap(),
                        ReduceOp::Avg => unreachable!("avg on integers is rejected"),
                        other => return Err(format!("no reference for {other}")),
                    },
                ));
            }
        }
        Ok(Reference {
            dtype,
            op,
            inputs,
            range,
            want,
            exact,
        })
    }

    /// Checks `got` (the reduced range); Err names the first wrong element.
    pub fn check(&self, got: &[u8]) -> Result<(), String> {
        let (dtype, op) = (self.dtype, self.op);
        let inputs = |i: usize| -> String {
            if dtype.is_float() {
                format!(
                    "{:?}",
                    self.inputs
                        .iter()
                        .map(|b| float_at(dtype, b, i))
                        .collect::<Vec<_>>()
                )
            } else {
                format!(
                    "{:?}",
                    self.inputs
                        .iter()
                        .map(|b| int_at(dtype, b, i))
                        .collect::<Vec<_>>()
                )
            }
        };
        for (k, i) in self.range.clone().enumerate() {
            if dtype.is_float() {
                let (want, tol) = self.want[k];
                let g = float_at(dtype, got, k);
                if (g - want).abs() > tol {
                    return Err(format!(
                        "{dtype} {op} element {i}: got {g}, float64 reference {want} (tolerance {tol}), inputs {}",
                        inputs(i)
                    ));
                }
            } else {
                let (want, g) = (self.exact[k], int_at(dtype, got, k));
                if g != want {
                    return Err(format!(
                        "{dtype} {op} element {i}: got {g}, reference {want}, inputs {}",
                        inputs(i)
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The ops that apply to `dtype`.
pub fn ops_for(dtype: DType) -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|op| op.check_dtype(dtype).is_ok())
        .collect()
}
