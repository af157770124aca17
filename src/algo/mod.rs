//! Algorithms: schedules of exchange steps over byte buffers, written once for any transport.
//!
//! Each large transfer is cut into slices of about QCCL_BUFFSIZE bytes so that the transport
//! moves slice j+1 (into socket buffers) while this rank reduces slice j.

pub mod allgather;
pub mod arena;
pub mod chain;
pub mod compressed;
pub mod direct;
mod kind;
pub mod ring;
pub mod sra;
pub mod tree;
pub mod wire;

pub use kind::Algo;

use crate::transport::frame::OpDesc;
use crate::transport::{LateSend, RecvReq, SendReq, SendSource, Transport};
use crate::types::{DType, ReduceOp};
use crate::Result;
use std::ops::Range;

/// Scratch memory owned by a comm, reused across calls, 8-byte aligned so typed kernels see
/// aligned data.
#[derive(Default)]
pub struct Scratch {
    /// Used inside the algorithms (taken out for the duration of one).
    pub main: Buf,
    /// Decoded chunks of the compressed schedules (lent to their `Coder`).
    pub decoded: Vec<f32>,
    /// The packed buffer of a fusion plan's multi-tensor groups (`plan::FusedAllReduce`),
    /// kept across calls: a fresh buffer of tens of MB would be page-faulted in every time.
    pub fused: Vec<f32>,
    /// Registered buffers the compressed schedules encode into and send from (`wire.rs`).
    pub wire: Vec<wire::WireBuf>,
}

/// One growable, 8-byte aligned byte buffer.
#[derive(Default)]
pub struct Buf {
    words: Vec<u64>,
}

impl Buf {
    /// At least `bytes` bytes of scratch (contents unspecified).
    pub fn get(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        &mut bytemuck::cast_slice_mut(&mut self.words[..])[..bytes]
    }
}

/// Everything an algorithm needs: the transport, who we are, and how to reduce.
pub struct Ctx<'a> {
    /// The comm's transport.
    pub t: &'a mut Transport,
    /// This rank.
    pub rank: usize,
    /// Ranks in the comm.
    pub size: usize,
    /// Slice size in bytes (QCCL_BUFFSIZE).
    pub slice: usize,
    /// Reusable scratch.
    pub scratch: &'a mut Scratch,
    /// What every frame of this operation carries.
    pub desc: OpDesc,
    /// Element type.
    pub dtype: DType,
    /// Reduction (Sum where the collective has none).
    pub op: ReduceOp,
    /// The comm's byte counters, advanced by every exchange.
    pub wire: &'a mut Wire,
}

/// Payload bytes a rank moved (frame headers excluded): the comm's counters, and what one
/// call reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wire {
    /// Bytes sent.
    pub sent: u64,
    /// Bytes received.
    pub received: u64,
}

impl std::ops::AddAssign for Wire {
    fn add_assign(&mut self, o: Wire) {
        self.sent += o.sent;
        self.received += o.received;
    }
}

impl std::ops::Sub for Wire {
    type Output = Wire;
    fn sub(self, o: Wire) -> Wire {
        Wire {
            sent: self.sent - o.sent,
            received: self.received - o.received,
        }
    }
}

impl Ctx<'_> {
    /// One exchange under this operation's descriptor.
    pub fn exchange(&mut self, sends: &[SendReq<'_>], recvs: &mut [RecvReq<'_>]) -> Result<()> {
        self.wire.sent += sends.iter().map(|s| s.data.len() as u64).sum::<u64>();
        self.wire.received += recvs.iter().map(|r| r.data.len() as u64).sum::<u64>();
        self.t.exchange(&self.desc, sends, recvs)
    }

    /// One exchange whose `late` sends start as `source` hands their bytes over (bytes a
    /// device is still writing when it begins).
    pub fn exchange_late<'a>(
        &mut self,
        sends: &[SendReq<'a>],
        late: &[LateSend],
        source: &mut dyn SendSource<'a>,
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        let late_bytes = late.iter().map(|l| l.len as u64).sum::<u64>();
        self.wire.sent += sends.iter().map(|s| s.data.len() as u64).sum::<u64>() + late_bytes;
        self.wire.received += recvs.iter().map(|r| r.data.len() as u64).sum::<u64>();
        self.t.exchange_late(&self.desc, sends, late, source, recvs)
    }

    /// A registered wire buffer from the comm's scratch; `give_wire` returns it.
    pub fn wire_buf(&mut self) -> wire::WireBuf {
        self.scratch
            .wire
            .pop()
            .unwrap_or_else(|| wire::WireBuf::new(self.t.registry()))
    }

    /// Returns wire buffers to the comm's scratch, keeping their registrations.
    pub fn give_wire(&mut self, bufs: impl IntoIterator<Item = wire::WireBuf>) {
        self.scratch.wire.extend(bufs);
    }

    /// Number of slices that a transfer of `bytes` bytes is cut into (at least 1).
    pub fn nslices(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.slice.max(1)).max(1)
    }

    /// (rank + delta) mod size, for any signed delta.
    pub fn peer(&self, delta: isize) -> usize {
        (self.rank as isize + delta).rem_euclid(self.size as isize) as usize
    }
}

/// Byte range of part `i` when `count` elements of `es` bytes are split in `parts` near-equal
/// parts (the first ones are never longer than the last: part i is [i·c/p, (i+1)·c/p)).
pub fn part(count: usize, parts: usize, i: usize, es: usize) -> Range<usize> {
    let a = (count as u128 * i as u128 / parts as u128) as usize;
    let b = (count as u128 * (i + 1) as u128 / parts as u128) as usize;
    a * es..b * es
}

/// What an algorithm run on a staged copy of its buffer waits for before each of its
/// pieces (or slices) and reports after it (`comm/bands.rs`: the copies in and out of a
/// call on device buffers staged piece by piece).
pub trait PieceIo {
    /// Returns once piece `i`'s input is in the buffer.
    fn landed(&self, i: usize) -> Result<()>;
    /// Piece `i`'s result is in the buffer (pieces end in order).
    fn done(&self, i: usize);
}

/// A buffer that is all there from the start.
pub struct AtOnce;

impl PieceIo for AtOnce {
    fn landed(&self, _: usize) -> Result<()> {
        Ok(())
    }
    fn done(&self, _: usize) {}
}

/// Sub-range `j` of `nsl` of the byte range `r`, on element boundaries.
pub fn sub(r: &Range<usize>, nsl: usize, j: usize, es: usize) -> Range<usize> {
    let elems = (r.end - r.start) / es;
    let s = part(elems, nsl, j, es);
    r.start + s.start..r.start + s.end
}

/// The byte ranges slice j of an all-reduce of `count` elements of `es` bytes on `n` ranks
/// in chunks of `slice`-byte slices reads and writes (slice j of every rank's chunk, the
/// longest chunk cut as `Ctx::nslices` cuts it), by j: what the SRA's and the ring's
/// `all_reduce_in_slices` wait for before their first step on slice j and report after
/// their last.
pub fn chunk_slices(count: usize, n: usize, es: usize, slice: usize) -> Vec<Vec<Range<usize>>> {
    let chunks: Vec<_> = (0..n).map(|c| part(count, n, c, es)).collect();
    let nsl = chunks[n - 1].len().div_ceil(slice.max(1)).max(1);
    (0..nsl)
        .map(|j| chunks.iter().map(|c| sub(c, nsl, j, es)).collect())
        .collect()
}

/// Borrows `a` immutably and `b` mutably from one buffer; the ranges must not overlap.
pub fn split_ref_mut(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        assert!(b.end <= a.start, "overlapping ranges {a:?} and {b:?}");
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// Splits `buf` at the given ascending, contiguous ranges covering it.
pub fn split_parts<'b, T>(mut buf: &'b mut [T], ranges: &[Range<usize>]) -> Vec<&'b mut [T]> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut at = 0;
    for r in ranges {
        debug_assert_eq!(r.start, at);
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(r.end - r.start);
        out.push(head);
        buf = tail;
        at = r.end;
    }
    out
}
