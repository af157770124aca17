//! C calls on device memory (`cudaMalloc`'d buffers, a `qcclStream_t`): where each buffer
//! lives is found before any byte moves; device buffers are staged through page-locked
//! memory on the comm's device. On a stream the call is enqueued and returns at once, the
//! stream waiting for it (`Comm::on_stream`); with NULL (the legacy default stream) it returns
//! once the result is on the device (`Comm::on_buffers`). Host buffers with a NULL stream
//! take the host path unchanged.
//!
//! Where `Comm::dense_path` says so (a comm using CUDA IPC, QCCL_CUDA_IPC=1 on every rank;
//! or, with NULL, a comm whose ranks share one host) a blocking reduce-scatter or all-gather
//! goes through `Comm::coll_dense_at`, and a dense blocking all-reduce through
//! `Comm::all_reduce_dense_at` (non-blocking ones through `Comm::submit_all_reduce_dense_at`
//! and `Comm::submit_coll_dense_at`): over CUDA IPC when every rank's buffers are on one
//! device, else through the shared-memory arena with the GPU copying into and out of its
//! segments when the host path would take the arena's rounds; a blocking one returns once
//! done. A broadcast or reduce on device buffers is staged in bands of the chain's slices
//! where it takes that path (`Comm::rooted_in_bands_at`, `Comm::submit_rooted_in_bands`;
//! on a stream `Comm::enqueue_coll_dense_at`), whole otherwise.
//!
//! A compressed all-reduce goes through the core's one entry for them
//! (`Comm::all_reduce_compressed_at`, `Comm::submit_all_reduce_compressed_at`): a flat SRA or
//! all-gather scheme (sparse codecs) on float32, float16 or bfloat16 device buffers whose
//! codecs have launch plans runs them on the GPU instead of
//! staging, blocking (NULL or a stream) and non-blocking alike. Grouped calls are all staged,
//! together at `qcclGroupEnd` (group.rs, spans.rs), the GPU codecs included: a group may mix
//! calls whose buffers overlap (an all-reduce into a buffer a later send of the group reads),
//! which one staged copy per span keeps in order. Other non-blocking calls (and the dense
//! ones `Comm::dense_path` does not take) are staged in the comm's turn
//! (`Comm::submit_on_buffers`).

use crate::group::{launch, queue};
use crate::handle::CommHandle;
use crate::nesting::in_group;
use crate::op::Op;
use crate::types::{qcclComm_t, qcclStream_t};
use qccl_core::internal::{AllReduceCall, Coll, PreparedAllReduce};
use qccl_core::{Request, Result};
use std::sync::Arc;

/// Runs the blocking call `op` on comm `token` where its buffers live, ordered on `stream`.
pub(crate) fn launch_on(
    token: qcclComm_t,
    h: Arc<CommHandle>,
    op: Op,
    stream: qcclStream_t,
) -> Result<()> {
    if in_group() {
        // Staged at qcclGroupEnd, with the group's other calls on this comm.
        return queue(token, h, op, stream);
    }
    if let Op::HiTopK { send, recv, call } = &op {
        let (s, r) = addrs(send, recv);
        // SAFETY (both): the C caller's contract (qccl.h): the buffers (distinct: in place
        // is `send: None`) stay valid until the call returns (NULL) or the stream passes it,
        // and `stream` is NULL or a live stream of their device.
        let done = if stream.is_null() {
            unsafe { h.comm.hitopk_on_device(call, s, r) }?.is_some()
        } else {
            unsafe { h.comm.enqueue_hitopk_on_device(call, s, r, stream) }?.is_some()
        };
        if done {
            return Ok(());
        }
    }
    let op = match compressed(op) {
        Ok((call, send, recv)) => {
            // SAFETY: the C caller's contract (qccl.h): the buffers (distinct: in place is
            // `send: None`) stay valid until the call returns (NULL) or the stream passes it,
            // and `stream` is NULL or a live stream of their device.
            return unsafe { h.comm.all_reduce_compressed_at(call, send, recv, stream) }.map(drop);
        }
        Err(op) => op,
    };
    if h.comm.dense_path(stream) {
        // SAFETY (both): as above; the call returns once done (the buffers are then free).
        match &op {
            Op::Coll { send, recv, call }
                if matches!(call.coll, Coll::ReduceScatter | Coll::AllGather) =>
            {
                let (s, r) = addrs(send, recv);
                return unsafe { h.comm.coll_dense_at(call, s, r, stream) };
            }
            Op::AllReduce { send, recv, call } => {
                let (s, r) = addrs(send, recv);
                return unsafe { h.comm.all_reduce_dense_at(call, s, r, stream) }.map(drop);
            }
            _ => {}
        }
    }
    if let (Op::Coll { send, recv, call }, true) = (&op, stream.is_null()) {
        let (s, r) = addrs(send, recv);
        // SAFETY: as above; a broadcast or reduce in bands returns once done.
        if unsafe { h.comm.rooted_in_bands_at(call, s, r, stream) }? {
            return Ok(());
        }
    }
    let comm = h.clone();
    let bufs = op.call_bufs();
    if !stream.is_null() {
        // Ranks sharing one host: pipelined through their arena, enqueued and returning at
        // once, where it applies.
        // SAFETY (both): as below.
        let enqueued = match &op {
            Op::AllReduce { send, recv, call } => {
                let (s, r) = addrs(send, recv);
                unsafe { h.comm.enqueue_all_reduce_dense_at(call, s, r, stream) }?
            }
            Op::Coll { send, recv, call } => {
                let (s, r) = addrs(send, recv);
                unsafe { h.comm.enqueue_coll_dense_at(call, s, r, stream) }?
            }
            _ => false,
        };
        if enqueued {
            return Ok(());
        }
        // NCCL's semantics: enqueued on the stream, returning at once (device buffers).
        // SAFETY: as below; the buffers stay valid until the stream passes the call.
        return unsafe {
            let coded = op.coded_calls();
            comm.comm.on_stream(&bufs, stream, coded, move |e, hosts| {
                op.rebased(hosts).run(e)
            })
        };
    }
    // SAFETY: the C caller's contract (qccl.h): each buffer is valid for the call's reads and
    // writes until it returns, and `stream` is NULL or a live stream of their device.
    unsafe {
        comm.comm
            .on_buffers(&bufs, stream, |hosts| launch(token, h, op.rebased(hosts)))
    }
}

/// Queues the non-blocking call `op`, whose buffers include device memory, on `h`'s comm:
/// the request ends once the results are on the device.
///
/// # Safety
/// The C caller's contract (qccl.h): the buffers stay valid until qcclWait returns, which is
/// after the request ended.
pub(crate) unsafe fn submit_on_device(h: &CommHandle, op: Op) -> Result<Request<()>> {
    let op = match compressed(op) {
        // SAFETY: the caller's promise, passed on; the buffers are distinct (in place is
        // `send: None`).
        Ok((call, send, recv)) => {
            return unsafe { h.comm.submit_all_reduce_compressed_at(call, send, recv) }
        }
        Err(op) => op,
    };
    let op = match op {
        // The core's entry on a comm using CUDA IPC (over it when every rank's buffers are on
        // one device) or one host's arena (the GPU copying into and out of it).
        Op::AllReduce { send, recv, call } if h.comm.dense_path(std::ptr::null_mut()) => {
            let (send, recv) = addrs(&send, &recv);
            // SAFETY: the caller's promise, passed on; the buffers are distinct.
            return unsafe { h.comm.submit_all_reduce_dense_at(call, send, recv) };
        }
        Op::Coll { send, recv, call }
            if h.comm.dense_path(std::ptr::null_mut())
                && matches!(call.coll, Coll::ReduceScatter | Coll::AllGather) =>
        {
            let (send, recv) = addrs(&send, &recv);
            // SAFETY: as above.
            return unsafe { h.comm.submit_coll_dense_at(call, send, recv) };
        }
        // A broadcast or reduce staged in bands of the chain's slices, where it takes that
        // path.
        Op::Coll { send, recv, call } if matches!(call.coll, Coll::Broadcast | Coll::Reduce) => {
            let (s, r) = addrs(&send, &recv);
            // SAFETY: as above.
            match unsafe { h.comm.submit_rooted_in_bands(&call, s, r) }? {
                Some(req) => return Ok(req),
                None => Op::Coll { send, recv, call },
            }
        }
        op => op,
    };
    let (bufs, coded) = (op.call_bufs(), op.coded_calls());
    let run = move |e: &mut qccl_core::internal::Engine, hosts: &[*mut u8]| {
        crate::last_error::no_panic(|| op.rebased(hosts).run(e))
    };
    // SAFETY: the caller's promise, passed on.
    unsafe { h.comm.submit_on_buffers(bufs, coded, run) }
}

/// The raw addresses of a call's send buffer (None: in place) and receive buffer.
fn addrs(send: &Option<crate::buf::RawBuf>, recv: &crate::buf::RawBuf) -> (Option<u64>, u64) {
    (send.map(|s| s.start() as u64), recv.start() as u64)
}

/// A compressed all-reduce's prepared call and raw send (None: in place) and receive
/// addresses, for the core's entry; any other operation as it was.
fn compressed(op: Op) -> std::result::Result<(PreparedAllReduce, Option<u64>, u64), Op> {
    match op {
        Op::AllReduce { send, recv, call } => match AllReduceCall::into_compressed(call) {
            Ok(c) => {
                let (s, r) = addrs(&send, &recv);
                Ok((c, s, r))
            }
            Err(call) => Err(Op::AllReduce { send, recv, call }),
        },
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use crate::*;
    use qccl_core::internal::gpu_driver::{DeviceMem, Driver};
    use std::ffi::{c_void, CStr};
    use std::ptr::null_mut;
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(30);

    fn upload(gpu: &dyn Driver, data: &[f32]) -> Box<dyn DeviceMem> {
        let len = std::mem::size_of_val(data);
        let m = gpu.alloc_device(0, len.max(1)).unwrap();
        let s = gpu.create_stream(0).unwrap();
        // SAFETY: `data` outlives the synchronize.
        unsafe { s.copy_to_device(m.addr(), data.as_ptr().cast(), len) }.unwrap();
        s.synchronize(WAIT).unwrap();
        m
    }

    fn upload_into(gpu: &dyn Driver, m: &dyn DeviceMem, data: &[f32]) {
        let s = gpu.create_stream(0).unwrap();
        // SAFETY: `data` outlives the synchronize; `m` holds at least `data`.
        unsafe { s.copy_to_device(m.addr(), data.as_ptr().cast(), std::mem::size_of_val(data)) }
            .unwrap();
        s.synchronize(WAIT).unwrap();
    }

    fn download(gpu: &dyn Driver, m: &dyn DeviceMem, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        let s = gpu.create_stream(0).unwrap();
        // SAFETY: `out` outlives the synchronize.
        unsafe { s.copy_to_host(out.as_mut_ptr().cast(), m.addr(), 4 * n) }.unwrap();
        s.synchronize(WAIT).unwrap();
        out
    }

    fn last_error(comm: qcclComm_t) -> String {
        // SAFETY: qcclGetLastError returns a NUL-terminated string that stays valid until
        // the next call on this thread.
        unsafe { CStr::from_ptr(qcclGetLastError(comm)) }
            .to_string_lossy()
            .into_owned()
    }

    type Dev = Box<dyn DeviceMem>;

    /// `n` comms of `qcclCommInitAll`.
    fn init_all(n: usize) -> Vec<qcclComm_t> {
        let mut comms = vec![null_mut(); n];
        // SAFETY: room for `n` comms; no device list.
        assert_eq!(
            unsafe { qcclCommInitAll(comms.as_mut_ptr(), n as i32, std::ptr::null()) },
            qcclSuccess
        );
        comms
    }

    /// Rank r of n's first two C calls on `count` floats of device memory, each checked: a
    /// sum out of place on NULL into `recv`, then a max in place in `send` on a stream of the
    /// caller's. Returns (send, recv, this rank's input, the sum).
    fn sum_then_max(
        gpu: &dyn Driver,
        comm: qcclComm_t,
        (r, n): (usize, usize),
        count: usize,
    ) -> (Dev, Dev, Vec<f32>, Vec<f32>) {
        let mine: Vec<f32> = (0..count).map(|i| ((r + i) % 7) as f32).collect();
        let want: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|p| ((p + i) % 7) as f32).sum())
            .collect();
        let send = upload(gpu, &mine);
        let recv = upload(gpu, &vec![0.0; count]);
        let (sp, rp) = (send.addr() as *const c_void, recv.addr() as *mut c_void);
        // SAFETY (both calls): device buffers of `count` floats, alive for the call; a stream
        // of the emulated driver or NULL.
        let rc = unsafe { qcclAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, null_mut()) };
        assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
        assert_eq!(download(gpu, &*recv, count), want);
        let user = gpu.create_stream(0).unwrap();
        let rc = unsafe {
            qcclAllReduce(
                sp,
                sp as *mut c_void,
                count,
                qcclFloat32,
                qcclMax,
                comm,
                user.raw(),
            )
        };
        assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
        // Enqueued (or done, over CUDA IPC): the stream passes the call once it is done.
        user.synchronize(WAIT).unwrap();
        let max: Vec<f32> = (0..count)
            .map(|i| (0..n).map(|p| ((p + i) % 7) as f32).fold(0.0, f32::max))
            .collect();
        assert_eq!(download(gpu, &*send, count), max);
        (send, recv, mine, want)
    }

    /// Rank r of n's all-gather of `mine` (its input, `sum_then_max`'s, copied into `send`)
    /// on NULL, then a reduce-scatter of the gathered buffer into `recv`: every rank holds
    /// the same one, so rank r gets n times its part r, which is rank r's input. Each
    /// checked.
    fn gather_then_scatter(
        gpu: &dyn Driver,
        comm: qcclComm_t,
        (r, n): (usize, usize),
        (send, recv): (&dyn DeviceMem, &dyn DeviceMem),
        mine: &[f32],
    ) {
        let count = mine.len();
        upload_into(gpu, send, mine);
        let all = upload(gpu, &vec![-1.0; count * n]);
        let (sp, rp, ap) = (
            send.addr() as *const c_void,
            recv.addr() as *mut c_void,
            all.addr() as *mut c_void,
        );
        // SAFETY (both): device buffers of the call's floats, alive for it.
        let rc = unsafe { qcclAllGather(sp, ap, count, qcclFloat32, comm, null_mut()) };
        assert_eq!(rc, qcclSuccess, "rank {r}: {}", last_error(comm));
        let gathered: Vec<f32> = (0..n)
            .flat_map(|p| (0..count).map(move |i| ((p + i) % 7) as f32))
            .collect();
        assert_eq!(download(gpu, &*all, count * n), gathered);
        let rc =
            unsafe { qcclReduceScatter(ap, rp, count, qcclFloat32, qcclSum, comm, null_mut()) };
        assert_eq!(rc, qcclSuccess, "rank {r}: {}", last_error(comm));
        let part: Vec<f32> = mine.iter().map(|x| x * n as f32).collect();
        assert_eq!(download(gpu, recv, count), part);
    }

    /// Compressed all-reduces through the C calls, two ranks on device buffers (the codec on
    /// the GPU: NULL, a stream, and non-blocking with qcclWait) and one on host buffers: every
    /// rank ends with the same bits, close to the float64 sum, error feedback carried over
    /// four calls.
    #[test]
    fn compressed_calls_run_their_codecs_on_the_device() {
        let gpu = qccl_core::internal::emulate_gpu(1).unwrap();
        let n = 3;
        let mut comms = vec![null_mut(); n];
        // SAFETY: room for `n` comms; no device list.
        assert_eq!(
            unsafe { qcclCommInitAll(comms.as_mut_ptr(), n as i32, std::ptr::null()) },
            qcclSuccess
        );
        let mut codec = null_mut();
        // SAFETY: a NUL-terminated spec and room for the handle.
        assert_eq!(
            unsafe { qcclCodecCreate(c"fp16:ef=1".as_ptr(), &mut codec) },
            qcclSuccess
        );
        let count = 10_007;
        let input = |r: usize, call: usize| -> Vec<f32> {
            (0..count)
                .map(|i| ((r * 31 + i * 7 + call) % 101) as f32 / 50.0 - 1.0)
                .collect()
        };
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let ranks: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, &comm)| {
                    let (gpu, comm, codec) = (gpu.clone(), comm as usize, codec as usize);
                    s.spawn(move || {
                        let (comm, codec) = (comm as qcclComm_t, codec as qcclCodec_t);
                        let user = gpu.create_stream(0).unwrap();
                        let mut outs = Vec::new();
                        for call in 0..4 {
                            let mine = input(r, call);
                            let got = if r == 2 {
                                let mut out = vec![0f32; count];
                                // SAFETY: host buffers of `count` floats, NULL stream.
                                let rc = unsafe {
                                    qcclAllReduceCompressed(
                                        mine.as_ptr().cast(),
                                        out.as_mut_ptr().cast(),
                                        count,
                                        qcclFloat32,
                                        qcclSum,
                                        codec,
                                        5,
                                        comm,
                                        null_mut(),
                                    )
                                };
                                assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                                out
                            } else {
                                let send = upload(&*gpu, &mine);
                                let recv = upload(&*gpu, &vec![0.0; count]);
                                let stream = if call == 1 { user.raw() } else { null_mut() };
                                let (sp, rp) = (send.addr() as *const c_void, recv.addr());
                                if call == 3 {
                                    // Non-blocking: the codec on the GPU in the comm's turn.
                                    let mut req = null_mut();
                                    // SAFETY: device buffers of `count` floats, alive until
                                    // qcclWait returned.
                                    let rc = unsafe {
                                        qcclIAllReduceCompressed(
                                            sp,
                                            rp as *mut c_void,
                                            count,
                                            qcclFloat32,
                                            qcclSum,
                                            codec,
                                            5,
                                            comm,
                                            &mut req,
                                        )
                                    };
                                    assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                                    assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
                                    outs.push(download(&*gpu, &*recv, count));
                                    continue;
                                }
                                // SAFETY: device buffers of `count` floats, alive until the
                                // stream passed the call (synchronised below).
                                let rc = unsafe {
                                    qcclAllReduceCompressed(
                                        send.addr() as *const c_void,
                                        recv.addr() as *mut c_void,
                                        count,
                                        qcclFloat32,
                                        qcclSum,
                                        codec,
                                        5,
                                        comm,
                                        stream,
                                    )
                                };
                                assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                                user.synchronize(WAIT).unwrap();
                                download(&*gpu, &*recv, count)
                            };
                            outs.push(got);
                        }
                        if r != 2 {
                            let c = crate::handle::comm(comm).unwrap();
                            assert_eq!(c.comm.device_stats().unwrap().calls, 4, "rank {r}");
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
            assert!(
                bits(&results[r]) == bits(&results[0]),
                "rank {r} differs from rank 0"
            );
        }
        for (call, got) in results[0].iter().enumerate() {
            let ins: Vec<Vec<f32>> = (0..n).map(|p| input(p, call)).collect();
            for (i, &g) in got.iter().enumerate() {
                let want: f64 = ins.iter().map(|x| x[i] as f64).sum();
                let mag: f64 = ins.iter().map(|x| (x[i] as f64).abs()).sum();
                assert!(
                    (g as f64 - want).abs() <= mag / 256.0 + 1e-6,
                    "call {call} element {i}: {g}, want {want}"
                );
            }
        }
        assert_eq!(qcclCodecDestroy(codec), qcclSuccess);
        for c in comms {
            assert_eq!(qcclCommDestroy(c), qcclSuccess);
        }
    }

    /// Three ranks as threads: device buffers through the blocking C calls (NULL stream and
    /// a stream of the emulated driver), in groups (collectives and sends sharing a buffer)
    /// and in non-blocking calls.
    #[test]
    fn c_calls_take_device_buffers() {
        let gpu = qccl_core::internal::emulate_gpu(1).unwrap();
        let n = 3;
        let comms = init_all(n);
        let count = 70_001;
        std::thread::scope(|s| {
            for (r, &comm) in comms.iter().enumerate() {
                let gpu = gpu.clone();
                let comm = comm as usize;
                s.spawn(move || {
                    let comm = comm as qcclComm_t;
                    let (send, recv, mine, want) = sum_then_max(&*gpu, comm, (r, n), count);
                    let (sp, rp) = (send.addr() as *const c_void, recv.addr() as *mut c_void);
                    let user = gpu.create_stream(0).unwrap();
                    // Grouped: an all-reduce into `recv`, then `recv` sent on round the ring
                    // and `send` sent the other way; one staged copy of `recv` (spans.rs), so
                    // the send reads what the all-reduce wrote.
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let got_sum = upload(&*gpu, &vec![-1.0; count]);
                    let got_theirs = upload(&*gpu, &vec![-1.0; count]);
                    let (gs, gt) = (
                        got_sum.addr() as *mut c_void,
                        got_theirs.addr() as *mut c_void,
                    );
                    let theirs: Vec<f32> = (0..count).map(|i| ((next + i) % 7) as f32).collect();
                    for stream in [null_mut(), user.raw()] {
                        upload_into(&*gpu, &*send, &mine);
                        assert_eq!(qcclGroupStart(), qcclSuccess);
                        let rcs = unsafe {
                            [
                                qcclAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, stream),
                                qcclSend(rp, count, qcclFloat32, next as i32, comm, stream),
                                qcclRecv(gs, count, qcclFloat32, prev as i32, comm, stream),
                                qcclSend(sp, count, qcclFloat32, prev as i32, comm, stream),
                                qcclRecv(gt, count, qcclFloat32, next as i32, comm, stream),
                            ]
                        };
                        assert_eq!(rcs, [qcclSuccess; 5], "{}", last_error(comm));
                        assert_eq!(qcclGroupEnd(), qcclSuccess, "{}", last_error(comm));
                        user.synchronize(WAIT).unwrap();
                        assert_eq!(download(&*gpu, &*recv, count), want);
                        assert_eq!(download(&*gpu, &*got_sum, count), want);
                        assert_eq!(download(&*gpu, &*got_theirs, count), theirs);
                    }
                    // One stream per comm in a group: a second one spoils the group.
                    assert_eq!(qcclGroupStart(), qcclSuccess);
                    let rc = unsafe {
                        qcclAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, user.raw())
                    };
                    assert_eq!(rc, qcclSuccess);
                    let rc = unsafe {
                        qcclAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, null_mut())
                    };
                    assert_eq!(rc, qcclUnsupported);
                    assert!(
                        last_error(comm).contains("one stream per comm"),
                        "{}",
                        last_error(comm)
                    );
                    assert_eq!(qcclGroupEnd(), qcclUnsupported);
                    // Non-blocking: staged in the comm's turn, done at qcclWait.
                    upload_into(&*gpu, &*recv, &vec![0.0; count]);
                    let mut req = null_mut();
                    let rc = unsafe {
                        qcclIAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, &mut req)
                    };
                    assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                    assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
                    assert_eq!(download(&*gpu, &*recv, count), want);
                    // The comm still works.
                    let rc = unsafe {
                        qcclAllReduce(sp, rp, count, qcclFloat32, qcclMin, comm, null_mut())
                    };
                    assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                });
            }
        });
        for c in comms {
            assert_eq!(qcclCommDestroy(c), qcclSuccess);
        }
    }

    /// QCCL_CUDA_IPC=1 (set for a child run of this test, the variable being read when the
    /// comms are made): three ranks of `qcclCommInitAll` reduce device buffers through each
    /// other's memory, from the blocking call on NULL and on a stream (in place) and from
    /// the non-blocking one; a call with host buffers on one rank makes all stage; an
    /// all-gather and a reduce-scatter take the same path.
    #[test]
    fn c_calls_take_cuda_ipc() {
        const NAME: &str = "device::tests::c_calls_take_cuda_ipc";
        if std::env::var("QCCL_CUDA_IPC").as_deref() != Ok("1") {
            let o = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
                .env("QCCL_CUDA_IPC", "1")
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "{}\n{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            assert!(
                String::from_utf8_lossy(&o.stdout).contains("1 passed"),
                "the child ran no test"
            );
            return;
        }
        let gpu = qccl_core::internal::emulate_gpu(1).unwrap();
        let n = 3;
        let comms = init_all(n);
        let count = 10_007;
        std::thread::scope(|s| {
            for (r, &comm) in comms.iter().enumerate() {
                let gpu = gpu.clone();
                let comm = comm as usize;
                s.spawn(move || {
                    let comm = comm as qcclComm_t;
                    let c = crate::handle::comm(comm).unwrap();
                    assert!(c.comm.uses_cuda_ipc());
                    let (send, recv, mine, want) = sum_then_max(&*gpu, comm, (r, n), count);
                    let (sp, rp) = (send.addr() as *const c_void, recv.addr() as *mut c_void);
                    upload_into(&*gpu, &*send, &mine);
                    upload_into(&*gpu, &*recv, &vec![0.0; count]);
                    let mut req = null_mut();
                    let rc = unsafe {
                        qcclIAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, &mut req)
                    };
                    assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                    assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
                    assert_eq!(download(&*gpu, &*recv, count), want);
                    assert_eq!(c.comm.cuda_ipc_calls(), 3, "rank {r}");
                    // Rank 1 on host buffers: every rank stages.
                    let host_in = mine.clone();
                    let mut host_out = vec![0f32; count];
                    let rc = if r == 1 {
                        unsafe {
                            qcclAllReduce(
                                host_in.as_ptr().cast(),
                                host_out.as_mut_ptr().cast(),
                                count,
                                qcclFloat32,
                                qcclSum,
                                comm,
                                null_mut(),
                            )
                        }
                    } else {
                        unsafe {
                            qcclAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, null_mut())
                        }
                    };
                    assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                    let got = if r == 1 {
                        host_out
                    } else {
                        download(&*gpu, &*recv, count)
                    };
                    assert_eq!(got, want, "rank {r}, mixed");
                    assert_eq!(
                        c.comm.cuda_ipc_calls(),
                        3,
                        "rank {r}: the mixed call staged"
                    );
                    gather_then_scatter(&*gpu, comm, (r, n), (&*send, &*recv), &mine);
                    assert_eq!(c.comm.cuda_ipc_calls(), 5, "rank {r}");
                    // A non-blocking all-gather too.
                    let all = upload(&*gpu, &vec![-1.0; count * n]);
                    let ap = all.addr() as *mut c_void;
                    let rc = unsafe { qcclIAllGather(sp, ap, count, qcclFloat32, comm, &mut req) };
                    assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
                    assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
                    let gathered: Vec<f32> = (0..n)
                        .flat_map(|p| (0..count).map(move |i| ((p + i) % 7) as f32))
                        .collect();
                    assert_eq!(download(&*gpu, &*all, count * n), gathered);
                    assert_eq!(c.comm.cuda_ipc_calls(), 6, "rank {r}");
                });
            }
        });
        for c in comms {
            assert_eq!(qcclCommDestroy(c), qcclSuccess);
        }
    }

    /// Three ranks as processes sharing one host (this test run again as each, the unique
    /// id passed in the environment): the blocking calls on NULL and the non-blocking ones
    /// go through the shared-memory arena, the (emulated) GPU copying into and out of it,
    /// and so does a call on a stream (enqueued in bands).
    #[test]
    fn c_calls_on_null_go_through_the_arena() {
        const NAME: &str = "device::tests::c_calls_on_null_go_through_the_arena";
        const CHILD: &str = "QCCL_FFI_ARENA_RANK";
        let n = 3;
        let Ok(rank) = std::env::var(CHILD) else {
            let mut id = qcclUniqueId {
                internal: [0; QCCL_UNIQUE_ID_BYTES],
            };
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { qcclGetUniqueId(&mut id) }, qcclSuccess);
            let hex: String = id
                .internal
                .iter()
                .map(|&b| format!("{:02x}", b as u8))
                .collect();
            let children: Vec<_> = (0..n)
                .map(|r| {
                    std::process::Command::new(std::env::current_exe().unwrap())
                        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
                        .env(CHILD, r.to_string())
                        .env("QCCL_FFI_ARENA_ID", &hex)
                        .env_remove("QCCL_CUDA_IPC")
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            for (r, c) in children.into_iter().enumerate() {
                let o = c.wait_with_output().unwrap();
                let out = String::from_utf8_lossy(&o.stdout);
                assert!(
                    o.status.success() && out.contains("1 passed"),
                    "rank {r}:\n{out}\n{}",
                    String::from_utf8_lossy(&o.stderr)
                );
            }
            return;
        };
        let r: usize = rank.parse().unwrap();
        let hex = std::env::var("QCCL_FFI_ARENA_ID").unwrap();
        let mut id = qcclUniqueId {
            internal: [0; QCCL_UNIQUE_ID_BYTES],
        };
        for (i, b) in id.internal.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as std::ffi::c_char;
        }
        let mut comm = null_mut();
        // SAFETY: a valid out-pointer; the id of this job.
        let rc = unsafe { qcclCommInitRank(&mut comm, n as i32, id, r as i32) };
        assert_eq!(rc, qcclSuccess);
        let c = crate::handle::comm(comm).unwrap();
        assert!(!c.comm.uses_cuda_ipc());
        let gpu = qccl_core::internal::emulate_gpu(1).unwrap();
        // 3 × 280 KB: past the arena's one-shot fold.
        let count = 70_001;
        // A sum on NULL (through the arena), a max on a stream (enqueued in bands, through
        // the arena too).
        let (send, recv, mine, want) = sum_then_max(&*gpu, comm, (r, n), count);
        assert_eq!(c.comm.arena_device_calls(), 2);
        let (sp, rp) = (send.addr() as *const c_void, recv.addr() as *mut c_void);
        upload_into(&*gpu, &*send, &mine);
        upload_into(&*gpu, &*recv, &vec![0.0; count]);
        let mut req = null_mut();
        // SAFETY (every call): device buffers of the call's floats, alive for it.
        let rc = unsafe { qcclIAllReduce(sp, rp, count, qcclFloat32, qcclSum, comm, &mut req) };
        assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
        assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
        assert_eq!(download(&*gpu, &*recv, count), want);
        gather_then_scatter(&*gpu, comm, (r, n), (&*send, &*recv), &mine);
        assert_eq!(c.comm.arena_device_calls(), 5, "rank {r}");
        // Non-blocking all-gather and reduce-scatter take it too.
        let all = upload(&*gpu, &vec![-1.0; count * n]);
        let ap = all.addr() as *mut c_void;
        let rc = unsafe { qcclIAllGather(sp, ap, count, qcclFloat32, comm, &mut req) };
        assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
        assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
        let rc = unsafe { qcclIReduceScatter(ap, rp, count, qcclFloat32, qcclMax, comm, &mut req) };
        assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
        assert_eq!(qcclWait(req), qcclSuccess, "{}", last_error(comm));
        // Every rank's part r of the gathered buffer is rank r's input: its max is itself.
        assert_eq!(download(&*gpu, &*recv, count), mine);
        assert_eq!(c.comm.arena_device_calls(), 7, "rank {r}");
        // HiTopKComm on NULL: its top-k on the GPU, its intra-host levels through the arena
        // (the hierarchy's sub-comm counts those); at density 1 every element is sent, so the
        // sum is the all-reduce's.
        upload_into(&*gpu, &*send, &mine);
        let rc =
            unsafe { qcclHiTopKAllReduce(sp, rp, count, qcclFloat32, 1.0, 5, comm, null_mut()) };
        assert_eq!(rc, qcclSuccess, "{}", last_error(comm));
        assert_eq!(download(&*gpu, &*recv, count), want);
        assert_eq!(c.comm.device_stats().unwrap().calls, 1, "rank {r}");
        assert_eq!(qcclCommDestroy(comm), qcclSuccess);
    }
}
