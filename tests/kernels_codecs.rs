//! The codec kernels (kernels/qsgd.cu, topk.cu, mstopk.cu, randk.cu, sparse.cu) run on the CPU
//! through the shim (kernels/shim/), compared bit for bit with the Rust codecs: payloads,
//! decoded outputs and error-feedback residuals, over awkward counts (0, 1, 7, 4099, 1000003),
//! every bit width, both scales and roundings, ties, signed zeros and non-finite values.
//!
//! Drivers: kernels/shim/qsgd_driver.cpp and sparse_driver.cpp (built and run by tests/shim).
//! Needs g++; without it the test prints why and passes, unless QCCL_REQUIRE_SHIM=1 (CI).

mod shim;

use qccl::codec::Rng;
use qccl::internal::k_of;
use qccl::CodecSpec;
use shim::{bytes_f32, driver, f32_bytes, Driver, Job, COUNTS};

/// f32 bits, with every NaN as one value: NaN payloads are not part of the wire contract for
/// decoded floats (a GPU's arithmetic makes canonical NaNs).
fn canon(v: &[f32]) -> Vec<u32> {
    v.iter()
        .map(|x| if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() })
        .collect()
}

/// Test data from its own splitmix64 (independent of the codecs' draw): kind 0 Gaussian-ish,
/// 1 few distinct values (ties, signed zeros), 2 with non-finite values sprinkled in.
fn data(kind: u32, n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n as u64;
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let r = next();
            let u = (r >> 40) as f32 / (1u64 << 24) as f32;
            match kind {
                0 => (u - 0.5) * 4.0 + ((r & 0xff) as f32 - 128.0) / 64.0,
                1 => [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 0.25][(r % 7) as usize],
                _ => match r % 97 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3 => -0.0,
                    _ => u * 2.0 - 1.0,
                },
            }
        })
        .collect()
}

/// Parameters of one qsgd case.
#[derive(Clone, Copy)]
struct Qsgd {
    bits: u32,
    bucket: u32,
    maxabs: bool,
    nearest: bool,
}

impl Qsgd {
    fn spec(&self) -> String {
        format!(
            "qsgd:bits={},bucket={},scale={},rounding={}",
            self.bits,
            self.bucket,
            if self.maxabs { "maxabs" } else { "maxmin" },
            if self.nearest {
                "nearest"
            } else {
                "stochastic"
            }
        )
    }

    fn job<'a>(&self, entry: &str, n: usize) -> Job<'a> {
        Job::new(entry)
            .arg("count", n)
            .arg("bits", self.bits)
            .arg("bucket", self.bucket)
            .arg("maxabs", self.maxabs as u8)
            .arg("nearest", self.nearest as u8)
    }
}

/// One qsgd case: encode (plain and with error feedback) and decode(-add), against the codec.
fn qsgd_case(d: &Driver, q: Qsgd, x: &[f32], key: u64) {
    let spec = q.spec();
    let c = CodecSpec::parse(&spec).unwrap().codec().clone();
    let n = x.len();
    let what = format!("{spec} n={n}");
    let mut want = vec![0u8; c.payload_len(n)];
    c.encode_payload(x, &mut Rng::from_u64(key), &mut want);
    let xb = f32_bytes(x);
    let got = q
        .job("encode", n)
        .arg("key", key)
        .input("x", &xb)
        .output("payload")
        .run(d);
    assert!(got["payload"] == want, "{what}: encoded payload differs");

    // decode-add onto a base and decode, then the decoder's refusal of a bad scale.
    let base: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.25 - 1.0).collect();
    let bb = f32_bytes(&base);
    let decode = |payload: &[u8], add: bool| {
        q.job("decode", n)
            .arg("add", add as u8)
            .input("payload", payload)
            .input("acc", &bb)
            .output("bad")
            .output("out")
            .run(d)
    };
    for add in [true, false] {
        let mut out = if add { base.clone() } else { vec![0.0; n] };
        c.decode_payload(&want, &mut out, add).unwrap();
        let got = decode(&want, add);
        assert_eq!(got["bad"], [0; 4], "{what}: valid payload refused");
        assert!(
            canon(&bytes_f32(&got["out"])) == canon(&out),
            "{what}: decode (add {add}) differs"
        );
    }
    if n > 0 {
        let mut bad = want.clone();
        // hi = -inf (maxmin) or m = -1 (maxabs): both invalid.
        let (at, v) = if q.maxabs {
            (0, -1.0f32)
        } else {
            (4, f32::NEG_INFINITY)
        };
        bad[at..at + 4].copy_from_slice(&v.to_le_bytes());
        assert!(c.decode_payload(&bad, &mut base.clone(), true).is_err());
        let got = decode(&bad, true);
        assert_eq!(got["bad"], 1i32.to_le_bytes(), "{what}: bad scale accepted");
        assert!(got["out"] == bb, "{what}: refused decode wrote");
    }

    // Error feedback, as the Rust wrapper: w = x + res, encode w, res = (0 + w) - decode(w).
    let res: Vec<f32> = data(0, n, key ^ 77).iter().map(|v| v * 0.01).collect();
    let w: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
    let mut want = vec![0u8; c.payload_len(n)];
    c.encode_payload(&w, &mut Rng::from_u64(key), &mut want);
    let mut dec = vec![0.0; n];
    c.decode_payload(&want, &mut dec, false).unwrap();
    let new_res: Vec<f32> = w.iter().zip(&dec).map(|(w, d)| (0.0 + w) - d).collect();
    let rb = f32_bytes(&res);
    let got = q
        .job("encode_ef", n)
        .arg("key", key)
        .input("x", &xb)
        .input("res", &rb)
        .output("payload")
        .output("res_out")
        .output("w")
        .run(d);
    assert!(got["payload"] == want, "{what}: EF payload differs");
    assert!(
        canon(&bytes_f32(&got["res_out"])) == canon(&new_res),
        "{what}: EF residual differs"
    );
    assert!(
        canon(&bytes_f32(&got["w"])) == canon(&w),
        "{what}: EF compensated input differs"
    );
}

#[test]
fn qsgd_kernels_match_the_codec() {
    let Some(d) = driver("qsgd") else { return };
    let mut seed = 1;
    for &n in &COUNTS {
        for bits in 1..=8 {
            // The large count at a few widths only (debug-build time).
            if n > 100_000 && ![1, 3, 4, 8].contains(&bits) {
                continue;
            }
            for maxabs in [false, true] {
                for nearest in [true, false] {
                    // At the large count, one bucket size per case, alternating.
                    // Buckets over 4096 take the kernels' scale-by-runs path.
                    let buckets: &[u32] = if n < 100_000 {
                        &[1, 7, 128, 5000]
                    } else if (bits + maxabs as u32 + nearest as u32) & 1 == 0 {
                        &[128, 1 << 16]
                    } else {
                        &[1000, 12289]
                    };
                    for &bucket in buckets {
                        seed += 1;
                        let x = data((seed % 3) as u32, n, seed);
                        let q = Qsgd {
                            bits,
                            bucket,
                            maxabs,
                            nearest,
                        };
                        qsgd_case(&d, q, &x, seed * 0x1234_5678);
                    }
                }
            }
        }
    }
}

#[test]
fn qsgd_kernels_handle_zero_signs_and_constant_buckets() {
    let Some(d) = driver("qsgd") else { return };
    // Buckets of only zeros of mixed signs (the scale's sign of zero is the first one each of
    // the eight lanes meets), constant buckets, a lone NaN and a lone infinity.
    let mut x = vec![0.0f32; 64];
    for (i, v) in x.iter_mut().enumerate() {
        if i % 3 == 1 || i % 11 == 0 {
            *v = -0.0;
        }
    }
    x.extend([2.5f32; 17]);
    x.extend([1.0, f32::NAN, 3.0, -2.0, 7.0, f32::INFINITY, 0.0, -0.0, 0.0]);
    for bucket in [1, 3, 8, 9, 16, 100, 4097] {
        for bits in [1, 2, 5, 8] {
            for maxabs in [false, true] {
                for nearest in [true, false] {
                    let q = Qsgd {
                        bits,
                        bucket,
                        maxabs,
                        nearest,
                    };
                    qsgd_case(&d, q, &x, 99);
                }
            }
        }
    }
    // Zeros of both signs among values of one sign, so a bucket's bound is a zero: its sign is
    // that of the zero met first in the lowest of the CPU's eight lanes, which is neither the
    // bucket's first zero nor the first a GPU warp lane (every 32nd element) meets.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for sign in [1.0f32, -1.0] {
        let z: Vec<f32> = (0..20_000)
            .map(|_| match next() % 16 {
                0 => -0.0,
                1 => 0.0,
                _ => sign * (1 + next() % 4) as f32,
            })
            .collect();
        for bucket in [32, 40, 64, 100, 128, 4096, 5000, 9000] {
            for maxabs in [false, true] {
                let q = Qsgd {
                    bits: 2,
                    bucket,
                    maxabs,
                    nearest: true,
                };
                qsgd_case(&d, q, &z, 3);
            }
        }
    }
    // Large buckets scanned in runs: the zeros (and their first signs) are in a later run
    // than the bucket's positive values, so the merge order decides the scale's sign.
    let y: Vec<f32> = (0..9100)
        .map(|i| match i {
            0..4096 => 1.0,
            _ if i % 5 == 0 || i % 7 == 3 => -0.0,
            _ => 0.0,
        })
        .collect();
    for bucket in [4500, 8192, 9100] {
        for maxabs in [false, true] {
            for nearest in [true, false] {
                let q = Qsgd {
                    bits: 3,
                    bucket,
                    maxabs,
                    nearest,
                };
                qsgd_case(&d, q, &y, 7);
            }
        }
    }
}

/// The driver's number for a sparse codec, and mstopk's samplings.
fn sparse_codec(spec: &str) -> (u32, u32) {
    match spec.split(':').next().unwrap() {
        "topk" => (0, 0),
        "mstopk" => (
            1,
            spec.split("samplings=")
                .nth(1)
                .map_or(30, |s| s.parse().unwrap()),
        ),
        _ => (2, 0),
    }
}

/// One sparse case: encode (plain and with error feedback) and decode(-add), against the
/// codec; `density` is the spec's.
fn sparse_case(d: &Driver, spec: &str, density: f64, x: &[f32], key: u64) {
    let c = CodecSpec::parse(spec).unwrap().codec().clone();
    let n = x.len();
    let what = format!("{spec} n={n}");
    let (codec, samplings) = sparse_codec(spec);
    let k = k_of(density, n);
    assert_eq!(c.payload_len(n), 8 * k);
    let mut want = vec![0u8; 8 * k];
    c.encode_payload(x, &mut Rng::from_u64(key), &mut want);
    let xb = f32_bytes(x);
    let job = |ef: bool| {
        Job::new("encode")
            .arg("codec", codec)
            .arg("count", n)
            .arg("k", k)
            .arg("samplings", samplings)
            .arg("key", key)
            .arg("ef", ef as u8)
            .input("x", &xb)
            .output("payload")
    };
    let got = job(false).run(d);
    assert!(got["payload"] == want, "{what}: encoded payload differs");

    let base: Vec<f32> = (0..n).map(|i| (i % 5) as f32 - 2.0).collect();
    let bb = f32_bytes(&base);
    let decode = |payload: &[u8], add: bool| {
        Job::new("decode")
            .arg("count", n)
            .arg("k", k)
            .arg("add", add as u8)
            .input("payload", payload)
            .input("acc", &bb)
            .output("bad")
            .output("out")
            .run(d)
    };
    for add in [true, false] {
        let mut out = if add { base.clone() } else { vec![0.0; n] };
        c.decode_payload(&want, &mut out, add).unwrap();
        let got = decode(&want, add);
        assert_eq!(got["bad"], [0; 4], "{what}: valid payload refused");
        assert!(
            canon(&bytes_f32(&got["out"])) == canon(&out),
            "{what}: decode (add {add}) differs"
        );
    }
    if k > 0 {
        // An index out of range, then (k >= 2) a repeated one.
        let mut bad = want.clone();
        bad[4 * (k - 1)..4 * k].copy_from_slice(&(n as u32).to_le_bytes());
        let got = decode(&bad, true);
        assert_eq!(got["bad"], 1i32.to_le_bytes(), "{what}: bad index accepted");
        assert!(got["out"] == bb, "{what}: refused decode wrote");
        if k >= 2 {
            let mut bad = want.clone();
            bad.copy_within(0..4, 4);
            let got = decode(&bad, true);
            assert_eq!(
                got["bad"],
                1i32.to_le_bytes(),
                "{what}: repeated index accepted"
            );
        }
    }

    // Error feedback, as the Rust wrapper: w = x + res, encode w, res = 0 + w, then res -= the
    // values sent.
    let res: Vec<f32> = data(0, n, key ^ 5).iter().map(|v| v * 0.1).collect();
    let w: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
    let mut want = vec![0u8; 8 * k];
    c.encode_payload(&w, &mut Rng::from_u64(key), &mut want);
    let mut new_res: Vec<f32> = w.iter().map(|v| 0.0 + v).collect();
    let word = |at: usize| u32::from_le_bytes(want[at..at + 4].try_into().unwrap());
    for j in 0..k {
        new_res[word(4 * j) as usize] -= f32::from_bits(word(4 * k + 4 * j));
    }
    let rb = f32_bytes(&res);
    let got = job(true).input("res", &rb).output("res_out").run(d);
    assert!(got["payload"] == want, "{what}: EF payload differs");
    assert!(
        canon(&bytes_f32(&got["res_out"])) == canon(&new_res),
        "{what}: EF residual differs"
    );
}

#[test]
fn topk_kernels_match_the_codec() {
    let Some(d) = driver("sparse") else { return };
    let mut seed = 1000;
    for &n in &COUNTS {
        for density in [0.001, 0.01, 0.3, 1.0] {
            for kind in 0..3 {
                seed += 1;
                if n > 100_000 && density > 0.1 {
                    continue;
                }
                let spec = format!("topk:density={density}");
                sparse_case(&d, &spec, density, &data(kind, n, seed), seed);
            }
        }
    }
}

#[test]
fn mstopk_kernels_match_the_codec() {
    let Some(d) = driver("sparse") else { return };
    let mut seed = 2000;
    for &n in &COUNTS {
        for density in [0.001, 0.01, 0.3, 1.0] {
            for samplings in [1, 2, 5, 30] {
                // kind 2 holds non-finite values: the exact top-k fallback.
                for kind in 0..3 {
                    seed += 1;
                    if n > 100_000 && (density > 0.1 || matches!(samplings, 2 | 5)) {
                        continue;
                    }
                    let spec = format!("mstopk:density={density},samplings={samplings}");
                    sparse_case(&d, &spec, density, &data(kind, n, seed), seed);
                }
            }
        }
    }
}

#[test]
fn randk_kernels_match_the_codec() {
    let Some(d) = driver("sparse") else { return };
    let mut seed = 3000;
    for &n in &COUNTS {
        for density in [0.001, 0.01, 0.3, 1.0] {
            seed += 1;
            let spec = format!("randk:density={density}");
            sparse_case(&d, &spec, density, &data(0, n, seed), seed);
        }
    }
}
