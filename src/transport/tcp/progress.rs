//! The TCP hot path: one exchange = a set of frame sends and receives, each split over the
//! peer pair's sockets, progressed together with non-blocking I/O and poll.

use super::Conn;
use crate::error::{Error, Result};
use crate::transport::frame::{FrameKind, Header, OpDesc, HEADER_LEN};
use crate::transport::shm;
use crate::transport::stall::Stalled;
use crate::transport::wait::{Next, Waiter};
use crate::transport::{LinkConfig, RecvReduce, RecvReq, SendReq};
use nix::poll::{poll, PollFd, PollFlags};
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::os::fd::AsFd;

/// Payloads below this go on one socket even when the pair has several.
const MIN_SPLIT: usize = 64 * 1024;

/// Byte ranges of a `len`-byte payload on each of `nsocks` sockets.
pub fn split(len: usize, nsocks: usize) -> Vec<(usize, usize)> {
    let k = if len < MIN_SPLIT { 1 } else { nsocks };
    // In u128: `len` may come from a peer's frame header (any u64), and len * k must not
    // overflow.
    let at = |i: usize| (len as u128 * i as u128 / k as u128) as usize;
    (0..k).map(|i| (at(i), at(i + 1))).collect()
}

/// Shared-memory frames are padded to 8 bytes, so every frame starts 8-aligned in the ring
/// and no element of any dtype straddles the ring's end: the receiver can then reduce
/// straight from `Ring::peek` without copying out first.
fn shm_pad(len: usize) -> usize {
    (8 - len % 8) % 8
}

const ZEROS: [u8; 8] = [0; 8];

struct Tx<'a> {
    peer: usize,
    sock: usize,
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

struct Rx<'a> {
    peer: usize,
    sock: usize,
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

fn closed(conns: &[Option<Conn>], peer: usize, what: String) -> Error {
    let addr = conns[peer]
        .as_ref()
        .map(|c| c.addr.to_string())
        .unwrap_or_default();
    Error::Remote {
        rank: peer,
        addr,
        msg: what,
    }
}

/// Runs one exchange to completion (or error). Connections must already exist.
pub fn exchange(
    conns: &mut [Option<Conn>],
    cfg: &LinkConfig,
    desc: &OpDesc,
    sends: &[SendReq<'_>],
    recvs: &mut [RecvReq<'_>],
) -> Result<()> {
    let mut txs: Vec<Tx<'_>> = Vec::with_capacity(sends.len());
    for s in sends {
        let nsocks = conns[s.peer].as_ref().map_or(1, Conn::streams);
        let head = Header {
            kind: FrameKind::Data,
            desc: *desc,
            len: s.data.len() as u64,
        }
        .encode();
        let shm = conns[s.peer].as_ref().is_some_and(|c| c.shm.is_some());
        for (i, (a, b)) in split(s.data.len(), nsocks).into_iter().enumerate() {
            txs.push(Tx {
                peer: s.peer,
                sock: i,
                head: (i == 0).then_some(head),
                data: &s.data[a..b],
                pad: if shm { shm_pad(s.data.len()) } else { 0 },
                pos: 0,
            });
        }
    }
    let mut rxs: Vec<Rx<'_>> = Vec::with_capacity(recvs.len());
    for r in recvs.iter_mut() {
        let nsocks = conns[r.peer].as_ref().map_or(1, Conn::streams);
        let shm = conns[r.peer].as_ref().is_some_and(|c| c.shm.is_some());
        if r.reduce.is_some() && !shm {
            return Err(Error::Internal(format!(
                "a reducing receive from rank {} needs a shared-memory link",
                r.peer
            )));
        }
        let full_len = r.data.len();
        let mut rest: &mut [u8] = r.data;
        let mut consumed = 0;
        for (i, (a, b)) in split(full_len, nsocks).into_iter().enumerate() {
            debug_assert_eq!(a, consumed);
            let (part, tail) = rest.split_at_mut(b - a);
            rest = tail;
            consumed = b;
            rxs.push(Rx {
                peer: r.peer,
                sock: i,
                head: (i == 0).then_some(([0u8; HEADER_LEN], 0)),
                data: part,
                pos: 0,
                full_len,
                reduce: r.reduce,
                pad: if shm { shm_pad(full_len) } else { 0 },
                padded: 0,
            });
        }
    }

    let mut waiter = Waiter::new(cfg);
    loop {
        let mut moved = false;
        let mut pending = 0;
        // A peer whose socket failed: reported after the loop, which holds `rxs` borrowed.
        let mut lost: Option<(usize, String)> = None;
        for t in txs.iter_mut().filter(|t| !t.done()) {
            let conn = conns[t.peer]
                .as_mut()
                .ok_or_else(|| Error::Internal(format!("no connection to rank {}", t.peer)))?;
            let hl = t.head.map_or(0, |_| HEADER_LEN);
            let res = match &conn.shm {
                Some(link) => Ok(link.tx.try_write(&t.rest())),
                None if t.pos < hl => {
                    let h = t.head.as_ref().unwrap();
                    conn.socks[t.sock]
                        .write_vectored(&[IoSlice::new(&h[t.pos..]), IoSlice::new(t.data)])
                }
                None => conn.socks[t.sock].write(&t.data[t.pos - hl..]),
            };
            match res {
                Ok(n) => {
                    t.pos += n;
                    moved |= n > 0;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let what =
                        format!("sending failed: {e} (the peer exited or closed the connection)");
                    lost = Some((t.peer, what));
                    break;
                }
            }
            if t.sock == 0 {
                // Remember a half-sent frame: an abort frame must not be spliced into it.
                conn.mid_frame = !t.done();
            }
            pending += usize::from(!t.done());
        }
        if let Some((peer, what)) = lost {
            return Err(lost_peer(conns, cfg, &rxs, peer, what));
        }
        for r in rxs.iter_mut().filter(|r| !r.done()) {
            let conn = conns[r.peer]
                .as_mut()
                .ok_or_else(|| Error::Internal(format!("no connection to rank {}", r.peer)))?;
            let res = match (&conn.shm, &mut r.head) {
                (None, Some((h, n))) if *n < HEADER_LEN => conn.socks[r.sock].read(&mut h[*n..]),
                (None, _) => conn.socks[r.sock].read(&mut r.data[r.pos..]),
                // An empty ring is not an end of file: liveness is checked when blocking.
                (Some(link), Some((h, n))) if *n < HEADER_LEN => {
                    match link.rx.try_read(&mut h[*n..]) {
                        0 => Err(ErrorKind::WouldBlock.into()),
                        n => Ok(n),
                    }
                }
                (Some(link), _) => {
                    let moved_now = shm_receive(link, r);
                    moved |= moved_now;
                    pending += usize::from(!r.done());
                    continue;
                }
            };
            match res {
                Ok(0) => {
                    let what = "connection closed by the peer (it exited, was killed, or aborted)";
                    lost = Some((r.peer, what.into()));
                    break;
                }
                Ok(n) => {
                    moved = true;
                    match &mut r.head {
                        Some((h, got)) if *got < HEADER_LEN => {
                            *got += n;
                            if *got == HEADER_LEN {
                                let header = Header::decode(h, r.peer)?;
                                if header.kind == FrameKind::Abort {
                                    blame(cfg, header.culprit());
                                    let reason = read_reason(conn, header.len as usize);
                                    return Err(closed(
                                        conns,
                                        r.peer,
                                        format!("{}{reason}", crate::transport::PEER_ABORTED),
                                    ));
                                }
                                header.check(desc, r.full_len, r.peer, cfg.rank)?;
                            }
                        }
                        _ => r.pos += n,
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    let what =
                        format!("receiving failed: {e} (the peer exited or closed the connection)");
                    lost = Some((r.peer, what));
                    break;
                }
            }
            pending += usize::from(!r.done());
        }
        if let Some((peer, what)) = lost {
            return Err(lost_peer(conns, cfg, &rxs, peer, what));
        }
        if pending == 0 {
            return Ok(());
        }
        if moved {
            waiter.progressed();
            continue;
        }
        let stalled = |full: bool| {
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
            let mut peers: Vec<String> = rxs
                .iter()
                .filter(|r| !r.done())
                .map(|r| format!("receive from rank {}", r.peer))
                .chain(
                    txs.iter()
                        .filter(|t| !t.done())
                        .map(|t| format!("send to rank {}", t.peer)),
                )
                .collect();
            peers.dedup();
            Stalled {
                desc: *desc,
                peers: waited,
                what: format!("{} stalled in {desc}", peers.join(", ")),
            }
        };
        if let Next::Block(d) = waiter.idle(cfg, stalled)? {
            block(conns, cfg, &txs, &rxs, d)?;
        }
    }
}

/// Moves what the ring holds of `r`'s payload (copied, or reduced straight from the shared
/// memory) and then its padding; returns whether anything moved.
fn shm_receive(link: &shm::ShmLink, r: &mut Rx<'_>) -> bool {
    if r.pos < r.data.len() {
        let n = match r.reduce {
            None => link.rx.try_read(&mut r.data[r.pos..]),
            Some(red) => {
                let es = red.dtype.size();
                let avail = link.rx.peek();
                // Whole elements only; frames are 8-aligned, so none straddles the ring end.
                let n = avail.len().min(r.data.len() - r.pos) / es * es;
                if n > 0 {
                    red.apply(&mut r.data[r.pos..r.pos + n], r.pos, &avail[..n]);
                    link.rx.consume(n);
                }
                n
            }
        };
        r.pos += n;
        return n > 0;
    }
    let n = link.rx.peek().len().min(r.pad - r.padded);
    if n > 0 {
        link.rx.consume(n);
        r.padded += n;
    }
    n > 0
}

/// Sleeps until one of the pending jobs may progress, at most `d`: poll for sockets, the
/// futex bell of a ring for shared memory (briefly, when several things are pending, since
/// one sleep cannot watch them all). Fails when a shared-memory peer's process is gone.
fn block(
    conns: &[Option<Conn>],
    cfg: &LinkConfig,
    txs: &[Tx<'_>],
    rxs: &[Rx<'_>],
    d: std::time::Duration,
) -> Result<()> {
    let conn = |p: usize| conns[p].as_ref().expect("connected");
    let mut fds: Vec<PollFd<'_>> = Vec::new();
    let mut rings: Vec<(usize, bool)> = Vec::new(); // (peer, is_send)
    for t in txs.iter().filter(|t| !t.done()) {
        match &conn(t.peer).shm {
            Some(_) => rings.push((t.peer, true)),
            None => fds.push(PollFd::new(
                conn(t.peer).socks[t.sock].as_fd(),
                PollFlags::POLLOUT,
            )),
        }
    }
    for r in rxs.iter().filter(|r| !r.done()) {
        match &conn(r.peer).shm {
            Some(_) => rings.push((r.peer, false)),
            None => fds.push(PollFd::new(
                conn(r.peer).socks[r.sock].as_fd(),
                PollFlags::POLLIN,
            )),
        }
    }
    let several = fds.len() + rings.len() > 1;
    let d = if several && !rings.is_empty() {
        d.min(std::time::Duration::from_millis(1))
    } else {
        d
    };
    if !fds.is_empty() {
        let ms = d.as_millis().clamp(1, u16::MAX as u128) as u16;
        let _ = poll(&mut fds, ms);
    } else if let Some(&(peer, is_send)) = rings.first() {
        let link = conn(peer).shm.as_ref().expect("shm");
        if is_send {
            link.tx.wait_writable(d);
        } else {
            link.rx.wait_readable(d);
        }
    }
    for &(peer, _) in &rings {
        let link = conn(peer).shm.as_ref().expect("shm");
        if !shm::alive(link.peer_pid) {
            blame(cfg, Some(peer));
            return Err(closed(
                conns,
                peer,
                format!(
                    "its process (pid {}) is gone: killed or exited",
                    link.peer_pid
                ),
            ));
        }
    }
    Ok(())
}

/// The error for a peer whose socket failed. A peer that aborted (because a third rank
/// died, say) sent an abort frame before closing; when our send to it fails first, that
/// frame still waits unread in our receive buffer, and its reason names the rank that
/// really failed. So look for it before blaming the peer.
fn lost_peer(
    conns: &mut [Option<Conn>],
    cfg: &LinkConfig,
    rxs: &[Rx<'_>],
    peer: usize,
    what: String,
) -> Error {
    // Where the peer's first socket stands: bytes left of the frame being read, or the part
    // of a header read so far (one receive per peer, so nothing else is half-read).
    let (skip, head): (usize, &[u8]) = match rxs.iter().find(|r| r.peer == peer && r.sock == 0) {
        Some(r) if !r.done() => match &r.head {
            Some((h, got)) if *got < HEADER_LEN => (0, &h[..*got]),
            _ => (r.data.len() - r.pos, &[]),
        },
        _ => (0, &[]),
    };
    let reason = match conns[peer].as_mut() {
        Some(conn) if conn.shm.is_none() => pending_abort(conn, cfg, peer, skip, head),
        _ => None,
    };
    match reason {
        Some((reason, culprit)) => {
            blame(cfg, culprit);
            closed(
                conns,
                peer,
                format!("{}{reason}", crate::transport::PEER_ABORTED),
            )
        }
        None => {
            blame(cfg, Some(peer));
            closed(conns, peer, what)
        }
    }
}

/// Tells the comm's stall inspector (if any) whom the failure is about.
fn blame(cfg: &LinkConfig, culprit: Option<usize>) {
    if let (Some(i), Some(c)) = (&cfg.inspector, culprit) {
        i.blame(c);
    }
}

/// Reads on from where the peer's first socket stands (`skip` bytes of the current frame
/// left, or `head`, the part of a header already read) over whatever data frames were queued,
/// to an abort frame; returns its reason and the rank it names. Bounded: 16 frames, one second in all, and
/// `abort()` on the comm ends it, since the peer is gone or going.
fn pending_abort(
    conn: &mut Conn,
    cfg: &LinkConfig,
    peer: usize,
    skip: usize,
    head: &[u8],
) -> Option<(String, Option<usize>)> {
    const MAX_FRAMES: usize = 16;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    let nsocks = conn.socks.len();
    let sock = &mut conn.socks[0];
    sock.set_nonblocking(false).ok()?;
    // Some bytes, waiting in slices of at most 100 ms so the abort flag is seen.
    let mut read = |buf: &mut [u8]| -> Option<usize> {
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || cfg.abort.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let wait = left.min(std::time::Duration::from_millis(100));
            sock.set_read_timeout(Some(wait)).ok()?;
            match sock.read(buf) {
                Ok(0) => return None,
                Ok(n) => return Some(n),
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                Err(_) => return None,
            }
        }
    };
    let mut scratch = [0u8; 4096];
    let mut h = [0u8; HEADER_LEN];
    let (mut skip, mut got) = (skip, head.len());
    h[..got].copy_from_slice(head);
    for _ in 0..MAX_FRAMES {
        while skip > 0 {
            let n = skip.min(scratch.len());
            skip -= read(&mut scratch[..n])?;
        }
        while got < HEADER_LEN {
            got += read(&mut h[got..])?;
        }
        let header = Header::decode(&h, peer).ok()?;
        if header.kind == FrameKind::Abort {
            return Some((read_reason(conn, header.len as usize), header.culprit()));
        }
        // A data frame sent ahead of us: only its first part travels on this socket.
        let (a, b) = split(header.len as usize, nsocks)[0];
        (skip, got) = (b - a, 0);
    }
    None
}

/// Reads an abort frame's reason; bounded in time since the peer is going away.
fn read_reason(conn: &mut Conn, len: usize) -> String {
    let mut buf = vec![0u8; len];
    let ok = match &conn.shm {
        Some(link) => {
            let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
            let mut got = 0;
            while got < len && std::time::Instant::now() < deadline {
                got += link.rx.try_read(&mut buf[got..]);
            }
            got == len
        }
        None => {
            let sock = &mut conn.socks[0];
            let _ = sock.set_nonblocking(false);
            let _ = sock.set_read_timeout(Some(std::time::Duration::from_millis(500)));
            sock.read_exact(&mut buf).is_ok()
        }
    };
    if ok {
        String::from_utf8_lossy(&buf).into_owned()
    } else {
        "(reason lost)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::frame::CollKind;
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    fn desc() -> OpDesc {
        OpDesc {
            coll: CollKind::AllReduce,
            dtype: 7,
            op: 0,
            algo: 0,
            root: 0,
            count: 0,
        }
    }

    /// Rank 1 queues a data frame of `early` bytes for a later step (split over the pair's
    /// `nsocks` sockets as `exchange` splits it), then an abort frame naming the rank that
    /// really died, and closes with our bytes unread (a reset). Our send to it fails first;
    /// the error must carry the abort's reason, not just a broken pipe.
    fn abort_queued_behind(nsocks: usize, early: usize) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for _ in 0..nsocks {
            ours.push(TcpStream::connect(addr).unwrap());
            let (s, _) = listener.accept().unwrap();
            // As `configure` sets for every comm socket: the frames leave at once, ahead of
            // the reset that the close sends (a reset drops what was still queued to send).
            s.set_nodelay(true).unwrap();
            theirs.push(s);
        }
        let peer = std::thread::spawn(move || {
            // Wait until our send reached every socket, so the close leaves it unread.
            let mut b = [0u8; 1];
            for s in &theirs {
                while s.peek(&mut b).unwrap() == 0 {}
            }
            let data = vec![1u8; early];
            let head = Header {
                kind: FrameKind::Data,
                desc: desc(),
                len: early as u64,
            };
            theirs[0].write_all(&head.encode()).unwrap();
            for (i, (a, b)) in split(early, nsocks).into_iter().enumerate() {
                theirs[i].write_all(&data[a..b]).unwrap();
            }
            let reason = b"rank 1 failed: rank 2 is gone";
            theirs[0]
                .write_all(&Header::abort(reason.len(), Some(2)).encode())
                .unwrap();
            theirs[0].write_all(reason).unwrap();
        });
        for s in &ours {
            s.set_nonblocking(true).unwrap();
        }
        let mut conns = vec![
            None,
            Some(Conn {
                socks: ours,
                addr,
                mid_frame: false,
                shm: None,
            }),
        ];
        let cfg = LinkConfig {
            rank: 0,
            size: 2,
            timeout: Duration::from_secs(10),
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
            abort: Arc::new(AtomicBool::new(false)),
            arena_chunk: None,
            inspector: Some(Arc::new(crate::transport::stall::Inspector::new(
                0,
                [0; 16],
                0,
                vec![addr; 3],
            ))),
        };
        let big = vec![0u8; 64 << 20];
        let sends = [SendReq {
            peer: 1,
            data: &big,
        }];
        let err = exchange(&mut conns, &cfg, &desc(), &sends, &mut [])
            .unwrap_err()
            .to_string();
        peer.join().unwrap();
        assert!(
            err.contains("peer aborted: rank 1 failed: rank 2 is gone"),
            "{err}"
        );
        // The frame's culprit, for this rank's own abort frames and probes.
        assert_eq!(cfg.inspector.unwrap().culprit(), Some(2));
    }

    #[test]
    fn a_send_to_a_peer_that_aborted_reports_the_abort_reason() {
        abort_queued_behind(1, 1000);
    }

    #[test]
    fn the_abort_reason_is_found_behind_a_frame_split_over_two_sockets() {
        abort_queued_behind(2, 100 << 10);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Any length splits without overflow into ranges that tile it: a peer's header may
        /// announce any u64, and the abort path splits it before the length is checked.
        #[test]
        fn split_tiles_any_length(
            len in proptest::prop_oneof![proptest::prelude::any::<u64>(), 0..1u64 << 20],
            nsocks in 1usize..16,
        ) {
            let len = len as usize;
            let parts = split(len, nsocks);
            proptest::prop_assert!(!parts.is_empty() && parts.len() <= nsocks);
            proptest::prop_assert_eq!(parts[0].0, 0);
            proptest::prop_assert_eq!(parts[parts.len() - 1].1, len);
            for w in parts.windows(2) {
                proptest::prop_assert_eq!(w[0].1, w[1].0);
            }
            proptest::prop_assert!(parts.iter().all(|(a, b)| a <= b));
        }
    }
}
