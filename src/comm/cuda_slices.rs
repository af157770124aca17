//! The collectives on cudarc's device memory (`CudaSlice`, `CudaView`, `CudaViewMut`), ordered
//! on a `CudaStream` as NCCL's: each call is enqueued and returns at once; work enqueued on the
//! stream before it is seen by it, work enqueued after it sees the result. A failure is the
//! comm's `async_error` (the comm is then failed) and still releases the stream.
//!
//! The buffers are staged through page-locked memory (`comm/device.rs`) on the comm's device.
//! cudarc's own stream tracking is kept: the pointers are taken with `device_ptr(stream)`,
//! whose guards record cudarc's events on `stream` after the call is enqueued, so another
//! stream of cudarc that uses or frees the memory later waits for the call.

use super::device_all_reduce::staged;
use super::{Comm, Compression};
use crate::coll::call::{Buf, Coll, CollCall};
use crate::error::Result;
use crate::types::{Element, ReduceOp};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::c_void;

/// A device range: address and bytes.
type Range = (u64, usize);

impl Comm {
    /// `recv[i] = op over ranks of send[i]`, on device memory, enqueued on `stream`.
    pub fn all_reduce_cuda<T: Element>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::AllReduce, recv.len(), T::DTYPE).op(op);
        with_ranges(Some(send), recv, stream, |s, r| {
            self.enqueue_cuda(call, s, r, stream)
        })
    }

    /// All-reduce in place on device memory, enqueued on `stream`.
    pub fn all_reduce_cuda_in_place<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::AllReduce, buf.len(), T::DTYPE).op(op);
        with_ranges(None, buf, stream, |s, r| {
            self.enqueue_cuda(call, s, r, stream)
        })
    }

    /// Compressed all-reduce on device memory, enqueued on `stream`: as the host's
    /// [`Comm::all_reduce_compressed_out_of_place`] (float types, Sum or Avg; every rank ends
    /// bit-identical, host ranks included). A flat SRA, all-gather scheme (sparse codecs) or ring on f32 runs its codecs on the GPU;
    /// other calls are staged through page-locked memory.
    pub fn all_reduce_compressed_cuda<T: Element>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        c: &Compression,
        stream: &CudaStream,
    ) -> Result<()> {
        with_ranges(Some(send), recv, stream, |s, r| {
            self.enqueue_compressed_cuda::<T>(s, r, op, c, stream)
        })
    }

    /// Compressed all-reduce in place on device memory, enqueued on `stream` (as
    /// [`Comm::all_reduce_compressed_cuda`]).
    pub fn all_reduce_compressed_cuda_in_place<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        c: &Compression,
        stream: &CudaStream,
    ) -> Result<()> {
        with_ranges(None, buf, stream, |s, r| {
            self.enqueue_compressed_cuda::<T>(s, r, op, c, stream)
        })
    }

    /// Root's `send` lands in every rank's `recv` (`send` is read on the root only),
    /// enqueued on `stream`.
    pub fn broadcast_cuda<T: Element>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Broadcast, recv.len(), T::DTYPE).root(root);
        with_ranges(Some(send), recv, stream, |s, r| {
            self.enqueue_cuda(call, s, r, stream)
        })
    }

    /// Broadcast in place: root's `buf` overwrites every rank's, enqueued on `stream`.
    pub fn broadcast_cuda_in_place<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Broadcast, buf.len(), T::DTYPE).root(root);
        with_ranges(None, buf, stream, |s, r| {
            self.enqueue_cuda(call, s, r, stream)
        })
    }

    /// Every rank's `send` (k elements) lands at part r of `recv` (size·k), enqueued on
    /// `stream`.
    pub fn all_gather_cuda<T: Element>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::AllGather, send.len(), T::DTYPE);
        with_ranges(Some(send), recv, stream, |s, r| {
            self.enqueue_cuda(call, s, r, stream)
        })
    }

    /// Reduce-scatter: `recv` (k elements) is part `rank` of the reduction of every rank's
    /// `send` (size·k), enqueued on `stream`.
    pub fn reduce_scatter_cuda<T: Element>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::ReduceScatter, recv.len(), T::DTYPE).op(op);
        with_ranges(Some(send), recv, stream, |s, r| {
            self.enqueue_cuda(call, s, r, stream)
        })
    }

    /// Checks a compressed all-reduce against the buffers' sizes and prepares it before any
    /// byte moves, then enqueues it on `stream` through the one entry for device all-reduces
    /// (the codecs on the GPU, or staged).
    fn enqueue_compressed_cuda<T: Element>(
        &self,
        send: Option<Range>,
        recv: Range,
        op: ReduceOp,
        c: &Compression,
        stream: &CudaStream,
    ) -> Result<()> {
        let count = recv.1 / std::mem::size_of::<T>();
        self.check(
            &CollCall::new(Coll::AllReduce, count, T::DTYPE)
                .op(op)
                .bufs(bytes_of(send), Buf::Bytes(recv.1))
                .codec(&c.codec, c.key.is_some()),
        )?;
        let call = self.prepare_all_reduce_compressed(count, T::DTYPE, op, c)?;
        self.enqueue_prepared_cuda(call, send, recv, stream)
    }

    /// Enqueues prepared compressed all-reduce `call` on `stream` through the one entry for
    /// device all-reduces.
    fn enqueue_prepared_cuda(
        &self,
        call: super::PreparedAllReduce,
        send: Option<Range>,
        recv: Range,
        stream: &CudaStream,
    ) -> Result<()> {
        // SAFETY: as in `enqueue_cuda`; the two ranges are distinct cudarc allocations or
        // views (one borrowed shared, one mutably), so they do not overlap.
        unsafe { self.all_reduce_compressed_at(call, send.map(|s| s.0), recv.0, raw(stream)) }
            .map(drop)
    }

    /// Checks `call` against the buffers' sizes before any byte moves, then enqueues it on
    /// `stream` through the device path.
    fn enqueue_cuda(
        &self,
        call: CollCall<'static>,
        send: Option<Range>,
        recv: Range,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = call.bufs(bytes_of(send), Buf::Bytes(recv.1));
        self.check(&call)?;
        let all_reduce = match call.coll {
            Coll::AllReduce => {
                let prepared = self.prepare_all_reduce(call.count, call.dtype, call.op, None)?;
                match Box::new(prepared).into_compressed() {
                    // Compressed by QCCL_COMPRESSION: the one entry for device all-reduces.
                    Ok(c) => return self.enqueue_prepared_cuda(c, send, recv, stream),
                    // On a comm using CUDA IPC, dense ones take the core's entry (which
                    // returns once done, over CUDA IPC when every rank's buffers are on one
                    // device).
                    Err(dense) if self.dense_path(raw(stream)) => {
                        // SAFETY: as below; the call returns once done.
                        return unsafe {
                            self.all_reduce_dense_at(&dense, send.map(|s| s.0), recv.0, raw(stream))
                        }
                        .map(drop);
                    }
                    Err(dense) => Some(dense),
                }
            }
            _ => None,
        };
        // Ranks sharing one host: pipelined through their arena, where that applies.
        // SAFETY (both): as below.
        let (s0, r0) = (send.map(|s| s.0), recv.0);
        let enqueued = match &all_reduce {
            Some(c) => unsafe { self.enqueue_all_reduce_dense_at(c, s0, r0, raw(stream)) }?,
            None => unsafe { self.enqueue_coll_dense_at(&call, s0, r0, raw(stream)) }?,
        };
        if enqueued {
            return Ok(());
        }
        let bufs = super::device::send_recv(send, recv);
        let (send_len, recv_len) = (send.map(|s| s.1), recv.1);
        // SAFETY: the buffers are cudarc device memory of the lengths given, kept alive by
        // cudarc until `stream` passes the call (their release is ordered on the stream, or
        // waits on the events the `device_ptr` guards record after this returns); `stream`
        // is a live stream of their device. The closure gets a staged address of the same
        // length for each.
        unsafe {
            // Dense: no compressed call (those took the entry above).
            self.on_stream(&bufs, raw(stream), Some(0), move |e, hosts| {
                let (s, r) = match send_len {
                    Some(len) => (Some(staged(hosts[0], len)), staged(hosts[1], recv_len)),
                    None => (None, staged(hosts[0], recv_len)),
                };
                match all_reduce {
                    Some(c) => c.run(e, s.map(|s| &*s), r).map(drop),
                    None => e.run_call(&call, s.map(|s| &*s), r),
                }
            })
        }
    }
}

/// Takes the device ranges of `send` (None: in place) and `recv` for use on `stream` and runs
/// `enqueue` with them. cudarc's guards drop after it, recording cudarc's events on `stream`
/// behind the enqueued call, so another stream of cudarc that uses or frees the memory later
/// waits for the call.
fn with_ranges<T>(
    send: Option<&dyn DevicePtr<T>>,
    recv: &mut impl DevicePtrMut<T>,
    stream: &CudaStream,
    enqueue: impl FnOnce(Option<Range>, Range) -> Result<()>,
) -> Result<()> {
    let read = send.map(|s| (s.device_ptr(stream), s.num_bytes()));
    let len = recv.num_bytes();
    let (r, _write) = recv.device_ptr_mut(stream);
    enqueue(read.as_ref().map(|((s, _), n)| (*s, *n)), (r, len))
}

/// The send buffer's size as a call's check takes it.
fn bytes_of(send: Option<Range>) -> Buf {
    match send {
        Some((_, len)) => Buf::Bytes(len),
        None => Buf::None,
    }
}

/// `stream` as the device path takes it (a `CUstream`).
fn raw(stream: &CudaStream) -> *mut c_void {
    stream.cu_stream() as *mut c_void
}
