//! The one progress engine: an exchange is a set of frame sends and receives over any mix of
//! links (`link.rs`), progressed together so a ring never deadlocks, with the comm's wait
//! policy (`wait.rs`), its stall diagnosis and the lost-peer and abort-frame handling.
//!
//! The hot path is `exchange`'s loop: per pending job and round one call on its link (a
//! dynamic call per round, never per byte); the state of each frame lives here, in `Tx`/`Rx`,
//! built once per exchange.

use super::frame::{FrameKind, Header, OpDesc, HEADER_LEN};
use super::link::{Dir, Link, Wait};
use super::stall::Stalled;
use super::wait::{Next, Waiter};
use super::{LateSend, LinkConfig, RecvReduce, RecvReq, SendReq, SendSource};
use crate::error::{Error, Result};
use nix::poll::{poll, PollFd, PollFlags};
use std::io::{self, ErrorKind};
use std::time::Duration;

/// A comm's links by peer rank (None: not opened yet, or this rank).
pub type Links = [Option<Box<dyn Link>>];

/// Byte ranges of a `len`-byte payload split evenly over `k` streams.
pub fn tile(len: usize, k: usize) -> impl Iterator<Item = (usize, usize)> {
    // In u128: `len` may come from a peer's frame header (any u64), and len * k must not
    // overflow.
    let at = move |i: usize| (len as u128 * i as u128 / k as u128) as usize;
    (0..k).map(move |i| (at(i), at(i + 1)))
}

/// Padding comes from here: `Link::pad` is below 8.
const ZEROS: [u8; 8] = [0; 8];

/// One stream's share of a frame being sent.
struct Tx<'a> {
    peer: usize,
    stream: usize,
    head: Option<[u8; HEADER_LEN]>,
    data: &'a [u8],
    pad: usize,
    pos: usize,
}

impl Tx<'_> {
    fn total(&self) -> usize {
        self.head.map_or(0, |_| HEADER_LEN) + self.data.len() + self.pad
    }
    fn done(&self) -> bool {
        self.pos == self.total()
    }
    /// What is left to send: header, payload, padding.
    fn rest(&self) -> [&[u8]; 3] {
        let hl = self.head.map_or(0, |_| HEADER_LEN);
        let dl = self.data.len();
        let head: &[u8] = match &self.head {
            Some(h) if self.pos < hl => &h[self.pos..],
            _ => &[],
        };
        let data = &self.data[self.pos.saturating_sub(hl).min(dl)..];
        let pad = &ZEROS[self.pos.saturating_sub(hl + dl)..self.pad];
        [head, data, pad]
    }
}

/// One stream's share of a frame being received.
struct Rx<'a> {
    peer: usize,
    stream: usize,
    head: Option<([u8; HEADER_LEN], usize)>,
    data: &'a mut [u8],
    pos: usize,
    full_len: usize,
    reduce: Option<RecvReduce<'a>>,
    pad: usize,
    padded: usize,
}

impl Rx<'_> {
    fn done(&self) -> bool {
        self.head.is_none_or(|(_, n)| n == HEADER_LEN)
            && self.pos == self.data.len()
            && self.padded == self.pad
    }
}

fn link(links: &mut Links, peer: usize) -> Result<&mut Box<dyn Link>> {
    links[peer]
        .as_mut()
        .ok_or_else(|| Error::Internal(format!("no connection to rank {peer}")))
}

fn closed(links: &Links, peer: usize, what: String) -> Error {
    let addr = links[peer].as_ref().map(|l| l.addr()).unwrap_or_default();
    Error::Remote {
        rank: peer,
        addr,
        msg: what,
    }
}

/// "Nothing now": try again later.
fn would_block(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

/// A count of bytes moved from shared memory, where 0 means "nothing yet", not end of file.
fn nonzero(n: usize) -> io::Result<usize> {
    match n {
        0 => Err(ErrorKind::WouldBlock.into()),
        n => Ok(n),
    }
}

/// Runs one exchange to completion (or error). The links must already be open.
pub fn exchange(
    links: &mut Links,
    cfg: &LinkConfig,
    desc: &OpDesc,
    sends: &[SendReq<'_>],
    recvs: &mut [RecvReq<'_>],
) -> Result<()> {
    exchange_late(links, cfg, desc, sends, &[], &mut NoLateSends, recvs)
}

/// `exchange` with `late` sends too: each starts once `source` hands its bytes over, while the
/// rest of the exchange progresses.
pub fn exchange_late<'a>(
    links: &mut Links,
    cfg: &LinkConfig,
    desc: &OpDesc,
    sends: &[SendReq<'a>],
    late: &[LateSend],
    source: &mut dyn SendSource<'a>,
    recvs: &mut [RecvReq<'_>],
) -> Result<()> {
    let res = run(links, cfg, desc, sends, late, source, recvs);
    if res.is_err() {
        // The caller gets its buffers back: no link may read a send's memory any more.
        for p in sends
            .iter()
            .map(|s| s.peer)
            .chain(late.iter().map(|l| l.peer))
        {
            if let Some(Some(l)) = links.get_mut(p) {
                l.release();
            }
        }
    }
    res
}

/// The source of an exchange without late sends.
struct NoLateSends;

impl<'a> SendSource<'a> for NoLateSends {
    fn ready(&mut self, peer: usize) -> Result<Option<&'a [u8]>> {
        Err(Error::Internal(format!("no late send to rank {peer}")))
    }

    fn wait(&mut self, _: usize, _: Duration) {}
}

/// Longest block while a late send's bytes are awaited along with links: neither wakes the
/// other's sleep.
const LATE_POLL: Duration = Duration::from_millis(1);

/// Appends the streams' shares of one frame of `data` to `peer`.
fn push_frame<'a>(
    txs: &mut Vec<Tx<'a>>,
    links: &mut Links,
    desc: &OpDesc,
    peer: usize,
    data: &'a [u8],
) -> Result<()> {
    let l = link(links, peer)?;
    let len = data.len();
    let head = Header {
        kind: FrameKind::Data,
        desc: *desc,
        len: len as u64,
    }
    .encode();
    let pad = l.pad(len);
    for (i, (a, b)) in tile(len, l.streams(len)).enumerate() {
        txs.push(Tx {
            peer,
            stream: i,
            head: (i == 0).then_some(head),
            data: &data[a..b],
            pad: if i == 0 { pad } else { 0 },
            pos: 0,
        });
    }
    Ok(())
}

/// Starts the late sends whose bytes are ready, keeping the others in `waiting`; true if
/// one started.
fn start_ready<'a>(
    txs: &mut Vec<Tx<'a>>,
    links: &mut Links,
    desc: &OpDesc,
    waiting: &mut Vec<LateSend>,
    source: &mut dyn SendSource<'a>,
) -> Result<bool> {
    let mut started = false;
    let mut i = 0;
    while i < waiting.len() {
        let LateSend { peer, len } = waiting[i];
        let Some(data) = source.ready(peer)? else {
            i += 1;
            continue;
        };
        if data.len() != len {
            return Err(Error::Internal(format!(
                "a late send to rank {peer} was announced with {len} bytes and has {}",
                data.len()
            )));
        }
        push_frame(txs, links, desc, peer, data)?;
        waiting.swap_remove(i);
        started = true;
    }
    Ok(started)
}

fn run<'a>(
    links: &mut Links,
    cfg: &LinkConfig,
    desc: &OpDesc,
    sends: &[SendReq<'a>],
    late: &[LateSend],
    source: &mut dyn SendSource<'a>,
    recvs: &mut [RecvReq<'_>],
) -> Result<()> {
    let mut txs: Vec<Tx<'a>> = Vec::with_capacity(sends.len() + late.len());
    for s in sends {
        push_frame(&mut txs, links, desc, s.peer, s.data)?;
    }
    let mut waiting: Vec<LateSend> = late.to_vec();
    let mut rxs: Vec<Rx<'_>> = Vec::with_capacity(recvs.len());
    for r in recvs.iter_mut() {
        let l = link(links, r.peer)?;
        if r.reduce.is_some() && !l.reduces_on_receive() {
            return Err(Error::Internal(format!(
                "a reducing receive from rank {} needs a link that reduces on receive",
                r.peer
            )));
        }
        let full_len = r.data.len();
        let pad = l.pad(full_len);
        let mut rest: &mut [u8] = r.data;
        for (i, (a, b)) in tile(full_len, l.streams(full_len)).enumerate() {
            let (part, tail) = rest.split_at_mut(b - a);
            rest = tail;
            rxs.push(Rx {
                peer: r.peer,
                stream: i,
                head: (i == 0).then_some(([0u8; HEADER_LEN], 0)),
                data: part,
                pos: 0,
                full_len,
                reduce: r.reduce,
                pad: if i == 0 { pad } else { 0 },
                padded: 0,
            });
        }
    }

    let mut waiter = Waiter::new(cfg);
    // A peer found gone after a sleep: the error, once a pass after that moved nothing.
    let mut gone: Option<(usize, String)> = None;
    loop {
        let mut moved = false;
        if !waiting.is_empty() {
            moved |= start_ready(&mut txs, links, desc, &mut waiting, source)?;
        }
        let mut pending = waiting.len();
        // A peer whose link failed: reported after the loop, which holds `rxs` borrowed.
        let mut lost: Option<(usize, String)> = None;
        for t in txs.iter_mut().filter(|t| !t.done()) {
            let l = link(links, t.peer)?;
            match l.send(t.stream, t.rest()) {
                Ok(n) => {
                    t.pos += n;
                    moved |= n > 0;
                }
                Err(e) if would_block(&e) => {}
                Err(e) => {
                    lost = Some((t.peer, l.lost(Dir::Send, Some(&e))));
                    break;
                }
            }
            pending += usize::from(!t.done());
        }
        if let Some((peer, what)) = lost {
            return Err(lost_peer(links, cfg, &rxs, peer, what));
        }
        for r in rxs.iter_mut().filter(|r| !r.done()) {
            let l = link(links, r.peer)?;
            let in_head = matches!(r.head, Some((_, n)) if n < HEADER_LEN);
            let res = match (&mut r.head, &r.reduce) {
                (Some((h, n)), _) if in_head => l.recv(r.stream, &mut h[*n..]),
                (_, None) if r.pos < r.data.len() => l.recv(r.stream, &mut r.data[r.pos..]),
                (_, Some(red)) if r.pos < r.data.len() => {
                    nonzero(l.recv_reduce(&mut r.data[r.pos..], r.pos, red))
                }
                _ => nonzero(l.skip(r.pad - r.padded)),
            };
            match res {
                Ok(0) => {
                    lost = Some((r.peer, l.lost(Dir::Recv, None)));
                    break;
                }
                Ok(n) => {
                    moved = true;
                    match &mut r.head {
                        Some((h, got)) if in_head => {
                            *got += n;
                            if *got == HEADER_LEN {
                                let header = Header::decode(h, r.peer)?;
                                if header.kind == FrameKind::Abort {
                                    blame(cfg, header.culprit());
                                    let reason = reason_text(l.read_reason(header.len as usize));
                                    return Err(closed(
                                        links,
                                        r.peer,
                                        format!("{}{reason}", super::PEER_ABORTED),
                                    ));
                                }
                                header.check(desc, r.full_len, r.peer, cfg.rank)?;
                            }
                        }
                        _ if r.pos < r.data.len() => r.pos += n,
                        _ => r.padded += n,
                    }
                }
                Err(e) if would_block(&e) => {}
                Err(e) => {
                    lost = Some((r.peer, l.lost(Dir::Recv, Some(&e))));
                    break;
                }
            }
            pending += usize::from(!r.done());
        }
        if let Some((peer, what)) = lost {
            return Err(lost_peer(links, cfg, &rxs, peer, what));
        }
        if pending == 0 {
            return Ok(());
        }
        if moved {
            gone = None;
            waiter.progressed();
            continue;
        }
        if let Some((peer, why)) = gone.take() {
            blame(cfg, Some(peer));
            return Err(closed(links, peer, why));
        }
        let stalled =
            |full: bool| {
                let mut waited: Vec<usize> = rxs
                    .iter()
                    .filter(|r| !r.done())
                    .map(|r| r.peer)
                    .chain(txs.iter().filter(|t| !t.done()).map(|t| t.peer))
                    .collect();
                waited.sort_unstable();
                waited.dedup();
                if !full {
                    return Stalled::on(*desc, waited);
                }
                let mut peers: Vec<String> =
                    rxs.iter()
                        .filter(|r| !r.done())
                        .map(|r| format!("receive from rank {}", r.peer))
                        .chain(
                            txs.iter()
                                .filter(|t| !t.done())
                                .map(|t| format!("send to rank {}", t.peer)),
                        )
                        .chain(waiting.iter().map(|w| {
                            format!("send to rank {} (its bytes not written yet)", w.peer)
                        }))
                        .collect();
                peers.dedup();
                Stalled {
                    desc: *desc,
                    peers: waited,
                    what: format!("{} stalled in {desc}", peers.join(", ")),
                }
            };
        if let Next::Block(d) = waiter.idle(cfg, stalled)? {
            let links_idle = txs.iter().all(Tx::done) && rxs.iter().all(Rx::done);
            match waiting.first() {
                Some(w) if links_idle => source.wait(w.peer, d),
                Some(_) => gone = block(links, &txs, &rxs, d.min(LATE_POLL)),
                None => gone = block(links, &txs, &rxs, d),
            }
        }
    }
}

fn reason_text(bytes: Option<Vec<u8>>) -> String {
    match bytes {
        Some(b) => String::from_utf8_lossy(&b).into_owned(),
        None => "(reason lost)".into(),
    }
}

/// Sleeps until one of the pending jobs may progress, at most `d`: `poll` for descriptors,
/// else the first link that sleeps by itself (briefly, when it is a bell and other jobs are
/// pending, since one sleep cannot watch them all). Then returns a pending peer that is
/// known gone, and why. Not an error yet: a peer that wrote its last bytes and exited while
/// we slept is gone with those bytes still in the link, so the caller makes one more pass.
fn block(
    links: &mut Links,
    txs: &[Tx<'_>],
    rxs: &[Rx<'_>],
    d: Duration,
) -> Option<(usize, String)> {
    let pending = || {
        txs.iter()
            .filter(|t| !t.done())
            .map(|t| (t.peer, t.stream, Dir::Send))
            .chain(
                rxs.iter()
                    .filter(|r| !r.done())
                    .map(|r| (r.peer, r.stream, Dir::Recv)),
            )
    };
    let sleeper = {
        let mut fds: Vec<PollFd<'_>> = Vec::new();
        let (mut sleepers, mut bells, mut first) = (0, false, None);
        for (peer, stream, dir) in pending() {
            let l = links[peer].as_deref().expect("connected");
            match l.wait(stream, dir) {
                Wait::Fd(fd) => fds.push(PollFd::new(
                    fd,
                    match dir {
                        Dir::Send => PollFlags::POLLOUT,
                        Dir::Recv => PollFlags::POLLIN,
                    },
                )),
                w => {
                    bells |= matches!(w, Wait::Bell);
                    sleepers += 1;
                    first.get_or_insert((peer, dir));
                }
            }
        }
        let several = fds.len() + sleepers > 1;
        let d = if several && (bells || (sleepers > 0 && !fds.is_empty())) {
            d.min(Duration::from_millis(1))
        } else {
            d
        };
        if !fds.is_empty() {
            let ms = d.as_millis().clamp(1, u16::MAX as u128) as u16;
            let _ = poll(&mut fds, ms);
            None
        } else {
            first.map(|(peer, dir)| (peer, dir, d))
        }
    };
    if let Some((peer, dir, d)) = sleeper {
        links[peer].as_mut().expect("connected").sleep(dir, d);
    }
    pending().find_map(|(peer, _, _)| Some((peer, links[peer].as_deref()?.gone()?)))
}

/// The error for a peer whose link failed. A peer that aborted (because a third rank died,
/// say) sent an abort frame before closing; when our send to it fails first, that frame still
/// waits unread, and its reason names the rank that really failed. So the link looks for it
/// (`Link::pending_abort`) before the peer is blamed.
fn lost_peer(
    links: &mut Links,
    cfg: &LinkConfig,
    rxs: &[Rx<'_>],
    peer: usize,
    what: String,
) -> Error {
    // Where the peer's stream 0 stands: bytes left of the frame being read, or the part of a
    // header read so far (one receive per peer, so nothing else is half-read).
    let (skip, head): (usize, &[u8]) = match rxs.iter().find(|r| r.peer == peer && r.stream == 0) {
        Some(r) if !r.done() => match &r.head {
            Some((h, got)) if *got < HEADER_LEN => (0, &h[..*got]),
            _ => (r.data.len() - r.pos, &[]),
        },
        _ => (0, &[]),
    };
    let reason = links[peer]
        .as_mut()
        .and_then(|l| l.pending_abort(cfg, peer, skip, head));
    match reason {
        Some((reason, culprit)) => {
            blame(cfg, culprit);
            closed(links, peer, format!("{}{reason}", super::PEER_ABORTED))
        }
        None => {
            blame(cfg, Some(peer));
            closed(links, peer, what)
        }
    }
}

/// Tells the comm's stall inspector (if any) whom the failure is about.
fn blame(cfg: &LinkConfig, culprit: Option<usize>) {
    if let (Some(i), Some(c)) = (&cfg.inspector, culprit) {
        i.blame(c);
    }
}

#[cfg(test)]
mod tests;
