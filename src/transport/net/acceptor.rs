//! The listening side of a TCP comm: a thread that accepts, checks each hello, sets up the
//! shared-memory or RDMA link of a peer whose pair uses one, and hands verified connections to
//! the transport.
//! Doing both halves of the accepting side here means a rank that connects never waits on
//! the other rank's main thread (which may itself be connecting elsewhere), so lazy
//! connection cannot deadlock.
//!
//! Strangers (anything that can reach the listener: port scanners, health checks, another
//! job's ranks) must not delay a peer. So the thread never blocks on one connection: it polls
//! the listener and every connection whose hello is still incomplete, and reads from each
//! only what has arrived, never beyond the fixed-size hello. A connection gets
//! [`HELLO_TIMEOUT`] from its accept to deliver a valid hello (secret, version, comm id), else
//! it is dropped; at most [`MAX_UNVERIFIED`] such connections wait at a time, and a new one
//! beyond that pushes out the oldest (a real peer sends its hello as soon as it connected, so
//! the oldest waiting connection is the likeliest stranger). A verified peer's shared-memory or
//! RDMA setup, which waits on that peer, runs in a thread of its own so it cannot hold up the
//! others either.

use super::handshake::{self, HELLO_LEN};
use super::select::Kind;
use crate::error::{Error, Result};
use crate::log::Level;
use crate::transport::ib::setup::{self as ib_setup, Conn, IbNet};
use crate::transport::shm::{self, Rings};
use crate::transport::stall::Inspector;
use crossbeam_channel::{unbounded, Receiver, Sender};
use nix::poll::{poll, PollFd, PollFlags};
use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an accepted connection may take to deliver its hello. A peer writes the hello
/// right after its connect returns, so on a loaded machine it still arrives in milliseconds.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Most accepted connections whose hello is incomplete, per listener; a new one beyond this
/// pushes out the oldest.
pub const MAX_UNVERIFIED: usize = 64;
/// Bound on each read of a verified peer's shared-memory or RDMA setup.
const SHM_SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What a pair's link needs that is set up over its first socket.
pub enum Prepared {
    /// The shared-memory rings.
    Shm(Rings),
    /// The RDMA queue pair and slot rings.
    Ib(Conn),
}

/// A verified incoming connection: peer rank, socket index, stream, and what was set up over
/// it when the pair talks over shared memory or RDMA (on its first socket).
pub type Incoming = (usize, usize, TcpStream, Option<Prepared>);

/// The accept thread; stops (and closes the listener) when dropped.
pub struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Verified connections, in arrival order.
    pub incoming: Receiver<Incoming>,
}

/// What the accept thread knows of the comm.
struct Job {
    secret: [u8; 16],
    comm_id: u64,
    size: usize,
    me: usize,
    kinds: Vec<Kind>,
    ib: Option<Arc<IbNet>>,
    inspector: Arc<Inspector>,
}

/// An accepted connection whose hello is not complete yet.
struct Unverified {
    stream: TcpStream,
    from: SocketAddr,
    since: Instant,
    hello: [u8; HELLO_LEN],
    got: usize,
}

/// What reading an unverified connection gave.
enum Step {
    /// Nothing more yet, and its time is not up.
    Wait,
    /// A complete hello that passed the checks and was acknowledged: peer rank, socket.
    Verified(usize, usize),
    /// Dropped, and why: a bad hello (logged at WARN), a silent or slow one (INFO), or
    /// closed before sending anything (TRACE: port scans, health checks).
    Drop(Level, String),
}

impl Acceptor {
    /// Starts accepting on `listener` for comm `comm_id` of `size` ranks, whose pairs with
    /// this rank use links of `kinds` (RDMA ones over `ib`); probes get `inspector`'s status,
    /// and once it says the comm failed, peers are refused.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        listener: TcpListener,
        secret: [u8; 16],
        comm_id: u64,
        size: usize,
        me: usize,
        kinds: Vec<Kind>,
        ib: Option<Arc<IbNet>>,
        inspector: Arc<Inspector>,
    ) -> Result<Acceptor> {
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting the listener non-blocking", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, incoming) = unbounded();
        let stop2 = stop.clone();
        let job = Job {
            secret,
            comm_id,
            size,
            me,
            kinds,
            ib,
            inspector,
        };
        let thread = std::thread::Builder::new()
            .name(format!("qccl-accept-{me}"))
            .spawn(move || job.serve(&listener, &stop2, &tx))
            .map_err(|e| Error::io("spawning the accept thread", e))?;
        Ok(Acceptor {
            stop,
            thread: Some(thread),
            incoming,
        })
    }
}

impl Job {
    /// The accept loop: until `stop`, or until the transport is gone.
    fn serve(&self, listener: &TcpListener, stop: &AtomicBool, tx: &Sender<Incoming>) {
        let me = self.me;
        let mut waiting: VecDeque<Unverified> = VecDeque::new();
        let mut pushed_out = 0usize;
        let _stopped = Stopped(&self.inspector);
        while !stop.load(Ordering::Relaxed) && !self.inspector.listener_released() {
            // Sleep until the listener or a waiting connection is readable, or the earliest
            // hello deadline, or 100 ms (to see `stop`).
            let ms = waiting
                .front()
                .map_or(Duration::from_millis(100), |u| {
                    (u.since + HELLO_TIMEOUT).saturating_duration_since(Instant::now())
                })
                .clamp(Duration::from_millis(1), Duration::from_millis(100));
            {
                let mut fds: Vec<PollFd<'_>> = std::iter::once(listener.as_fd())
                    .chain(waiting.iter().map(|u| u.stream.as_fd()))
                    .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
                    .collect();
                if let Err(e) = poll(&mut fds, ms.as_millis() as u16) {
                    if e != nix::errno::Errno::EINTR {
                        crate::qlog!(Warn, "rank {me}: accept thread: poll: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            self.accept_all(listener, &mut waiting, &mut pushed_out);
            let mut i = 0;
            while i < waiting.len() {
                match self.step(&mut waiting[i]) {
                    Step::Wait => i += 1,
                    Step::Drop(level, why) => {
                        let u = waiting.remove(i).expect("index in range");
                        crate::qlog!(
                            level = level,
                            "rank {me}: dropped the connection from {}: {why}",
                            u.from
                        );
                    }
                    Step::Verified(rank, sock) => {
                        let u = waiting.remove(i).expect("index in range");
                        if !self.hand_over(rank, sock, u.stream, tx) {
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Accepts every connection the listener holds, pushing out the oldest waiting ones
    /// beyond [`MAX_UNVERIFIED`].
    fn accept_all(
        &self,
        listener: &TcpListener,
        waiting: &mut VecDeque<Unverified>,
        pushed_out: &mut usize,
    ) {
        let me = self.me;
        loop {
            let (stream, from) = match listener.accept() {
                Ok(a) => a,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ECONNABORTED, EMFILE, ...: keep serving the connections we have.
                    crate::qlog!(Warn, "rank {me}: accept: {e}");
                    return;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                crate::qlog!(Warn, "rank {me}: connection from {from}: {e}");
                continue;
            }
            crate::qlog!(Trace, "rank {me}: connection from {from}");
            if waiting.len() >= MAX_UNVERIFIED {
                let old = waiting.pop_front().expect("MAX_UNVERIFIED > 0");
                *pushed_out += 1;
                // Once loudly, then quietly: a flood must not flood the log too.
                let msg = format!(
                    "rank {me}: {MAX_UNVERIFIED} connections without a hello yet; dropped the \
                     oldest, from {} ({pushed_out} so far)",
                    old.from
                );
                if *pushed_out == 1 {
                    crate::qlog!(Warn, "{msg}");
                } else {
                    crate::qlog!(Trace, "{msg}");
                }
            }
            waiting.push_back(Unverified {
                stream,
                from,
                since: Instant::now(),
                hello: [0; HELLO_LEN],
                got: 0,
            });
        }
    }

    /// Reads what has arrived of `u`'s hello (never more), checks and acknowledges it when
    /// complete, and drops it when its time is up.
    fn step(&self, u: &mut Unverified) -> Step {
        while u.got < HELLO_LEN {
            match u.stream.read(&mut u.hello[u.got..]) {
                Ok(0) if u.got == 0 => {
                    return Step::Drop(Level::Trace, "closed without a hello".into())
                }
                Ok(0) => {
                    return Step::Drop(
                        Level::Info,
                        format!("closed after {} bytes of a hello", u.got),
                    )
                }
                Ok(n) => u.got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if u.since.elapsed() < HELLO_TIMEOUT {
                        return Step::Wait;
                    }
                    return Step::Drop(
                        Level::Info,
                        format!(
                            "no complete hello within {} ms ({} of {HELLO_LEN} bytes)",
                            HELLO_TIMEOUT.as_millis(),
                            u.got
                        ),
                    );
                }
                Err(e) => return Step::Drop(Level::Info, format!("reading the hello: {e}")),
            }
        }
        let (rank, sock) = match handshake::verify(&u.hello, &self.secret, self.comm_id, self.size)
        {
            Ok(v) => v,
            Err(why) => {
                // Once the comm failed, the survivors' shrink joins come here too until this
                // rank shrinks: not worth a warning.
                let level = if self.inspector.failed() {
                    Level::Info
                } else {
                    Level::Warn
                };
                return Step::Drop(level, format!("refused: {why}"));
            }
        };
        if sock == handshake::PROBE_SOCK {
            // A fresh non-blocking socket: the status (at most a few KiB) fits its buffer.
            let _ = u.stream.write(&self.inspector.status());
            return Step::Drop(Level::Trace, format!("answered rank {rank}'s probe"));
        }
        let failed = self.inspector.failed();
        if let Err(why) = handshake::answer(&mut u.stream, !failed) {
            return Step::Drop(Level::Info, why);
        }
        if failed {
            return Step::Drop(
                Level::Info,
                format!("rank {rank} connects, but this comm has failed"),
            );
        }
        Step::Verified(rank, sock as usize)
    }

    /// Hands a verified connection to the transport: at once, or after the shared-memory or
    /// RDMA setup (in a thread of its own) on the first socket of a pair that uses one. False
    /// once the transport is gone.
    fn hand_over(&self, rank: usize, sock: usize, s: TcpStream, tx: &Sender<Incoming>) -> bool {
        let kind = self.kinds[rank];
        if sock != 0 || kind == Kind::Socket {
            return tx.send((rank, sock, s, None)).is_ok();
        }
        let (me, comm_id, tx, ib) = (self.me, self.comm_id, tx.clone(), self.ib.clone());
        let setup = move || {
            let mut s = s;
            let link = s
                .set_nonblocking(false)
                .and_then(|()| s.set_read_timeout(Some(SHM_SETUP_TIMEOUT)))
                .map_err(|e| Error::io("configuring the setup socket", e))
                .and_then(|()| match (kind, &ib) {
                    (Kind::Ib, Some(net)) => ib_setup::connect(net, &mut s).map(Prepared::Ib),
                    (Kind::Ib, None) => Err(Error::Internal("an RDMA pair without a port".into())),
                    _ => shm::setup(&mut s, comm_id, me, rank).map(Prepared::Shm),
                });
            match link {
                Ok(l) => {
                    let _ = tx.send((rank, sock, s, Some(l)));
                }
                Err(e) => {
                    crate::qlog!(
                        Warn,
                        "rank {me}: {kind:?} setup with rank {rank} failed: {e}"
                    )
                }
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name(format!("qccl-link-setup-{me}-{rank}"))
            .spawn(setup)
        {
            crate::qlog!(
                Warn,
                "rank {me}: spawning the link setup thread for rank {rank}: {e}"
            );
        }
        true
    }
}

/// Tells the inspector, however the accept loop ends, that the thread no longer accepts.
struct Stopped<'a>(&'a Inspector);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        self.0.accept_thread_stopped();
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: [u8; 16] = [7; 16];
    const COMM: u64 = 0x1234;

    /// An acceptor for rank 1 of 2 (rank 0 connects to it) and its address.
    fn acceptor() -> (Acceptor, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let inspector = Arc::new(Inspector::new(1, SECRET, COMM, vec![addr, addr]));
        let a = Acceptor::spawn(
            listener,
            SECRET,
            COMM,
            2,
            1,
            vec![Kind::Socket; 2],
            None,
            inspector,
        )
        .unwrap();
        (a, addr)
    }

    fn hello() -> handshake::Hello {
        handshake::Hello {
            secret: SECRET,
            comm_id: COMM,
            rank: 0,
            sock: 0,
        }
    }

    /// Rank 0's connection, hello sent and acknowledged.
    fn peer(addr: SocketAddr) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        handshake::connect(&mut s, &hello()).unwrap();
        s
    }

    /// Waits (bounded) until the acceptor closed `s`: true on end of file or reset.
    fn closed(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        matches!(s.read(&mut [0u8; 64]), Ok(0) | Err(_))
    }

    #[test]
    fn a_peer_is_verified_behind_more_idle_strangers_than_the_cap() {
        let (a, addr) = acceptor();
        let extra = 10;
        let mut strangers: Vec<TcpStream> = (0..MAX_UNVERIFIED + extra)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let connected = Instant::now();
        let _ours = peer(addr);
        let (rank, sock, _, link) = a.incoming.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!((rank, sock), (0, 0));
        assert!(link.is_none());
        // The oldest strangers were pushed out for the newer ones, which stay until their
        // deadline (checked only while it cannot have passed: the machine may be loaded).
        assert!(closed(&mut strangers[0]));
        let newest = strangers.last_mut().unwrap();
        newest.set_nonblocking(true).unwrap();
        let open =
            matches!(newest.read(&mut [0u8; 1]), Err(e) if e.kind() == ErrorKind::WouldBlock);
        assert!(open || connected.elapsed() >= HELLO_TIMEOUT);
        assert!(closed(newest));
    }

    #[test]
    fn nothing_past_the_hello_is_read_before_the_handover() {
        let (a, addr) = acceptor();
        let mut s = TcpStream::connect(addr).unwrap();
        // Hello and the first frame bytes in one write.
        let mut bytes = hello().encode().to_vec();
        bytes.extend_from_slice(b"frame");
        s.write_all(&bytes).unwrap();
        let (_, _, mut theirs, _) = a.incoming.recv_timeout(Duration::from_secs(30)).unwrap();
        theirs.set_nonblocking(false).unwrap();
        let mut got = [0u8; 5];
        theirs.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"frame");
    }

    #[test]
    fn silent_and_trickling_strangers_are_dropped_at_the_hello_deadline() {
        let (_a, addr) = acceptor();
        let start = Instant::now();
        let mut idle = TcpStream::connect(addr).unwrap();
        assert!(closed(&mut idle));
        // The deadline counts from the accept, which follows the connect.
        assert!(start.elapsed() >= HELLO_TIMEOUT, "{:?}", start.elapsed());
        // One byte every 200 ms would take 8 s to complete a hello: a byte does not extend
        // the deadline, so the acceptor hangs up first.
        let mut trickle = TcpStream::connect(addr).unwrap();
        trickle.set_nonblocking(true).unwrap();
        let mut sent = 0;
        let hung_up = loop {
            match trickle.read(&mut [0u8; 1]) {
                Ok(0) => break true,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                _ => break true,
            }
            if sent == HELLO_LEN - 1 {
                break false;
            }
            if trickle.write_all(&[0x53]).is_err() {
                break true;
            }
            sent += 1;
            std::thread::sleep(Duration::from_millis(200));
        };
        assert!(hung_up, "the acceptor waited for {sent} trickled bytes");
    }
}

/// The stall inspector's probes, answered by real accept threads.
#[cfg(test)]
mod probe_tests {
    use super::*;
    use crate::transport::frame::{CollKind, OpDesc};
    use crate::transport::stall::Stalled;
    use std::time::Duration;

    const SECRET: [u8; 16] = [9; 16];
    const COMM: u64 = 0x5678;

    fn desc() -> OpDesc {
        OpDesc {
            coll: CollKind::Barrier,
            dtype: 1,
            op: 0,
            algo: 0,
            root: 0,
            count: 0,
        }
    }

    /// Rank 1 of 3 behind an accept thread; rank 2's address is `two`.
    fn rank1(two: SocketAddr) -> (Acceptor, Arc<Inspector>, Vec<SocketAddr>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addrs = vec!["127.0.0.1:9".parse().unwrap(), l.local_addr().unwrap(), two];
        let i = Arc::new(Inspector::new(1, SECRET, COMM, addrs.clone()));
        let a = Acceptor::spawn(
            l,
            SECRET,
            COMM,
            3,
            1,
            vec![Kind::Socket; 3],
            None,
            i.clone(),
        )
        .unwrap();
        (a, i, addrs)
    }

    /// Rank 0's diagnosis of a wait on rank 1.
    fn diagnose(addrs: &[SocketAddr]) -> (String, Option<usize>) {
        let me = Inspector::new(0, SECRET, COMM, addrs.to_vec());
        let s = Stalled {
            what: "receive from rank 1 stalled in barrier".into(),
            ..Stalled::on(desc(), vec![1])
        };
        let e = me.diagnose(Duration::from_millis(3000), &AtomicBool::new(false), s);
        (e.to_string(), me.culprit())
    }

    #[test]
    fn the_inspector_follows_the_waits_to_the_rank_that_does_not_answer() {
        // Rank 2: a listener whose process never accepts (the kernel still completes the
        // connection), as a stopped process's.
        let stopped = TcpListener::bind("127.0.0.1:0").unwrap();
        let (_a, one, addrs) = rank1(stopped.local_addr().unwrap());
        one.waiting(&Stalled::on(desc(), vec![2]), Instant::now());
        let (err, culprit) = diagnose(&addrs);
        let want = format!(
            "timeout: rank 0: rank 2 ({}) made no progress for 3000 ms (QCCL_TIMEOUT_MS) and \
             does not answer (stopped, or hung?) (rank 1 waits on rank 2); here: receive from \
             rank 1 stalled in barrier",
            addrs[2]
        );
        assert_eq!(err, want);
        assert_eq!(culprit, Some(2));
    }

    #[test]
    fn a_rank_that_waits_on_nothing_is_named_as_not_waiting() {
        let (_a, one, addrs) = rank1("127.0.0.1:9".parse().unwrap());
        one.waiting(&Stalled::on(desc(), vec![2]), Instant::now());
        one.done();
        let (err, culprit) = diagnose(&addrs);
        assert!(
            err.contains(&format!(
                "rank 1 ({}) made no progress for 3000 ms (QCCL_TIMEOUT_MS): it is not waiting \
                 in this comm",
                addrs[1]
            )),
            "{err}"
        );
        assert_eq!(culprit, Some(1));
    }

    #[test]
    fn a_failed_rank_passes_its_culprit_on_and_refuses_new_peers() {
        let stopped = TcpListener::bind("127.0.0.1:0").unwrap();
        let (_a, one, addrs) = rank1(stopped.local_addr().unwrap());
        one.blame(2);
        one.fail("rank 1 failed: timeout");
        let (err, culprit) = diagnose(&addrs);
        assert!(
            err.contains(&format!(
                "rank 2 ({}) made no progress for 3000 ms (QCCL_TIMEOUT_MS), as rank 1 found",
                addrs[2]
            )),
            "{err}"
        );
        assert_eq!(culprit, Some(2));
        // A peer's connection is answered with a refusal, not left to time out.
        let mut s = TcpStream::connect(addrs[1]).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let hello = handshake::Hello {
            secret: SECRET,
            comm_id: COMM,
            rank: 0,
            sock: 0,
        };
        let e = handshake::connect(&mut s, &hello).unwrap_err().to_string();
        assert!(e.contains("the peer's comm has failed"), "{e}");
    }

    #[test]
    fn a_rank_whose_listener_is_closed_is_named_as_gone() {
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let gone = closed.local_addr().unwrap();
        drop(closed);
        let (_a, one, addrs) = rank1(gone);
        one.waiting(&Stalled::on(desc(), vec![2]), Instant::now());
        let (err, culprit) = diagnose(&addrs);
        assert!(
            err.contains(&format!("rank 2 ({gone}) made no progress")) && err.contains("refuses"),
            "{err}"
        );
        assert_eq!(culprit, Some(2));
    }
}
