//! The bootstrap root: collects every rank's hello and sends back the world table.
//!
//! One thread, one `poll` loop over the listener and the connections whose hello is still
//! incomplete; no thread per connection, so a stranger opening many connections costs little,
//! and none is waited on alone: a rank's hello is read as soon as it arrives, however many idle
//! or trickling strangers are connected. A connection gets `HELLO_TIMEOUT` to deliver its
//! hello; beyond `MAX_PENDING` incomplete ones, a new connection pushes out the oldest.
//! Outcomes:
//! - a connection with a wrong secret or a malformed hello is answered (best effort), logged at
//!   WARN with its address and dropped; the job goes on;
//! - a protocol-version mismatch, a rank out of range, a world-size mismatch or a rank joining
//!   twice fails the whole init: every joined rank gets the message, and so does every rank
//!   whose hello (with the right secret) arrives in the next 10 s (before the deadline); then
//!   the root exits;
//! - all ranks joined: every rank gets the same table and a fresh random comm id; the root exits;
//! - the deadline passed first: every connected rank gets a timeout naming the missing ranks.

use super::peer::{PeerInfo, World};
use super::wire::{self, ErrorKind, HELLO_HEAD_LEN, MAX_HELLO_LEN, MAX_WORLD_SIZE};
use super::PROTOCOL_VERSION;
use crate::error::{Error, Result};
use nix::poll::{poll, PollFd, PollFlags};
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// Longest a connection may take to deliver its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a failed root keeps answering late ranks with the failure (bounded by the deadline).
const LINGER: Duration = Duration::from_secs(10);
/// Most connections whose hello is still incomplete; a new one beyond pushes out the oldest.
const MAX_PENDING: usize = 1024;
/// Bound on each write of a reply.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Spawns the root server on `listener` in a detached thread.
///
/// The root accepts hellos carrying `secret` until every rank of the world joined (then it sends
/// the table to all) or until `deadline` (measured from now) passes (then it sends every
/// connected rank a timeout naming the missing ranks). Either way the thread then exits and the
/// listener is closed. Fails only if the listener cannot be made non-blocking or the thread
/// cannot be spawned.
pub fn spawn_root(listener: TcpListener, secret: [u8; 16], deadline: Duration) -> Result<()> {
    spawn_root_speaking(listener, secret, deadline, PROTOCOL_VERSION)
}

/// [`spawn_root`] speaking protocol `version` (tests simulate other versions).
pub(crate) fn spawn_root_speaking(
    listener: TcpListener,
    secret: [u8; 16],
    deadline: Duration,
    version: u32,
) -> Result<()> {
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("bootstrap root: local_addr of the listener", e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(format!("bootstrap root {addr}: set_nonblocking"), e))?;
    let root = Root {
        listener: Some(listener),
        addr,
        secret,
        version,
        deadline,
        end: Instant::now() + deadline,
        pending: Vec::new(),
        size: None,
        joined: Vec::new(),
        flood_warned: false,
        failed: None,
    };
    std::thread::Builder::new()
        .name("qccl-root".into())
        .spawn(move || root.run())
        .map_err(|e| {
            Error::io(
                format!("bootstrap root {addr}: spawning the root thread"),
                e,
            )
        })?;
    Ok(())
}

/// A connection whose hello is not complete yet.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    since: Instant,
    buf: Vec<u8>,
}

/// A rank that joined.
struct Joined {
    stream: TcpStream,
    from: SocketAddr,
    info: PeerInfo,
}

struct Root {
    /// None once the deadline (or a failed init's linger) passed: closed before the last
    /// answers are sent, so a rank that learns of them and tries again is refused at once
    /// instead of landing in the backlog of a listener about to close (which resets it:
    /// "closed without an answer").
    listener: Option<TcpListener>,
    addr: SocketAddr,
    secret: [u8; 16],
    version: u32,
    deadline: Duration,
    end: Instant,
    pending: Vec<Pending>,
    /// World size and the rank whose hello fixed it.
    size: Option<(usize, usize)>,
    /// Indexed by rank once the size is known.
    joined: Vec<Option<Joined>>,
    flood_warned: bool,
    /// Set once the init failed: later hellos (with the right secret) get this answer until
    /// `end`, so a rank that connects after the failure learns why instead of timing out.
    failed: Option<(ErrorKind, String)>,
}

/// What reading one pending connection gave.
enum Read1 {
    Incomplete,
    /// Closed without sending anything (a port scan, a health check): dropped quietly.
    Closed,
    Drop(String),
    Hello(Vec<u8>),
}

/// What a hello did to the world.
enum Verdict {
    Continue,
    Fail(String, TcpStream),
    Complete,
}

impl Root {
    fn run(mut self) {
        crate::qlog!(
            Info,
            "bootstrap root listening on {}, init deadline {} ms",
            self.addr,
            self.deadline.as_millis()
        );
        loop {
            let now = Instant::now();
            if now >= self.end {
                self.close();
                return;
            }
            self.wait(self.end - now);
            self.accept_all();
            let mut i = 0;
            while i < self.pending.len() {
                match read_some(&mut self.pending[i]) {
                    Read1::Incomplete => {
                        if self.pending[i].since.elapsed() > HELLO_TIMEOUT {
                            let p = self.pending.swap_remove(i);
                            crate::qlog!(
                                Warn,
                                "bootstrap root {}: dropping the connection from {}: no hello \
                                 within {} ms",
                                self.addr,
                                p.from,
                                HELLO_TIMEOUT.as_millis()
                            );
                        } else {
                            i += 1;
                        }
                    }
                    Read1::Closed => {
                        let p = self.pending.swap_remove(i);
                        crate::qlog!(
                            Trace,
                            "bootstrap root {}: {} closed without a hello",
                            self.addr,
                            p.from
                        );
                    }
                    Read1::Drop(why) => {
                        let p = self.pending.swap_remove(i);
                        self.reject(p.stream, p.from, &why);
                    }
                    Read1::Hello(body) => {
                        let p = self.pending.swap_remove(i);
                        match self.on_hello(p.stream, p.from, &body) {
                            Verdict::Continue => {}
                            Verdict::Fail(msg, offender) => {
                                self.fail(ErrorKind::Usage, &msg, Some(offender));
                                // Linger (bounded) to answer ranks that are still on their way.
                                self.end = self.end.min(Instant::now() + LINGER);
                            }
                            Verdict::Complete => {
                                self.send_table();
                                return;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Blocks until the listener or a pending connection is readable, or at most 100 ms.
    fn wait(&self, left: Duration) {
        let ms = left.as_millis().clamp(1, 100) as u16;
        let mut fds = Vec::with_capacity(1 + self.pending.len());
        if let Some(l) = &self.listener {
            fds.push(PollFd::new(l.as_fd(), PollFlags::POLLIN));
        }
        for p in &self.pending {
            fds.push(PollFd::new(p.stream.as_fd(), PollFlags::POLLIN));
        }
        if let Err(e) = poll(&mut fds, ms) {
            if e != nix::errno::Errno::EINTR {
                crate::qlog!(Warn, "bootstrap root {}: poll: {e}", self.addr);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn accept_all(&mut self) {
        let Some(listener) = &self.listener else {
            return;
        };
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    if self.pending.len() >= MAX_PENDING {
                        // Push out the oldest: a rank sends its hello as soon as it connected,
                        // so the connection waiting longest is the likeliest stranger (refusing
                        // the newcomer instead would let idle strangers lock the ranks out).
                        let oldest = (0..self.pending.len())
                            .min_by_key(|&i| self.pending[i].since)
                            .expect("MAX_PENDING > 0");
                        let old = self.pending.swap_remove(oldest);
                        if !self.flood_warned {
                            crate::qlog!(
                                Warn,
                                "bootstrap root {}: {MAX_PENDING} connections without a hello \
                                 yet; dropping the oldest ({} and others) for newer ones",
                                self.addr,
                                old.from
                            );
                            self.flood_warned = true;
                        }
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        crate::qlog!(Warn, "bootstrap root {}: {from}: {e}", self.addr);
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    crate::qlog!(
                        Trace,
                        "bootstrap root {}: connection from {from}",
                        self.addr
                    );
                    self.pending.push(Pending {
                        stream,
                        from,
                        since: Instant::now(),
                        buf: Vec::new(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // ECONNABORTED, EMFILE, ...: keep serving the connections we have.
                    crate::qlog!(Warn, "bootstrap root {}: accept: {e}", self.addr);
                    return;
                }
            }
        }
    }

    /// Answers a stranger or a malformed hello and drops the connection; the job goes on.
    fn reject(&self, stream: TcpStream, from: SocketAddr, why: &str) {
        crate::qlog!(
            Warn,
            "bootstrap root {}: rejected the connection from {from}: {why}",
            self.addr
        );
        send(stream, &wire::encode_error(ErrorKind::Usage, why));
    }

    fn on_hello(&mut self, stream: TcpStream, from: SocketAddr, body: &[u8]) -> Verdict {
        let hello = match wire::decode_hello(body, self.version) {
            Ok(h) => h,
            Err(e) => {
                self.reject(stream, from, &format!("not a qccl bootstrap hello: {e}"));
                return Verdict::Continue;
            }
        };
        // The secret first: a stranger must never be able to fail the job.
        if hello.secret != self.secret {
            crate::qlog!(
                Warn,
                "bootstrap root {}: rejected a hello with a wrong secret from {from} \
                 (rank {} of {}: a process of another job?)",
                self.addr,
                hello.rank,
                hello.size
            );
            send(
                stream,
                &wire::encode_error(
                    ErrorKind::Usage,
                    "wrong secret: this id belongs to another job",
                ),
            );
            return Verdict::Continue;
        }
        if let Some((kind, msg)) = &self.failed {
            send(stream, &wire::encode_error(*kind, msg));
            return Verdict::Continue;
        }
        let (rank, size) = (hello.rank as usize, hello.size as usize);
        if hello.version != self.version {
            return Verdict::Fail(
                format!(
                    "rank {rank} speaks protocol version {}, root speaks {} (from {from})",
                    hello.version, self.version
                ),
                stream,
            );
        }
        let Some(info) = hello.tail else {
            // decode_hello parses the tail whenever the versions agree.
            return Verdict::Fail(format!("rank {rank}: hello without body"), stream);
        };
        if size == 0 || size > MAX_WORLD_SIZE {
            return Verdict::Fail(
                format!("rank {rank} says world size {size}, outside 1..={MAX_WORLD_SIZE} (from {from})"),
                stream,
            );
        }
        if rank >= size {
            return Verdict::Fail(
                format!("rank {rank} is out of range for world size {size} (from {from})"),
                stream,
            );
        }
        match self.size {
            None => {
                self.size = Some((size, rank));
                self.joined = (0..size).map(|_| None).collect();
            }
            Some((s0, r0)) if s0 != size => {
                return Verdict::Fail(
                    format!("rank {rank} says world size {size} but rank {r0} said {s0}"),
                    stream,
                );
            }
            Some(_) => {}
        }
        if let Some(prev) = &self.joined[rank] {
            return Verdict::Fail(
                format!("rank {rank} joined twice (from {} and {from})", prev.from),
                stream,
            );
        }
        crate::qlog!(
            Trace,
            "bootstrap root {}: rank {rank} of {size} joined from {from} (host {}, pid {}, \
             transport {})",
            self.addr,
            info.host_id,
            info.pid,
            info.addr
        );
        self.joined[rank] = Some(Joined { stream, from, info });
        if self.joined.iter().all(Option::is_some) {
            Verdict::Complete
        } else {
            Verdict::Continue
        }
    }

    fn send_table(self) {
        let comm_id = loop {
            let id: u64 = rand::random();
            if id != 0 {
                break id;
            }
        };
        let (streams, peers): (Vec<TcpStream>, Vec<PeerInfo>) = self
            .joined
            .into_iter()
            .flatten()
            .map(|j| (j.stream, j.info))
            .unzip();
        let frame = wire::encode_table(&World { comm_id, peers });
        crate::qlog!(
            Info,
            "bootstrap root {}: all {} ranks joined; comm id {comm_id:#018x}",
            self.addr,
            streams.len()
        );
        for s in streams {
            send(s, &frame);
        }
    }

    /// Fails the init: every joined rank (and `offender`) gets `msg`, and so does every later
    /// hello.
    fn fail(&mut self, kind: ErrorKind, msg: &str, offender: Option<TcpStream>) {
        crate::qlog!(Warn, "bootstrap root {}: init failed: {msg}", self.addr);
        let frame = wire::encode_error(kind, msg);
        let joined = std::mem::take(&mut self.joined)
            .into_iter()
            .flatten()
            .map(|j| j.stream);
        for s in joined.chain(offender) {
            send(s, &frame);
        }
        self.failed = Some((kind, msg.to_string()));
    }

    /// The deadline (or a failed init's linger) ran out: who connected in time hears why, who
    /// comes later is refused.
    fn close(mut self) {
        self.accept_all();
        self.listener = None;
        let (kind, msg) = match self.failed.take() {
            Some(failed) => failed,
            None => {
                let msg = self.deadline_message();
                self.fail(ErrorKind::Timeout, &msg, None);
                (ErrorKind::Timeout, msg)
            }
        };
        let frame = wire::encode_error(kind, &msg);
        for p in std::mem::take(&mut self.pending) {
            send(p.stream, &frame);
        }
    }

    /// What the ranks hear when the deadline passed before all joined.
    fn deadline_message(&self) -> String {
        let ms = self.deadline.as_millis();
        match self.size {
            None => format!("init deadline of {ms} ms passed: no rank joined"),
            Some((size, _)) => {
                let missing: Vec<usize> = (0..size).filter(|&r| self.joined[r].is_none()).collect();
                format!(
                    "init deadline of {ms} ms passed: ranks {} did not join",
                    rank_list(&missing)
                )
            }
        }
    }
}

/// `[1, 2, 5]`, or the first 32 followed by `... (N in all)`.
fn rank_list(ranks: &[usize]) -> String {
    const SHOW: usize = 32;
    if ranks.len() <= SHOW {
        return format!("{ranks:?}");
    }
    let head: Vec<String> = ranks[..SHOW].iter().map(usize::to_string).collect();
    format!("[{}, ... ({} in all)]", head.join(", "), ranks.len())
}

/// Reads what is available on a pending connection, never past the end of one hello frame.
fn read_some(p: &mut Pending) -> Read1 {
    let mut tmp = [0u8; 1024];
    loop {
        match wire::frame_complete(&p.buf, MAX_HELLO_LEN) {
            Err(why) => return Read1::Drop(format!("not a qccl bootstrap hello: {why}")),
            Ok(Some(len)) => {
                if len < HELLO_HEAD_LEN {
                    return Read1::Drop(format!(
                        "not a qccl bootstrap hello: {len} bytes is shorter than any hello"
                    ));
                }
                return Read1::Hello(p.buf[4..4 + len].to_vec());
            }
            Ok(None) => {}
        }
        // Read no further than the announced frame (or its length prefix).
        let want = if p.buf.len() < 4 {
            4 - p.buf.len()
        } else {
            let len = u32::from_le_bytes([p.buf[0], p.buf[1], p.buf[2], p.buf[3]]) as usize;
            4 + len - p.buf.len()
        };
        let n = want.min(tmp.len());
        match p.stream.read(&mut tmp[..n]) {
            Ok(0) if p.buf.is_empty() => return Read1::Closed,
            Ok(0) => {
                return Read1::Drop(format!(
                    "connection closed after {} bytes of a hello",
                    p.buf.len()
                ))
            }
            Ok(k) => p.buf.extend_from_slice(&tmp[..k]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Read1::Incomplete,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Read1::Drop(format!("read error: {e}")),
        }
    }
}

/// Sends one frame, best effort, then closes our side.
fn send(stream: TcpStream, frame: &[u8]) {
    let mut stream = stream;
    let res = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_write_timeout(Some(WRITE_TIMEOUT)))
        .and_then(|()| wire::write_frame(&mut stream, frame));
    if let Err(e) = res {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        crate::qlog!(
            Trace,
            "bootstrap root: could not send a reply to {peer}: {e}"
        );
    }
    let _ = stream.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw_join(addr: SocketAddr, secret: [u8; 16], rank: usize, size: u32) -> wire::Reply {
        let me = PeerInfo {
            rank,
            host_id: "h".into(),
            machine_id: "m".into(),
            addr: "127.0.0.1:9".parse().unwrap(),
            pid: 1,
            cpus: vec![0],
            rdma: false,
            cuda_ipc: false,
        };
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        wire::write_frame(
            &mut s,
            &wire::encode_hello(crate::bootstrap::PROTOCOL_VERSION, &secret, &me, size),
        )
        .unwrap();
        wire::decode_reply(&wire::read_frame(&mut s, wire::MAX_REPLY_LEN).unwrap()).unwrap()
    }

    #[test]
    fn root_checks_ranks_itself() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        spawn_root(listener, [3; 16], Duration::from_secs(3)).unwrap();
        // A hello the rank side would have refused to send.
        match raw_join(addr, [3; 16], 5, 3) {
            wire::Reply::Error { kind, msg } => {
                assert_eq!(kind, ErrorKind::Usage);
                assert!(
                    msg.contains("rank 5 is out of range for world size 3"),
                    "{msg}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn world_of_one_by_hand() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        spawn_root(listener, [4; 16], Duration::from_secs(3)).unwrap();
        match raw_join(addr, [4; 16], 0, 1) {
            wire::Reply::Table(w) => {
                assert_eq!(w.peers.len(), 1);
                assert_ne!(w.comm_id, 0);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rank_lists_are_bounded() {
        assert_eq!(rank_list(&[2]), "[2]");
        assert_eq!(rank_list(&[1, 3]), "[1, 3]");
        let many: Vec<usize> = (0..100).collect();
        let s = rank_list(&many);
        assert!(
            s.starts_with("[0, 1, 2,") && s.ends_with("31, ... (100 in all)]"),
            "{s}"
        );
    }
}
