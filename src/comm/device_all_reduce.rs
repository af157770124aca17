//! The one entry for a compressed all-reduce on raw buffers that may be device memory (the C
//! ABI's, Python's and cudarc's way in): the codecs run on the GPU where the call has that
//! path (`gpu_sra.rs`: a flat SRA, all-gather, ring or tree schedule on device buffers of a
//! float type; `gpu_hier.rs`: the hierarchical one, for calls that return once
//! done, and `gpu_hier_stream.rs` on a stream for float32), otherwise the call is staged through page-locked memory: piece by piece on the
//! hierarchical route (`bands.rs`), whole (`device.rs`) as any other call elsewhere.
//! Callers say only how the call is ordered: on a stream (`all_reduce_compressed_at`) or
//! queued (`submit_..._at`).

use super::{Comm, PreparedAllReduce, Report};
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::staging::CallBuf;
use std::ffi::c_void;
use std::sync::Arc;

impl Comm {
    /// Compressed all-reduce `call` on `send` (None: in place) and `recv`, raw addresses of
    /// the call's `count` elements each, host or device memory, ordered on the caller's
    /// `stream`: with null it returns the report once the result is in `recv`; on a stream
    /// it returns None once the call is enqueued (NCCL's semantics: the stream waits for it,
    /// a failure is the comm's `async_error`), or once done if a buffer is host memory or
    /// the codecs run on the GPU (`gpu_sra.rs` says why).
    ///
    /// # Safety
    /// `send` and `recv` must not overlap and must each be valid for the call's bytes (host
    /// memory, or device memory of one device) until the call is done: its return with a
    /// null stream, the stream passing the call otherwise; `stream` must be null or a live
    /// stream of their device.
    #[doc(hidden)]
    pub unsafe fn all_reduce_compressed_at(
        &self,
        call: PreparedAllReduce,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<Option<Report>> {
        if let Some(g) = self.gpu_compressed_all_reduce(&call, send, recv, stream.is_null())? {
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.run_gpu_all_reduce(g, stream) };
        }
        let call = Arc::new(call);
        if let Some(plan) = self.coded_bands_of(&call, send, recv)? {
            if !stream.is_null() {
                // SAFETY: the caller's promise, passed on.
                return unsafe { self.enqueue_plan(plan, stream) }.map(|()| None);
            }
            // SAFETY: the caller's promise, passed on.
            let report = unsafe { self.run_bands_waiting(plan, stream) }?;
            return coded_report(report).map(Some);
        }
        let bufs = call_bufs(&call, send, recv);
        if stream.is_null() {
            // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
            return unsafe {
                self.on_buffers(&bufs, stream, |hosts| {
                    self.execute(|e| run_staged(&call, e, hosts))
                })
            }
            .map(Some);
        }
        // SAFETY: as above.
        unsafe {
            // One compressed call, staged.
            self.on_stream(&bufs, stream, Some(1), move |e, hosts| {
                run_staged(&call, e, hosts).map(drop)
            })
        }
        .map(|()| None)
    }

    /// As [`Comm::all_reduce_compressed_at`] with the legacy default stream, but queued
    /// behind the comm's earlier operations and returning at once (the C ABI's non-blocking
    /// calls): the codecs on the GPU where the call has that path, staged otherwise; either
    /// way the work on the legacy default stream is waited for in the comm's turn, and the
    /// request ends once the result is in `recv`.
    ///
    /// # Safety
    /// As [`Comm::all_reduce_compressed_at`], until the request has ended.
    #[doc(hidden)]
    pub unsafe fn submit_all_reduce_compressed_at(
        &self,
        call: PreparedAllReduce,
        send: Option<u64>,
        recv: u64,
    ) -> Result<crate::Request<()>> {
        if let Some(g) = self.gpu_compressed_all_reduce(&call, send, recv, true)? {
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.submit_gpu_all_reduce(g) };
        }
        let call = Arc::new(call);
        if let Some(plan) = self.coded_bands_of(&call, send, recv)? {
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.submit_bands(plan) };
        }
        let bufs = call_bufs(&call, send, recv);
        // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
        unsafe {
            self.submit_on_buffers(bufs, Some(1), move |e, hosts| {
                run_staged(&call, e, hosts).map(drop)
            })
        }
    }
}

/// A compressed call's report from its run in bands (`Bands::run_waiting`).
fn coded_report(report: Option<Report>) -> Result<Report> {
    report.ok_or_else(|| Error::Internal("a compressed call in bands made no report".into()))
}

/// The call's buffers as the device path sees them (`device::send_recv`).
fn call_bufs(call: &PreparedAllReduce, send: Option<u64>, recv: u64) -> Vec<CallBuf> {
    let (count, dtype, _) = call.shape();
    let len = count * dtype.size();
    super::device::send_recv(send.map(|s| (s, len)), (recv, len))
}

/// Runs `call` on `e` over `hosts`, host addresses standing for its buffers (`call_bufs`'
/// order: send, if any, then recv).
fn run_staged(call: &PreparedAllReduce, e: &mut Engine, hosts: &[*mut u8]) -> Result<Report> {
    let (count, dtype, _) = call.shape();
    let len = count * dtype.size();
    // SAFETY: each host address stands for one buffer of `len` bytes, valid until the staged
    // call ends (`on_buffers`, `on_stream`, `submit_on_buffers`), and they do not overlap
    // (the entry's promise; page-locked copies never do).
    unsafe {
        match hosts {
            [s, r] => call.run(e, Some(&*staged(*s, len)), staged(*r, len)),
            [r] => call.run(e, None, staged(*r, len)),
            _ => Err(Error::Internal(format!(
                "a staged all-reduce got {} buffers, not one or two",
                hosts.len()
            ))),
        }
    }
}

/// The `len` staged bytes at `p` (any `p` when `len` is 0).
///
/// # Safety
/// `p` must be valid for `len` bytes, and used by no one else, for the returned lifetime.
pub(super) unsafe fn staged<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts_mut(p, len) }
}
