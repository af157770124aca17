//! Compressed-collective checks shared by the thread and process tests: inputs, float64
//! references, and a suite that runs every schedule and compares against the reference.

use super::mix;
use qccl::{Algo, Comm, Compression, ReduceOp};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

/// Large inputs and references, computed once per test process: the sweeps ask for the same
/// ones for every codec, schedule and layout, and computing them was most of their time.
type Memo<T> = LazyLock<Mutex<HashMap<(usize, usize, u64), Arc<Vec<T>>>>>;
static GRADS: Memo<f32> = LazyLock::new(Default::default);
static REFERENCES: Memo<f64> = LazyLock::new(Default::default);

/// From 64 Ki elements on: smaller ones are cheaper to compute than to keep.
const MEMO_FROM: usize = 1 << 16;

fn memo<T: Clone>(
    table: &Memo<T>,
    key: (usize, usize, u64),
    make: impl FnOnce() -> Vec<T>,
) -> Vec<T> {
    if key.1 < MEMO_FROM {
        return make();
    }
    let hit = table.lock().unwrap().get(&key).cloned();
    let v = hit.unwrap_or_else(|| {
        let v = Arc::new(make());
        table.lock().unwrap().insert(key, v.clone());
        v
    });
    v.as_ref().clone()
}

/// Rank `rank`'s gradient: roughly Gaussian values (a sum of four uniforms), per salt.
pub fn grad(rank: usize, count: usize, salt: u64) -> Vec<f32> {
    memo(&GRADS, (rank, count, salt), || make_grad(rank, count, salt))
}

fn make_grad(rank: usize, count: usize, salt: u64) -> Vec<f32> {
    (0..count)
        .map(|i| {
            let u = |k: u64| {
                (mix(rank as u64, i as u64, salt * 4 + k) >> 11) as f64 / (1u64 << 53) as f64
            };
            ((u(0) + u(1) + u(2) + u(3) - 2.0) * 2.0) as f32
        })
        .collect()
}

/// The float64 sum over `n` ranks' gradients.
pub fn reference(n: usize, count: usize, salt: u64) -> Vec<f64> {
    memo(&REFERENCES, (n, count, salt), || {
        let mut r = vec![0.0f64; count];
        for rank in 0..n {
            for (a, b) in r.iter_mut().zip(grad(rank, count, salt)) {
                *a += b as f64;
            }
        }
        r
    })
}

/// ‖out − exact‖ / ‖exact‖ (0 for a zero reference).
pub fn rel_err(out: &[f32], exact: &[f64]) -> f64 {
    let num: f64 = out
        .iter()
        .zip(exact)
        .map(|(&o, &e)| (o as f64 - e).powi(2))
        .sum();
    let den: f64 = exact.iter().map(|e| e * e).sum();
    if den == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}

/// A 64-bit hash of the bits of `v` (to compare results across processes).
pub fn hash(v: &[f32]) -> u64 {
    v.iter()
        .enumerate()
        .fold(0x243f_6a88_85a3_08d3, |h, (i, x)| {
            mix(h, i as u64, x.to_bits() as u64)
        })
}

/// Every schedule × count for `spec` on `comm`: relative error against the float64 reference
/// within `bound`, and bit-identical results on every rank (hashes all-gathered).
pub fn check_spec(comm: &Comm, spec: &str, bound: f64) -> Result<(), String> {
    let n = comm.size();
    for algo in [
        Algo::Auto,
        Algo::Sra,
        Algo::Ring,
        Algo::Tree,
        Algo::AllGather,
    ] {
        for (k, count) in [0usize, 1, 7, 1000, 100_003].into_iter().enumerate() {
            let salt = 1000 + k as u64;
            let c = Compression::parse(spec)
                .map_err(|e| e.to_string())?
                .algo(algo)
                .key(format!("{algo:?} {count}"));
            let mut g = grad(comm.rank(), count, salt);
            comm.all_reduce_compressed(&mut g, ReduceOp::Sum, &c)
                .map_err(|e| format!("{spec} {algo:?} count {count}: {e}"))?;
            let e = rel_err(&g, &reference(n, count, salt));
            if e > bound {
                return Err(format!(
                    "{spec} {algo:?} count {count}: relative error {e} above {bound}"
                ));
            }
            let mut hashes = vec![0u64; n];
            comm.all_gather(&[hash(&g)], &mut hashes)
                .map_err(|e| e.to_string())?;
            if hashes.iter().any(|&h| h != hashes[0]) {
                return Err(format!(
                    "{spec} {algo:?} count {count}: ranks ended with different results"
                ));
            }
        }
    }
    Ok(())
}
