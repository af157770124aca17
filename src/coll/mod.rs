//! Collectives over bytes: build the operation descriptor, run the schedule (all-reduce's
//! chosen by `tuning` before the call gets here).
//! Arguments were validated by the caller (`call::CollCall::validate`) before any byte moves.

pub mod call;
pub mod check;
pub mod compressed;
// The CUDA IPC agreement each dense call of a comm using it starts with.
pub(crate) mod ipc_vote;

use crate::algo::ring::Io;
use crate::algo::Algo;
use crate::algo::{self, part, Ctx, Scratch, Wire};
use crate::codec::ef::Residuals;
use crate::transport::frame::{CollKind, OpDesc};
use crate::transport::{RecvReq, SendReq, Transport};
use crate::tuning::Flat;
use crate::types::{DType, ReduceOp};
use crate::{Error, Result};
use call::{Coll, CollCall};

/// What executes collectives for one comm: its transport and scratch, used by one operation
/// at a time.
pub struct Engine {
    /// The transport to the comm's peers.
    pub(crate) t: Transport,
    /// Reused scratch buffers.
    pub(crate) scratch: Scratch,
    /// This rank.
    pub(crate) rank: usize,
    /// Ranks in the comm.
    pub(crate) size: usize,
    /// Slice size (QCCL_BUFFSIZE).
    pub(crate) slice: usize,
    /// Slice size of the pairwise SRA all-reduce (`Config::sra_slice_bytes`).
    pub(crate) sra_slice: usize,
    /// Bytes moved by every collective so far (the counters API).
    pub(crate) wire: Wire,
    /// Error-feedback residuals of compressed calls, by tensor key.
    pub(crate) residuals: Residuals,
    /// Compressed calls executed so far: the `step` of their random streams.
    pub(crate) coded_calls: u64,
    /// Compressed all-reduces on device buffers with the codecs on the GPU: their stream,
    /// buffers and residuals (made by the first such call), shared with the comm, which
    /// enqueues such a call's device work on the caller's thread.
    pub(crate) gpu: std::sync::Arc<crate::gpu::sra::state::GpuLane>,
    /// The comm uses CUDA IPC: a reduce-scatter or all-gather made through `run_call` (on
    /// host or staged buffers) starts by saying so (`ipc_vote`).
    pub(crate) cuda_ipc: bool,
}

impl Engine {
    /// One exchange of frames described by `desc` with some peers: every send and receive
    /// progressed together (the C ABI's grouped point-to-point phases).
    pub fn exchange(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'_>],
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        self.t.exchange(desc, sends, recvs)
    }

    pub(crate) fn ctx(
        &mut self,
        coll: CollKind,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        algo: u8,
    ) -> Ctx<'_> {
        Ctx {
            t: &mut self.t,
            rank: self.rank,
            size: self.size,
            slice: self.slice,
            scratch: &mut self.scratch,
            desc: OpDesc {
                coll,
                dtype: dtype as u8,
                op: op as u8,
                algo,
                root: root as u32,
                count: count as u64,
            },
            dtype,
            op,
            wire: &mut self.wire,
        }
    }

    /// All-reduce of `count` elements with schedule `algo` (chosen by `tuning`); in place
    /// when `send` is None.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Flat,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let sra_slice = self.sra_slice;
        let mut ctx = self.ctx(CollKind::AllReduce, count, dtype, op, 0, algo.algo() as u8);
        match algo {
            Flat::AllGather => algo::allgather::all_reduce(&mut ctx, send, recv),
            Flat::Tree => algo::tree::all_reduce(&mut ctx, send, recv),
            Flat::Sra => {
                ctx.slice = sra_slice;
                algo::sra::all_reduce(&mut ctx, send, recv, count)
            }
            Flat::Ring => algo::ring::all_reduce(&mut ctx, send, recv, count),
        }
    }

    /// The SRA or ring (`algo`) all-reduce of `count` elements in place in `buf`, a staged
    /// copy whose slices (`algo::chunk_slices` with the schedule's slice) `io` says landed,
    /// reporting each done: the host path's call, frame for frame. An error for another
    /// schedule, or on a comm with a shared-memory arena, whose rounds take a call whole.
    pub(crate) fn all_reduce_in_slices(
        &mut self,
        buf: &mut [u8],
        (count, dtype, op): (usize, DType, ReduceOp),
        algo: Flat,
        io: &dyn algo::PieceIo,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let sra_slice = self.sra_slice;
        let mut ctx = self.ctx(CollKind::AllReduce, count, dtype, op, 0, algo.algo() as u8);
        if ctx.t.arena()?.is_some() {
            return Err(Error::Internal(
                "an all-reduce in slices on a comm with a shared-memory arena".into(),
            ));
        }
        match algo {
            Flat::Sra => {
                ctx.slice = sra_slice;
                algo::sra::all_reduce_in_slices(&mut ctx, None, buf, count, io)
            }
            Flat::Ring => algo::ring::all_reduce_in_slices(&mut ctx, None, buf, count, io),
            _ => Err(Error::Internal(format!(
                "an all-reduce in slices on the {} schedule",
                algo.algo().name()
            ))),
        }
    }

    /// The reduce-scatter (every rank's part of `count` elements, the whole input) or the
    /// all-gather (this rank's part of `count` elements) `coll` over the ring in place in
    /// `buf`, a staged copy of the whole n-part buffer whose slices (`algo::chunk_slices` of
    /// the n parts with the ring's slice) `io` says landed, reporting each done: the host
    /// path's call, frame for frame. A broadcast or reduce from `root` (on more than one
    /// rank) runs its chain in place the same way, its slices the chain's (`chunk_slices`
    /// on one part). An error for another collective, or a reduce-scatter or all-gather
    /// on a comm with a shared-memory arena, whose rounds take a call whole.
    pub(crate) fn coll_in_slices(
        &mut self,
        buf: &mut [u8],
        (coll, root): (Coll, usize),
        (count, dtype, op): (usize, DType, ReduceOp),
        io: &dyn algo::PieceIo,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        match coll {
            Coll::Broadcast => {
                let mut ctx = self.ctx(CollKind::Broadcast, count, dtype, ReduceOp::Sum, root, 0);
                return algo::chain::broadcast_in_slices(&mut ctx, buf, root, io);
            }
            Coll::Reduce => {
                let mut ctx = self.ctx(CollKind::Reduce, count, dtype, op, root, 0);
                return algo::chain::reduce_in_slices(&mut ctx, None, buf, root, io);
            }
            _ => {}
        }
        let total = count * self.size;
        let (kind, op) = match coll {
            Coll::ReduceScatter => (CollKind::ReduceScatter, op),
            Coll::AllGather => (CollKind::AllGather, ReduceOp::Sum),
            _ => return Err(Error::Internal(format!("a {} in slices", coll.name()))),
        };
        let mut ctx = self.ctx(kind, count, dtype, op, 0, 0);
        if ctx.t.arena()?.is_some() {
            return Err(Error::Internal(
                "a collective in slices on a comm with a shared-memory arena".into(),
            ));
        }
        match coll {
            Coll::ReduceScatter => {
                algo::ring::reduce_scatter_in_slices(&mut ctx, Io::InPlace(buf), total, io, true)
            }
            _ => algo::ring::all_gather_in_slices(&mut ctx, buf, total, io),
        }
    }

    /// Reduce-scatter: `recvcount` elements per rank; in place (result at `buf[rank]`) when
    /// `send` is None and `recv` is the whole buffer.
    pub fn reduce_scatter(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        recvcount: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if recvcount == 0 {
            return Ok(());
        }
        let n = self.size;
        let total = recvcount * n;
        let mut ctx = self.ctx(CollKind::ReduceScatter, recvcount, dtype, op, 0, 0);
        if algo::arena::reduce_scatter(&mut ctx, send, recv, total)? {
            return Ok(());
        }
        let io = match send {
            Some(input) => Io::OutOfPlace { input, out: recv },
            None => Io::InPlace(recv),
        };
        algo::ring::reduce_scatter(&mut ctx, io, total)
    }

    /// Reduce-scatter of `count` elements split in near-equal parts (part r has
    /// `algo::part(count, size, r)`); in place when `send` is None, else part r of `buf` gets
    /// the result. Used by the hierarchical all-reduce, whose parts need not be equal.
    pub fn reduce_scatter_parts(
        &mut self,
        send: Option<&[u8]>,
        buf: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mine = part(count, self.size, self.rank, dtype.size());
        let mut ctx = self.ctx(
            CollKind::ReduceScatter,
            count,
            dtype,
            op,
            0,
            Algo::Hier as u8,
        );
        let out = match send {
            Some(_) => &mut buf[mine.clone()],
            None => &mut *buf,
        };
        if algo::arena::reduce_scatter(&mut ctx, send, out, count)? {
            return Ok(());
        }
        let io = match send {
            Some(input) => Io::OutOfPlace {
                input,
                out: &mut buf[mine],
            },
            None => Io::InPlace(buf),
        };
        algo::ring::reduce_scatter(&mut ctx, io, count)
    }

    /// All-gather in place of `count` elements split in near-equal parts, part r from rank r.
    pub fn all_gather_parts(&mut self, buf: &mut [u8], count: usize, dtype: DType) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(
            CollKind::AllGather,
            count,
            dtype,
            ReduceOp::Sum,
            0,
            Algo::Hier as u8,
        );
        if algo::arena::all_gather(&mut ctx, None, buf, count)? {
            return Ok(());
        }
        algo::ring::all_gather(&mut ctx, buf, count)
    }

    /// All-gather of `sendcount` elements per rank into `recv` (n·sendcount); `send` None
    /// means in place (this rank's part is already at its slot).
    pub fn all_gather(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        sendcount: usize,
        dtype: DType,
    ) -> Result<()> {
        if sendcount == 0 {
            return Ok(());
        }
        let n = self.size;
        let mut ctx = self.ctx(CollKind::AllGather, sendcount, dtype, ReduceOp::Sum, 0, 0);
        if algo::arena::all_gather(&mut ctx, send, recv, sendcount * n)? {
            return Ok(());
        }
        if let Some(s) = send {
            let mine = part(sendcount * n, n, ctx.rank, dtype.size());
            recv[mine].copy_from_slice(s);
        }
        algo::ring::all_gather(&mut ctx, recv, sendcount * n)
    }

    /// Broadcast from `root`; root's `send` (if given) is the data.
    pub fn broadcast(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Broadcast, count, dtype, ReduceOp::Sum, root, 0);
        algo::chain::broadcast(&mut ctx, send, recv, root)
    }

    /// Reduce onto `root` (see `algo::chain::reduce`).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Reduce, count, dtype, op, root, 0);
        algo::chain::reduce(&mut ctx, send, recv, root)
    }

    /// All-to-all with `count` elements per peer.
    pub fn all_to_all(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::AllToAll, count, dtype, ReduceOp::Sum, 0, 0);
        algo::direct::all_to_all(&mut ctx, send, recv)
    }

    /// Gather of `count` elements per rank onto `root`'s `recv`.
    pub fn gather(
        &mut self,
        send: &[u8],
        recv: Option<&mut [u8]>,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Gather, count, dtype, ReduceOp::Sum, root, 0);
        algo::direct::gather(&mut ctx, send, recv, root)
    }

    /// Scatter of `count` elements per rank from `root`'s `send`.
    pub fn scatter(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Scatter, count, dtype, ReduceOp::Sum, root, 0);
        algo::direct::scatter(&mut ctx, send, recv, root)
    }

    /// Point-to-point send of `count` elements to `peer`.
    pub fn send(&mut self, data: &[u8], count: usize, dtype: DType, peer: usize) -> Result<()> {
        let mut ctx = self.ctx(CollKind::SendRecv, count, dtype, ReduceOp::Sum, 0, 0);
        ctx.exchange(&[SendReq { peer, data }], &mut [])
    }

    /// Point-to-point receive of `count` elements from `peer`.
    pub fn recv(&mut self, data: &mut [u8], count: usize, dtype: DType, peer: usize) -> Result<()> {
        let mut ctx = self.ctx(CollKind::SendRecv, count, dtype, ReduceOp::Sum, 0, 0);
        ctx.exchange(&[], &mut [RecvReq::new(peer, data)])
    }

    /// Runs a validated call: the one dispatch from a call's description to its schedule.
    /// `send` None is in place (NCCL's layouts, `Coll::in_place`), or the input is unused on
    /// this rank (a root-only one elsewhere, a receive). All-reduce is not run here: it runs
    /// through the route `comm::route` prepared for it.
    pub fn run_call(
        &mut self,
        call: &CollCall<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
    ) -> Result<()> {
        if let Some(bytes) = self.ipc_staged_bytes(call) {
            ipc_vote::exchange(self, &ipc_vote::Descriptor::host(bytes))?;
        }
        self.run_call_agreed(call, send, recv)
    }

    /// The bytes each rank stages when `call` may go over CUDA IPC on this comm (a
    /// reduce-scatter's whole input, an all-gather's part), None when it may not.
    pub(crate) fn ipc_staged_bytes(&self, call: &CollCall<'_>) -> Option<usize> {
        let part = call.count * call.dtype.size();
        match call.coll {
            _ if !self.cuda_ipc || part == 0 => None,
            Coll::ReduceScatter => Some(part * self.size),
            Coll::AllGather => Some(part),
            _ => None,
        }
    }

    /// As `run_call`, after the CUDA IPC agreement (if any) was made.
    pub fn run_call_agreed(
        &mut self,
        call: &CollCall<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
    ) -> Result<()> {
        let (count, dtype, op) = (call.count, call.dtype, call.op);
        let root = call.rank_arg();
        let is_root = self.rank == root;
        let missing = || crate::Error::Internal(format!("{}: no send buffer", call.coll.name()));
        match call.coll {
            // Its schedule is chosen by `tuning` as the call is prepared (`comm::route`).
            Coll::AllReduce => Err(crate::Error::Internal(
                "all_reduce runs through its prepared route, not run_call".into(),
            )),
            Coll::ReduceScatter => self.reduce_scatter(send, recv, count, dtype, op),
            Coll::AllGather => self.all_gather(send, recv, count, dtype),
            Coll::Broadcast => self.broadcast(send.filter(|_| is_root), recv, count, dtype, root),
            Coll::Reduce => self.reduce(send, recv, count, dtype, op, root),
            Coll::AllToAll => match send {
                Some(s) => self.all_to_all(s, recv, count, dtype),
                // In place: each part of the buffer is received over while others still go out.
                None => {
                    let copy = recv.to_vec();
                    self.all_to_all(&copy, recv, count, dtype)
                }
            },
            Coll::Gather => {
                let s = send.ok_or_else(missing)?;
                self.gather(s, is_root.then_some(recv), count, dtype, root)
            }
            Coll::Scatter => {
                let s = send.filter(|_| is_root);
                if is_root && s.is_none() {
                    return Err(missing());
                }
                self.scatter(s, recv, count, dtype, root)
            }
            Coll::Send => self.send(send.ok_or_else(missing)?, count, dtype, root),
            Coll::Recv => self.recv(recv, count, dtype, root),
        }
    }

    /// Blocks until every rank has called barrier.
    pub fn barrier(&mut self) -> Result<()> {
        let mut ctx = self.ctx(CollKind::Barrier, 0, DType::Uint8, ReduceOp::Sum, 0, 0);
        algo::direct::barrier(&mut ctx)
    }
}
