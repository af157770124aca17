//! Calls on device buffers: objects with `__cuda_array_interface__` (CuPy, Numba, torch) and
//! CUDA torch tensors, run through the core's device path (`Comm::on_buffers` /
//! `Comm::on_stream`, staged through page-locked memory). A call takes this path when one of
//! its buffers is a CUDA array or a `stream=` is given; host buffers alone with no stream take
//! the host path unchanged.
//!
//! The stream: `stream=` (an int `cudaStream_t`; 0 is the legacy default stream, the call
//! completing before it returns), else the v3 interface's `stream` of the device buffers,
//! else none (the call completes before it returns). On a stream the call is enqueued and
//! returns at once (NCCL's semantics): the buffers must stay alive until the stream passes it,
//! and a failure surfaces through `Comm.async_error` and later calls.

use crate::{err, Buf};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use qccl::internal::{AllReduceCall, CallBuf, Coll, CollCall, Engine, PreparedTopK};
use qccl::{Algo, Comm, TopKReport};
use std::sync::Arc;

/// Where a device call's work is ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The legacy default stream; the call completes before it returns.
    Wait,
    /// A caller's stream (`cudaStream_t`): the call is enqueued on it and returns.
    Stream(u64),
}

impl Target {
    /// The `CUstream` the core's calls take (null: the legacy default stream).
    pub(crate) fn stream(self) -> *mut std::ffi::c_void {
        match self {
            Target::Wait => std::ptr::null_mut(),
            Target::Stream(h) => h as *mut std::ffi::c_void,
        }
    }
}

/// The stream handle of a `stream=` argument: an int, or a stream object carrying one
/// (`torch.cuda.Stream.cuda_stream`, CuPy's `Stream.ptr`).
fn handle_of(stream: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(h) = stream.extract::<u64>() {
        return Ok(h);
    }
    for attr in ["cuda_stream", "ptr"] {
        if let Ok(h) = stream.getattr(attr).and_then(|h| h.extract::<u64>()) {
            return Ok(h);
        }
    }
    Err(err(
        "invalid",
        format!(
            "stream must be an int cudaStream_t handle (or a stream object with .cuda_stream), \
             got {}",
            stream
                .repr()
                .map(|r| r.to_string())
                .unwrap_or_else(|_| "?".into())
        ),
    ))
}

/// Whether a call with these buffers (None: not used) and `stream` argument takes the device
/// path, and on which stream; None: the host path.
pub(crate) fn target(
    stream: Option<&Bound<'_, PyAny>>,
    bufs: &[Option<Buf>],
) -> PyResult<Option<Target>> {
    if let Some(s) = stream.filter(|s| !s.is_none()) {
        return Ok(Some(match handle_of(s)? {
            0 => Target::Wait,
            h => Target::Stream(h),
        }));
    }
    let device: Vec<&Buf> = bufs.iter().flatten().filter(|b| b.device).collect();
    if device.is_empty() {
        return Ok(None);
    }
    let mut streams = device.iter().filter_map(|b| b.stream);
    let first = streams.next();
    if let (Some(a), Some(b)) = (first, streams.find(|&s| Some(s) != first)) {
        return Err(err(
            "invalid",
            format!(
                "the CUDA arrays name two streams ({a:#x} and {b:#x}) in \
                 __cuda_array_interface__; pass stream= to choose the call's stream"
            ),
        ));
    }
    Ok(Some(first.map_or(Target::Wait, Target::Stream)))
}

/// What a device call runs on the comm's engine, checked and prepared before any byte moves.
pub(crate) enum Job {
    /// Any collective but all-reduce, or a send or receive (validated).
    Coll(CollCall<'static>),
    AllReduce(Box<AllReduceCall>),
    /// In place (no send buffer).
    TopK(Arc<PreparedTopK>),
}

/// What a call that completed before returning reports.
pub(crate) enum Outcome {
    Done,
    Algo(Algo),
    TopK(TopKReport),
}

impl Job {
    /// A collective validated as the core's `*_raw` calls validate it (the error names it).
    pub(crate) fn coll(c: &Comm, call: CollCall<'static>) -> qccl::Result<Job> {
        crate::check(c, &call)?;
        Ok(Job::Coll(call))
    }

    /// How many compressed calls `run` makes, declared by a call on a stream
    /// (`Comm::on_stream`).
    fn coded_calls(&self) -> u64 {
        match self {
            Job::Coll(_) => 0,
            Job::AllReduce(call) => call.coded_calls(),
            Job::TopK(call) => call.coded_calls(),
        }
    }

    fn run(&self, e: &mut Engine, send: Option<&[u8]>, recv: &mut [u8]) -> qccl::Result<Outcome> {
        match self {
            Job::Coll(call) => e.run_call(call, send, recv).map(|()| Outcome::Done),
            Job::AllReduce(call) => call.run(e, send, recv).map(Outcome::Algo),
            Job::TopK(call) => call.run(e, recv).map(Outcome::TopK),
        }
    }
}

/// The slices standing for a call's buffers on the worker: `hosts` holds one address per
/// `CallBuf` (send first when there is one).
///
/// # Safety
/// Each address must be valid for its length (reads for send, reads and writes for recv)
/// while the slices live, and the two must not overlap (the call checked that send and recv
/// are distinct, and staged copies are distinct page-locked buffers).
unsafe fn views<'a>(
    hosts: &[*mut u8],
    send_len: Option<usize>,
    recv_len: usize,
) -> (Option<&'a [u8]>, &'a mut [u8]) {
    let slice = |p: *mut u8, len: usize| -> &'a mut [u8] {
        if len == 0 {
            return &mut [];
        }
        // SAFETY: the caller's promise (valid, not overlapping the other view).
        unsafe { std::slice::from_raw_parts_mut(p, len) }
    };
    match send_len {
        Some(n) => (Some(&*slice(hosts[0], n)), slice(hosts[1], recv_len)),
        None => (None, slice(hosts[0], recv_len)),
    }
}

/// Runs the compressed all-reduce `call` on `send` (None: in place) and `recv` where they
/// live, ordered on `target`, through the core's one entry for them (as the C call's): the
/// codecs on the GPU where the call has that path, else staged. Its report when it completed
/// before returning; None when enqueued on a stream.
pub(crate) fn run_compressed(
    py: Python<'_>,
    c: &Arc<Comm>,
    target: Target,
    call: qccl::internal::PreparedAllReduce,
    send: Option<Buf>,
    recv: Buf,
) -> PyResult<Option<qccl::Report>> {
    refuse_unusable(target, send, recv)?;
    let stream = match target {
        Target::Wait => 0,
        Target::Stream(h) => h,
    };
    let (sp, rp) = (send.map(|b| b.ptr as u64), recv.ptr as u64);
    // SAFETY: as `run`'s: the buffers are live objects of this call, distinct (the callers
    // checked), kept by the caller until it returns or until the stream passes it, and the
    // stream is null or the caller's live stream of their device.
    py.allow_threads(|| unsafe { c.all_reduce_compressed_at(call, sp, rp, stream as *mut _) })
        .map_err(crate::py_err)
}

/// Runs the dense all-reduce `call` on `send` (None: in place) and `recv` on a comm using
/// CUDA IPC, through the core's entry (as the C call's): over CUDA IPC when every rank's
/// buffers are on one device (returning "cuda_ipc"), staged or on the host otherwise
/// (returning the algorithm's name); returns once done, on a stream too.
pub(crate) fn run_dense(
    py: Python<'_>,
    c: &Arc<Comm>,
    target: Target,
    call: &qccl::internal::AllReduceCall,
    send: Option<Buf>,
    recv: Buf,
) -> PyResult<String> {
    refuse_unusable(target, send, recv)?;
    let (sp, rp) = (send.map(|b| b.ptr as u64), recv.ptr as u64);
    // SAFETY: as `run_compressed`'s; the call returns once done.
    let algo = py
        .allow_threads(|| unsafe { c.all_reduce_dense_at(call, sp, rp, target.stream()) })
        .map_err(crate::py_err)?;
    Ok(algo.map_or("cuda_ipc", |a| a.name()).to_string())
}

/// Runs `job` on `send` (None: in place or unused) and `recv` where they live, ordered on
/// `target`. Some(outcome) when it completed before returning; None when enqueued on a stream.
pub(crate) fn run(
    py: Python<'_>,
    c: &Arc<Comm>,
    target: Target,
    job: Job,
    send: Option<Buf>,
    recv: Buf,
) -> PyResult<Option<Outcome>> {
    refuse_unusable(target, send, recv)?;
    if let Job::Coll(call) = &job {
        if c.dense_path(target.stream())
            && matches!(call.coll, Coll::ReduceScatter | Coll::AllGather)
        {
            let (sp, rp) = (send.map(|b| b.ptr as u64), recv.ptr as u64);
            // SAFETY: as below; the core's entry returns once done (over CUDA IPC when every
            // rank's buffers are on one device, else through one host's arena or staged).
            py.allow_threads(|| unsafe { c.coll_dense_at(call, sp, rp, target.stream()) })
                .map_err(crate::py_err)?;
            return Ok(Some(Outcome::Done));
        }
        if let Target::Wait = target {
            let (sp, rp) = (send.map(|b| b.ptr as u64), recv.ptr as u64);
            // SAFETY: as below; a broadcast or reduce staged in bands returns once done.
            let banded = py
                .allow_threads(|| unsafe {
                    c.rooted_in_bands_at(call, sp, rp, std::ptr::null_mut())
                })
                .map_err(crate::py_err)?;
            if banded {
                return Ok(Some(Outcome::Done));
            }
        }
    }
    let call_buf = |b: &Buf, reads, writes| CallBuf {
        addr: b.ptr as u64,
        len: b.bytes,
        reads,
        writes,
    };
    // An in-place buffer is read as well as written; a receive's only written.
    let recv_reads = send.is_none() && !matches!(&job, Job::Coll(c) if c.coll == Coll::Recv);
    let mut bufs: Vec<CallBuf> = send.iter().map(|s| call_buf(s, true, false)).collect();
    bufs.push(call_buf(&recv, recv_reads, true));
    let (send_len, recv_len) = (send.map(|s| s.bytes), recv.bytes);
    match target {
        Target::Wait => {
            let work = |hosts: &[*mut u8]| {
                c.execute(|e| {
                    // SAFETY: `hosts` stand for the buffers, valid until `on_buffers`
                    // returns; send and recv were checked distinct.
                    let (s, r) = unsafe { views(hosts, send_len, recv_len) };
                    job.run(e, s, r)
                })
            };
            // SAFETY: the buffers are live objects of this call (held by the caller until it
            // returns): device memory of their declared size per their CUDA array interface
            // or tensor, or host memory checked by `buf_of`; the null stream.
            let out =
                py.allow_threads(|| unsafe { c.on_buffers(&bufs, std::ptr::null_mut(), work) });
            out.map(Some).map_err(crate::py_err)
        }
        Target::Stream(h) => {
            let (sp, rp) = (send.map(|b| b.ptr as u64), recv.ptr as u64);
            // Ranks sharing one host: dense calls pipelined through their arena, enqueued
            // on the stream and returning at once, where that applies.
            // SAFETY (both): as below.
            let enqueued = py.allow_threads(|| {
                let stream = h as *mut std::ffi::c_void;
                match &job {
                    Job::AllReduce(call) => unsafe {
                        c.enqueue_all_reduce_dense_at(call, sp, rp, stream)
                    },
                    Job::Coll(call) => unsafe { c.enqueue_coll_dense_at(call, sp, rp, stream) },
                    _ => Ok(false),
                }
            });
            if enqueued.map_err(crate::py_err)? {
                return Ok(None);
            }
            let coded = Some(job.coded_calls());
            let work = move |e: &mut Engine, hosts: &[*mut u8]| {
                // SAFETY: `hosts` stand for the buffers while the job runs (see below).
                let (s, r) = unsafe { views(hosts, send_len, recv_len) };
                job.run(e, s, r).map(drop)
            };
            // SAFETY: NCCL's contract, stated in the Python docs: the buffers stay alive
            // until the caller's stream passes the call, and `h` is a live stream of their
            // device (the emulated driver refuses handles it does not know).
            let out = py.allow_threads(|| unsafe {
                c.on_stream(&bufs, h as *mut std::ffi::c_void, coded, work)
            });
            out.map(|()| None).map_err(crate::py_err)
        }
    }
}

/// Refuses what no device call can run: a read-only output, CUDA buffers or a stream where
/// no CUDA device can be used (each error says which).
pub(crate) fn refuse_unusable(target: Target, send: Option<Buf>, recv: Buf) -> PyResult<()> {
    if recv.readonly && recv.bytes > 0 {
        return Err(err("invalid", "the output buffer is read-only".to_string()));
    }
    if let Err(e) = qccl::internal::gpu() {
        if send.iter().chain([&recv]).any(|b| b.device && b.bytes > 0) {
            return Err(err(
                "unsupported",
                format!("CUDA buffers given, but no CUDA device can be used: {e}"),
            ));
        }
        if let Target::Stream(h) = target {
            return Err(err(
                "unsupported",
                format!(
                    "stream={h:#x} given, but no CUDA device can be used ({e}); host buffers \
                     take no stream (omit it or pass 0)"
                ),
            ));
        }
    }
    Ok(())
}

/// The `__cuda_array_interface__` dict of `obj`, if it has one.
pub(crate) fn interface<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
    match obj.getattr("__cuda_array_interface__") {
        Ok(ai) => Ok(Some(ai.downcast_into::<PyDict>().map_err(|_| {
            err(
                "invalid",
                "__cuda_array_interface__ is not a dict".to_string(),
            )
        })?)),
        Err(_) => Ok(None),
    }
}

/// The v3 interface's `stream` (None: absent or None); 0 is refused, as the protocol says.
pub(crate) fn interface_stream(what: &str, ai: &Bound<'_, PyDict>) -> PyResult<Option<u64>> {
    let Some(s) = ai.get_item("stream")?.filter(|s| !s.is_none()) else {
        return Ok(None);
    };
    match s.extract::<u64>() {
        Ok(0) | Err(_) => Err(err(
            "invalid",
            format!(
                "{what}: __cuda_array_interface__ stream must be None or a non-zero stream \
                 handle, got {}",
                s.repr()
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| "?".into())
            ),
        )),
        Ok(h) => Ok(Some(h)),
    }
}
