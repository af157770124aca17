//! Collectives that move data without reducing it, as one exchange with every peer at once:
//! gather, scatter, all-to-all, point-to-point, and the dissemination barrier.

use super::{part, split_parts, Ctx};
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// Gathers every rank's `send` (count elements) into root's `recv` (n·count, rank order).
pub fn gather(ctx: &mut Ctx<'_>, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> Result<()> {
    if ctx.rank != root {
        return ctx.exchange(
            &[SendReq {
                peer: root,
                data: send,
            }],
            &mut [],
        );
    }
    let out = recv.expect("root has a receive buffer");
    let n = ctx.size;
    let ranges: Vec<_> = (0..n).map(|p| part(out.len(), n, p, 1)).collect();
    let mut parts = split_parts(out, &ranges);
    parts[root].copy_from_slice(send);
    let mut recvs: Vec<RecvReq<'_>> = parts
        .into_iter()
        .enumerate()
        .filter(|(p, _)| *p != root)
        .map(|(peer, data)| RecvReq::new(peer, data))
        .collect();
    ctx.exchange(&[], &mut recvs)
}

/// Scatters root's `send` (n·count, rank order) so rank p gets part p in `recv`.
pub fn scatter(ctx: &mut Ctx<'_>, send: Option<&[u8]>, recv: &mut [u8], root: usize) -> Result<()> {
    if ctx.rank != root {
        return ctx.exchange(&[], &mut [RecvReq::new(root, recv)]);
    }
    let input = send.expect("root has a send buffer");
    let n = ctx.size;
    let range = |p| part(input.len(), n, p, 1);
    recv.copy_from_slice(&input[range(root)]);
    let sends: Vec<SendReq<'_>> = (0..n)
        .filter(|&p| p != root)
        .map(|p| SendReq {
            peer: p,
            data: &input[range(p)],
        })
        .collect();
    ctx.exchange(&sends, &mut [])
}

/// All-to-all: part p of `send` goes to rank p, part q of `recv` comes from rank q.
pub fn all_to_all(ctx: &mut Ctx<'_>, send: &[u8], recv: &mut [u8]) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let ranges: Vec<_> = (0..n).map(|p| part(send.len(), n, p, 1)).collect();
    let mut parts = split_parts(recv, &ranges);
    parts[r].copy_from_slice(&send[ranges[r].clone()]);
    let sends: Vec<SendReq<'_>> = (0..n)
        .filter(|&p| p != r)
        .map(|p| SendReq {
            peer: p,
            data: &send[ranges[p].clone()],
        })
        .collect();
    let mut recvs: Vec<RecvReq<'_>> = parts
        .into_iter()
        .enumerate()
        .filter(|(p, _)| *p != r)
        .map(|(peer, data)| RecvReq::new(peer, data))
        .collect();
    ctx.exchange(&sends, &mut recvs)
}

/// Dissemination barrier: ⌈log2 n⌉ rounds of empty frames; no rank leaves before all arrived.
pub fn barrier(ctx: &mut Ctx<'_>) -> Result<()> {
    let mut k = 1;
    while k < ctx.size {
        let (to, from) = (ctx.peer(k as isize), ctx.peer(-(k as isize)));
        ctx.exchange(
            &[SendReq {
                peer: to,
                data: &[],
            }],
            &mut [RecvReq::new(from, &mut [])],
        )?;
        k *= 2;
    }
    Ok(())
}
