//! The CUDA kernels (kernels/*.cu) run on the CPU through the shim, compared bit for bit with
//! qccl's Rust reductions and codecs at the counts in `shim::COUNTS`. See kernels/README.md.

mod shim;

use qccl::internal::{finish_avg, reduce3};
use qccl::{DType, ReduceOp};
use shim::{assert_same, check, driver, random, Gen, Job, COUNTS};

/// The kernels' dtype suffix (kernels/reduce.cu).
fn suffix(d: DType) -> &'static str {
    qccl::internal::kernels::dtype_suffix(d)
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
                // In place and out of place; 16-byte aligned (the kernels' vector path) and
                // one element off.
                let (inplace, offset) = (ci % 2, ci / 2 % 2);
                let got = Job::new(&entry)
                    .arg("count", n)
                    .arg("inplace", inplace)
                    .arg("offset", offset)
                    .input("a", &a)
                    .input("b", &b)
                    .output("out")
                    .run(&drv);
                let any_nan = matches!(op, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg);
                let what = format!("{entry} n={n} inplace={inplace} offset={offset}");
                check(&what, d, &got["out"], &want, any_nan);
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

// ---- the shim's fiber mode (kernels/shim/selftest.cu) ---------------------------------------

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn u32_bytes(x: &[u32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Also with the shim's portable fiber switch (swapcontext), which x86-64 builds replace with
/// their own.
#[test]
fn fibers_block_sum() {
    for define in [None, Some("QCCL_SHIM_UCONTEXT")] {
        let Some(drv) = shim::driver_with("selftest", define) else {
            return;
        };
        block_sums(&drv);
    }
}

fn block_sums(drv: &shim::Driver) {
    let mut g = Gen::new(3);
    for n in [0usize, 1, 7, 4099, 100_003] {
        for block in [32u32, 256, 1024] {
            let x: Vec<u32> = (0..n).map(|_| g.u64() as u32).collect();
            let xb = u32_bytes(&x);
            let out = Job::new("block_sum")
                .arg("block", block)
                .input("x", &xb)
                .output("out")
                .run(drv);
            let blocks = (n.div_ceil(block as usize)).clamp(1, 16);
            let stride = blocks * block as usize;
            let want: Vec<u32> = (0..blocks)
                .map(|b| {
                    (0..n)
                        .filter(|i| (i % stride) / block as usize == b)
                        .fold(0u32, |s, i| s.wrapping_add(x[i]))
                })
                .collect();
            assert_eq!(u32s(&out["out"]), want, "n {n} block {block}");
        }
    }
}

#[test]
fn fibers_votes_on_partial_warps() {
    let Some(drv) = driver("selftest") else {
        return;
    };
    let mut g = Gen::new(4);
    for n in [1usize, 7, 4099] {
        for block in [32usize, 100, 33] {
            // Mostly odd values, so that __all_sync is sometimes true.
            let x: Vec<u32> = (0..n)
                .map(|_| g.u64() as u32 | !g.u64().is_multiple_of(8) as u32)
                .collect();
            let xb = u32_bytes(&x);
            let out = Job::new("votes")
                .arg("block", block)
                .input("x", &xb)
                .output("ballot")
                .output("all")
                .output("any")
                .run(&drv);
            let warps_per_block = block.div_ceil(32);
            let (mut ballot, mut all, mut any) = (vec![], vec![], vec![]);
            for b in 0..n.div_ceil(block) {
                for w in 0..warps_per_block {
                    let lanes = (block - 32 * w).min(32);
                    let mut bits = 0u32;
                    for l in 0..lanes {
                        let i = b * block + 32 * w + l;
                        if i < n && x[i] & 1 == 1 {
                            bits |= 1 << l;
                        }
                    }
                    let mask = if lanes == 32 { !0 } else { (1u32 << lanes) - 1 };
                    ballot.push(bits);
                    all.push((bits == mask) as u32);
                    any.push((bits != 0) as u32);
                }
            }
            assert_eq!(u32s(&out["ballot"]), ballot, "n {n} block {block}");
            assert_eq!(u32s(&out["all"]), all, "n {n} block {block}");
            assert_eq!(u32s(&out["any"]), any, "n {n} block {block}");
        }
    }
}

#[test]
fn fibers_segmented_scan() {
    let Some(drv) = driver("selftest") else {
        return;
    };
    let mut g = Gen::new(5);
    for n in [0usize, 1, 7, 4099] {
        for width in [1u32, 8, 32] {
            let x: Vec<u32> = (0..n).map(|_| g.u64() as u32).collect();
            let xb = u32_bytes(&x);
            let out = Job::new("scan")
                .arg("width", width)
                .input("x", &xb)
                .output("out")
                .run(&drv);
            let w = width as usize;
            let want: Vec<u32> = (0..n)
                .map(|i| (i - i % w..=i).fold(0u32, |s, j| s.wrapping_add(x[j])))
                .collect();
            assert_eq!(u32s(&out["out"]), want, "n {n} width {width}");
        }
    }
}

#[test]
fn atomics_in_both_modes() {
    let Some(drv) = driver("selftest") else {
        return;
    };
    let mut g = Gen::new(6);
    for n in [0usize, 1, 7, 4099] {
        let x: Vec<u32> = (0..n).map(|_| g.u64() as u32).collect();
        let xb = u32_bytes(&x);
        for fibers in [0, 1] {
            let out = Job::new("atomics")
                .arg("fibers", fibers)
                .input("x", &xb)
                .output("acc")
                .output("facc")
                .run(&drv);
            let want = vec![
                x.iter().fold(0u32, |s, &v| s.wrapping_add(v)),
                x.iter().copied().max().unwrap_or(0),
                x.iter().copied().min().unwrap_or(u32::MAX),
                x.iter().fold(0, |s, &v| s | v),
            ];
            assert_eq!(u32s(&out["acc"]), want, "n {n} fibers {fibers}");
            // Sums of small integers are exact in f32 in any order.
            let fsum: u32 = x.iter().map(|v| v & 255).sum();
            let got = f32::from_le_bytes(out["facc"][..4].try_into().unwrap());
            assert_eq!(got, fsum as f32, "n {n} fibers {fibers}");
        }
    }
}

#[test]
fn shared_memory_per_block() {
    let Some(drv) = driver("selftest") else {
        return;
    };
    for (blocks, block) in [(1u32, 1u32), (3, 64), (5, 1024)] {
        let out = Job::new("shared")
            .arg("blocks", blocks)
            .arg("block", block)
            .output("out")
            .run(&drv);
        let want: Vec<u32> = (0..blocks)
            .flat_map(|b| (0..block).map(move |t| b * 1000 + (t + 1) % block))
            .collect();
        assert_eq!(u32s(&out["out"]), want, "{blocks} blocks of {block}");
    }
}

#[test]
fn shim_refuses_misuse() {
    let Some(drv) = driver("selftest") else {
        return;
    };
    let err = Job::new("bad_barrier").run_failing(&drv);
    assert!(err.contains("deadlock"), "{err}");
    let err = Job::new("bad_mask").run_failing(&drv);
    assert!(err.contains("with mask"), "{err}");
    let err = Job::new("sync_in_sequential").run_failing(&drv);
    assert!(err.contains("needs fiber mode"), "{err}");
}

// ---- codecs ----------------------------------------------------------------------------------

/// Checks a codec's kernels against its Rust payload functions: `qccl_<name>_encode` gives
/// `encode_payload`'s bytes, `qccl_<name>_decode` and `_decode_add` give `decode_payload`'s
/// f32s (a NaN matching any NaN after an add), at each of `counts`. `args` go to every job
/// (e.g. the bucket).
fn check_codec(
    driver_name: &str,
    name: &str,
    spec: &str,
    args: &[(&str, u64)],
    counts: &[usize],
    seed: u64,
) {
    let Some(drv) = driver(driver_name) else {
        return;
    };
    let codec = qccl::CodecSpec::parse(spec).unwrap().codec().clone();
    let mut g = Gen::new(seed);
    for &n in counts {
        for finite in [false, true] {
            let x = g.f32s(n, finite);
            let mut want = vec![0u8; codec.payload_len(n)];
            codec.encode_payload(&x, &mut qccl::codec::Rng::from_u64(seed), &mut want);
            let xb = shim::f32_bytes(&x);
            let job = |entry: String| {
                args.iter()
                    .fold(Job::new(&entry), |j, (k, v)| j.arg(k, v))
                    .arg("count", n)
            };
            let what = format!("{spec} n={n} finite={finite}");
            let got = job(format!("qccl_{name}_encode"))
                .input("x", &xb)
                .output("payload")
                .run(&drv);
            assert_same(&format!("{what}: encode"), &got["payload"], &want, 1);

            let acc = g.f32s(n, finite);
            let accb = shim::f32_bytes(&acc);
            for add in [false, true] {
                let mut out = acc.clone();
                codec.decode_payload(&want, &mut out, add).unwrap();
                let entry = format!("qccl_{name}_{}", if add { "decode_add" } else { "decode" });
                let got = job(entry.clone())
                    .input("payload", &want)
                    .input("acc", &accb)
                    .output("out")
                    .run(&drv);
                check(
                    &format!("{what}: {entry}"),
                    DType::Float32,
                    &got["out"],
                    &shim::f32_bytes(&out),
                    add,
                );
            }
        }
    }
}

/// Checks an encode with fused error feedback (`entry`, given x and res) against the CPU's
/// steps: w = x + res, payload = encode_payload(w), res = (0 + w) - decode_payload(payload).
fn check_codec_ef(
    driver_name: &str,
    entry: &str,
    spec: &str,
    args: &[(&str, u64)],
    counts: &[usize],
    seed: u64,
) {
    let Some(drv) = driver(driver_name) else {
        return;
    };
    let codec = qccl::CodecSpec::parse(spec).unwrap().codec().clone();
    let mut g = Gen::new(seed);
    for &n in counts {
        for finite in [false, true] {
            let x = g.f32s(n, finite);
            let res: Vec<f32> = g.f32s(n, finite).iter().map(|r| r * 0.25).collect();
            let w: Vec<f32> = x.iter().zip(&res).map(|(x, r)| x + r).collect();
            let mut payload = vec![0u8; codec.payload_len(n)];
            codec.encode_payload(&w, &mut qccl::codec::Rng::from_u64(seed), &mut payload);
            let mut d = vec![0f32; n];
            codec.decode_payload(&payload, &mut d, false).unwrap();
            let res_want: Vec<f32> = w.iter().zip(&d).map(|(w, d)| (0.0 + w) - d).collect();
            let (xb, rb) = (shim::f32_bytes(&x), shim::f32_bytes(&res));
            let got = args
                .iter()
                .fold(Job::new(entry), |j, (k, v)| j.arg(k, v))
                .arg("count", n)
                .input("x", &xb)
                .input("res", &rb)
                .output("payload")
                .output("res_out")
                .output("w_out")
                .run(&drv);
            let what = format!("{entry} {spec} n={n} finite={finite}");
            assert_same(&format!("{what}: payload"), &got["payload"], &payload, 1);
            let f = DType::Float32;
            check(
                &format!("{what}: w"),
                f,
                &got["w_out"],
                &shim::f32_bytes(&w),
                true,
            );
            check(
                &format!("{what}: res"),
                f,
                &got["res_out"],
                &shim::f32_bytes(&res_want),
                true,
            );
        }
    }
}

/// The float codecs, with 16-byte aligned buffers (the kernels' vector path) and one element
/// off (their per-element path).
fn check_float_codec(name: &str, seed: u64) {
    for offset in [0, 1] {
        let args = [("offset", offset)];
        check_codec("floats", name, name, &args, &COUNTS, seed + offset);
        if name != "none" {
            let entry = format!("qccl_{name}_encode_ef");
            check_codec_ef("floats", &entry, name, &args, &COUNTS, seed + 100 + offset);
        }
    }
}

#[test]
fn none_codec_matches_rust() {
    check_float_codec("none", 10);
}

#[test]
fn fp16_codec_matches_rust() {
    check_float_codec("fp16", 12);
}

#[test]
fn bf16_codec_matches_rust() {
    check_float_codec("bf16", 14);
}

/// The f16/bf16 conversions on every 16-bit pattern, and on every rounding edge: each value
/// widened, the midpoints between neighbours (ties) and one f32 ulp either side of them.
#[test]
fn half_conversions_every_pattern_and_tie() {
    let Some(drv) = driver("floats") else { return };
    for (name, brain) in [("fp16", false), ("bf16", true)] {
        let widen = |h: u16| {
            if brain {
                half::bf16::from_bits(h).to_f32()
            } else {
                half::f16::from_bits(h).to_f32()
            }
        };
        let mut x = Vec::new();
        for h in 0..=u16::MAX {
            let (a, b) = (widen(h), widen(h.wrapping_add(1)));
            x.push(a);
            if a.is_finite() && b.is_finite() && (h & 0x7fff) != 0x7fff {
                let mid = ((a as f64 + b as f64) / 2.0) as f32; // exact: f16/bf16 midpoints fit f32
                x.extend([
                    mid,
                    f32::from_bits(mid.to_bits() - 1),
                    f32::from_bits(mid.to_bits() + 1),
                ]);
            }
        }
        x.extend([
            f32::MAX,
            f32::MIN,
            65520.0,
            -65520.0,
            65519.996,
            1e-45,
            -1e-45,
            2.9802322e-8,
        ]);
        let codec = qccl::CodecSpec::parse(name).unwrap().codec().clone();
        let mut want = vec![0u8; codec.payload_len(x.len())];
        codec.encode_payload(&x, &mut qccl::codec::Rng::from_u64(0), &mut want);
        let xb = shim::f32_bytes(&x);
        let got = Job::new(&format!("qccl_{name}_encode"))
            .arg("count", x.len())
            .arg("offset", 0)
            .input("x", &xb)
            .output("payload")
            .run(&drv);
        assert_same(
            &format!("{name}: encode of the edges"),
            &got["payload"],
            &want,
            2,
        );

        let all: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let mut out = vec![0f32; 1 << 16];
        codec.decode_payload(&all, &mut out, false).unwrap();
        let zeros = vec![0u8; 4 << 16];
        let got = Job::new(&format!("qccl_{name}_decode"))
            .arg("count", 1 << 16)
            .arg("offset", 0)
            .input("payload", &all)
            .input("acc", &zeros)
            .output("out")
            .run(&drv);
        assert_same(
            &format!("{name}: decode of every pattern"),
            &got["out"],
            &shim::f32_bytes(&out),
            4,
        );
    }
}

#[test]
fn efsign_matches_rust() {
    // grid 0: a block per 32 tiles; 3: a capped grid, so the tile loop strides.
    for grid in [0, 3] {
        let args = [("grid", grid), ("ef", 0)];
        check_codec("sign", "efsign", "efsign", &args, &COUNTS, 20 + grid);
        let args = [("grid", grid), ("ef", 1)];
        check_codec_ef(
            "sign",
            "qccl_efsign_encode",
            "efsign",
            &args,
            &COUNTS,
            30 + grid,
        );
    }
}

#[test]
fn onebit_matches_rust() {
    // Buckets that divide the 2048-element tile, equal it, straddle it or hold many tiles.
    // The fiber-mode fold costs the shim a context switch per lane and segment, so most
    // buckets stop at 4099 elements, and only the default one runs the capped grid (which
    // strides over tiles from 196 608 elements) at the large count.
    for (bucket, big) in [
        (512u64, true),
        (3000, true),
        (1 << 24, true),
        (2048, false),
        (1, false),
        (7, false),
        (100, false),
        (4096, false),
    ] {
        let spec = format!("onebit:bucket={bucket}");
        for grid in [0, 3] {
            let counts: &[usize] = if big && (grid == 0 || bucket == 512) {
                &COUNTS
            } else {
                &COUNTS[..4]
            };
            let args = [("bucket", bucket), ("grid", grid), ("ef", 0)];
            check_codec("sign", "onebit", &spec, &args, counts, bucket + grid);
            let args = [("bucket", bucket), ("grid", grid), ("ef", 1)];
            check_codec_ef(
                "sign",
                "qccl_onebit_encode",
                &spec,
                &args,
                counts,
                bucket + grid,
            );
        }
    }
}
