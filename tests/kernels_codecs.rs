//! The codec kernels (kernels/qsgd.cu, topk.cu, mstopk.cu, randk.cu, sparse.cu) run on the CPU
//! through the shim (kernels/shim/), compared bit for bit with the Rust codecs: payloads,
//! decoded outputs and error-feedback residuals, over awkward counts (0, 1, 7, 4099, 1000003),
//! every bit width, both scales and roundings, ties, signed zeros and non-finite values.
//!
//! Needs g++; without it the test prints why and passes, unless QCCL_REQUIRE_SHIM=1 (CI).

use qccl::codec::Rng;
use qccl::internal::k_of;
use qccl::CodecSpec;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The harness binary, built once per test process; None (with the reason printed) if g++ is
/// missing and the shim is not required.
fn harness() -> Option<&'static Path> {
    static BIN: OnceLock<Option<PathBuf>> = OnceLock::new();
    BIN.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernels_codecs_harness");
        let gxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
        if Command::new(&gxx).arg("--version").output().is_err() {
            let why = format!("{gxx} not found: the codec kernels' shim tests cannot run");
            assert!(
                std::env::var("QCCL_REQUIRE_SHIM").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("skipped: {why}");
            return None;
        }
        let st = Command::new(&gxx)
            .args(["-O2", "-std=c++17", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(root.join("kernels"))
            .arg("-I")
            .arg(root.join("kernels/shim"))
            .arg(root.join("kernels/shim/codecs.cpp"))
            .arg("-o")
            .arg(&out)
            .status()
            .expect("run g++");
        assert!(
            st.success(),
            "g++ failed to build the codec kernels' harness"
        );
        Some(out)
    })
    .as_deref()
}

/// Runs `op` with `req` on stdin; returns stdout.
fn run(bin: &Path, op: &str, req: &[u8]) -> Vec<u8> {
    let mut child = Command::new(bin)
        .arg(op)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start harness");
    let mut stdin = child.stdin.take().unwrap();
    let req = req.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&req));
    let out = child.wait_with_output().expect("harness output");
    writer.join().unwrap().expect("write request");
    assert!(
        out.status.success(),
        "harness {op} failed: {:?}",
        out.status
    );
    out.stdout
}

/// A little-endian request builder.
#[derive(Default, Clone)]
struct Req(Vec<u8>);

impl Req {
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn f32s(mut self, v: &[f32]) -> Self {
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

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

const COUNTS: [usize; 5] = [0, 1, 7, 4099, 1_000_003];

fn qsgd_spec(bits: u32, bucket: u32, maxabs: bool, nearest: bool) -> String {
    format!(
        "qsgd:bits={bits},bucket={bucket},scale={},rounding={}",
        if maxabs { "maxabs" } else { "maxmin" },
        if nearest { "nearest" } else { "stochastic" }
    )
}

/// One qsgd case: encode (plain and with error feedback) and decode-add, against the codec.
#[allow(clippy::too_many_arguments)]
fn qsgd_case(bin: &Path, bits: u32, bucket: u32, maxabs: bool, nearest: bool, x: &[f32], key: u64) {
    let spec = qsgd_spec(bits, bucket, maxabs, nearest);
    let c = CodecSpec::parse(&spec).unwrap().codec().clone();
    let n = x.len();
    let what = format!("{spec} n={n}");
    let mut want = vec![0u8; c.payload_len(n)];
    c.encode_payload(x, &mut Rng::from_u64(key), &mut want);
    let head = Req::default()
        .u64(n as u64)
        .u32(bits)
        .u32(bucket)
        .u32(maxabs as u32)
        .u32(nearest as u32)
        .u64(key);
    let got = run(bin, "qsgd_encode", &head.clone().u32(0).f32s(x).0);
    assert!(got == want, "{what}: encoded payload differs");

    // decode-add onto a base, and the decoder's rejection of a bad scale.
    let base: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.25 - 1.0).collect();
    let mut acc = base.clone();
    c.decode_payload(&want, &mut acc, true).unwrap();
    let req = |payload: &[u8], add: u32| {
        Req::default()
            .u64(n as u64)
            .u32(bits)
            .u32(bucket)
            .u32(maxabs as u32)
            .u32(add)
            .bytes(payload)
            .f32s(&base)
            .0
    };
    let got = run(bin, "qsgd_decode", &req(&want, 1));
    assert_eq!(&got[..4], &[0; 4], "{what}: valid payload refused");
    assert!(
        canon(&f32s(&got[4..])) == canon(&acc),
        "{what}: decode-add differs"
    );
    let mut into = vec![0.0; n];
    c.decode_payload(&want, &mut into, false).unwrap();
    let got = run(bin, "qsgd_decode", &req(&want, 0));
    assert!(
        canon(&f32s(&got[4..])) == canon(&into),
        "{what}: decode differs"
    );
    if n > 0 {
        let mut bad = want.clone();
        // hi = -inf (maxmin) or m = -1 (maxabs): both invalid.
        let at = if maxabs { 0 } else { 4 };
        let v = if maxabs { -1.0f32 } else { f32::NEG_INFINITY };
        bad[at..at + 4].copy_from_slice(&v.to_le_bytes());
        assert!(c.decode_payload(&bad, &mut acc.clone(), true).is_err());
        let got = run(bin, "qsgd_decode", &req(&bad, 1));
        assert_eq!(&got[..4], &1i32.to_le_bytes(), "{what}: bad scale accepted");
        assert!(f32s(&got[4..]) == base, "{what}: refused decode wrote");
    }

    // Error feedback: w = x + res, encode w, res = (0 + w) - decode(w).
    let res: Vec<f32> = data(0, n, key ^ 77).iter().map(|v| v * 0.01).collect();
    let w: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
    let mut want = vec![0u8; c.payload_len(n)];
    c.encode_payload(&w, &mut Rng::from_u64(key), &mut want);
    let mut dec = vec![0.0; n];
    c.decode_payload(&want, &mut dec, false).unwrap();
    let new_res: Vec<f32> = w.iter().zip(&dec).map(|(w, d)| (0.0 + w) - d).collect();
    let got = run(bin, "qsgd_encode", &head.u32(1).f32s(x).f32s(&res).0);
    let len = want.len();
    assert!(got[..len] == want[..], "{what}: EF payload differs");
    let (r, wo) = got[len..].split_at(4 * n);
    assert!(
        canon(&f32s(r)) == canon(&new_res),
        "{what}: EF residual differs"
    );
    assert!(
        canon(&f32s(wo)) == canon(&w),
        "{what}: EF compensated input differs"
    );
}

#[test]
fn qsgd_kernels_match_the_codec() {
    let Some(bin) = harness() else { return };
    let mut seed = 1;
    for &n in &COUNTS {
        for bits in 1..=8 {
            for maxabs in [false, true] {
                for nearest in [true, false] {
                    // The large count at a few widths only (debug-build time).
                    if n > 100_000 && ![1, 3, 4, 8].contains(&bits) {
                        continue;
                    }
                    let buckets: &[u32] = if n > 100_000 {
                        &[128, 1000]
                    } else {
                        &[1, 7, 128]
                    };
                    for &bucket in buckets {
                        seed += 1;
                        let kind = (seed % 3) as u32;
                        let x = data(kind, n, seed);
                        qsgd_case(bin, bits, bucket, maxabs, nearest, &x, seed * 0x1234_5678);
                    }
                }
            }
        }
    }
}

#[test]
fn qsgd_kernels_handle_zero_signs_and_constant_buckets() {
    let Some(bin) = harness() else { return };
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
    for bucket in [1, 3, 8, 9, 16, 100] {
        for bits in [1, 2, 5, 8] {
            for maxabs in [false, true] {
                for nearest in [true, false] {
                    qsgd_case(bin, bits, bucket, maxabs, nearest, &x, 99);
                }
            }
        }
    }
}

/// One sparse case: encode (plain and EF) and decode-add against the codec.
fn sparse_case(bin: &Path, spec: &str, x: &[f32], key: u64) {
    let c = CodecSpec::parse(spec).unwrap().codec().clone();
    let n = x.len();
    let what = format!("{spec} n={n}");
    let (codec, samplings) = match spec.split(':').next().unwrap() {
        "topk" => (0, 0),
        "mstopk" => (
            1,
            spec.split("samplings=")
                .nth(1)
                .map_or(30, |s| s.parse().unwrap()),
        ),
        _ => (2, 0),
    };
    let density: f64 = spec
        .split("density=")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let k = k_of(density, n);
    assert_eq!(c.payload_len(n), 8 * k);
    let mut want = vec![0u8; 8 * k];
    c.encode_payload(x, &mut Rng::from_u64(key), &mut want);
    let head = Req::default()
        .u32(codec)
        .u64(n as u64)
        .u64(k as u64)
        .u32(samplings)
        .u64(key);
    let got = run(bin, "sparse_encode", &head.clone().u32(0).f32s(x).0);
    assert!(got == want, "{what}: encoded payload differs");

    let base: Vec<f32> = (0..n).map(|i| (i % 5) as f32 - 2.0).collect();
    let mut acc = base.clone();
    c.decode_payload(&want, &mut acc, true).unwrap();
    let req = |payload: &[u8], add: u32| {
        Req::default()
            .u64(n as u64)
            .u64(k as u64)
            .u32(add)
            .bytes(payload)
            .f32s(&base)
            .0
    };
    let got = run(bin, "sparse_decode", &req(&want, 1));
    assert_eq!(&got[..4], &[0; 4], "{what}: valid payload refused");
    assert!(
        canon(&f32s(&got[4..])) == canon(&acc),
        "{what}: decode-add differs"
    );
    let mut into = vec![0.0; n];
    c.decode_payload(&want, &mut into, false).unwrap();
    let got = run(bin, "sparse_decode", &req(&want, 0));
    assert!(
        canon(&f32s(&got[4..])) == canon(&into),
        "{what}: decode differs"
    );
    if k > 0 {
        // An index out of range, then (k >= 2) a repeated one.
        let mut bad = want.clone();
        bad[4 * (k - 1)..4 * k].copy_from_slice(&(n as u32).to_le_bytes());
        let got = run(bin, "sparse_decode", &req(&bad, 1));
        assert_eq!(&got[..4], &1i32.to_le_bytes(), "{what}: bad index accepted");
        assert!(f32s(&got[4..]) == base, "{what}: refused decode wrote");
        if k >= 2 {
            let mut bad = want.clone();
            let first: [u8; 4] = bad[..4].try_into().unwrap();
            bad[4..8].copy_from_slice(&first);
            let got = run(bin, "sparse_decode", &req(&bad, 1));
            assert_eq!(
                &got[..4],
                &1i32.to_le_bytes(),
                "{what}: repeated index accepted"
            );
        }
    }

    // Error feedback: w = x + res, encode w, res = (0 + w), then res -= the sent values.
    let res: Vec<f32> = data(0, n, key ^ 5).iter().map(|v| v * 0.1).collect();
    let w: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
    let mut want = vec![0u8; 8 * k];
    c.encode_payload(&w, &mut Rng::from_u64(key), &mut want);
    let mut new_res: Vec<f32> = w.iter().map(|v| 0.0 + v).collect();
    for j in 0..k {
        let i = u32::from_le_bytes(want[4 * j..4 * j + 4].try_into().unwrap()) as usize;
        new_res[i] -=
            f32::from_le_bytes(want[4 * k + 4 * j..4 * k + 4 * j + 4].try_into().unwrap());
    }
    let got = run(bin, "sparse_encode", &head.u32(1).f32s(x).f32s(&res).0);
    assert!(got[..8 * k] == want[..], "{what}: EF payload differs");
    assert!(
        canon(&f32s(&got[8 * k..])) == canon(&new_res),
        "{what}: EF residual differs"
    );
}

#[test]
fn topk_kernels_match_the_codec() {
    let Some(bin) = harness() else { return };
    let mut seed = 1000;
    for &n in &COUNTS {
        for d in [0.001, 0.01, 0.3, 1.0] {
            for kind in 0..3 {
                seed += 1;
                if n > 100_000 && d > 0.1 {
                    continue;
                }
                sparse_case(
                    bin,
                    &format!("topk:density={d}"),
                    &data(kind, n, seed),
                    seed,
                );
            }
        }
    }
}

#[test]
fn mstopk_kernels_match_the_codec() {
    let Some(bin) = harness() else { return };
    let mut seed = 2000;
    for &n in &COUNTS {
        for d in [0.001, 0.01, 0.3, 1.0] {
            for samplings in [1, 2, 30] {
                for kind in 0..3 {
                    seed += 1;
                    if n > 100_000 && (d > 0.1 || samplings == 2) {
                        continue;
                    }
                    let spec = format!("mstopk:density={d},samplings={samplings}");
                    sparse_case(bin, &spec, &data(kind, n, seed), seed);
                }
            }
        }
    }
}

#[test]
fn randk_kernels_match_the_codec() {
    let Some(bin) = harness() else { return };
    let mut seed = 3000;
    for &n in &COUNTS {
        for d in [0.001, 0.01, 0.3, 1.0] {
            seed += 1;
            sparse_case(bin, &format!("randk:density={d}"), &data(0, n, seed), seed);
        }
    }
}
