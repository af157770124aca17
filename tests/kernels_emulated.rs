//! Kernel launches through the driver contract (`Driver::function`, `Stream::launch`) under
//! the emulated driver, which builds kernels/*.cu for the CPU with g++ and runs them through
//! the shim on its streams: every reduction kernel (dtype x op, and the avg finish) on device
//! memory, compared bit for bit with qccl's Rust reduction; and the launch errors.
//!
//! Without g++ the tests print why and pass, unless QCCL_REQUIRE_SHIM=1 (set by .ci/run). The
//! first run builds reduce.cu (a few seconds; cached on disk after that, see
//! kernels/README.md).

mod codec_plans;
mod shim;

use qccl::gpu::driver::{Arg, DeviceMem, Driver, Function, Stream};
use qccl::gpu::emu::EmuDriver;
use qccl::internal::{finish_avg, kernels::dtype_suffix, reduce3};
use qccl::{DType, Error, ReduceOp};
use shim::{check, random, Gen};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(60);

/// The counts each kernel runs at: empty, one, a partial vector, a prime past a few blocks,
/// and a large prime.
const COUNTS: [usize; 5] = [0, 1, 7, 4099, 1_000_003];

/// An emulated driver whose kernels load, or None (skip) where g++ is missing and not
/// required.
fn driver(devices: usize) -> Option<EmuDriver> {
    let d = EmuDriver::new(devices);
    let start = Instant::now();
    match d.function(0, "qccl_reduce_sum_f32") {
        Ok(_) => {
            eprintln!("reduce.cu loaded in {:?}", start.elapsed());
            Some(d)
        }
        Err(Error::Unsupported(why)) => {
            assert_ne!(
                std::env::var("QCCL_REQUIRE_SHIM").as_deref(),
                Ok("1"),
                "QCCL_REQUIRE_SHIM=1 but {why}"
            );
            eprintln!("skipped: {why}");
            None
        }
        Err(e) => panic!("loading reduce.cu for the emulated GPU: {e}"),
    }
}

/// Device memory holding `data` (at least 1 byte allocated).
fn upload(d: &EmuDriver, s: &dyn Stream, data: &[u8]) -> Box<dyn DeviceMem> {
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

/// A grid-stride launch over `n` elements: 256 threads a block, at most 64 blocks.
fn launch(s: &dyn Stream, f: &dyn Function, n: usize, args: &[Arg]) -> qccl::Result<()> {
    let grid = n.div_ceil(256).clamp(1, 64) as u32;
    // SAFETY: every test passes the kernel's own parameter list, pointing at device memory
    // it keeps until after synchronising.
    unsafe { s.launch(f, grid, 256, args) }
}

#[test]
fn reductions_match_rust() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(11);
    for dtype in DType::ALL {
        let size = dtype.size();
        for op in ReduceOp::ALL {
            if op.check_dtype(dtype).is_err() {
                continue;
            }
            let name = format!("qccl_reduce_{}_{}", op.name(), dtype_suffix(dtype));
            let f = d.function(0, &name).unwrap();
            assert_eq!(f.name(), name);
            for (ci, n) in COUNTS.into_iter().enumerate() {
                // In place or not; 16-byte aligned (the vector path) or one element off.
                let (inplace, offset) = (ci % 2 == 1, ci / 2 % 2);
                let a = random(&mut g, dtype, n);
                let b = random(&mut g, dtype, n);
                let mut want = vec![0u8; a.len()];
                reduce3(dtype, op, &mut want, &a, &b);
                let pad = vec![0u8; offset * size];
                let da = upload(&d, &*s, &[&pad[..], &a].concat());
                let db = upload(&d, &*s, &[&pad[..], &b].concat());
                let out = d.alloc_device(0, (n + offset) * size + 1).unwrap();
                let at = |m: &dyn DeviceMem| m.addr() + (offset * size) as u64;
                let dst = if inplace { at(&*da) } else { at(&*out) };
                let args = [
                    Arg::Ptr(dst),
                    Arg::Ptr(at(&*da)),
                    Arg::Ptr(at(&*db)),
                    Arg::U64(n as u64),
                ];
                launch(&*s, &*f, n, &args).unwrap();
                let got = download(&*s, dst, n * size);
                let any_nan = matches!(op, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Avg);
                let what = format!("{name} n={n} inplace={inplace} offset={offset}");
                check(&what, dtype, &got, &want, any_nan);
            }
        }
    }
}

#[test]
fn finish_avg_matches_rust() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(12);
    for dtype in DType::ALL.into_iter().filter(|d| d.is_float()) {
        let name = format!("qccl_finish_avg_{}", dtype_suffix(dtype));
        let f = d.function(0, &name).unwrap();
        for (n, ranks) in COUNTS.into_iter().zip([1usize, 3, 7, 2, 16_777_217]) {
            let x = random(&mut g, dtype, n);
            let mut want = x.clone();
            finish_avg(dtype, &mut want, ranks);
            let dx = upload(&d, &*s, &x);
            let args = [
                Arg::Ptr(dx.addr()),
                Arg::U64(n as u64),
                Arg::U64(ranks as u64),
            ];
            launch(&*s, &*f, n, &args).unwrap();
            let got = download(&*s, dx.addr(), x.len());
            check(
                &format!("{name} n={n} ranks={ranks}"),
                dtype,
                &got,
                &want,
                true,
            );
        }
    }
}

/// Page-locked memory is passed to kernels as it is, and launches keep stream order with
/// the copies around them.
/// ef.cu's compensate against the CPU's `ef::compensate`, bit for bit: out of place, in
/// place (the residual cleared), and with no residual (a copy).
#[test]
fn ef_compensate_matches_rust() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_ef_compensate").unwrap();
    let mut g = Gen::new(22);
    for n in COUNTS {
        let x = random(&mut g, DType::Float32, n);
        let r = random(&mut g, DType::Float32, n);
        let (mut want, mut res): (Vec<f32>, Vec<f32>) = (floats(&x), floats(&r));
        qccl::internal::ef_compensate(&mut want, &mut res);
        let want: Vec<u8> = want.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let zeros = vec![0u8; 4 * n];
        for in_place in [false, true] {
            let (dx, dr) = (upload(&d, &*s, &x), upload(&d, &*s, &r));
            let dw = if in_place {
                None
            } else {
                Some(upload(&d, &*s, &zeros))
            };
            let w = dw.as_ref().map_or(dx.addr(), |m| m.addr());
            let args = [
                Arg::Ptr(dx.addr()),
                Arg::Ptr(dr.addr()),
                Arg::Ptr(w),
                Arg::U64(n as u64),
            ];
            launch(&*s, &*f, n, &args).unwrap();
            let what = format!("qccl_ef_compensate n={n} in place {in_place}");
            check(&what, DType::Float32, &download(&*s, w, 4 * n), &want, true);
            assert_eq!(download(&*s, dr.addr(), 4 * n), zeros, "{what}: residual");
        }
        let (dx, dw) = (upload(&d, &*s, &x), upload(&d, &*s, &zeros));
        let args = [
            Arg::Ptr(dx.addr()),
            Arg::Ptr(0),
            Arg::Ptr(dw.addr()),
            Arg::U64(n as u64),
        ];
        launch(&*s, &*f, n, &args).unwrap();
        assert_eq!(download(&*s, dw.addr(), 4 * n), x, "copy n={n}");
    }
}

/// ef.cu's zero (a new device residual: +0.0 everywhere) and wire.cu's header (32 bytes
/// from four little-endian words, at any byte offset of page-locked memory, nothing around
/// them touched).
#[test]
fn ef_zero_and_put_header_write_what_they_say() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let zero = d.function(0, "qccl_ef_zero").unwrap();
    let mut g = Gen::new(23);
    for n in COUNTS {
        let dr = upload(&d, &*s, &random(&mut g, DType::Float32, n));
        launch(&*s, &*zero, n, &[Arg::Ptr(dr.addr()), Arg::U64(n as u64)]).unwrap();
        assert_eq!(download(&*s, dr.addr(), 4 * n), vec![0u8; 4 * n], "n={n}");
    }
    let put = d.function(0, "qccl_put_header").unwrap();
    let words = [
        0x0123_4567_89ab_cdef_u64,
        u64::MAX,
        0,
        0x8000_0000_0000_0001,
    ];
    let want: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let pinned = d.alloc_pinned(64).unwrap();
    for at in 0..8 {
        // SAFETY: 64 bytes of page-locked memory, idle (synchronised after each launch).
        unsafe { std::ptr::write_bytes(pinned.ptr(), 0xa5, 64) };
        let mut args = vec![Arg::Ptr(pinned.ptr() as u64 + at as u64)];
        args.extend(words.iter().map(|&w| Arg::U64(w)));
        launch(&*s, &*put, 32, &args).unwrap();
        s.synchronize(WAIT).unwrap();
        // SAFETY: as above; the launch is done.
        let got = unsafe { std::slice::from_raw_parts(pinned.ptr(), 64) };
        assert_eq!(&got[at..at + 32], &want[..], "offset {at}");
        assert!(
            got[..at].iter().chain(&got[at + 32..]).all(|&b| b == 0xa5),
            "offset {at}: bytes around the header changed"
        );
    }
}

/// float64 buffers' conversions to and from the codecs' f32 copy: bit for bit Rust's `as`
/// (NaN payloads, signed zeros, subnormals, overflow and ties to even included).
#[test]
fn float64_conversions_match_rust() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let mut g = Gen::new(29);
    let doubles: Vec<f64> = [
        0.0,
        -0.0,
        1.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::from_bits(0x7ff8_0000_0000_0001),
        f64::from_bits(0xfff0_0000_dead_beef),
        f64::from_bits(0x7ff4_5678_9abc_def0),
        f64::MIN_POSITIVE,
        -5e-324,
        1e-40,
        -1.5e-45,
        f32::MAX as f64 * 1.0000001,
        f32::MAX as f64,
        // Ties: halfway between two f32s, and one ulp of f64 either side.
        1.0 + f32::EPSILON as f64 / 2.0,
        1.0 + 3.0 * f32::EPSILON as f64 / 2.0,
        f64::from_bits((1.0 + f32::EPSILON as f64 / 2.0).to_bits() + 1),
        f64::from_bits((1.0 + f32::EPSILON as f64 / 2.0).to_bits() - 1),
    ]
    .into_iter()
    .chain((0..4099).map(|_| f64::from_bits(g.u64())))
    .collect();
    let narrow = d.function(0, "qccl_f64_to_f32").unwrap();
    let widen = d.function(0, "qccl_f32_to_f64").unwrap();
    // One conversion kernel over `input` (n elements) into `width` bytes each: the output.
    let convert = |f: &dyn Function, input: &[u8], n: usize, width: usize| {
        let src = upload(&d, &*s, input);
        let out = codec_plans::filled(&d, &*s, width * n, 0xa5);
        let args = [
            Arg::Ptr(src.addr()),
            Arg::Ptr(out.addr()),
            Arg::U64(n as u64),
        ];
        launch(&*s, f, n, &args).unwrap();
        download(&*s, out.addr(), width * n)
    };
    for n in [0, 1, 7, doubles.len()] {
        let x = &doubles[..n];
        let got = floats(&convert(&*narrow, bytemuck::cast_slice(x), n, 4));
        for (i, (&v, g)) in x.iter().zip(&got).enumerate() {
            assert_eq!(
                g.to_bits(),
                (v as f32).to_bits(),
                "narrow n={n} [{i}] {v:e}"
            );
        }
        // Back: every f32 the narrowing gave, NaNs with payloads among them.
        let f: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let back = convert(&*widen, bytemuck::cast_slice(&f), n, 8);
        for (i, (&v, b)) in f.iter().zip(back.chunks_exact(8)).enumerate() {
            let b = u64::from_ne_bytes(b.try_into().unwrap());
            assert_eq!(b, (v as f64).to_bits(), "widen n={n} [{i}] {v:e}");
        }
    }
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

#[test]
fn pinned_memory_and_stream_order() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_reduce_sum_u32").unwrap();
    let n = 1031usize;
    let a: Vec<u8> = (0..n as u32).flat_map(|v| v.to_le_bytes()).collect();
    let pinned = d.alloc_pinned(a.len()).unwrap();
    let dev = d.alloc_device(0, a.len()).unwrap();
    // SAFETY: `a` and `pinned` live until the synchronize below; nothing else touches them.
    unsafe {
        std::ptr::copy_nonoverlapping(a.as_ptr(), pinned.ptr(), a.len());
        s.copy_to_device(dev.addr(), a.as_ptr(), a.len()).unwrap();
    }
    // pinned = pinned + dev, twice: 3a, and the second launch sees the first's result.
    let args = [
        Arg::Ptr(pinned.ptr() as u64),
        Arg::Ptr(pinned.ptr() as u64),
        Arg::Ptr(dev.addr()),
        Arg::U64(n as u64),
    ];
    launch(&*s, &*f, n, &args).unwrap();
    launch(&*s, &*f, n, &args).unwrap();
    s.synchronize(WAIT).unwrap();
    // SAFETY: the launches are done (synchronised); `pinned` holds `a.len()` bytes.
    let got = unsafe { std::slice::from_raw_parts(pinned.ptr(), a.len()) };
    for (i, c) in got.chunks_exact(4).enumerate() {
        assert_eq!(
            u32::from_le_bytes(c.try_into().unwrap()),
            3 * i as u32,
            "{i}"
        );
    }
}

/// A launch on the legacy default stream, and another stream waiting for it through an
/// event before copying the result out.
#[test]
fn launches_order_with_events_across_streams() {
    let Some(d) = driver(1) else { return };
    // SAFETY: null is the legacy default stream of device 0.
    let s0 = unsafe { d.borrow_stream(0, std::ptr::null_mut()) }.unwrap();
    let s1 = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_reduce_prod_i64").unwrap();
    let n = 4099usize;
    let a: Vec<u8> = (0..n as i64).flat_map(|v| (v - 7).to_le_bytes()).collect();
    let dev = upload(&d, &*s0, &a);
    let p = Arg::Ptr(dev.addr());
    // A word holds s0 back, so only the event can order s1's copy after the launch.
    let gate = d.alloc_pinned(4).unwrap();
    let w = gate.ptr().cast::<u32>();
    // SAFETY: pinned, aligned, outlives the wait (synchronised below).
    unsafe {
        w.write(0);
        s0.wait_word(w, 1).unwrap();
    }
    launch(&*s0, &*f, n, &[p, p, p, Arg::U64(n as u64)]).unwrap();
    let done = s0.record().unwrap();
    s1.wait_event(&*done).unwrap();
    let mut out = vec![0u8; a.len()];
    // SAFETY: `out` outlives the copy (s1 is synchronised below).
    unsafe { s1.copy_to_host(out.as_mut_ptr(), dev.addr(), out.len()) }.unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !done.query().unwrap(),
        "the launch ran before the gate opened"
    );
    // SAFETY: an aligned word of live pinned memory, stored atomically as the worker reads.
    unsafe {
        (*w.cast::<std::sync::atomic::AtomicU32>()).store(1, std::sync::atomic::Ordering::Release)
    };
    s1.synchronize(WAIT).unwrap();
    let want: Vec<u8> = (0..n as i64)
        .flat_map(|v| (v - 7).wrapping_mul(v - 7).to_le_bytes())
        .collect();
    assert_eq!(out, want);
    s0.synchronize(WAIT).unwrap();
}

fn assert_invalid(r: qccl::Result<()>, needles: &[&str]) {
    match r {
        Err(Error::InvalidArgument(m)) => {
            for n in needles {
                assert!(m.contains(n), "{m:?} does not name {n:?}");
            }
        }
        other => panic!("expected InvalidArgument naming {needles:?}, got {other:?}"),
    }
}

#[test]
fn unknown_kernels_are_refused() {
    let Some(d) = driver(1) else { return };
    for name in ["qccl_reduce_sum_f33", "qccl_nothing", "not a name", ""] {
        assert_invalid(d.function(0, name).map(|_| ()), &[&format!("{name:?}")]);
    }
    assert_invalid(
        d.function(1, "qccl_reduce_sum_f32").map(|_| ()),
        &["ordinal 1"],
    );
}

#[test]
fn bad_launches_are_refused_naming_the_kernel() {
    let Some(d) = driver(2) else { return };
    let s = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_reduce_max_i32").unwrap();
    let mem = d.alloc_device(0, 64).unwrap();
    let p = Arg::Ptr(mem.addr());
    let ok = [p, p, p, Arg::U64(16)];
    let k = "qccl_reduce_max_i32";
    // SAFETY (every launch below): refused at enqueue, or running on `mem`, which lives
    // until the synchronize at the end.
    unsafe {
        // A host pointer: neither device memory nor pinned.
        let host = [0u32; 16];
        let h = host.as_ptr() as u64;
        assert_invalid(
            s.launch(&*f, 1, 32, &[p, Arg::Ptr(h), p, Arg::U64(16)]),
            &[k, "argument 1", &format!("0x{h:x}"), "neither"],
        );
        // Argument types and count come from the kernel's parameters.
        assert_invalid(
            s.launch(&*f, 1, 32, &[p, p, p, Arg::U32(16)]),
            &[k, "argument 3", "uint64_t"],
        );
        assert_invalid(s.launch(&*f, 1, 32, &ok[..3]), &[k, "4 argument"]);
        // Shapes.
        assert_invalid(s.launch(&*f, 0, 32, &ok), &[k, "0 block"]);
        assert_invalid(s.launch(&*f, 1, 2048, &ok), &[k, "2048 thread"]);
        // Memory or a function of another device.
        let other = d.alloc_device(1, 64).unwrap();
        assert_invalid(
            s.launch(&*f, 1, 32, &[p, Arg::Ptr(other.addr()), p, Arg::U64(16)]),
            &[k, "argument 1", "device 1"],
        );
        let f1 = d.function(1, k).unwrap();
        assert_invalid(s.launch(&*f1, 1, 32, &ok), &[k, "device 1"]);
        // Refusals leave the stream usable.
        s.launch(&*f, 1, 32, &ok).unwrap();
    }
    s.synchronize(WAIT).unwrap();
}

#[test]
fn freed_memory_fails_the_launch() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_reduce_sum_f64").unwrap();
    let k = "qccl_reduce_sum_f64";
    // Freed before the launch: refused at enqueue.
    let gone = d.alloc_device(0, 64).unwrap().addr();
    let args = [Arg::Ptr(gone), Arg::Ptr(gone), Arg::Ptr(gone), Arg::U64(8)];
    // SAFETY: refused at enqueue; nothing runs.
    let r = unsafe { s.launch(&*f, 1, 32, &args) };
    assert_invalid(r, &[k, "argument 0", &format!("0x{gone:x}")]);

    // Freed after the enqueue, before the stream reaches the launch: the launch fails when it
    // runs, and the stream with it (sticky).
    let word = d.alloc_pinned(4).unwrap();
    let w = word.ptr().cast::<u32>();
    // SAFETY: `word` is pinned, aligned and outlives the stream's wait (synchronised below).
    unsafe {
        w.write(0);
        s.wait_word(w, 1).unwrap();
    }
    let mem = d.alloc_device(0, 64).unwrap();
    let p = Arg::Ptr(mem.addr());
    // SAFETY: `mem` is freed before the launch runs; the emulated driver refuses to run it.
    unsafe { s.launch(&*f, 1, 32, &[p, p, p, Arg::U64(8)]) }.unwrap();
    drop(mem);
    // SAFETY: an aligned word of live pinned memory, stored atomically as the worker reads.
    unsafe {
        (*w.cast::<std::sync::atomic::AtomicU32>()).store(1, std::sync::atomic::Ordering::Release)
    };
    let e = s.synchronize(WAIT).unwrap_err();
    assert!(matches!(e, Error::System(_)), "{e}");
    let m = e.to_string();
    assert!(m.contains(k) && m.contains("freed"), "{m}");
}

/// Every kernel file builds for the emulated GPU (about 15 s the first time on a small
/// machine, then cached), and each plainly named entry point loads. reduce.cu and floats.cu
/// name every kernel through a macro; the tests above load those.
#[test]
fn every_kernel_file_loads() {
    let Some(d) = driver(1) else { return };
    for source in qccl::internal::kernels::SOURCES {
        let start = Instant::now();
        let plain: Vec<String> = source
            .entry_points()
            .into_iter()
            .filter(|n| !n.contains('*'))
            .collect();
        assert!(
            !plain.is_empty() || ["reduce.cu", "floats.cu"].contains(&source.file),
            "{}: no plainly named kernel to load it by: add a test that launches one",
            source.file
        );
        for name in plain {
            d.function(0, &name)
                .unwrap_or_else(|e| panic!("{}: {name}: {e}", source.file));
        }
        eprintln!("{} loaded in {:?}", source.file, start.elapsed());
    }
}

/// The float codecs' launch plan (`gpu::plans::FloatPlan`, through `plan_for`) on emulated
/// device memory gives the Rust codec's payload, decodes and error feedback (compensate,
/// encode, record), bit for bit, aligned and one element off.
#[test]
fn float_codec_plans_match_rust() {
    let Some(d) = driver(1) else { return };
    codec_plans::float_cases(&d);
}

/// qsgd's launch plan (`gpu::plans::QsgdPlan`) against the Rust codec: every bit width, both
/// scales and roundings, buckets of 1, 7, 128 and over QSGD_RUN (the scale-by-runs path), a
/// few counts each, a bucket whose signed zeros come in a later run than its positives, and
/// the large count once (tests/codec_plans).
#[test]
fn qsgd_codec_plans_match_rust() {
    let Some(d) = driver(1) else { return };
    codec_plans::qsgd_cases(&d);
}

/// efsign's and onebit's launch plan (`gpu::plans::SignPlan`) against the Rust codec
/// (tests/codec_plans).
#[test]
fn sign_codec_plans_match_rust() {
    let Some(d) = driver(1) else { return };
    codec_plans::sign_cases(&d);
}

/// The qsgd and one-bit plans refuse, before enqueueing anything, a codec not theirs, a null
/// `bad` word and null scratch where they need some.
#[test]
fn codec_plans_refuse_misuse() {
    use qccl::gpu::plans::{QsgdPlan, SignPlan};
    use qccl::CodecSpec;
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let codec = |spec: &str| CodecSpec::parse(spec).unwrap().codec().clone();
    let (qsgd, efsign, fp16) = (codec("qsgd:bucket=5000"), codec("efsign"), codec("fp16"));
    assert_invalid(
        QsgdPlan::new(&d, 0, &*efsign).map(|_| ()),
        &["efsign", "not qsgd"],
    );
    assert_invalid(
        SignPlan::new(&d, 0, &*fp16).map(|_| ()),
        &["fp16", "neither"],
    );
    let mem = d.alloc_device(0, 1 << 16).unwrap();
    let p = mem.addr();
    for c in [qsgd, efsign, codec("onebit")] {
        let plan = qccl::gpu::plans::plan_for(&d, 0, &*c).unwrap();
        // SAFETY: refused before anything is enqueued.
        let r = unsafe { plan.decode(&*s, p, p, 8, false, 0, p) };
        assert_invalid(r, &["bad", "null"]);
    }
    let plan = QsgdPlan::new(&d, 0, &*codec("qsgd:bucket=5000")).unwrap();
    use qccl::gpu::plans::CodecPlan;
    assert_eq!(plan.scratch_len(10_001), 3 * 2 * 68);
    // SAFETY: refused before anything is enqueued.
    unsafe {
        assert_invalid(plan.encode(&*s, p, p, 10_001, 1, 0), &["scratch", "null"]);
        assert_invalid(plan.encode_ef(&*s, p, p, 0, p, 10_001, 1, 0), &["scratch"]);
    }
    let plan = SignPlan::new(&d, 0, &*codec("onebit")).unwrap();
    // SAFETY: refused before anything is enqueued.
    let r = unsafe { plan.encode(&*s, p, p, 100, 1, 0) };
    assert_invalid(r, &["scratch", "null"]);
    s.synchronize(WAIT).unwrap();
}

#[test]
fn topk_plan_matches_rust() {
    let Some(d) = driver(1) else { return };
    codec_plans::topk_cases(&d);
}

#[test]
fn mstopk_plan_matches_rust() {
    let Some(d) = driver(1) else { return };
    codec_plans::mstopk_cases(&d);
}

#[test]
fn randk_plan_matches_rust() {
    let Some(d) = driver(1) else { return };
    codec_plans::randk_cases(&d);
}

/// What the sparse plans refuse: a non-sparse codec, a count the kernels cannot index, a
/// missing scratch or `bad` flag.
#[test]
fn sparse_plans_refuse_what_they_cannot_run() {
    use qccl::gpu::plans::{plan_for, SparsePlan};
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let fp16 = qccl::CodecSpec::parse("fp16").unwrap().codec().clone();
    assert!(matches!(
        SparsePlan::new(&d, 0, &*fp16),
        Err(Error::Unsupported(_))
    ));
    let topk = qccl::CodecSpec::parse("topk:density=0.5")
        .unwrap()
        .codec()
        .clone();
    let plan = plan_for(&d, 0, &*topk).unwrap();
    let x = upload(&d, &*s, &shim::f32_bytes(&[1.0; 8]));
    let p = d.alloc_device(0, 32).unwrap();
    // SAFETY: every call is refused before anything is enqueued.
    unsafe {
        let e = plan
            .encode(&*s, x.addr(), p.addr(), 1 << 32, 1, 0)
            .unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        let e = plan.encode(&*s, x.addr(), p.addr(), 8, 1, 0).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("scratch")),
            "{e}"
        );
        let e = plan
            .decode(&*s, p.addr(), x.addr(), 8, true, 0, 0)
            .unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("bad")),
            "{e}"
        );
    }
    s.synchronize(WAIT).unwrap();
}

/// Device memory mapped right after page-locked memory starts where that range ends: a
/// launch given its address must reach the device memory, not take it for the page-locked
/// range's end (it once did: the kernel wrote through the unmapped device address and the
/// process died of SIGSEGV, now and then, as mappings happened to fall).
#[test]
fn device_memory_starting_where_pinned_memory_ends() {
    let Some(d) = driver(1) else { return };
    let s = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_reduce_sum_u32").unwrap();
    let page = 4096;
    // New mappings go below older ones, into the highest hole they fit: free one page just
    // above page-locked memory, and the device memory's address mapping (made first) fills
    // it. Keep every try alive so no other hole is left.
    let mut kept = Vec::new();
    let adjacent = (0..64).find_map(|_| {
        let above = d.alloc_pinned(page).unwrap();
        let pinned = d.alloc_pinned(page).unwrap();
        drop(above);
        let dev = d.alloc_device(0, page).unwrap();
        if pinned.ptr() as u64 + page as u64 == dev.addr() {
            return Some((dev, pinned));
        }
        kept.push((dev, pinned));
        None
    });
    let Some((dev, pinned)) = adjacent else {
        eprintln!("skipped: no device memory was mapped right after page-locked memory");
        return;
    };
    let n = page / 4;
    let a: Vec<u8> = (0..n as u32).flat_map(|v| v.to_le_bytes()).collect();
    // SAFETY: `pinned` holds `page` bytes; `a` lives until the synchronize below.
    unsafe {
        std::ptr::copy_nonoverlapping(a.as_ptr(), pinned.ptr(), page);
        s.copy_to_device(dev.addr(), a.as_ptr(), page).unwrap();
    }
    // dev = dev + pinned = 2a.
    let args = [
        Arg::Ptr(dev.addr()),
        Arg::Ptr(dev.addr()),
        Arg::Ptr(pinned.ptr() as u64),
        Arg::U64(n as u64),
    ];
    launch(&*s, &*f, n, &args).unwrap();
    let got = download(&*s, dev.addr(), page);
    for (i, c) in got.chunks_exact(4).enumerate() {
        assert_eq!(
            u32::from_le_bytes(c.try_into().unwrap()),
            2 * i as u32,
            "{i}"
        );
    }
}
