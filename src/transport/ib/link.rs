//! The RDMA link: frames through the peer's registered slot ring (`slots.rs`) over one RC
//! queue pair (`setup.rs`). `send` copies what fits into free staging slots and posts each as
//! an RDMA write with immediate into the peer's slot of the same index; `recv` polls the
//! completion queue and hands out the arrived bytes in order, returning a credit for each slot
//! read to its end. Frames are padded to 8 bytes and slots are multiples of 8, so no element
//! straddles two slots and a receive reduces straight out of the slot.
//!
//! A payload inside a buffer registered with the comm is written straight from it instead
//! (`zcopy.rs`), its bytes reported to the engine only once the write completed.
//!
//! Registered memory may be written by the NIC at any time its queue pair allows, so it is
//! only touched through raw pointers, and only where the protocol gives this side the bytes: a
//! receive slot from its arrival until its credit is posted, a staging slot from its write's
//! completion until the next write from it is posted.
//!
//! A completion with an error fails the link with the verbs status and the peer's rank; bytes
//! that arrived before it are still handed out first (they may hold the peer's abort frame).
//! The bootstrap socket stays open, unused, so a peer process that is gone shows as its end of
//! file (`gone`).

use super::setup::{Conn, CREDIT_WORD, RECV_TAG};
use super::slots::{Arrivals, Imm, Window, MAX_CREDIT_WRITES, SLOTS, SLOT_BYTES};
use super::verbs::{Completion, RemoteAddr, Sge, WcOpcode, WcStatus};
use super::zcopy::{self, Ahead, UserMr, ZCOPY_MIN};
use crate::transport::frame::{FrameKind, Header, HEADER_LEN};
use crate::transport::link::{Dir, Link, Wait};
use crate::transport::registry::Registry;
use crate::transport::{LinkConfig, RecvReduce};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// wr_id tag of data writes (the low bits count them).
const DATA_TAG: u64 = 2 << 60;
/// wr_id tag of credit writes.
const CREDIT_TAG: u64 = 3 << 60;
const TAG_MASK: u64 = 0xf << 60;
/// Completions taken per poll.
const POLL_BATCH: usize = 32;
const _: () = assert!(8 <= CREDIT_WORD);

/// Longest wait for the writes already posted when the link closes (their bytes must reach
/// the peer before the queue pair goes away).
const DRAIN: Duration = Duration::from_secs(10);

/// The queue pair and slot rings to one peer.
pub struct IbLink {
    conn: Conn,
    /// The bootstrap sockets, kept open: the peer's end of file tells it is gone.
    socks: Vec<TcpStream>,
    addr: SocketAddr,
    peer: usize,
    tx: Window,
    rx: Arrivals,
    credit_writes: usize,
    wcs: Vec<Completion>,
    /// Bytes handed out so far: frames start at multiples of 8.
    consumed: u64,
    /// Why the link failed (the first error completion, or a protocol error).
    failed: Option<String>,
    /// True while a frame is half written.
    mid_frame: bool,
    /// Posted bytes the engine has not been told of (zero-copy writes in flight).
    ahead: Ahead,
    /// The last `send` left bytes it could not post yet (no free slot).
    unposted: bool,
    /// The comm's registered buffers (zero-copy sources).
    registry: Arc<Registry>,
    /// The comm's timeout, bounding the drain on close.
    timeout: Duration,
}

impl IbLink {
    /// A link over `conn`, set up over `socks` with rank `peer` at `addr`.
    pub fn new(
        conn: Conn,
        socks: Vec<TcpStream>,
        addr: SocketAddr,
        peer: usize,
        cfg: &LinkConfig,
    ) -> IbLink {
        IbLink {
            conn,
            socks,
            addr,
            peer,
            tx: Window::default(),
            rx: Arrivals::default(),
            credit_writes: 0,
            consumed: 0,
            wcs: Vec::with_capacity(POLL_BATCH),
            failed: None,
            mid_frame: false,
            ahead: Ahead::default(),
            unposted: false,
            registry: cfg.registry.clone(),
            timeout: cfg.timeout,
        }
    }

    /// Notes the link's first failure (a flush error only until a real one is known: a flush
    /// follows the error that caused it).
    fn fail(&mut self, why: String, flush: bool) {
        match &self.failed {
            None => self.failed = Some(why),
            Some(f) if !flush && f.contains(WcStatus::WrFlush.describe().as_str()) => {
                self.failed = Some(why)
            }
            _ => {}
        }
    }

    fn failure(&self) -> io::Error {
        io::Error::other(self.failed.clone().unwrap_or_default())
    }

    /// Takes every completion that is ready; then returns owed credits.
    fn progress(&mut self) {
        loop {
            self.wcs.clear();
            match self.conn.cq.poll(&mut self.wcs, POLL_BATCH) {
                Ok(0) => break,
                Ok(_) => {
                    let wcs = std::mem::take(&mut self.wcs);
                    for wc in &wcs {
                        self.complete(wc);
                    }
                    self.wcs = wcs;
                }
                Err(e) => {
                    self.fail(format!("polling the completion queue failed: {e}"), false);
                    break;
                }
            }
        }
        self.return_credits();
    }

    fn complete(&mut self, wc: &Completion) {
        let what = match wc.wr_id & TAG_MASK {
            DATA_TAG => "RDMA write to",
            CREDIT_TAG => "credit write to",
            _ => "receive from",
        };
        if wc.status != WcStatus::Success {
            let flush = wc.status == WcStatus::WrFlush;
            self.fail(
                format!(
                    "{what} rank {} failed: {} (verbs completion status; qp {} on {})",
                    self.peer,
                    wc.status.describe(),
                    wc.qpn,
                    self.conn.port
                ),
                flush,
            );
            return;
        }
        let res = match (wc.wr_id & TAG_MASK, wc.opcode) {
            (DATA_TAG, _) => self.tx.completed_one(),
            (CREDIT_TAG, _) => {
                self.credit_writes = self.credit_writes.saturating_sub(1);
                Ok(())
            }
            (RECV_TAG, WcOpcode::RecvWriteImm) => self.arrived(wc),
            _ => Err(format!("unexpected completion {wc:?}")),
        };
        if let Err(e) = res {
            self.fail(
                format!("rank {} is out of step on the RDMA link: {e}", self.peer),
                false,
            );
        }
    }

    /// A receive consumed by the peer's write with immediate: a slot's bytes or a credit.
    fn arrived(&mut self, wc: &Completion) -> Result<(), String> {
        match Imm::decode(wc.imm) {
            Imm::Credit(n) => self.tx.credit(n)?,
            Imm::Data { slot, len } => {
                if wc.byte_len != len {
                    return Err(format!(
                        "slot {slot} announced {len} bytes but {} arrived",
                        wc.byte_len
                    ));
                }
                self.rx.arrive(slot, len)?;
            }
        }
        // The receive is used up: post it again.
        self.conn
            .qp
            .post_recv(wc.wr_id)
            .map_err(|e| format!("posting a receive: {e}"))
    }

    /// Posts one credit write for the slots read to their end, when there is room.
    fn return_credits(&mut self) {
        if self.rx.owed == 0 || self.credit_writes >= MAX_CREDIT_WRITES || self.failed.is_some() {
            return;
        }
        let n = self.rx.owed;
        let ring = (SLOTS * SLOT_BYTES) as u64;
        // The 8 bytes carried are not read (the immediate is the credit): any stable source.
        let local = Sge {
            addr: self.conn.outbox.addr() + ring,
            len: 8,
            lkey: self.conn.outbox.lkey(),
        };
        let remote = RemoteAddr {
            addr: self.conn.remote.addr + ring,
            rkey: self.conn.remote.rkey,
        };
        let id = CREDIT_TAG | (self.credit_writes as u64);
        match self
            .conn
            .qp
            .post_write(id, local, remote, Some(Imm::Credit(n).encode()), true)
        {
            Ok(()) => {
                self.rx.owed = 0;
                self.credit_writes += 1;
            }
            Err(e) => self.fail(
                format!("returning credits to rank {} failed: {e}", self.peer),
                false,
            ),
        }
    }

    /// Posts what fits of `parts` past the bytes already posted (`ahead`): the payload
    /// (`parts[1]`) straight from its registered buffer where `user` is given, everything
    /// else copied into free staging slots. Each write fills at most one slot.
    fn post(&mut self, parts: &[&[u8]], user: Option<&UserMr>) -> Result<(), String> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let head = parts[0].len();
        let body = head..head + parts.get(1).map_or(0, |p| p.len());
        let mut at = self.ahead.posted();
        while at < total && self.tx.free() > 0 {
            let slot = self.tx.next_slot();
            let off = slot * SLOT_BYTES;
            let (local, zero_copy) = match user {
                // Whole slots from the payload's start (8-aligned), so no element straddles.
                Some(mr) if body.contains(&at) => {
                    let n = (body.end - at).min(SLOT_BYTES);
                    let addr = parts[1][at - head..].as_ptr() as u64;
                    let sge = Sge {
                        addr,
                        len: n as u32,
                        lkey: mr.lkey(),
                    };
                    (sge, true)
                }
                _ => {
                    // The header alone when the payload goes without a copy.
                    let end = if user.is_some() && at < body.start {
                        body.start
                    } else {
                        total
                    };
                    let n = (end - at).min(SLOT_BYTES);
                    // SAFETY: the staging slot lies inside the outbox region (SLOTS *
                    // SLOT_BYTES bytes), and no write reads it now: the window counts it free
                    // only after the last write from it completed.
                    unsafe { copy_out(parts, at, self.conn.outbox.ptr().add(off), n) };
                    let sge = Sge {
                        addr: self.conn.outbox.addr() + off as u64,
                        len: n as u32,
                        lkey: self.conn.outbox.lkey(),
                    };
                    (sge, false)
                }
            };
            let n = local.len as usize;
            let remote = RemoteAddr {
                addr: self.conn.remote.addr + off as u64,
                rkey: self.conn.remote.rkey,
            };
            let imm = Imm::Data {
                slot: slot as u32,
                len: n as u32,
            };
            self.conn
                .qp
                .post_write(
                    DATA_TAG | self.tx.posted,
                    local,
                    remote,
                    Some(imm.encode()),
                    true,
                )
                .map_err(|e| format!("posting an RDMA write to rank {}: {e}", self.peer))?;
            if zero_copy {
                self.ahead.zero_copy(self.tx.posted, n);
            } else {
                self.ahead.staged(n);
            }
            self.tx.posted += 1;
            at += n;
        }
        self.unposted = at < total;
        Ok(())
    }

    /// Hands out up to `max` arrived bytes, in order, to `take` (called once per slot piece
    /// with the piece's bytes, returning how many it used); the bytes used.
    fn read(&mut self, max: usize, mut take: impl FnMut(&[u8]) -> usize) -> usize {
        let mut got = 0;
        while got < max {
            let Some((at, avail)) = self.rx.front() else {
                break;
            };
            let n = avail.min(max - got);
            // SAFETY: the piece lies inside the inbox ring, and the peer does not write this
            // slot until this side credits it, which happens only once it is read to its end
            // (`Arrivals::consume`); the slice does not outlive this call.
            let piece = unsafe { std::slice::from_raw_parts(self.conn.inbox.ptr().add(at), n) };
            let used = take(piece);
            if used == 0 {
                break;
            }
            self.rx.consume(used);
            self.consumed += used as u64;
            got += used;
        }
        if got > 0 {
            self.return_credits();
        }
        got
    }

    /// Waits for completions until `deadline`, the comm's abort flag, or failure; false then
    /// (a failed queue pair is in the error state: nothing more arrives, and what arrived
    /// before the error was polled with it).
    fn wait_more(&mut self, deadline: Instant, cfg: Option<&LinkConfig>) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero()
            || self.failed.is_some()
            || cfg.is_some_and(|c| c.abort.load(Ordering::Relaxed))
        {
            return false;
        }
        self.conn.cq.wait(left.min(Duration::from_millis(10)));
        self.progress();
        true
    }

    /// Reads exactly `buf.len()` bytes by `deadline`.
    fn read_exact(&mut self, buf: &mut [u8], deadline: Instant, cfg: Option<&LinkConfig>) -> bool {
        let mut got = 0;
        loop {
            self.progress();
            got += self.read(buf.len() - got, |p| {
                buf[got..got + p.len()].copy_from_slice(p);
                p.len()
            });
            if got == buf.len() {
                return true;
            }
            if !self.wait_more(deadline, cfg) {
                return false;
            }
        }
    }

    /// Drops `n` bytes by `deadline`.
    fn skip_exact(&mut self, mut n: usize, deadline: Instant, cfg: &LinkConfig) -> bool {
        loop {
            self.progress();
            n -= self.read(n, |p| p.len());
            if n == 0 {
                return true;
            }
            if !self.wait_more(deadline, Some(cfg)) {
                return false;
            }
        }
    }
}

/// Copies `n` bytes of `parts`, from byte `skip` of their concatenation, to `dst`.
///
/// # Safety
/// `dst..dst+n` must be valid for writes and not overlap `parts`.
unsafe fn copy_out(parts: &[&[u8]], mut skip: usize, mut dst: *mut u8, mut n: usize) {
    for p in parts {
        if n == 0 {
            break;
        }
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        let k = (p.len() - skip).min(n);
        // SAFETY: the caller's contract; `k` bytes are left of both.
        unsafe {
            std::ptr::copy_nonoverlapping(p.as_ptr().add(skip), dst, k);
            dst = dst.add(k);
        }
        n -= k;
        skip = 0;
    }
}

/// "Nothing now", or the failure once nothing arrived is left.
fn some_or(n: usize, failed: Option<io::Error>) -> io::Result<usize> {
    match (n, failed) {
        (0, Some(e)) => Err(e),
        (0, None) => Err(io::ErrorKind::WouldBlock.into()),
        (n, _) => Ok(n),
    }
}

impl Link for IbLink {
    fn pad(&self, len: usize) -> usize {
        (8 - len % 8) % 8
    }

    fn send(&mut self, _stream: usize, parts: [&[u8]; 3]) -> io::Result<usize> {
        self.progress();
        if self.failed.is_some() {
            return Err(self.failure());
        }
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let user = (parts[1].len() >= ZCOPY_MIN)
            .then(|| zcopy::lookup(&self.registry, &self.conn._ctx, parts[1]))
            .flatten();
        if let Err(e) = self.post(&parts, user.as_deref()) {
            self.fail(e, false);
            return Err(self.failure());
        }
        let n = self.ahead.report(self.tx.completed);
        self.mid_frame = self.ahead.posted() > 0 || (n < total && (n > 0 || self.mid_frame));
        some_or(n, None)
    }

    fn release(&mut self) {
        if self.mid_frame || self.ahead.posted() > 0 {
            // The frame is abandoned and the stream cut: stop the device reading the
            // caller's memory (returns only once it reads none) and fail the link.
            let _ = self.conn.qp.to_error();
            self.fail(
                format!(
                    "a frame to rank {} was abandoned half written (the exchange failed)",
                    self.peer
                ),
                false,
            );
            self.ahead.clear();
        }
    }

    fn recv(&mut self, _stream: usize, buf: &mut [u8]) -> io::Result<usize> {
        self.progress();
        // `read` hands out at most what is left of `buf`, in order.
        let mut got = 0;
        let n = self.read(buf.len(), |p| {
            buf[got..got + p.len()].copy_from_slice(p);
            got += p.len();
            p.len()
        });
        some_or(n, self.failed.is_some().then(|| self.failure()))
    }

    fn reduces_on_receive(&self) -> bool {
        true
    }

    fn recv_reduce(&mut self, dst: &mut [u8], at: usize, reduce: &RecvReduce<'_>) -> usize {
        self.progress();
        let es = reduce.dtype.size();
        let mut got = 0;
        // Whole elements only; frames and slots are 8-aligned, so none straddles two slots.
        self.read(dst.len(), |p| {
            let n = p.len() / es * es;
            if n > 0 {
                reduce.apply(&mut dst[got..got + n], at + got, &p[..n]);
                got += n;
            }
            n
        })
    }

    fn skip(&mut self, n: usize) -> usize {
        self.progress();
        self.read(n, |p| p.len())
    }

    fn wait(&self, _stream: usize, _dir: Dir) -> Wait<'_> {
        Wait::Bell
    }

    fn sleep(&mut self, dir: Dir, d: Duration) {
        self.progress();
        let ready = self.failed.is_some()
            || match dir {
                Dir::Send => {
                    self.ahead.ready(self.tx.completed) || (self.unposted && self.tx.free() > 0)
                }
                Dir::Recv => !self.rx.is_empty(),
            };
        if !ready {
            self.conn.cq.wait(d);
        }
    }

    fn gone(&self) -> Option<String> {
        // Non-blocking (`socket::configure`): end of file only when the peer closed it.
        matches!(self.socks.first()?.peek(&mut [0u8]), Ok(0)).then(|| {
            "its process is gone (the setup connection reached end of file: it exited, was \
             killed, or aborted)"
                .into()
        })
    }

    fn lost(&self, dir: Dir, err: Option<&io::Error>) -> String {
        match err {
            Some(e) => e.to_string(),
            None => match dir {
                Dir::Send => "the RDMA link closed while sending".into(),
                Dir::Recv => "the RDMA link closed while receiving".into(),
            },
        }
    }

    fn read_reason(&mut self, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        let deadline = Instant::now() + Duration::from_millis(500);
        self.read_exact(&mut buf, deadline, None).then_some(buf)
    }

    fn pending_abort(
        &mut self,
        cfg: &LinkConfig,
        peer: usize,
        skip: usize,
        head: &[u8],
    ) -> Option<(String, Option<usize>)> {
        const MAX_FRAMES: usize = 16;
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut h = [0u8; HEADER_LEN];
        h[..head.len()].copy_from_slice(head);
        let mut skip = skip;
        let mut got = head.len();
        for _ in 0..MAX_FRAMES {
            if !self.skip_exact(skip, deadline, cfg) {
                return None;
            }
            // The engine counts what is left of the payload, not of its padding: the next
            // frame starts at the next multiple of 8.
            let pad = (8 - self.consumed % 8) % 8;
            if got == 0 && !self.skip_exact(pad as usize, deadline, cfg) {
                return None;
            }
            if !self.read_exact(&mut h[got..], deadline, Some(cfg)) {
                return None;
            }
            let header = Header::decode(&h, peer).ok()?;
            if header.kind == FrameKind::Abort {
                let reason = self
                    .read_reason(header.len as usize)
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_else(|| "(reason lost)".into());
                return Some((reason, header.culprit()));
            }
            skip = usize::try_from(header.len).ok()?;
            got = 0;
        }
        None
    }

    fn abort(&mut self, head: &[u8], reason: &[u8]) {
        self.progress();
        // All or nothing, in one slot: a partial abort frame would be garbage to the peer.
        let fits = head.len() + reason.len() <= SLOT_BYTES && self.tx.free() > 0;
        if !self.mid_frame
            && self.failed.is_none()
            && fits
            && self.post(&[head, reason], None).is_ok()
        {
            // Bounded: its bytes must be in the peer's ring before the queue pair errors.
            let deadline = Instant::now() + Duration::from_millis(200);
            while !self.tx.drained() && self.failed.is_none() && self.wait_more(deadline, None) {}
        }
        let _ = self.conn.qp.to_error();
        for s in &self.socks {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn addr(&self) -> String {
        self.addr.to_string()
    }

    fn describe(&self) -> String {
        let qpn = self.conn.qp.qpn();
        match self.conn.kind {
            "emulated" => format!("ib emulated {} (qp {qpn})", self.conn.port),
            _ => format!("ib {} (qp {qpn})", self.conn.port),
        }
    }
}

impl Drop for IbLink {
    /// Waits (bounded) for the writes already posted: the engine counts a frame sent once it
    /// is posted, and its bytes must reach the peer before the queue pair goes away.
    fn drop(&mut self) {
        let deadline = Instant::now() + self.timeout.min(DRAIN);
        self.progress();
        while !self.tx.drained() && self.failed.is_none() && self.wait_more(deadline, None) {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::setup::{connect, IbNet};
    use super::super::Device;
    use super::*;
    use crate::transport::engine;
    use crate::transport::frame::{CollKind, OpDesc};
    use crate::transport::ib::emu::fault::{Fault, FaultKind};
    use crate::transport::ib::emu::EmuFabric;
    use crate::transport::{RecvReq, SendReq};
    use crate::{DType, ReduceOp};
    use std::net::{Ipv4Addr, TcpListener};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    fn cfg(rank: usize) -> LinkConfig {
        cfg_with(rank, Default::default())
    }

    fn cfg_with(rank: usize, registry: Arc<Registry>) -> LinkConfig {
        LinkConfig {
            rank,
            size: 2,
            timeout: Duration::from_secs(20),
            spin: Duration::ZERO,
            yield_for: Duration::ZERO,
            abort: Arc::new(AtomicBool::new(false)),
            arena_chunk: None,
            inspector: None,
            registry,
        }
    }

    fn desc() -> OpDesc {
        OpDesc {
            coll: CollKind::AllReduce,
            dtype: DType::Float64 as u8,
            op: 0,
            algo: 0,
            root: 0,
            count: 0,
        }
    }

    /// Two links over the emulated fabric (both ends in this process, over loopback), set up
    /// as the connector does.
    fn pair() -> (IbLink, IbLink) {
        pair_failing(0)
    }

    /// A pair whose `n`-th write is refused by the responder, a remote access error (0: none).
    fn pair_failing(n: u64) -> (IbLink, IbLink) {
        pair_with(n, Default::default())
    }

    /// A pair whose ranks look up buffers in `registry`.
    fn pair_with(n: u64, registry: Arc<Registry>) -> (IbLink, IbLink) {
        let mut fabric = EmuFabric::new([7; 16], Ipv4Addr::LOCALHOST.into());
        if n > 0 {
            fabric = fabric.with_fault(Fault {
                kind: FaultKind::Rkey,
                n,
            });
        }
        let dev = Device {
            fabric: Arc::new(fabric),
            name: "emu0".into(),
            port: 1,
            path: Default::default(),
        };
        let net = Arc::new(IbNet::open(&dev).unwrap());
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let net2 = net.clone();
        let reg2 = registry.clone();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let c = connect(&net2, &mut s).unwrap();
            s.set_nonblocking(true).unwrap();
            IbLink::new(c, vec![s], addr, 1, &cfg_with(0, reg2))
        });
        let (mut s, _) = l.accept().unwrap();
        let c = connect(&net, &mut s).unwrap();
        s.set_nonblocking(true).unwrap();
        let b = IbLink::new(c, vec![s], addr, 0, &cfg_with(1, registry));
        (t.join().unwrap(), b)
    }

    fn links(rank: usize, l: IbLink) -> Vec<Option<Box<dyn Link>>> {
        let mut v: Vec<Option<Box<dyn Link>>> = vec![None, None];
        v[1 - rank] = Some(Box::new(l));
        v
    }

    fn f64s(seed: u64, n: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| ((seed * 1000 + i as u64) as f64 * 0.5).to_le_bytes())
            .collect()
    }

    #[test]
    fn frames_of_every_size_cross_in_both_directions_and_reduce_from_the_slots() {
        let (a, b) = pair();
        let sizes = [
            0usize,
            1,
            5,
            40,
            4099,
            SLOT_BYTES - 40,
            SLOT_BYTES * 3 + 5,
            9 << 20,
        ];
        let run = move |rank: usize, link: IbLink| {
            let mut links = links(rank, link);
            let c = cfg(rank);
            let peer = 1 - rank;
            for (i, &n) in sizes.iter().enumerate() {
                // Plain bytes, both ways at once.
                let out: Vec<u8> = (0..n).map(|k| (k * 7 + i + rank) as u8).collect();
                let mut got = vec![0u8; n];
                let sends = [SendReq { peer, data: &out }];
                let mut recvs = [RecvReq::new(peer, &mut got)];
                engine::exchange(&mut links, &c, &desc(), &sends, &mut recvs).unwrap();
                let want: Vec<u8> = (0..n).map(|k| (k * 7 + i + peer) as u8).collect();
                assert_eq!(got, want, "{n} bytes");
                // Float64 sums reduced straight out of the slots.
                let elems = n / 8 + 1;
                let mine = f64s(rank as u64 + 1, elems);
                let mut acc = f64s(10, elems);
                let sends = [SendReq { peer, data: &mine }];
                let red = RecvReduce {
                    dtype: DType::Float64,
                    op: ReduceOp::Sum,
                    with: None,
                };
                let mut recvs = [RecvReq::reducing(peer, &mut acc, red)];
                engine::exchange(&mut links, &c, &desc(), &sends, &mut recvs).unwrap();
                let theirs = f64s(peer as u64 + 1, elems);
                let base = f64s(10, elems);
                for k in 0..elems {
                    let v = |b: &[u8]| f64::from_le_bytes(b[k * 8..k * 8 + 8].try_into().unwrap());
                    assert_eq!(v(&acc), v(&base) + v(&theirs), "element {k} of {elems}");
                }
            }
        };
        let t = std::thread::spawn(move || run(0, a));
        run(1, b);
        t.join().unwrap();
    }

    /// Payloads inside a registered buffer go without a copy (one device registration, made
    /// on first use and reused); after deregistration the same bytes are staged again.
    #[test]
    fn registered_payloads_are_written_from_the_buffer_itself() {
        let registry = Arc::new(Registry::default());
        let (a, b) = pair_with(0, registry.clone());
        let n = SLOT_BYTES * 3 + 5;
        let src: Vec<u8> = (0..3 * n).map(|k| (k % 251) as u8).collect();
        let handle = registry.register(src.as_ptr(), src.len()).unwrap();
        let reg = registry.clone();
        let sender = std::thread::spawn(move || {
            let mut links = links(0, a);
            let c = cfg_with(0, reg.clone());
            // Three frames from the registered buffer (different offsets), then one after
            // deregistration, each followed by a reply so the buffer is reused only then.
            for round in 0..4 {
                if round == 3 {
                    reg.deregister(handle).unwrap();
                    assert_eq!(reg.stats().ranges, 0);
                }
                let at = [0, n, 2 * n - 3, 8][round];
                let sends = [SendReq {
                    peer: 1,
                    data: &src[at..at + n - round],
                }];
                engine::exchange(&mut links, &c, &desc(), &sends, &mut []).unwrap();
                if round < 3 {
                    assert_eq!(reg.stats().made, 1, "round {round}");
                }
                let mut ack = [0u8; 8];
                let mut recvs = [RecvReq::new(1, &mut ack)];
                engine::exchange(&mut links, &c, &desc(), &[], &mut recvs).unwrap();
            }
            src
        });
        let mut links = links(1, b);
        let c = cfg(1);
        let mut got = Vec::new();
        for round in 0..4 {
            let mut buf = vec![0u8; n - round];
            let mut recvs = [RecvReq::new(0, &mut buf)];
            engine::exchange(&mut links, &c, &desc(), &[], &mut recvs).unwrap();
            got.push(buf);
            let sends = [SendReq {
                peer: 0,
                data: &[1u8; 8],
            }];
            engine::exchange(&mut links, &c, &desc(), &sends, &mut []).unwrap();
        }
        let src = sender.join().unwrap();
        for (round, buf) in got.iter().enumerate() {
            let at = [0, n, 2 * n - 3, 8][round];
            assert!(buf[..] == src[at..at + n - round], "round {round}");
        }
    }

    /// A frame sent from a registered buffer that cannot finish (the peer reads nothing, so
    /// no credit returns) fails the exchange; the link then stops the device reading the
    /// buffer before the caller gets it back.
    #[test]
    fn an_abandoned_zero_copy_frame_stops_the_device_reading_the_buffer() {
        let registry = Arc::new(Registry::default());
        let (a, b) = pair_with(0, registry.clone());
        let src = vec![3u8; SLOT_BYTES * (SLOTS + 2)];
        let handle = registry.register(src.as_ptr(), src.len()).unwrap();
        let mut links = links(0, a);
        let mut c = cfg_with(0, registry.clone());
        c.timeout = Duration::from_millis(300);
        let sends = [SendReq {
            peer: 1,
            data: &src,
        }];
        let e = engine::exchange(&mut links, &c, &desc(), &sends, &mut []).unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
        let link = links[1].as_mut().unwrap();
        let again = link.send(0, [&[], &[1u8; 8], &[]]).unwrap_err().to_string();
        assert!(again.contains("abandoned half written"), "{again}");
        registry.deregister(handle).unwrap();
        drop(src);
        drop(links);
        drop(b);
    }

    #[test]
    fn an_abort_frame_reaches_the_peer_with_its_reason() {
        let (mut a, b) = pair();
        let reason = b"rank 0 failed: something broke";
        a.abort(&Header::abort(reason.len(), Some(3)).encode(), reason);
        let mut links = links(1, b);
        let mut got = vec![0u8; 16];
        let mut recvs = [RecvReq::new(0, &mut got)];
        let e = engine::exchange(&mut links, &cfg(1), &desc(), &[], &mut recvs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("peer aborted: rank 0 failed: something broke"),
            "{e}"
        );
        drop(a);
    }

    /// A send that fails finds the abort frame the peer queued behind a padded data frame
    /// this side had half read.
    #[test]
    fn a_queued_abort_frame_is_found_behind_a_half_read_frame() {
        let (mut a, mut b) = pair();
        let data = [7u8; 13];
        let head = Header {
            kind: FrameKind::Data,
            desc: desc(),
            len: 13,
        }
        .encode();
        let pad = [0u8; 3];
        assert_eq!(a.pad(13), 3);
        assert_eq!(a.send(0, [&head, &data, &pad]).unwrap(), 56);
        let mut h = [0u8; HEADER_LEN + 5];
        let deadline = Instant::now() + Duration::from_secs(10);
        assert!(b.read_exact(&mut h, deadline, None));
        let next = Header {
            kind: FrameKind::Data,
            desc: desc(),
            len: 8,
        }
        .encode();
        assert_eq!(a.send(0, [&next, &[1; 8], &[]]).unwrap(), 48);
        let reason = b"rank 0 failed: rank 3 is gone";
        a.abort(&Header::abort(reason.len(), Some(3)).encode(), reason);
        assert_eq!(
            b.pending_abort(&cfg(1), 0, 8, &[]),
            Some((String::from_utf8_lossy(reason).into_owned(), Some(3)))
        );
    }

    #[test]
    fn a_failed_write_names_the_peer_and_the_verbs_status() {
        let (a, b) = pair_failing(1);
        let mut links = links(0, a);
        let data = vec![1u8; 64];
        let sends = [SendReq {
            peer: 1,
            data: &data,
        }];
        let mut got = vec![0u8; 64];
        let mut recvs = [RecvReq::new(1, &mut got)];
        let e = engine::exchange(&mut links, &cfg(0), &desc(), &sends, &mut recvs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1") && e.contains("remote access error") && e.contains("emu0:1"),
            "{e}"
        );
        drop(b);
    }

    #[test]
    fn a_peer_whose_socket_closed_is_gone() {
        let (a, b) = pair();
        assert_eq!(a.gone(), None);
        drop(b);
        let start = Instant::now();
        while a.gone().is_none() && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(a.gone().unwrap().contains("its process is gone"));
        assert!(
            a.describe().starts_with("ib emulated emu0:1 (qp "),
            "{}",
            a.describe()
        );
    }

    #[test]
    fn parts_are_copied_across_their_boundaries() {
        let parts: [&[u8]; 3] = [b"head", b"payload", &[0, 0, 0]];
        for skip in 0..14 {
            for n in 0..=(14 - skip) {
                let mut out = vec![9u8; n];
                // SAFETY: `out` has `n` bytes and is not part of `parts`.
                unsafe { copy_out(&parts, skip, out.as_mut_ptr(), n) };
                assert_eq!(out, b"headpayload\0\0\0"[skip..skip + n].to_vec());
            }
        }
    }

    #[test]
    fn nothing_is_would_block_and_a_failure_comes_after_the_data() {
        assert_eq!(
            some_or(0, None).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        assert_eq!(some_or(5, Some(io::Error::other("x"))).unwrap(), 5);
        assert_eq!(
            some_or(0, Some(io::Error::other("boom")))
                .unwrap_err()
                .to_string(),
            "boom"
        );
    }
}
