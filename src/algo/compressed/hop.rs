//! The side the compressed ring and tree run over ([`HopSide`]): exchanges that send one
//! encoding to some ranks and receive from others, encodings forwarded unchanged. As SRA's
//! `Side`, the schedules are written once over it: the host's side ([`HostHops`]) encodes
//! with the CPU codecs into registered buffers, the device's (`gpu::sra`) runs the codecs'
//! kernels over device memory, so host and device ranks of one job end bit-identical.

use super::Coder;
use crate::algo::wire::WireBuf;
use crate::algo::Ctx;
use crate::error::{Error, Result};
use crate::transport::{RecvReq, SendReq};
use std::ops::Range;

/// What one exchange sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outgoing {
    /// The bytes an encode wrote into send buffer `slot` of `set` (`HopSide::encode_to`).
    Encoded {
        /// The set of send buffers (below `sra::SETS`).
        set: usize,
        /// The send buffer in the set (a rank: the one it goes to, or this rank's own).
        slot: usize,
    },
    /// The bytes the previous exchange received (from one rank), forwarded unchanged.
    Forward,
    /// The encoding `HopSide::keep_total` kept as total `j`.
    Kept(usize),
    /// Nothing: the exchange only receives.
    Nothing,
}

/// One rank's data and codec in the compressed ring or tree. Element ranges are positions in
/// the call's buffer, whose work buffer holds the input plus the residual before the schedule
/// starts. As `sra::Side`, methods may only enqueue work (a device), as long as `pass` sends
/// what it names and `take` reads the bytes of the latest `pass`.
pub trait HopSide<X: ?Sized> {
    /// Bytes of the encoding of elements `r`.
    fn len(&self, r: &Range<usize>) -> usize;
    /// Encodes elements `r` of the work buffer into send buffer `slot` of `set`, recording the
    /// loss for error feedback.
    fn encode_to(&mut self, set: usize, slot: usize, r: Range<usize>) -> Result<()>;
    /// As `encode_to`, for a sum this rank finished: elements `r` of the work buffer then take
    /// their decoded value, so this rank holds what every receiver will.
    fn encode_own_to(&mut self, set: usize, slot: usize, r: Range<usize>) -> Result<()>;
    /// One exchange: `what` sent to each rank of `to`, `land` bytes received from each of
    /// `from`.
    fn pass(
        &mut self,
        x: &mut X,
        what: Outgoing,
        to: &[usize],
        from: &[usize],
        land: usize,
    ) -> Result<()>;
    /// Decodes the bytes received from `from` in the latest exchange (the encoding of
    /// elements `r`) into the work buffer, or adds them to it when `add`.
    fn take(&mut self, from: usize, r: Range<usize>, add: bool) -> Result<()>;
    /// As `encode_own_to`, the encoding kept as total `j` until an exchange sends it
    /// (`Outgoing::Kept`); false (nothing done) for a side that keeps no totals and encodes
    /// them as it sends them (the device's two sets of slots hold no more). The bytes are
    /// the same either way: the tree's root encodes a slice it no longer changes, and the
    /// draws are keyed by position.
    fn keep_total(&mut self, _j: usize, _r: Range<usize>) -> Result<bool> {
        Ok(false)
    }
}

/// The host's side: the CPU codecs over an f32 work buffer. One encode is sent before the
/// next is made, so one send buffer serves every set.
pub struct HostHops<'a, 'c> {
    cd: &'a mut Coder<'c>,
    work: &'a mut [f32],
    out: WireBuf,
    /// What the latest exchange received, by rank.
    landed: Vec<(usize, WireBuf)>,
    /// Buffers free to receive into.
    spare: Vec<WireBuf>,
    /// Totals kept for a later exchange (`keep_total`), by index.
    kept: Vec<WireBuf>,
}

impl<'a, 'c> HostHops<'a, 'c> {
    /// The side of `work`, its buffers from `ctx`'s scratch (`give_back` returns them).
    pub fn new(ctx: &mut Ctx<'_>, cd: &'a mut Coder<'c>, work: &'a mut [f32]) -> Self {
        HostHops {
            cd,
            work,
            out: ctx.wire_buf(),
            landed: Vec::new(),
            spare: Vec::new(),
            kept: Vec::new(),
        }
    }

    /// Room to keep `n` totals (`HopSide::keep_total`), from `ctx`'s scratch.
    pub fn keep_room(&mut self, ctx: &mut Ctx<'_>, n: usize) {
        self.kept.extend((0..n).map(|_| ctx.wire_buf()));
    }

    /// Hands the buffers back to the comm's scratch, keeping their registrations.
    pub fn give_back(self, ctx: &mut Ctx<'_>) {
        let landed = self.landed.into_iter().map(|(_, b)| b);
        let bufs = std::iter::once(self.out).chain(landed).chain(self.spare);
        ctx.give_wire(bufs.chain(self.kept));
    }
}

impl<'c> HopSide<Ctx<'c>> for HostHops<'_, '_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.cd.len(r)
    }

    fn encode_to(&mut self, _set: usize, _slot: usize, r: Range<usize>) -> Result<()> {
        let len = self.cd.len(&r);
        self.cd.encode(self.work, r, self.out.fit(len))
    }

    fn encode_own_to(&mut self, _set: usize, _slot: usize, r: Range<usize>) -> Result<()> {
        let len = self.cd.len(&r);
        self.cd.encode_own(self.work, r, self.out.fit(len))
    }

    fn pass(
        &mut self,
        ctx: &mut Ctx<'c>,
        what: Outgoing,
        to: &[usize],
        from: &[usize],
        land: usize,
    ) -> Result<()> {
        // Registered (an RDMA link receives and forwards them without a copy).
        let mut fresh: Vec<WireBuf> = from
            .iter()
            .map(|_| self.spare.pop().unwrap_or_else(|| ctx.wire_buf()))
            .collect();
        let data = match (what, self.landed.as_slice()) {
            (Outgoing::Encoded { .. }, _) => self.out.bytes(),
            (Outgoing::Kept(j), _) => match self.kept.get(j) {
                Some(b) => b.bytes(),
                None => return Err(Error::Internal(format!("no total {j} kept"))),
            },
            (Outgoing::Nothing, _) => &[],
            (Outgoing::Forward, [(_, b)]) => b.bytes(),
            (Outgoing::Forward, l) => {
                return Err(Error::Internal(format!(
                    "a forward after an exchange that received from {} ranks",
                    l.len()
                )))
            }
        };
        let sends: Vec<SendReq<'_>> = to.iter().map(|&peer| SendReq { peer, data }).collect();
        let mut recvs: Vec<RecvReq<'_>> = from
            .iter()
            .zip(fresh.iter_mut())
            .map(|(&p, b)| RecvReq::new(p, b.fit(land)))
            .collect();
        let done = ctx.exchange(&sends, &mut recvs);
        drop((sends, recvs));
        let old = std::mem::replace(&mut self.landed, from.iter().copied().zip(fresh).collect());
        self.spare.extend(old.into_iter().map(|(_, b)| b));
        done
    }

    fn take(&mut self, from: usize, r: Range<usize>, add: bool) -> Result<()> {
        let Some((_, b)) = self.landed.iter().find(|(p, _)| *p == from) else {
            return Err(Error::Internal(format!(
                "no bytes from rank {from} in the latest exchange"
            )));
        };
        self.cd.decode(b.bytes(), self.work, r, add)
    }

    fn keep_total(&mut self, j: usize, r: Range<usize>) -> Result<bool> {
        let len = self.cd.len(&r);
        let Some(b) = self.kept.get_mut(j) else {
            // No room made for it (`keep_room`): encoded when sent.
            return Ok(false);
        };
        self.cd.encode_own(self.work, r, b.fit(len))?;
        Ok(true)
    }
}
