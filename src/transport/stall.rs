//! The stall inspector: when a wait times out, find the rank that really stalled.
//!
//! A rank that times out knows only whom it waited on, and that peer may be healthy and
//! waiting itself on a third rank that stopped (SIGSTOP, a debugger, a hung process): blaming
//! the peer names the messenger. So every rank publishes what it is blocked on (the
//! operation and the peers it waits for, set by [`Waiter`](super::wait::Waiter) when a wait
//! first blocks, cleared when it ends), and its accept thread, which runs whatever the rank's
//! main thread does, answers a *probe* (a hello with the job's secret and socket index
//! [`PROBE_SOCK`]) with that status. On a timeout the rank probes the peers it waited on,
//! then the peers those wait on, and so on (the wait-for graph, a few hops): a rank whose
//! accept thread does not answer within [`PROBE_TIMEOUT`] is stopped or hung and is the
//! culprit; failing that, one that refuses connections (gone), one that failed naming a
//! culprit itself, or one that answers but waits on nothing (busy elsewhere, or not calling
//! the collective). The error names the culprit with its address:
//! "rank 1: rank 2 (10.0.0.3:41234) made no progress for 3000 ms (QCCL_TIMEOUT_MS) and does not
//! answer (stopped, or hung?); rank 3 waits on it; here: receive from rank 3 stalled in …".
//!
//! The culprit is also remembered: abort frames carry it (see `frame::Header::abort`), so
//! ranks that learn of the failure through an abort know whom it was about, and a failed
//! rank's accept thread keeps answering probes with its reason and culprit.

use crate::error::Error;
use crate::transport::frame::{Header, OpDesc, HEADER_LEN};
use crate::transport::net::handshake::{self, Hello, PROBE_SOCK};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a probed rank's accept thread has to answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Wait-for hops followed per diagnosis.
const MAX_HOPS: usize = 4;
/// Ranks probed at once, per hop.
const MAX_PROBES: usize = 64;
/// Peers listed in a status.
const MAX_LISTED: usize = 1024;
/// Bytes of a failure reason in a status.
const MAX_REASON: usize = 1024;
const STATUS_MAGIC: u32 = 0x5143_5354; // "QCST"
const STATUS_HEAD: usize = 64;

/// What a blocked wait is waiting for.
pub struct Stalled {
    /// The operation.
    pub desc: OpDesc,
    /// The peers it waits on (to receive from, to send to, or to advance in the arena).
    pub peers: Vec<usize>,
    /// What exactly is pending, for the timeout message.
    pub what: String,
}

impl Stalled {
    /// Waiting on `peers` in `desc`, without the description.
    pub fn on(desc: OpDesc, peers: Vec<usize>) -> Stalled {
        Stalled {
            desc,
            peers,
            what: String::new(),
        }
    }
}

struct Waiting {
    head: [u8; HEADER_LEN],
    peers: Vec<usize>,
    since: Instant,
}

#[derive(Default)]
struct State {
    waiting: Option<Waiting>,
    culprit: Option<usize>,
    failed: Option<String>,
}

/// One rank's side of the stall inspector, for one comm (shared by its transport, its wait
/// loops and its accept thread).
pub struct Inspector {
    me: usize,
    secret: [u8; 16],
    comm_id: u64,
    peers: Vec<SocketAddr>,
    state: Mutex<State>,
    /// Set by [`Inspector::release_listener`]: the accept thread is to stop.
    release: AtomicBool,
    /// Set by the accept thread when it stopped.
    released: AtomicBool,
}

impl std::fmt::Debug for Inspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Inspector(rank {}, comm {:#018x})",
            self.me, self.comm_id
        )
    }
}

/// What a probed rank said.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// No answer in time: the process is stopped or hung.
    Silent,
    /// Refused or closed: the process is gone.
    Gone(String),
    /// Not blocked in this comm.
    Idle,
    /// Blocked in `desc` on `peers`.
    Waiting {
        desc: Option<OpDesc>,
        peers: Vec<usize>,
    },
    /// Its comm failed, naming `culprit` or not.
    Failed {
        culprit: Option<usize>,
        reason: String,
    },
}

impl Inspector {
    /// The inspector of rank `me` of a comm whose ranks listen at `peers`.
    pub fn new(me: usize, secret: [u8; 16], comm_id: u64, peers: Vec<SocketAddr>) -> Inspector {
        Inspector {
            me,
            secret,
            comm_id,
            peers,
            state: Mutex::new(State::default()),
            release: AtomicBool::new(false),
            released: AtomicBool::new(false),
        }
    }

    /// Stops the comm's accept thread (within about 100 ms; waits for it, at most a second),
    /// so that another server owns the listener (a shrink: `comm::shrink`), which then
    /// answers probes with [`Inspector::serve_probe`].
    pub fn release_listener(&self) {
        self.release.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(1);
        while !self.released.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Accept-thread side: true once it is to stop.
    pub(crate) fn listener_released(&self) -> bool {
        self.release.load(Ordering::Relaxed)
    }

    /// Accept-thread side: it stopped.
    pub(crate) fn accept_thread_stopped(&self) {
        self.released.store(true, Ordering::SeqCst);
    }

    /// Answers a probe on `stream` whose first 4 bytes, `head`, were read and start a hello
    /// (`handshake::is_hello`): reads the rest (within the stream's read timeout), checks it,
    /// writes the status. Errors say why nothing was written (a peer's data connection, say).
    pub fn serve_probe(
        &self,
        stream: &mut TcpStream,
        head: [u8; 4],
    ) -> std::result::Result<usize, String> {
        let mut hello = [0u8; handshake::HELLO_LEN];
        hello[..4].copy_from_slice(&head);
        stream
            .read_exact(&mut hello[4..])
            .map_err(|e| format!("no complete hello: {e}"))?;
        let (rank, sock) = handshake::verify(&hello, &self.secret, self.comm_id, self.peers.len())?;
        if sock != PROBE_SOCK {
            return Err(format!("rank {rank} connects, but this comm has failed"));
        }
        stream
            .write_all(&self.status())
            .map_err(|e| format!("answering rank {rank}'s probe: {e}"))?;
        Ok(rank)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes that this rank is blocked (since `since`) on `s.peers` in `s.desc`.
    pub fn waiting(&self, s: &Stalled, since: Instant) {
        let head = Header {
            kind: crate::transport::frame::FrameKind::Data,
            desc: s.desc,
            len: 0,
        }
        .encode();
        let mut st = self.state();
        let w = st.waiting.get_or_insert_with(|| Waiting {
            head,
            peers: Vec::new(),
            since,
        });
        w.head = head;
        w.since = since;
        w.peers.clear();
        w.peers.extend_from_slice(&s.peers);
    }

    /// The wait ended.
    pub fn done(&self) {
        self.state().waiting = None;
    }

    /// Records the rank a failure is about (the first one found sticks).
    pub fn blame(&self, culprit: usize) {
        if culprit < self.peers.len() && culprit != self.me {
            self.state().culprit.get_or_insert(culprit);
        }
    }

    /// The rank this comm's failure is about, if known.
    pub fn culprit(&self) -> Option<usize> {
        self.state().culprit
    }

    /// The comm failed with `reason`: probes get it from now on.
    pub fn fail(&self, reason: &str) {
        let mut st = self.state();
        st.waiting = None;
        st.failed.get_or_insert_with(|| reason.to_string());
    }

    /// True once the comm failed.
    pub fn failed(&self) -> bool {
        self.state().failed.is_some()
    }

    /// `rank p (address)`.
    pub fn name(&self, p: usize) -> String {
        match self.peers.get(p) {
            Some(a) => format!("rank {p} ({a})"),
            None => format!("rank {p}"),
        }
    }

    /// The answer to a probe: this rank's status, encoded.
    pub fn status(&self) -> Vec<u8> {
        let st = self.state();
        let (kind, head, peers, idle_ms): (u8, [u8; HEADER_LEN], &[usize], u128) =
            match (&st.failed, &st.waiting) {
                (Some(_), _) => (2, [0; HEADER_LEN], &[], 0),
                (None, Some(w)) => (1, w.head, &w.peers, w.since.elapsed().as_millis()),
                (None, None) => (0, [0; HEADER_LEN], &[], 0),
            };
        let peers = &peers[..peers.len().min(MAX_LISTED)];
        let reason = st.failed.as_deref().unwrap_or("").as_bytes();
        let reason = &reason[..reason.len().min(MAX_REASON)];
        let mut b = Vec::with_capacity(STATUS_HEAD + 4 * peers.len() + reason.len());
        b.extend_from_slice(&STATUS_MAGIC.to_le_bytes());
        b.extend_from_slice(&[kind, 0, 0, 0]);
        let culprit = st.culprit.map_or(u32::MAX, |c| c as u32);
        b.extend_from_slice(&culprit.to_le_bytes());
        b.extend_from_slice(&(idle_ms.min(u32::MAX as u128) as u32).to_le_bytes());
        b.extend_from_slice(&head);
        b.extend_from_slice(&(peers.len() as u32).to_le_bytes());
        b.extend_from_slice(&(reason.len() as u32).to_le_bytes());
        debug_assert_eq!(b.len(), STATUS_HEAD);
        for &p in peers {
            b.extend_from_slice(&(p as u32).to_le_bytes());
        }
        b.extend_from_slice(reason);
        b
    }

    /// Asks rank `p`'s accept thread for its status, until `deadline`.
    fn probe(&self, p: usize, deadline: Instant) -> Answer {
        let addr = self.peers[p];
        let left = || deadline.saturating_duration_since(Instant::now());
        let mut s = match TcpStream::connect_timeout(&addr, left().max(Duration::from_millis(1))) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Answer::Gone(
                    "its listener refuses connections (the process exited or was killed)".into(),
                )
            }
            Err(e) if is_timeout(&e) => return Answer::Silent,
            Err(e) => return Answer::Gone(format!("probing it failed: {e}")),
        };
        let hello = Hello {
            secret: self.secret,
            comm_id: self.comm_id,
            rank: self.me as u32,
            sock: PROBE_SOCK,
        };
        let mut head = [0u8; STATUS_HEAD];
        let res = s
            .set_write_timeout(Some(left().max(Duration::from_millis(1))))
            .and_then(|()| s.write_all(&hello.encode()))
            .and_then(|()| s.set_read_timeout(Some(left().max(Duration::from_millis(1)))))
            .and_then(|()| s.read_exact(&mut head));
        match res {
            Ok(()) => {}
            Err(e) if is_timeout(&e) => return Answer::Silent,
            Err(e) => return Answer::Gone(format!("it closed the probe unanswered ({e})")),
        }
        let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().unwrap());
        if word(0) != STATUS_MAGIC {
            return Answer::Gone("it answered the probe with garbage".into());
        }
        let culprit = (word(8) != u32::MAX).then_some(word(8) as usize);
        let npeers = (word(56) as usize).min(MAX_LISTED);
        let nreason = (word(60) as usize).min(MAX_REASON);
        let mut rest = vec![0u8; 4 * npeers + nreason];
        if let Err(e) = s.read_exact(&mut rest) {
            return if is_timeout(&e) {
                Answer::Silent
            } else {
                Answer::Gone(format!("it closed the probe half answered ({e})"))
            };
        }
        match head[4] {
            1 => Answer::Waiting {
                desc: Header::decode(head[16..56].try_into().unwrap(), p)
                    .ok()
                    .map(|h| h.desc),
                peers: rest[..4 * npeers]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as usize)
                    .collect(),
            },
            2 => Answer::Failed {
                culprit,
                reason: String::from_utf8_lossy(&rest[4 * npeers..]).into_owned(),
            },
            _ => Answer::Idle,
        }
    }

    /// Why rank `p` will not take part any more, by one probe: its process is gone or its
    /// comm failed; None when it answered otherwise or not at all.
    pub fn peer_down(&self, p: usize) -> Option<String> {
        match self.probe(p, Instant::now() + PROBE_TIMEOUT) {
            Answer::Gone(why) => Some(why),
            Answer::Failed { reason, .. } => Some(format!("its comm failed: {reason}")),
            Answer::Silent | Answer::Idle | Answer::Waiting { .. } => None,
        }
    }

    /// Probes `ranks` at once (one thread each), until `deadline`.
    fn probe_all(&self, ranks: &[usize], deadline: Instant) -> Vec<Answer> {
        std::thread::scope(|scope| {
            let probes: Vec<_> = ranks
                .iter()
                .map(|&p| scope.spawn(move || self.probe(p, deadline)))
                .collect();
            probes
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Answer::Gone("probe panicked".into()))
                })
                .collect()
        })
    }

    /// The error for a wait that made no progress for `timeout`: finds the rank that stalled
    /// (see the module's description), remembers it, and names it.
    pub fn diagnose(&self, timeout: Duration, abort: &AtomicBool, s: Stalled) -> Error {
        let n = self.peers.len();
        let ms = timeout.as_millis();
        let mut via: Vec<Option<(usize, Option<OpDesc>)>> = vec![None; n];
        let mut seen = vec![false; n];
        seen[self.me.min(n.saturating_sub(1))] = true;
        let mut frontier: Vec<usize> = Vec::new();
        for &p in &s.peers {
            if p < n && !seen[p] {
                seen[p] = true;
                frontier.push(p);
            }
        }
        let direct = frontier.clone();
        let (mut silent, mut gone, mut idle, mut failed) = (vec![], vec![], vec![], vec![]);
        let mut found: Option<(usize, usize)> = None; // (culprit, the failed rank that named it)
        for _ in 0..MAX_HOPS {
            if frontier.is_empty() || abort.load(Ordering::Relaxed) {
                break;
            }
            frontier.truncate(MAX_PROBES);
            let answers = self.probe_all(&frontier, Instant::now() + PROBE_TIMEOUT);
            let mut next = Vec::new();
            for (&p, a) in frontier.iter().zip(answers) {
                crate::qlog!(
                    Info,
                    "rank {}: stall inspector: {} answered {a:?}",
                    self.me,
                    self.name(p)
                );
                match a {
                    Answer::Silent => silent.push(p),
                    Answer::Gone(why) => gone.push((p, why)),
                    Answer::Idle => idle.push(p),
                    Answer::Waiting { desc, peers } => {
                        for q in peers {
                            if q < n && !seen[q] {
                                seen[q] = true;
                                via[q] = Some((p, desc));
                                next.push(q);
                            }
                        }
                    }
                    Answer::Failed {
                        culprit: Some(c), ..
                    } if c < n && c != self.me => {
                        found.get_or_insert((c, p));
                    }
                    Answer::Failed { reason, .. } => failed.push((p, reason)),
                }
            }
            if !silent.is_empty() {
                break;
            }
            frontier = next;
        }
        let made = format!("made no progress for {ms} ms (QCCL_TIMEOUT_MS)");
        let (culprits, verdict): (Vec<usize>, String) = if !silent.is_empty() {
            let verb = if silent.len() == 1 { "does" } else { "do" };
            let v = format!("{made} and {verb} not answer (stopped, or hung?)");
            (silent, v)
        } else if let Some((c, by)) = found {
            let v = format!("{made}, as rank {by} found (it failed on it)");
            (vec![c], v)
        } else if !gone.is_empty() {
            let v = format!("{made}: {}", gone[0].1);
            (gone.into_iter().map(|g| g.0).collect(), v)
        } else if !failed.is_empty() {
            let v = format!("{made}: it failed: {}", failed[0].1);
            (vec![failed[0].0], v)
        } else if !idle.is_empty() {
            let who = if idle.len() == 1 { "it is" } else { "they are" };
            let v = format!(
                "{made}: {who} not waiting in this comm (busy elsewhere, or not calling this \
                 collective?)"
            );
            (idle, v)
        } else {
            (direct, made)
        };
        if let Some(&c) = culprits.first() {
            self.blame(c);
        }
        // How this rank's wait leads to the first culprit: who waits on whom, in what.
        let mut chain = Vec::new();
        let mut at = culprits.first().copied();
        while let Some((w, desc)) = at.and_then(|c| via.get(c).copied().flatten()) {
            // The operation only where it is not this rank's.
            let what = match desc {
                Some(d) if d != s.desc => format!(" in {d}"),
                _ => String::new(),
            };
            chain.push(format!("rank {w} waits on rank {}{what}", at.unwrap_or(0)));
            at = Some(w);
            if chain.len() > n {
                break;
            }
        }
        chain.reverse();
        let chain = if chain.is_empty() {
            String::new()
        } else {
            format!(" ({})", chain.join(", "))
        };
        Error::Timeout(format!(
            "rank {}: {} {verdict}{chain}; here: {}",
            self.me,
            self.list(&culprits),
            s.what
        ))
    }

    /// `rank 2 (addr)`, `ranks 1 (addr) and 2 (addr)`, at most 8 named.
    fn list(&self, ranks: &[usize]) -> String {
        const SHOW: usize = 8;
        match ranks {
            [] => "no rank".into(),
            [p] => self.name(*p),
            _ => {
                let named: Vec<String> = ranks
                    .iter()
                    .take(SHOW)
                    .map(|&p| self.name(p).replacen("rank ", "", 1))
                    .collect();
                let more = if ranks.len() > SHOW {
                    format!(" ... ({} in all)", ranks.len())
                } else {
                    String::new()
                };
                format!("ranks {}{more}", named.join(", "))
            }
        }
    }
}

/// The timeout error where there is no inspector (ranks as threads): names the peers waited on.
pub fn plain_timeout(me: usize, timeout: Duration, s: Stalled) -> Error {
    let mut peers = s.peers;
    peers.sort_unstable();
    peers.dedup();
    let who = match &peers[..] {
        [p] => format!("rank {p}"),
        _ => format!("ranks {peers:?}"),
    };
    Error::Timeout(format!(
        "rank {me}: {who} made no progress for {} ms (QCCL_TIMEOUT_MS); here: {}",
        timeout.as_millis(),
        s.what
    ))
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}
