//! The network transport: one or more TCP sockets per peer pair (QCCL_NSOCKS_PERPEER), opened
//! lazily on first use (the lower rank connects, the higher rank's accept thread verifies the
//! hello), then driven non-blocking by `progress`. For a peer on the same host the verified
//! connection sets up a shared-memory link (`transport::shm`) and frames travel through its
//! rings instead; the socket stays open only as the setup channel.

mod acceptor;
pub mod handshake;
pub mod progress;

use super::frame::{Header, OpDesc};
use super::shm::arena::{self, Arena};
use super::shm::{self, ShmLink};
use super::stall::{self, Inspector, Stalled};
use super::{LinkConfig, RecvReq, SendReq, Transport};
use crate::error::{Error, Result};
use acceptor::Acceptor;
use std::collections::HashMap;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Socket buffer size asked for (root may exceed the kernel's default cap).
const SOCKET_BUF: usize = 4 << 20;

/// The sockets to one peer.
pub struct Conn {
    /// One or more streams; frame headers travel on the first.
    pub socks: Vec<TcpStream>,
    /// The peer's listening address, for messages.
    pub addr: SocketAddr,
    /// True while a frame is half-sent on the first socket (or the shm ring).
    pub mid_frame: bool,
    /// The shared-memory link, for a peer on this host: frames go through it.
    pub shm: Option<ShmLink>,
}

impl Conn {
    /// Byte streams a frame's payload is split over: the sockets, or the one shm ring.
    pub fn streams(&self) -> usize {
        if self.shm.is_some() {
            1
        } else {
            self.socks.len()
        }
    }
}

/// Incoming sockets of a peer whose set is not complete yet, and its shm link.
type Stash = (Vec<Option<TcpStream>>, Option<ShmLink>);

/// One rank's TCP endpoint of a comm.
pub struct TcpTransport {
    cfg: LinkConfig,
    secret: [u8; 16],
    comm_id: u64,
    peers: Vec<SocketAddr>,
    nsocks: usize,
    conns: Vec<Option<Conn>>,
    /// Lives as long as the transport: after an abort it refuses peers and answers probes.
    acceptor: Acceptor,
    stash: HashMap<usize, Stash>,
    shm_peers: Vec<bool>,
    arena: Option<Arena>,
    aborted: bool,
}

impl TcpTransport {
    /// A transport that accepts on `listener` (its address is `peers[cfg.rank]`) and reaches
    /// peer `i` at `peers[i]`, through shared memory where `shm_peers[i]`.
    pub fn new(
        listener: TcpListener,
        peers: Vec<SocketAddr>,
        comm_id: u64,
        secret: [u8; 16],
        nsocks: usize,
        shm_peers: Vec<bool>,
        mut cfg: LinkConfig,
    ) -> Result<TcpTransport> {
        let inspector = Arc::new(Inspector::new(cfg.rank, secret, comm_id, peers.clone()));
        cfg.inspector = Some(inspector.clone());
        let acceptor = Acceptor::spawn(
            listener,
            secret,
            comm_id,
            cfg.size,
            cfg.rank,
            shm_peers.clone(),
            inspector,
        )?;
        Ok(TcpTransport {
            conns: (0..cfg.size).map(|_| None).collect(),
            cfg,
            secret,
            comm_id,
            peers,
            nsocks: nsocks.max(1),
            acceptor,
            stash: HashMap::new(),
            shm_peers,
            arena: None,
            aborted: false,
        })
    }

    fn ensure(&mut self, peer: usize) -> Result<()> {
        if self.conns[peer].is_some() {
            return Ok(());
        }
        if self.aborted {
            return Err(Error::Aborted("the comm's transport was aborted".into()));
        }
        let deadline = Instant::now() + self.cfg.timeout;
        let (socks, shm) = if peer > self.cfg.rank {
            let mut socks = (0..self.nsocks)
                .map(|i| self.connect(peer, i, deadline))
                .collect::<Result<Vec<_>>>()?;
            // The peer's accept thread runs its half of the setup.
            let shm = if self.shm_peers[peer] {
                let s = &mut socks[0];
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(10))));
                let link = shm::setup(s, self.comm_id, self.cfg.rank, peer).map_err(|e| {
                    Error::Remote {
                        rank: peer,
                        addr: self.peers[peer].to_string(),
                        msg: format!("shared memory setup failed: {e}"),
                    }
                })?;
                Some(link)
            } else {
                None
            };
            (socks, shm)
        } else {
            self.await_incoming(peer, deadline)?
        };
        for s in &socks {
            configure(s)?;
        }
        crate::qlog!(
            Info,
            "rank {}: comm {:#018x}: connected to rank {peer} at {} over {}",
            self.cfg.rank,
            self.comm_id,
            self.peers[peer],
            match &shm {
                Some(l) => format!("shm (pid {})", l.peer_pid),
                None => format!("tcp ({} socket(s))", socks.len()),
            }
        );
        self.conns[peer] = Some(Conn {
            socks,
            addr: self.peers[peer],
            mid_frame: false,
            shm,
        });
        Ok(())
    }

    fn connect(&self, peer: usize, sock: usize, deadline: Instant) -> Result<TcpStream> {
        // A connection the peer's accept thread dropped unanswered (pushed out by a flood of
        // strangers: see `acceptor`) is tried again, a few times, within the deadline.
        const HELLO_TRIES: usize = 4;
        let addr = self.peers[peer];
        let remote = |msg: String| Error::Remote {
            rank: peer,
            addr: addr.to_string(),
            msg,
        };
        let mut tries = 0;
        loop {
            let mut stream = loop {
                match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline && !self.abort_requested() => {
                        crate::qlog!(Trace, "connect to rank {peer} at {addr}: {e}; retrying");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => return Err(remote(format!("cannot connect: {e}"))),
                }
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(10))));
            let hello = handshake::Hello {
                secret: self.secret,
                comm_id: self.comm_id,
                rank: self.cfg.rank as u32,
                sock: sock as u32,
            };
            tries += 1;
            match handshake::connect(&mut stream, &hello) {
                Ok(()) => return Ok(stream),
                Err(e @ Error::System(_))
                    if tries < HELLO_TRIES
                        && Instant::now() < deadline
                        && !self.abort_requested() =>
                {
                    crate::qlog!(
                        Info,
                        "rank {}: rank {peer} at {addr} dropped our hello ({e}); trying again",
                        self.cfg.rank
                    );
                    std::thread::sleep(Duration::from_millis(10 << tries));
                }
                Err(e) => return Err(remote(e.to_string())),
            }
        }
    }

    fn await_incoming(
        &mut self,
        peer: usize,
        deadline: Instant,
    ) -> Result<(Vec<TcpStream>, Option<ShmLink>)> {
        let incoming = self.acceptor.incoming.clone();
        loop {
            if let Some((v, _)) = self.stash.get(&peer) {
                if v.iter().all(Option::is_some) {
                    let (v, link) = self.stash.remove(&peer).unwrap();
                    if self.shm_peers[peer] && link.is_none() {
                        return Err(Error::Internal(format!(
                            "rank {peer} connected without a shared-memory link"
                        )));
                    }
                    return Ok((v.into_iter().map(Option::unwrap).collect(), link));
                }
            }
            if self.abort_requested() {
                return Err(Error::Aborted("abort() was called on this comm".into()));
            }
            if Instant::now() >= deadline {
                let stalled = Stalled {
                    desc: OpDesc::setup(),
                    peers: vec![peer],
                    what: format!("rank {peer} did not connect to this rank"),
                };
                return Err(match &self.cfg.inspector {
                    Some(i) => i.diagnose(self.cfg.timeout, &self.cfg.abort, stalled),
                    None => stall::plain_timeout(self.cfg.rank, self.cfg.timeout, stalled),
                });
            }
            if let Ok((rank, sock, s, link)) = incoming.recv_timeout(Duration::from_millis(100)) {
                if sock >= self.nsocks || self.conns[rank].is_some() {
                    crate::qlog!(
                        Warn,
                        "rank {}: unexpected socket {sock} from rank {rank}",
                        self.cfg.rank
                    );
                    continue;
                }
                let (slots, shm) = self
                    .stash
                    .entry(rank)
                    .or_insert_with(|| ((0..self.nsocks).map(|_| None).collect(), None));
                slots[sock] = Some(s);
                if link.is_some() {
                    *shm = link;
                }
            }
        }
    }

    /// Maps the arena of an all-shared-memory comm (collective: see `Transport::arena`).
    fn setup_arena(&mut self) -> Result<Arena> {
        let (me, n) = (self.cfg.rank, self.cfg.size);
        for p in (0..n).filter(|&p| p != me) {
            self.ensure(p)?;
        }
        let pids = (0..n)
            .map(|p| {
                self.conns[p]
                    .as_ref()
                    .and_then(|c| c.shm.as_ref())
                    .map_or(0, |l| l.peer_pid)
            })
            .collect();
        let addrs = self.peers.iter().map(|a| a.to_string()).collect();
        let desc = OpDesc::setup();
        let (conns, cfg) = (&mut self.conns, &self.cfg);
        arena::setup(cfg, self.comm_id, pids, addrs, |s, r| {
            progress::exchange(conns, cfg, &desc, s, r)
        })
    }

    fn abort_requested(&self) -> bool {
        self.cfg.abort.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn configure(s: &TcpStream) -> Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    s.set_nodelay(true)
        .map_err(|e| Error::io("setting TCP_NODELAY", e))?;
    if setsockopt(s, sockopt::SndBufForce, &SOCKET_BUF).is_err() {
        let _ = setsockopt(s, sockopt::SndBuf, &SOCKET_BUF);
    }
    if setsockopt(s, sockopt::RcvBufForce, &SOCKET_BUF).is_err() {
        let _ = setsockopt(s, sockopt::RcvBuf, &SOCKET_BUF);
    }
    s.set_read_timeout(None)
        .map_err(|e| Error::io("clearing the read timeout", e))?;
    s.set_nonblocking(true)
        .map_err(|e| Error::io("setting the socket non-blocking", e))
}

impl Transport for TcpTransport {
    fn exchange(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'_>],
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        for p in sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
        {
            self.ensure(p)?;
        }
        progress::exchange(&mut self.conns, &self.cfg, desc, sends, recvs)
    }

    fn reduces_on_receive(&mut self, peer: usize) -> Result<bool> {
        self.ensure(peer)?;
        Ok(self.conns[peer].as_ref().is_some_and(|c| c.shm.is_some()))
    }

    fn arena(&mut self) -> Result<Option<&mut Arena>> {
        let me = self.cfg.rank;
        if self.cfg.size < 2 || (0..self.cfg.size).any(|p| p != me && !self.shm_peers[p]) {
            return Ok(None);
        }
        if self.arena.is_none() {
            let arena = self.setup_arena()?;
            crate::qlog!(
                Info,
                "rank {me}: comm {:#018x}: shared-memory arena over {} ranks, {} KiB per owner \
                 per round",
                self.comm_id,
                arena.size(),
                arena.chunk() >> 10
            );
            self.arena = Some(arena);
        }
        Ok(self.arena.as_mut())
    }

    fn abort(&mut self, reason: &str) {
        self.aborted = true;
        // The accept thread stays: it answers probes with the reason and refuses peers.
        let culprit = self.cfg.inspector.as_ref().and_then(|i| {
            i.fail(reason);
            i.culprit()
        });
        if let Some(a) = &self.arena {
            a.abort(reason, culprit);
        }
        let reason = &reason.as_bytes()[..reason.len().min(super::frame::MAX_ABORT_LEN as usize)];
        let head = Header::abort(reason.len(), culprit).encode();
        for conn in self.conns.iter_mut().filter_map(Option::take) {
            let s = &conn.socks[0];
            if let (Some(link), false) = (&conn.shm, conn.mid_frame) {
                // All or nothing: a partial abort frame would be garbage to the peer.
                if link.tx.room() >= head.len() + reason.len() {
                    link.tx.try_write(&[&head, reason]);
                }
            } else if !conn.mid_frame {
                // Best effort and bounded: the peer may be gone or not reading.
                let _ = s.set_nonblocking(false);
                let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
                let mut w = s;
                let _ = w.write_all(&head).and_then(|_| w.write_all(reason));
            }
            for s in &conn.socks {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        self.stash.clear();
    }

    fn inspector(&self) -> Option<Arc<Inspector>> {
        self.cfg.inspector.clone()
    }

    fn peer_name(&self, peer: usize) -> String {
        self.peers
            .get(peer)
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into())
    }

    fn name(&self) -> &'static str {
        if self.shm_peers.iter().any(|&b| b) {
            "tcp+shm"
        } else {
            "tcp"
        }
    }
}
