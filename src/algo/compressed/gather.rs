//! The all-gather scheme ("naive all-gather" of HiTopKComm's paper): every rank encodes its
//! whole buffer once, all encodings are exchanged, and every rank adds all of them, decoded, in
//! rank order. The scheme sparse codecs need, since sums of (index, value) lists are not sparse.

use super::Coder;
use crate::algo::Ctx;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

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
