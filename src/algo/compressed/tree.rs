//! Compressed binary tree: each rank adds its children's decoded partial sums to its own exact
//! data and sends its sum up encoded; the root encodes the total once and the encoding travels
//! down unchanged. log2(n) quantizations on the way up.

use super::{nslices, slice, Coder};
use crate::algo::wire::WireBuf;
use crate::algo::Ctx;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// Compressed tree all-reduce (sum) of `work`, in place.
pub fn all_reduce(ctx: &mut Ctx<'_>, cd: &mut Coder<'_>, work: &mut [f32]) -> Result<()> {
    let (n, r, count) = (ctx.size, ctx.rank, work.len());
    if n == 1 {
        return Ok(());
    }
    let (parent, kids) = crate::algo::tree::neighbours(r, n);
    let whole = 0..count;
    let nsl = nslices(ctx, count);
    let mut land: Vec<Vec<u8>> = vec![Vec::new(); 2];
    // Encoded (or forwarded) from registered memory: an RDMA link sends without a copy.
    let mut out = ctx.wire_buf();
    // Results the root encoded, one per slice, kept for the way down.
    let mut down: Vec<WireBuf> = (0..nsl).map(|_| ctx.wire_buf()).collect();
    for (j, result) in down.iter_mut().enumerate() {
        let sj = slice(&whole, nsl, j);
        if !kids.is_empty() {
            for l in land.iter_mut() {
                l.resize(cd.len(&sj), 0);
            }
            let mut recvs: Vec<RecvReq<'_>> = kids
                .iter()
                .zip(land.iter_mut())
                .map(|(&k, l)| RecvReq::new(k, l))
                .collect();
            ctx.exchange(&[], &mut recvs)?;
            for l in land.iter().take(kids.len()) {
                cd.decode(l, work, sj.clone(), true)?;
            }
        }
        match parent {
            Some(p) => {
                let len = cd.len(&sj);
                cd.encode(work, sj, out.fit(len))?;
                ctx.exchange(
                    &[SendReq {
                        peer: p,
                        data: out.bytes(),
                    }],
                    &mut [],
                )?;
            }
            None => {
                let len = cd.len(&sj);
                cd.encode_own(work, sj, result.fit(len))?
            }
        }
    }
    for (j, result) in down.iter_mut().enumerate() {
        let sj = slice(&whole, nsl, j);
        if let Some(p) = parent {
            let len = cd.len(&sj);
            ctx.exchange(&[], &mut [RecvReq::new(p, result.fit(len))])?;
            cd.decode(result.bytes(), work, sj, false)?;
        }
        let sends: Vec<SendReq<'_>> = kids
            .iter()
            .map(|&k| SendReq {
                peer: k,
                data: result.bytes(),
            })
            .collect();
        ctx.exchange(&sends, &mut [])?;
    }
    ctx.give_wire(down.into_iter().chain([out]));
    Ok(())
}
