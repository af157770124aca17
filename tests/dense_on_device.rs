//! Dense calls on device buffers between ranks in separate processes, on the emulated GPU
//! driver, whose device memory faults when host code touches it:
//! - over CUDA IPC (QCCL_CUDA_IPC=1): another process reaches a rank's device memory only
//!   through the handle `ipc_open` maps, so a result that is right here was reduced through
//!   the peers' mapped memory. Every dtype and op, counts 0, 1 and primes, in place and out
//!   of place, on a caller's stream, the legacy default one and queued (the C API's
//!   non-blocking calls), at 1, 3, 5 and 7 ranks (and 3 threads of one process, which use
//!   each other's addresses), against the float64 reference, every rank bit-identical; and
//!   the agreement: a rank with host buffers, or one that did not ask for CUDA IPC, makes
//!   every rank take the usual path, still right.
//! - through the shared-memory arena (without CUDA IPC), the GPU copying into and out of
//!   its segments: the same grid plus calls of many rounds, at 2, 3 and 5 ranks (a smaller
//!   grid at 1 and 7), a rank on host buffers in the same calls, and reduce-scatter and
//!   all-gather (blocking and queued, here and over CUDA IPC); which calls took the path is counted against the host path's choice (the
//!   arena's rounds: SRA past one shot).

mod common;

use common::job::{exit_with, text, Job, CHILD};
use common::suite::same_on_all_ranks;
use common::{check_reduce, input, ops_for};
use qccl::internal::gpu_driver::{DeviceMem, Driver, Stream};
use qccl::internal::{Buf, Coll, CollCall};
use qccl::{Algo, Comm, Compression, DType, ReduceOp};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);
const LIMIT: Duration = Duration::from_secs(300);

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    exit_with(run_child(&scenario), 0, 3);
}

/// How a call is made.
#[derive(Clone, Copy, PartialEq, Debug)]
enum How {
    /// Out of place, the legacy default stream.
    Default,
    /// In place, on a caller's stream.
    Stream,
    /// Out of place, queued (`submit_all_reduce_dense_at`, the C API's non-blocking call).
    Queued,
    /// Out of place, on a caller's stream.
    StreamOut,
}

/// Where a rank's buffers are in a scenario.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Device,
    Host,
}

fn run_child(scenario: &str) -> Result<(), String> {
    // "real-*": the process's own driver (a GPU), else the emulated one.
    let (gpu, scenario) = match scenario.strip_prefix("real-") {
        Some(s) => (qccl::internal::gpu(), s),
        None => (qccl::internal::emulate_gpu(1), scenario),
    };
    let gpu = gpu.map_err(|e| e.to_string())?;
    let comm = Comm::from_env().map_err(|e| e.to_string())?;
    run_cases(&comm, &*gpu, scenario)
}

/// One rank of `scenario` on `comm`, its device buffers on `gpu`.
fn run_cases(comm: &Comm, gpu: &dyn Driver, scenario: &str) -> Result<(), String> {
    let (rank, n) = (comm.rank(), comm.size());
    let wants_ipc = std::env::var("QCCL_CUDA_IPC").is_ok_and(|v| v == "1");
    let rank_1_on_host = if rank == 1 {
        Place::Host
    } else {
        Place::Device
    };
    let (cases, place, expect_ipc) = match scenario {
        // Every dtype and op, on device buffers everywhere.
        "all" => (every_case(), Place::Device, n > 1),
        // A smaller grid for 7 ranks.
        "few" => (few_cases(), Place::Device, n > 1),
        // Rank 1's buffers are host memory: every rank takes the usual path.
        "mixed" => (few_cases(), rank_1_on_host, false),
        // Some rank did not ask for CUDA IPC: none uses it.
        "partial" => (few_cases(), Place::Device, false),
        // Reduce-scatter and all-gather, every dtype (and op).
        "colls" => return colls(comm, gpu, Counted::Ipc),
        // No CUDA IPC: through the arena, on device buffers everywhere.
        "arena" => (arena_cases(), Place::Device, false),
        // A smaller grid for a real GPU, calls of many rounds included.
        "arena-few" => {
            let mut cases = few_cases();
            cases.push((DType::Float32, ReduceOp::Sum, 1_000_003));
            (cases, Place::Device, false)
        }
        // Rank 1's buffers are host memory: the others still go through the arena.
        "arena-mixed" => (arena_cases(), rank_1_on_host, false),
        // Several emulated hosts: the hierarchical route (or SRA, or the ring), staged in
        // bands.
        "hosts" | "hosts-sra" | "hosts-ring" => (hosts_cases(), Place::Device, false),
        // Rank 1's buffers are host memory: the others still stage in bands.
        "hosts-mixed" => (few_cases(), rank_1_on_host, false),
        "arena-colls" => return colls(comm, gpu, Counted::Arena),
        "hosts-colls" => return colls(comm, gpu, Counted::Bands),
        // Broadcast and reduce, on one host or across hosts: in bands of the chain's slices.
        "rooted" => return rooted(comm, gpu),
        "arena-fault" => return arena_fault(comm, gpu),
        "hosts-fault" => return hosts_fault(comm, gpu),
        "hosts-coded-fault" => return hosts_coded_fault(comm, gpu),
        "arena-slow" => return arena_slow_copy(comm, gpu),
        other => return Err(format!("unknown scenario {other}")),
    };
    let hosts = scenario.starts_with("hosts");
    let ipc_comm = n > 1 && !scenario.starts_with("arena") && !hosts && scenario != "partial";
    if comm.uses_cuda_ipc() != ipc_comm {
        return Err(format!(
            "uses_cuda_ipc() is {} on {n} ranks (scenario {scenario}, QCCL_CUDA_IPC wanted \
             here: {wants_ipc})",
            comm.uses_cuda_ipc()
        ));
    }
    let user = gpu.create_stream(0).map_err(|e| e.to_string())?;
    let (mut calls, mut through_arena, mut in_bands) = (0, 0, 0);
    let hows: &[How] = if hosts {
        &[How::Default, How::Stream, How::Queued, How::StreamOut]
    } else {
        &[How::Default, How::Stream, How::Queued]
    };
    for (i, &(dtype, op, count)) in cases.iter().enumerate() {
        for &how in hows {
            // In place on the caller's stream, out of place otherwise.
            let in_place = how == How::Stream;
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|q| input(dtype, op, q, count, i as u64))
                .collect();
            let what = format!("{dtype} {op} count {count} {how:?}");
            let got = match place {
                Place::Device => on_device(comm, gpu, &*user, &inputs[rank], (dtype, op), how),
                Place::Host => on_host(comm, &inputs[rank], (dtype, op), in_place),
            }
            .map_err(|e| format!("{what}: {e}"))?;
            check_reduce(dtype, op, &inputs, 0..count, &got).map_err(|e| format!("{what}: {e}"))?;
            same_on_all_ranks(comm, &got, &what)?;
            calls += u64::from(count > 0);
            // Through the arena: device buffers not over CUDA IPC (on a stream: enqueued in
            // bands; on a comm using CUDA IPC, every call returns once done).
            let device = place == Place::Device && !expect_ipc;
            let arena = !hosts && takes_arena_rounds(n, count * dtype.size());
            through_arena += u64::from(device && arena);
            // Across hosts: every call of bytes staged in bands.
            in_bands += u64::from(device && hosts && count > 0);
        }
    }
    if comm.piecewise_calls() != in_bands {
        return Err(format!(
            "{} calls on device buffers staged in bands, expected {in_bands} (scenario \
             {scenario})",
            comm.piecewise_calls()
        ));
    }
    if hosts {
        // The entry names the schedule that ran (every rank calls; device ranks check).
        let want = match scenario {
            "hosts-sra" => Algo::Sra,
            "hosts-ring" => Algo::Ring,
            _ => Algo::Hier,
        };
        let e = |e: qccl::Error| e.to_string();
        let call = comm
            .prepare_all_reduce(4099, DType::Float32, ReduceOp::Sum, None)
            .map_err(e)?;
        let mut host = vec![0u8; 4 * 4099];
        let dev = gpu.alloc_device(0, 4 * 4099).map_err(e)?;
        let at = match place {
            Place::Device => dev.addr(),
            Place::Host => host.as_mut_ptr() as u64,
        };
        // SAFETY: memory of the call's bytes, alive until it returned.
        let ran = unsafe { comm.all_reduce_dense_at(&call, None, at, std::ptr::null_mut()) }
            .map_err(e)?;
        if place == Place::Device && ran != Some(want) {
            return Err(format!("the call ran {ran:?}, not {want:?}"));
        }
    }
    if comm.arena_device_calls() != through_arena {
        return Err(format!(
            "{} calls on device buffers through the arena, expected {through_arena} \
             (scenario {scenario})",
            comm.arena_device_calls()
        ));
    }
    let want = if expect_ipc { calls } else { 0 };
    if comm.cuda_ipc_calls() != want {
        return Err(format!(
            "{} calls over CUDA IPC, expected {want} (scenario {scenario})",
            comm.cuda_ipc_calls()
        ));
    }
    Ok(())
}

/// True when the host path runs an all-reduce of `bytes` on `n` ranks sharing one host in
/// the arena's rounds (so device buffers go through the arena): the tuning table's SRA (3
/// ranks and more at every size, 2 ranks past 1 MiB) past the one-shot fold (64 KiB over
/// all ranks).
fn takes_arena_rounds(n: usize, bytes: usize) -> bool {
    let sra = n >= 3 || (n == 2 && bytes > 1 << 20);
    sra && bytes * n > 64 << 10
}

/// Which counter the device calls of `colls` advance.
#[derive(Clone, Copy, PartialEq)]
enum Counted {
    Ipc,
    Arena,
    /// Across hosts: staged in bands of slices (`Comm::piecewise_calls`).
    Bands,
}

/// Reduce-scatter (every op) and all-gather of every dtype at counts 0, 1 and primes, in
/// place (NCCL's layouts) and out of place, over CUDA IPC, through the arena or across
/// hosts in bands (counted).
fn colls(comm: &Comm, gpu: &dyn Driver, counted: Counted) -> Result<(), String> {
    let (rank, n) = (comm.rank(), comm.size());
    let e = |e: qccl::Error| e.to_string();
    let user = gpu.create_stream(0).map_err(e)?;
    let mut calls = 0;
    let mut salt = 0;
    for dtype in DType::ALL {
        let mut colls: Vec<(Coll, ReduceOp)> = ops_for(dtype)
            .into_iter()
            .map(|op| (Coll::ReduceScatter, op))
            .collect();
        colls.push((Coll::AllGather, ReduceOp::Sum));
        for (coll, op) in colls {
            let counts: &[usize] = match counted {
                Counted::Ipc => &[0, 1, 7, 4099],
                // And a call of many rounds (slots reused), or of more slices than bands.
                Counted::Arena | Counted::Bands => &[0, 1, 7, 4099, 300_007],
            };
            for &count in counts {
                for in_place in [false, true] {
                    salt += 1;
                    // In turn: blocking on NULL, queued (`submit_coll_dense_at`,
                    // qcclIReduceScatter / qcclIAllGather), on a stream (enqueued in bands
                    // through the arena or across hosts, else blocking).
                    let how = [How::Default, How::Queued, How::Stream][(salt % 3) as usize];
                    let what =
                        format!("{coll:?} {dtype} {op} count {count} in place {in_place} {how:?}");
                    let es = dtype.size();
                    let part = count * es;
                    // Every rank's input: n parts (reduce-scatter) or one (all-gather).
                    let parts = if coll == Coll::ReduceScatter { n } else { 1 };
                    let inputs: Vec<Vec<u8>> = (0..n)
                        .map(|q| input(dtype, op, q, count * parts, salt))
                        .collect();
                    let mine = &inputs[rank];
                    // In place: the whole buffer, this rank's input at its place.
                    let whole = if coll == Coll::ReduceScatter {
                        mine.clone()
                    } else {
                        let mut w = vec![0xa5u8; part * n];
                        w[rank * part..(rank + 1) * part].copy_from_slice(mine);
                        w
                    };
                    let recv_len = if in_place {
                        whole.len()
                    } else if coll == Coll::ReduceScatter {
                        part
                    } else {
                        part * n
                    };
                    let up = |b: &[u8]| -> Result<Box<dyn DeviceMem>, String> {
                        let m = gpu.alloc_device(0, b.len().max(1)).map_err(e)?;
                        // SAFETY: `b` outlives the synchronize below; `m` holds it.
                        unsafe { user.copy_to_device(m.addr(), b.as_ptr(), b.len()) }.map_err(e)?;
                        user.synchronize(WAIT).map_err(e)?;
                        Ok(m)
                    };
                    let send = if in_place { None } else { Some(up(mine)?) };
                    let recv = up(&if in_place {
                        whole
                    } else {
                        vec![0xa5; recv_len]
                    })?;
                    let sbuf = send.as_ref().map_or(Buf::None, |_| Buf::Bytes(mine.len()));
                    let call = CollCall::new(coll, count, dtype)
                        .op(op)
                        .bufs(sbuf, Buf::Bytes(recv_len));
                    let from = send.as_ref().map(|s| s.addr());
                    // SAFETY (both): device buffers of the call's sizes, alive until it
                    // returned or its request ended.
                    let (to, raw) = (recv.addr(), user.raw());
                    let done = match how {
                        How::Queued => unsafe { comm.submit_coll_dense_at(call, from, to) }
                            .and_then(|r| r.wait()),
                        How::Stream | How::StreamOut => {
                            match unsafe { comm.enqueue_coll_dense_at(&call, from, to, raw) } {
                                Ok(false) => unsafe { comm.coll_dense_at(&call, from, to, raw) },
                                other => other.map(drop),
                            }
                        }
                        How::Default => unsafe {
                            comm.coll_dense_at(&call, from, to, std::ptr::null_mut())
                        },
                    };
                    done.map_err(|e| format!("{what}: {e}"))?;
                    let mut got = vec![0u8; recv_len];
                    // SAFETY: `got` outlives the synchronize below.
                    unsafe { user.copy_to_host(got.as_mut_ptr(), recv.addr(), recv_len) }
                        .map_err(e)?;
                    user.synchronize(WAIT).map_err(e)?;
                    if coll == Coll::ReduceScatter {
                        let at = if in_place { rank * part } else { 0 };
                        let range = rank * count..(rank + 1) * count;
                        check_reduce(dtype, op, &inputs, range, &got[at..at + part])
                            .map_err(|e| format!("{what}: {e}"))?;
                    } else {
                        let want: Vec<u8> = inputs.concat();
                        if got != want {
                            return Err(format!("{what}: the gathered bytes differ"));
                        }
                        same_on_all_ranks(comm, &got, &what)?;
                    }
                    calls += u64::from(count > 0);
                }
            }
        }
    }
    let (got, path) = match counted {
        Counted::Ipc => (comm.cuda_ipc_calls(), "over CUDA IPC"),
        Counted::Arena => (comm.arena_device_calls(), "through the arena"),
        Counted::Bands => (comm.piecewise_calls(), "staged in bands"),
    };
    if got != calls {
        return Err(format!("{got} calls {path}, expected {calls}"));
    }
    Ok(())
}

/// Broadcast and reduce (every op) of every dtype at counts 0, 1 and primes, from the first,
/// the last and a middle root, in place and out of place, blocking on NULL, queued and on a
/// stream: staged in bands of the chain's slices (counted; any links), against the root's
/// input (a broadcast's bits, on every rank) or the float64 reference (a reduce's, on the
/// root). Off the root a reduce reads its input only: its buffers keep their bytes.
fn rooted(comm: &Comm, gpu: &dyn Driver) -> Result<(), String> {
    let (rank, n) = (comm.rank(), comm.size());
    let e = |e: qccl::Error| e.to_string();
    let user = gpu.create_stream(0).map_err(e)?;
    let up = |b: &[u8]| -> Result<Box<dyn DeviceMem>, String> {
        let m = gpu.alloc_device(0, b.len().max(1)).map_err(e)?;
        // SAFETY: `b` outlives the synchronize below; `m` holds it.
        unsafe { user.copy_to_device(m.addr(), b.as_ptr(), b.len()) }.map_err(e)?;
        user.synchronize(WAIT).map_err(e)?;
        Ok(m)
    };
    let (mut calls, mut salt) = (0, 0u64);
    for dtype in DType::ALL {
        let mut colls = vec![(Coll::Broadcast, ReduceOp::Sum)];
        colls.extend(ops_for(dtype).into_iter().map(|op| (Coll::Reduce, op)));
        for (coll, op) in colls {
            for count in [0, 1, 7, 4099, 300_007] {
                for in_place in [false, true] {
                    salt += 1;
                    let root = [0, n - 1, n / 2][(salt % 3) as usize];
                    let how = [How::Default, How::Queued, How::Stream][(salt / 3 % 3) as usize];
                    let what = format!(
                        "{coll:?} {dtype} {op} count {count} root {root} in place {in_place} \
                         {how:?}"
                    );
                    let inputs: Vec<Vec<u8>> =
                        (0..n).map(|q| input(dtype, op, q, count, salt)).collect();
                    let (mine, len) = (&inputs[rank], count * dtype.size());
                    let blank = vec![0xa5u8; len];
                    // In place the one buffer holds the input (a broadcast's on the root);
                    // out of place every rank passes both, as NCCL callers may.
                    let holds_input = coll == Coll::Reduce || rank == root;
                    let send = if in_place { None } else { Some(up(mine)?) };
                    let recv = up(if in_place && holds_input {
                        mine
                    } else {
                        &blank
                    })?;
                    let sbuf = send.as_ref().map_or(Buf::None, |_| Buf::Bytes(len));
                    let call = CollCall::new(coll, count, dtype)
                        .op(op)
                        .root(root)
                        .bufs(sbuf, Buf::Bytes(len));
                    let (from, to, raw) =
                        (send.as_ref().map(|s| s.addr()), recv.addr(), user.raw());
                    // SAFETY (all): device buffers of the call's sizes, alive until it
                    // returned, its request ended or the stream synchronized below.
                    let banded = match how {
                        How::Default => unsafe {
                            comm.rooted_in_bands_at(&call, from, to, std::ptr::null_mut())
                        },
                        How::Queued => {
                            match unsafe { comm.submit_rooted_in_bands(&call, from, to) } {
                                Ok(Some(req)) => req.wait().map(|()| true),
                                Ok(None) => Ok(false),
                                Err(e) => Err(e),
                            }
                        }
                        _ => unsafe { comm.enqueue_coll_dense_at(&call, from, to, raw) },
                    }
                    .map_err(|e| format!("{what}: {e}"))?;
                    if banded != (count > 0) {
                        return Err(format!("{what}: staged in bands: {banded}"));
                    }
                    calls += u64::from(banded);
                    let mut got = vec![0u8; len];
                    // SAFETY: `got` outlives the synchronize below.
                    unsafe { user.copy_to_host(got.as_mut_ptr(), recv.addr(), len) }.map_err(e)?;
                    user.synchronize(WAIT).map_err(e)?;
                    match coll {
                        Coll::Broadcast => {
                            if got != inputs[root] {
                                return Err(format!("{what}: not the root's bytes"));
                            }
                        }
                        _ if rank == root => check_reduce(dtype, op, &inputs, 0..count, &got)
                            .map_err(|e| format!("{what}: {e}"))?,
                        _ => {
                            let kept = if in_place { mine } else { &blank };
                            if &got != kept {
                                return Err(format!(
                                    "{what}: a rank off the root wrote its buffer"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    if comm.piecewise_calls() != calls {
        return Err(format!(
            "{} calls staged in bands, expected {calls}",
            comm.piecewise_calls()
        ));
    }
    Ok(())
}

/// Rank 1's copy into the arena fails (an injected fault) in the middle of a call through
/// it: rank 1's call returns that error, the others' fail naming a peer instead of waiting,
/// all well within the comm's timeout.
fn arena_fault(comm: &Comm, gpu: &dyn Driver) -> Result<(), String> {
    let user = gpu.create_stream(0).map_err(|e| e.to_string())?;
    let (dtype, op) = (DType::Float32, ReduceOp::Sum);
    let mine = input(dtype, op, comm.rank(), 300_007, 1);
    // A call that goes through, setting the arena and its streams up.
    let got = on_device(comm, gpu, &*user, &mine, (dtype, op), How::Default)?;
    if comm.arena_device_calls() != 1 {
        return Err(format!(
            "{} calls through the arena",
            comm.arena_device_calls()
        ));
    }
    let want = if comm.rank() == 1 {
        "injected fault"
    } else {
        "rank 1"
    };
    fails_soon(comm, gpu, &*user, &got, want)
}

/// Across hosts, a hierarchical call staged in bands whose first copy in fails on rank 1:
/// every rank's call fails, soon, rank 1's naming the fault.
fn hosts_fault(comm: &Comm, gpu: &dyn Driver) -> Result<(), String> {
    let user = gpu.create_stream(0).map_err(|e| e.to_string())?;
    let mine = input(DType::Float32, ReduceOp::Sum, comm.rank(), 100_003, 1);
    let want = if comm.rank() == 1 {
        "injected fault"
    } else {
        ""
    };
    fails_soon(comm, gpu, &*user, &mine, want)
}

/// A device buffer holding `mine`, rank 1's next copy made to fail (an injected fault).
fn armed(
    comm: &Comm,
    gpu: &dyn Driver,
    user: &dyn Stream,
    mine: &[u8],
) -> Result<Box<dyn DeviceMem>, String> {
    let e = |e: qccl::Error| e.to_string();
    let buf = gpu.alloc_device(0, mine.len()).map_err(e)?;
    // SAFETY: `mine` outlives the synchronize; `buf` holds its bytes.
    unsafe { user.copy_to_device(buf.addr(), mine.as_ptr(), mine.len()) }.map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    if comm.rank() == 1 {
        let emu = qccl::internal::emulated_driver().ok_or("not on the emulated driver")?;
        emu.fail_next_copy(0).map_err(e)?;
    }
    Ok(buf)
}

/// Across hosts, a compressed call on the hierarchy enqueued on a caller's stream (float32:
/// the codecs on the GPU, its host levels on a page-locked copy staged in bands) whose
/// first copy in fails on rank 1: the call returns once enqueued, every rank's stream
/// passes and its comm fails soon (the comm's timeout is 60 s), rank 1's error naming the
/// fault; the failed comm refuses the next call. Every process stays 6 s: a peer's exit
/// would end the waits too.
fn hosts_coded_fault(comm: &Comm, gpu: &dyn Driver) -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    let user = gpu.create_stream(0).map_err(e)?;
    let mine = input(DType::Float32, ReduceOp::Sum, comm.rank(), 100_003, 1);
    let count = mine.len() / 4;
    let c = Compression::parse("fp16").map_err(e)?.algo(Algo::Hier);
    let prepare = || comm.prepare_all_reduce_compressed(count, DType::Float32, ReduceOp::Sum, &c);
    let buf = armed(comm, gpu, &*user, &mine)?;
    let t0 = std::time::Instant::now();
    let p = prepare().map_err(e)?;
    // SAFETY: `buf` lives until the stream passed the call (synchronized below).
    let r = unsafe { comm.all_reduce_compressed_at(p, None, buf.addr(), user.raw()) };
    if !matches!(r, Ok(None)) {
        return Err(format!("the call did not return once enqueued: {r:?}"));
    }
    // The stream passes (rank 1's fails on its own copy's sticky error).
    let passed = user.synchronize(WAIT);
    let msg = loop {
        if let Some(err) = comm.async_error() {
            break err.to_string();
        }
        if t0.elapsed() > WAIT {
            return Err("no async error after rank 1's copy failed".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = t0.elapsed();
    let refused = {
        let p = prepare().map_err(e)?;
        // SAFETY: as above.
        unsafe { comm.all_reduce_compressed_at(p, None, buf.addr(), user.raw()) }.is_err()
    };
    std::thread::sleep(Duration::from_secs(6).saturating_sub(took));
    if comm.rank() != 1 {
        passed.map_err(e)?;
    }
    if comm.rank() == 1 && !msg.contains("injected fault") {
        return Err(format!("the comm failed without naming the fault: {msg}"));
    }
    if took > Duration::from_secs(4) {
        return Err(format!("the failure took {took:?} to surface: {msg}"));
    }
    if !refused {
        return Err("a call on the failed comm was accepted".into());
    }
    Ok(())
}

/// A float sum of `mine` on a device buffer with the NULL stream, rank 1's next copy made to
/// fail first: the call must fail within 4 s (the comm's timeout is 60 s), its error naming
/// `want`. Every process stays 6 s: a peer's exit would end the waits too.
fn fails_soon(
    comm: &Comm,
    gpu: &dyn Driver,
    user: &dyn Stream,
    mine: &[u8],
    want: &str,
) -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    let (dtype, op) = (DType::Float32, ReduceOp::Sum);
    let count = mine.len() / dtype.size();
    let call = comm.prepare_all_reduce(count, dtype, op, None).map_err(e)?;
    let buf = armed(comm, gpu, user, mine)?;
    let t0 = std::time::Instant::now();
    // SAFETY: device memory of the call's bytes, alive until it returned.
    let r = unsafe { comm.all_reduce_dense_at(&call, None, buf.addr(), std::ptr::null_mut()) };
    let msg = match r {
        Ok(_) => return Err("the call succeeded though rank 1's copy failed".into()),
        Err(err) => err.to_string(),
    };
    let took = t0.elapsed();
    std::thread::sleep(Duration::from_secs(6).saturating_sub(took));
    if !msg.contains(want) {
        return Err(format!("the call failed without naming {want:?}: {msg}"));
    }
    if took > Duration::from_secs(4) {
        return Err(format!("the failure took {took:?} to surface: {msg}"));
    }
    Ok(())
}

/// A call enqueued on a stream in bands whose first copy into page-locked memory is slow
/// (EmuDriver::delay_next_copy, on every rank): the rounds wait for their band to land, so
/// the result is still right.
fn arena_slow_copy(comm: &Comm, gpu: &dyn Driver) -> Result<(), String> {
    let e = |e: qccl::Error| e.to_string();
    let user = gpu.create_stream(0).map_err(e)?;
    let (dtype, op) = (DType::Float32, ReduceOp::Sum);
    let n = comm.size();
    let inputs: Vec<Vec<u8>> = (0..n).map(|q| input(dtype, op, q, 400_009, 7)).collect();
    let count = inputs[0].len() / dtype.size();
    let buf = gpu.alloc_device(0, inputs[0].len()).map_err(e)?;
    let mine = &inputs[comm.rank()];
    // SAFETY: `mine` outlives the synchronize; `buf` holds its bytes.
    unsafe { user.copy_to_device(buf.addr(), mine.as_ptr(), mine.len()) }.map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    let call = comm.prepare_all_reduce(count, dtype, op, None).map_err(e)?;
    let emu = qccl::internal::emulated_driver().ok_or("not on the emulated driver")?;
    emu.delay_next_copy(0, Duration::from_millis(300))
        .map_err(e)?;
    // SAFETY: `buf` lives until `user` passed the call (synchronized below).
    let raw = user.raw();
    if !unsafe { comm.enqueue_all_reduce_dense_at(&call, None, buf.addr(), raw) }.map_err(e)? {
        return Err("the call was not enqueued in bands".into());
    }
    let mut got = vec![0u8; mine.len()];
    // SAFETY: `got` outlives the synchronize; on `user`, behind the call.
    unsafe { user.copy_to_host(got.as_mut_ptr(), buf.addr(), got.len()) }.map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    check_reduce(dtype, op, &inputs, 0..count, &got)?;
    same_on_all_ranks(comm, &got, "slow copy")?;
    if comm.arena_device_calls() != 1 {
        return Err(format!(
            "{} calls through the arena",
            comm.arena_device_calls()
        ));
    }
    Ok(())
}

/// Every dtype with every op it takes, at counts 0, 1 and primes.
fn every_case() -> Vec<(DType, ReduceOp, usize)> {
    let mut cases = Vec::new();
    for dtype in DType::ALL {
        for op in ops_for(dtype) {
            for count in [0, 1, 7, 4099, 65537] {
                cases.push((dtype, op, count));
            }
        }
    }
    cases
}

/// Every dtype and op, and calls of many rounds (slots reused, odd tails).
fn arena_cases() -> Vec<(DType, ReduceOp, usize)> {
    let mut cases = every_case();
    cases.extend([
        (DType::Float32, ReduceOp::Sum, 1_000_003),
        (DType::Float16, ReduceOp::Avg, 777_777),
        (DType::Int64, ReduceOp::Max, 300_007),
    ]);
    cases
}

/// Every dtype and op, and calls of more pieces than a call has bands.
fn hosts_cases() -> Vec<(DType, ReduceOp, usize)> {
    let mut cases = every_case();
    cases.extend([
        (DType::Float32, ReduceOp::Sum, 1_000_003),
        (DType::Bfloat16, ReduceOp::Avg, 777_777),
    ]);
    cases
}

fn few_cases() -> Vec<(DType, ReduceOp, usize)> {
    vec![
        (DType::Float32, ReduceOp::Sum, 100_003),
        (DType::Bfloat16, ReduceOp::Avg, 4099),
        (DType::Int8, ReduceOp::Prod, 7),
        (DType::Float64, ReduceOp::Max, 1),
        (DType::Float16, ReduceOp::Min, 0),
    ]
}

/// The all-reduce of `mine` in device buffers (a receive buffer of garbage out of place),
/// made as `how` says; the result read back.
fn on_device(
    comm: &Comm,
    gpu: &dyn Driver,
    user: &dyn Stream,
    mine: &[u8],
    (dtype, op): (DType, ReduceOp),
    how: How,
) -> Result<Vec<u8>, String> {
    let e = |e: qccl::Error| e.to_string();
    let len = mine.len();
    let count = len / dtype.size();
    let upload = |bytes: &[u8]| -> Result<Box<dyn DeviceMem>, String> {
        let m = gpu.alloc_device(0, bytes.len().max(1)).map_err(e)?;
        // SAFETY: `bytes` outlives the synchronize below; `m` holds them.
        unsafe { user.copy_to_device(m.addr(), bytes.as_ptr(), bytes.len()) }.map_err(e)?;
        user.synchronize(WAIT).map_err(e)?;
        Ok(m)
    };
    let send = upload(mine)?;
    let recv = match how {
        How::Stream => None,
        How::Default | How::Queued | How::StreamOut => Some(upload(&vec![0xa5; len])?),
    };
    let call = comm.prepare_all_reduce(count, dtype, op, None).map_err(e)?;
    let out = recv.as_deref().unwrap_or(&*send);
    let from = recv.is_some().then(|| send.addr());
    match how {
        // SAFETY: device buffers of `len` bytes that live until the request ended.
        How::Queued => unsafe { comm.submit_all_reduce_dense_at(Box::new(call), from, out.addr()) }
            .map_err(e)?
            .wait()
            .map_err(e)?,
        // SAFETY (all): device buffers of `len` bytes that live until the call returned or
        // `user` passed it (synchronized below); `user` is a live stream of their device.
        How::Stream | How::StreamOut => {
            // Enqueued, pipelined through the arena where that applies (the C API's way on
            // a stream), else the blocking entry.
            let raw = user.raw();
            if !unsafe { comm.enqueue_all_reduce_dense_at(&call, from, out.addr(), raw) }
                .map_err(e)?
            {
                unsafe { comm.all_reduce_dense_at(&call, from, out.addr(), raw) }.map_err(e)?;
            }
        }
        How::Default => {
            unsafe { comm.all_reduce_dense_at(&call, from, out.addr(), std::ptr::null_mut()) }
                .map_err(e)
                .map(drop)?
        }
    }
    let mut got = vec![0u8; len];
    // SAFETY: `got` outlives the synchronize below. On `user`: the call is done before it
    // returned, which the copy must see even when the call was on the legacy stream.
    unsafe { user.copy_to_host(got.as_mut_ptr(), out.addr(), len) }.map_err(e)?;
    user.synchronize(WAIT).map_err(e)?;
    Ok(got)
}

/// The same all-reduce on host buffers, through the same entry.
fn on_host(
    comm: &Comm,
    mine: &[u8],
    (dtype, op): (DType, ReduceOp),
    in_place: bool,
) -> Result<Vec<u8>, String> {
    let e = |e: qccl::Error| e.to_string();
    let count = mine.len() / dtype.size();
    let call = comm.prepare_all_reduce(count, dtype, op, None).map_err(e)?;
    let mut send = mine.to_vec();
    let mut recv = vec![0xa5u8; mine.len()];
    let (from, out) = if in_place {
        (None, send.as_mut_ptr() as u64)
    } else {
        (Some(send.as_ptr() as u64), recv.as_mut_ptr() as u64)
    };
    // SAFETY: host buffers of the call's bytes, alive until it returns.
    unsafe { comm.all_reduce_dense_at(&call, from, out, std::ptr::null_mut()) }.map_err(e)?;
    Ok(if in_place { send } else { recv })
}

/// Runs `scenario` on `n` ranks, rank r with `env(r)` added; asserts every rank passed.
fn job(n: usize, scenario: &str, env: impl Fn(usize) -> Vec<(&'static str, &'static str)>) {
    let job = Job::new(n);
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut vars = vec![("QCCL_TIMEOUT_MS", "60000")];
            vars.extend(env(r));
            job.spawn(r, scenario, &vars)
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = common::job::wait(c, LIMIT);
        assert_eq!(
            o.status.code(),
            Some(0),
            "rank {r} of {n} ({scenario}): {}",
            text(&o)
        );
    }
}

fn ipc(_: usize) -> Vec<(&'static str, &'static str)> {
    vec![("QCCL_CUDA_IPC", "1")]
}

#[test]
fn every_dtype_and_op_at_three_ranks() {
    job(3, "all", ipc);
}

#[test]
fn every_dtype_and_op_at_five_ranks() {
    job(5, "all", ipc);
}

#[test]
fn one_and_seven_ranks() {
    job(1, "few", ipc);
    job(7, "few", ipc);
}

#[test]
fn reduce_scatter_and_all_gather_at_three_and_five_ranks() {
    job(3, "colls", ipc);
    job(5, "colls", ipc);
}

#[test]
fn a_rank_with_host_buffers_makes_every_rank_stage() {
    job(3, "mixed", ipc);
}

#[test]
fn a_rank_that_did_not_ask_turns_it_off_for_all() {
    job(3, "partial", |r| if r == 2 { vec![] } else { ipc(r) });
}

fn no_ipc(_: usize) -> Vec<(&'static str, &'static str)> {
    vec![]
}

#[test]
fn through_the_arena_at_two_three_and_five_ranks() {
    job(2, "arena", no_ipc);
    job(3, "arena", no_ipc);
    job(5, "arena", no_ipc);
}

#[test]
fn through_the_arena_at_one_and_seven_ranks() {
    job(1, "arena-few", no_ipc);
    job(7, "arena-few", no_ipc);
}

#[test]
fn a_slow_copy_on_a_stream_holds_its_band() {
    job(3, "arena-slow", no_ipc);
}

#[test]
fn a_failed_copy_into_the_arena_fails_every_rank_at_once() {
    job(3, "arena-fault", no_ipc);
}

#[test]
fn through_the_arena_beside_a_rank_on_host_buffers() {
    job(3, "arena-mixed", no_ipc);
}

/// Rank r on emulated host `r % hosts` (interleaved), pieces of 16 KiB.
fn on_hosts(hosts: usize) -> impl Fn(usize) -> Vec<(&'static str, &'static str)> {
    const NAMES: [&str; 3] = ["emuhost0", "emuhost1", "emuhost2"];
    move |r| {
        vec![
            ("QCCL_HOSTID", NAMES[r % hosts]),
            ("QCCL_CHUNKSIZE", "16384"),
        ]
    }
}

#[test]
fn across_emulated_hosts_hierarchical_calls_stage_in_bands() {
    job(4, "hosts", on_hosts(2));
}

/// One rank on each of 3 emulated hosts, SRA at every size (QCCL_ALGO=sra) in 4 KiB slices:
/// staged in bands of slices.
#[test]
fn across_emulated_hosts_sra_calls_stage_in_bands() {
    job(3, "hosts-sra", |r| {
        let mut env = on_hosts(3)(r);
        env.extend([("QCCL_ALGO", "sra"), ("QCCL_BUFFSIZE", "4096")]);
        env
    });
}

/// One rank on each of 2 and of 3 emulated hosts, the ring at every size (QCCL_ALGO=ring;
/// the default for 2 hosts of one rank from 64 KiB) in 4 KiB slices: staged in bands of
/// slices.
#[test]
fn across_emulated_hosts_ring_calls_stage_in_bands() {
    for n in [2, 3] {
        job(n, "hosts-ring", move |r| {
            let mut env = on_hosts(n)(r);
            env.extend([("QCCL_ALGO", "ring"), ("QCCL_BUFFSIZE", "4096")]);
            env
        });
    }
}

/// Reduce-scatter and all-gather across hosts (2 hosts × 2 ranks, 3 × 1) run the ring:
/// staged in bands of its 4 KiB slices on a stream, NULL and queued.
#[test]
fn across_emulated_hosts_reduce_scatter_and_all_gather_stage_in_bands() {
    for (n, hosts) in [(4, 2), (3, 3)] {
        job(n, "hosts-colls", move |r| {
            let mut env = on_hosts(hosts)(r);
            env.push(("QCCL_BUFFSIZE", "4096"));
            env
        });
    }
}

/// Broadcast and reduce run the chain in 4 KiB slices on any links: staged in bands of
/// them on one host's shared memory (2 and 5 ranks) and across hosts (2 hosts × 2 ranks).
#[test]
fn broadcast_and_reduce_stage_in_bands_of_the_chains_slices() {
    let small = |_: usize| vec![("QCCL_BUFFSIZE", "4096")];
    job(2, "rooted", small);
    job(5, "rooted", small);
    job(4, "rooted", |r| {
        let mut env = on_hosts(2)(r);
        env.push(("QCCL_BUFFSIZE", "4096"));
        env
    });
}

#[test]
fn across_emulated_hosts_a_failed_copy_fails_every_rank() {
    job(4, "hosts-fault", on_hosts(2));
}

/// Also with streams that hold 100 operations: rank 1's thread is then still enqueueing
/// the call's pieces (blocked behind their waits) when its worker fails the call, whose
/// posted parts must release their waits at once, the call returning as enqueued.
#[test]
fn across_emulated_hosts_a_failed_copy_of_a_compressed_call_on_a_stream_fails_every_rank() {
    job(4, "hosts-coded-fault", on_hosts(2));
    job(4, "hosts-coded-fault", |r| {
        let mut env = on_hosts(2)(r);
        env.push(("QCCL_GPU_EMULATE_QUEUE_DEPTH", "100"));
        env
    });
}

#[test]
fn across_emulated_hosts_beside_a_rank_on_host_buffers() {
    job(6, "hosts-mixed", on_hosts(3));
}

#[test]
fn reduce_scatter_and_all_gather_through_the_arena() {
    job(3, "arena-colls", no_ipc);
    job(2, "arena-colls", no_ipc);
}

/// Ranks as threads of this process (`Comm::init_threads`, as `qcclCommInitAll`): they reach
/// each other's device memory at its address, no IPC handle (CUDA opens none of its own
/// process).
#[test]
fn ranks_as_threads_of_one_process() {
    let gpu = qccl::internal::emulate_gpu(1).unwrap();
    let config = qccl::Config {
        cuda_ipc: true,
        ..qccl::Config::default()
    };
    let comms = Comm::init_threads(3, config).unwrap();
    std::thread::scope(|s| {
        for comm in comms {
            let gpu = gpu.clone();
            s.spawn(move || {
                let r = comm.rank();
                run_cases(&comm, &*gpu, "few").unwrap_or_else(|e| panic!("rank {r}: {e}"));
            });
        }
    });
}

/// The same on a real GPU, 3 processes sharing device 0, over CUDA IPC and through the
/// arena, and 4 on 2 emulated hosts (`--ignored`; QCCL_REQUIRE_GPU=1 makes a missing GPU a
/// failure).
#[test]
#[ignore = "needs an NVIDIA GPU (QCCL_REQUIRE_GPU=1 makes a missing one a failure)"]
fn on_a_real_gpu() {
    if common::real_gpu() {
        job(3, "real-few", ipc);
        job(3, "real-all", ipc);
        job(3, "real-arena-few", no_ipc);
        job(3, "real-arena-colls", no_ipc);
        job(4, "real-hosts", on_hosts(2));
    }
}
