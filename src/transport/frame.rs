//! The frame every transport carries: a 40-byte header, then the payload.
//!
//! Every data frame repeats the operation's descriptor (collective, dtype, op, root, count,
//! algorithm), so a rank that called a different collective, or the same one with other
//! arguments, is caught on the first frame it sends, and the error names it.

use crate::error::{Error, Result};

/// Bytes in an encoded header.
pub const HEADER_LEN: usize = 40;
const MAGIC: u32 = 0x5143_4346; // "QCCF"
/// The most an ABORT frame may carry (a reason string).
pub const MAX_ABORT_LEN: u64 = 4096;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Payload of a collective step.
    Data = 1,
    /// The sender failed; the payload is the reason, as UTF-8.
    Abort = 2,
}

/// Which collective a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum CollKind {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Reduce = 5,
    AllToAll = 6,
    Gather = 7,
    Scatter = 8,
    SendRecv = 9,
    Barrier = 10,
    Split = 11,
    /// Setting up a comm-wide resource (the shared-memory arena).
    Setup = 12,
}

impl CollKind {
    /// The collective's name as users call it.
    pub fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllGather => "all_gather",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllToAll => "all_to_all",
            CollKind::Gather => "gather",
            CollKind::Scatter => "scatter",
            CollKind::SendRecv => "send/recv",
            CollKind::Barrier => "barrier",
            CollKind::Split => "split",
            CollKind::Setup => "setup",
        }
    }

    fn from_u8(v: u8) -> Option<CollKind> {
        use CollKind::*;
        [
            AllReduce,
            ReduceScatter,
            AllGather,
            Broadcast,
            Reduce,
            AllToAll,
            Gather,
            Scatter,
            SendRecv,
            Barrier,
            Split,
            Setup,
        ]
        .into_iter()
        .find(|c| *c as u8 == v)
    }
}

/// What every rank must agree on for one collective call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDesc {
    /// The collective.
    pub coll: CollKind,
    /// NCCL dtype number.
    pub dtype: u8,
    /// NCCL op number (0 where the collective has none).
    pub op: u8,
    /// Algorithm number (0 where the collective has no choice).
    pub algo: u8,
    /// Root rank (0 where the collective has none).
    pub root: u32,
    /// Element count as NCCL defines it for this collective.
    pub count: u64,
}

impl OpDesc {
    /// The descriptor of a link's or the arena's setup, which belongs to no collective.
    pub fn setup() -> OpDesc {
        OpDesc {
            coll: CollKind::Setup,
            dtype: 0,
            op: 0,
            algo: 0,
            root: 0,
            count: 0,
        }
    }
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dtype = crate::types::DType::from_i32(self.dtype as i32)
            .map(|d| d.name())
            .unwrap_or("?");
        write!(
            f,
            "{}(count={}, dtype={dtype}",
            self.coll.name(),
            self.count
        )?;
        match self.coll {
            CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce => {
                let op = crate::types::ReduceOp::from_i32(self.op as i32)
                    .map(|o| o.name())
                    .unwrap_or("?");
                write!(f, ", op={op}")?;
            }
            _ => {}
        }
        if matches!(
            self.coll,
            CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
        ) {
            write!(f, ", root={}", self.root)?;
        }
        if self.root != 0
            && matches!(
                self.coll,
                CollKind::AllReduce | CollKind::ReduceScatter | CollKind::AllGather
            )
        {
            // Compressed calls carry their codec plan's fingerprint in the root field.
            write!(f, ", codec={:08x}", self.root)?;
        }
        if self.coll == CollKind::AllReduce {
            let algo = ["auto", "ring", "tree", "sra", "hier", "allgather"]
                .get(self.algo as usize)
                .unwrap_or(&"?");
            write!(f, ", algo={algo}")?;
        }
        f.write_str(")")
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Data or abort.
    pub kind: FrameKind,
    /// The sender's view of the operation.
    pub desc: OpDesc,
    /// Payload bytes that follow.
    pub len: u64,
}

impl Header {
    /// Serializes into the fixed 40-byte form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.desc.coll as u8;
        b[6] = self.desc.dtype;
        b[7] = self.desc.op;
        b[8] = self.desc.algo;
        b[12..16].copy_from_slice(&self.desc.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.desc.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// The header of an abort frame carrying a `len`-byte reason, and the rank the failure is
    /// about when known (the stalled or dead one: see `transport::stall`), in the root field
    /// as rank + 1 (0: none).
    pub fn abort(len: usize, culprit: Option<usize>) -> Header {
        Header {
            kind: FrameKind::Abort,
            desc: OpDesc {
                coll: CollKind::Barrier,
                dtype: 0,
                op: 0,
                algo: 0,
                root: culprit.map_or(0, |c| (c as u32).saturating_add(1)),
                count: 0,
            },
            len: len as u64,
        }
    }

    /// The rank an abort frame's failure is about, if it names one.
    pub fn culprit(&self) -> Option<usize> {
        (self.kind == FrameKind::Abort)
            .then(|| self.desc.root.checked_sub(1))
            .flatten()
            .map(|c| c as usize)
    }

    /// Parses a header; `peer` names the sender in the error.
    pub fn decode(b: &[u8; HEADER_LEN], peer: usize) -> Result<Header> {
        let bad = |what: &str| {
            Error::InvalidUsage(format!(
                "rank {peer} sent a malformed frame ({what}): a stranger, or a peer out of step"
            ))
        };
        if u32::from_le_bytes(b[0..4].try_into().unwrap()) != MAGIC {
            return Err(bad("bad magic"));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            _ => return Err(bad("unknown kind")),
        };
        let coll = CollKind::from_u8(b[5]).ok_or_else(|| bad("unknown collective"))?;
        let len = u64::from_le_bytes(b[24..32].try_into().unwrap());
        if kind == FrameKind::Abort && len > MAX_ABORT_LEN {
            return Err(bad("oversized abort reason"));
        }
        Ok(Header {
            kind,
            desc: OpDesc {
                coll,
                dtype: b[6],
                op: b[7],
                algo: b[8],
                root: u32::from_le_bytes(b[12..16].try_into().unwrap()),
                count: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            },
            len,
        })
    }

    /// Checks a received data header against what this rank expects from `peer`.
    pub fn check(&self, expect: &OpDesc, expect_len: usize, peer: usize, me: usize) -> Result<()> {
        if self.desc != *expect {
            return Err(Error::InvalidUsage(format!(
                "ranks disagree: rank {peer} called {} but rank {me} called {}",
                self.desc, expect
            )));
        }
        if self.len != expect_len as u64 {
            return Err(Error::InvalidUsage(format!(
                "rank {peer} sent {} bytes where rank {me} expected {expect_len} for {}",
                self.len, expect
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_frames_carry_their_culprit() {
        for culprit in [None, Some(0), Some(5), Some(70_000)] {
            let h = Header::abort(17, culprit);
            let back = Header::decode(&h.encode(), 1).unwrap();
            assert_eq!(back.culprit(), culprit);
            assert_eq!(back.len, 17);
        }
        let data = Header {
            kind: FrameKind::Data,
            ..Header::abort(0, Some(3))
        };
        assert_eq!(data.culprit(), None);
    }

    #[test]
    fn header_round_trip_and_mismatch() {
        let desc = OpDesc {
            coll: CollKind::AllReduce,
            dtype: 7,
            op: 0,
            algo: 1,
            root: 0,
            count: 1000003,
        };
        let h = Header {
            kind: FrameKind::Data,
            desc,
            len: 123,
        };
        let d = Header::decode(&h.encode(), 1).unwrap();
        assert_eq!(d, h);
        assert!(d.check(&desc, 123, 1, 0).is_ok());
        let other = OpDesc { count: 7, ..desc };
        let e = d.check(&other, 123, 1, 0).unwrap_err().to_string();
        assert!(e.contains("rank 1 called all_reduce(count=1000003"), "{e}");
        let mut junk = h.encode();
        junk[0] = 0;
        assert!(Header::decode(&junk, 3).is_err());
    }
}
