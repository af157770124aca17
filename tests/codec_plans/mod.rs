//! Codec launch plans (`qccl::gpu::plans`) against the Rust codecs, bit for bit, on any
//! driver: tests/kernels_emulated.rs runs these cases on the emulated driver,
//! tests/gpu_driver.rs on a GPU.

#![allow(dead_code)]

use crate::shim::{self, check, Gen};
use qccl::codec::Codec;
use qccl::gpu::driver::{DeviceMem, Driver, Stream};
use qccl::{CodecSpec, DType};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

/// Device memory holding `data` (at least 1 byte allocated).
fn upload(d: &dyn Driver, s: &dyn Stream, data: &[u8]) -> Box<dyn DeviceMem> {
    let mem = d.alloc_device(s.ordinal(), data.len().max(1)).unwrap();
    // SAFETY: `data` outlives the copy: synchronised below.
    unsafe { s.copy_to_device(mem.addr(), data.as_ptr(), data.len()) }.unwrap();
    s.synchronize(WAIT).unwrap();
    mem
}

fn download(s: &dyn Stream, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` outlives the copy: synchronised below.
    unsafe { s.copy_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
    s.synchronize(WAIT).unwrap();
    out
}

/// Test values for the codec plans: kind 0 finite (signed zeros included), 1 with NaN,
/// infinities and subnormals mixed in, 2 a few distinct values (ties, signed zeros, constant
/// runs).
pub fn plan_input(g: &mut Gen, kind: usize, n: usize) -> Vec<f32> {
    match kind {
        0 | 1 => g.f32s(n, kind == 0),
        _ => (0..n)
            .map(|_| [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 0.25][(g.u64() % 7) as usize])
            .collect(),
    }
}

/// One case of a codec's launch plan (through `plan_for`) against the Rust codec, on the
/// driver's device memory: the payload (every byte written over a filled buffer), decode and
/// decode_add with `bad` left 0, the `bad` flag on the payload `corrupt` spoils (which the Rust
/// decoder refuses), and encode_ef's payload, residual and w. `offset`: the f32 buffers start
/// one element and the payload one byte into their allocations (off the vector paths).
pub fn plan_case(
    d: &dyn Driver,
    s: &dyn Stream,
    codec: &dyn Codec,
    x: &[f32],
    key: u64,
    offset: bool,
    corrupt: &dyn Fn(&mut [u8]),
) {
    use qccl::codec::Rng;
    use qccl::gpu::plans::plan_for;
    let plan = plan_for(d, 0, codec).unwrap();
    assert_eq!(plan.codec(), codec.id());
    let n = x.len();
    let what = format!("{} n={n} offset={offset}", codec.spec());
    let mut want = vec![0u8; codec.payload_len(n)];
    codec.encode_payload(x, &mut Rng::from_u64(key), &mut want);
    assert_eq!(plan.payload_len(n), want.len(), "{what}: payload_len");

    let off = offset as usize;
    let f32_buf = |v: &[f32]| {
        upload(
            d,
            s,
            &[&vec![0u8; 4 * off][..], &shim::f32_bytes(v)].concat(),
        )
    };
    let at = |m: &dyn DeviceMem| m.addr() + 4 * off as u64;
    let scratch_mem = d.alloc_device(0, plan.scratch_len(n).max(1)).unwrap();
    let scratch = if plan.scratch_len(n) > 0 {
        scratch_mem.addr()
    } else {
        0
    };
    let dx = f32_buf(x);
    let payload = upload(d, s, &vec![0xa5; want.len() + off]);
    let p_at = payload.addr() + off as u64;
    // SAFETY: n f32s at at(dx), payload_len(n) bytes at p_at and scratch_len(n) at scratch,
    // device memory kept until the download synchronises (as every call below).
    unsafe { plan.encode(s, at(&*dx), p_at, n, key, scratch) }.unwrap();
    shim::assert_same(
        &format!("{what}: encode"),
        &download(s, p_at, want.len()),
        &want,
        1,
    );

    let flag = |bad: &[u8]| upload(d, s, bad);
    let acc = plan_input(&mut Gen::new(key), 0, n);
    for add in [false, true] {
        let mut out = acc.clone();
        codec.decode_payload(&want, &mut out, add).unwrap();
        let dacc = f32_buf(&acc);
        let bad = flag(&[0; 4]);
        // SAFETY: as above; n f32s at at(dacc), 4 bytes at bad.
        unsafe { plan.decode(s, p_at, at(&*dacc), n, add, bad.addr(), scratch) }.unwrap();
        let got = download(s, at(&*dacc), 4 * n);
        let f32s = shim::f32_bytes(&out);
        check(
            &format!("{what}: decode add={add}"),
            DType::Float32,
            &got,
            &f32s,
            true,
        );
        assert_eq!(
            download(s, bad.addr(), 4),
            [0; 4],
            "{what}: valid payload refused"
        );
    }
    let mut spoilt = want.clone();
    corrupt(&mut spoilt);
    if spoilt != want {
        assert!(
            codec
                .decode_payload(&spoilt, &mut acc.clone(), true)
                .is_err(),
            "{what}: the Rust decoder takes the spoilt payload"
        );
        let dp = upload(d, s, &spoilt);
        let dacc = f32_buf(&acc);
        let bad = flag(&[0; 4]);
        // SAFETY: as above.
        unsafe { plan.decode(s, dp.addr(), at(&*dacc), n, true, bad.addr(), scratch) }.unwrap();
        let got = i32::from_le_bytes(download(s, bad.addr(), 4).try_into().unwrap());
        assert_ne!(got, 0, "{what}: spoilt payload accepted");
    }

    // Error feedback: the CPU's compensate, encode, record.
    let res = plan_input(&mut Gen::new(key ^ 5), 0, n);
    let mut w = x.to_vec();
    let mut res_want = res.clone();
    qccl::internal::ef_compensate(&mut w, &mut res_want);
    let mut want_ef = vec![0u8; want.len()];
    codec.encode_payload(&w, &mut Rng::from_u64(key), &mut want_ef);
    let mut decoded = vec![0f32; n];
    codec.decode_payload(&want_ef, &mut decoded, false).unwrap();
    qccl::internal::ef_record(&mut res_want, &w, &decoded);
    let dres = f32_buf(&res);
    let dw = f32_buf(&vec![0.0; n]);
    let payload = upload(d, s, &vec![0xa5; want.len() + off]);
    let p_at = payload.addr() + off as u64;
    // SAFETY: as above; n f32s at at(dres) and at(dw).
    unsafe { plan.encode_ef(s, at(&*dx), at(&*dres), at(&*dw), p_at, n, key, scratch) }.unwrap();
    let got = download(s, p_at, want.len());
    shim::assert_same(&format!("{what}: encode_ef"), &got, &want_ef, 1);
    let got = download(s, at(&*dres), 4 * n);
    let f32s = shim::f32_bytes(&res_want);
    check(
        &format!("{what}: encode_ef residual"),
        DType::Float32,
        &got,
        &f32s,
        true,
    );
    let got = download(s, at(&*dw), 4 * n);
    let f32s = shim::f32_bytes(&w);
    check(
        &format!("{what}: encode_ef w"),
        DType::Float32,
        &got,
        &f32s,
        true,
    );
}

/// Stores f32 `v` at byte `at` of a payload.
fn put_f32(p: &mut [u8], at: usize, v: f32) {
    if p.len() >= at + 4 {
        p[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// qsgd's launch plan (`gpu::plans::QsgdPlan`) against the Rust codec: every bit width, both
/// scales and roundings, buckets of 1, 7, 128 and over QSGD_RUN (the scale-by-runs path), a
/// few counts each, a bucket whose signed zeros come in a later run than its positives, and
/// the large count once.
pub fn qsgd_cases(d: &dyn Driver) {
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(14);
    let spec = |bits: u32, bucket: u32, maxabs: bool, nearest: bool| {
        let scale = if maxabs { "maxabs" } else { "maxmin" };
        let rounding = if nearest { "nearest" } else { "stochastic" };
        let spec = format!("qsgd:bits={bits},bucket={bucket},scale={scale},rounding={rounding}");
        CodecSpec::parse(&spec).unwrap().codec().clone()
    };
    // hi = -inf (maxmin) or m = -1 (maxabs) in the last bucket: both refused.
    let corrupt = |maxabs: bool, n: usize, bucket: u32| {
        move |p: &mut [u8]| {
            let last = n.div_ceil(bucket as usize).saturating_sub(1);
            if maxabs {
                put_f32(p, 4 * last, -1.0)
            } else {
                put_f32(p, 8 * last + 4, f32::NEG_INFINITY)
            }
        }
    };
    let buckets = [1u32, 7, 128, 5000];
    let mut case = 0usize;
    for bits in 1..=8u32 {
        for maxabs in [false, true] {
            for nearest in [false, true] {
                let i = (bits as usize) + 2 * maxabs as usize + nearest as usize;
                // Three counts (one of 0, 1, 7; a prime; one past a whole block) and three of the
                // four buckets, rotating with i so each width meets every pair.
                for (n, bucket) in [
                    ([0, 1, 7][i % 3], buckets[i % 4]),
                    (263, buckets[(i + 1) % 4]),
                    (4099, buckets[(i + 2) % 4]),
                ] {
                    case += 1;
                    let c = spec(bits, bucket, maxabs, nearest);
                    // Every count meets every kind of input over the widths.
                    let x = plan_input(&mut g, (case + i) % 3, n);
                    let key = g.u64();
                    plan_case(
                        d,
                        &*s,
                        &*c,
                        &x,
                        key,
                        case % 2 == 1,
                        &corrupt(maxabs, n, bucket),
                    );
                }
            }
        }
    }
    // A large bucket scanned in two runs: the zeros (and their first signs) come after the
    // positives, so the merge order decides the scale's sign.
    let y: Vec<f32> = (0..9100)
        .map(|i| match i {
            0..4096 => 1.0,
            _ if i % 5 == 0 || i % 7 == 3 => -0.0,
            _ => 0.0,
        })
        .collect();
    for maxabs in [false, true] {
        let c = spec(3, 9100, maxabs, false);
        plan_case(d, &*s, &*c, &y, 7, maxabs, &corrupt(maxabs, y.len(), 9100));
    }
    // The large count, by runs (buckets of 2^16).
    let n = 1_000_003;
    let x = plan_input(&mut g, 0, n);
    let c = spec(4, 1 << 16, false, false);
    plan_case(d, &*s, &*c, &x, 99, false, &corrupt(false, n, 1 << 16));
}

/// efsign's and onebit's launch plan (`gpu::plans::SignPlan`) against the Rust codec: counts
/// 0, 1, 7 and 4099 (efsign also the large count), onebit buckets that divide the 2048-element
/// tile, equal it, straddle it or hold many tiles; refused scales: negative, infinite, a NaN
/// beside a number.
pub fn sign_cases(d: &dyn Driver) {
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(15);
    let efsign = CodecSpec::parse("efsign").unwrap().codec().clone();
    for (case, n) in [0, 1, 7, 4099, 1_000_003].into_iter().enumerate() {
        let x = plan_input(&mut g, case % 3, n);
        let bad = [-1.0, f32::INFINITY][case % 2];
        plan_case(d, &*s, &*efsign, &x, 1, case % 2 == 1, &|p| {
            put_f32(p, 0, bad)
        });
    }
    let mut case = 0usize;
    for bucket in [1u32, 7, 512, 2048, 3000, 1 << 24] {
        let onebit = CodecSpec::parse(&format!("onebit:bucket={bucket}"))
            .unwrap()
            .codec()
            .clone();
        for n in [0, 1, 7, 4099] {
            case += 1;
            let x = plan_input(&mut g, case % 3, n);
            // The last bucket's means: a negative mean of the non-negatives, a positive one
            // of the negatives, or one NaN.
            let last = 8 * n.div_ceil(bucket as usize).saturating_sub(1);
            let (at, v) = [(last, -0.5), (last + 4, 0.5), (last, f32::NAN)][case % 3];
            let corrupt = move |p: &mut [u8]| {
                if n > 0 {
                    let other = if at == last { last + 4 } else { last };
                    if v.is_nan() {
                        put_f32(p, other, 0.0)
                    }
                    put_f32(p, at, v)
                }
            };
            plan_case(d, &*s, &*onebit, &x, 2, case % 2 == 1, &corrupt);
        }
    }
}

/// The float codecs' plans (fp16, bf16, none) against the Rust codecs at counts 0, 1, 7,
/// 4099 and 1000003, finite and not, on and off vector alignment: encode, decode(-add) and
/// error feedback.
pub fn float_cases(d: &dyn Driver) {
    use qccl::codec::CodecId;
    use qccl::gpu::plans::{plan_for, FloatPlan};
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(13);
    for id in [CodecId::Fp16, CodecId::Bf16, CodecId::None] {
        let codec = qccl::CodecSpec::parse(id.name()).unwrap().codec().clone();
        let plan = plan_for(d, 0, &*codec).unwrap();
        for (ci, n) in [0, 1, 7, 4099, 1_000_003].into_iter().enumerate() {
            let finite = ci % 2 == 0;
            let offset = ci / 2 % 2;
            let x = g.f32s(n, finite);
            let mut want = vec![0u8; codec.payload_len(n)];
            codec.encode_payload(&x, &mut qccl::codec::Rng::from_u64(1), &mut want);
            assert_eq!(plan.payload_len(n), want.len());
            let what = format!("{} n={n} finite={finite} offset={offset}", id.name());

            let esize = plan.payload_len(1);
            let pad = vec![0u8; 4 * offset];
            let dx = upload(d, &*s, &[&pad[..], &shim::f32_bytes(&x)].concat());
            let payload = d.alloc_device(0, want.len() + esize * offset + 1).unwrap();
            let (x_at, p_at) = (
                dx.addr() + 4 * offset as u64,
                payload.addr() + (esize * offset) as u64,
            );
            // SAFETY: n f32s at x_at and payload_len(n) bytes at p_at, device memory kept
            // until the download synchronises.
            unsafe { plan.encode(&*s, x_at, p_at, n, 1, 0) }.unwrap();
            let got = download(&*s, p_at, want.len());
            shim::assert_same(&format!("{what}: encode"), &got, &want, esize);

            let acc = g.f32s(n, finite);
            for add in [false, true] {
                let mut out = acc.clone();
                codec.decode_payload(&want, &mut out, add).unwrap();
                let dacc = upload(d, &*s, &[&pad[..], &shim::f32_bytes(&acc)].concat());
                let acc_at = dacc.addr() + 4 * offset as u64;
                // SAFETY: as above, n f32s at acc_at.
                unsafe { plan.decode(&*s, p_at, acc_at, n, add, 0, 0) }.unwrap();
                let got = download(&*s, acc_at, 4 * n);
                let f32s: Vec<u8> = shim::f32_bytes(&out);
                check(
                    &format!("{what}: add={add}"),
                    DType::Float32,
                    &got,
                    &f32s,
                    add,
                );
            }

            // Error feedback: the CPU's compensate, encode, record.
            let res = g.f32s(n, finite);
            let mut w = x.clone();
            let mut res_want = res.clone();
            qccl::internal::ef_compensate(&mut w, &mut res_want);
            let mut want_ef = vec![0u8; want.len()];
            codec.encode_payload(&w, &mut qccl::codec::Rng::from_u64(1), &mut want_ef);
            let mut decoded = vec![0f32; n];
            codec.decode_payload(&want_ef, &mut decoded, false).unwrap();
            qccl::internal::ef_record(&mut res_want, &w, &decoded);
            let dres = upload(d, &*s, &[&pad[..], &shim::f32_bytes(&res)].concat());
            let dw = d.alloc_device(0, 4 * (n + offset) + 1).unwrap();
            let (res_at, w_at) = (
                dres.addr() + 4 * offset as u64,
                dw.addr() + 4 * offset as u64,
            );
            // SAFETY: n f32s at x_at, res_at, w_at and payload_len(n) bytes at p_at, device
            // memory kept until the downloads synchronise.
            unsafe { plan.encode_ef(&*s, x_at, res_at, w_at, p_at, n, 1, 0) }.unwrap();
            let got = download(&*s, p_at, want.len());
            shim::assert_same(&format!("{what}: encode_ef"), &got, &want_ef, esize);
            let got = download(&*s, res_at, 4 * n);
            shim::assert_same(
                &format!("{what}: encode_ef residual"),
                &got,
                &shim::f32_bytes(&res_want),
                4,
            );
            let got = download(&*s, w_at, 4 * n);
            shim::assert_same(
                &format!("{what}: encode_ef w"),
                &got,
                &shim::f32_bytes(&w),
                4,
            );
        }
    }
    assert!(matches!(
        FloatPlan::new(d, 0, CodecId::Qsgd),
        Err(qccl::Error::InvalidArgument(_))
    ));
}

/// Sparse plan test data: kind 0 ordinary values (signed zeros, tiny and large magnitudes), 1
/// few distinct values (ties at every threshold, signed zeros), 2 with random bit patterns
/// (NaN, infinity, subnormals) mixed in: mstopk's exact top-k fallback.
fn sparse_data(g: &mut Gen, kind: usize, n: usize) -> Vec<f32> {
    const FEW: [f32; 7] = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 0.25];
    match kind {
        1 => (0..n).map(|_| FEW[(g.u64() % 7) as usize]).collect(),
        _ => g.f32s(n, kind == 0),
    }
}

/// Device memory of `len` bytes (at least 1) filled with `byte`.
pub fn filled(d: &dyn Driver, s: &dyn Stream, len: usize, byte: u8) -> Box<dyn DeviceMem> {
    upload(d, s, &vec![byte; len.max(1)])
}

/// A sparse plan (`gpu::plans::SparsePlan`, through `plan_for`) on `x` against the Rust codec
/// of `spec`, bit for bit: the payload (no byte past it written), decode and decode_add, the
/// `bad` flag on corrupted payloads (an index out of range, a repeated and a decreasing one)
/// without a write outside `out`, and error feedback with and without `w_out` (residual and
/// w). The scratch starts as garbage: the plan's first kernels must set what they read. At a
/// large count (slow in fiber mode) the corrupted payloads and EF without `w_out` are left to
/// the smaller ones.
fn sparse_plan_case(d: &dyn Driver, s: &dyn Stream, spec: &str, x: &[f32], key: u64) {
    use qccl::codec::Rng;
    let codec = qccl::CodecSpec::parse(spec).unwrap().codec().clone();
    let plan = qccl::gpu::plans::plan_for(d, 0, &*codec).unwrap();
    assert_eq!(plan.codec(), codec.id());
    let n = x.len();
    let len = codec.payload_len(n);
    assert_eq!(plan.payload_len(n), len);
    let k = len / 8;
    let what = format!("{spec} n={n} k={k}");
    let thorough = n < 100_000;
    const GUARD: usize = 16;
    let scratch = filled(d, s, plan.scratch_len(n), 0xa5);
    let sc = scratch.addr();

    let mut want = vec![0u8; len];
    codec.encode_payload(x, &mut Rng::from_u64(key), &mut want);
    let dx = upload(d, s, &shim::f32_bytes(x));
    let payload = filled(d, s, len + GUARD, 0x5a);
    // SAFETY: n f32s at dx, len bytes (and a guard) at payload, scratch_len(n) bytes at sc,
    // device memory kept until the downloads synchronise; likewise below.
    unsafe { plan.encode(s, dx.addr(), payload.addr(), n, key, sc) }.unwrap();
    let got = download(s, payload.addr(), len + GUARD);
    shim::assert_same(&format!("{what}: encode"), &got[..len], &want, 4);
    assert_eq!(
        got[len..],
        [0x5a; GUARD],
        "{what}: encode wrote past the payload"
    );

    // Decodes `p` into (or adds it to) `acc` on the device; the output and the bad flag.
    let base = g_acc(n);
    let decode = |p: &[u8], add: bool| {
        let dp = upload(d, s, p);
        let mut init = shim::f32_bytes(&base);
        init.extend([0x77; GUARD]);
        let out = upload(d, s, &init);
        let bad = upload(d, s, &[0; 4]);
        // SAFETY: as above; n f32s (and a guard) at out, 4 bytes at bad.
        unsafe { plan.decode(s, dp.addr(), out.addr(), n, add, bad.addr(), sc) }.unwrap();
        let got = download(s, out.addr(), 4 * n + GUARD);
        assert_eq!(got[4 * n..], [0x77; GUARD], "{what}: decode wrote past out");
        let bad = i32::from_le_bytes(download(s, bad.addr(), 4).try_into().unwrap());
        (got[..4 * n].to_vec(), bad)
    };
    for add in [false, true] {
        let mut out = base.clone();
        codec.decode_payload(&want, &mut out, add).unwrap();
        let (got, bad) = decode(&want, add);
        assert_eq!(bad, 0, "{what}: add={add}: a valid payload refused");
        shim::assert_same(
            &format!("{what}: decode add={add}"),
            &got,
            &shim::f32_bytes(&out),
            4,
        );
    }
    let idx =
        |p: &mut [u8], j: usize, i: u32| p[4 * j..4 * j + 4].copy_from_slice(&i.to_le_bytes());
    let first = |p: &[u8], j: usize| u32::from_le_bytes(p[4 * j..4 * j + 4].try_into().unwrap());
    let mut corrupt: Vec<(&str, Vec<u8>)> = vec![];
    if thorough && k >= 1 {
        let mut p = want.clone();
        idx(&mut p, k - 1, n as u32);
        corrupt.push(("index n", p));
        let mut p = want.clone();
        idx(&mut p, 0, u32::MAX);
        corrupt.push(("index 2^32-1", p));
    }
    if thorough && k >= 2 {
        let mut p = want.clone();
        idx(&mut p, 1, first(&want, 0));
        corrupt.push(("repeated index", p));
        let mut p = want.clone();
        idx(&mut p, 0, first(&want, 1));
        idx(&mut p, 1, first(&want, 0));
        corrupt.push(("decreasing index", p));
    }
    for (how, p) in &corrupt {
        let mut out = base.clone();
        assert!(
            codec.decode_payload(p, &mut out, true).is_err(),
            "{what}: {how}"
        );
        for add in [false, true] {
            let (_, bad) = decode(p, add);
            assert_ne!(bad, 0, "{what}: {how}, add={add}: accepted");
        }
    }

    // Error feedback as the Rust wrapper: w = x + res, encode w, res = 0 + w, then res -= the
    // values sent.
    let res: Vec<f32> = g_acc(n).iter().map(|v| v * 0.125).collect();
    let mut w = x.to_vec();
    let mut res_want = res.clone();
    qccl::internal::ef_compensate(&mut w, &mut res_want);
    let mut want = vec![0u8; len];
    codec.encode_payload(&w, &mut Rng::from_u64(key), &mut want);
    for (r, v) in res_want.iter_mut().zip(&w) {
        *r += v;
    }
    for j in 0..k {
        let v = f32::from_le_bytes(want[4 * k + 4 * j..4 * k + 4 * j + 4].try_into().unwrap());
        res_want[first(&want, j) as usize] -= v;
    }
    for keep_w in [true, false].into_iter().filter(|&keep| keep || thorough) {
        let dres = upload(d, s, &shim::f32_bytes(&res));
        let dw = filled(d, s, 4 * n, 0x33);
        let w_at = if keep_w { dw.addr() } else { 0 };
        let garbage = filled(d, s, plan.scratch_len(n), 0xa5);
        // SAFETY: as above; n f32s at dres and dw.
        unsafe {
            plan.encode_ef(
                s,
                dx.addr(),
                dres.addr(),
                w_at,
                payload.addr(),
                n,
                key,
                garbage.addr(),
            )
        }
        .unwrap();
        let what = format!("{what} w_out={keep_w}");
        let got = download(s, payload.addr(), len);
        shim::assert_same(&format!("{what}: encode_ef"), &got, &want, 4);
        let got = download(s, dres.addr(), 4 * n);
        shim::assert_same(
            &format!("{what}: encode_ef residual"),
            &got,
            &shim::f32_bytes(&res_want),
            4,
        );
        if keep_w {
            let got = download(s, dw.addr(), 4 * n);
            shim::assert_same(
                &format!("{what}: encode_ef w"),
                &got,
                &shim::f32_bytes(&w),
                4,
            );
        }
    }
}

/// An accumulator of `n` elements, the same for every call with `n`: small integers and a
/// few signed zeros, so decode_add's sums are exact and -0.0 + 0.0 shows.
fn g_acc(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if i % 11 == 3 {
                -0.0
            } else {
                (i % 5) as f32 - 2.0
            }
        })
        .collect()
}

/// The sparse cases of one codec family: `spec(density)` at counts 0, 1, 7, 4099 (a prime
/// just past one compaction segment) over the data kinds, densities giving k = 0, 1, a few,
/// many and n; `large` adds 1000003 at density 0.001.
pub fn sparse_cases(d: &dyn Driver, spec: &dyn Fn(f64) -> String, large: bool, seed: u64) {
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(seed);
    let mut cases = vec![
        (0, 0.5, 0),
        (1, 0.001, 0),
        (1, 1.0, 2),
        (7, 0.3, 1),
        (7, 1.0, 0),
    ];
    for kind in 0..3 {
        cases.extend([(4099, 0.001, kind), (4099, 0.3, kind)]);
    }
    if large {
        cases.push((1_000_003, 0.001, 0));
    }
    for (i, (n, density, kind)) in cases.into_iter().enumerate() {
        let start = Instant::now();
        let x = sparse_data(&mut g, kind, n);
        let spec = spec(density);
        sparse_plan_case(d, &*s, &spec, &x, seed * 1000 + i as u64);
        eprintln!("{spec} n={n} kind={kind}: {:?}", start.elapsed());
    }
}

/// Top-k's plan: every sparse case, the large count included.
pub fn topk_cases(d: &dyn Driver) {
    sparse_cases(d, &|k| format!("topk:density={k}"), true, 41);
}

/// MSTopK's plan: every sparse case at 1, 3 (one count pass) and 30 samplings.
pub fn mstopk_cases(d: &dyn Driver) {
    for samplings in [1, 3, 30] {
        sparse_cases(
            d,
            &|k| format!("mstopk:density={k},samplings={samplings}"),
            false,
            42 + samplings,
        );
    }
}

/// Random-k's plan: every sparse case, the large count included.
pub fn randk_cases(d: &dyn Driver) {
    sparse_cases(d, &|k| format!("randk:density={k}"), true, 43);
}
