//! The CUDA driver contract (`qccl::gpu::driver`) against the real driver on a GPU: copies
//! both ways at awkward sizes, stream ordering, events across streams, pointer lookup, bad
//! addresses refused, device identity, a stream waiting for a page-locked word, kernel
//! launches (NVRTC images of kernels/, compared with the Rust reduction) and their errors,
//! the codecs' launch plans against the Rust codecs (tests/codec_plans).
//!
//! They need an NVIDIA GPU, so they are ignored by default. Run them with
//! `QCCL_REQUIRE_GPU=1 cargo test --test gpu_driver -- --ignored`. Without a GPU each test
//! skips with a message, unless QCCL_REQUIRE_GPU=1 makes that a failure.
#![cfg(feature = "cuda")]

mod codec_plans;
mod shim;

use qccl::gpu::driver::{Arg, DeviceMem, Driver, Event, Memory, Stream};
use qccl::internal::CudaDriver;
use qccl::Error;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(30);

/// The driver, or None (skip) when this machine has no GPU.
fn driver() -> Option<CudaDriver> {
    match CudaDriver::open() {
        Ok(driver) => Some(driver),
        Err(e) => {
            assert_ne!(
                std::env::var("QCCL_REQUIRE_GPU").as_deref(),
                Ok("1"),
                "QCCL_REQUIRE_GPU=1 but no GPU: {e}"
            );
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// `len` bytes of a pattern that differs for each `seed` and has no short period.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(131) ^ (i >> 8) ^ (usize::from(seed) * 29)) as u8)
        .collect()
}

/// Copies `data` to device memory of the same length and returns that memory.
fn upload(driver: &CudaDriver, stream: &dyn Stream, data: &[u8]) -> Box<dyn DeviceMem> {
    let mem = driver.alloc_device(0, data.len()).unwrap();
    // SAFETY: `data` lives and is unchanged until the synchronize below.
    unsafe { stream.copy_to_device(mem.addr(), data.as_ptr(), data.len()) }.unwrap();
    stream.synchronize(WAIT).unwrap();
    mem
}

/// Copies `len` bytes at device address `addr` back to a new vector.
fn download(stream: &dyn Stream, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` lives and is not touched until the synchronize below.
    unsafe { stream.copy_to_host(out.as_mut_ptr(), addr, len) }.unwrap();
    stream.synchronize(WAIT).unwrap();
    out
}

fn assert_invalid(r: qccl::Result<()>, want: &str) {
    match r {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains(want), "{msg}"),
        other => panic!("expected InvalidArgument containing {want:?}, got {other:?}"),
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn devices_are_named() {
    let Some(driver) = driver() else { return };
    assert_eq!(driver.kind(), "cuda");
    assert!(driver.device_count() >= 1);
    for ordinal in 0..driver.device_count() {
        let info = driver.device(ordinal).unwrap();
        eprintln!("{info:?}");
        assert_eq!(info.ordinal, ordinal);
        assert!(!info.name.is_empty());
        assert!(
            info.bus_id.contains(':') && info.bus_id.contains('.'),
            "{info:?}"
        );
        assert!(info.memory >= 1 << 30, "{info:?}");
    }
    let n = driver.device_count();
    let e = driver.device(n).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(
        e.to_string().contains(&format!("no CUDA device {n}")),
        "{e}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn copies_both_ways_at_awkward_sizes() {
    let Some(driver) = driver() else { return };
    let stream = driver.create_stream(0).unwrap();
    for (i, len) in [
        1usize,
        3,
        7,
        4095,
        4097,
        65_537,
        (1 << 20) + 13,
        (16 << 20) + 1,
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern(len, i as u8);
        // Pageable source, pinned destination.
        let mem = upload(&driver, stream.as_ref(), &data);
        let pinned = driver.alloc_pinned(len).unwrap();
        assert_eq!(pinned.len(), len);
        // SAFETY: the pinned block lives and is untouched until the synchronize.
        unsafe { stream.copy_to_host(pinned.ptr(), mem.addr(), len) }.unwrap();
        stream.synchronize(WAIT).unwrap();
        // SAFETY: the copy is done; the block holds `len` initialised bytes.
        let back = unsafe { std::slice::from_raw_parts(pinned.ptr(), len) };
        assert!(back == &data[..], "pinned copy back differs at {len} bytes");
        // Pinned source, pageable destination, at an odd offset inside the allocation.
        if len > 2 {
            let tail = pattern(len - 1, i as u8 + 100);
            // SAFETY: as above; `pinned` has len >= len - 1 bytes.
            unsafe { std::ptr::copy_nonoverlapping(tail.as_ptr(), pinned.ptr(), len - 1) };
            // SAFETY: the pinned block lives and is unchanged until the synchronize.
            unsafe { stream.copy_to_device(mem.addr() + 1, pinned.ptr(), len - 1) }.unwrap();
            stream.synchronize(WAIT).unwrap();
            let back = download(stream.as_ref(), mem.addr(), len);
            assert_eq!(back[0], data[0]);
            assert!(back[1..] == tail[..], "offset copy differs at {len} bytes");
        }
        // A zero-length copy is a no-op, whatever the addresses.
        // SAFETY: nothing is copied.
        unsafe { stream.copy_to_host(std::ptr::null_mut(), 0, 0) }.unwrap();
        // SAFETY: nothing is copied.
        unsafe { stream.copy_to_device(0, std::ptr::null(), 0) }.unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn work_on_one_stream_runs_in_order() {
    let Some(driver) = driver() else { return };
    let stream = driver.create_stream(0).unwrap();
    let len = 32 << 20;
    let first = pattern(len, 1);
    let second = pattern(4096, 2);
    let mem = driver.alloc_device(0, len).unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: every buffer lives and is untouched until the synchronize below.
    unsafe {
        stream
            .copy_to_device(mem.addr(), first.as_ptr(), len)
            .unwrap();
        stream
            .copy_to_device(mem.addr() + 8, second.as_ptr(), second.len())
            .unwrap();
        stream
            .copy_to_host(out.as_mut_ptr(), mem.addr(), len)
            .unwrap();
    }
    let done = stream.record().unwrap();
    done.synchronize(WAIT).unwrap();
    assert!(done.query().unwrap());
    let mut want = first.clone();
    want[8..8 + second.len()].copy_from_slice(&second);
    assert!(out == want, "the copies did not run in the order enqueued");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn wait_event_orders_two_streams() {
    let Some(driver) = driver() else { return };
    let writer = driver.create_stream(0).unwrap();
    let reader = driver.create_stream(0).unwrap();
    let len = 64 << 20;
    let data = pattern(len, 3);
    let pinned = driver.alloc_pinned(len).unwrap();
    // SAFETY: `pinned` has `len` bytes; no copy uses it yet.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), pinned.ptr(), len) };
    let mem = driver.alloc_device(0, len).unwrap();
    let mut out = vec![0u8; len];
    for round in 0..3 {
        // SAFETY: `pinned` and `out` live and are untouched until `reader` is synchronised.
        unsafe { writer.copy_to_device(mem.addr(), pinned.ptr(), len) }.unwrap();
        let written = writer.record().unwrap();
        reader.wait_event(written.as_ref()).unwrap();
        // SAFETY: as above.
        unsafe { reader.copy_to_host(out.as_mut_ptr(), mem.addr(), len) }.unwrap();
        reader.synchronize(WAIT).unwrap();
        assert!(written.query().unwrap(), "round {round}");
        assert!(
            out == data,
            "round {round}: the reader ran before the writer's copy"
        );
        out.fill(0);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn pointers_are_located() {
    let Some(driver) = driver() else { return };
    let mem = driver.alloc_device(0, 4096).unwrap();
    let pinned = driver.alloc_pinned(4096).unwrap();
    let pageable = vec![0u8; 4096];
    let on_stack = 0u64;
    assert_eq!(
        driver.locate(mem.addr()).unwrap(),
        Memory::Device { ordinal: 0 }
    );
    assert_eq!(
        driver.locate(mem.addr() + 4095).unwrap(),
        Memory::Device { ordinal: 0 }
    );
    assert_eq!(driver.locate(pinned.ptr() as u64).unwrap(), Memory::Host);
    assert_eq!(
        driver.locate(pinned.ptr() as u64 + 100).unwrap(),
        Memory::Host
    );
    assert_eq!(
        driver.locate(pageable.as_ptr() as u64).unwrap(),
        Memory::Host
    );
    assert_eq!(
        driver.locate(&on_stack as *const u64 as u64).unwrap(),
        Memory::Host
    );
    assert_eq!(driver.locate(0).unwrap(), Memory::Host);
    assert_eq!(mem.ordinal(), 0);
    assert_eq!(mem.len(), 4096);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn bad_addresses_and_arguments_are_refused() {
    let Some(driver) = driver() else { return };
    let n = driver.device_count();
    let stream = driver.create_stream(0).unwrap();
    let mem = driver.alloc_device(0, 4096).unwrap();
    let pinned = driver.alloc_pinned(4096).unwrap();
    let mut host = vec![0u8; 8192];
    let p = host.as_mut_ptr();
    // SAFETY (all copies below): each is refused before anything is enqueued, which is
    // what the test checks; the buffers outlive the calls anyway.
    unsafe {
        // Past the end of the allocation (cuMemAlloc memory: one allocation, strictly).
        assert_invalid(
            stream.copy_to_host(p, mem.addr(), 4097),
            "past their allocation",
        );
        assert_invalid(
            stream.copy_to_host(p, mem.addr() + 4000, 97),
            "past their allocation",
        );
        assert_invalid(
            stream.copy_to_device(mem.addr() + 1, p, 4096),
            "past their allocation",
        );
        // Host memory, pinned or pageable, is not device memory.
        let pageable = p as u64;
        assert_invalid(stream.copy_to_host(p, pageable, 16), "not device memory");
        assert_invalid(
            stream.copy_to_host(p, pinned.ptr() as u64, 16),
            "not device memory",
        );
        assert_invalid(
            stream.copy_to_device(pinned.ptr() as u64, p, 16),
            "not device memory",
        );
        assert_invalid(stream.copy_to_device(0x10, p, 16), "not device memory");
        // Null host pointers.
        assert_invalid(
            stream.copy_to_host(std::ptr::null_mut(), mem.addr(), 1),
            "null",
        );
        assert_invalid(
            stream.copy_to_device(mem.addr(), std::ptr::null(), 1),
            "null",
        );
    }
    // Ordinals and lengths.
    let no_device = |r: qccl::Result<()>| assert_invalid(r, &format!("no CUDA device {n}"));
    no_device(driver.alloc_device(n, 16).map(drop));
    no_device(driver.create_stream(n).map(drop));
    // SAFETY: refused before the handle is used.
    no_device(unsafe { driver.borrow_stream(n, std::ptr::null_mut()) }.map(drop));
    assert_invalid(driver.alloc_device(0, 0).map(drop), "at least one byte");
    assert_invalid(driver.alloc_pinned(0).map(drop), "at least one byte");
    // An event of another driver.
    assert_invalid(stream.wait_event(&Foreign), "not made by the CUDA driver");
    // The context is still healthy: a good copy works after all of the above.
    let data = pattern(4096, 9);
    // SAFETY: `data` lives until the synchronize in `download`.
    unsafe { stream.copy_to_device(mem.addr(), data.as_ptr(), 4096) }.unwrap();
    assert_eq!(download(stream.as_ref(), mem.addr(), 4096), data);
}

/// An event no CUDA driver made.
struct Foreign;

impl Event for Foreign {
    fn query(&self) -> qccl::Result<bool> {
        Ok(true)
    }
    fn synchronize(&self, _: Duration) -> qccl::Result<()> {
        Ok(())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn borrowed_streams_work_and_are_left_alone() {
    let Some(driver) = driver() else { return };
    let own = driver.create_stream(0).unwrap();
    assert!(!own.raw().is_null());
    let data = pattern(1 << 20, 5);
    let mem = upload(&driver, own.as_ref(), &data);
    // The legacy default stream (null), twice: borrowing it never destroys it.
    for _ in 0..2 {
        // SAFETY: null is the legacy default stream.
        let legacy = unsafe { driver.borrow_stream(0, std::ptr::null_mut()) }.unwrap();
        assert!(legacy.raw().is_null());
        assert_eq!(legacy.ordinal(), 0);
        assert_eq!(download(legacy.as_ref(), mem.addr(), data.len()), data);
    }
    // qccl's own stream borrowed by its handle; dropping the borrow leaves it usable.
    {
        // SAFETY: `own` outlives the borrow.
        let borrowed = unsafe { driver.borrow_stream(0, own.raw()) }.unwrap();
        assert_eq!(borrowed.raw(), own.raw());
        assert_eq!(download(borrowed.as_ref(), mem.addr(), data.len()), data);
    }
    assert_eq!(download(own.as_ref(), mem.addr(), data.len()), data);
    // Events recorded on the legacy stream order a created stream's work.
    // SAFETY: null is the legacy default stream.
    let legacy = unsafe { driver.borrow_stream(0, std::ptr::null_mut()) }.unwrap();
    let fresh = pattern(1 << 20, 6);
    // SAFETY: `fresh` lives until `own` is synchronised below (it waits for the copy).
    unsafe { legacy.copy_to_device(mem.addr(), fresh.as_ptr(), fresh.len()) }.unwrap();
    own.wait_event(legacy.record().unwrap().as_ref()).unwrap();
    assert_eq!(download(own.as_ref(), mem.addr(), fresh.len()), fresh);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn waits_are_bounded_and_streams_drop_cleanly() {
    let Some(driver) = driver() else { return };
    let len = 256 << 20;
    let data = vec![7u8; len];
    let mem = driver.alloc_device(0, len).unwrap();
    let stream = driver.create_stream(0).unwrap();
    // A pageable 256 MiB copy takes tens of milliseconds: a zero timeout returns at once,
    // either done or a Timeout naming the stream.
    // SAFETY: `data` lives until the stream is synchronised below.
    unsafe { stream.copy_to_device(mem.addr(), data.as_ptr(), len) }.unwrap();
    let event = stream.record().unwrap();
    match event.synchronize(Duration::ZERO) {
        Ok(()) => eprintln!("the copy was already done"),
        Err(Error::Timeout(msg)) => assert!(msg.contains("CUDA device 0"), "{msg}"),
        Err(e) => panic!("unexpected error: {e}"),
    }
    event.synchronize(WAIT).unwrap();
    // Dropping a stream with work queued waits for it (bounded) and destroys it.
    // SAFETY: `data` outlives the stream, whose drop waits for the copy.
    unsafe { stream.copy_to_device(mem.addr(), data.as_ptr(), len) }.unwrap();
    drop(stream);
    // Streams and events may move between threads.
    let stream = driver.create_stream(0).unwrap();
    let (stream, event) = std::thread::spawn(move || {
        let event = stream.record().unwrap();
        (stream, event)
    })
    .join()
    .expect("recording on another thread");
    event.synchronize(WAIT).unwrap();
    stream.synchronize(WAIT).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn a_stream_waits_for_a_word() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let Some(d) = driver() else { return };
    let s = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 4096).unwrap();
    let gate = d.alloc_pinned(8).unwrap();
    // SAFETY: page-locked, page-aligned, ours.
    let word = unsafe { &*(gate.ptr() as *const AtomicU32) };
    word.store(0, Ordering::Release);
    // SAFETY: the gate outlives the wait (synchronized below).
    unsafe { s.wait_word(gate.ptr() as *const u32, 2) }.unwrap();
    let data = pattern(4096, 5);
    // SAFETY: `data` lives until the synchronize below.
    unsafe { s.copy_to_device(mem.addr(), data.as_ptr(), data.len()) }.unwrap();
    let done = s.record().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.query().unwrap(), "ran before the word was stored");
    word.store(1, Ordering::Release);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.query().unwrap(), "ran below the value");
    word.store(2, Ordering::Release);
    done.synchronize(WAIT).unwrap();
    assert_eq!(download(&*s, mem.addr(), 4096), data);
}

/// Little-endian f32 bytes of `n` values that sum exactly in either order.
fn f32_data(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .flat_map(|i| (((i * 7 + seed) % 1000) as f32 * 0.5).to_le_bytes())
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn kernels_launch_and_match_rust() {
    let Some(d) = driver() else { return };
    let s = d.create_stream(0).unwrap();
    let f = d.function(0, "qccl_reduce_sum_f32").unwrap();
    assert_eq!(f.name(), "qccl_reduce_sum_f32");
    assert_eq!(f.ordinal(), 0);
    // Looked up once: the same function again.
    let again = d.function(0, "qccl_reduce_sum_f32").unwrap();
    assert!(std::ptr::addr_eq(&*f, &*again));
    for n in [0usize, 1, 7, 4099, 1_000_003] {
        let (a, b) = (f32_data(n, 1), f32_data(n, 2));
        let mut want = vec![0u8; a.len()];
        qccl::internal::reduce3(qccl::DType::Float32, qccl::ReduceOp::Sum, &mut want, &a, &b);
        let da = upload(&d, &*s, &[&a[..], &[0; 4]].concat());
        let db = upload(&d, &*s, &[&b[..], &[0; 4]].concat());
        let grid = n.div_ceil(256).clamp(1, 1024) as u32;
        let args = [
            Arg::Ptr(da.addr()),
            Arg::Ptr(da.addr()),
            Arg::Ptr(db.addr()),
            Arg::U64(n as u64),
        ];
        // SAFETY: reduce.cu's (out, a, b, count) on live device memory of n floats each,
        // kept until the download synchronises.
        unsafe { s.launch(&*f, grid, 256, &args) }.unwrap();
        assert_eq!(download(&*s, da.addr(), a.len()), want, "n={n}");
    }
    let avg = d.function(0, "qccl_finish_avg_f32").unwrap();
    let x = f32_data(1000, 3);
    let mut want = x.clone();
    qccl::internal::finish_avg(qccl::DType::Float32, &mut want, 3);
    let dx = upload(&d, &*s, &x);
    let args = [Arg::Ptr(dx.addr()), Arg::U64(1000), Arg::U64(3)];
    // SAFETY: (x, count, n) on 1000 live floats, kept until the download.
    unsafe { s.launch(&*avg, 4, 256, &args) }.unwrap();
    assert_eq!(download(&*s, dx.addr(), x.len()), want);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn bad_kernels_and_launches_are_refused() {
    let Some(d) = driver() else { return };
    let s = d.create_stream(0).unwrap();
    for name in ["qccl_reduce_sum_f33", "not a name"] {
        let e = d.function(0, name).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains(name), "{e}");
    }
    let f = d.function(0, "qccl_reduce_sum_u8").unwrap();
    let mem = d.alloc_device(0, 16).unwrap();
    let p = Arg::Ptr(mem.addr());
    // SAFETY: refused before reaching the driver.
    let r = unsafe { s.launch(&*f, 0, 256, &[p, p, p, Arg::U64(16)]) };
    assert_invalid(r, "qccl_reduce_sum_u8");
    // SAFETY: a valid launch on `mem`, synchronised below.
    unsafe { s.launch(&*f, 1, 32, &[p, p, p, Arg::U64(16)]) }.unwrap();
    s.synchronize(WAIT).unwrap();
}

/// The collectives on cudarc slices (`Comm::*_cuda`), three ranks as threads sharing GPU 0,
/// each on a cudarc stream of its own, against float64 references; the calls return once
/// enqueued and the stream orders what follows.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn collectives_on_cudarc_slices() {
    use cudarc::driver::CudaContext;
    use qccl::{Comm, Config, ReduceOp};
    if driver().is_none() {
        return;
    }
    let n = 3;
    let comms = Comm::init_threads(n, Config::default()).unwrap();
    std::thread::scope(|s| {
        for comm in &comms {
            s.spawn(move || {
                let r = comm.rank();
                let ctx = CudaContext::new(0).unwrap();
                let stream = ctx.new_stream().unwrap();
                for count in [0usize, 1, 7, 65_537] {
                    let mine = |p: usize| -> Vec<f32> {
                        (0..count)
                            .map(|i| ((p * 31 + i) % 13) as f32 - 6.0)
                            .collect()
                    };
                    let sum: Vec<f32> = (0..count)
                        .map(|i| (0..n).map(|p| f64::from(mine(p)[i])).sum::<f64>() as f32)
                        .collect();
                    let send = stream.clone_htod(&mine(r)).unwrap();
                    let mut recv = stream.alloc_zeros::<f32>(count.max(1)).unwrap();
                    let mut recv_view = recv.slice_mut(0..count);
                    comm.all_reduce_cuda(&send, &mut recv_view, ReduceOp::Sum, &stream)
                        .unwrap();
                    let got = stream.clone_dtoh(&recv.slice(0..count)).unwrap();
                    assert_eq!(got, sum, "all_reduce_cuda, count {count}");

                    let mut buf = stream.clone_htod(&mine(r)).unwrap();
                    comm.all_reduce_cuda_in_place(&mut buf, ReduceOp::Sum, &stream)
                        .unwrap();
                    comm.broadcast_cuda_in_place(&mut buf, 1, &stream).unwrap();
                    assert_eq!(stream.clone_dtoh(&buf).unwrap(), sum, "in place, {count}");

                    let mut all = stream.alloc_zeros::<f32>((n * count).max(1)).unwrap();
                    let mut all_view = all.slice_mut(0..n * count);
                    comm.all_gather_cuda(&send, &mut all_view, &stream).unwrap();
                    let want: Vec<f32> = (0..n).flat_map(mine).collect();
                    let got = stream.clone_dtoh(&all.slice(0..n * count)).unwrap();
                    assert_eq!(got, want, "all_gather_cuda, count {count}");
                }
                assert!(comm.async_error().is_none());
            });
        }
    });
}

/// Compressed all-reduces on cudarc slices (`Comm::all_reduce_compressed_cuda` and
/// `_in_place`) run the codecs on the GPU: three ranks as threads, two on GPU 0 (out of place
/// and in place) and one on host buffers, end bit-identical, close to the float64 sum, error
/// feedback carried over calls.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn compressed_all_reduce_on_cudarc_slices() {
    use cudarc::driver::CudaContext;
    use qccl::{Algo, Comm, Compression, Config, ReduceOp};
    if driver().is_none() {
        return;
    }
    let n = 3;
    let comms = Comm::init_threads(n, Config::default()).unwrap();
    let c = Compression::parse("fp16:ef=1")
        .unwrap()
        .algo(Algo::Sra)
        .key("cudarc.grad");
    let count = 65_537;
    let mine = |p: usize, call: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((p * 31 + i * 7 + call) % 101) as f32 / 50.0 - 1.0)
            .collect()
    };
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|comm| {
                let c = &c;
                s.spawn(move || {
                    let r = comm.rank();
                    let ctx = CudaContext::new(0).unwrap();
                    let stream = ctx.new_stream().unwrap();
                    let mut outs = Vec::new();
                    for call in 0..3 {
                        let got = match r {
                            0 => {
                                let send = stream.clone_htod(&mine(r, call)).unwrap();
                                let mut recv = stream.alloc_zeros::<f32>(count).unwrap();
                                comm.all_reduce_compressed_cuda(
                                    &send,
                                    &mut recv,
                                    ReduceOp::Sum,
                                    c,
                                    &stream,
                                )
                                .unwrap();
                                stream.clone_dtoh(&recv).unwrap()
                            }
                            1 => {
                                let mut buf = stream.clone_htod(&mine(r, call)).unwrap();
                                comm.all_reduce_compressed_cuda_in_place(
                                    &mut buf,
                                    ReduceOp::Sum,
                                    c,
                                    &stream,
                                )
                                .unwrap();
                                stream.clone_dtoh(&buf).unwrap()
                            }
                            _ => {
                                let mut buf = mine(r, call);
                                comm.all_reduce_compressed(&mut buf, ReduceOp::Sum, c)
                                    .unwrap();
                                buf
                            }
                        };
                        outs.push(got);
                    }
                    assert!(comm.async_error().is_none());
                    if r < 2 {
                        assert_eq!(comm.device_stats().unwrap().calls, 3, "rank {r}");
                    }
                    outs
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        v.iter()
            .map(|c| c.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    for r in 1..n {
        assert!(bits(&results[r]) == bits(&results[0]), "rank {r} differs");
    }
    for (call, got) in results[0].iter().enumerate() {
        let ins: Vec<Vec<f32>> = (0..n).map(|p| mine(p, call)).collect();
        for (i, &g) in got.iter().enumerate() {
            let want: f64 = ins.iter().map(|x| f64::from(x[i])).sum();
            let mag: f64 = ins.iter().map(|x| f64::from(x[i]).abs()).sum();
            assert!(
                (f64::from(g) - want).abs() <= mag / 256.0 + 1e-6,
                "call {call} element {i}: {g}, want {want}"
            );
        }
    }
}

/// Every codec's launch plan on the GPU (fp16, bf16, none, qsgd, efsign, onebit, top-k,
/// MSTopK, random-k) gives the Rust codec's payloads, decodes, check flags and error
/// feedback, bit for bit (the emulated driver's cases).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn codec_plans_match_rust() {
    let Some(d) = driver() else { return };
    codec_plans::float_cases(&d);
    codec_plans::qsgd_cases(&d);
    codec_plans::sign_cases(&d);
    codec_plans::topk_cases(&d);
    codec_plans::mstopk_cases(&d);
    codec_plans::randk_cases(&d);
}
