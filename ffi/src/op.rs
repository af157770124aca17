//! One C call as an operation: its arguments checked, its buffers resolved with NCCL's
//! in-place rules and its route prepared (`Comm::prepare_all_reduce`) when the call is made;
//! run on the comm's engine in its turn, the same way whether blocking (`Comm::execute`),
//! grouped or non-blocking (`Comm::submit`), or as part of a group's point-to-point batch.

use crate::buf::RawBuf;
use crate::types::*;
use qccl_core::fused::{FusedAllReduce, Part};
use qccl_core::internal::{
    AllReduceCall, CollKind, Engine, OpDesc, PreparedTopK, RecvReq, SendReq,
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
    Broadcast {
        send: Option<RawBuf>,
        recv: RawBuf,
        count: usize,
        dtype: DType,
        root: usize,
    },
    Reduce {
        send: Option<RawBuf>,
        recv: RawBuf,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    },
    AllGather {
        send: Option<RawBuf>,
        recv: RawBuf,
        sendcount: usize,
        dtype: DType,
    },
    ReduceScatter {
        send: Option<RawBuf>,
        recv: RawBuf,
        recvcount: usize,
        dtype: DType,
        op: ReduceOp,
    },
    AllToAll {
        send: RawBuf,
        recv: RawBuf,
        in_place: bool,
        count: usize,
        dtype: DType,
    },
    Send {
        buf: RawBuf,
        count: usize,
        dtype: DType,
        peer: usize,
    },
    Recv {
        buf: RawBuf,
        count: usize,
        dtype: DType,
        peer: usize,
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

fn dtype(v: qcclDataType_t) -> Result<DType> {
    DType::from_i32(v)
}

fn redop(v: qcclRedOp_t, dtype: DType) -> Result<ReduceOp> {
    let op = ReduceOp::from_i32(v)?;
    op.check_dtype(dtype)?;
    Ok(op)
}

fn root(v: c_int, size: usize) -> Result<usize> {
    match usize::try_from(v) {
        Ok(r) if r < size => Ok(r),
        _ => Err(Error::invalid(format!(
            "root {v} is out of range for a comm of {size} ranks (valid: 0..={})",
            size - 1
        ))),
    }
}

fn peer(v: c_int, size: usize) -> Result<usize> {
    match usize::try_from(v) {
        Ok(p) if p < size => Ok(p),
        _ => Err(Error::invalid(format!(
            "peer {v} is out of range for a comm of {size} ranks (valid: 0..={})",
            size - 1
        ))),
    }
}

/// The buffers of an all-reduce-shaped call, checked, with NCCL's in-place rule applied:
/// `send` None when `sendbuff == recvbuff`; other overlaps are refused.
fn all_reduce_buffers(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
) -> Result<(Option<RawBuf>, RawBuf, DType, ReduceOp)> {
    let dtype = dtype(datatype)?;
    let op = redop(op, dtype)?;
    let es = dtype.size();
    let recv = RawBuf::new("recvbuff", recvbuff, count, es, 1)?;
    let send = RawBuf::new("sendbuff", sendbuff, count, es, 1)?;
    let send = if send.starts_at(&recv, 0) {
        None
    } else if send.overlaps(&recv) {
        return Err(overlap_error("sendbuff", "recvbuff"));
    } else {
        Some(send)
    };
    Ok((send, recv, dtype, op))
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
    pub(crate) fn new(
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        op: qcclRedOp_t,
    ) -> Result<AllReduceArgs> {
        let (send, recv, dtype, op) = all_reduce_buffers(sendbuff, recvbuff, count, datatype, op)?;
        Ok(AllReduceArgs {
            send,
            recv,
            count,
            dtype,
            op,
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

    pub(crate) fn broadcast(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        root_rank: c_int,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let root = root(root_rank, c.size())?;
        let es = dtype.size();
        let recv = RawBuf::new("recvbuff", recvbuff, count, es, 1)?;
        // sendbuff is only read on the root.
        let send = if c.rank() == root {
            let send = RawBuf::new("sendbuff (on the root)", sendbuff, count, es, 1)?;
            if send.starts_at(&recv, 0) {
                None
            } else if send.overlaps(&recv) {
                return Err(overlap_error("sendbuff", "recvbuff"));
            } else {
                Some(send)
            }
        } else {
            None
        };
        Ok(Op::Broadcast {
            send,
            recv,
            count,
            dtype,
            root,
        })
    }

    pub(crate) fn reduce(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        op: qcclRedOp_t,
        root_rank: c_int,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let op = redop(op, dtype)?;
        let root = root(root_rank, c.size())?;
        let es = dtype.size();
        let send = RawBuf::new("sendbuff", sendbuff, count, es, 1)?;
        let (send, recv) = if c.rank() == root {
            let recv = RawBuf::new("recvbuff (on the root)", recvbuff, count, es, 1)?;
            if send.starts_at(&recv, 0) {
                (None, recv)
            } else if send.overlaps(&recv) {
                return Err(overlap_error("sendbuff", "recvbuff"));
            } else {
                (Some(send), recv)
            }
        } else {
            // Only the root's recvbuff is written; elsewhere it may be NULL and is ignored
            // (in place or not, the input is sendbuff).
            (Some(send), RawBuf::EMPTY)
        };
        Ok(Op::Reduce {
            send,
            recv,
            count,
            dtype,
            op,
            root,
        })
    }

    pub(crate) fn all_gather(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        sendcount: usize,
        datatype: qcclDataType_t,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let es = dtype.size();
        let recv = RawBuf::new("recvbuff", recvbuff, sendcount, es, c.size())?;
        let send = RawBuf::new("sendbuff", sendbuff, sendcount, es, 1)?;
        // In place: sendbuff == recvbuff + rank·sendcount elements.
        let send = if send.starts_at(&recv, c.rank() * send.len()) {
            None
        } else if send.overlaps(&recv) {
            return Err(overlap_error("sendbuff", "recvbuff"));
        } else {
            Some(send)
        };
        Ok(Op::AllGather {
            send,
            recv,
            sendcount,
            dtype,
        })
    }

    pub(crate) fn reduce_scatter(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        recvcount: usize,
        datatype: qcclDataType_t,
        op: qcclRedOp_t,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let op = redop(op, dtype)?;
        let es = dtype.size();
        let send = RawBuf::new("sendbuff", sendbuff, recvcount, es, c.size())?;
        let recv = RawBuf::new("recvbuff", recvbuff, recvcount, es, 1)?;
        // In place: recvbuff == sendbuff + rank·recvcount elements; the whole sendbuff is
        // then the buffer, and this rank's result lands at its part.
        let (send, recv) = if recv.starts_at(&send, c.rank() * recv.len()) {
            (None, send)
        } else if send.overlaps(&recv) {
            return Err(overlap_error("sendbuff", "recvbuff"));
        } else {
            (Some(send), recv)
        };
        Ok(Op::ReduceScatter {
            send,
            recv,
            recvcount,
            dtype,
            op,
        })
    }

    pub(crate) fn all_to_all(
        c: &Comm,
        sendbuff: *const c_void,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let es = dtype.size();
        let send = RawBuf::new("sendbuff", sendbuff, count, es, c.size())?;
        let recv = RawBuf::new("recvbuff", recvbuff, count, es, c.size())?;
        let in_place = send.starts_at(&recv, 0);
        if !in_place && send.overlaps(&recv) {
            return Err(overlap_error("sendbuff", "recvbuff"));
        }
        Ok(Op::AllToAll {
            send,
            recv,
            in_place,
            count,
            dtype,
        })
    }

    pub(crate) fn send(
        c: &Comm,
        sendbuff: *const c_void,
        count: usize,
        datatype: qcclDataType_t,
        peer_rank: c_int,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let peer = peer(peer_rank, c.size())?;
        let buf = RawBuf::new("sendbuff", sendbuff, count, dtype.size(), 1)?;
        Ok(Op::Send {
            buf,
            count,
            dtype,
            peer,
        })
    }

    pub(crate) fn recv(
        c: &Comm,
        recvbuff: *mut c_void,
        count: usize,
        datatype: qcclDataType_t,
        peer_rank: c_int,
    ) -> Result<Op> {
        let dtype = dtype(datatype)?;
        let peer = peer(peer_rank, c.size())?;
        let buf = RawBuf::new("recvbuff", recvbuff, count, dtype.size(), 1)?;
        Ok(Op::Recv {
            buf,
            count,
            dtype,
            peer,
        })
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
        let (send, recv, dtype, op) = all_reduce_buffers(sendbuff, recvbuff, count, datatype, op)?;
        let call = c.prepare_all_reduce_compressed(count, dtype, op, compression)?;
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
        let (send, recv, dtype, _) =
            all_reduce_buffers(sendbuff, recvbuff, count, datatype, qcclSum)?;
        let o = TopK::new(density).key(tensor_key);
        let call = Arc::new(c.prepare_topk(count, dtype, TopKScheme::HiTopK, &o)?);
        Ok(Op::HiTopK { send, recv, call })
    }

    pub(crate) fn is_p2p(&self) -> bool {
        matches!(self, Op::Send { .. } | Op::Recv { .. })
    }

    /// The peer of a send or receive.
    pub(crate) fn p2p_peer(&self) -> Option<usize> {
        match self {
            Op::Send { peer, .. } | Op::Recv { peer, .. } => Some(*peer),
            _ => None,
        }
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
            Op::Broadcast {
                send,
                recv,
                count,
                dtype,
                root,
            } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                e.broadcast(s, r, count, dtype, root)
            }
            Op::Reduce {
                send,
                recv,
                count,
                dtype,
                op,
                root,
            } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                e.reduce(s, r, count, dtype, op, root)
            }
            Op::AllGather {
                send,
                recv,
                sendcount,
                dtype,
            } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                e.all_gather(s, r, sendcount, dtype)
            }
            Op::ReduceScatter {
                send,
                recv,
                recvcount,
                dtype,
                op,
            } => {
                let (s, r) = unsafe { (send.map(|b| b.slice()), recv.slice_mut()) };
                e.reduce_scatter(s, r, recvcount, dtype, op)
            }
            Op::AllToAll {
                send,
                recv,
                in_place,
                count,
                dtype,
            } => {
                if in_place {
                    let copy = unsafe { send.slice() }.to_vec();
                    e.all_to_all(&copy, unsafe { recv.slice_mut() }, count, dtype)
                } else {
                    let (s, r) = unsafe { (send.slice(), recv.slice_mut()) };
                    e.all_to_all(s, r, count, dtype)
                }
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
            // Alone (outside a group): the engine's own send and receive, whose frames match
            // a grouped peer's (see P2pPlan).
            Op::Send {
                buf,
                count,
                dtype,
                peer,
            } => e.send(unsafe { buf.slice() }, count, dtype, peer),
            Op::Recv {
                buf,
                count,
                dtype,
                peer,
            } => e.recv(unsafe { buf.slice_mut() }, count, dtype, peer),
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
                Op::Send { buf, peer, .. } if peer == me => self_sends.push(buf),
                Op::Recv { buf, peer, .. } if peer == me => self_recvs.push(buf),
                Op::Send {
                    buf,
                    count,
                    dtype,
                    peer,
                } => {
                    let k = nsend[peer];
                    nsend[peer] += 1;
                    let key = (k, dtype as u8, count as u64);
                    phases.entry(key).or_default().0.push((peer, buf));
                }
                Op::Recv {
                    buf,
                    count,
                    dtype,
                    peer,
                } => {
                    let k = nrecv[peer];
                    nrecv[peer] += 1;
                    let key = (k, dtype as u8, count as u64);
                    phases.entry(key).or_default().1.push((peer, buf));
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
