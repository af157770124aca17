//! Reduction kernel throughput (sum of f32, f16, bf16, f64, i32; f32 max; f32 out of place and
//! misaligned) next to a single-thread memcpy measured in the same run, for buffers in DRAM, L2
//! and L1.
//!
//! `cargo bench --bench reduce`. Prints GB/s (1 GB = 1e9 bytes) of bytes touched, best of several
//! runs: `reduce_into` reads dst, reads src and writes dst (3 × buffer), `reduce3` reads a and b
//! and writes dst (3 × buffer), memcpy reads and writes (2 × buffer).

#[path = "common/mod.rs"]
mod common;

use common::{best_of, gbps};
use qccl::internal::{reduce3, reduce_into};
use qccl::{DType, ReduceOp};
use std::hint::black_box;
use std::time::Duration;

const MIB: usize = 1 << 20;

/// A zeroed, 8-byte aligned byte buffer (so reductions take the aligned path).
fn buffer(bytes: usize) -> Vec<u64> {
    vec![0; bytes / 8]
}

fn bytes_mut(b: &mut [u64]) -> &mut [u8] {
    bytemuck::cast_slice_mut(b)
}

fn bytes(b: &[u64]) -> &[u8] {
    bytemuck::cast_slice(b)
}

/// Fills `buf` with the value `v` in `dtype` (touching every page, so no page faults are timed).
fn fill(dtype: DType, buf: &mut [u8], v: f64) {
    fn rep<const N: usize>(buf: &mut [u8], e: [u8; N]) {
        for c in buf.chunks_exact_mut(N) {
            c.copy_from_slice(&e);
        }
    }
    match dtype {
        DType::Float32 => rep(buf, (v as f32).to_ne_bytes()),
        DType::Float64 => rep(buf, v.to_ne_bytes()),
        DType::Float16 => rep(buf, half::f16::from_f64(v).to_ne_bytes()),
        DType::Bfloat16 => rep(buf, half::bf16::from_f64(v).to_ne_bytes()),
        DType::Int32 => rep(buf, (v as i32).to_ne_bytes()),
        _ => unimplemented!("bench fill for {dtype}"),
    }
}

/// Best time of `reps` back-to-back memcpys of `size` bytes.
fn memcpy(size: usize, reps: usize, runs: usize) -> Duration {
    let mut src = buffer(size);
    fill(DType::Int32, bytes_mut(&mut src), 7.0);
    let mut dst = buffer(size);
    fill(DType::Int32, bytes_mut(&mut dst), 1.0);
    best_of(runs, || {
        for _ in 0..reps {
            black_box(&mut dst).copy_from_slice(black_box(&src));
        }
    })
}

/// How a case lays out its buffers.
#[derive(Clone, Copy)]
enum Layout {
    /// `reduce_into(dst, src)`, aligned.
    InPlace,
    /// `reduce3(dst, a, src)`, aligned.
    OutOfPlace,
    /// `reduce_into(dst, src)`, both one byte past alignment.
    Misaligned,
}

fn run(size: usize, reps: usize, runs: usize, filter: &str) {
    let copy = memcpy(size, reps, runs);
    let copy_gbps = gbps(2 * size * reps, copy);
    println!(
        "{:<28} {:>8.2} GB/s {:>10.2} us/call",
        "memcpy (copy_from_slice)",
        copy_gbps,
        copy.as_secs_f64() * 1e6 / reps as f64
    );
    let mut dst = buffer(size);
    let mut src = buffer(size);
    // (dtype, op, layout)
    let cases = [
        (DType::Float32, ReduceOp::Sum, Layout::InPlace),
        (DType::Float32, ReduceOp::Sum, Layout::OutOfPlace),
        (DType::Float32, ReduceOp::Sum, Layout::Misaligned),
        (DType::Float32, ReduceOp::Max, Layout::InPlace),
        (DType::Float16, ReduceOp::Sum, Layout::InPlace),
        (DType::Bfloat16, ReduceOp::Sum, Layout::InPlace),
        (DType::Float64, ReduceOp::Sum, Layout::InPlace),
        (DType::Int32, ReduceOp::Sum, Layout::InPlace),
    ];
    for (dtype, op, layout) in cases {
        let name = match layout {
            Layout::InPlace => format!("reduce_into {dtype} {op}"),
            Layout::OutOfPlace => format!("reduce3 {dtype} {op}"),
            Layout::Misaligned => format!("reduce_into {dtype} {op} +1B"),
        };
        if !name.contains(filter) {
            continue;
        }
        fill(dtype, bytes_mut(&mut dst), 1.0);
        fill(dtype, bytes_mut(&mut src), 0.5);
        let a = match layout {
            Layout::OutOfPlace => dst.clone(),
            _ => Vec::new(),
        };
        // Misaligned: both buffers start one byte in (and lose one element).
        let (off, len) = match layout {
            Layout::Misaligned => (1, size - dtype.size()),
            _ => (0, size),
        };
        let t = best_of(runs, || {
            for _ in 0..reps {
                let d = &mut bytes_mut(black_box(&mut dst))[off..off + len];
                let s = &bytes(black_box(&src))[off..off + len];
                match layout {
                    Layout::OutOfPlace => reduce3(dtype, op, d, &bytes(black_box(&a))[..len], s),
                    _ => reduce_into(dtype, op, d, s),
                }
            }
        });
        let g = gbps(3 * len * reps, t);
        println!(
            "{name:<28} {g:>8.2} GB/s {:>10.2} us/call {:>6.2} x memcpy",
            t.as_secs_f64() * 1e6 / reps as f64,
            g / copy_gbps
        );
    }
}

fn main() {
    // `cargo bench --bench reduce [-- FILTER]`: only the cases whose name contains FILTER
    // (cargo itself passes `--bench`, which is skipped).
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    println!("64 MiB buffers (memory-bound), best of 10 runs; GB/s = bytes touched / time");
    run(64 * MIB, 1, 10, &filter);
    println!();
    println!("256 KiB buffers (L2-resident), 256 calls per run, best of 10 runs");
    run(256 << 10, 256, 10, &filter);
    println!();
    println!("16 KiB buffers (L1-resident), 4096 calls per run, best of 10 runs");
    run(16 << 10, 4096, 10, &filter);
}
