//! Ring reduce-scatter and all-gather, and all-reduce as their composition: bandwidth-optimal,
//! each rank sends 2(n−1)/n of the buffer. The chunk of rank r is reduced once, by rank r,
//! and then copied around the ring, so every rank ends with the same bits.

use super::{part, split_ref_mut, sub, AtOnce, Ctx, PieceIo};
use crate::reduce;
use crate::transport::{RecvReduce, RecvReq, SendReq};
use crate::Result;

/// Where a reduce-scatter reads its contributions and writes this rank's result.
pub enum Io<'a> {
    /// Read `input` (all n chunks); write the result to `out` (chunk `rank`'s size).
    OutOfPlace {
        /// This rank's contribution, all n chunks.
        input: &'a [u8],
        /// This rank's result.
        out: &'a mut [u8],
    },
    /// Read `buf` (all n chunks); the result replaces chunk `rank` of `buf`.
    InPlace(&'a mut [u8]),
}

impl Io<'_> {
    fn input(&self) -> &[u8] {
        match self {
            Io::OutOfPlace { input, .. } => input,
            Io::InPlace(buf) => buf,
        }
    }
}

/// Reduces `count` elements (split in n near-equal chunks) across ranks and leaves chunk
/// `rank`'s reduction where `io` says. Avg is finished here.
pub fn reduce_scatter(ctx: &mut Ctx<'_>, io: Io<'_>, count: usize) -> Result<()> {
    reduce_scatter_in_slices(ctx, io, count, &AtOnce, false)
}

/// [`reduce_scatter`], its first step's slice j started once `pieces` says slice j of every
/// chunk landed ([`super::chunk_slices`] with the ring's slice; later steps read the same
/// slices); with `ends_here`, every slice reported done at the end (the result, this rank's
/// chunk, is a 1/n of the input: it is not worth releasing slice by slice).
pub fn reduce_scatter_in_slices(
    ctx: &mut Ctx<'_>,
    mut io: Io<'_>,
    count: usize,
    pieces: &dyn PieceIo,
    ends_here: bool,
) -> Result<()> {
    let (n, r, es) = (ctx.size, ctx.rank, ctx.dtype.size());
    let chunk = |c: usize| part(count, n, c, es);
    if n == 1 {
        if let Io::OutOfPlace { input, out } = io {
            out.copy_from_slice(input);
        }
        return Ok(());
    }
    let max_chunk = chunk(n - 1).len();
    let nsl = ctx.nslices(max_chunk);
    let max_slice = sub(&(0..max_chunk), nsl, nsl - 1, es).len() + es;
    // Two accumulators (the one being sent, the one being filled) and one landing slice.
    let mut scratch = std::mem::take(&mut ctx.scratch.main);
    let space = scratch.get(2 * max_chunk + max_slice);
    let (w0, rest) = space.split_at_mut(max_chunk);
    let (w1, land) = rest.split_at_mut(max_chunk);
    let mut work = [w0, w1];
    let result = (|| {
        let direct = ctx.t.reduces_on_receive(ctx.peer(-1))?;
        for s in 0..n - 1 {
            let a = ctx.peer(-(s as isize) - 1);
            let b = ctx.peer(-(s as isize) - 2);
            let (ra, rb) = (chunk(a), chunk(b));
            let (w_prev, w_cur) = {
                let [x, y] = &mut work;
                if s % 2 == 0 {
                    (&**y, &mut **x)
                } else {
                    (&**x, &mut **y)
                }
            };
            for j in 0..nsl {
                if s == 0 {
                    pieces.landed(j)?;
                }
                let sa = sub(&ra, nsl, j, es);
                let sb = sub(&rb, nsl, j, es);
                let local = sb.start - rb.start..sb.end - rb.start;
                let last = s == n - 2;
                let (next, prev) = (ctx.peer(1), ctx.peer(-1));
                let reduce_with = |with| RecvReduce {
                    dtype: ctx.dtype,
                    op: ctx.op,
                    with,
                };
                if direct {
                    // The transport reduces the incoming slice straight into its destination.
                    let prev_part = &w_prev[sa.start - ra.start..sa.end - ra.start];
                    // Per case: what leaves, where the incoming slice is reduced, and with what.
                    let (src, dst, with): (&[u8], &mut [u8], Option<&[u8]>) = match &mut io {
                        Io::InPlace(buf) if last && s == 0 => {
                            let (src, dst) = split_ref_mut(buf, sa, sb);
                            (src, dst, None)
                        }
                        Io::InPlace(buf) if last => (prev_part, &mut buf[sb], None),
                        Io::OutOfPlace { input, out } if last => {
                            let src = if s == 0 { &input[sa] } else { prev_part };
                            (src, &mut out[local], Some(&input[sb]))
                        }
                        Io::OutOfPlace { input, .. } => {
                            let src = if s == 0 { &input[sa] } else { prev_part };
                            (src, &mut w_cur[local], Some(&input[sb]))
                        }
                        Io::InPlace(buf) => {
                            let src = if s == 0 { &buf[sa] } else { prev_part };
                            (src, &mut w_cur[local], Some(&buf[sb]))
                        }
                    };
                    ctx.exchange(
                        &[SendReq {
                            peer: next,
                            data: src,
                        }],
                        &mut [RecvReq::reducing(prev, dst, reduce_with(with))],
                    )?;
                    continue;
                }
                let src: &[u8] = if s == 0 {
                    &io.input()[sa.clone()]
                } else {
                    &w_prev[sa.start - ra.start..sa.end - ra.start]
                };
                let landing = &mut land[..sb.len()];
                ctx.exchange(
                    &[SendReq {
                        peer: next,
                        data: src,
                    }],
                    &mut [RecvReq::new(prev, landing)],
                )?;
                let got = &land[..sb.len()];
                match &mut io {
                    _ if !last => {
                        reduce::reduce3(ctx.dtype, ctx.op, &mut w_cur[local], &io.input()[sb], got)
                    }
                    // Last step: this chunk is rank r's, complete once `got` is added.
                    Io::OutOfPlace { input, out } => {
                        reduce::reduce3(ctx.dtype, ctx.op, &mut out[local], &input[sb], got)
                    }
                    Io::InPlace(buf) => reduce::reduce_into(ctx.dtype, ctx.op, &mut buf[sb], got),
                }
            }
        }
        Ok(())
    })();
    ctx.scratch.main = scratch;
    result?;
    let mine = match io {
        Io::OutOfPlace { out, .. } => out,
        Io::InPlace(buf) => &mut buf[chunk(r)],
    };
    reduce::finish(ctx.dtype, ctx.op, mine, n);
    if ends_here {
        (0..nsl).for_each(|j| pieces.done(j));
    }
    Ok(())
}

/// In place on `buf` (n near-equal chunks of `count` elements in all): every rank's chunk
/// `rank` is copied to every other rank.
pub fn all_gather(ctx: &mut Ctx<'_>, buf: &mut [u8], count: usize) -> Result<()> {
    all_gather_in_slices(ctx, buf, count, &AtOnce)
}

/// [`all_gather`], its first step's slice j started once `pieces` says slice j of this
/// rank's chunk landed (it may have been said before) and slice j of every chunk reported
/// done after its last step ([`super::chunk_slices`] with the ring's slice).
pub fn all_gather_in_slices(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    count: usize,
    pieces: &dyn PieceIo,
) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    if n == 1 {
        return Ok(());
    }
    let chunk = |c: usize| part(count, n, c, es);
    let nsl = ctx.nslices(chunk(n - 1).len());
    for s in 0..n - 1 {
        let ra = chunk(ctx.peer(-(s as isize)));
        let rb = chunk(ctx.peer(-(s as isize) - 1));
        for j in 0..nsl {
            if s == 0 {
                pieces.landed(j)?;
            }
            let (src, dst) = split_ref_mut(buf, sub(&ra, nsl, j, es), sub(&rb, nsl, j, es));
            ctx.exchange(
                &[SendReq {
                    peer: ctx.peer(1),
                    data: src,
                }],
                &mut [RecvReq::new(ctx.peer(-1), dst)],
            )?;
            if s == n - 2 {
                pieces.done(j);
            }
        }
    }
    Ok(())
}

/// Ring all-reduce of `count` elements: out-of-place from `send` into `buf`, or in place on
/// `buf` when `send` is None.
pub fn all_reduce(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
) -> Result<()> {
    all_reduce_in_slices(ctx, send, buf, count, &AtOnce)
}

/// [`all_reduce`], its reduce-scatter's slice j started once `pieces` says slice j of every
/// chunk landed ([`super::chunk_slices`] with the ring's slice) and reported done after its
/// all-gather's last step. More than one rank (one rank reports nothing).
pub fn all_reduce_in_slices(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
    pieces: &dyn PieceIo,
) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    let io = match send {
        Some(input) => Io::OutOfPlace {
            input,
            out: &mut buf[part(count, n, ctx.rank, es)],
        },
        None => Io::InPlace(buf),
    };
    reduce_scatter_in_slices(ctx, io, count, pieces, false)?;
    all_gather_in_slices(ctx, buf, count, pieces)
}
