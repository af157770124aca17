//! The collectives on cudarc's device memory (`CudaSlice`, `CudaView`, `CudaViewMut`), ordered
//! on a `CudaStream` as NCCL's: each call is enqueued and returns at once; work enqueued on the
//! stream before it is seen by it, work enqueued after it sees the result. A failure is the
//! comm's `async_error` (the comm is then failed) and still releases the stream.
//!
//! The buffers are staged through page-locked memory (`comm/device.rs`) on the comm's device.
//! cudarc's own stream tracking is kept: the pointers are taken with `device_ptr(stream)`,
//! whose guards record cudarc's events on `stream` after the call is enqueued, so another
//! stream of cudarc that uses or frees the memory later waits for the call.

use super::Comm;
use crate::coll::call::{Buf, Coll, CollCall};
use crate::error::Result;
use crate::gpu::staging::CallBuf;
use crate::types::{Element, ReduceOp};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

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
        let (s, _read) = send.device_ptr(stream);
        let send = (s, send.num_bytes());
        let len = recv.num_bytes();
        let (r, _write) = recv.device_ptr_mut(stream);
        self.enqueue_cuda(call, Some(send), (r, len), stream)
    }

    /// All-reduce in place on device memory, enqueued on `stream`.
    pub fn all_reduce_cuda_in_place<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::AllReduce, buf.len(), T::DTYPE).op(op);
        let len = buf.num_bytes();
        let (b, _write) = buf.device_ptr_mut(stream);
        self.enqueue_cuda(call, None, (b, len), stream)
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
        let (s, _read) = send.device_ptr(stream);
        let send = (s, send.num_bytes());
        let len = recv.num_bytes();
        let (r, _write) = recv.device_ptr_mut(stream);
        self.enqueue_cuda(call, Some(send), (r, len), stream)
    }

    /// Broadcast in place: root's `buf` overwrites every rank's, enqueued on `stream`.
    pub fn broadcast_cuda_in_place<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Broadcast, buf.len(), T::DTYPE).root(root);
        let len = buf.num_bytes();
        let (b, _write) = buf.device_ptr_mut(stream);
        self.enqueue_cuda(call, None, (b, len), stream)
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
        let (s, _read) = send.device_ptr(stream);
        let send = (s, send.num_bytes());
        let len = recv.num_bytes();
        let (r, _write) = recv.device_ptr_mut(stream);
        self.enqueue_cuda(call, Some(send), (r, len), stream)
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
        let (s, _read) = send.device_ptr(stream);
        let send = (s, send.num_bytes());
        let len = recv.num_bytes();
        let (r, _write) = recv.device_ptr_mut(stream);
        self.enqueue_cuda(call, Some(send), (r, len), stream)
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
        let send_buf = match send {
            Some((_, len)) => Buf::Bytes(len),
            None => Buf::None,
        };
        let call = call.bufs(send_buf, Buf::Bytes(recv.1));
        self.check(&call)?;
        let all_reduce = match call.coll {
            Coll::AllReduce => {
                Some(self.prepare_all_reduce(call.count, call.dtype, call.op, None)?)
            }
            _ => None,
        };
        let mut bufs: Vec<CallBuf> = send
            .iter()
            .map(|&(addr, len)| CallBuf {
                addr,
                len,
                reads: true,
                writes: false,
            })
            .collect();
        bufs.push(CallBuf {
            addr: recv.0,
            len: recv.1,
            reads: send.is_none(),
            writes: true,
        });
        let (send_len, recv_len) = (send.map(|s| s.1), recv.1);
        let raw = stream.cu_stream() as *mut std::ffi::c_void;
        // SAFETY: the buffers are cudarc device memory of the lengths given, kept alive by
        // cudarc until `stream` passes the call (their release is ordered on the stream, or
        // waits on the events the `device_ptr` guards record after this returns); `stream`
        // is a live stream of their device. The closure gets a staged address of the same
        // length for each.
        unsafe {
            self.on_stream(&bufs, raw, move |e, hosts| {
                let (s, r) = match send_len {
                    Some(len) => (Some(as_slice(hosts[0], len)), as_slice(hosts[1], recv_len)),
                    None => (None, as_slice(hosts[0], recv_len)),
                };
                match all_reduce {
                    Some(c) => c.run(e, s.map(|s| &*s), r).map(drop),
                    None => e.run_call(&call, s.map(|s| &*s), r),
                }
            })
        }
    }
}

/// The staged bytes at `p`.
///
/// # Safety
/// `p` must be valid for `len` bytes, and used by no one else, for the returned lifetime.
unsafe fn as_slice<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts_mut(p, len) }
}
