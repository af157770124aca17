//! Compressed ring: reduce-scatter where every hop decodes, adds and re-encodes (n−1
//! quantizations of a chunk, so the error grows with the world size: SRA's reason to exist),
//! then an all-gather that forwards the owner's encoding unchanged.

use super::{chunk, nslices, slice, Coder};
use crate::algo::Ctx;
use crate::transport::{RecvReq, SendReq};
use crate::Result;
use std::ops::Range;

/// Compressed ring all-reduce (sum) of `work`, in place.
pub fn all_reduce(ctx: &mut Ctx<'_>, cd: &mut Coder<'_>, work: &mut [f32]) -> Result<()> {
    let (n, r, count) = (ctx.size, ctx.rank, work.len());
    if n == 1 {
        return Ok(());
    }
    let chunks: Vec<_> = (0..n).map(|c| chunk(count, n, c)).collect();
    let nsl = nslices(ctx, chunks[n - 1].len());
    let (next, prev) = (ctx.peer(1), ctx.peer(-1));
    // Encoded into registered memory: an RDMA link sends it without a copy.
    let mut out = ctx.wire_buf();
    let mut land = Vec::new();
    for step in 0..n - 1 {
        let send_c = (r + n - step) % n;
        let recv_c = (r + 2 * n - step - 1) % n;
        for j in 0..nsl {
            let (ss, rs) = (
                slice(&chunks[send_c], nsl, j),
                slice(&chunks[recv_c], nsl, j),
            );
            let len = cd.len(&ss);
            cd.encode(work, ss, out.fit(len))?;
            land.resize(cd.len(&rs), 0);
            ctx.exchange(
                &[SendReq {
                    peer: next,
                    data: out.bytes(),
                }],
                &mut [RecvReq::new(prev, &mut land)],
            )?;
            cd.decode(&land, work, rs, true)?;
        }
    }
    ctx.give_wire([out]);
    // Rank r finished chunk r+1.
    all_gather(ctx, cd, work, &chunks, |q| (q + 1) % n)
}

/// Ring all-gather of encoded chunks: rank q's finished chunk is `owned(q)`; it encodes it
/// once (keeping the decoded copy) and every other rank decodes and forwards those bytes.
pub fn all_gather(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    work: &mut [f32],
    chunks: &[Range<usize>],
    owned: impl Fn(usize) -> usize,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    if n == 1 {
        return Ok(());
    }
    let nsl = nslices(ctx, chunks.iter().map(|c| c.len()).max().unwrap_or(0));
    let (next, prev) = (ctx.peer(1), ctx.peer(-1));
    // Both registered: what lands is forwarded as it is.
    let (mut cur, mut land) = (ctx.wire_buf(), ctx.wire_buf());
    for j in 0..nsl {
        let own = slice(&chunks[owned(r)], nsl, j);
        cd.encode_own(work, own.clone(), cur.fit(cd.len(&own)))?;
        for step in 0..n - 1 {
            let from = (r + 2 * n - step - 1) % n;
            let rs = slice(&chunks[owned(from)], nsl, j);
            ctx.exchange(
                &[SendReq {
                    peer: next,
                    data: cur.bytes(),
                }],
                &mut [RecvReq::new(prev, land.fit(cd.len(&rs)))],
            )?;
            cd.decode(land.bytes(), work, rs, false)?;
            std::mem::swap(&mut cur, &mut land);
        }
    }
    ctx.give_wire([cur, land]);
    Ok(())
}
