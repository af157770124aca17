//! Codec throughput on one thread: encode, decode_add and encode_own (encode keeping the
//! decoded value in place, as the owner of a sum does) of a Gaussian f32 buffer (64 MiB by
//! default: DRAM-bound) next to a single-thread memcpy of the same buffer in the same run.
//!
//! `cargo bench --bench codecs [-- SPEC...]`, e.g. `-- qsgd:bits=4 efsign`; the buffer size in
//! MiB comes from QCCL_BENCH_MIB (default 64), the repetitions from QCCL_BENCH_RUNS (default 15).
//! Codec GB/s (1 GB = 1e9 bytes) count f32 bytes: the input of encode, the output of decode_add.
//! memcpy GB/s counts bytes read plus bytes written (2 × buffer), as benches/reduce.rs does and
//! as the "fraction of memcpy bandwidth" targets mean it; the ratio columns divide by that.
//! Each figure is the best of the runs. Specs not implemented in this build are skipped with a
//! note.

#[path = "common/mod.rs"]
mod common;

use common::{best_of, gaussian, gbps};
use qccl::codec::{Rng, Site};
use qccl::{CodecSpec, Error};
use std::hint::black_box;

const DEFAULT_SPECS: &str = "fp16 bf16 qsgd:bits=8 qsgd:bits=4 qsgd:bits=2 efsign onebit \
     topk:density=0.01 mstopk:density=0.01 mstopk:density=0.001 topk:density=0.001 \
     randk:density=0.01";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // Cargo passes `--bench`; every other argument is a spec.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let specs: Vec<String> = if args.is_empty() {
        DEFAULT_SPECS.split_whitespace().map(String::from).collect()
    } else {
        args
    };
    let mib = env_usize("QCCL_BENCH_MIB", 64);
    let runs = env_usize("QCCL_BENCH_RUNS", 15);
    let n = (mib << 20) / 4;
    let bytes = 4 * n;
    let x = gaussian(n, 1);
    let mut out = vec![0.5f32; n];

    let copy = best_of(runs, || {
        black_box(&mut out).copy_from_slice(black_box(&x));
    });
    let copy_gbps = gbps(2 * bytes, copy);
    println!(
        "{n} f32 ({mib} MiB), one thread, best of {runs}; codec GB/s of f32 data (encode: \
         input, decode_add: output)"
    );
    println!(
        "memcpy (copy_from_slice): {copy_gbps:.2} GB/s read+write ({:.2} GB/s of buffer)",
        copy_gbps / 2.0
    );
    println!();
    println!(
        "{:<28} {:>8} {:>9} {:>8} {:>10} {:>8} {:>10} {:>9}",
        "spec", "ratio", "enc GB/s", "x memcpy", "dec+ GB/s", "x memcpy", "own GB/s", "rel err"
    );
    for text in &specs {
        let spec = match CodecSpec::parse(text) {
            Ok(s) => s,
            Err(Error::Unsupported(m)) => {
                println!("{text:<28} skipped: {m}");
                continue;
            }
            Err(e) => {
                println!("{text:<28} skipped: {e}");
                continue;
            }
        };
        let codec = spec.codec().clone();
        let mut enc = vec![0u8; codec.max_encoded_len(n)];
        let site = Site::default();
        let te = best_of(runs, || {
            let mut rng = Rng::new(site);
            codec
                .encode(black_box(&x), &mut rng, black_box(&mut enc))
                .unwrap();
        });
        let td = best_of(runs, || {
            codec
                .decode_add(black_box(&enc), black_box(&mut out))
                .unwrap();
        });
        // Encode keeping the decoded value in place (the owner of a sum): repeated on its
        // own output, which encodes at the same speed.
        let mut own = x.clone();
        let to = best_of(runs, || {
            let mut rng = Rng::new(site);
            codec
                .encode_own(black_box(&mut own), &mut rng, black_box(&mut enc))
                .unwrap();
        });
        // One clean round trip for the error column.
        codec.decode_into(&enc, &mut out).unwrap();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (a, b) in x.iter().zip(&out) {
            num += (*a as f64 - *b as f64).powi(2);
            den += (*a as f64).powi(2);
        }
        let (ge, gd) = (gbps(bytes, te), gbps(bytes, td));
        println!(
            "{:<28} {:>7.1}x {:>9.2} {:>8.2} {:>10.2} {:>8.2} {:>10.2} {:>9.4}",
            codec
                .spec()
                .replace(",scale=maxmin,rounding=stochastic", ""),
            bytes as f64 / enc.len() as f64,
            ge,
            ge / copy_gbps,
            gd,
            gd / copy_gbps,
            gbps(bytes, to),
            (num / den).sqrt()
        );
        out.fill(0.5);
    }
}
