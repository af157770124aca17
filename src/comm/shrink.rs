//! Shrink: the survivors of a comm that lost ranks make a comm of their own and carry on
//! (MPI ULFM's `MPIX_Comm_shrink`, NCCL's `ncclCommShrink`).
//!
//! The old comm's transport is aborted (so a peer still inside a collective fails at once),
//! but its listener stays open for the comm's life (`Comm::rescue`): every rank can still be
//! reached at the address the others know, and a dead process's listener refuses. One rank
//! leads: the lowest rank not excluded (a given list), or the lowest rank that answers (agree
//! on the failed set). Every other survivor sends it a join (the job's secret, the old
//! comm's id, its rank, its exclusion list and the listener address of its new comm) and
//! gets "hold" at once; the leader answers every join with one table (the new comm's id, the
//! members by old rank and their addresses) once every rank has joined or is known gone: it
//! refuses connections, or has not joined when the leader's timeout ends. The new comm's
//! first act is a barrier, so a member that missed the table makes every member's shrink
//! fail within the timeout instead of leaving comms that disagree.
//!
//! A rank that is not the leader answers joins too, for as long as the old comm lives:
//! "hold" then "ask rank L" while it searches or follows, and after its shrink "the
//! survivors already shrank without you", so a latecomer never builds a comm of its own.

use super::{Comm, Fabric};
use crate::error::{Error, Result};
use crate::transport::net::handshake;
use crate::transport::stall::Inspector;
use crossbeam_channel::{unbounded, Receiver, Sender};
use nix::poll::{poll, PollFd, PollFlags};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const JOIN_MAGIC: u64 = 0x4b52_4853_4c43_4351; // "QCCLSHRK"
const ANSWER_MAGIC: u64 = 0x4152_4853_4c43_4351; // "QCCLSHRA"
/// Bytes of a join before its exclusion list.
const JOIN_HEAD: usize = 66;
/// Bytes of an answer before its body.
const ANSWER_HEAD: usize = 24;
/// Longest error message an answer carries.
const MAX_MESSAGE: usize = 4096;
/// How long a connection may take to deliver its join, and a rank to answer "hold".
const HELLO_WAIT: Duration = Duration::from_secs(2);
/// How often the leader checks whether a rank that has not joined is gone.
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// Which ranks leave.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Leaving {
    /// These, as every survivor says (sorted).
    Given(Vec<usize>),
    /// Those the survivors find gone.
    Failed,
}

impl std::fmt::Display for Leaving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leaving::Given(l) => write!(f, "excluding ranks {l:?}"),
            Leaving::Failed => write!(f, "agreeing on the failed ranks"),
        }
    }
}

/// A survivor's join.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Join {
    rank: usize,
    leaving: Leaving,
    /// Where the new comm's transport listens on this rank.
    addr: SocketAddr,
}

/// What a rank answers a join with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// Received; the outcome follows on this connection.
    Hold,
    /// The new comm: its id and its members (old rank, new listener), by old rank.
    Table(u64, Vec<(usize, SocketAddr)>),
    /// Rank L leads: ask it.
    AskRank(usize),
    /// No comm for this rank, and why.
    Refused(String),
}

fn put_addr(b: &mut Vec<u8>, a: SocketAddr) {
    let ip = match a.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    b.extend_from_slice(&ip.octets());
    b.extend_from_slice(&a.port().to_le_bytes());
}

fn get_addr(b: &[u8]) -> SocketAddr {
    let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&b[..16]).expect("16 bytes"));
    let ip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
    SocketAddr::new(ip, u16::from_le_bytes([b[16], b[17]]))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Join {
    fn encode(&self, secret: &[u8; 16], comm_id: u64) -> Vec<u8> {
        let (agree, list): (u8, &[usize]) = match &self.leaving {
            Leaving::Given(l) => (0, l),
            Leaving::Failed => (1, &[]),
        };
        let mut b = Vec::with_capacity(JOIN_HEAD + 4 * list.len());
        b.extend_from_slice(&JOIN_MAGIC.to_le_bytes());
        b.extend_from_slice(&crate::bootstrap::PROTOCOL_VERSION.to_le_bytes());
        b.extend_from_slice(secret);
        b.extend_from_slice(&comm_id.to_le_bytes());
        b.extend_from_slice(&(self.rank as u32).to_le_bytes());
        b.extend_from_slice(&[agree, 0, 0, 0]);
        b.extend_from_slice(&(list.len() as u32).to_le_bytes());
        put_addr(&mut b, self.addr);
        for &r in list {
            b.extend_from_slice(&(r as u32).to_le_bytes());
        }
        debug_assert_eq!(b.len(), JOIN_HEAD + 4 * list.len());
        b
    }

    /// Reads and checks a join; Err says why the connection is dropped unanswered. Reads
    /// nothing past the head before the secret and comm id are checked, and at most `size`
    /// ranks of list after.
    fn read(
        s: &mut impl Read,
        secret: &[u8; 16],
        comm_id: u64,
        size: usize,
    ) -> std::result::Result<Join, String> {
        let mut h = [0u8; JOIN_HEAD];
        s.read_exact(&mut h)
            .map_err(|e| format!("no complete join: {e}"))?;
        if u64_at(&h, 0) != JOIN_MAGIC {
            return Err("not a shrink join".into());
        }
        if u32_at(&h, 8) != crate::bootstrap::PROTOCOL_VERSION {
            return Err(format!("protocol version {}", u32_at(&h, 8)));
        }
        if h[12..28] != secret[..] {
            return Err("wrong secret".into());
        }
        if u64_at(&h, 28) != comm_id {
            return Err(format!("another comm ({:#018x})", u64_at(&h, 28)));
        }
        let rank = u32_at(&h, 36) as usize;
        let (agree, n) = (h[40], u32_at(&h, 44) as usize);
        if rank >= size || agree > 1 || n > size || (agree == 1 && n > 0) {
            return Err(format!(
                "malformed join (rank {rank}, mode {agree}, {n} ranks)"
            ));
        }
        let addr = get_addr(&h[48..66]);
        let mut list = vec![0u8; 4 * n];
        s.read_exact(&mut list)
            .map_err(|e| format!("no complete join: {e}"))?;
        let mut ranks: Vec<usize> = list.chunks(4).map(|c| u32_at(c, 0) as usize).collect();
        if ranks.iter().any(|&r| r >= size) {
            return Err("a rank out of range in the join".into());
        }
        ranks.sort_unstable();
        let leaving = if agree == 1 {
            Leaving::Failed
        } else {
            Leaving::Given(ranks)
        };
        Ok(Join {
            rank,
            leaving,
            addr,
        })
    }
}

impl Answer {
    fn encode(&self) -> Vec<u8> {
        let (kind, a, b, body): (u8, u32, u64, Vec<u8>) = match self {
            Answer::Hold => (0, 0, 0, vec![]),
            Answer::Table(id, members) => {
                let mut body = Vec::with_capacity(22 * members.len());
                for &(r, addr) in members {
                    body.extend_from_slice(&(r as u32).to_le_bytes());
                    put_addr(&mut body, addr);
                }
                (1, members.len() as u32, *id, body)
            }
            Answer::AskRank(l) => (2, *l as u32, 0, vec![]),
            Answer::Refused(m) => {
                let mut m = m.as_bytes().to_vec();
                m.truncate(MAX_MESSAGE);
                (3, m.len() as u32, 0, m)
            }
        };
        let mut out = Vec::with_capacity(ANSWER_HEAD + body.len());
        out.extend_from_slice(&ANSWER_MAGIC.to_le_bytes());
        out.extend_from_slice(&[kind, 0, 0, 0]);
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&b.to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Reads one answer from a comm of `size` ranks.
    fn read(s: &mut impl Read, size: usize) -> std::io::Result<Answer> {
        let bad = |what: &str| std::io::Error::new(ErrorKind::InvalidData, what.to_string());
        let mut h = [0u8; ANSWER_HEAD];
        s.read_exact(&mut h)?;
        if u64_at(&h, 0) != ANSWER_MAGIC {
            return Err(bad("not a shrink answer"));
        }
        let (a, b) = (u32_at(&h, 12) as usize, u64_at(&h, 16));
        match h[8] {
            0 => Ok(Answer::Hold),
            1 if (1..=size).contains(&a) => {
                let mut body = vec![0u8; 22 * a];
                s.read_exact(&mut body)?;
                let members = body
                    .chunks(22)
                    .map(|c| (u32_at(c, 0) as usize, get_addr(&c[4..])))
                    .collect::<Vec<_>>();
                if members.iter().any(|&(r, _)| r >= size) {
                    return Err(bad("a member out of range"));
                }
                Ok(Answer::Table(b, members))
            }
            2 if a < size => Ok(Answer::AskRank(a)),
            3 if a <= MAX_MESSAGE => {
                let mut m = vec![0u8; a];
                s.read_exact(&mut m)?;
                Ok(Answer::Refused(String::from_utf8_lossy(&m).into_owned()))
            }
            _ => Err(bad("malformed shrink answer")),
        }
    }
}

/// Where this rank's shrink stands, for the joins its server answers.
#[derive(Debug, Clone)]
enum Phase {
    /// Looking for the leader, or leading: joins are held for the main thread.
    Open,
    /// Rank L leads.
    Following(usize),
    /// Done: the new comm's members by old rank (empty if this rank's shrink failed).
    Done(Vec<usize>),
}

/// A join held open until its answer.
struct Held {
    join: Join,
    stream: TcpStream,
}

/// The thread that answers joins on the old comm's listener; lives as long as the old comm.
pub(super) struct Server {
    stop: Arc<AtomicBool>,
    phase: Arc<Mutex<Phase>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(
        listener: TcpListener,
        secret: [u8; 16],
        comm_id: u64,
        size: usize,
        me: usize,
        inspector: Option<Arc<Inspector>>,
    ) -> Result<(Server, Receiver<Held>)> {
        let stop = Arc::new(AtomicBool::new(false));
        let phase = Arc::new(Mutex::new(Phase::Open));
        let (tx, rx) = unbounded();
        let (stop2, phase2) = (stop.clone(), phase.clone());
        let thread = std::thread::Builder::new()
            .name(format!("qccl-shrink-{me}"))
            .spawn(move || {
                serve(
                    listener,
                    &stop2,
                    &phase2,
                    &tx,
                    inspector.as_deref(),
                    (secret, comm_id, size, me),
                )
            })
            .map_err(|e| Error::io("spawning the shrink thread", e))?;
        Ok((
            Server {
                stop,
                phase,
                thread: Some(thread),
            },
            rx,
        ))
    }

    fn set(&self, p: Phase) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = p;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(
    listener: TcpListener,
    stop: &AtomicBool,
    phase: &Mutex<Phase>,
    held: &Sender<Held>,
    inspector: Option<&Inspector>,
    (secret, comm_id, size, me): ([u8; 16], u64, usize, usize),
) {
    let _ = listener.set_nonblocking(true);
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, 100u16).unwrap_or(0) <= 0 {
            continue;
        }
        let Ok((mut s, from)) = listener.accept() else {
            continue;
        };
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(HELLO_WAIT));
        let _ = s.set_write_timeout(Some(HELLO_WAIT));
        let mut head = [0u8; 4];
        if let Err(e) = s.read_exact(&mut head) {
            crate::qlog!(Trace, "rank {me}: shrink: {from} sent nothing: {e}");
            continue;
        }
        if let (true, Some(i)) = (handshake::is_hello(&head), inspector) {
            // The stall inspector's probe from a rank still in the old comm's collective,
            // or a peer connecting to the old comm: answered with this rank's status, or
            // dropped.
            match i.serve_probe(&mut s, head) {
                Ok(r) => crate::qlog!(Trace, "rank {me}: shrink: answered rank {r}'s probe"),
                Err(why) => crate::qlog!(
                    Info,
                    "rank {me}: shrink: dropped a connection from {from}: {why}"
                ),
            }
            continue;
        }
        let join = match Join::read(&mut (&head[..]).chain(&mut s), &secret, comm_id, size) {
            Ok(j) => j,
            Err(why) => {
                // Data connections of peers that were still running land here too.
                crate::qlog!(
                    Info,
                    "rank {me}: shrink: dropped a connection from {from}: {why}"
                );
                continue;
            }
        };
        let now = phase.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let answer = match now {
            Phase::Open => {
                if s.write_all(&Answer::Hold.encode()).is_ok() {
                    let _ = held.send(Held { join, stream: s });
                }
                continue;
            }
            Phase::Following(l) => Answer::AskRank(l),
            Phase::Done(members) if members.is_empty() => Answer::Refused(format!(
                "rank {me}'s own shrink failed; rank {} cannot shrink through it",
                join.rank
            )),
            Phase::Done(members) => Answer::Refused(format!(
                "the survivors already shrank to ranks {members:?} without rank {}",
                join.rank
            )),
        };
        let _ = s.write_all(&Answer::Hold.encode());
        let _ = s.write_all(&answer.encode());
    }
}

/// What asking a rank gave.
enum Asked {
    /// The outcome (table, or refusal) from the leader.
    Final(Answer),
    /// It said another rank leads.
    AskRank(usize),
    /// It refuses connections (its process is gone) or did not answer by the deadline.
    Gone,
}

/// Sends `join` to the rank listening at `addr` and waits for its outcome. A rank that is
/// still inside a collective (its old listener's accept thread drops the join) or that does
/// not answer (stopped) is asked again until `deadline`; one that refuses is gone.
fn ask(
    addr: SocketAddr,
    join: &[u8],
    deadline: Instant,
    hold_wait: Duration,
    size: usize,
) -> Result<Asked> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(Asked::Gone);
        }
        let mut s = match TcpStream::connect_timeout(&addr, left.min(HELLO_WAIT)) {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => return Ok(Asked::Gone),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(50).min(left));
                continue;
            }
        };
        let _ = s.set_nodelay(true);
        let _ = s.set_write_timeout(Some(HELLO_WAIT));
        let _ = s.set_read_timeout(Some(left.min(HELLO_WAIT)));
        if s.write_all(join).is_err() || !matches!(Answer::read(&mut s, size), Ok(Answer::Hold)) {
            // Not (yet) in its shrink, or not answering: again, until the deadline.
            std::thread::sleep(Duration::from_millis(50).min(left));
            continue;
        }
        // It holds the join: the leader decides by its own deadline, which may be later than
        // ours by as much as it entered its shrink later.
        let wait = deadline.saturating_duration_since(Instant::now()) + hold_wait;
        let _ = s.set_read_timeout(Some(wait));
        return match Answer::read(&mut s, size) {
            Ok(Answer::AskRank(l)) => Ok(Asked::AskRank(l)),
            Ok(a @ (Answer::Table(..) | Answer::Refused(_))) => Ok(Asked::Final(a)),
            Ok(Answer::Hold) => Err(Error::Internal("shrink: a second hold".into())),
            Err(e) => Err(Error::System(format!(
                "shrink: the rank at {addr} stopped answering after it took the join: {e}"
            ))),
        };
    }
}

impl Comm {
    /// Makes a comm of this comm's ranks but `exclude` (NCCL's `ncclCommShrink`): every rank
    /// not excluded calls it with the same list, excluded ranks do not. This comm is aborted
    /// first (a peer still inside a collective fails at once), so call it on the comm that
    /// failed, then drop that one. A survivor's new rank is its old rank minus the excluded
    /// ranks below it. Every survivor ends with the same new comm, or every survivor gets an
    /// error (within twice `QCCL_TIMEOUT_MS`, and the new comm's first barrier). Comms of processes
    /// (TCP, shared memory) only.
    pub fn shrink(&self, exclude: &[usize]) -> Result<Comm> {
        let mut list = exclude.to_vec();
        list.sort_unstable();
        if let Some(&r) = list.iter().find(|&&r| r >= self.size) {
            return Err(Error::invalid(format!(
                "shrink: rank {r} is out of range for a comm of {} ranks",
                self.size
            )));
        }
        if list.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid(format!(
                "shrink: the exclusion list {exclude:?} names a rank twice"
            )));
        }
        if list.contains(&self.rank) {
            return Err(Error::invalid(format!(
                "shrink: rank {} excludes itself (excluded ranks do not call shrink)",
                self.rank
            )));
        }
        self.shrink_as(Leaving::Given(list))
    }

    /// Makes a comm of this comm's surviving ranks (MPI ULFM's `MPIX_Comm_shrink`): every
    /// survivor calls it, typically after a collective returned an error; the survivors
    /// agree on which ranks are gone (a rank whose process refuses connections, or that has
    /// not joined within twice `QCCL_TIMEOUT_MS`: a survivor still waiting on the lost rank
    /// needs up to one timeout to notice). Otherwise as [`Comm::shrink`].
    pub fn shrink_failed(&self) -> Result<Comm> {
        self.shrink_as(Leaving::Failed)
    }

    fn shrink_as(&self, leaving: Leaving) -> Result<Comm> {
        let (Fabric::Tcp { ip, peers, .. }, Some(rescue)) = (&self.fabric, &self.rescue) else {
            return Err(Error::Unsupported(
                "shrink: comms of threads (init_threads, qcclCommInitAll) cannot lose a rank; \
                 shrink works on comms of processes"
                    .into(),
            ));
        };
        let mut slot = self.shrinker.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(Error::InvalidUsage(
                "shrink: this comm was already shrunk; shrink the new comm".into(),
            ));
        }
        let listener = rescue
            .try_clone()
            .map_err(|e| Error::io("shrink: duplicating the listener", e))?;
        self.queue
            .abort_because("the comm was shrunk", "is shrinking the comm");
        // The transport's accept thread, which outlives an abort to answer the stall
        // inspector's probes, hands the listener over; the shrink thread answers them now.
        if let Some(i) = &self.inspector {
            i.release_listener();
        }
        let (server, held) = Server::start(
            listener,
            self.secret,
            self.comm_id,
            self.size,
            self.rank,
            self.inspector.clone(),
        )?;
        let server = slot.insert(server);
        let mine = TcpListener::bind((*ip, 0))
            .map_err(|e| Error::io(format!("shrink: binding a listener on {ip}"), e))?;
        let join = Join {
            rank: self.rank,
            leaving,
            addr: mine
                .local_addr()
                .map_err(|e| Error::io("shrink: reading the listener's address", e))?,
        };
        // A survivor notices the failure within its timeout (a rank waiting for a lazy
        // connection from a dead peer hears from no one and waits out the whole of it), so
        // ranks are waited for twice that.
        let deadline = Instant::now() + 2 * self.config.timeout;
        let outcome = self.agree(&join, peers, server, &held, deadline);
        server.set(Phase::Done(match &outcome {
            Ok((_, members)) => members.iter().map(|&(r, _)| r).collect(),
            Err(_) => vec![],
        }));
        let (id, members) = outcome?;
        crate::qlog!(
            Info,
            "rank {}: shrink: comm {:#018x} of old ranks {:?} (of {})",
            self.rank,
            id,
            members.iter().map(|&(r, _)| r).collect::<Vec<_>>(),
            self.size
        );
        let members = members.into_iter().map(|(r, a)| (r as i32, r, a)).collect();
        let comm = self.child(id, members, Some(mine), self.config.clone())?;
        comm.barrier().map_err(|e| Error::Remote {
            rank: comm.rank(),
            addr: "the new comm".into(),
            msg: format!("shrink: the new comm's first barrier failed: {e}"),
        })?;
        Ok(comm)
    }

    /// Finds or becomes the leader and returns the table.
    fn agree(
        &self,
        join: &Join,
        peers: &[SocketAddr],
        server: &Server,
        held: &Receiver<Held>,
        deadline: Instant,
    ) -> Result<(u64, Vec<(usize, SocketAddr)>)> {
        let bytes = join.encode(&self.secret, self.comm_id);
        let mut gone = vec![false; self.size];
        let mut next = match &join.leaving {
            Leaving::Given(l) => (0..self.size).find(|r| !l.contains(r)).unwrap_or(self.rank),
            Leaving::Failed => 0,
        };
        for _ in 0..2 * self.size + 1 {
            if next == self.rank {
                return self.lead(join, peers, server, held, &gone, deadline);
            }
            server.set(Phase::Following(next));
            refer(held, next);
            match ask(
                peers[next],
                &bytes,
                deadline,
                self.config.timeout,
                self.size,
            )? {
                Asked::Final(Answer::Table(id, members)) => {
                    if !members.iter().any(|&(r, _)| r == self.rank) {
                        return Err(Error::Internal(format!(
                            "shrink: rank {next}'s table {members:?} leaves this rank out"
                        )));
                    }
                    return Ok((id, members));
                }
                Asked::Final(Answer::Refused(why)) => {
                    return Err(Error::Remote {
                        rank: next,
                        addr: peers[next].to_string(),
                        msg: format!("shrink refused: {why}"),
                    })
                }
                Asked::Final(_) => unreachable!("ask returns only tables and refusals"),
                Asked::AskRank(l) => next = l,
                Asked::Gone => {
                    crate::qlog!(
                        Warn,
                        "rank {}: shrink: rank {next} ({}) refuses connections or did not answer \
                         in time: gone",
                        self.rank,
                        peers[next]
                    );
                    if let Leaving::Given(_) = join.leaving {
                        return Err(Error::Remote {
                            rank: next,
                            addr: peers[next].to_string(),
                            msg: "shrink: the leader (the lowest rank not excluded) is gone or \
                                  did not answer within twice the timeout: exclude it too"
                                .into(),
                        });
                    }
                    gone[next] = true;
                    server.set(Phase::Open);
                    next = (next + 1..self.size)
                        .find(|&r| !gone[r])
                        .unwrap_or(self.rank);
                }
            }
        }
        Err(Error::Internal(
            "shrink: no leader after every rank was asked".into(),
        ))
    }

    /// Leads: gathers the joins until every rank joined or is gone, answers them all.
    fn lead(
        &self,
        join: &Join,
        peers: &[SocketAddr],
        server: &Server,
        held: &Receiver<Held>,
        gone: &[bool],
        deadline: Instant,
    ) -> Result<(u64, Vec<(usize, SocketAddr)>)> {
        server.set(Phase::Open);
        let n = self.size;
        let mut gone = gone.to_vec();
        let mut joined: Vec<Option<Held>> = (0..n).map(|_| None).collect();
        let expected = |r: usize| match &join.leaving {
            Leaving::Given(l) => !l.contains(&r),
            Leaving::Failed => true,
        };
        let mut probed: Option<Instant> = None;
        loop {
            let first = held.recv_timeout(Duration::from_millis(50)).ok();
            for h in first.into_iter().chain(held.try_iter()) {
                let r = h.join.rank;
                let refuse = if h.join.leaving != join.leaving {
                    Some(format!(
                        "rank {r} shrinks {} but the leader, rank {}, {}",
                        h.join.leaving, self.rank, join.leaving
                    ))
                } else if !expected(r) {
                    Some(format!("rank {r} is excluded"))
                } else {
                    None
                };
                match refuse {
                    Some(why) => {
                        crate::qlog!(Warn, "rank {}: shrink: {why}", self.rank);
                        let mut s = h.stream;
                        let _ = s.write_all(&Answer::Refused(why.clone()).encode());
                        if h.join.leaving != join.leaving {
                            // Survivors that disagree on who leaves: nobody gets a comm.
                            answer_all(&mut joined, &Answer::Refused(why.clone()));
                            return Err(Error::InvalidUsage(format!("shrink: {why}")));
                        }
                    }
                    None => {
                        gone[r] = false;
                        joined[r] = Some(h);
                    }
                }
            }
            let waiting: Vec<usize> = (0..n)
                .filter(|&r| r != self.rank && expected(r) && joined[r].is_none() && !gone[r])
                .collect();
            if waiting.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                if let Leaving::Given(_) = join.leaving {
                    let why = format!(
                        "ranks {waiting:?} did not join the shrink within {} ms",
                        2 * self.config.timeout.as_millis()
                    );
                    answer_all(&mut joined, &Answer::Refused(why.clone()));
                    return Err(Error::Timeout(format!("shrink: {why}")));
                }
                crate::qlog!(
                    Warn,
                    "rank {}: shrink: ranks {waiting:?} did not join in time: left out",
                    self.rank
                );
                break;
            }
            if join.leaving == Leaving::Failed && probed.is_none_or(|t| t.elapsed() >= PROBE_EVERY)
            {
                probed = Some(Instant::now());
                for &r in &waiting {
                    // A dead process's listener refuses; a live one's accepts (and drops the
                    // empty connection).
                    let left = deadline.saturating_duration_since(Instant::now());
                    if let Err(e) = TcpStream::connect_timeout(&peers[r], left.min(HELLO_WAIT)) {
                        if e.kind() == ErrorKind::ConnectionRefused {
                            crate::qlog!(
                                Warn,
                                "rank {}: shrink: rank {r} ({}) refuses connections: gone",
                                self.rank,
                                peers[r]
                            );
                            gone[r] = true;
                        }
                    }
                }
            }
        }
        crate::qlog!(
            Info,
            "rank {}: shrink: leading; joined {:?}, gone {:?}",
            self.rank,
            (0..n).filter(|&r| joined[r].is_some()).collect::<Vec<_>>(),
            (0..n).filter(|&r| gone[r]).collect::<Vec<_>>()
        );
        let id: u64 = rand::random();
        let mut members = vec![(self.rank, join.addr)];
        members.extend(joined.iter().flatten().map(|h| (h.join.rank, h.join.addr)));
        members.sort_unstable_by_key(|&(r, _)| r);
        answer_all(&mut joined, &Answer::Table(id, members.clone()));
        Ok((id, members))
    }
}

/// Answers every held join with `a`.
fn answer_all(joined: &mut [Option<Held>], a: &Answer) {
    let bytes = a.encode();
    for h in joined.iter_mut().filter_map(Option::take) {
        let mut s = h.stream;
        let _ = s.write_all(&bytes);
    }
}

/// Sends the joins held so far on to rank `leader`.
fn refer(held: &Receiver<Held>, leader: usize) {
    let bytes = Answer::AskRank(leader).encode();
    while let Ok(h) = held.try_recv() {
        let mut s = h.stream;
        let _ = s.write_all(&bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: [u8; 16] = [7; 16];

    fn addr(p: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::from([10, 0, 0, 1]), p)
    }

    #[test]
    fn joins_round_trip_and_strangers_are_refused() {
        for leaving in [
            Leaving::Given(vec![0, 3]),
            Leaving::Given(vec![]),
            Leaving::Failed,
        ] {
            let j = Join {
                rank: 2,
                leaving,
                addr: addr(4242),
            };
            let b = j.encode(&SECRET, 99);
            assert_eq!(Join::read(&mut &b[..], &SECRET, 99, 5).unwrap(), j);
            let e = Join::read(&mut &b[..], &[8; 16], 99, 5).unwrap_err();
            assert!(e.contains("secret"), "{e}");
            assert!(Join::read(&mut &b[..], &SECRET, 98, 5)
                .unwrap_err()
                .contains("comm"));
            // A rank or a listed rank out of range, a truncated join.
            assert!(Join::read(&mut &b[..], &SECRET, 99, 2).is_err());
            assert!(Join::read(&mut &b[..b.len() - 1], &SECRET, 99, 5).is_err());
        }
        // A list longer than the comm is refused before it is read.
        let mut b = Join {
            rank: 0,
            leaving: Leaving::Given(vec![1]),
            addr: addr(1),
        }
        .encode(&SECRET, 1);
        b[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Join::read(&mut &b[..], &SECRET, 1, 4)
            .unwrap_err()
            .contains("malformed"));
    }

    #[test]
    fn answers_round_trip_and_garbage_is_an_error() {
        for a in [
            Answer::Hold,
            Answer::Table(0xfeed, vec![(0, addr(1)), (3, addr(2))]),
            Answer::AskRank(1),
            Answer::Refused("no".into()),
        ] {
            let b = a.encode();
            assert_eq!(Answer::read(&mut &b[..], 4).unwrap(), a);
        }
        let table = Answer::Table(1, vec![(7, addr(1))]).encode();
        assert!(Answer::read(&mut &table[..], 4).is_err(), "member 7 of 4");
        assert!(Answer::read(&mut &[0u8; ANSWER_HEAD][..], 4).is_err());
        let mut long = Answer::Refused("x".into()).encode();
        long[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Answer::read(&mut &long[..], 4).is_err());
    }
}
