//! Selection cost of the sparsifiers on one core: exact top-k (quickselect) against MSTopK
//! (Algorithm 1, 30 samplings) and random-k, on 16 Mi Gaussian f32 at densities 0.001 and 0.01.
//!
//! `cargo bench --bench select` (SELECT_N elements, SELECT_DIST=gaussian|uniform|ef|ef-uniform). Prints the best of several runs in ms and ns per element.

#[path = "common/mod.rs"]
mod common;

use common::{best_of, gaussian};
use qccl::codec::Rng;
use qccl::internal::k_of;
use qccl::internal::mstopk_select;
use qccl::internal::select_randk;
use qccl::internal::select_topk;
use std::hint::black_box;
use std::time::Duration;

fn main() {
    let n = std::env::var("SELECT_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16usize << 20);
    // SELECT_DIST=uniform: the shape of qccl-perf's inputs, where the sampled cutoff is
    // least informative.
    let dist = std::env::var("SELECT_DIST").unwrap_or_else(|_| "gaussian".into());
    let x: Vec<f32> = match dist.as_str() {
        "uniform" => {
            let mut r = Rng::from_u64(1);
            (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
        }
        // What error feedback feeds the selector after 20 steps on the same gradient: entries
        // not sent pile up, so magnitudes spread over a range of scales.
        "ef" | "ef-uniform" => {
            let g = if dist == "ef" {
                gaussian(n, 1)
            } else {
                let mut r = Rng::from_u64(1);
                (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
            };
            let k = k_of(0.01, n);
            let (mut r, mut e, mut sel) = (vec![0f32; n], vec![0f32; n], Vec::new());
            for _ in 0..20 {
                for ((e, r), g) in e.iter_mut().zip(&r).zip(&g) {
                    *e = r + g;
                }
                select_topk(&e, k, &mut sel);
                r.copy_from_slice(&e);
                for &i in &sel {
                    r[i as usize] = 0.0;
                }
            }
            e
        }
        _ => gaussian(n, 1),
    };
    let mut idx = Vec::new();
    println!("{n} {dist} f32, best of 5, one thread");
    println!(
        "{:<10} {:>8} {:>10} {:>10}",
        "selector", "density", "ms", "ns/elem"
    );
    for density in [0.001, 0.01] {
        let k = k_of(density, n);
        let report = |name: &str, d: Duration| {
            println!(
                "{name:<10} {density:>8} {:>10.2} {:>10.3}",
                d.as_secs_f64() * 1e3,
                d.as_secs_f64() * 1e9 / n as f64
            );
        };
        let topk = best_of(5, || select_topk(black_box(&x), k, &mut idx));
        report("topk", topk);
        let mut rng = Rng::from_u64(2);
        let ms = best_of(5, || {
            mstopk_select(black_box(&x), k, 30, rng.next_u64(), &mut idx);
        });
        report("mstopk", ms);
        let rk = best_of(5, || select_randk(n, k, rng.next_u64(), &mut idx));
        report("randk", rk);
        println!(
            "mstopk is {:.1}x faster than topk at density {density}",
            topk.as_secs_f64() / ms.as_secs_f64()
        );
    }
}
