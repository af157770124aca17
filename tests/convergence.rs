//! Compression must not cost accuracy: data-parallel gradient descent on an L2-regularised
//! logistic regression (4 ranks as threads, each with its own shard of generated data) reaches
//! a final loss within 1% of the uncompressed run with qsgd 4 bits / bucket 128 and with top-k
//! density 0.01 plus error feedback. Top-k without error feedback is allowed to be worse, and
//! the test shows that it is.

mod common;

use common::mix;
use qccl::{Comm, Compression, Config, ReduceOp};
use std::sync::Arc;

const RANKS: usize = 4;
const FEATURES: usize = 1000;
const SAMPLES_PER_RANK: usize = 400;
const STEPS: usize = 600;
const LR: f64 = 0.5;
const L2: f64 = 1e-3;

fn unit(a: u64, b: u64, c: u64) -> f64 {
    (mix(a, b, c) >> 11) as f64 / (1u64 << 53) as f64
}

/// Roughly standard normal (Irwin–Hall of 6).
fn normal(a: u64, b: u64, c: u64) -> f64 {
    (0..6).map(|k| unit(a, b, c * 8 + k)).sum::<f64>() * (2.0f64).sqrt()
        - 6.0 / 2.0 * (2.0f64).sqrt()
}

/// A rank's shard: features and labels from a planted model, 10% label noise.
fn shard(rank: usize) -> (Vec<f64>, Vec<f64>) {
    let truth: Vec<f64> = (0..FEATURES)
        .map(|j| {
            if j % 7 == 0 {
                normal(99, j as u64, 1)
            } else {
                0.0
            }
        })
        .collect();
    let mut x = vec![0.0; SAMPLES_PER_RANK * FEATURES];
    let mut y = vec![0.0; SAMPLES_PER_RANK];
    for i in 0..SAMPLES_PER_RANK {
        let row = &mut x[i * FEATURES..(i + 1) * FEATURES];
        let id = (rank * SAMPLES_PER_RANK + i) as u64;
        for (j, v) in row.iter_mut().enumerate() {
            *v = normal(id, j as u64, 2) / (FEATURES as f64).sqrt() * 3.0;
        }
        let margin: f64 = row.iter().zip(&truth).map(|(a, b)| a * b).sum();
        let flip = unit(id, 0, 3) < 0.1;
        y[i] = ((margin > 0.0) != flip) as u8 as f64;
    }
    (x, y)
}

/// Mean logistic loss of the shard plus the L2 term, and its gradient.
fn loss_grad(x: &[f64], y: &[f64], w: &[f64], grad: Option<&mut [f64]>) -> f64 {
    let mut loss = 0.0;
    let mut g = vec![0.0; FEATURES];
    for (i, &yi) in y.iter().enumerate() {
        let row = &x[i * FEATURES..(i + 1) * FEATURES];
        let z: f64 = row.iter().zip(w).map(|(a, b)| a * b).sum();
        let p = 1.0 / (1.0 + (-z).exp());
        loss += if yi > 0.5 {
            -(p.max(1e-12)).ln()
        } else {
            -((1.0 - p).max(1e-12)).ln()
        };
        for (gj, xj) in g.iter_mut().zip(row) {
            *gj += (p - yi) * xj;
        }
    }
    let n = y.len() as f64;
    if let Some(out) = grad {
        for ((o, gj), wj) in out.iter_mut().zip(&g).zip(w) {
            *o = gj / n + L2 * wj;
        }
    }
    loss / n + 0.5 * L2 * w.iter().map(|v| v * v).sum::<f64>()
}

/// Trains with `spec` (None: uncompressed all-reduce); returns the final global loss.
fn train(spec: Option<&'static str>) -> f64 {
    let comms = Comm::init_threads(RANKS, Config::default()).unwrap();
    let losses: Vec<f64> = comms
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let (x, y) = shard(comm.rank());
                let mut w = vec![0.0f64; FEATURES];
                let mut g64 = vec![0.0f64; FEATURES];
                let c = spec.map(|s| Compression::parse(s).unwrap().key("w"));
                for _ in 0..STEPS {
                    loss_grad(&x, &y, &w, Some(&mut g64));
                    let mut g: Vec<f32> = g64.iter().map(|&v| v as f32).collect();
                    match &c {
                        Some(c) => {
                            comm.all_reduce_compressed(&mut g, ReduceOp::Avg, c)
                                .unwrap();
                        }
                        None => comm.all_reduce_in_place(&mut g, ReduceOp::Avg).unwrap(),
                    }
                    for (wj, gj) in w.iter_mut().zip(&g) {
                        *wj -= LR * *gj as f64;
                    }
                }
                let mut l = [loss_grad(&x, &y, &w, None)];
                comm.all_reduce_in_place(&mut l, ReduceOp::Avg).unwrap();
                l[0]
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    // Every rank holds the same model, so the same loss.
    assert!(losses.iter().all(|&l| l == losses[0]), "{losses:?}");
    losses[0]
}

#[test]
fn compressed_training_matches_uncompressed() {
    let dense = train(None);
    let initial = std::f64::consts::LN_2;
    assert!(
        dense < 0.8 * initial,
        "the problem must need its gradients: {dense}"
    );
    let runs = Arc::new([
        (
            "qsgd:bits=4,bucket=128",
            train(Some("qsgd:bits=4,bucket=128")),
        ),
        (
            "topk:density=0.01,ef=1",
            train(Some("topk:density=0.01,ef=1")),
        ),
        ("topk:density=0.01", train(Some("topk:density=0.01"))),
    ]);
    let report: Vec<String> = runs
        .iter()
        .map(|(s, l)| format!("{s}: {l:.5} ({:+.2}%)", (l / dense - 1.0) * 100.0))
        .collect();
    let report = format!("dense {dense:.5}; {}", report.join("; "));
    println!("{report}");
    for (spec, loss) in &runs[..2] {
        assert!((loss / dense - 1.0).abs() < 0.01, "{spec}: {report}");
    }
    assert!(
        runs[2].1 > runs[1].1 * 1.01,
        "top-k without error feedback: {report}"
    );
}
