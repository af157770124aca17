//! The collective calls: typed (`&[T]` for any [`Element`]) and raw (bytes + count + dtype,
//! for the C ABI). Each describes itself as a `CollCall`, validated before it is queued.

use super::{Comm, Request};
use crate::algo::Algo;
use crate::coll::call::{Buf, Coll, CollCall, Shape};
use crate::coll::{check, Engine};
use crate::error::Result;
use crate::types::{DType, Element, ReduceOp};

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Comm {
    /// Where this comm's calls are made, for `CollCall::validate`.
    pub(crate) fn shape(&self) -> Shape {
        Shape {
            rank: self.rank,
            size: self.size,
        }
    }

    /// Validates `call` on this comm (the one check every Rust path runs before anything is
    /// queued; the C ABI runs `validate` itself); the error names the collective.
    pub(crate) fn check(&self, call: &CollCall<'_>) -> Result<()> {
        call.validate(self.shape())
            .map_err(|e| e.prefixed(&format!("{}: ", call.coll.name())))
    }

    /// Validates `call` and runs it in this comm's turn on the caller's thread.
    fn run_call(&self, call: CollCall<'_>, send: Option<&[u8]>, recv: &mut [u8]) -> Result<()> {
        self.check(&call)?;
        self.queue.run(|e| e.run_call(&call, send, recv))
    }

    // ---- raw (bytes) API -----------------------------------------------------------------

    /// All-reduce of `count` elements of `dtype`. `send` None means in place in `recv`.
    /// `algo` None uses the comm's default (QCCL_ALGO). Returns the algorithm used.
    pub fn all_reduce_raw(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Option<Algo>,
    ) -> Result<Algo> {
        self.check(
            &CollCall::new(Coll::AllReduce, count, dtype)
                .op(op)
                .bufs(Buf::of(send), Buf::Bytes(recv.len())),
        )?;
        let call = self.prepare_all_reduce(count, dtype, op, algo)?;
        self.queue.run(|e| call.run(e, send, recv))
    }

    /// Reduce-scatter with `recvcount` elements per rank. Out of place, `send` holds
    /// size·recvcount and `recv` recvcount elements; in place (`send` None), `recv` is the
    /// whole size·recvcount buffer and rank r's result lands at its r-th part (NCCL's rule).
    pub fn reduce_scatter_raw(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        recvcount: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let call = CollCall::new(Coll::ReduceScatter, recvcount, dtype)
            .op(op)
            .bufs(Buf::of(send), Buf::Bytes(recv.len()));
        self.run_call(call, send, recv)
    }

    /// All-gather of `sendcount` elements per rank into `recv` (size·sendcount). In place
    /// (`send` None), this rank's part is already at its slot of `recv`.
    pub fn all_gather_raw(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        sendcount: usize,
        dtype: DType,
    ) -> Result<()> {
        let call = CollCall::new(Coll::AllGather, sendcount, dtype)
            .bufs(Buf::of(send), Buf::Bytes(recv.len()));
        self.run_call(call, send, recv)
    }

    /// Broadcast of `count` elements from `root`. Root's data is `send` (or `recv` itself
    /// when `send` is None); every rank receives into `recv`.
    pub fn broadcast_raw(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Broadcast, count, dtype)
            .root(root)
            .bufs(Buf::of(send), Buf::Bytes(recv.len()));
        self.run_call(call, send, recv)
    }

    /// Reduce of `count` elements onto `root`. Input is `send`, or `recv` when `send` is
    /// None (in place). Root's result lands in `recv`; elsewhere `recv` is ignored (may be
    /// empty) when `send` is given.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_raw(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Reduce, count, dtype)
            .op(op)
            .root(root)
            .bufs(Buf::of(send), Buf::Bytes(recv.len()));
        self.run_call(call, send, recv)
    }

    /// All-to-all: part p (`count` elements) of `send` goes to rank p; part q of `recv`
    /// comes from rank q.
    pub fn all_to_all_raw(
        &self,
        send: &[u8],
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let call = CollCall::new(Coll::AllToAll, count, dtype)
            .bufs(Buf::Bytes(send.len()), Buf::Bytes(recv.len()));
        self.run_call(call, Some(send), recv)
    }

    /// Gather of `count` elements per rank onto root's `recv` (size·count, rank order);
    /// `recv` is ignored on other ranks (may be empty).
    pub fn gather_raw(
        &self,
        send: &[u8],
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Gather, count, dtype)
            .root(root)
            .bufs(Buf::Bytes(send.len()), Buf::Bytes(recv.len()));
        self.run_call(call, Some(send), recv)
    }

    /// Scatter from root's `send` (size·count, rank order) into every rank's `recv`;
    /// `send` is ignored on other ranks (may be empty).
    pub fn scatter_raw(
        &self,
        send: &[u8],
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let call = CollCall::new(Coll::Scatter, count, dtype)
            .root(root)
            .bufs(Buf::Bytes(send.len()), Buf::Bytes(recv.len()));
        self.run_call(call, Some(send), recv)
    }

    /// Sends `count` elements to `peer`, which must call a matching receive.
    pub fn send_raw(&self, data: &[u8], count: usize, dtype: DType, peer: usize) -> Result<()> {
        let call = CollCall::new(Coll::Send, count, dtype)
            .root(peer)
            .bufs(Buf::Bytes(data.len()), Buf::None);
        self.run_call(call, Some(data), &mut [])
    }

    /// Receives `count` elements from `peer`, which must call a matching send.
    pub fn recv_raw(&self, data: &mut [u8], count: usize, dtype: DType, peer: usize) -> Result<()> {
        let call = CollCall::new(Coll::Recv, count, dtype)
            .root(peer)
            .bufs(Buf::None, Buf::Bytes(data.len()));
        self.run_call(call, None, data)
    }

    /// Returns when every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.queue.run(|e| e.barrier())
    }

    // ---- typed API ------------------------------------------------------------------------

    /// `recv[i] = op over ranks of send[i]`.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let n = recv.len();
        self.all_reduce_raw(Some(bytes(send)), bytes_mut(recv), n, T::DTYPE, op, None)
            .map(drop)
    }

    /// All-reduce in place: `buf[i] = op over ranks of buf[i]`.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let n = buf.len();
        self.all_reduce_raw(None, bytes_mut(buf), n, T::DTYPE, op, None)
            .map(drop)
    }

    /// All-reduce with an explicit algorithm (`send` None: in place). Returns the algorithm
    /// used (`Auto` resolved).
    pub fn all_reduce_with<T: Element>(
        &self,
        send: Option<&[T]>,
        recv: &mut [T],
        op: ReduceOp,
        algo: Algo,
    ) -> Result<Algo> {
        let n = recv.len();
        self.all_reduce_raw(
            send.map(bytes),
            bytes_mut(recv),
            n,
            T::DTYPE,
            op,
            Some(algo),
        )
    }

    /// Reduce-scatter: `send` holds size·k elements, `recv` receives this rank's k.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let k = recv.len();
        self.reduce_scatter_raw(Some(bytes(send)), bytes_mut(recv), k, T::DTYPE, op)
    }

    /// Reduce-scatter in place on a size·k buffer: rank r's result is `buf[r*k..(r+1)*k]`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let k = check::divisible("reduce_scatter", "buffer", buf.len(), self.size)?;
        self.reduce_scatter_raw(None, bytes_mut(buf), k, T::DTYPE, op)
    }

    /// All-gather: every rank's `send` (k elements) lands at part r of `recv` (size·k).
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let k = send.len();
        self.all_gather_raw(Some(bytes(send)), bytes_mut(recv), k, T::DTYPE)
    }

    /// All-gather in place on a size·k buffer whose part `rank` holds this rank's data.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let k = check::divisible("all_gather", "buffer", buf.len(), self.size)?;
        self.all_gather_raw(None, bytes_mut(buf), k, T::DTYPE)
    }

    /// Broadcast: root's `send` lands in every rank's `recv` (`send` is ignored elsewhere
    /// and may be empty).
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let n = recv.len();
        self.broadcast_raw(Some(bytes(send)), bytes_mut(recv), n, T::DTYPE, root)
    }

    /// Broadcast in place: root's `buf` overwrites every rank's `buf`.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let n = buf.len();
        self.broadcast_raw(None, bytes_mut(buf), n, T::DTYPE, root)
    }

    /// Reduce onto root: root's `recv[i] = op over ranks of send[i]` (`recv` may be empty
    /// on other ranks).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let n = send.len();
        self.reduce_raw(Some(bytes(send)), bytes_mut(recv), n, T::DTYPE, op, root)
    }

    /// Reduce in place: the result replaces root's `buf`; other ranks' `buf` is unchanged.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let n = buf.len();
        self.reduce_raw(None, bytes_mut(buf), n, T::DTYPE, op, root)
    }

    /// All-to-all: part p of `send` (size·k elements) goes to rank p.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let k = check::divisible("all_to_all", "sendbuff", send.len(), self.size)?;
        self.all_to_all_raw(bytes(send), bytes_mut(recv), k, T::DTYPE)
    }

    /// Gather every rank's `send` into root's `recv` (size·k, rank order).
    pub fn gather<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let k = send.len();
        self.gather_raw(bytes(send), bytes_mut(recv), k, T::DTYPE, root)
    }

    /// Scatter root's `send` (size·k, rank order) so rank p gets part p in `recv`.
    pub fn scatter<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let k = recv.len();
        self.scatter_raw(bytes(send), bytes_mut(recv), k, T::DTYPE, root)
    }

    /// Sends `buf` to `peer`.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.send_raw(bytes(buf), buf.len(), T::DTYPE, peer)
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        let n = buf.len();
        self.recv_raw(bytes_mut(buf), n, T::DTYPE, peer)
    }

    // ---- engine access --------------------------------------------------------------------

    #[doc(hidden)]
    /// Runs `f` on this comm's engine on the caller's thread, in its turn after every earlier
    /// operation, like a blocking collective (an error fails the comm, as a failed collective
    /// does). For callers that compose operations from `Engine` calls, such as the C ABI's
    /// grouped calls; they validate a `CollCall` first, as the `*_raw` calls do.
    pub fn execute<R>(&self, f: impl FnOnce(&mut Engine) -> Result<R>) -> Result<R> {
        self.queue.run(f)
    }

    #[doc(hidden)]
    /// Queues `f` to run on this comm's worker thread after every earlier operation; the
    /// request yields its result. What `f` captures is moved to the worker (the C ABI's
    /// non-blocking and grouped calls capture the caller's buffers this way).
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> Result<R> + Send + 'static,
    ) -> Result<Request<R>> {
        self.queue.submit(f)
    }

    // ---- async API ------------------------------------------------------------------------

    /// Starts an in-place all-reduce of `buf`; the request returns it reduced.
    pub fn all_reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Request<Vec<T>>> {
        // Resolved now, as the blocking call is: QCCL_COMPRESSION, and the hierarchical
        // algorithm on multi-host comms (its sub-comms are split here, in call order).
        let call = self.prepare_all_reduce(buf.len(), T::DTYPE, op, None)?;
        self.queue.submit(move |e| {
            call.run(e, None, bytes_mut(&mut buf))?;
            Ok(buf)
        })
    }

    /// Starts a reduce-scatter of `send` (size·k elements); the request returns this rank's k.
    pub fn reduce_scatter_async<T: Element>(
        &self,
        send: Vec<T>,
        op: ReduceOp,
    ) -> Result<Request<Vec<T>>> {
        let k = check::divisible("reduce_scatter", "sendbuff", send.len(), self.size)?;
        let call = CollCall::new(Coll::ReduceScatter, k, T::DTYPE)
            .op(op)
            .bufs(Buf::Bytes(bytes(&send).len()), Buf::Counted);
        self.check(&call)?;
        self.queue.submit(move |e| {
            let mut out = vec![T::zeroed(); k];
            e.run_call(&call, Some(bytes(&send)), bytes_mut(&mut out))?;
            Ok(out)
        })
    }

    /// Starts an all-gather of `send` (k elements); the request returns size·k elements.
    pub fn all_gather_async<T: Element>(&self, send: Vec<T>) -> Result<Request<Vec<T>>> {
        let (k, size) = (send.len(), self.size);
        let call = CollCall::new(Coll::AllGather, k, T::DTYPE);
        self.check(&call)?;
        self.queue.submit(move |e| {
            let mut out = vec![T::zeroed(); k * size];
            e.run_call(&call, Some(bytes(&send)), bytes_mut(&mut out))?;
            Ok(out)
        })
    }

    /// Starts an in-place broadcast of root's `buf`; the request returns it.
    pub fn broadcast_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        root: usize,
    ) -> Result<Request<Vec<T>>> {
        let call = CollCall::new(Coll::Broadcast, buf.len(), T::DTYPE)
            .root(root)
            .bufs(Buf::None, Buf::Counted);
        self.check(&call)?;
        self.queue.submit(move |e| {
            e.run_call(&call, None, bytes_mut(&mut buf))?;
            Ok(buf)
        })
    }
}
