//! Scatter-reduce-allgather (CGX's all-reduce): every rank sends chunk j straight to its
//! owner j, the owner reduces all contributions in rank order, then all-gathers the result.
//! Two transfers per element whatever the world size, which is what keeps the error of a
//! lossy codec bounded later; and the owner's single reduction makes all ranks bit-identical.

use super::{part, split_parts, sub, AtOnce, Ctx, PieceIo};
use crate::reduce;
use crate::transport::{RecvReduce, RecvReq, SendReq};
use crate::Result;

/// SRA all-reduce of `count` elements; out-of-place when `send` is given.
pub fn all_reduce(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
) -> Result<()> {
    all_reduce_in_slices(ctx, send, buf, count, &AtOnce)
}

/// [`all_reduce`], its scatter-reduce step j started once `io` says slice j of every chunk
/// landed ([`super::chunk_slices`] with the SRA's slice) and its all-gather step j reported
/// done to it. Without the arena only: its rounds take the call whole (the caller checks).
pub fn all_reduce_in_slices(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
    io: &dyn PieceIo,
) -> Result<()> {
    let (n, r, es) = (ctx.size, ctx.rank, ctx.dtype.size());
    if n == 1 {
        if let Some(s) = send {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    // All ranks on one host: the arena replaces the pairwise frames.
    if super::arena::all_reduce(ctx, send, buf, count)? {
        return Ok(());
    }
    // Out of place, nothing is copied up front: contributions leave from `send`, the own
    // chunk's first reduction reads it (reduce3 / RecvReduce::with) and writes `buf`, and
    // the all-gather fills the rest of `buf` (an extra pass over the whole buffer cost ~30%
    // at 16–64 MiB on 4 ranks).
    let chunks: Vec<_> = (0..n).map(|c| part(count, n, c, es)).collect();
    let nsl = ctx.nslices(chunks[n - 1].len());
    let max_slice = sub(&chunks[n - 1], nsl, nsl - 1, es).len() + es;
    let mut land = std::mem::take(&mut ctx.scratch.main);
    let result = (|| {
        let space = land.get((n - 1) * max_slice);
        let peers: Vec<usize> = (1..n).map(|d| ctx.peer(d as isize)).collect();
        let mut by_rank = peers.clone();
        by_rank.sort_unstable();
        let mut direct = true;
        for &p in &peers {
            direct &= ctx.t.reduces_on_receive(p)?;
        }
        // Scatter-reduce: slice j of every chunk goes to the chunk's owner.
        for j in 0..nsl {
            io.landed(j)?;
            let mine = sub(&chunks[r], nsl, j, es);
            if direct {
                scatter_reduce_direct(ctx, send, buf, &chunks, &by_rank, nsl, j)?;
                reduce::finish(ctx.dtype, ctx.op, &mut buf[mine], n);
                continue;
            }
            // Contributions leave straight from the input (the send buffer, or buf in place).
            let input: &[u8] = send.unwrap_or(buf);
            let sends: Vec<SendReq<'_>> = peers
                .iter()
                .map(|&p| SendReq {
                    peer: p,
                    data: &input[sub(&chunks[p], nsl, j, es)],
                })
                .collect();
            let mut recvs: Vec<RecvReq<'_>> = peers
                .iter()
                .zip(space.chunks_mut(max_slice))
                .map(|(&p, l)| RecvReq::new(p, &mut l[..mine.len()]))
                .collect();
            ctx.exchange(&sends, &mut recvs)?;
            drop(sends);
            // A fixed order (own data, then peers by rank), independent of arrival order.
            let mut order: Vec<(usize, usize)> =
                peers.iter().enumerate().map(|(i, &p)| (p, i)).collect();
            order.sort_unstable();
            let landed = |i: usize| &space[i * max_slice..i * max_slice + mine.len()];
            reduce::fold(
                ctx.dtype,
                ctx.op,
                &mut buf[mine.clone()],
                send.map(|own| &own[mine.clone()]),
                order.iter().map(|&(_, i)| landed(i)),
            );
            reduce::finish(ctx.dtype, ctx.op, &mut buf[mine], n);
        }
        // All-gather: each owner sends its reduced chunk to everyone.
        let mut parts = split_parts(buf, &chunks);
        for j in 0..nsl {
            let own_range = sub(&(0..chunks[r].len()), nsl, j, es);
            let (before, rest) = parts.split_at_mut(r);
            let (own, after) = rest.split_first_mut().expect("own chunk");
            let own: &[u8] = &own[own_range];
            let sends: Vec<SendReq<'_>> = (0..n)
                .filter(|&p| p != r)
                .map(|p| SendReq { peer: p, data: own })
                .collect();
            let mut recvs: Vec<RecvReq<'_>> = before
                .iter_mut()
                .enumerate()
                .chain(after.iter_mut().enumerate().map(|(i, c)| (r + 1 + i, c)))
                .map(|(p, c)| {
                    let rg = sub(&(0..c.len()), nsl, j, es);
                    RecvReq::new(p, &mut c[rg])
                })
                .collect();
            ctx.exchange(&sends, &mut recvs)?;
            io.done(j);
        }
        Ok(())
    })();
    ctx.scratch.main = land;
    result
}

/// Slice `j` of the scatter-reduce when the transport reduces on receive: all contributions
/// leave at once, and the peers' slices are reduced straight out of the transport into this
/// rank's chunk one peer at a time, in rank order (the same arithmetic as the landing path:
/// own data, then peers by rank).
fn scatter_reduce_direct(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    chunks: &[std::ops::Range<usize>],
    by_rank: &[usize],
    nsl: usize,
    j: usize,
) -> Result<()> {
    let (r, es) = (ctx.rank, ctx.dtype.size());
    let (dtype, op) = (ctx.dtype, ctx.op);
    let slice = |c: usize| sub(&(0..chunks[c].len()), nsl, j, es);
    // Split the buffer so this rank's chunk is writable while the others are read.
    let mut parts = split_parts(buf, chunks);
    let own = parts.remove(r);
    let others: Vec<&[u8]> = parts.into_iter().map(|p| &*p).collect();
    let input_of = |p: usize| -> &[u8] {
        match send {
            Some(input) => &input[chunks[p].clone()][slice(p)],
            None => &others[if p < r { p } else { p - 1 }][slice(p)],
        }
    };
    let sends: Vec<SendReq<'_>> = by_rank
        .iter()
        .map(|&p| SendReq {
            peer: p,
            data: input_of(p),
        })
        .collect();
    let dst = &mut own[slice(r)];
    for (k, &p) in by_rank.iter().enumerate() {
        // The first contribution meets this rank's own data: from `send`, or already in place.
        let with = match send {
            Some(input) if k == 0 => Some(&input[chunks[r].clone()][slice(r)]),
            _ => None,
        };
        let s: &[SendReq<'_>] = if k == 0 { &sends } else { &[] };
        ctx.exchange(
            s,
            &mut [RecvReq::reducing(
                p,
                &mut *dst,
                RecvReduce { dtype, op, with },
            )],
        )?;
    }
    Ok(())
}
