//! Compressed scatter-reduce-allgather (CGX): each rank encodes chunk j once and sends it to its
//! owner j; the owner adds the decoded contributions to its own exact data in rank order,
//! encodes the sum once, keeps the decoded copy and all-gathers the encoding. Two quantizations
//! per element whatever the world size, so the error does not grow with the ring length.

use super::{chunk, nslices, slice, Coder};
use crate::algo::wire::WireBuf;
use crate::algo::Ctx;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// Compressed SRA all-reduce (sum) of `work`: in place, or out of place from `input` (read
/// where it is encoded; only this rank's own chunk is copied into `work`).
pub fn all_reduce(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    input: Option<&[f32]>,
    work: &mut [f32],
) -> Result<()> {
    scatter_reduce(ctx, cd, input, work, true)
}

/// Compressed reduce-scatter (sum): afterwards chunk `rank` of `work` (`chunk(count, n, rank)`)
/// holds the exact sum of its own data and every peer's decoded contribution. Out of place
/// (`input`), the other chunks of `work` are not touched.
pub fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    input: Option<&[f32]>,
    work: &mut [f32],
) -> Result<()> {
    scatter_reduce(ctx, cd, input, work, false)
}

fn scatter_reduce(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    input: Option<&[f32]>,
    work: &mut [f32],
    gather: bool,
) -> Result<()> {
    let (n, r, count) = (ctx.size, ctx.rank, work.len());
    if n == 1 {
        if let Some(i) = input {
            work.copy_from_slice(i);
        }
        return Ok(());
    }
    let chunks: Vec<_> = (0..n).map(|c| chunk(count, n, c)).collect();
    let nsl = nslices(ctx, chunks[n - 1].len());
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    // Encoded into registered memory: an RDMA link sends them without a copy.
    let mut out: Vec<WireBuf> = (0..n).map(|_| ctx.wire_buf()).collect();
    let mut land: Vec<Vec<u8>> = vec![Vec::new(); n];
    let mut result = ctx.wire_buf();
    for j in 0..nsl {
        let s = |c: usize| slice(&chunks[c], nsl, j);
        // Scatter: every peer's slice, encoded once, to its owner.
        for &p in &peers {
            let len = cd.len(&s(p));
            cd.encode(input.unwrap_or(work), s(p), out[p].fit(len))?;
            land[p].resize(cd.len(&s(r)), 0);
        }
        swap(ctx, &peers, |p| out[p].bytes(), &mut land)?;
        // Own data exact, then the peers in rank order: the same arithmetic on every run.
        if let Some(i) = input {
            work[s(r)].copy_from_slice(&i[s(r)]);
        }
        for &p in &peers {
            cd.decode(&land[p], work, s(r), true)?;
        }
        if !gather {
            continue;
        }
        // All-gather: the owner's sum, encoded once, to everyone.
        let len = cd.len(&s(r));
        cd.encode_own(work, s(r), result.fit(len))?;
        for &p in &peers {
            land[p].resize(cd.len(&s(p)), 0);
        }
        swap(ctx, &peers, |_| result.bytes(), &mut land)?;
        for &p in &peers {
            cd.decode(&land[p], work, s(p), false)?;
        }
    }
    ctx.give_wire(out.into_iter().chain([result]));
    Ok(())
}

/// One exchange with every peer: `send(p)` goes to peer p while `land[p]` (sized by the
/// caller) receives from it.
fn swap<'a>(
    ctx: &mut Ctx<'_>,
    peers: &[usize],
    send: impl Fn(usize) -> &'a [u8],
    land: &mut [Vec<u8>],
) -> Result<()> {
    let sends: Vec<SendReq<'_>> = peers
        .iter()
        .map(|&p| SendReq {
            peer: p,
            data: send(p),
        })
        .collect();
    let r = ctx.rank;
    let mut recvs: Vec<RecvReq<'_>> = land
        .iter_mut()
        .enumerate()
        .filter(|(p, _)| *p != r)
        .map(|(p, l)| RecvReq::new(p, l))
        .collect();
    ctx.exchange(&sends, &mut recvs)
}
