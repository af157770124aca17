//! The all-gather scheme ("naive all-gather" of HiTopKComm's paper): every rank encodes its
//! whole buffer once, all encodings are exchanged, and every rank adds all of them, decoded, in
//! rank order. The scheme sparse codecs need, since sums of (index, value) lists are not sparse.
//!
//! `all_reduce` is the host's; `run` is the same schedule over the SRA's [`Side`] with the two
//! steps it lacks ([`GatherSide`]), for the device (`gpu::sra`): the same encode, zeroed work
//! and additions in rank order, so host and device ranks end bit-identical.

use super::sra::{Phase, Shape, Side};
use super::Coder;
use crate::algo::Ctx;
use crate::transport::{RecvReq, SendReq};
use crate::Result;
use std::ops::Range;

/// A [`Side`] that can also run the all-gather scheme.
pub trait GatherSide<X: ?Sized>: Side<X> {
    /// Sets elements `r` of the work buffer to +0.0.
    fn zero(&mut self, r: Range<usize>) -> Result<()>;
    /// Adds the decoded bytes this rank encoded into its own slot of `set` (the encoding of
    /// elements `r`) to the work buffer.
    fn add_own(&mut self, set: usize, r: Range<usize>) -> Result<()>;
}

/// The schedule of [`all_reduce`] over `count` elements for `shape.n` > 1 ranks, its one
/// exchange on `x`: the input encoded (error feedback recorded) into this rank's own slot,
/// sent to every peer, then the work zeroed and every rank's encoding added in rank order.
pub fn run<X: ?Sized>(
    x: &mut X,
    shape: Shape,
    side: &mut dyn GatherSide<X>,
    count: usize,
) -> Result<()> {
    let (n, r) = (shape.n, shape.rank);
    let whole = 0..count;
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    side.encode_for(0, r, whole.clone())?;
    let len = side.len(&whole);
    side.swap(x, 0, &peers, Phase::Gather, &|_| len)?;
    side.zero(whole.clone())?;
    for p in 0..n {
        if p == r {
            side.add_own(0, whole.clone())?;
        } else {
            side.add_from(p, whole.clone())?;
        }
    }
    Ok(())
}

/// All-gather all-reduce (sum) of `work`, in place.
pub fn all_reduce(ctx: &mut Ctx<'_>, cd: &mut Coder<'_>, work: &mut [f32]) -> Result<()> {
    let (n, r, count) = (ctx.size, ctx.rank, work.len());
    if n == 1 || count == 0 {
        return Ok(());
    }
    let whole = 0..count;
    let len = cd.len(&whole);
    let mut all = vec![0u8; n * len];
    // Encoded into registered memory: an RDMA link sends it without a copy.
    let mut own = ctx.wire_buf();
    cd.encode(work, whole.clone(), own.fit(len))?;
    {
        let (before, rest) = all.split_at_mut(r * len);
        let (_, after) = rest.split_at_mut(len);
        let sends: Vec<SendReq<'_>> = (0..n)
            .filter(|&p| p != r)
            .map(|p| SendReq {
                peer: p,
                data: own.bytes(),
            })
            .collect();
        let mut recvs: Vec<RecvReq<'_>> = before
            .chunks_mut(len)
            .enumerate()
            .chain(
                after
                    .chunks_mut(len)
                    .enumerate()
                    .map(|(i, c)| (r + 1 + i, c)),
            )
            .map(|(p, c)| RecvReq::new(p, c))
            .collect();
        ctx.exchange(&sends, &mut recvs)?;
    }
    all[r * len..(r + 1) * len].copy_from_slice(own.bytes());
    ctx.give_wire([own]);
    work.fill(0.0);
    for p in 0..n {
        cd.decode(&all[p * len..(p + 1) * len], work, whole.clone(), true)?;
    }
    Ok(())
}
