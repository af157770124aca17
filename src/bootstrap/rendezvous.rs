//! Rank side of the rendezvous: connect to the root, say hello, receive the world table.

use super::peer::{PeerInfo, World};
use super::unique_id::UniqueId;
use super::wire::{self, ErrorKind, Reply, MAX_HOST_ID_LEN, MAX_REPLY_LEN, MAX_WORLD_SIZE};
use super::PROTOCOL_VERSION;
use crate::error::{Error, Result};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Joins the world described by `id` as `me`, in a world of `size` ranks.
///
/// Connects to the root (retrying until `deadline`: the root may start later than this rank),
/// sends the hello and waits for the table. Errors:
/// - `InvalidArgument` when `me.rank >= size`, `size` is 0 or too large, or the host id is
///   longer than 1024 bytes;
/// - `Timeout` when the root cannot be reached or does not answer by `deadline`, or when the
///   root's own deadline passed before all ranks joined (the message names the missing ranks);
/// - `InvalidUsage` when the root rejects the world (wrong secret, duplicate rank, size or
///   protocol-version mismatch), with the root's message.
pub fn join(id: &UniqueId, me: &PeerInfo, size: usize, deadline: Instant) -> Result<World> {
    join_speaking(id, me, size, deadline, PROTOCOL_VERSION)
}

/// [`join`], announcing protocol `version` in the hello (tests simulate other versions).
pub(crate) fn join_speaking(
    id: &UniqueId,
    me: &PeerInfo,
    size: usize,
    deadline: Instant,
    version: u32,
) -> Result<World> {
    if size == 0 || size > MAX_WORLD_SIZE {
        return Err(Error::invalid(format!(
            "world size {size} is outside 1..={MAX_WORLD_SIZE}"
        )));
    }
    if me.rank >= size {
        return Err(Error::invalid(format!(
            "rank {} is out of range for world size {size}",
            me.rank
        )));
    }
    if me.host_id.len() > MAX_HOST_ID_LEN {
        return Err(Error::invalid(format!(
            "host id of rank {} is {} bytes long, over the limit of {MAX_HOST_ID_LEN} (QCCL_HOSTID?)",
            me.rank,
            me.host_id.len()
        )));
    }
    let root = id.root_addr();
    let rank = me.rank;
    let start = Instant::now();
    let total_ms = deadline.saturating_duration_since(start).as_millis();
    let version_note = if id.version() != PROTOCOL_VERSION {
        format!(
            " (note: the unique id is of protocol version {}, this library speaks {PROTOCOL_VERSION})",
            id.version()
        )
    } else {
        String::new()
    };

    let mut stream = connect(root, rank, deadline, total_ms, &version_note)?;
    crate::qlog!(
        Trace,
        "bootstrap: rank {rank} connected to the root at {root}"
    );
    let _ = stream.set_nodelay(true);
    let hello = wire::encode_hello(version, &id.secret(), me, size as u32);
    let left = remaining(deadline).unwrap_or(Duration::from_millis(1));
    stream
        .set_write_timeout(Some(left))
        .and_then(|()| wire::write_frame(&mut stream, &hello))
        .map_err(|e| {
            Error::io(
                format!("rank {rank}: sending the hello to the bootstrap root at {root}"),
                e,
            )
        })?;

    let body = loop {
        let Some(left) = remaining(deadline) else {
            return Err(no_answer(rank, root, total_ms, &version_note));
        };
        if let Err(e) = stream.set_read_timeout(Some(left)) {
            return Err(Error::io(format!("rank {rank}: set_read_timeout"), e));
        }
        match wire::read_frame(&mut stream, MAX_REPLY_LEN) {
            Ok(body) => break body,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(no_answer(rank, root, total_ms, &version_note));
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return Err(Error::InvalidUsage(format!(
                    "rank {rank}: the process at {root} is not a qccl bootstrap root: {e}"
                )));
            }
            Err(e) => {
                return Err(Error::System(format!(
                    "rank {rank}: the bootstrap root at {root} closed the connection without \
                     an answer (the root process died, or init failed before this rank's \
                     hello was read): {e}{version_note}"
                )));
            }
        }
    };

    let world = match wire::decode_reply(&body) {
        Err(e) => {
            return Err(Error::InvalidUsage(format!(
                "rank {rank}: reply from the bootstrap root at {root}: {e}"
            )))
        }
        Ok(Reply::Error { kind, msg }) => {
            let msg = format!("rank {rank}: bootstrap root at {root}: {msg}{version_note}");
            return Err(match kind {
                ErrorKind::Usage => Error::InvalidUsage(msg),
                ErrorKind::Timeout => Error::Timeout(msg),
            });
        }
        Ok(Reply::Table(world)) => world,
    };
    check_table(&world, me, size, root)?;
    if id.version() != PROTOCOL_VERSION {
        return Err(Error::InvalidUsage(format!(
            "rank {rank}: the unique id is of protocol version {}, this library speaks \
             {PROTOCOL_VERSION}",
            id.version()
        )));
    }
    crate::qlog!(
        Info,
        "bootstrap: rank {rank} of {size} joined comm {:#018x} via the root at {root} in {} ms",
        world.comm_id,
        start.elapsed().as_millis()
    );
    Ok(world)
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (!left.is_zero()).then_some(left)
}

fn no_answer(rank: usize, root: SocketAddr, total_ms: u128, note: &str) -> Error {
    Error::Timeout(format!(
        "rank {rank}: no answer from the bootstrap root at {root} within {total_ms} ms \
         (not all ranks joined in time?){note}"
    ))
}

/// Connects to the root, retrying with backoff until `deadline`.
fn connect(
    root: SocketAddr,
    rank: usize,
    deadline: Instant,
    total_ms: u128,
    note: &str,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(10);
    let mut last_err = String::from("the deadline had already passed");
    loop {
        let Some(left) = remaining(deadline) else {
            return Err(Error::Timeout(format!(
                "rank {rank}: could not reach the bootstrap root at {root} within {total_ms} ms: \
                 {last_err}{note}"
            )));
        };
        match TcpStream::connect_timeout(&root, left.min(Duration::from_secs(1))) {
            Ok(s) => return Ok(s),
            Err(e) => {
                crate::qlog!(Trace, "bootstrap: rank {rank}: connect to {root}: {e}");
                last_err = e.to_string();
            }
        }
        if let Some(left) = remaining(deadline) {
            std::thread::sleep(backoff.min(left));
        }
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}

/// Checks that the root's table is complete, in rank order and holds our own entry unchanged.
fn check_table(world: &World, me: &PeerInfo, size: usize, root: SocketAddr) -> Result<()> {
    let bad = |what: String| {
        Err(Error::Internal(format!(
            "rank {}: inconsistent table from the bootstrap root at {root}: {what}",
            me.rank
        )))
    };
    if world.peers.len() != size {
        return bad(format!(
            "{} entries for world size {size}",
            world.peers.len()
        ));
    }
    if let Some((i, p)) = world.peers.iter().enumerate().find(|(i, p)| p.rank != *i) {
        return bad(format!("entry {i} is rank {}", p.rank));
    }
    if world.peers[me.rank] != *me {
        return bad(format!(
            "this rank's entry is {:?}, sent {:?}",
            world.peers[me.rank], me
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This library's protocol version, and another one.
    const V: u32 = PROTOCOL_VERSION;
    const W: u32 = PROTOCOL_VERSION + 1;
    use crate::bootstrap::root::spawn_root_speaking;
    use std::io::Write;
    use std::net::{IpAddr, Ipv4Addr, TcpListener};
    use std::thread;

    const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    fn peer(rank: usize) -> PeerInfo {
        PeerInfo {
            rank,
            host_id: format!("host{}", rank % 2),
            machine_id: "m".into(),
            addr: SocketAddr::new(LO, 20000 + rank as u16),
            pid: 1000 + rank as u32,
            cpus: vec![rank],
            rdma: false,
            cuda_ipc: false,
        }
    }

    /// Starts one thread per (rank, size, version) and returns their join handles.
    fn start(
        id: UniqueId,
        who: &[(usize, usize, u32)],
        wait: Duration,
    ) -> Vec<thread::JoinHandle<Result<World>>> {
        who.iter()
            .map(|&(rank, size, version)| {
                thread::spawn(move || {
                    join_speaking(&id, &peer(rank), size, Instant::now() + wait, version)
                })
            })
            .collect()
    }

    fn finish(hs: Vec<thread::JoinHandle<Result<World>>>) -> Vec<Result<World>> {
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn all(ranks: std::ops::Range<usize>, size: usize) -> Vec<(usize, usize, u32)> {
        ranks.map(|r| (r, size, PROTOCOL_VERSION)).collect()
    }

    fn lo_id(deadline: Duration) -> UniqueId {
        UniqueId::new_at(LO, deadline).unwrap()
    }

    #[test]
    fn worlds_of_1_3_5_agree() {
        for size in [1, 3, 5] {
            let id = UniqueId::new().unwrap();
            let res = finish(start(id, &all(0..size, size), Duration::from_secs(3)));
            let worlds: Vec<World> = res.into_iter().map(|r| r.unwrap()).collect();
            let expect: Vec<PeerInfo> = (0..size).map(peer).collect();
            for w in &worlds {
                assert_eq!(w, &worlds[0]);
                assert_eq!(w.peers, expect);
            }
            assert_ne!(worlds[0].comm_id, 0);
        }
    }

    #[test]
    fn strangers_are_turned_away_and_the_job_completes() {
        let id = lo_id(Duration::from_secs(3));
        // A connection that never speaks, and one that speaks HTTP.
        let _idle = TcpStream::connect(id.root_addr()).unwrap();
        let mut http = TcpStream::connect(id.root_addr()).unwrap();
        http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        // Same root, other job's secret.
        let stranger = UniqueId::with_root(id.root_addr(), [0x55; 16]);
        let err = join(
            &stranger,
            &peer(0),
            3,
            Instant::now() + Duration::from_secs(2),
        )
        .unwrap_err();
        assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
        assert!(
            err.to_string()
                .contains("wrong secret: this id belongs to another job"),
            "{err}"
        );
        let res = finish(start(id, &all(0..3, 3), Duration::from_secs(3)));
        let w0 = res[0].as_ref().unwrap();
        for r in &res {
            assert_eq!(r.as_ref().unwrap(), w0);
        }
    }

    #[test]
    fn duplicate_rank_fails_everyone() {
        let id = lo_id(Duration::from_secs(3));
        let who = [(0, 3, V), (1, 3, V), (1, 3, V)];
        for r in finish(start(id, &who, Duration::from_secs(3))) {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
            let s = err.to_string();
            assert!(s.contains("rank 1 joined twice (from 127.0.0.1:"), "{s}");
        }
    }

    #[test]
    fn size_mismatch_fails_everyone() {
        let id = lo_id(Duration::from_secs(3));
        let first = start(id, &all(0..2, 4), Duration::from_secs(3));
        thread::sleep(Duration::from_millis(300));
        let late = start(id, &[(2, 5, PROTOCOL_VERSION)], Duration::from_secs(3));
        for r in finish(first).into_iter().chain(finish(late)) {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
            let s = err.to_string();
            assert!(s.contains("rank 2 says world size 5 but rank "), "{s}");
            assert!(s.contains(" said 4"), "{s}");
        }
    }

    #[test]
    fn version_mismatch_fails_everyone() {
        let id = lo_id(Duration::from_secs(3));
        let first = start(id, &[(0, 3, V), (2, 3, V)], Duration::from_secs(3));
        thread::sleep(Duration::from_millis(300));
        let other = start(id, &[(1, 3, W)], Duration::from_secs(3));
        for r in finish(first).into_iter().chain(finish(other)) {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
            let s = err.to_string();
            assert!(
                s.contains(&format!(
                    "rank 1 speaks protocol version {W}, root speaks {V}"
                )),
                "{s}"
            );
        }
    }

    #[test]
    fn id_of_another_version_meets_a_root_of_that_version() {
        // A version-2 root (as a newer library would start) and its version-2 id, given to a
        // rank of this library.
        let listener = TcpListener::bind((LO, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        spawn_root_speaking(listener, [9; 16], Duration::from_secs(3), W).unwrap();
        let bytes = *UniqueId::with_root(addr, [9; 16])
            .with_version(W)
            .as_bytes();
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.version(), W);
        let err = join(&id, &peer(0), 2, Instant::now() + Duration::from_secs(3)).unwrap_err();
        assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
        let s = err.to_string();
        assert!(
            s.contains(&format!(
                "rank 0 speaks protocol version {V}, root speaks {W}"
            )),
            "{s}"
        );
        assert!(
            s.contains(&format!("the unique id is of protocol version {W}")),
            "{s}"
        );
    }

    #[test]
    fn missing_rank_times_out_by_name_and_late_joiner_too() {
        let id = lo_id(Duration::from_millis(1500));
        let who = [(0, 4, V), (1, 4, V), (3, 4, V)];
        for r in finish(start(id, &who, Duration::from_secs(4))) {
            let err = r.unwrap_err();
            assert!(matches!(err, Error::Timeout(_)), "{err}");
            let s = err.to_string();
            assert!(
                s.contains("init deadline of 1500 ms passed: ranks [2] did not join"),
                "{s}"
            );
        }
        let late = join(
            &id,
            &peer(2),
            4,
            Instant::now() + Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(matches!(late, Error::Timeout(_)), "{late}");
        let s = late.to_string();
        assert!(
            s.contains(&format!(
                "could not reach the bootstrap root at {}",
                id.root_addr()
            )),
            "{s}"
        );
    }

    #[test]
    fn bad_arguments_are_rejected_locally() {
        let id = UniqueId::with_root(SocketAddr::new(LO, 9), [0; 16]);
        let soon = Instant::now() + Duration::from_millis(100);
        let e = join(&id, &peer(3), 3, soon).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(e
            .to_string()
            .contains("rank 3 is out of range for world size 3"));
        let e = join(&id, &peer(0), 0, soon).unwrap_err();
        assert!(e.to_string().contains("world size 0"));
    }
}
