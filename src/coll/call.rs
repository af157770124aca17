//! One description of a collective call, and its one validation.
//!
//! Like NCCL's `ncclEnqueueCheck`, every way into a collective describes the call as a
//! [`CollCall`] and runs [`CollCall::validate`] before anything is queued or moved: the Rust
//! blocking and async calls (`comm::api`), the compressed ones (`comm::compress`), and the C
//! ABI's blocking, grouped and non-blocking calls. So an argument rule (root in range, no
//! send to oneself outside a group, op fits dtype, buffer sizes, codec fits dtype) holds the
//! same way whichever path the call took, and a refused call leaves the comm usable.
//!
//! Messages name the argument but not the collective: the Rust API prefixes the collective's
//! name (`Comm::check`), the C ABI its entry point's (`qcclBroadcast: invalid argument: …`).

use crate::codec::CodecSpec;
use crate::error::{Error, Result};
use crate::transport::frame::CollKind;
use crate::types::{DType, ReduceOp};

/// Every collective that takes arguments (barrier takes none): the one list of them, with
/// what each takes (`name`, `reduces`, `rooted`, `send_parts`, `recv_parts`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coll {
    /// Every rank ends with the reduction of all ranks' buffers.
    AllReduce,
    /// Rank r ends with part r of the reduction.
    ReduceScatter,
    /// Every rank ends with every rank's part, in rank order.
    AllGather,
    /// The root's buffer lands on every rank.
    Broadcast,
    /// The root ends with the reduction.
    Reduce,
    /// Part p of every rank's input goes to rank p.
    AllToAll,
    /// The root ends with every rank's part, in rank order.
    Gather,
    /// Part p of the root's input goes to rank p.
    Scatter,
    /// A point-to-point send to a peer.
    Send,
    /// A point-to-point receive from a peer.
    Recv,
}

/// Which buffer of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The input (`sendbuff`).
    Send,
    /// The output (`recvbuff`).
    Recv,
}

impl Coll {
    /// Every collective.
    pub const ALL: [Coll; 10] = [
        Coll::AllReduce,
        Coll::ReduceScatter,
        Coll::AllGather,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllToAll,
        Coll::Gather,
        Coll::Scatter,
        Coll::Send,
        Coll::Recv,
    ];

    /// The name users call it by (the Rust method's).
    pub fn name(self) -> &'static str {
        match self {
            Coll::Send => "send",
            Coll::Recv => "recv",
            c => c.kind().name(),
        }
    }

    /// What its frames carry on the wire.
    pub fn kind(self) -> CollKind {
        match self {
            Coll::AllReduce => CollKind::AllReduce,
            Coll::ReduceScatter => CollKind::ReduceScatter,
            Coll::AllGather => CollKind::AllGather,
            Coll::Broadcast => CollKind::Broadcast,
            Coll::Reduce => CollKind::Reduce,
            Coll::AllToAll => CollKind::AllToAll,
            Coll::Gather => CollKind::Gather,
            Coll::Scatter => CollKind::Scatter,
            Coll::Send | Coll::Recv => CollKind::SendRecv,
        }
    }

    /// Takes a reduction op.
    pub fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce)
    }

    /// Takes a root.
    pub fn rooted(self) -> bool {
        matches!(
            self,
            Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter
        )
    }

    /// A point-to-point call: its rank argument is a peer.
    pub fn is_p2p(self) -> bool {
        matches!(self, Coll::Send | Coll::Recv)
    }

    /// Elements of the buffer on `side`, in units of the call's count, on a comm of `size`
    /// (NCCL's counts: all-gather's is per rank sent, reduce-scatter's per rank received,
    /// all-to-all's, gather's and scatter's per peer). None: the call has no such buffer.
    pub fn parts(self, side: Side, size: usize) -> Option<usize> {
        use Coll::*;
        match (self, side) {
            (Send, Side::Recv) | (Recv, Side::Send) => None,
            (ReduceScatter | Scatter | AllToAll, Side::Send) => Some(size),
            (AllGather | Gather | AllToAll, Side::Recv) => Some(size),
            _ => Some(1),
        }
    }

    /// The buffer only the root uses (ignored elsewhere, may be NULL or empty there).
    pub fn root_only(self) -> Option<Side> {
        match self {
            Coll::Broadcast | Coll::Scatter => Some(Side::Send),
            Coll::Reduce | Coll::Gather => Some(Side::Recv),
            _ => None,
        }
    }

    /// NCCL's in-place layout: the whole buffer is on the side returned (the larger one), and
    /// the other buffer starts `offset` elements into it (`rank·count` for the per-rank
    /// collectives: all-gather's sendbuff is `recvbuff + rank·sendcount`, reduce-scatter's
    /// recvbuff `sendbuff + rank·recvcount`). None for point-to-point calls.
    pub fn in_place(self, rank: usize, count: usize) -> Option<(Side, usize)> {
        use Coll::*;
        match self {
            Send | Recv => None,
            AllGather | Gather => Some((Side::Recv, rank * count)),
            ReduceScatter | Scatter => Some((Side::Send, rank * count)),
            AllReduce | Broadcast | Reduce | AllToAll => Some((Side::Recv, 0)),
        }
    }
}

/// A buffer argument, as far as validation sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buf {
    /// A buffer of this many bytes (a Rust slice): its length must fit the call.
    Bytes(usize),
    /// A buffer as long as the count makes it (a C pointer): only that size is checked
    /// (overflow).
    Counted,
    /// No buffer: for `send`, the call is in place (the whole buffer is `recv`); for a
    /// buffer the call does not have, or a root-only one elsewhere, nothing.
    None,
}

impl Buf {
    /// The argument of a Rust slice (None: in place).
    pub fn of(s: Option<&[u8]>) -> Buf {
        s.map_or(Buf::None, |s| Buf::Bytes(s.len()))
    }
}

/// Where a call is made: the rank and size of its comm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// This rank.
    pub rank: usize,
    /// Ranks in the comm.
    pub size: usize,
}

/// A compressed call's codec, as far as validation sees it.
#[derive(Debug, Clone, Copy)]
pub struct CodecArg<'a> {
    /// The codec.
    pub spec: &'a CodecSpec,
    /// The call names its tensor (error feedback needs it).
    pub keyed: bool,
}

/// One collective call: which collective, its counts, root or peer, dtype, op, buffers
/// (send `Buf::None`: in place) and codec. Built by every path; `validate` is the one check.
#[derive(Debug, Clone, Copy)]
pub struct CollCall<'a> {
    /// Which collective.
    pub coll: Coll,
    /// The count, as NCCL's call of this collective takes it (see `Coll::parts`).
    pub count: usize,
    /// The element type.
    pub dtype: DType,
    /// The reduction (Sum for collectives that do not reduce).
    pub op: ReduceOp,
    /// The root of a rooted collective or the peer of a send or receive; signed, so the C
    /// ABI's negative ranks are refused as given.
    pub root: i64,
    /// The input buffer.
    pub send: Buf,
    /// The output buffer (or the only one, in place).
    pub recv: Buf,
    /// Made inside a group (the C ABI's qcclGroupStart..qcclGroupEnd), where a send to this
    /// rank matched by a receive from it is allowed (NCCL's rule): the group copies it.
    pub grouped: bool,
    /// The codec of a compressed call.
    pub codec: Option<CodecArg<'a>>,
}

impl<'a> CollCall<'a> {
    /// A call of `coll` with `count` elements of `dtype`: op Sum, root 0, both buffers
    /// sized by the count, not grouped, no codec; the builders below set the rest.
    pub fn new(coll: Coll, count: usize, dtype: DType) -> CollCall<'a> {
        CollCall {
            coll,
            count,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
            send: Buf::Counted,
            recv: Buf::Counted,
            grouped: false,
            codec: None,
        }
    }

    /// Sets the reduction.
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// Sets the root (or peer) from a Rust rank.
    pub fn root(mut self, root: usize) -> Self {
        self.root = i64::try_from(root).unwrap_or(i64::MAX);
        self
    }

    /// Sets the buffers.
    pub fn bufs(mut self, send: Buf, recv: Buf) -> Self {
        self.send = send;
        self.recv = recv;
        self
    }

    /// Sets the codec of a compressed call.
    pub fn codec(mut self, spec: &'a CodecSpec, keyed: bool) -> Self {
        self.codec = Some(CodecArg { spec, keyed });
        self
    }

    /// The root or peer, once validated.
    pub fn rank_arg(&self) -> usize {
        usize::try_from(self.root).unwrap_or(usize::MAX)
    }

    /// True when this rank is the call's root (every rank, for collectives without one).
    pub fn is_root(&self, rank: usize) -> bool {
        !self.coll.rooted() || self.rank_arg() == rank
    }

    /// True when the buffer on `side` is used on `rank` (a root-only buffer is not elsewhere).
    pub fn uses(&self, side: Side, rank: usize) -> bool {
        self.coll.parts(side, 1).is_some()
            && (self.coll.root_only() != Some(side) || self.is_root(rank))
    }

    /// Bytes of the buffer on `side` out of place on a comm of `size`: count × parts ×
    /// element size, refused past isize::MAX (Rust's limit on a slice).
    pub fn bytes(&self, side: Side, size: usize) -> Result<usize> {
        let parts = self.coll.parts(side, size).unwrap_or(0);
        let es = self.dtype.size();
        self.count
            .checked_mul(parts)
            .and_then(|n| n.checked_mul(es))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                let what = if parts == 1 {
                    format!("count {} × {es} bytes", self.count)
                } else {
                    format!("count {} × {parts} ranks × {es} bytes", self.count)
                };
                Error::invalid(format!(
                    "{}: {what} overflows (more than isize::MAX bytes)",
                    side_name(side)
                ))
            })
    }

    /// Checks every argument rule against the comm `at`; the error (InvalidArgument) names
    /// the argument. Nothing has moved yet, so a refused call leaves the comm usable.
    pub fn validate(&self, at: Shape) -> Result<()> {
        let c = self.coll;
        if c.rooted() {
            in_range("root", self.root, at.size)?;
        }
        if c.is_p2p() {
            in_range("peer", self.root, at.size)?;
            if self.rank_arg() == at.rank && !self.grouped {
                return Err(Error::invalid(format!(
                    "peer {} is this rank; a rank cannot send to or from itself outside a \
                     group (between qcclGroupStart and qcclGroupEnd a send to itself is \
                     matched by a receive from itself)",
                    self.root
                )));
            }
        }
        if c.reduces() {
            self.op.check_dtype(self.dtype)?;
        }
        if let Some(codec) = self.codec {
            self.check_codec(codec)?;
        }
        self.check_buffers(at)
    }

    fn check_codec(&self, codec: CodecArg<'_>) -> Result<()> {
        let (spec, dtype, op) = (codec.spec, self.dtype, self.op);
        if !dtype.is_float() {
            return Err(Error::invalid(format!(
                "codec {spec} compresses floating-point data, not {dtype}"
            )));
        }
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            return Err(Error::invalid(format!(
                "codec {spec} supports only sum and avg, not {op}"
            )));
        }
        if spec.error_feedback() && !codec.keyed {
            return Err(Error::invalid(format!(
                "codec {spec} uses error feedback, which needs a tensor key with the call"
            )));
        }
        Ok(())
    }

    /// Sizes: out of place each used buffer holds count × its parts; in place (send
    /// `Buf::None`) `recv` is the whole buffer, the larger of the two.
    fn check_buffers(&self, at: Shape) -> Result<()> {
        let in_place = self.send == Buf::None
            && self.coll.in_place(0, 0).is_some()
            && self.uses(Side::Send, at.rank);
        let mut send = self.bytes(Side::Send, at.size)?;
        let mut recv = self.bytes(Side::Recv, at.size)?;
        if in_place {
            recv = recv.max(send);
            send = 0;
        }
        if self.uses(Side::Send, at.rank) && !in_place {
            self.fits(Side::Send, self.send, send)?;
        }
        if self.uses(Side::Recv, at.rank) || in_place {
            self.fits(Side::Recv, self.recv, recv)?;
        }
        Ok(())
    }

    /// A buffer `b` on `side` must hold `want` bytes (whole elements).
    fn fits(&self, side: Side, b: Buf, want: usize) -> Result<()> {
        let Buf::Bytes(len) = b else {
            return Ok(());
        };
        let name = side_name(side);
        let (es, dtype) = (self.dtype.size(), self.dtype);
        if len % es != 0 {
            return Err(Error::invalid(format!(
                "{name} is {len} bytes, not a whole number of {dtype} elements"
            )));
        }
        if len != want {
            return Err(Error::invalid(format!(
                "{name} holds {} elements but {} are needed",
                len / es,
                want / es
            )));
        }
        Ok(())
    }
}

fn side_name(side: Side) -> &'static str {
    match side {
        Side::Send => "sendbuff",
        Side::Recv => "recvbuff",
    }
}

/// A root or peer must be a rank of the comm.
fn in_range(what: &str, v: i64, size: usize) -> Result<()> {
    if usize::try_from(v).is_ok_and(|r| r < size) {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "{what} {v} is out of range for a comm of {size} ranks (valid: 0..={})",
        size.saturating_sub(1)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use Buf::{Bytes, Counted};
    use Coll::*;
    use DType::{Float32, Int32};

    const AT: Shape = Shape { rank: 1, size: 3 };

    fn call(coll: Coll, count: usize) -> CollCall<'static> {
        CollCall::new(coll, count, Float32)
    }

    /// Every rule, each with a call it refuses (and the words the error must hold) or a
    /// call it lets through (None), on rank 1 of 3.
    #[test]
    fn validate_applies_every_rule() {
        let fp16 = CodecSpec::parse("fp16").unwrap();
        let ef = CodecSpec::parse("fp16:ef=1").unwrap();
        let huge = usize::MAX / 2;
        let f = |n: usize| Bytes(4 * n);
        let cases: Vec<(&str, CollCall<'_>, Option<&str>)> = vec![
            // Root and peer in range.
            ("root in range", call(Broadcast, 4).root(2), None),
            (
                "root = size",
                call(Broadcast, 4).root(3),
                Some("root 3 is out of range for a comm of 3 ranks (valid: 0..=2)"),
            ),
            (
                "negative root (C)",
                CollCall {
                    root: -1,
                    ..call(Reduce, 4)
                },
                Some("root -1 is out of range"),
            ),
            ("gather root", call(Gather, 4).root(9), Some("root 9")),
            ("scatter root", call(Scatter, 4).root(3), Some("root 3")),
            ("root unused", call(AllReduce, 4).root(7), None),
            (
                "peer out of range",
                call(Send, 4).root(3),
                Some("peer 3 is out of range"),
            ),
            (
                "negative peer",
                CollCall {
                    root: -2,
                    ..call(Recv, 4)
                },
                Some("peer -2 is out of range"),
            ),
            (
                "send to self",
                call(Send, 4).root(1),
                Some("cannot send to or from itself"),
            ),
            (
                "recv from self",
                call(Recv, 4).root(1),
                Some("peer 1 is this rank"),
            ),
            (
                "self, grouped",
                CollCall {
                    grouped: true,
                    ..call(Send, 4).root(1)
                },
                None,
            ),
            ("send to peer", call(Send, 4).root(0), None),
            // Op against dtype, for collectives that reduce.
            (
                "avg on ints",
                CollCall::new(AllReduce, 4, Int32).op(ReduceOp::Avg),
                Some("avg needs a floating-point datatype, got int32"),
            ),
            (
                "avg on ints, rs",
                CollCall::new(ReduceScatter, 4, Int32).op(ReduceOp::Avg),
                Some("avg needs"),
            ),
            (
                "avg on ints, reduce",
                CollCall::new(Reduce, 4, Int32).op(ReduceOp::Avg),
                Some("avg needs"),
            ),
            ("avg on floats", call(Reduce, 4).op(ReduceOp::Avg), None),
            (
                "op unused",
                CollCall::new(AllGather, 4, Int32).op(ReduceOp::Avg),
                None,
            ),
            (
                "max on ints",
                CollCall::new(AllReduce, 4, Int32).op(ReduceOp::Max),
                None,
            ),
            // Codec against dtype, op and key.
            (
                "codec on ints",
                CollCall::new(AllReduce, 4, Int32).codec(&fp16, false),
                Some("codec fp16 compresses floating-point data, not int32"),
            ),
            (
                "codec with max",
                call(AllReduce, 4).op(ReduceOp::Max).codec(&fp16, false),
                Some("supports only sum and avg, not max"),
            ),
            (
                "ef without key",
                call(AllReduce, 4).codec(&ef, false),
                Some("needs a tensor key"),
            ),
            ("ef with key", call(AllReduce, 4).codec(&ef, true), None),
            (
                "codec, all-gather",
                call(AllGather, 4).codec(&fp16, false),
                None,
            ),
            // Sizes: count × parts × element size within isize::MAX.
            (
                "overflow",
                call(AllReduce, huge),
                Some("count 9223372036854775807 × 4 bytes overflows"),
            ),
            (
                "overflow × ranks",
                call(ReduceScatter, usize::MAX / 8),
                Some("sendbuff: count 2305843009213693951 × 3 ranks × 4 bytes overflows"),
            ),
            (
                "overflow, all-gather",
                call(AllGather, usize::MAX / 8),
                Some("recvbuff: count"),
            ),
            (
                "overflow, all-to-all",
                call(AllToAll, usize::MAX / 8),
                Some("× 3 ranks"),
            ),
            (
                "overflow, send",
                call(Send, huge).root(0),
                Some("overflows"),
            ),
            ("count 0", call(AllToAll, 0).bufs(Bytes(0), Bytes(0)), None),
            // Rust slices must fit the count; C pointers are sized by it.
            ("sized", call(AllToAll, 5), None),
            (
                "partial element",
                call(AllReduce, 2).bufs(Counted, Bytes(7)),
                Some("recvbuff is 7 bytes, not a whole number of float elements"),
            ),
            (
                "short sendbuff",
                call(AllReduce, 8).bufs(f(7), f(8)),
                Some("sendbuff holds 7 elements but 8 are needed"),
            ),
            ("in place", call(AllReduce, 8).bufs(Buf::None, f(8)), None),
            (
                "rs out of place",
                call(ReduceScatter, 2).bufs(f(6), f(2)),
                None,
            ),
            (
                "rs short recv",
                call(ReduceScatter, 2).bufs(f(6), f(6)),
                Some("recvbuff holds 6 elements but 2"),
            ),
            (
                "rs in place",
                call(ReduceScatter, 2).bufs(Buf::None, f(6)),
                None,
            ),
            (
                "rs in place, short",
                call(ReduceScatter, 2).bufs(Buf::None, f(2)),
                Some("recvbuff holds 2 elements but 6"),
            ),
            ("ag out of place", call(AllGather, 2).bufs(f(2), f(6)), None),
            (
                "ag short recv",
                call(AllGather, 2).bufs(f(2), f(5)),
                Some("recvbuff holds 5 elements but 6"),
            ),
            (
                "ag in place",
                call(AllGather, 2).bufs(Buf::None, f(6)),
                None,
            ),
            ("a2a", call(AllToAll, 2).bufs(f(6), f(6)), None),
            (
                "a2a short send",
                call(AllToAll, 2).bufs(f(2), f(6)),
                Some("sendbuff holds 2 elements but 6"),
            ),
            // Root-only buffers are ignored elsewhere, checked on the root.
            (
                "bcast send elsewhere",
                call(Broadcast, 4).bufs(f(1), f(4)),
                None,
            ),
            (
                "bcast send on root",
                call(Broadcast, 4).root(1).bufs(f(1), f(4)),
                Some("sendbuff holds 1 elements but 4"),
            ),
            (
                "bcast in place",
                call(Broadcast, 4).root(1).bufs(Buf::None, f(4)),
                None,
            ),
            (
                "bcast short recv",
                call(Broadcast, 4).bufs(Buf::None, f(3)),
                Some("recvbuff holds 3"),
            ),
            (
                "reduce recv elsewhere",
                call(Reduce, 4).bufs(f(4), f(1)),
                None,
            ),
            (
                "reduce recv on root",
                call(Reduce, 4).root(1).bufs(f(4), f(1)),
                Some("recvbuff holds 1 elements but 4"),
            ),
            (
                "reduce in place elsewhere",
                call(Reduce, 4).bufs(Buf::None, f(3)),
                Some("recvbuff holds 3 elements but 4"),
            ),
            (
                "gather recv elsewhere",
                call(Gather, 2).bufs(f(2), Bytes(0)),
                None,
            ),
            (
                "gather recv on root",
                call(Gather, 2).root(1).bufs(f(2), f(2)),
                Some("recvbuff holds 2 elements but 6"),
            ),
            (
                "scatter send elsewhere",
                call(Scatter, 2).bufs(Bytes(0), f(2)),
                None,
            ),
            (
                "scatter send on root",
                call(Scatter, 2).root(1).bufs(f(2), f(2)),
                Some("sendbuff holds 2 elements but 6"),
            ),
            (
                "send short",
                call(Send, 4).root(0).bufs(f(3), Buf::None),
                Some("sendbuff holds 3"),
            ),
            (
                "recv short",
                call(Recv, 4).root(2).bufs(Buf::None, f(5)),
                Some("recvbuff holds 5"),
            ),
        ];
        for (what, c, want) in cases {
            match (c.validate(AT), want) {
                (Ok(()), None) => {}
                (Err(Error::InvalidArgument(m)), Some(w)) => {
                    assert!(m.contains(w), "{what}: {m:?} lacks {w:?}")
                }
                (got, _) => panic!("{what}: got {got:?}, wanted an error with {want:?}"),
            }
        }
    }

    #[test]
    fn the_table_agrees_with_itself() {
        let mut names: Vec<&str> = Coll::ALL.iter().map(|c| c.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Coll::ALL.len());
        for c in Coll::ALL {
            assert_eq!(c.name(), c.kind().name().replace("send/recv", c.name()));
            // p2p calls have one buffer and no in-place layout; every other has both.
            let both = c.parts(Side::Send, 3).is_some() && c.parts(Side::Recv, 3).is_some();
            assert_eq!(both, !c.is_p2p(), "{c:?}");
            assert_eq!(c.in_place(1, 2).is_none(), c.is_p2p(), "{c:?}");
            // The in-place side is the larger buffer.
            if let Some((side, _)) = c.in_place(1, 2) {
                let other = if side == Side::Send {
                    Side::Recv
                } else {
                    Side::Send
                };
                assert!(c.parts(side, 3) >= c.parts(other, 3), "{c:?}");
            }
            assert!(!(c.rooted() && c.is_p2p()));
            assert_eq!(c.root_only().is_some(), c.rooted(), "{c:?}");
        }
        // NCCL's layouts: all-gather's sendbuff at recvbuff + rank·count, and the reverse.
        assert_eq!(AllGather.in_place(2, 5), Some((Side::Recv, 10)));
        assert_eq!(ReduceScatter.in_place(2, 5), Some((Side::Send, 10)));
        assert_eq!(AllReduce.in_place(2, 5), Some((Side::Recv, 0)));
    }
}
