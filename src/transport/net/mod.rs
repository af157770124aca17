//! Opening a network comm's links: the lower rank of a pair connects (`QCCL_NSOCKS_PERPEER`
//! TCP sockets, each introduced by a hello: `handshake.rs`), the higher rank's accept thread
//! (`acceptor.rs`) verifies the hello, and the pair's link kind, chosen per pair by
//! `select.rs`, is built over the verified sockets: a socket link (`transport::socket`), or
//! shared-memory rings (`transport::shm`) or an RDMA queue pair (`transport::ib`) set up over
//! the first socket, which then stays open only as the setup channel (and, having no end of
//! file of their own, to tell that the peer is gone). Links open lazily, at a pair's first
//! exchange.

mod acceptor;
pub mod handshake;
pub mod select;

use super::frame::OpDesc;
use super::ib::{self, link::IbLink, setup::IbNet};
use super::link::{Connector, Link};
use super::shm::{self, link::ShmLink};
use super::socket::{self, SocketLink};
use super::stall::{self, Inspector, Stalled};
use super::LinkConfig;
use crate::error::{Error, Result};
use acceptor::{Acceptor, Prepared};
use select::Kind;
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Incoming sockets of a peer whose set is not complete yet, and what was set up over them.
type Stash = (Vec<Option<TcpStream>>, Option<Prepared>);

/// One rank's connection setup for a network comm.
pub struct NetConnector {
    rank: usize,
    secret: [u8; 16],
    comm_id: u64,
    peers: Vec<SocketAddr>,
    nsocks: usize,
    /// The link kind of each peer pair (this rank's own entry unused).
    kinds: Vec<Kind>,
    /// The opened RDMA port, where some pair uses it.
    ib: Option<Arc<IbNet>>,
    inspector: Arc<Inspector>,
    /// Lives as long as the comm: after an abort it refuses peers and answers probes.
    acceptor: Acceptor,
    stash: HashMap<usize, Stash>,
    /// Peers whose link was handed out: later sockets from them are unexpected.
    linked: Vec<bool>,
}

impl NetConnector {
    /// Accepts on `listener` (its address is `peers[cfg.rank]`) and reaches peer `i` at
    /// `peers[i]` over a link of `kinds[i]` (RDMA ones over `ib`). Sets `cfg.inspector` to the
    /// comm's stall inspector, which the accept thread serves.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        listener: TcpListener,
        peers: Vec<SocketAddr>,
        comm_id: u64,
        secret: [u8; 16],
        nsocks: usize,
        kinds: Vec<Kind>,
        ib: Option<Arc<IbNet>>,
        cfg: &mut LinkConfig,
    ) -> Result<NetConnector> {
        if ib.is_none() && (0..cfg.size).any(|p| p != cfg.rank && kinds[p] == Kind::Ib) {
            return Err(Error::Internal("RDMA pairs without an opened port".into()));
        }
        let inspector = Arc::new(Inspector::new(cfg.rank, secret, comm_id, peers.clone()));
        cfg.inspector = Some(inspector.clone());
        let mut accept_kinds = kinds.clone();
        accept_kinds[cfg.rank] = Kind::Socket;
        let acceptor = Acceptor::spawn(
            listener,
            secret,
            comm_id,
            cfg.size,
            cfg.rank,
            accept_kinds,
            ib.clone(),
            inspector.clone(),
        )?;
        Ok(NetConnector {
            rank: cfg.rank,
            secret,
            comm_id,
            peers,
            nsocks: nsocks.max(1),
            kinds,
            ib,
            inspector,
            acceptor,
            stash: HashMap::new(),
            linked: vec![false; cfg.size],
        })
    }

    fn connect_sock(
        &self,
        cfg: &LinkConfig,
        peer: usize,
        sock: usize,
        deadline: Instant,
    ) -> Result<TcpStream> {
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
                    Err(e) if Instant::now() < deadline && !abort_requested(cfg) => {
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
                rank: self.rank as u32,
                sock: sock as u32,
            };
            tries += 1;
            match handshake::connect(&mut stream, &hello) {
                Ok(()) => return Ok(stream),
                Err(e @ Error::System(_))
                    if tries < HELLO_TRIES
                        && Instant::now() < deadline
                        && !abort_requested(cfg) =>
                {
                    crate::qlog!(
                        Info,
                        "rank {}: rank {peer} at {addr} dropped our hello ({e}); trying again",
                        self.rank
                    );
                    std::thread::sleep(Duration::from_millis(10 << tries));
                }
                Err(e) => return Err(remote(e.to_string())),
            }
        }
    }

    /// The connecting side: opens the sockets, then runs this rank's half of the rings' or
    /// queue pair's setup (the peer's accept thread runs its half).
    fn dial(
        &self,
        cfg: &LinkConfig,
        peer: usize,
        deadline: Instant,
    ) -> Result<(Vec<TcpStream>, Option<Prepared>)> {
        let mut socks = (0..self.nsocks)
            .map(|i| self.connect_sock(cfg, peer, i, deadline))
            .collect::<Result<Vec<_>>>()?;
        let s = &mut socks[0];
        let left = deadline.saturating_duration_since(Instant::now());
        let remote = |what: &str, e: Error| Error::Remote {
            rank: peer,
            addr: self.peers[peer].to_string(),
            msg: format!("{what} setup failed: {e}"),
        };
        let prepared = match (self.kinds[peer], &self.ib) {
            (Kind::Shm, _) => {
                let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(10))));
                let rings = shm::setup(s, self.comm_id, self.rank, peer)
                    .map_err(|e| remote("shared memory", e))?;
                Some(Prepared::Shm(rings))
            }
            (Kind::Ib, Some(net)) => {
                let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(10))));
                let conn = ib::setup::connect(net, s).map_err(|e| remote("RDMA", e))?;
                Some(Prepared::Ib(conn))
            }
            _ => None,
        };
        Ok((socks, prepared))
    }

    /// The accepting side: waits for the accept thread to hand over `peer`'s sockets.
    fn await_incoming(
        &mut self,
        cfg: &LinkConfig,
        peer: usize,
        deadline: Instant,
    ) -> Result<(Vec<TcpStream>, Option<Prepared>)> {
        let incoming = self.acceptor.incoming.clone();
        // A peer whose comm failed (or whose process exited) before connecting never will:
        // ask it now and then instead of waiting for the whole timeout.
        let mut ask_at = Instant::now() + PEER_CHECK;
        loop {
            if let Some((v, _)) = self.stash.get(&peer) {
                if v.iter().all(Option::is_some) {
                    let (v, prepared) = self.stash.remove(&peer).unwrap();
                    let matching = matches!(
                        (self.kinds[peer], &prepared),
                        (Kind::Shm, Some(Prepared::Shm(_)))
                            | (Kind::Ib, Some(Prepared::Ib(_)))
                            | (Kind::Socket, None)
                    );
                    if !matching {
                        return Err(Error::Internal(format!(
                            "rank {peer} connected without its {:?} link",
                            self.kinds[peer]
                        )));
                    }
                    return Ok((v.into_iter().map(Option::unwrap).collect(), prepared));
                }
            }
            if abort_requested(cfg) {
                return Err(Error::Aborted("abort() was called on this comm".into()));
            }
            if let Some(i) = cfg.inspector.as_ref().filter(|_| Instant::now() >= ask_at) {
                if let Some(why) = i.peer_down(peer) {
                    return Err(Error::Remote {
                        rank: peer,
                        addr: self.peers[peer].to_string(),
                        msg: format!("it will not connect to this rank: {why}"),
                    });
                }
                ask_at = Instant::now() + PEER_CHECK;
            }
            if Instant::now() >= deadline {
                let stalled = Stalled {
                    desc: OpDesc::setup(),
                    peers: vec![peer],
                    what: format!("rank {peer} did not connect to this rank"),
                };
                return Err(match &cfg.inspector {
                    Some(i) => i.diagnose(cfg.timeout, &cfg.abort, stalled),
                    None => stall::plain_timeout(cfg.rank, cfg.timeout, stalled),
                });
            }
            if let Ok((rank, sock, s, prepared)) = incoming.recv_timeout(Duration::from_millis(100))
            {
                if sock >= self.nsocks || self.linked[rank] {
                    crate::qlog!(
                        Warn,
                        "rank {}: unexpected socket {sock} from rank {rank}",
                        self.rank
                    );
                    continue;
                }
                let (slots, stashed) = self
                    .stash
                    .entry(rank)
                    .or_insert_with(|| ((0..self.nsocks).map(|_| None).collect(), None));
                slots[sock] = Some(s);
                if prepared.is_some() {
                    *stashed = prepared;
                }
            }
        }
    }
}

/// How often a wait for a peer to connect asks whether it still can.
const PEER_CHECK: Duration = Duration::from_secs(1);

fn abort_requested(cfg: &LinkConfig) -> bool {
    cfg.abort.load(std::sync::atomic::Ordering::Relaxed)
}

impl Connector for NetConnector {
    fn connect(&mut self, peer: usize, cfg: &LinkConfig) -> Result<Box<dyn Link>> {
        let deadline = Instant::now() + cfg.timeout;
        let (socks, prepared) = if peer > self.rank {
            self.dial(cfg, peer, deadline)?
        } else {
            self.await_incoming(cfg, peer, deadline)?
        };
        for s in &socks {
            socket::configure(s)?;
        }
        let addr = self.peers[peer];
        let link: Box<dyn Link> = match prepared {
            Some(Prepared::Shm(r)) => Box::new(ShmLink::new(r, socks, addr)),
            Some(Prepared::Ib(c)) => Box::new(IbLink::new(c, socks, addr, peer, cfg)),
            None => Box::new(SocketLink::new(socks, addr)),
        };
        self.linked[peer] = true;
        crate::qlog!(
            Info,
            "rank {}: comm {:#018x}: connected to rank {peer} at {addr} over {}",
            self.rank,
            self.comm_id,
            link.describe()
        );
        Ok(link)
    }

    fn shares_memory(&self, peer: usize) -> bool {
        peer != self.rank && self.kinds[peer] == Kind::Shm
    }

    fn comm_id(&self) -> u64 {
        self.comm_id
    }

    fn abort(&mut self, _head: &[u8], _reason: &[u8]) {
        // Closes the sockets of peers that connected but were never linked (stashed, or
        // still in the accept thread's queue): a peer already sending or waiting on one
        // fails at once instead of at its timeout (an abort frame goes only over links).
        self.stash.clear();
        while self.acceptor.incoming.try_recv().is_ok() {}
    }

    fn inspector(&self) -> Option<Arc<Inspector>> {
        Some(self.inspector.clone())
    }

    fn peer_name(&self, peer: usize) -> String {
        self.peers
            .get(peer)
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into())
    }

    fn name(&self) -> &'static str {
        let uses = |k: Kind| (0..self.kinds.len()).any(|p| p != self.rank && self.kinds[p] == k);
        match (
            uses(Kind::Ib),
            uses(Kind::Shm),
            self.ib.as_ref().map(|n| n.kind),
        ) {
            (true, true, Some("emulated")) => "tcp+shm+ib-emulated",
            (true, false, Some("emulated")) => "tcp+ib-emulated",
            (true, true, _) => "tcp+shm+ib",
            (true, false, _) => "tcp+ib",
            (false, true, _) => "tcp+shm",
            (false, false, _) => "tcp",
        }
    }
}
