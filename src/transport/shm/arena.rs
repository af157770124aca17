//! A comm-wide shared-memory arena, for comms whose ranks all share one host: every rank maps
//! every rank's segment, so an owner reduces its peers' contributions straight out of their
//! segments and every rank copies each owner's result straight out of the owner's segment
//! (CGX's shared-memory SRA; Open MPI's coll/sm). Per element that is one copy in, one
//! reduction and one copy out, and two synchronisation points per round, where the ring over
//! pairwise links has 2(n−1) dependent hand-offs, each a copy in and a copy out.
//!
//! The segment of rank p holds a header (counters, bell, abort flag, slot descriptors) and
//! `SLOTS` round slots; slot k holds p's contribution to every owner q (n areas of `chunk`
//! bytes; the area for q = p stays unused) and, as an owner, p's result. Three counters per
//! rank count rounds, monotonically over the comm's life:
//!   staged[p]  rounds whose contributions p wrote,
//!   reduced[p] rounds whose result p (as owner) wrote,
//!   copied[p]  rounds whose results p copied out.
//! Round s uses slot s % SLOTS. p may stage round s once every owner reduced round s − SLOTS
//! (nobody reads that slot any more); an owner may write its result of round s once every
//! rank copied round s − SLOTS. The closures of [`Arena::try_stage`], [`Arena::try_reduce`]
//! and [`Arena::try_copy`] only see memory inside those windows, which is what makes handing
//! out slices of shared memory sound.
//!
//! Sleeping: one bell (a futex word in rank 0's segment) for the whole comm; every counter
//! update rings it, and wakes sleepers only when someone announced sleeping.

use super::futex;
use super::segment::{self, Segment};
use crate::error::{Error, Result};
use crate::transport::frame::{FrameKind, Header, OpDesc, HEADER_LEN};
use crate::transport::stall::Stalled;
use crate::transport::wait::{Next, Waiter};
use crate::transport::{LinkConfig, RecvReq, SendReq};
use std::sync::atomic::Ordering;

/// Round slots per rank: how far ranks may run ahead of each other.
pub const SLOTS: usize = 4;
/// Bytes per owner per round: the least a large collective uses, and the most unless
/// [`default_chunk`] says otherwise.
pub const CHUNK: usize = 128 << 10;
/// The most bytes per owner per round on 2 ranks.
const CHUNK_2_RANKS: usize = 512 << 10;

/// Largest bytes per owner per round for `n` ranks when QCCL_SHM_ARENA_CHUNK is not set.
/// Measured on 2 ranks (2-core VM, interleaved runs): 512 KiB rounds take 64 MiB in 10–13 ms
/// against 13–14 and 256 MiB in 42–56 against 50–65; on 4 ranks they lose (64 MiB 40–54 ms
/// against 28–38: the ranks' 4 segments, 10 MiB each, outgrow the 32 MiB L3).
pub fn default_chunk(n: usize) -> usize {
    if n == 2 {
        CHUNK_2_RANKS
    } else {
        CHUNK
    }
}
/// Bytes per owner per round of an arena of `n` ranks, `requested` by QCCL_SHM_ARENA_CHUNK
/// or by default: what `setup` makes, known before it runs.
pub fn chunk_for(requested: Option<usize>, n: usize) -> usize {
    // Every rank maps every segment: bound each, so that many ranks on one host do not
    // exhaust /dev/shm (128 KiB per owner up to 31 ranks, less beyond).
    requested
        .unwrap_or_else(|| default_chunk(n))
        .min(MAX_SEGMENT / (SLOTS * (n + 1)) / 4096 * 4096)
        .max(4096)
}

/// Largest segment a rank creates (round slots only; the header comes on top).
const MAX_SEGMENT: usize = 16 << 20;

const HEADER: usize = 4096;
const MAGIC: u64 = 0x5143_434c_4152_4e41; // "QCCLARNA"
const OFF_MAGIC: usize = 0;
const OFF_GEOMETRY: usize = 8; // n, slots, chunk as u64
const OFF_STAGED: usize = 64;
const OFF_REDUCED: usize = 128;
const OFF_COPIED: usize = 192;
const OFF_BELL: usize = 256;
const OFF_SLEEPERS: usize = 320;
const OFF_ABORTED: usize = 384;
/// The rank an abort is about, + 1 (0: none), written with the reason.
const OFF_CULPRIT: usize = 448;
/// Why this rank aborted: a u32 length, then that many bytes of UTF-8 (written once, before
/// the flag).
const OFF_REASON: usize = 2048;
const MAX_REASON: usize = 1024;
/// Slot k's descriptor (the frame header of the call, and the round) at OFF_SLOTS + 64·k.
const OFF_SLOTS: usize = 512;
const NAME_LEN: usize = 96;

/// The arena as one rank sees it: all ranks' segments, mapped.
pub struct Arena {
    /// What keeps the segments registered with another party (the CUDA driver's page-locked
    /// registration, `gpu::arena`): declared first, so dropped before the segments unmap.
    held: Option<Box<dyn Send>>,
    me: usize,
    n: usize,
    chunk: usize,
    segs: Vec<Segment>,
    pids: Vec<i32>,
    addrs: Vec<String>,
    cfg: LinkConfig,
}

/// Segment bytes for `n` ranks and `chunk` bytes per owner per round.
fn segment_len(n: usize, chunk: usize) -> usize {
    HEADER + SLOTS * (n + 1) * chunk
}

/// Sets the arena up: every rank of the comm calls this at the same point. `exchange` moves
/// frames to and from peers (the pairwise links); `pids[p]` and `addrs[p]` identify peer p.
pub fn setup(
    cfg: &LinkConfig,
    comm_id: u64,
    pids: Vec<i32>,
    addrs: Vec<String>,
    mut exchange: impl FnMut(&[SendReq<'_>], &mut [RecvReq<'_>]) -> Result<()>,
) -> Result<Arena> {
    let (me, n) = (cfg.rank, cfg.size);
    let chunk = chunk_for(cfg.arena_chunk, n);
    let len = segment_len(n, chunk);
    let name = segment::new_name(comm_id, &format!("a{me}"));
    let own = Segment::create(&name, len)?;
    for (i, v) in [n, SLOTS, chunk].into_iter().enumerate() {
        own.word64(OFF_GEOMETRY + 8 * i)
            .store(v as u64, Ordering::Relaxed);
    }
    own.word64(OFF_MAGIC).store(MAGIC, Ordering::Release);
    let result = (|| {
        let mut mine = [0u8; NAME_LEN];
        mine[..name.len()].copy_from_slice(name.as_bytes());
        let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        let mut names = vec![[0u8; NAME_LEN]; n];
        {
            let sends: Vec<SendReq<'_>> = peers
                .iter()
                .map(|&p| SendReq {
                    peer: p,
                    data: &mine,
                })
                .collect();
            let mut recvs: Vec<RecvReq<'_>> = names
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != me)
                .map(|(p, b)| RecvReq::new(p, b))
                .collect();
            exchange(&sends, &mut recvs)?;
        }
        let mut segs = Vec::with_capacity(n);
        let mut own = Some(own);
        for (p, raw) in names.iter().enumerate() {
            if p == me {
                segs.push(own.take().expect("own segment"));
                continue;
            }
            let end = raw.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
            let peer_name = std::str::from_utf8(&raw[..end])
                .ok()
                .and_then(segment::checked_name)
                .ok_or_else(|| {
                    Error::InvalidUsage(format!("rank {p} sent a malformed arena segment name"))
                })?;
            let seg = Segment::open(peer_name, len)?;
            let geometry: Vec<u64> = (0..3)
                .map(|i| seg.word64(OFF_GEOMETRY + 8 * i).load(Ordering::Relaxed))
                .collect();
            if seg.word64(OFF_MAGIC).load(Ordering::Acquire) != MAGIC
                || geometry != [n as u64, SLOTS as u64, chunk as u64]
            {
                return Err(Error::InvalidUsage(format!(
                    "rank {p}'s arena segment has another geometry ({geometry:?}, this rank \
                     [{n}, {SLOTS}, {chunk}]): do all ranks run the same qccl with the same \
                     settings?"
                )));
            }
            segs.push(seg);
        }
        // Everyone mapped everything: the names can go.
        let sends: Vec<SendReq<'_>> = peers
            .iter()
            .map(|&p| SendReq { peer: p, data: &[] })
            .collect();
        let mut recvs: Vec<RecvReq<'_>> = peers.iter().map(|&p| RecvReq::new(p, &mut [])).collect();
        exchange(&sends, &mut recvs)?;
        Ok(segs)
    })();
    Segment::unlink(&name);
    Ok(Arena {
        held: None,
        me,
        n,
        chunk,
        segs: result?,
        pids,
        addrs,
        cfg: cfg.clone(),
    })
}

impl Arena {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.me
    }

    /// Ranks in the comm.
    pub fn size(&self) -> usize {
        self.n
    }

    /// Bytes per owner per round.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// The next round this rank will stage.
    pub fn next_round(&self) -> u64 {
        self.counter(self.me, OFF_STAGED)
    }

    /// The first round of a collective of `rounds` rounds. A one-round collective starts on
    /// an even round, skipping one when needed (every rank makes the same calls, so all skip
    /// the same round, which nobody stages, reduces or copies: this rank publishes it as done
    /// in its three counters, which only ever let waiters on it go on sooner). Small calls
    /// then alternate between two slots instead of cycling through all four: half the
    /// memory stays warm in the caches, and a new size finds two cold slots, not four (4
    /// ranks, 64 KiB: the first 4 calls at a new size took 2-6x the steady time). Two slots
    /// still let a rank that finished call k stage call k + 1 at once: that needs the round
    /// two back reduced, which call k's end implies.
    pub fn begin(&self, rounds: usize) -> u64 {
        let base = self.next_round();
        if rounds != 1 || base.is_multiple_of(2) {
            return base;
        }
        // No bell: nothing waits for a skipped round alone, and this rank's stage of the next
        // one, which rings, follows at once (the round two back is reduced: call k is over).
        for off in [OFF_STAGED, OFF_REDUCED, OFF_COPIED] {
            self.segs[self.me]
                .word64(off)
                .store(base + 1, Ordering::Release);
        }
        base + 1
    }

    fn counter(&self, p: usize, off: usize) -> u64 {
        self.segs[p].word64(off).load(Ordering::Acquire)
    }

    fn publish(&self, off: usize, value: u64) {
        self.segs[self.me]
            .word64(off)
            .store(value, Ordering::Release);
        let bell = self.segs[0].word32(OFF_BELL);
        bell.fetch_add(1, Ordering::SeqCst);
        if self.segs[0].word32(OFF_SLEEPERS).load(Ordering::SeqCst) != 0 {
            futex::wake(bell);
        }
    }

    /// Offset of slot `round % SLOTS`'s area `area` (an owner's contribution, or `n` for the
    /// result).
    fn area(&self, round: u64, area: usize) -> usize {
        HEADER + ((round as usize % SLOTS) * (self.n + 1) + area) * self.chunk
    }

    /// True when every rank in `ranks`'s counter at `off` reached `at_least`.
    fn all_reached(
        &self,
        off: usize,
        at_least: u64,
        mut ranks: impl Iterator<Item = usize>,
    ) -> bool {
        ranks.all(|p| self.counter(p, off) >= at_least)
    }

    fn others(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.n).filter(move |&p| p != self.me)
    }

    /// Stages round `round` (the next one, see [`Arena::next_round`]) when its slot is free:
    /// `fill(owner, area)` writes this rank's contribution for each other owner into `area`
    /// (`chunk` bytes; only a prefix need be used). Returns false when the slot is not free yet.
    pub fn try_stage(
        &mut self,
        desc: &OpDesc,
        round: u64,
        fill: impl FnMut(usize, &mut [u8]),
    ) -> bool {
        self.stage(desc, round, self.others(), fill)
    }

    /// Stages round `round` of a one-shot all-reduce when its slot is free: `fill(area)`
    /// writes this rank's whole input into its own area (the one SRA leaves unused; `chunk`
    /// bytes), which every peer reads in [`Arena::try_gather`]. False when not free yet.
    pub fn try_stage_whole(
        &mut self,
        desc: &OpDesc,
        round: u64,
        fill: impl FnOnce(&mut [u8]),
    ) -> bool {
        let mut fill = Some(fill);
        self.stage(desc, round, std::iter::once(self.me), |_, area| {
            if let Some(f) = fill.take() {
                f(area)
            }
        })
    }

    /// Claims round `round`'s slot for a stage whose bytes land later (copies from a GPU):
    /// once the slot is free, `fill(area index, area)` gets every area of it, this rank's
    /// own included (its own contribution, read back by [`Arena::try_reduce_own`]), the
    /// descriptor is written, and nothing is published until [`Arena::staged`]. Rounds are
    /// claimed in order, ahead of those published; this rank must have reduced round
    /// `round − SLOTS` (its own area is reused). False when the slot is not free yet.
    pub fn try_claim(
        &mut self,
        desc: &OpDesc,
        round: u64,
        fill: impl FnMut(usize, &mut [u8]),
    ) -> bool {
        let freed = (round + 1).saturating_sub(SLOTS as u64);
        if self.counter(self.me, OFF_REDUCED) < freed {
            return false;
        }
        self.write_stage(desc, round, 0..self.n, fill)
    }

    /// Publishes round `round` (claimed with [`Arena::try_claim`], its bytes landed) as
    /// staged; rounds are published in order.
    pub fn staged(&mut self, round: u64) {
        debug_assert_eq!(round, self.next_round(), "rounds are staged in order");
        self.publish(OFF_STAGED, round + 1);
    }

    /// Writes `areas` of round `round`'s slot with `fill(area index, area)` once every peer
    /// is done with the slot, then the descriptor, and publishes staged. (The callers hold
    /// the arena mutably: one stage at a time hands out the areas.)
    fn stage(
        &self,
        desc: &OpDesc,
        round: u64,
        areas: impl Iterator<Item = usize>,
        fill: impl FnMut(usize, &mut [u8]),
    ) -> bool {
        debug_assert_eq!(round, self.next_round(), "rounds are staged in order");
        if !self.write_stage(desc, round, areas, fill) {
            return false;
        }
        self.publish(OFF_STAGED, round + 1);
        true
    }

    /// What `stage` does before publishing: false when a peer still uses the slot.
    fn write_stage(
        &self,
        desc: &OpDesc,
        round: u64,
        areas: impl Iterator<Item = usize>,
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> bool {
        debug_assert!(
            round >= self.next_round(),
            "round {round} was staged already"
        );
        let freed = (round + 1).saturating_sub(SLOTS as u64);
        if !self.all_reached(OFF_REDUCED, freed, self.others()) {
            return false;
        }
        let seg = &self.segs[self.me];
        let head = Header {
            kind: FrameKind::Data,
            desc: *desc,
            len: round,
        }
        .encode();
        // SAFETY (protocol): slot round % SLOTS of this segment is read by the peers only
        // between staged ≥ round + 1 and their reduced ≥ round + 1 (owners in try_reduce,
        // everyone in try_gather); every peer reduced round − SLOTS, the last use of this
        // slot, and this rank has not published round yet. Each area is borrowed alone, one
        // after the other.
        unsafe { seg.bytes_mut(OFF_SLOTS + 64 * (round as usize % SLOTS), HEADER_LEN) }
            .copy_from_slice(&head);
        for q in areas {
            // SAFETY: as above.
            fill(q, unsafe { seg.bytes_mut(self.area(round, q), self.chunk) });
        }
        true
    }

    /// Reduces round `round` as owner when every peer staged it and every rank copied the
    /// result this slot held before: `reduce(contributions, result)` gets the peers'
    /// contributions to this rank in rank order (`chunk` bytes each) and this rank's result
    /// area. Ok(false) when not ready; an error when a peer staged another collective.
    pub fn try_reduce(
        &mut self,
        desc: &OpDesc,
        round: u64,
        reduce: impl FnOnce(&[&[u8]], &mut [u8]),
    ) -> Result<bool> {
        self.reduce_round(desc, round, reduce)
    }

    /// `try_reduce`'s body.
    fn reduce_round(
        &self,
        desc: &OpDesc,
        round: u64,
        reduce: impl FnOnce(&[&[u8]], &mut [u8]),
    ) -> Result<bool> {
        let freed = (round + 1).saturating_sub(SLOTS as u64);
        if !self.all_reached(OFF_STAGED, round + 1, self.others())
            || !self.all_reached(OFF_COPIED, freed, 0..self.n)
        {
            return Ok(false);
        }
        self.check_staged(desc, round)?;
        // SAFETY (protocol): the peers' areas for this owner are stable between their
        // staged ≥ round + 1 and this rank's reduced ≥ round + 1; this rank's result area is
        // unread by anyone (every rank copied round − SLOTS) until reduced ≥ round + 1 is
        // published, after `reduce` returned and the slices are gone.
        let srcs: Vec<&[u8]> = self
            .others()
            .map(|q| unsafe { self.segs[q].bytes(self.area(round, self.me), self.chunk) })
            .collect();
        // SAFETY: as above.
        let result = unsafe { self.segs[self.me].bytes_mut(self.area(round, self.n), self.chunk) };
        reduce(&srcs, result);
        self.publish(OFF_REDUCED, round + 1);
        Ok(true)
    }

    /// As [`Arena::try_reduce`] for a rank that staged its own contribution too
    /// ([`Arena::try_claim`]): `reduce(own, contributions, result)`, once this rank published
    /// round `round` staged as well.
    pub fn try_reduce_own(
        &mut self,
        desc: &OpDesc,
        round: u64,
        reduce: impl FnOnce(&[u8], &[&[u8]], &mut [u8]),
    ) -> Result<bool> {
        if self.counter(self.me, OFF_STAGED) < round + 1 {
            return Ok(false);
        }
        // SAFETY (protocol): this rank's own area of the slot is read by nobody else in
        // these rounds and rewritten only by this rank's claim of round + SLOTS, which waits
        // for this rank's reduced ≥ round + 1, published after `reduce` returned.
        let own = unsafe { self.segs[self.me].bytes(self.area(round, self.me), self.chunk) };
        self.reduce_round(desc, round, |srcs, result| reduce(own, srcs, result))
    }

    /// One-shot round `round`, once every peer staged it: `take(inputs)` gets every rank's
    /// whole input in rank order (this rank's own staged copy included; `chunk` bytes each).
    /// Then this rank has read the slot and holds no result to copy: it publishes reduced and
    /// copied together. Ok(false) when not ready; an error when a peer staged another call.
    pub fn try_gather(
        &mut self,
        desc: &OpDesc,
        round: u64,
        take: impl FnOnce(&[&[u8]]),
    ) -> Result<bool> {
        if !self.all_reached(OFF_STAGED, round + 1, self.others()) {
            return Ok(false);
        }
        self.check_staged(desc, round)?;
        // SAFETY (protocol): rank q's own area of this slot is written only in q's stage of
        // this round and, SLOTS rounds later, once every peer (this rank too) published
        // reduced ≥ round + 1, which this rank does below, after `take` returned. This rank's
        // own area it wrote itself before publishing staged.
        let inputs: Vec<&[u8]> = (0..self.n)
            .map(|q| unsafe { self.segs[q].bytes(self.area(round, q), self.chunk) })
            .collect();
        take(&inputs);
        let seg = &self.segs[self.me];
        seg.word64(OFF_REDUCED).store(round + 1, Ordering::Release);
        self.publish(OFF_COPIED, round + 1);
        Ok(true)
    }

    /// Checks that every peer staged round `round` of the call `desc` (their descriptors,
    /// written before their staged counter, which the caller saw reach round + 1).
    fn check_staged(&self, desc: &OpDesc, round: u64) -> Result<()> {
        let want = Header {
            kind: FrameKind::Data,
            desc: *desc,
            len: round,
        };
        for q in self.others() {
            // SAFETY (protocol): q wrote the descriptor before publishing staged ≥ round + 1
            // (the caller's Acquire load saw it) and rewrites it only after this rank
            // publishes reduced ≥ round + 1.
            let raw: [u8; HEADER_LEN] = unsafe {
                self.segs[q].bytes(OFF_SLOTS + 64 * (round as usize % SLOTS), HEADER_LEN)
            }
            .try_into()
            .expect("header length");
            let got = Header::decode(&raw, q)?;
            got.check(desc, round as usize, q, self.me).map_err(|e| {
                if got.desc == *desc {
                    Error::Internal(format!(
                        "rank {q} staged round {} where rank {} expected {round}: the arena's \
                         ranks are out of step",
                        got.len, self.me
                    ))
                } else {
                    e
                }
            })?;
            debug_assert_eq!(got, want);
        }
        Ok(())
    }

    /// Copies owner `peer`'s result of round `round` out with `take(result)` (`chunk` bytes)
    /// once it is there. False when not yet.
    pub fn try_copy(&self, peer: usize, round: u64, take: impl FnOnce(&[u8])) -> bool {
        if self.counter(peer, OFF_REDUCED) < round + 1 {
            return false;
        }
        debug_assert!(self.counter(self.me, OFF_COPIED) <= round);
        // SAFETY (protocol): the owner rewrites this area only after every rank's copied passes
        // round, and this rank publishes that only in `copied`, after `take` returned.
        take(unsafe { self.segs[peer].bytes(self.area(round, self.n), self.chunk) });
        true
    }

    /// Tells the owners that this rank copied every result of round `round`.
    pub fn copied(&mut self, round: u64) {
        self.publish(OFF_COPIED, round + 1);
    }

    /// The bell's current value: read before a pass over the try_* calls, and given to
    /// [`Arena::idle`] when that pass moved nothing, so no ring in between is missed.
    pub fn bell(&self) -> u32 {
        self.segs[0].word32(OFF_BELL).load(Ordering::SeqCst)
    }

    /// Called when a pass moved nothing: spins, yields or sleeps on the bell (see `Waiter`);
    /// fails on a timeout, an abort, or a peer that died or aborted. The peers waited on are
    /// the ones furthest behind; `what` describes this rank's state in `desc`.
    pub fn idle(
        &self,
        waiter: &mut Waiter,
        seen: u32,
        desc: &OpDesc,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        self.check_peers()?;
        let stalled = |full: bool| {
            let behind = self.behind();
            if !full {
                return Stalled::on(*desc, behind);
            }
            let counts: Vec<String> = behind
                .iter()
                .map(|&p| {
                    format!(
                        "rank {p} staged {}, reduced {}, copied {}",
                        self.counter(p, OFF_STAGED),
                        self.counter(p, OFF_REDUCED),
                        self.counter(p, OFF_COPIED)
                    )
                })
                .collect();
            Stalled {
                desc: *desc,
                what: format!("{}; furthest behind: {}", what(), counts.join("; ")),
                peers: behind,
            }
        };
        if let Next::Block(d) = waiter.idle(&self.cfg, stalled)? {
            let sleepers = self.segs[0].word32(OFF_SLEEPERS);
            sleepers.fetch_add(1, Ordering::SeqCst);
            futex::wait(self.segs[0].word32(OFF_BELL), seen, d);
            sleepers.fetch_sub(1, Ordering::SeqCst);
            for p in self.others() {
                // A peer that published its last step and then exited is not a failure:
                // when the bell rang since `seen`, the caller looks again first (the exit
                // came after the ring, so the next pass sees everything it published).
                if !super::alive(self.pids[p]) && self.bell() == seen {
                    self.blame(Some(p));
                    return Err(self.remote(
                        p,
                        format!(
                            "its process (pid {}) is gone: killed or exited",
                            self.pids[p]
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The peers furthest behind: fewest rounds staged, reduced and copied together. A rank
    /// that stopped is among them (the others advance as far as they can without it).
    fn behind(&self) -> Vec<usize> {
        let progress = |p: usize| {
            self.counter(p, OFF_STAGED) + self.counter(p, OFF_REDUCED) + self.counter(p, OFF_COPIED)
        };
        let least = self.others().map(progress).min().unwrap_or(0);
        self.others().filter(|&p| progress(p) == least).collect()
    }

    fn blame(&self, culprit: Option<usize>) {
        if let (Some(i), Some(c)) = (&self.cfg.inspector, culprit) {
            i.blame(c);
        }
    }

    fn check_peers(&self) -> Result<()> {
        for p in self.others() {
            if self.segs[p].word32(OFF_ABORTED).load(Ordering::Acquire) != 0 {
                let len = (self.segs[p].word32(OFF_REASON).load(Ordering::Relaxed) as usize)
                    .min(MAX_REASON);
                // SAFETY (protocol): p wrote the reason once, before its Release store of the
                // flag that the Acquire load above saw, and never writes it again.
                let reason = unsafe { self.segs[p].bytes(OFF_REASON + 4, len) };
                let reason = String::from_utf8_lossy(reason);
                let culprit = self.segs[p].word32(OFF_CULPRIT).load(Ordering::Relaxed);
                self.blame((culprit as usize).checked_sub(1));
                return Err(self.remote(p, format!("{}{reason}", crate::transport::PEER_ABORTED)));
            }
        }
        Ok(())
    }

    fn remote(&self, p: usize, msg: String) -> Error {
        Error::Remote {
            rank: p,
            addr: self.addrs[p].clone(),
            msg,
        }
    }

    /// Tells the peers waiting in the arena that this rank failed, why, and about which rank
    /// when known.
    pub fn abort(&self, reason: &str, culprit: Option<usize>) {
        let seg = &self.segs[self.me];
        if seg.word32(OFF_ABORTED).load(Ordering::Relaxed) != 0 {
            return;
        }
        let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON)];
        // SAFETY (protocol): peers read the reason only after seeing the flag, which is set
        // below and only once (checked above; abort runs on the comm's one transport owner).
        unsafe { seg.bytes_mut(OFF_REASON + 4, reason.len()) }.copy_from_slice(reason);
        seg.word32(OFF_REASON)
            .store(reason.len() as u32, Ordering::Relaxed);
        seg.word32(OFF_CULPRIT)
            .store(culprit.map_or(0, |c| c as u32 + 1), Ordering::Relaxed);
        seg.word32(OFF_ABORTED).store(1, Ordering::Release);
        let bell = self.segs[0].word32(OFF_BELL);
        bell.fetch_add(1, Ordering::SeqCst);
        futex::wake(bell);
    }

    /// Every rank's mapped segment, (first byte, bytes), in rank order: what a driver
    /// registers so that copies between a GPU and the areas go straight in (`gpu::arena`).
    pub fn segments(&self) -> Vec<(*mut u8, usize)> {
        self.segs.iter().map(|s| (s.ptr(0), s.len())).collect()
    }

    /// Keeps `what` (a registration of [`Arena::segments`]) until the arena is dropped,
    /// released before the segments unmap.
    pub fn hold(&mut self, what: Box<dyn Send>) {
        self.held = Some(what);
    }

    /// True once something is held ([`Arena::hold`]).
    pub fn holds(&self) -> bool {
        self.held.is_some()
    }

    /// The link settings (timeout, spin) the arena's waits honour.
    pub fn link_config(&self) -> &LinkConfig {
        &self.cfg
    }
}
