//! Collectives on device buffers over the emulated GPU driver (QCCL_GPU_EMULATE), with ranks
//! as OS processes: device memory the emulator hands out cannot be read or written by host
//! code at its address (it faults, as a GPU pointer does), so a path that forgot to stage a
//! buffer crashes the rank instead of passing. Checked against float64 references: every
//! dtype at awkward counts, in place and out of place, the caller's stream ordering (a copy
//! enqueued before the call is seen by it; one enqueued after sees the result), mixed host
//! and device buffers, and the errors (a buffer running past its allocation, buffers on a
//! second device), and compressed SRA all-reduces with the codecs on the GPU, device ranks
//! mixed with host ranks in one job, every rank's result bit-identical.
//!
//! The same scenarios run on a real GPU with `--ignored` (QCCL_REQUIRE_GPU=1 makes a missing
//! GPU a failure).
//!
//! The test binary re-executes itself: `child` is the rank's entry point, a no-op unless
//! QCCL_TEST_CHILD names a scenario.

mod common;

use common::job::{text, Job, CHILD};
use common::{check_reduce, input};
use qccl::internal::gpu_driver::{DeviceMem, Driver, Stream};
use qccl::internal::CallBuf;
use qccl::{Algo, Comm, Compression, DType, Layout, ReduceOp, TopK, TopKScheme};
use std::sync::Arc;
use std::time::Duration;

/// Exit code of a rank whose check failed.
const FAILED: i32 = 3;
const WAIT: Duration = Duration::from_secs(30);

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    common::job::exit_with(run_child(&scenario), 0, FAILED);
}

fn run_child(scenario: &str) -> Result<(), String> {
    let comm = Comm::from_env().map_err(|e| e.to_string())?;
    let gpu = qccl::internal::gpu().map_err(|e| e.to_string())?;
    let dev = Dev::new(gpu)?;
    match scenario {
        "collectives" => collectives(&comm, &dev),
        "stream" => stream_ordering(&comm, &dev),
        "enqueue" => enqueue_and_return(&comm, &dev),
        "errors" => errors(&comm, &dev),
        "coded" => coded(&comm, &dev),
        "topk" => hitopk(&comm, &dev),
        "hier_then_stream" => hier_then_stream(&comm, &dev),
        "hier_fault" => hier_fault(&comm, &dev, false),
        "topk_fault" => hier_fault(&comm, &dev, true),
        "coded_enqueue" => coded_enqueue_and_return(&comm, &dev),
        "coded_peer_gone" => coded_peer_gone(&comm, &dev),
        "coded_enqueue_fails" => coded_enqueue_fails(&comm, &dev),
        "bounded" => bounded_staging(&comm, &dev),
        "threads" => threads_on_one_device(),
        other => Err(format!("unknown scenario {other}")),
    }
}

/// Device memory on device 0 and a stream to fill and read it.
struct Dev {
    gpu: Arc<dyn Driver>,
    stream: Box<dyn Stream>,
}

impl Dev {
    fn new(gpu: Arc<dyn Driver>) -> Result<Dev, String> {
        let stream = gpu.create_stream(0).map_err(|e| e.to_string())?;
        Ok(Dev { gpu, stream })
    }

    /// A device buffer holding `bytes` (at least one byte is allocated).
    fn upload(&self, bytes: &[u8]) -> Result<Box<dyn DeviceMem>, String> {
        let m = self
            .gpu
            .alloc_device(0, bytes.len().max(1))
            .map_err(|e| e.to_string())?;
        // SAFETY: `bytes` outlives the synchronize below; the buffer has room.
        unsafe {
            self.stream
                .copy_to_device(m.addr(), bytes.as_ptr(), bytes.len())
        }
        .map_err(|e| e.to_string())?;
        self.stream.synchronize(WAIT).map_err(|e| e.to_string())?;
        Ok(m)
    }

    /// The first `len` bytes of `m`.
    fn download(&self, m: &dyn DeviceMem, len: usize) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; len];
        // SAFETY: `out` outlives the synchronize below.
        unsafe { self.stream.copy_to_host(out.as_mut_ptr(), m.addr(), len) }
            .map_err(|e| e.to_string())?;
        self.stream.synchronize(WAIT).map_err(|e| e.to_string())?;
        Ok(out)
    }
}

fn buf(addr: u64, len: usize, reads: bool, writes: bool) -> CallBuf {
    CallBuf {
        addr,
        len,
        reads,
        writes,
    }
}

/// # Safety
/// `p` is valid for `len` bytes (any value when `len` is 0).
unsafe fn bytes<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts_mut(p, len) }
}

/// All-reduce of `count` elements on device buffers (`send` None: in place in `recv`).
fn all_reduce(
    comm: &Comm,
    send: Option<&dyn DeviceMem>,
    recv: &dyn DeviceMem,
    len: usize,
    c: (usize, DType, ReduceOp),
    stream: *mut std::ffi::c_void,
) -> Result<(), String> {
    let (count, dtype, op) = c;
    let mut bufs: Vec<CallBuf> = send
        .iter()
        .map(|s| buf(s.addr(), len, true, false))
        .collect();
    bufs.push(buf(recv.addr(), len, send.is_none(), true));
    let in_place = send.is_none();
    // SAFETY: both are device buffers of at least `len` bytes, alive for the call; the
    // staged addresses passed to the closure hold `len` bytes each.
    unsafe {
        comm.on_buffers(&bufs, stream, |h| {
            let (s, r) = if in_place {
                (None, bytes(h[0], len))
            } else {
                (Some(&*bytes(h[0], len)), bytes(h[1], len))
            };
            comm.all_reduce_raw(s, r, count, dtype, op, None)
                .map(|_| ())
        })
    }
    .map_err(|e| e.to_string())
}

fn collectives(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let cases = [
        (DType::Float32, ReduceOp::Sum),
        (DType::Float64, ReduceOp::Max),
        (DType::Float16, ReduceOp::Sum),
        (DType::Int32, ReduceOp::Min),
        (DType::Bfloat16, ReduceOp::Avg),
    ];
    for (i, &(dtype, op)) in cases.iter().enumerate() {
        for count in [0usize, 1, 7, 4099, 131_075] {
            let len = count * dtype.size();
            let salt = (i * 100 + count) as u64;
            let ins: Vec<Vec<u8>> = (0..n).map(|p| input(dtype, op, p, count, salt)).collect();
            let what = format!("{dtype:?} {op:?} count {count}");
            // Out of place, then in place.
            let send = dev.upload(&ins[r])?;
            let recv = dev.upload(&vec![0u8; len])?;
            let c = (count, dtype, op);
            all_reduce(comm, Some(&*send), &*recv, len, c, std::ptr::null_mut())?;
            let got = dev.download(&*recv, len)?;
            check_reduce(dtype, op, &ins, 0..count, &got).map_err(|e| format!("{what}: {e}"))?;
            let inplace = dev.upload(&ins[r])?;
            all_reduce(comm, None, &*inplace, len, c, std::ptr::null_mut())?;
            let got2 = dev.download(&*inplace, len)?;
            if got2 != got {
                return Err(format!("{what}: in place differs from out of place"));
            }
        }
    }
    // Broadcast from every root, host send buffer on the root and a device receive buffer.
    let count = 4099;
    for root in 0..n {
        let data: Vec<u8> = (0..count).map(|k| (k * 7 + root) as u8).collect();
        let recv = dev.upload(&vec![0u8; count])?;
        let bufs = [
            buf(data.as_ptr() as u64, count, true, false),
            buf(recv.addr(), count, false, true),
        ];
        // SAFETY: `data` and `recv` hold `count` bytes and live through the call.
        unsafe {
            comm.on_buffers(&bufs, std::ptr::null_mut(), |h| {
                comm.broadcast_raw(
                    Some(&*bytes(h[0], count)),
                    bytes(h[1], count),
                    count,
                    DType::Uint8,
                    root,
                )
            })
        }
        .map_err(|e| e.to_string())?;
        if dev.download(&*recv, count)? != data {
            return Err(format!("broadcast from {root}: wrong bytes"));
        }
    }
    Ok(())
}

/// The caller's stream: a copy enqueued on it before the call is what the call reads, and a
/// copy enqueued after the call returns reads the result.
fn stream_ordering(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let count = 1 << 20;
    let len = 4 * count;
    let user = dev.gpu.create_stream(0).map_err(|e| e.to_string())?;
    let buf = dev.upload(&vec![0u8; len])?;
    for round in 0..3 {
        let mine: Vec<f32> = (0..count).map(|i| ((r + round + i) % 13) as f32).collect();
        // Enqueued, not waited for: the call must order itself after it.
        // SAFETY: `mine` lives until the call below returned, which is after the copy ran.
        unsafe { user.copy_to_device(buf.addr(), mine.as_ptr().cast(), len) }
            .map_err(|e| e.to_string())?;
        let c = (count, DType::Float32, ReduceOp::Sum);
        all_reduce(comm, None, &*buf, len, c, user.raw())?;
        let mut out = vec![0f32; count];
        // SAFETY: `out` outlives the synchronize.
        unsafe { user.copy_to_host(out.as_mut_ptr().cast(), buf.addr(), len) }
            .map_err(|e| e.to_string())?;
        user.synchronize(WAIT).map_err(|e| e.to_string())?;
        for (i, &x) in out.iter().enumerate() {
            let want: usize = (0..n).map(|p| (p + round + i) % 13).sum();
            if x != want as f32 {
                return Err(format!("round {round}: element {i} is {x}, want {want}"));
            }
        }
    }
    Ok(())
}

/// On a caller's stream a call returns once enqueued: the stream is held shut (it waits for
/// a word the test stores later), two in-place all-reduces are called on it and return, the
/// application allocates device memory, then the stream is opened and read back after them:
/// both ran, in order, on what the stream held when they were called. The allocation makes
/// CUDA order all later work behind the held stream (implicit synchronisation), so each
/// call must have enqueued every copy it needs before returning (seen hanging on an H200
/// when the comm's worker enqueued the copies out after the collective).
fn enqueue_and_return(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let count = 1 << 18;
    let len = 4 * count;
    let e = |e: qccl::Error| e.to_string();
    let d = gated_twice(comm, dev, count, |d, user| {
        let bufs = [buf(d, len, true, true)];
        let call = comm
            .prepare_all_reduce(count, DType::Float32, ReduceOp::Sum, None)
            .map_err(e)?;
        // SAFETY: `d` lives until the stream passed the calls (`gated_twice` synchronizes).
        unsafe {
            comm.on_stream(&bufs, user, Some(call.coded_calls()), move |eng, h| {
                call.run(eng, None, bytes(h[0], len)).map(|_| ())
            })
        }
        .map_err(e)
    })?;
    let mine: Vec<f32> = (0..count).map(|i| ((r + i) % 5) as f32).collect();
    // Queued (the C ABI's non-blocking and grouped calls): staged in the comm's turn; a
    // blocking call on another buffer made meanwhile waits behind it without sharing its
    // staging (it holds the blocking calls' staging while it waits for its turn).
    let call = comm
        .prepare_all_reduce(count, DType::Float32, ReduceOp::Sum, None)
        .map_err(e)?;
    let queued = vec![buf(d.addr(), len, true, true)];
    // SAFETY: `d` lives until the request ended (waited below).
    let req = unsafe {
        comm.submit_on_buffers(queued, None, move |eng, h| {
            call.run(eng, None, bytes(h[0], len)).map(|_| ())
        })
    }
    .map_err(e)?;
    let other = dev.upload(bytemuck::cast_slice(&mine))?;
    let c = (count, DType::Float32, ReduceOp::Sum);
    all_reduce(comm, None, &*other, len, c, std::ptr::null_mut())?;
    req.wait().map_err(e)?;
    for (m, what, times) in [(&d, "queued", n * n), (&other, "blocking", 1)] {
        let out = dev.download(&**m, len)?;
        for (i, x) in out.chunks_exact(4).enumerate() {
            let x = f32::from_ne_bytes(x.try_into().expect("4 bytes"));
            let want = (0..n).map(|p| (p + i) % 5).sum::<usize>() * times;
            if x != want as f32 {
                return Err(format!("{what}: element {i} is {x}, want {want}"));
            }
        }
    }
    Ok(())
}

/// The gated pattern of the enqueue-and-return scenarios: `call` twice on zeros to warm up,
/// then a stream of the caller's held shut (waiting for a word stored later) and, behind
/// the gate, a copy of this rank's
/// `(rank + i) % 5` into a device buffer of `count` f32s; `call(buffer, stream)` twice (each
/// an in-place sum on the stream that must return while the gate is shut); an allocation
/// (CUDA then orders all later work behind the held stream); the gate opened and the buffer
/// read back on the stream: both calls ran, in order, on what the stream held when they
/// were made (`n` times the sum). Returns the buffer.
fn gated_twice(
    comm: &Comm,
    dev: &Dev,
    count: usize,
    mut call: impl FnMut(u64, *mut std::ffi::c_void) -> Result<(), String>,
) -> Result<Box<dyn DeviceMem>, String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    let (n, r) = (comm.size(), comm.rank());
    let len = 4 * count;
    let e = |e: qccl::Error| e.to_string();
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let gate = dev.gpu.alloc_pinned(4).map_err(e)?;
    // SAFETY: page-locked, page-aligned, ours.
    let word = unsafe { &*(gate.ptr() as *const AtomicU32) };
    word.store(0, Ordering::Release);
    let d = dev.upload(&vec![0u8; len])?;
    // Two calls to warm up (sums of zeros), behind the gate too but opened 300 ms later
    // from another thread whatever happens: what two calls in flight allocate on first use
    // (page-locked staging, the codecs' buffers) is there before the gate shuts for good.
    // On a GPU allocating page-locked memory may wait for the device's work, the held
    // stream included, which only this thread would open: behind the gate, forever.
    // SAFETY: the gate outlives the stream's wait (stored below, then synchronized).
    unsafe { user.wait_word(gate.ptr() as *const u32, 1) }.map_err(e)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            word.store(1, Ordering::Release);
        });
        (0..2).try_for_each(|_| call(d.addr(), user.raw()))
    })?;
    user.synchronize(WAIT).map_err(e)?;
    let mine: Vec<f32> = (0..count).map(|i| ((r + i) % 5) as f32).collect();
    // Page-locked, and allocated before the gate shuts, for the same reason (and a copy
    // from pageable memory returns only once done).
    let staged = dev.gpu.alloc_pinned(len).map_err(e)?;
    // SAFETY: `staged` holds `len` bytes, ours alone until the copy below is enqueued.
    unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr().cast::<u8>(), staged.ptr(), len) };
    // SAFETY: the gate outlives the stream's wait (it is stored below, then synchronized).
    unsafe { user.wait_word(gate.ptr() as *const u32, 2) }.map_err(e)?;
    // Behind the gate: what the calls must read.
    // SAFETY: `staged` lives until the synchronize below.
    unsafe { user.copy_to_device(d.addr(), staged.ptr(), len) }.map_err(e)?;
    for _ in 0..2 {
        call(d.addr(), user.raw())?;
    }
    if word.load(Ordering::Acquire) != 1 {
        return Err("the gate moved by itself".into());
    }
    // The gate opens from another thread once the calls returned: on a GPU the allocation
    // may wait for the device's work (the held stream included) before it returns.
    let returned = std::sync::atomic::AtomicBool::new(false);
    let allocated = std::thread::scope(|s| {
        s.spawn(|| {
            while !returned.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(200));
            word.store(2, Ordering::Release);
        });
        returned.store(true, Ordering::Release);
        dev.gpu.alloc_device(0, 4096)
    });
    let _scratch = allocated.map_err(e)?;
    let mut out = vec![0f32; count];
    // SAFETY: `out` outlives the synchronize.
    unsafe { user.copy_to_host(out.as_mut_ptr().cast(), d.addr(), len) }.map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    if let Some(err) = comm.async_error() {
        return Err(format!("async error: {err}"));
    }
    for (i, &x) in out.iter().enumerate() {
        let once: usize = (0..n).map(|p| (p + i) % 5).sum();
        if x != (once * n) as f32 {
            return Err(format!("element {i} is {x}, want {}", once * n));
        }
    }
    Ok(d)
}

/// A compressed all-reduce with the codecs on the GPU, on a caller's stream, returns once
/// enqueued: the stream is held shut, two in-place calls (the second with error feedback)
/// are made on it and return, the application allocates device memory (after which CUDA
/// orders all later work behind the held stream), then the stream is opened and read back:
/// both ran, in order, on what the stream held when they were called. The calls' kernels
/// were all enqueued when they were made; the comm's worker enqueues nothing, so nothing of
/// theirs waits behind the held stream.
fn coded_enqueue_and_return(comm: &Comm, dev: &Dev) -> Result<(), String> {
    // Small integers: fp16 holds them and their sums exactly.
    let count = (1 << 16) + 3;
    let e = |e: qccl::Error| e.to_string();
    let before = comm.device_stats().map_err(e)?;
    // A compressed all-reduce of `count` f32 in place at `d`, on `user` (from inside
    // `gated_twice` only: it keeps `d` alive until the stream passed the calls).
    let coded_at = |c: &Compression, d: u64, user: *mut std::ffi::c_void| {
        let p = comm
            .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, c)
            .map_err(e)?;
        // SAFETY: `d` lives until the stream passed the calls (`gated_twice` synchronizes).
        unsafe { comm.all_reduce_compressed_at(p, None, d, user) }
            .map(drop)
            .map_err(e)
    };
    // Two calls to warm up (`gated_twice`), then the two gated ones.
    let mut specs = ["fp16", "fp16:ef=1"].into_iter().cycle().take(4);
    gated_twice(comm, dev, count, |d, user| {
        let spec = specs.next().ok_or("a fifth call")?;
        let c = Compression::parse(spec)
            .map_err(e)?
            .algo(Algo::Sra)
            .key("gated");
        coded_at(&c, d, user)
    })?;
    let after = comm.device_stats().map_err(e)?;
    if after.calls - before.calls != 4 || after.enqueued - before.enqueued != 4 {
        return Err(format!(
            "{} calls with the codecs on the GPU, {} returned once enqueued; want 4 and 4",
            after.calls - before.calls,
            after.enqueued - before.enqueued
        ));
    }
    // Behind a non-blocking call still queued (it may run compressed calls of its own, which
    // decide this call's step): the call waits for it to end, then is enqueued and returns.
    let (n, r) = (comm.size(), comm.rank());
    let len = 4 * count;
    let mine: Vec<f32> = (0..count).map(|i| ((r + i) % 5) as f32).collect();
    let (a, b) = (
        dev.upload(bytemuck::cast_slice(&mine))?,
        dev.upload(bytemuck::cast_slice(&mine))?,
    );
    let dense = comm
        .prepare_all_reduce(count, DType::Float32, ReduceOp::Sum, None)
        .map_err(e)?;
    // SAFETY: `a` lives until the request ended (waited below).
    let req = unsafe {
        comm.submit_on_buffers(vec![buf(a.addr(), len, true, true)], None, move |eng, h| {
            dense.run(eng, None, bytes(h[0], len)).map(|_| ())
        })
    }
    .map_err(e)?;
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let c = Compression::parse("fp16").map_err(e)?.algo(Algo::Sra);
    let p = comm
        .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &c)
        .map_err(e)?;
    // SAFETY: `b` lives until the stream passed the call (synchronized below).
    unsafe { comm.all_reduce_compressed_at(p, None, b.addr(), user.raw()) }.map_err(e)?;
    req.wait().map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    let last = comm.device_stats().map_err(e)?;
    if last.enqueued - after.enqueued != 1 {
        return Err("the call behind a queued one did not return once enqueued".into());
    }
    for m in [&a, &b] {
        let got = floats(&dev.download(&**m, len)?);
        for (i, &x) in got.iter().enumerate() {
            let want: usize = (0..n).map(|p| (p + i) % 5).sum();
            if x != want as f32 {
                return Err(format!(
                    "behind a queued call: element {i} is {x}, want {want}"
                ));
            }
        }
    }
    // Behind a staged call on the same held stream, which declared how many compressed calls
    // it runs (a dense all-reduce none): the compressed call's step is known, so it does not
    // wait for the staged call to end (it cannot: the stream is held) and both return at
    // once. Behind a hierarchical compressed call (the codecs on the GPU, its host levels
    // tied to its device work by words: `gpu_hier_stream.rs`), which returns once enqueued
    // too, every device operation of it enqueued before the allocation.
    // (`gated_twice` makes each pair twice: to warm up, then gated.)
    for hier in [false, true] {
        let mut made = 0;
        gated_twice(comm, dev, count, |d, user| {
            made += 1;
            let sra = Compression::parse("fp16").map_err(e)?.algo(Algo::Sra);
            let c = match (made % 2, hier) {
                (1, false) => {
                    let bufs = [buf(d, len, true, true)];
                    let dense = comm
                        .prepare_all_reduce(count, DType::Float32, ReduceOp::Sum, None)
                        .map_err(e)?;
                    // SAFETY: `d` lives until the stream passed the calls (`gated_twice`
                    // synchronizes).
                    return unsafe {
                        comm.on_stream(&bufs, user, Some(dense.coded_calls()), move |eng, h| {
                            dense.run(eng, None, bytes(h[0], len)).map(drop)
                        })
                    }
                    .map_err(e);
                }
                (1, true) => sra.algo(Algo::Hier),
                _ => sra,
            };
            coded_at(&c, d, user)
        })?;
    }
    let end = comm.device_stats().map_err(e)?;
    if end.enqueued - last.enqueued != 6 {
        return Err(format!(
            "{} of 6 compressed calls behind a staged or a hierarchical one returned once \
             enqueued",
            end.enqueued - last.enqueued
        ));
    }
    Ok(())
}

/// A peer leaves while a compressed call with the codecs on the GPU is in flight on a
/// caller's stream: the call has returned, its exchanges fail in the comm's worker, and the
/// stream must still pass the call (every progress value it waits for is stored) with the
/// failure in `async_error`, not hang.
fn coded_peer_gone(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    // Connected first (links are made on first use; dialling a rank that never answers
    // waits out the comm's timeout).
    let mut one = [1f32];
    comm.all_reduce_in_place(&mut one, ReduceOp::Sum)
        .map_err(e)?;
    if comm.rank() == 1 {
        // Gone without a word, as a crashed process.
        std::process::exit(0);
    }
    let count = 4099;
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let d = dev.upload(&vec![0u8; 4 * count])?;
    let c = Compression::parse("qsgd:bits=4,bucket=128,ef=1")
        .map_err(e)?
        .algo(Algo::Sra)
        .key("gone");
    let p = comm
        .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &c)
        .map_err(e)?;
    // SAFETY: `d` lives until the stream passed the call (synchronized below).
    unsafe { comm.all_reduce_compressed_at(p, None, d.addr(), user.raw()) }.map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    let deadline = std::time::Instant::now() + WAIT;
    while comm.async_error().is_none() {
        if std::time::Instant::now() >= deadline {
            return Err("no async error after the peer left".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // A failed comm refuses the next call before enqueueing anything.
    let p = comm
        .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &c)
        .map_err(e)?;
    // SAFETY: as above.
    if unsafe { comm.all_reduce_compressed_at(p, None, d.addr(), user.raw()) }.is_ok() {
        return Err("a call on the failed comm was accepted".into());
    }
    user.synchronize(WAIT).map_err(e)?;
    Ok(())
}

/// Rank 0's compressed call on a stream fails while it is being enqueued (a copy of its
/// device work fails when the stream reaches it, and the stream's queue is kept short, so
/// later enqueues of the call see the sticky error): after the worker took the call's
/// script. The call returns the error, the caller's stream passes, the comm fails, and the
/// peer's call fails instead of waiting: nothing hangs.
fn coded_enqueue_fails(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    let mut one = [1f32];
    comm.all_reduce_in_place(&mut one, ReduceOp::Sum)
        .map_err(e)?;
    let count = 65_536;
    let c = Compression::parse("qsgd:bits=4,bucket=128")
        .map_err(e)?
        .algo(Algo::Sra);
    let p = comm
        .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &c)
        .map_err(e)?;
    if comm.rank() != 0 {
        let mut x = vec![1f32; count];
        return match comm.all_reduce_compressed(&mut x, ReduceOp::Sum, &c) {
            Ok(_) => Err("the peer's call succeeded without rank 0's bytes".into()),
            Err(_) => Ok(()),
        };
    }
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let d = dev.upload(&vec![0u8; 4 * count])?;
    let emu = qccl::internal::emulated_driver().ok_or("not on the emulated driver")?;
    emu.fail_next_copy(0).map_err(e)?;
    let before = comm.device_stats().map_err(e)?;
    // SAFETY: `d` lives until the stream passed the call (synchronized below).
    let called = unsafe { comm.all_reduce_compressed_at(p, None, d.addr(), user.raw()) };
    let msg = match called {
        Ok(_) => return Err("the call enqueued whole though its stream failed".into()),
        Err(err) => err.to_string(),
    };
    if !msg.contains("injected fault") {
        return Err(format!("the call failed for another reason: {msg}"));
    }
    if comm.device_stats().map(|s| s.enqueued).unwrap_or(0) != before.enqueued {
        return Err("a failed call counted as enqueued".into());
    }
    // The caller's stream never waits for the failed call's work.
    user.synchronize(WAIT).map_err(e)?;
    let deadline = std::time::Instant::now() + WAIT;
    while comm.async_error().is_none() {
        if std::time::Instant::now() >= deadline {
            return Err("no async error after the call failed".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Two ranks of one process on one device (threads), each calling on its own stream; the
/// second allocates and uploads its input (a synchronous copy) only after the first called.
/// Had the first call held its rank's stream and returned, the second rank's allocation
/// would order the upload behind that stream, which waits for the second rank's call:
/// neither would ever go on (seen on an H200 with cudarc). With another rank in the
/// process a call on a stream waits for its result instead.
fn threads_on_one_device() -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    let config = qccl::Config {
        timeout: Duration::from_secs(20),
        ..qccl::Config::default()
    };
    let comms = Comm::init_threads(2, config).map_err(e)?;
    let count = 4099;
    let len = 4 * count;
    let input = |p: usize| -> Vec<f32> { (0..count).map(|i| ((p * 7 + i) % 11) as f32).collect() };
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || -> Result<(), String> {
                    let r = comm.rank();
                    let dev = Dev::new(qccl::internal::gpu().map_err(e)?)?;
                    let user = dev.gpu.create_stream(0).map_err(e)?;
                    if r == 1 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let d = dev.upload(bytemuck::cast_slice(&input(r)))?;
                    let c = (count, DType::Float32, ReduceOp::Sum);
                    let bufs = [buf(d.addr(), len, true, true)];
                    let call = comm.prepare_all_reduce(c.0, c.1, c.2, None).map_err(e)?;
                    // SAFETY: `d` lives until the stream passed the call (synchronized below).
                    unsafe {
                        comm.on_stream(
                            &bufs,
                            user.raw(),
                            Some(call.coded_calls()),
                            move |eng, h| call.run(eng, None, bytes(h[0], len)).map(|_| ()),
                        )
                    }
                    .map_err(e)?;
                    user.synchronize(WAIT).map_err(e)?;
                    if let Some(err) = comm.async_error() {
                        return Err(format!("rank {r}: async error: {err}"));
                    }
                    let got = floats(&dev.download(&*d, len)?);
                    for (i, &g) in got.iter().enumerate() {
                        let want: f32 = (0..2).map(|p| input(p)[i]).sum();
                        if g != want {
                            return Err(format!("rank {r} element {i}: {g}, want {want}"));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|h| h.join().map_err(|_| "a rank panicked".to_string())?)
            .collect::<Result<Vec<()>, String>>()
    })?;
    Ok(())
}

/// Page-locked bytes of calls on a stream, capped (QCCL_STAGING_BYTES, set by the parent to
/// two calls' worth): a third call enqueued while the first two cannot finish (the stream is
/// held at a gate) waits for room, and goes once the gate opens; then many calls enqueued on
/// one stream all end right, and the pool never held more than the cap.
fn bounded_staging(comm: &Comm, dev: &Dev) -> Result<(), String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    let (n, r) = (comm.size(), comm.rank());
    let e = |e: qccl::Error| e.to_string();
    let cap: usize = std::env::var("QCCL_STAGING_BYTES")
        .map_err(|_| "QCCL_STAGING_BYTES is not set")?
        .parse()
        .map_err(|_| "QCCL_STAGING_BYTES is not a number")?;
    // Two buffers of 16004 bytes a call: two calls fit in 64 KiB, three do not.
    let count = 4001;
    let len = 4 * count;
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let gate = dev.gpu.alloc_pinned(4).map_err(e)?;
    // SAFETY: page-locked, page-aligned, ours.
    let word = unsafe { &*(gate.ptr() as *const AtomicU32) };
    word.store(0, Ordering::Release);
    let input = |call: usize, p: usize| -> Vec<f32> {
        (0..count)
            .map(|i| ((p * 13 + i * 7 + call * 3) % 17) as f32 - 8.0)
            .collect()
    };
    let calls = 14;
    // Uploaded before the gate shuts: an allocation orders later work behind the held
    // stream (CUDA's implicit synchronisation), the upload's copy too.
    let mut bufs = Vec::new();
    for call in 0..calls {
        let send = dev.upload(bytemuck::cast_slice(&input(call, r)))?;
        let recv = dev.upload(&vec![0u8; len])?;
        bufs.push((send, recv));
    }
    // SAFETY: the gate outlives the stream's wait (stored below, then synchronized).
    unsafe { user.wait_word(gate.ptr() as *const u32, 1) }.map_err(e)?;
    std::thread::scope(|s| -> Result<(), String> {
        // Opens the gate once a call waits for room (none can finish before).
        let opener = s.spawn(|| {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while comm.staging_stats().waits == 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            word.store(1, Ordering::Release);
        });
        for (send, recv) in &bufs {
            let c = comm
                .prepare_all_reduce(count, DType::Float32, ReduceOp::Sum, None)
                .map_err(e)?;
            let cb = [
                buf(send.addr(), len, true, false),
                buf(recv.addr(), len, false, true),
            ];
            // SAFETY: both live until the stream passed the calls (synchronized below).
            unsafe {
                comm.on_stream(&cb, user.raw(), Some(c.coded_calls()), move |eng, h| {
                    c.run(eng, Some(&*bytes(h[0], len)), bytes(h[1], len))
                        .map(drop)
                })
            }
            .map_err(e)?;
        }
        opener.join().map_err(|_| "the gate opener panicked")?;
        Ok(())
    })?;
    user.synchronize(WAIT).map_err(e)?;
    if let Some(err) = comm.async_error() {
        return Err(format!("async error: {err}"));
    }
    for (call, (_, recv)) in bufs.iter().enumerate() {
        let got = floats(&dev.download(&**recv, len)?);
        let ins: Vec<Vec<f32>> = (0..n).map(|p| input(call, p)).collect();
        for (i, &g) in got.iter().enumerate() {
            let want: f64 = ins.iter().map(|x| x[i] as f64).sum();
            if g as f64 != want {
                return Err(format!("call {call} element {i}: {g}, want {want}"));
            }
        }
    }
    // The stream passes a call's copy-out before the worker's drop of the call gives its
    // buffers back to the pool: wait (bounded) for that, it must come.
    let deadline = std::time::Instant::now() + WAIT;
    let mut st = comm.staging_stats();
    while st.lent != 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        st = comm.staging_stats();
    }
    if st.waits == 0 || st.peak > cap || st.peak < 2 * len || st.lent != 0 {
        return Err(format!(
            "staging pool {st:?}: want waits > 0, {} <= peak <= {cap}, nothing lent",
            2 * len
        ));
    }
    Ok(())
}

/// Bad device buffers are refused before any byte moves, naming what is wrong; the comm
/// still works afterwards.
fn errors(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let len = 4096;
    let m = dev.upload(&vec![1u8; len])?;
    let run = |bufs: &[CallBuf]| -> Result<(), String> {
        // SAFETY: never run: every call below is refused before the closure.
        unsafe { comm.on_buffers(bufs, std::ptr::null_mut(), |_| Ok(())) }
            .map_err(|e| e.to_string())
    };
    // Past the end of its allocation.
    let e = run(&[buf(m.addr() + 8, len, true, true)]).err();
    if !e
        .as_deref()
        .is_some_and(|e| e.contains("does not end there"))
    {
        return Err(format!("a buffer past its allocation: {e:?}"));
    }
    // A second device, after the comm's first device call on device 0.
    let first = (1, DType::Uint8, ReduceOp::Max);
    all_reduce(comm, None, &*m, 1, first, std::ptr::null_mut())?;
    let other = dev.gpu.alloc_device(1, len).map_err(|e| e.to_string())?;
    let e = run(&[buf(other.addr(), len, true, true)]).err();
    if !e
        .as_deref()
        .is_some_and(|e| e.contains("this comm's device is 0"))
    {
        return Err(format!("a buffer on device 1: {e:?}"));
    }
    let e = run(&[
        buf(m.addr(), 16, true, false),
        buf(other.addr(), 16, false, true),
    ])
    .err();
    if !e.as_deref().is_some_and(|e| e.contains("two devices")) {
        return Err(format!("buffers on two devices: {e:?}"));
    }
    all_reduce(
        comm,
        None,
        &*m,
        len,
        (len, DType::Uint8, ReduceOp::Max),
        std::ptr::null_mut(),
    )
}

/// One compressed all-reduce case of the `coded` scenario.
struct CodedCase {
    spec: &'static str,
    /// Error feedback keyed by this name (with the layout, if any).
    key: Option<&'static str>,
    layout: Option<Layout>,
    op: ReduceOp,
    counts: Vec<usize>,
    /// Calls per count (error feedback carries over between them).
    calls: usize,
    /// Largest error, relative to the sum of the inputs' magnitudes, per element; None: the
    /// relative L2 error of the whole result is checked against `l2` instead (sparsifiers
    /// have no per-element bound).
    tolerance: Option<f64>,
    l2: f64,
    /// The GPU path must run (a float codec); otherwise it runs when the codec has a launch
    /// plan, and the call is staged when not.
    must_gpu: bool,
    /// The buffers' type: float32, or a half type the call runs on an f32 copy of.
    dtype: DType,
    /// The schedule asked for (None: the tuning's, the all-gather scheme for sparse codecs),
    /// and whether it is the all-gather scheme (one exchange a call) rather than SRA.
    algo: Option<Algo>,
    gather: bool,
}

/// `x` as bytes of `dtype` (float32, float16, bfloat16; halves rounded as `half` does).
fn to_bytes(x: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Float16 => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_ne_bytes())
            .collect(),
        DType::Bfloat16 => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_ne_bytes())
            .collect(),
        // Bits below an f32's: the conversion to the codecs' f32 copy must round them.
        DType::Float64 => x
            .iter()
            .flat_map(|&v| (v as f64 * (1.0 + 1e-9)).to_ne_bytes())
            .collect(),
        _ => bytemuck::cast_slice(x).to_vec(),
    }
}

/// Bytes of `dtype` as f32 values.
fn from_bytes(b: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::Float16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_ne_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Bfloat16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_ne_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::Float64 => b
            .chunks_exact(8)
            .map(|c| f64::from_ne_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        _ => floats(b),
    }
}

/// A compressed all-reduce of `mine` (values of `dtype`) on host buffers; the result's bytes.
fn host_coded(
    comm: &Comm,
    c: &Compression,
    op: ReduceOp,
    mine: &[f32],
    in_place: bool,
    dtype: DType,
) -> Result<Vec<u8>, qccl::Error> {
    fn run<T: qccl::Element>(
        comm: &Comm,
        c: &Compression,
        op: ReduceOp,
        mine: Vec<T>,
        in_place: bool,
    ) -> Result<Vec<u8>, qccl::Error> {
        let mut recv = mine.clone();
        if in_place {
            comm.all_reduce_compressed(&mut recv, op, c)?;
        } else {
            comm.all_reduce_compressed_out_of_place(&mine, &mut recv, op, c)?;
        }
        Ok(bytemuck::cast_slice(&recv).to_vec())
    }
    let bytes = to_bytes(mine, dtype);
    match dtype {
        DType::Float16 => run::<half::f16>(
            comm,
            c,
            op,
            halves(&bytes, half::f16::from_ne_bytes),
            in_place,
        ),
        DType::Bfloat16 => run::<half::bf16>(
            comm,
            c,
            op,
            halves(&bytes, half::bf16::from_ne_bytes),
            in_place,
        ),
        DType::Float64 => {
            let values = bytes
                .chunks_exact(8)
                .map(|b| f64::from_ne_bytes(b.try_into().expect("8 bytes")))
                .collect();
            run::<f64>(comm, c, op, values, in_place)
        }
        _ => run::<f32>(comm, c, op, mine.to_vec(), in_place),
    }
}

/// 16-bit values from their bytes (of any alignment: an empty `Vec<u8>`'s is 1).
fn halves<T>(bytes: &[u8], from: fn([u8; 2]) -> T) -> Vec<T> {
    bytes.chunks_exact(2).map(|c| from([c[0], c[1]])).collect()
}

/// Input `i` of rank `p` in call `call` of case `case`: deterministic, in [-1, 1).
fn coded_input(case: usize, call: usize, p: usize, count: usize) -> Vec<f32> {
    (0..count)
        .map(|i| {
            let k = (p * 7919 + i * 104_729 + call * 31 + case * 17) % 2003;
            k as f32 / 1001.5 - 1.0
        })
        .collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Compressed SRA all-reduces: ranks named in QCCL_TEST_DEVICE_RANKS use device buffers (the
/// codecs on the GPU: checked through `device_stats`), the others host buffers; float32, and
/// float16 and bfloat16 buffers (an f32 copy on the device, as the host's). Every result
/// is compared with the float64 sum of the inputs within the codec's tolerance, and its hash
/// printed (`QCCL-HASH case call hash`) for the parent to compare across ranks.
fn coded(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let on_device = device_rank(r);
    let e = |e: qccl::Error| e.to_string();
    let layered = Layout::new([
        ("conv.weight", 37),
        ("conv.bias", 5),
        ("fc", 1001),
        ("fc2.norm", 17),
        ("head", 4099),
    ]);
    let layered_count = layered.count();
    // On emulated hosts the calls take the hierarchical route instead of the cases' flat
    // schedules, its codecs on the GPU for float32.
    let hier = std::env::var("QCCL_TEST_HIER").is_ok();
    // Every call on a stream of the caller's (a tensor key's residual then stays the
    // host's on every call, as on host ranks).
    let on_streams = std::env::var("QCCL_TEST_STREAMS").is_ok();
    // Compressed intra-host levels too (no GPU path: every call staged).
    let intra = std::env::var("QCCL_TEST_INTRA").is_ok();
    let cases = [
        CodedCase {
            spec: "fp16",
            key: None,
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![0, 1, 7, 4099, 131_075],
            calls: 1,
            tolerance: Some(1.0 / 512.0),
            l2: 0.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "bf16:ef=1",
            key: Some("bf16.grad"),
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![4099, 65_537],
            calls: 4,
            tolerance: Some(1.0 / 32.0),
            l2: 0.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "fp16:ef=1",
            key: Some("fused"),
            layout: Some(layered.clone()),
            op: ReduceOp::Sum,
            counts: vec![layered_count],
            calls: 4,
            tolerance: Some(1.0 / 256.0),
            l2: 0.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "qsgd:bits=4,bucket=128,ef=1",
            key: Some("qsgd.grad"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![4099],
            calls: 3,
            tolerance: None,
            l2: 0.5,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "topk:density=0.25,ef=1",
            key: Some("topk.grad"),
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![1031],
            calls: 3,
            tolerance: None,
            // Error feedback re-sends what earlier calls dropped: a sanity bound only.
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "fp16:ef=1",
            key: Some("half.grad"),
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![1, 4099, 65_537],
            calls: 3,
            // The codec's rounding, then the result's own into float16.
            tolerance: Some(1.0 / 256.0),
            l2: 0.0,
            must_gpu: true,
            dtype: DType::Float16,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "qsgd:bits=4,bucket=128",
            key: None,
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![7, 4099],
            calls: 2,
            tolerance: None,
            l2: 0.5,
            must_gpu: true,
            dtype: DType::Bfloat16,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "qsgd:bits=4,bucket=128,ef=1",
            key: Some("f64.grad"),
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![1, 4099],
            calls: 3,
            tolerance: None,
            l2: 0.5,
            must_gpu: true,
            dtype: DType::Float64,
            algo: Some(Algo::Sra),
            gather: false,
        },
        CodedCase {
            spec: "topk:density=0.1",
            key: None,
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![1031],
            calls: 2,
            tolerance: None,
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Float64,
            algo: None,
            gather: true,
        },
        CodedCase {
            spec: "topk:density=0.1,ef=1",
            key: Some("gather.topk"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![1, 4099],
            calls: 3,
            tolerance: None,
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: None,
            gather: true,
        },
        CodedCase {
            spec: "mstopk:density=0.05,ef=1",
            key: Some("gather.mstopk"),
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![4099],
            calls: 3,
            tolerance: None,
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Bfloat16,
            algo: None,
            gather: true,
        },
        CodedCase {
            spec: "randk:density=0.25",
            key: None,
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![7, 1031],
            calls: 2,
            tolerance: None,
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Float16,
            algo: None,
            gather: true,
        },
        CodedCase {
            spec: "qsgd:bits=8,bucket=64,ef=1",
            key: Some("gather.qsgd"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![4099],
            calls: 3,
            tolerance: None,
            l2: 0.5,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::AllGather),
            gather: true,
        },
        // The ring: partial sums re-encoded at every hop, the owner's encoding forwarded.
        CodedCase {
            spec: "qsgd:bits=4,bucket=128,ef=1",
            key: Some("ring.qsgd"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![1, 7, 4099, 65_537],
            calls: 3,
            tolerance: None,
            l2: 1.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Ring),
            gather: false,
        },
        CodedCase {
            spec: "fp16",
            key: None,
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![0, 1, 7, 4099],
            calls: 2,
            tolerance: Some(1.0 / 128.0),
            l2: 0.0,
            must_gpu: true,
            dtype: DType::Bfloat16,
            algo: Some(Algo::Ring),
            gather: false,
        },
        CodedCase {
            spec: "topk:density=0.25,ef=1",
            key: Some("ring.topk"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![1031],
            calls: 3,
            tolerance: None,
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Ring),
            gather: false,
        },
        // A layered plan on the ring: slices cut across layers, pieces encoded by layer.
        CodedCase {
            spec: "qsgd:bits=8,bucket=64,ef=1",
            key: Some("ring.layers"),
            layout: Some(layered),
            op: ReduceOp::Avg,
            counts: vec![layered_count],
            calls: 3,
            tolerance: None,
            l2: 0.5,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Ring),
            gather: false,
        },
        // The tree: partial sums up, the root's encoding down.
        CodedCase {
            spec: "qsgd:bits=8,bucket=64,ef=1",
            key: Some("tree.qsgd"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![1, 7, 4099, 65_537],
            calls: 3,
            tolerance: None,
            l2: 0.5,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Tree),
            gather: false,
        },
        CodedCase {
            spec: "fp16",
            key: None,
            layout: None,
            op: ReduceOp::Avg,
            counts: vec![0, 1, 4099],
            calls: 2,
            tolerance: Some(1.0 / 128.0),
            l2: 0.0,
            must_gpu: true,
            dtype: DType::Float16,
            algo: Some(Algo::Tree),
            gather: false,
        },
        CodedCase {
            spec: "randk:density=0.25,ef=1",
            key: Some("tree.randk"),
            layout: None,
            op: ReduceOp::Sum,
            counts: vec![1031],
            calls: 3,
            tolerance: None,
            l2: 2.0,
            must_gpu: true,
            dtype: DType::Float32,
            algo: Some(Algo::Tree),
            gather: false,
        },
    ];
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let slice_bytes: usize = std::env::var("QCCL_BUFFSIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512 * 1024);
    // Device calls of several slices per chunk, and their exchanges that began with encodes
    // still queued on the stream.
    let (mut piped, mut overlapped) = (0u64, 0u64);
    for (ci, case) in cases.iter().enumerate() {
        let mut c = Compression::parse(case.spec).map_err(e)?;
        if hier {
            c = c.algo(Algo::Hier).intra_host(intra);
        } else if let Some(a) = case.algo {
            c = c.algo(a);
        }
        if let Some(k) = case.key {
            c = c.key(k);
        }
        if let (Some(k), Some(l)) = (case.key, &case.layout) {
            comm.set_layout(k, l.clone()).map_err(e)?;
        }
        for &count in &case.counts {
            for call in 0..case.calls {
                let what = format!("{} count {count} call {call}", case.spec);
                let dt = case.dtype;
                // The inputs as the buffers hold them (halves rounded).
                let ins: Vec<Vec<f32>> = (0..n)
                    .map(|p| from_bytes(&to_bytes(&coded_input(ci, call, p, count), dt), dt))
                    .collect();
                let in_place = call % 2 == 1;
                let got = if on_device {
                    // Odd calls on a stream of the caller's, even ones on NULL. On the
                    // hierarchical route a call on a stream of another type than float32 is
                    // staged (in bands), its residual the host's: such a tensor key stays
                    // off streams there.
                    let hosted = hier && case.key.is_some() && dt != DType::Float32;
                    let stream = if on_streams || call % 2 == 1 && !hosted {
                        user.raw()
                    } else {
                        std::ptr::null_mut()
                    };
                    // Every third call queued, as the C ABI's non-blocking calls.
                    let queued = call % 3 == 2 && !on_streams;
                    // The hierarchical route's GPU path: calls that return once done, and
                    // calls on float32 on a stream.
                    let waits = stream.is_null() || queued;
                    let on_gpu = waits || dt == DType::Float32;
                    let must_gpu = case.must_gpu && (!hier || on_gpu && !intra);
                    let before = comm.device_stats().map_err(e)?;
                    let banded = comm.piecewise_calls();
                    let how = (case.op, dt, in_place, stream, queued);
                    let (m, input) = coded_on_device(comm, dev, &c, &ins[r], how, hier)?;
                    user.synchronize(WAIT).map_err(e)?;
                    drop(input);
                    if let Some(err) = comm.async_error() {
                        return Err(format!("{what}: async error: {err}"));
                    }
                    let got = from_bytes(&dev.download(&*m, dt.size() * count)?, dt);
                    let after = comm.device_stats().map_err(e)?;
                    let ran = after.calls - before.calls;
                    let gpu_ran = ran == 1;
                    if count > 0 && must_gpu && !gpu_ran {
                        return Err(format!("{what}: the GPU path did not run ({ran} calls)"));
                    }
                    // A call on a stream returns once enqueued, on the hierarchy too.
                    let early = after.enqueued - before.enqueued;
                    if gpu_ran && early != u64::from(!stream.is_null() && !queued) {
                        return Err(format!(
                            "{what}: {early} calls returned once enqueued (stream {stream:?})"
                        ));
                    }
                    // Without a GPU path (on a stream, compressed intra-host levels), a call
                    // on the hierarchy is staged piece by piece, its pieces' copies
                    // pipelined with its levels.
                    let banded = comm.piecewise_calls() - banded;
                    let want = u64::from(hier && count > 0 && !gpu_ran);
                    if banded != want {
                        return Err(format!(
                            "{what}: {banded} calls staged in bands, want {want}"
                        ));
                    }
                    if hier {
                        // The levels' exchanges depend on the pieces and the parts.
                    } else if gpu_ran && n > 1 && case.gather {
                        // The all-gather scheme: one exchange.
                        let exchanges = after.exchanges - before.exchanges;
                        if exchanges != 1 {
                            return Err(format!("{what}: {exchanges} exchanges, want 1"));
                        }
                    } else if gpu_ran && n > 1 {
                        // SRA: two exchanges per slice, slice j+1 encoded before slice j
                        // moves; the ring: 2(n-1) per slice; the tree: two per slice for
                        // the parent and two for the children (the whole buffer sliced).
                        let last = count - count * (n - 1) / n;
                        let nsl = (4 * last).div_ceil(slice_bytes).max(1) as u64;
                        let want = match case.algo {
                            Some(Algo::Ring) => 2 * (n as u64 - 1) * nsl,
                            Some(Algo::Tree) => {
                                let nsl = (4 * count).div_ceil(slice_bytes).max(1) as u64;
                                let links = u64::from(r > 0) + u64::from(2 * r + 1 < n);
                                2 * links * nsl
                            }
                            _ => 2 * nsl,
                        };
                        let exchanges = after.exchanges - before.exchanges;
                        let late = after.late_sends - before.late_sends;
                        if exchanges != want || late > exchanges * (n as u64 - 1) {
                            return Err(format!(
                                "{what}: {exchanges} exchanges ({late} late sends), want {want}"
                            ));
                        }
                        // The ring's and the tree's encodes wait for the previous hop's bytes.
                        if nsl > 1 && case.algo == Some(Algo::Sra) {
                            piped += 1;
                            overlapped += after.overlapped - before.overlapped;
                        }
                    }
                    if gpu_ran
                        && n > 1
                        && !hier
                        && case.layout.is_none()
                        && case.spec.starts_with("fp16")
                        && count >= 16
                    {
                        // Only encoded bytes cross PCIe: every element is encoded once by
                        // this rank, 2 bytes each.
                        let moved = after.to_host - before.to_host;
                        if moved != 2 * count as u64 {
                            return Err(format!(
                                "{what}: {moved} bytes to the host, want {}",
                                2 * count
                            ));
                        }
                    }
                    got
                } else {
                    let bytes = host_coded(comm, &c, case.op, &ins[r], in_place, dt).map_err(e)?;
                    from_bytes(&bytes, dt)
                };
                println!(
                    "QCCL-HASH {ci} {count} {call} {:016x}",
                    fnv(bytemuck::cast_slice(&got))
                );
                check_coded(case, &ins, &got, n).map_err(|m| format!("{what}: {m}"))?;
            }
        }
    }
    if piped > 0 && overlapped == 0 {
        return Err(format!(
            "no exchange of {piped} device calls of several slices began with encodes queued"
        ));
    }
    Ok(())
}

/// `got` against the float64 sum (or average) of `ins` within the case's tolerance.
/// A queued hierarchical compressed all-reduce (which leaves the comm's device side between
/// its pieces), then at once a flat one on a stream of the caller's (whose work is enqueued on
/// that device side when it is made, behind progress waits the worker stores in its turn):
/// the stream call must wait for the queued one to end before it enqueues, or its waits land
/// ahead of the queued call's next kernels and both hang until the comm's timeout. Both
/// results right (fp16 carries these small integer sums exactly), three times.
fn hier_then_stream(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let e = |e: qccl::Error| e.to_string();
    let count = 65_537;
    let mine: Vec<f32> = (0..count).map(|i| ((r + i) % 5) as f32).collect();
    let hier = Compression::parse("fp16").map_err(e)?.algo(Algo::Hier);
    let flat = Compression::parse("fp16").map_err(e)?.algo(Algo::Sra);
    let user = dev.gpu.create_stream(0).map_err(e)?;
    for round in 0..3 {
        let a = dev.upload(bytemuck::cast_slice(&mine))?;
        let b = dev.upload(bytemuck::cast_slice(&mine))?;
        let p = comm
            .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &hier)
            .map_err(e)?;
        // SAFETY: `a` lives until the request ended (waited below).
        let req = unsafe { comm.submit_all_reduce_compressed_at(p, None, a.addr()) }.map_err(e)?;
        let q = comm
            .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &flat)
            .map_err(e)?;
        // SAFETY: `b` lives until the stream passed the call (synchronized below).
        unsafe { comm.all_reduce_compressed_at(q, None, b.addr(), user.raw()) }.map_err(e)?;
        req.wait().map_err(e)?;
        user.synchronize(WAIT).map_err(e)?;
        if let Some(err) = comm.async_error() {
            return Err(format!("round {round}: async error: {err}"));
        }
        for (m, what) in [(&a, "queued hierarchical"), (&b, "flat on a stream")] {
            let got = floats(&dev.download(&**m, 4 * count)?);
            for (i, &x) in got.iter().enumerate() {
                let want: usize = (0..n).map(|p| (p + i) % 5).sum();
                if x != want as f32 {
                    return Err(format!(
                        "round {round}, {what}: element {i} is {x}, want {want}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// On two emulated hosts, a compressed all-reduce on the hierarchy with the codecs on the
/// GPU (`topk`: HiTopK with its top-k on the GPU) whose next copy fails on rank 1, after a
/// call that went through: every rank's call fails within 4 s though the comm's timeout is
/// 20 s (the failing rank aborts the sub-comms, and each rank that fails so in turn), rank
/// 1's naming the fault. Every process stays 6 s: a peer's exit would end the waits too.
fn hier_fault(comm: &Comm, dev: &Dev, topk: bool) -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    let count = 65_537;
    let mine: Vec<f32> = (0..count).map(|i| ((comm.rank() + i) % 5) as f32).collect();
    let d = dev.upload(bytemuck::cast_slice(&mine))?;
    let call = || -> Result<(), String> {
        if topk {
            let p = comm
                .prepare_topk(
                    count,
                    DType::Float32,
                    TopKScheme::HiTopK,
                    &TopK::new(0.1).error_feedback(false),
                )
                .map_err(e)?;
            // SAFETY: `d` lives until the call returned (it returns once done).
            match unsafe { comm.hitopk_on_device(&p, None, d.addr()) }.map_err(e)? {
                Some(_) => Ok(()),
                None => Err("HiTopK took no GPU path".into()),
            }
        } else {
            let c = Compression::parse("fp16").map_err(e)?.algo(Algo::Hier);
            let p = comm
                .prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &c)
                .map_err(e)?;
            // SAFETY: `d` lives until the call returned (the NULL stream).
            unsafe { comm.all_reduce_compressed_at(p, None, d.addr(), std::ptr::null_mut()) }
                .map(drop)
                .map_err(e)
        }
    };
    call().map_err(|m| format!("the first call: {m}"))?;
    if comm.rank() == 1 {
        let emu = qccl::internal::emulated_driver().ok_or("not on the emulated driver")?;
        emu.fail_next_copy(0).map_err(e)?;
    }
    let t0 = std::time::Instant::now();
    let msg = match call() {
        Ok(()) => return Err("the call succeeded though rank 1's copy failed".into()),
        Err(m) => m,
    };
    let took = t0.elapsed();
    std::thread::sleep(Duration::from_secs(6).saturating_sub(took));
    if comm.rank() == 1 && !msg.contains("injected fault") {
        return Err(format!("the call failed without naming the fault: {msg}"));
    }
    if took > Duration::from_secs(4) {
        return Err(format!("the failure took {took:?} to surface: {msg}"));
    }
    Ok(())
}

/// True when rank `r` is named in QCCL_TEST_DEVICE_RANKS (it uses device buffers).
fn device_rank(r: usize) -> bool {
    std::env::var("QCCL_TEST_DEVICE_RANKS")
        .unwrap_or_default()
        .split(',')
        .any(|x| x == r.to_string())
}

/// HiTopKComm on float32, the ranks in QCCL_TEST_DEVICE_RANKS on device buffers with the
/// top-k on the GPU (`Comm::hitopk_on_device`, every call: it must take the path; every
/// third float32 call enqueued on a stream instead, `Comm::enqueue_hitopk_on_device`), the
/// others on host buffers; error feedback carried over calls, in place and out of place,
/// float32, bfloat16 and float16 (an f32 copy on the device, as the host's). Prints a
/// hash of every result (the job compares them across ranks and against a host-only job).
fn hitopk(comm: &Comm, dev: &Dev) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let on_device = device_rank(r);
    let e = |e: qccl::Error| e.to_string();
    let user = dev.gpu.create_stream(0).map_err(e)?;
    let bound = CodedCase {
        spec: "hitopk",
        key: None,
        layout: None,
        op: ReduceOp::Sum,
        counts: Vec::new(),
        calls: 0,
        tolerance: None,
        // Error feedback re-sends what earlier calls dropped: a sanity bound only.
        l2: 2.0,
        must_gpu: true,
        dtype: DType::Float32,
        algo: None,
        gather: false,
    };
    let cases: [(f64, &[usize], Option<&str>, DType); 5] = [
        (
            0.05,
            &[1, 7, 4099, 65_537],
            Some("hitopk.grad"),
            DType::Float32,
        ),
        (0.25, &[1031], None, DType::Float32),
        (1.0, &[13], Some("hitopk.all"), DType::Float32),
        (0.1, &[7, 4099], Some("hitopk.bf16"), DType::Bfloat16),
        (0.1, &[1031], Some("hitopk.half"), DType::Float16),
    ];
    for (ci, (density, counts, key, dt)) in cases.into_iter().enumerate() {
        let mut o = TopK::new(density).error_feedback(key.is_some());
        if let Some(k) = key {
            o = o.key(k);
        }
        for &count in counts {
            for call in 0..3 {
                let what = format!("hitopk density {density} {dt} count {count} call {call}");
                // The inputs as the buffers hold them (halves rounded).
                let ins: Vec<Vec<f32>> = (0..n)
                    .map(|p| {
                        let x = coded_input(100 + ci, call, p, count);
                        from_bytes(&to_bytes(&x, dt), dt)
                    })
                    .collect();
                let p = comm
                    .prepare_topk(count, dt, TopKScheme::HiTopK, &o)
                    .map_err(e)?;
                let bytes = if on_device {
                    let before = comm.device_stats().map_err(e)?;
                    let send = dev.upload(&to_bytes(&ins[r], dt))?;
                    let recv = match call % 2 {
                        1 => Some(dev.upload(&vec![0u8; dt.size() * count])?),
                        _ => None,
                    };
                    let (s, rv) = match &recv {
                        Some(m) => (Some(send.addr()), m.addr()),
                        None => (None, send.addr()),
                    };
                    let on_stream = call == 2 && dt == DType::Float32;
                    // SAFETY (both): both buffers live until the call returns (NULL: it
                    // returns once done) or the stream passed it (synchronized below).
                    let k = if on_stream {
                        let k = unsafe { comm.enqueue_hitopk_on_device(&p, s, rv, user.raw()) }
                            .map_err(e)?
                            .ok_or_else(|| format!("{what}: not enqueued on the stream"))?;
                        user.synchronize(WAIT).map_err(e)?;
                        k
                    } else {
                        unsafe { comm.hitopk_on_device(&p, s, rv) }
                            .map_err(e)?
                            .ok_or_else(|| format!("{what}: the GPU path did not run"))?
                            .k
                    };
                    if let Some(err) = comm.async_error() {
                        return Err(format!("{what}: async error: {err}"));
                    }
                    let after = comm.device_stats().map_err(e)?;
                    // Only the pairs left the device: k of them, 8 bytes each.
                    let moved = after.to_host - before.to_host;
                    let early = after.enqueued - before.enqueued;
                    if after.calls - before.calls != 1
                        || moved != 8 * k as u64
                        || early != u64::from(on_stream)
                    {
                        return Err(format!(
                            "{what}: {} calls counted ({early} enqueued), {moved} bytes to \
                             the host for k = {k}",
                            after.calls - before.calls,
                        ));
                    }
                    dev.download(&*recv.unwrap_or(send), dt.size() * count)?
                } else {
                    let mut bytes = to_bytes(&ins[r], dt);
                    comm.execute(|eng| p.run(eng, &mut bytes)).map_err(e)?;
                    bytes
                };
                println!("QCCL-HASH topk {ci} {count} {call} {:016x}", fnv(&bytes));
                let got = from_bytes(&bytes, dt);
                check_coded(&bound, &ins, &got, n).map_err(|m| format!("{what}: {m}"))?;
            }
        }
    }
    Ok(())
}

fn check_coded(case: &CodedCase, ins: &[Vec<f32>], got: &[f32], n: usize) -> Result<(), String> {
    let div = if case.op == ReduceOp::Avg {
        n as f64
    } else {
        1.0
    };
    let (mut err2, mut norm2) = (0f64, 0f64);
    for (i, &g) in got.iter().enumerate() {
        let want: f64 = ins.iter().map(|x| x[i] as f64).sum::<f64>() / div;
        let mag: f64 = ins.iter().map(|x| (x[i] as f64).abs()).sum::<f64>() / div;
        let d = (g as f64 - want).abs();
        if let Some(t) = case.tolerance {
            if d.is_nan() || d > t * mag + 1e-6 {
                return Err(format!(
                    "element {i} is {g}, want {want} (within {})",
                    t * mag
                ));
            }
        }
        err2 += d * d;
        norm2 += want * want;
    }
    if case.tolerance.is_none() && err2 > case.l2 * case.l2 * norm2 {
        return Err(format!("relative L2 error {}", (err2 / norm2).sqrt()));
    }
    Ok(())
}

/// One compressed all-reduce of `mine` on device buffers through the core's entry, ordered
/// on `stream` (or queued, as the C ABI's non-blocking calls, when `queued`): with the codecs
/// on the GPU when the call has that path, else staged. Returns the device buffer holding the
/// result (read after the stream) and, out of place, the input's (kept until then).
fn coded_on_device(
    comm: &Comm,
    dev: &Dev,
    c: &Compression,
    mine: &[f32],
    (op, dtype, in_place, stream, queued): (ReduceOp, DType, bool, *mut std::ffi::c_void, bool),
    hier: bool,
) -> Result<(Mem, Option<Mem>), String> {
    let e = |e: qccl::Error| e.to_string();
    let count = mine.len();
    let send = dev.upload(&to_bytes(mine, dtype))?;
    let recv = if in_place {
        None
    } else {
        Some(dev.upload(&vec![0u8; dtype.size() * count])?)
    };
    let p = comm
        .prepare_all_reduce_compressed(count, dtype, op, c)
        .map_err(e)?;
    if hier && p.algo() != Algo::Hier {
        return Err(format!("a call across hosts runs {:?}, not hier", p.algo()));
    }
    let (s, rv) = match &recv {
        Some(rm) => (Some(send.addr()), rm.addr()),
        None => (None, send.addr()),
    };
    if queued {
        // SAFETY: both buffers live until the request ended (waited for here).
        let req = unsafe { comm.submit_all_reduce_compressed_at(p, s, rv) }.map_err(e)?;
        req.wait().map_err(e)?;
    } else {
        // SAFETY: both buffers live until the stream passed the call (the caller
        // synchronises it before they are dropped, with the result read).
        unsafe { comm.all_reduce_compressed_at(p, s, rv, stream) }.map_err(e)?;
    }
    Ok(match recv {
        Some(rm) => (rm, Some(send)),
        None => (send, None),
    })
}

/// A device buffer of the test's.
type Mem = Box<dyn DeviceMem>;

/// Runs the `coded` scenario on `n` ranks, those in `device_ranks` on device buffers, checks
/// that every rank printed the same hashes and returns them.
fn run_coded(n: usize, device_ranks: &str, devices: &str) -> Vec<String> {
    run_coded_with(n, device_ranks, devices, &[])
}

/// `run_coded` with more variables set in the ranks.
fn run_coded_with(
    n: usize,
    device_ranks: &str,
    devices: &str,
    more: &[(&str, &str)],
) -> Vec<String> {
    run_coded_on(n, device_ranks, devices, more, &[])
}

/// `run_coded_with`, rank r on emulated host `hosts[r]` (QCCL_HOSTID) when given.
fn run_coded_on(
    n: usize,
    device_ranks: &str,
    devices: &str,
    more: &[(&str, &str)],
    hosts: &[&str],
) -> Vec<String> {
    run_hashed("coded", (n, device_ranks, devices), more, hosts)
}

/// Runs `scenario` on `n` ranks, those in `device_ranks` on device buffers of emulated
/// `devices` (0: the real GPU), rank r on emulated host `hosts[r]` when given; checks that
/// every rank printed the same hashes and returns them.
fn run_hashed(
    scenario: &str,
    (n, device_ranks, devices): (usize, &str, &str),
    more: &[(&str, &str)],
    hosts: &[&str],
) -> Vec<String> {
    let job = Job::new(n);
    let mut env = vec![
        ("QCCL_GPU_EMULATE", devices),
        ("QCCL_TEST_DEVICE_RANKS", device_ranks),
    ];
    env.extend_from_slice(more);
    let limit = Duration::from_secs(300);
    let outs: Vec<_> = (0..n)
        .map(|r| {
            let mut env = env.clone();
            if let Some(h) = hosts.get(r) {
                env.push(("QCCL_HOSTID", h));
            }
            job.spawn(r, scenario, &env)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|c| common::job::wait(c, limit))
        .collect();
    let mut hashes: Vec<Vec<String>> = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        if o.status.code() != Some(0) {
            // Every rank's story: the first to fail is not always rank 0.
            for (q, o) in outs.iter().enumerate() {
                let t = text(o);
                let t: Vec<&str> = t.lines().filter(|l| !l.starts_with("QCCL-HASH")).collect();
                eprintln!("rank {q} of {n}: {}", t.join("\n"));
            }
        }
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
        hashes.push(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("QCCL-HASH "))
                .map(String::from)
                .collect(),
        );
    }
    assert!(
        !hashes[0].is_empty(),
        "no results printed:\n{}",
        text(&outs[0])
    );
    for (r, h) in hashes.iter().enumerate() {
        assert_eq!(
            h, &hashes[0],
            "rank {r} of {n} ends with other bytes than rank 0"
        );
    }
    hashes.swap_remove(0)
}

/// Device ranks mixed with host ranks end bit-identical, and with the bytes of the same job
/// on host buffers only: the device arithmetic (error feedback included, which only changes
/// the encoding rank's own contribution) is the CPU's.
#[test]
fn compressed_sra_with_the_codecs_on_the_gpu_matches_host_ranks_bit_for_bit() {
    for (n, device) in [(3, "0,2"), (5, "1,2,4"), (1, "0")] {
        let host = run_coded(n, "", "1");
        assert_eq!(
            run_coded(n, device, "1"),
            host,
            "{n} ranks, {device} on device buffers"
        );
    }
}

/// The smallest slices (QCCL_BUFFSIZE=4096: up to 43 slices per chunk): the pipelined device
/// side (slice j+1 encoded while slice j moves, each send started as its encode completes,
/// the decodes of one exchange overlapping the next) ends as bit-identical with host ranks,
/// and its exchanges began with encodes still queued (`coded` checks the counters). Streams
/// hold at most 256 pending operations here, fewer than such a call enqueues on a caller's
/// stream behind its first progress wait: the worker must move its bytes while the rest is
/// still being enqueued (a GPU's stream blocks its enqueues past about 1000), and with no
/// driver call: an enqueue blocked on a full queue holds the driver's lock here, as CUDA's
/// does (QCCL_GPU_EMULATE_FULL_QUEUE_LOCK; an H200 hung on the worker's event queries).
#[test]
fn pipelined_compressed_sra_over_many_slices_matches_host_ranks_bit_for_bit() {
    let small = [
        ("QCCL_BUFFSIZE", "4096"),
        ("QCCL_GPU_EMULATE_QUEUE_DEPTH", "256"),
        ("QCCL_GPU_EMULATE_FULL_QUEUE_LOCK", "1"),
    ];
    for (n, device) in [(3, "0,1,2"), (5, "0,3"), (1, "0")] {
        let host = run_coded_with(n, "", "1", &small);
        assert_eq!(
            run_coded_with(n, device, "1", &small),
            host,
            "{n} ranks, {device} on device buffers, 4 KiB slices"
        );
    }
}

/// The hierarchical route a multi-host job takes (pieces of 64 KiB pipelined): float32
/// calls on device buffers run it with the codecs on the GPU and the intra-host levels
/// through the arena, and end with the bytes of the same job on host buffers only, device
/// and host ranks mixed: 2 hosts × 2 ranks interleaved, 3 hosts × 1 rank (no intra-host
/// level), 3 hosts × 2 ranks.
#[test]
fn hierarchical_compressed_all_reduce_with_the_codecs_on_the_gpu_matches_host_ranks() {
    let more = [("QCCL_TEST_HIER", "1"), ("QCCL_CHUNKSIZE", "65536")];
    mixed_jobs_match_host_ranks(
        &more,
        &[
            (
                &["host-a", "host-b", "host-a", "host-b"],
                &["0,1,2,3", "0,3"],
            ),
            (&["host-a", "host-b", "host-c"], &["1"]),
            (&["a", "a", "b", "b", "c", "c"], &["0,3,5"]),
        ],
    );
}

/// For each job (rank r on emulated host `hosts[r]`) and each set of device ranks, the
/// `coded` scenario with `more` ends with the bytes of the same job on host buffers only.
fn mixed_jobs_match_host_ranks(more: &[(&str, &str)], jobs: &[(&[&str], &[&str])]) {
    for &(hosts, devices) in jobs {
        let n = hosts.len();
        let host = run_coded_on(n, "", "1", more, hosts);
        for device in devices {
            let mixed = run_coded_on(n, device, "1", more, hosts);
            assert_eq!(
                mixed, host,
                "{n} ranks, device ranks {device} against host ranks only"
            );
        }
    }
}

/// Calls on the hierarchical route made on a caller's stream have no GPU path (`gpu_hier.rs`)
/// and are staged piece by piece (`comm/bands.rs`), the residual folded in, other float
/// types converted and Avg divided per piece: with pieces of 16 KiB (several per call),
/// tensor keys' residuals across calls, float16, bfloat16, float64 and Avg, the job ends with
/// the bytes of the same job on host buffers, device and host ranks mixed. So do calls with
/// compressed intra-host levels (no GPU path either) on streams, NULL and queued. Streams
/// hold 100 operations: float32 calls (the codecs on the GPU, `gpu_hier_stream.rs`) block
/// their caller's thread while it enqueues their pieces, until the worker moves earlier ones
/// (holding the driver's lock meanwhile, as CUDA's enqueues do: QCCL_GPU_EMULATE_FULL_QUEUE_LOCK).
#[test]
fn hierarchical_compressed_calls_on_a_stream_stage_in_bands_and_match_host_ranks() {
    let more = [
        ("QCCL_TEST_HIER", "1"),
        ("QCCL_TEST_STREAMS", "1"),
        ("QCCL_CHUNKSIZE", "16384"),
        ("QCCL_GPU_EMULATE_QUEUE_DEPTH", "100"),
        ("QCCL_GPU_EMULATE_FULL_QUEUE_LOCK", "1"),
    ];
    let intra = [
        ("QCCL_TEST_HIER", "1"),
        ("QCCL_TEST_INTRA", "1"),
        ("QCCL_CHUNKSIZE", "16384"),
    ];
    let two: &[&str] = &["host-a", "host-b", "host-a", "host-b"];
    mixed_jobs_match_host_ranks(&intra, &[(two, &["0,2,3"])]);
    mixed_jobs_match_host_ranks(
        &more,
        &[
            (two, &["0,1,2,3", "1,2"]),
            (&["a", "a", "a", "b", "b", "b"], &["0,4,5"]),
        ],
    );
}

/// HiTopKComm with its top-k and scatter-add on the GPU ends with the bytes of the same job
/// on host buffers, device and host ranks mixed: 2 hosts × 2 ranks, 3 hosts × 1 rank (no
/// intra-host level), one host of 3 (no inter-host peer).
#[test]
fn hitopk_with_the_top_k_on_the_gpu_matches_host_ranks() {
    let jobs: [(&[&str], &[&str]); 3] = [
        (
            &["host-a", "host-b", "host-a", "host-b"],
            &["0,1,2,3", "1,2"],
        ),
        (&["host-a", "host-b", "host-c"], &["0,2"]),
        (&["host-a", "host-a", "host-a"], &["0,1,2"]),
    ];
    for (hosts, devices) in jobs {
        let n = hosts.len();
        let host = run_hashed("topk", (n, "", "1"), &[], hosts);
        for device in devices {
            let mixed = run_hashed("topk", (n, device, "1"), &[], hosts);
            assert_eq!(
                mixed, host,
                "{n} ranks, device ranks {device} against host ranks only"
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn hitopk_on_a_real_gpu_matches_host_ranks() {
    if common::real_gpu() {
        let hosts = ["host-a", "host-b", "host-a", "host-b"];
        let host = run_hashed("topk", (4, "", "0"), &[], &hosts);
        assert_eq!(run_hashed("topk", (4, "0,1,2,3", "0"), &[], &hosts), host);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn hierarchical_compressed_all_reduce_on_a_real_gpu_matches_host_ranks() {
    if common::real_gpu() {
        let more = [("QCCL_TEST_HIER", "1"), ("QCCL_CHUNKSIZE", "65536")];
        let hosts = ["host-a", "host-b", "host-a", "host-b"];
        let host = run_coded_on(4, "", "0", &more, &hosts);
        assert_eq!(run_coded_on(4, "0,1,2,3", "0", &more, &hosts), host);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn compressed_sra_with_the_codecs_on_a_real_gpu_matches_host_ranks_bit_for_bit() {
    if common::real_gpu() {
        // Default slices, then 4 KiB ones (the pipeline over many slices; at 5 ranks a call
        // enqueues roughly 1000 operations behind its first progress wait, about what a CUDA
        // stream holds pending: the worker must move bytes while the rest is enqueued).
        for more in [&[][..], &[("QCCL_BUFFSIZE", "4096")][..]] {
            let five = if more.is_empty() {
                None
            } else {
                Some((5, "0,2,4"))
            };
            for (n, device) in [(2, "0"), (3, "0,1,2")].into_iter().chain(five) {
                let host = run_coded_with(n, "", "0", more);
                assert_eq!(
                    run_coded_with(n, device, "0", more),
                    host,
                    "{n} ranks, {device} on the GPU, {more:?}"
                );
            }
        }
    }
}

/// A queued hierarchical call, then a flat one on a stream: neither hangs (2 emulated hosts
/// × 2 ranks, 16 pieces; a 20 s timeout turns a hang into a failure).
#[test]
fn a_stream_call_after_a_queued_hierarchical_one_waits_for_it() {
    on_two_hosts("hier_then_stream");
}

/// A failed copy midway through a call on the hierarchy (codecs on the GPU; HiTopK) fails
/// every rank soon, not at the comm's timeout.
#[test]
fn a_failed_copy_in_a_call_on_the_hierarchy_fails_every_rank_soon() {
    on_two_hosts("hier_fault");
    on_two_hosts("topk_fault");
}

/// `scenario` on 4 ranks of 2 emulated hosts (interleaved), 16 KiB pieces, a 20 s timeout.
fn on_two_hosts(scenario: &str) {
    let job = Job::new(4);
    let limit = Duration::from_secs(120);
    let outs: Vec<_> = (0..4)
        .map(|r| {
            let host = if r % 2 == 0 { "host-a" } else { "host-b" };
            let env = [
                ("QCCL_GPU_EMULATE", "1"),
                ("QCCL_HOSTID", host),
                ("QCCL_CHUNKSIZE", "16384"),
                ("QCCL_TIMEOUT_MS", "20000"),
            ];
            job.spawn(r, scenario, &env)
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|c| common::job::wait(c, limit))
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(
            o.status.code(),
            Some(0),
            "rank {r} of 4 ({scenario}):\n{}",
            text(o)
        );
    }
}

fn run_job(n: usize, scenario: &str, devices: &str) {
    let job = Job::new(n);
    // QCCL_TEST_JOB_SECS: a shorter limit, so that a GPU run's step limit still sees the
    // ranks' output of a hung job (they are killed and their output printed).
    let secs = std::env::var("QCCL_TEST_JOB_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let outs = job.run(
        scenario,
        &[("QCCL_GPU_EMULATE", devices)],
        Duration::from_secs(secs),
    );
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn collectives_on_a_real_gpu_at_1_2_and_4_ranks() {
    if common::real_gpu() {
        for n in [1, 2, 4] {
            run_job(n, "collectives", "0");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn the_callers_stream_orders_the_call_on_a_real_gpu() {
    if common::real_gpu() {
        run_job(2, "stream", "0");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn a_call_on_a_stream_returns_once_enqueued_on_a_real_gpu() {
    if common::real_gpu() {
        run_job(2, "enqueue", "0");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a GPU machine"]
fn ranks_of_one_process_call_on_streams_on_a_real_gpu() {
    if common::real_gpu() {
        run_job(1, "threads", "0");
    }
}

#[test]
fn collectives_on_device_buffers_at_1_3_and_5_ranks() {
    for n in [1, 3, 5] {
        run_job(n, "collectives", "1");
    }
}

#[test]
fn the_callers_stream_orders_the_call() {
    run_job(2, "stream", "1");
}

#[test]
fn a_call_on_a_stream_returns_once_enqueued_and_queued_calls_stage_in_turn() {
    run_job(3, "enqueue", "1");
}

#[test]
fn a_compressed_call_with_the_codecs_on_the_gpu_returns_once_enqueued() {
    for n in [1, 3] {
        run_job(n, "coded_enqueue", "1");
    }
}

#[test]
fn a_compressed_call_on_a_stream_whose_peer_left_does_not_hang_the_stream() {
    run_job(2, "coded_peer_gone", "1");
}

#[test]
fn a_compressed_call_that_fails_while_enqueued_hangs_nothing() {
    let job = Job::new(2);
    let outs = job.run(
        "coded_enqueue_fails",
        &[
            ("QCCL_GPU_EMULATE", "1"),
            ("QCCL_GPU_EMULATE_QUEUE_DEPTH", "8"),
            ("QCCL_BUFFSIZE", "4096"),
        ],
        Duration::from_secs(120),
    );
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r}:\n{}", text(o));
    }
}

#[test]
fn ranks_of_one_process_on_one_device_call_on_streams() {
    run_job(1, "threads", "1");
}

#[test]
fn calls_on_a_stream_wait_for_room_under_the_staging_cap() {
    for n in [1, 3] {
        let job = Job::new(n);
        let outs = job.run(
            "bounded",
            &[("QCCL_GPU_EMULATE", "1"), ("QCCL_STAGING_BYTES", "65536")],
            Duration::from_secs(120),
        );
        for (r, o) in outs.iter().enumerate() {
            assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
        }
    }
}

#[test]
fn bad_device_buffers_are_refused_by_name() {
    run_job(2, "errors", "2");
}

/// f32s from native-endian bytes (any alignment).
fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect()
}
