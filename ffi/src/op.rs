//! One C call as an operation: its arguments checked (`describe`: the core's one validation,
//! `CollCall::validate`, as for Rust calls), its buffers resolved with NCCL's
//! in-place rules and its route prepared (`Comm::prepare_all_reduce`) when the call is made;
//! run on the comm's engine in its turn, the same way whether blocking (`Comm::execute`),
//! grouped or non-blocking (`Comm::submit`), or as part of a group's point-to-point batch.

use crate::buf::RawBuf;
use crate::nesting::in_group;
use crate::types::*;
use qccl_core::fused::{FusedAllReduce, Part};
use qccl_core::internal::{
    AllReduceCall, CallBuf, Coll, CollCall, CollKind, Engine, OpDesc, PreparedTopK, RecvReq,
    SendReq, Shape, Side,
};
use qccl_core::{Comm, Compression, DType, Error, ReduceOp, Result, TopK, TopKScheme};
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

/// A checked operation. `send: None` means in place.
pub(crate) enum Op {
    /// Every all-reduce (plain, compressed by QCCL_COMPRESSION or a codec, hierarchical),
    /// its route resolved on the Comm when the call was made.
    AllReduce {
        send: Option<RawBuf>,
        recv: RawBuf,
        call: Box<AllReduceCall>,
    },
    /// Every other collective, and each send or receive: its validated description, and
    /// its buffers with NCCL's in-place layout resolved (`send: None`).
    Coll {
        call: CollCall<'static>,
        send: Option<RawBuf>,
        recv: RawBuf,
    },
    HiTopK {
        send: Option<RawBuf>,
        recv: RawBuf,
        call: Arc<PreparedTopK>,
    },
    /// A fusion plan's group (`plan.rs`): its tensors (send None: in place) reduced as one
    /// buffer.
    Fused {
        call: Box<FusedAllReduce>,
        parts: Vec<(Option<RawBuf>, RawBuf)>,
    },
}

impl Op {
    /// Its buffers as the device path sees them: the send buffer (read), then the receive
    /// buffer (written; read too when there is no separate send buffer, in place or a
    /// receive). None for a fusion group, whose tensors are host memory.
    pub(crate) fn call_bufs(&self) -> Vec<CallBuf> {
        let (send, recv) = match self {
            Op::AllReduce { send, recv, .. }
            | Op::Coll { send, recv, .. }
            | Op::HiTopK { send, recv, .. } => (send, recv),
            Op::Fused { .. } => return Vec::new(),
        };
        let buf = |b: &RawBuf, reads, writes| CallBuf {
            addr: b.start() as u64,
            len: b.len(),
            reads,
            writes,
        };
        let mut v: Vec<CallBuf> = send.iter().map(|s| buf(s, true, false)).collect();
        v.push(buf(recv, send.is_none(), true));
        v
    }

    /// Moves each of its buffers (a fusion group's host tensors included) where `f` says.
    pub(crate) fn map_bufs(&mut self, f: &impl Fn(RawBuf) -> RawBuf) {
        match self {
            Op::AllReduce { send, recv, .. }
            | Op::Coll { send, recv, .. }
            | Op::HiTopK { send, recv, .. } => {
                *send = send.map(f);
                *recv = f(*recv);
            }
            Op::Fused { parts, .. } => {
                for (s, r) in parts {
                    *s = s.map(f);
                    *r = f(*r);
                }
            }
        }
    }

    /// How many compressed calls running it makes, where that is known before it runs (a
    /// fusion group's is not), for a call queued on a stream to declare (`Comm::on_stream`).
    pub(crate) fn coded_calls(&self) -> Option<u64> {
        match self {
            Op::AllReduce { call, .. } => Some(call.coded_calls()),
            Op::Coll { .. } => Some(0),
            Op::HiTopK { call, .. } => Some(call.coded_calls()),
            Op::Fused { .. } => None,
        }
    }

    /// True for a fusion plan's group (its tensors are host memory, not in `call_bufs`).
    pub(crate) fn is_fused(&self) -> bool {
        matches!(self, Op::Fused { .. })
    }

    /// The same operation on `hosts`, one address per `call_bufs` entry (same lengths).
    pub(crate) fn rebased(mut self, hosts: &[*mut u8]) -> Op {
        match &mut self {
            Op::AllReduce { send, recv, .. }
            | Op::Coll { send, recv, .. }
            | Op::HiTopK { send, recv, .. } => {
                let mut at = 0;
                if let Some(s) = send {
                    *s = RawBuf::at(hosts[0], s.len());
                    at = 1;
                }
                *recv = RawBuf::at(hosts[at], recv.len());
            }
            Op::Fused { .. } => {}
        }
        self
    }
}

/// A C call described and validated: the ABI's enums decoded, then the core's one check
/// (`CollCall::validate`, as for Rust calls). `rank_arg` is the root or peer (0 if none);
/// `op` is read only by collectives that reduce.
fn describe(
    c: &Comm,
    coll: Coll,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    rank_arg: c_int,
) -> Result<CollCall<'static>> {
    let dtype = DType::from_i32(datatype)?;
    let op = if coll.reduces() {
        ReduceOp::from_i32(op)?
    } else {
        ReduceOp::Sum
    };
    let call = CollCall {
        root: i64::from(rank_arg),
        // A send to this rank is allowed in a group, which copies it to the matching receive.
        grouped: in_group(),
        ..CollCall::new(coll, count, dtype).op(op)
    };
    call.validate(Shape {
        rank: c.rank(),
        size: c.size(),
    })?;
    Ok(call)
}

/// The buffers of a validated call: checked (NULL with a non-zero size, wrap-around), those
/// the call does not use on this rank left empty, and NCCL's in-place layout
/// (`Coll::in_place`) turned into `send: None`; other overlaps are refused.
fn buffers(
    c: &Comm,
    call: &CollCall<'_>,
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
) -> Result<(Option<RawBuf>, RawBuf)> {
    let (rank, size, es) = (c.rank(), c.size(), call.dtype.size());
    let raw = |side: Side, ptr: *const c_void| match call.coll.parts(side, size) {
        Some(parts) if call.uses(side, rank) => {
            let root_only = call.coll.root_only() == Some(side);
            let name = match (side, root_only) {
                (Side::Send, false) => "sendbuff",
                (Side::Send, true) => "sendbuff (on the root)",
                (Side::Recv, false) => "recvbuff",
                (Side::Recv, true) => "recvbuff (on the root)",
            };
            RawBuf::new(name, ptr, call.count, es, parts).map(Some)
        }
        _ => Ok(None),
    };
    let recv = raw(Side::Recv, recvbuff)?;
    let send = raw(Side::Send, sendbuff)?;
    let (send, recv) = match (send, recv) {
        (Some(send), Some(recv)) => (send, recv),
        (send, recv) => return Ok((send, recv.unwrap_or(RawBuf::EMPTY))),
    };
    if let Some((whole, offset)) = call.coll.in_place(rank, call.count) {
        let (part, outer) = match whole {
            Side::Recv => (send, recv),
            Side::Send => (recv, send),
        };
        if part.starts_at(&outer, offset * es) {
            return Ok((None, outer));
        }
    }
    if send.overlaps(&recv) {
        return Err(overlap_error("sendbuff", "recvbuff"));
    }
    Ok((Some(send), recv))
}

fn overlap_error(a: &str, b: &str) -> Error {
    Error::invalid(format!(
        "{a} and {b} overlap without being the in-place layout NCCL defines for this call"
    ))
}

/// A `qcclAllReduce`/`qcclIAllReduce` call's arguments, checked (before a fusion plan or
/// `Op::all_reduce` takes them).
pub(crate) struct AllReduceArgs {
    pub send: Option<RawBuf>,
    pub recv: RawBuf,
    pub count: usize,
    pub dtype: DType,
    pub op: ReduceOp,
}

impl AllReduceArgs {
    /// Its buffers as the device path sees them (as `Op::call_bufs`).
    pub(crate) fn call_bufs(&self) -> Vec<CallBuf> {
        Op::Coll {
            call: CollCall::new(Coll::AllReduce, 0, DType::Float32),
            send: self.send,
            recv: self.recv,
        }
        .call_bufs()
    }

    pub(crate) fn new(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        op: qcclRedOp_t,
    ) -> Result<AllReduceArgs> {
        let call = describe(c, Coll::AllReduce, count, datatype, op, 0)?;
        let (send, recv) = buffers(c, &call, sendbuff, recvbuff)?;
        Ok(AllReduceArgs {
            send,
            recv,
            count,
            dtype: call.dtype,
            op: call.op,
        })
    }
}

impl Op {
    pub(crate) fn all_reduce(c: &Comm, a: AllReduceArgs) -> Result<Op> {
        // QCCL_COMPRESSION and the hierarchical choice are the core's (Comm::prepare_all_reduce).
        let call = Box::new(c.prepare_all_reduce(a.count, a.dtype, a.op, None)?);
        Ok(Op::AllReduce {
            send: a.send,
            recv: a.recv,
            call,
        })
    }

    /// Any collective but all-reduce, or a send or receive, described, validated and its
    /// buffers resolved (`describe`, `buffers`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn coll(
        c: &Comm,
        coll: Coll,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        op: qcclRedOp_t,
        rank_arg: c_int,
    ) -> Result<Op> {
        let call = describe(c, coll, count, datatype, op, rank_arg)?;
        let (send, recv) = buffers(c, &call, sendbuff, recvbuff)?;
        Ok(Op::Coll { call, send, recv })
    }

    /// A compressed all-reduce: checked like `qcclAllReduce` (and by the codec's rules) and
    /// prepared (plan, schedule) before anything is queued.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn all_reduce_compressed(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        op: qcclRedOp_t,
        compression: &Compression,
    ) -> Result<Op> {
        let a = AllReduceArgs::new(c, sendbuff, recvbuff, count, datatype, op)?;
        let (send, recv) = (a.send, a.recv);
        let call = c.prepare_all_reduce_compressed(count, a.dtype, a.op, compression)?;
        let call = Box::new(c.compressed_call(call));
        Ok(Op::AllReduce { send, recv, call })
    }

    /// A HiTopKComm all-reduce (sum): buffers checked like `qcclAllReduce`, the call prepared
    /// (density, error feedback keyed by `tensor_key`, hierarchy) before anything is queued.
    pub(crate) fn hitopk(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        density: f64,
        tensor_key: u64,
    ) -> Result<Op> {
        let AllReduceArgs {
            send, recv, dtype, ..
        } = AllReduceArgs::new(c, sendbuff, recvbuff, count, datatype, qcclSum)?;
        let o = TopK::new(density).key(tensor_key);
        let call = Arc::new(c.prepare_topk(count, dtype, TopKScheme::HiTopK, &o)?);
        Ok(Op::HiTopK { send, recv, call })
    }

    pub(crate) fn is_p2p(&self) -> bool {
        matches!(self, Op::Coll { call, .. } if call.coll.is_p2p())
    }

    /// Runs the operation now, in the comm's turn on the caller's thread: the same path as a
    /// grouped or non-blocking call, only not queued.
    pub(crate) fn run_blocking(self, c: &Comm) -> Result<()> {
        c.execute(|e| self.run(e))
    }

    /// Runs a collective on the comm's engine (inside `Comm::execute` or `Comm::submit`).
    pub(crate) fn run(self, e: &mut Engine) -> Result<()> {
        // SAFETY (every slice below): the RawBufs were checked when the call was made (buf.rs)
        // and the C caller keeps them valid until the call completes (its return when
        // blocking, qcclGroupEnd when grouped, qcclWait when non-blocking). A shared and a
        // mutable slice are never made of overlapping buffers: the constructors above turned
        // the overlapping (in-place) layouts into `send: None`, or refused them.
        match self {
            Op::AllReduce { send, recv, call } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                call.run(e, s, r).map(drop)
            }
            // Alone (outside a group), a send or receive is the engine's own, whose frames
            // match a grouped peer's (see P2pPlan).
            Op::Coll { call, send, recv } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                e.run_call(&call, s, r)
            }
            Op::HiTopK { send, recv, call } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                if let Some(s) = s {
                    r.copy_from_slice(s);
                }
                call.run(e, r).map(drop)
            }
            Op::Fused { call, parts } => {
                // SAFETY: as above; plan.rs refused tensors whose buffers overlap another tensor's
                // output, so the outputs alias nothing.
                let mut views: Vec<Part<'_>> = parts
                    .iter()
                    .map(|(s, r)| unsafe { (s.map(|b| b.slice()), r.slice_mut()) })
                    .collect();
                call.run(e, &mut views)
            }
        }
    }
}

/// A group's sends and receives on one comm, checked and arranged to run together, so that
/// no order of sends and receives deadlocks (both ranks may send before they receive, any
/// size).
///
/// The k-th send to a peer matches that peer's k-th receive from this rank. Operations run
/// in phases keyed by (k, dtype, count), in key order on every rank: each phase is one
/// transport exchange (at most one send and one receive per peer, all progressed at once),
/// and both ends of a matched pair are in the same phase, so every rank goes through the same
/// sequence of phases and none waits on a phase another rank has not reached. Each frame
/// carries what `Engine::send` would (send/recv, dtype, count), so a lone grouped send
/// matches a blocking `qcclRecv` and the reverse. Sends to this rank itself are copied to
/// its receives from itself, in order, before the phases.
pub(crate) struct P2pPlan {
    self_copies: Vec<(RawBuf, RawBuf)>,
    phases: Vec<(OpDesc, Phase)>,
}

type Phase = (Vec<(usize, RawBuf)>, Vec<(usize, RawBuf)>);

impl P2pPlan {
    /// Arranges `ops` (sends and receives of rank `me` of `size`) and checks everything that
    /// needs no peer: self sends matched by self receives of the same size, and no receive
    /// buffer overlapping another buffer it runs together with.
    pub(crate) fn new(me: usize, size: usize, ops: Vec<Op>) -> Result<P2pPlan> {
        let mut nsend = vec![0usize; size];
        let mut nrecv = vec![0usize; size];
        let mut self_sends = Vec::new();
        let mut self_recvs = Vec::new();
        let mut phases: BTreeMap<(usize, u8, u64), Phase> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Coll { call, send, recv } if call.coll.is_p2p() => {
                    let peer = call.rank_arg();
                    let key = |k| (k, call.dtype as u8, call.count as u64);
                    match (call.coll, send) {
                        (Coll::Send, Some(buf)) if peer == me => self_sends.push(buf),
                        (Coll::Send, Some(buf)) => {
                            let k = nsend[peer];
                            nsend[peer] += 1;
                            phases.entry(key(k)).or_default().0.push((peer, buf));
                        }
                        (Coll::Recv, _) if peer == me => self_recvs.push(recv),
                        (Coll::Recv, _) => {
                            let k = nrecv[peer];
                            nrecv[peer] += 1;
                            phases.entry(key(k)).or_default().1.push((peer, recv));
                        }
                        _ => return Err(Error::Internal("a send without a buffer".into())),
                    }
                }
                _ => return Err(Error::Internal("a collective in the p2p batch".into())),
            }
        }
        if self_sends.len() != self_recvs.len() {
            return Err(Error::InvalidUsage(format!(
                "rank {me}: the group has {} qcclSend to this rank itself but {} qcclRecv \
                 from it",
                self_sends.len(),
                self_recvs.len()
            )));
        }
        let mut self_copies = Vec::with_capacity(self_sends.len());
        for (i, (s, r)) in self_sends.into_iter().zip(self_recvs).enumerate() {
            if s.len() != r.len() {
                return Err(Error::InvalidUsage(format!(
                    "rank {me}: send #{i} to itself is {} bytes but the matching receive is {}",
                    s.len(),
                    r.len()
                )));
            }
            if s.starts_at(&r, 0) {
                continue;
            }
            if s.overlaps(&r) {
                return Err(overlap_error("a send to this rank", "its matching receive"));
            }
            self_copies.push((s, r));
        }
        let phases = phases
            .into_iter()
            .map(|((_, dtype, count), (sends, recvs))| {
                check_disjoint(&sends, &recvs)?;
                let desc = OpDesc {
                    coll: CollKind::SendRecv,
                    dtype,
                    op: 0,
                    algo: 0,
                    root: 0,
                    count,
                };
                Ok((desc, (sends, recvs)))
            })
            .collect::<Result<_>>()?;
        Ok(P2pPlan {
            self_copies,
            phases,
        })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.self_copies.is_empty() && self.phases.is_empty()
    }

    /// Moves each of its buffers where `f` says.
    pub(crate) fn map_bufs(&mut self, f: &impl Fn(RawBuf) -> RawBuf) {
        for (s, r) in &mut self.self_copies {
            *s = f(*s);
            *r = f(*r);
        }
        for (_, (sends, recvs)) in &mut self.phases {
            for (_, b) in sends.iter_mut().chain(recvs.iter_mut()) {
                *b = f(*b);
            }
        }
    }

    /// Runs the plan on the comm's engine.
    pub(crate) fn run(self, e: &mut Engine) -> Result<()> {
        for (s, r) in self.self_copies {
            // SAFETY: both checked at the call and kept valid by the caller until
            // qcclGroupEnd returns; they do not overlap (checked in `new`).
            unsafe { r.slice_mut() }.copy_from_slice(unsafe { s.slice() });
        }
        for (desc, (sends, recvs)) in self.phases {
            // SAFETY: checked at the call and kept valid by the caller until qcclGroupEnd
            // returns; no receive buffer of this phase overlaps any other buffer of it
            // (check_disjoint in `new`), so the mutable slices alias nothing.
            let sends: Vec<SendReq<'_>> = sends
                .iter()
                .map(|&(peer, b)| SendReq {
                    peer,
                    data: unsafe { b.slice() },
                })
                .collect();
            let mut recvs: Vec<RecvReq<'_>> = recvs
                .iter()
                .map(|&(peer, b)| RecvReq::new(peer, unsafe { b.slice_mut() }))
                .collect();
            e.exchange(&desc, &sends, &mut recvs)?;
        }
        Ok(())
    }
}

/// Refuses a receive buffer that overlaps another buffer of the same phase (sends may share
/// memory: they are only read).
fn check_disjoint(sends: &[(usize, RawBuf)], recvs: &[(usize, RawBuf)]) -> Result<()> {
    let mut all: Vec<(usize, usize, bool, usize)> = Vec::new();
    for &(p, b) in sends {
        if b.len() > 0 {
            let start = b.start();
            all.push((start, start + b.len(), false, p));
        }
    }
    for &(p, b) in recvs {
        if b.len() > 0 {
            let start = b.start();
            all.push((start, start + b.len(), true, p));
        }
    }
    all.sort_unstable();
    let (mut end_any, mut end_recv) = (0usize, 0usize);
    for (start, end, is_recv, p) in all {
        if start < end_recv || (is_recv && start < end_any) {
            let what = if is_recv {
                "qcclRecv from"
            } else {
                "qcclSend to"
            };
            return Err(Error::invalid(format!(
                "the buffer of a grouped {what} peer {p} overlaps a receive buffer of the same \
                 group"
            )));
        }
        end_any = end_any.max(end);
        if is_recv {
            end_recv = end_recv.max(end);
        }
    }
    Ok(())
}
