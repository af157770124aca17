//! Helpers shared by the plain-harness benches (`#[path = "common/mod.rs"] mod common;`).
#![allow(dead_code)]

use qccl::codec::Rng;
use std::time::{Duration, Instant};

/// Shortest time of `runs` calls of `f` (after one warm-up call).
pub fn best_of(runs: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .expect("at least one run")
}

/// GB/s (1e9 bytes) of `bytes` moved in `t`.
pub fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Standard normal samples (Box-Muller on the codecs' generator).
pub fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::from_u64(seed);
    (0..n)
        .map(|_| {
            let u1 = 1.0 - r.next_f32() as f64; // (0, 1]
            let u2 = r.next_f32() as f64;
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}
