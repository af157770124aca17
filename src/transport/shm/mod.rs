//! Shared-memory links between ranks on the same host: one ring per direction (`ring.rs`),
//! driven as a `Link` by `link.rs`; and the comm-wide arena (`arena.rs`).
//!
//! Both ranks of a pair set the rings up over their already verified TCP connection: each
//! creates its outgoing ring under a random name (mode 0600), sends the name and its pid,
//! maps the peer's ring, and unlinks its own name once the peer confirms it mapped it. From
//! then on nothing is left in /dev/shm, even if a process is killed with SIGKILL. A peer that
//! dies is noticed through its pid, since a ring has no end-of-file.

pub mod arena;
pub mod futex;
pub mod link;
pub mod ring;
pub mod segment;

use crate::error::{Error, Result};
use ring::Ring;
use std::io::{Read, Write};
use std::net::TcpStream;

/// Whether a peer pair may talk over shared memory (`net::select`): on one host, unless
/// QCCL_TRANSPORT says tcp; always when it says shm.
pub fn can_connect(pair: &crate::transport::link::Pair) -> bool {
    use crate::config::TransportChoice;
    match pair.choice {
        TransportChoice::Tcp => false,
        TransportChoice::Shm => true,
        TransportChoice::Auto => pair.same_host,
    }
}

/// Data bytes of each ring.
pub const RING_BYTES: usize = 4 << 20;

/// The two rings to one peer, and the peer's pid for liveness checks.
pub struct Rings {
    /// This rank writes, the peer reads.
    pub tx: Ring,
    /// The peer writes, this rank reads.
    pub rx: Ring,
    /// The peer's process id.
    pub peer_pid: i32,
}

/// Sets up the rings to `peer` over `sock` (blocking, with a read timeout); both ranks call it
/// at the same point.
pub fn setup(sock: &mut TcpStream, comm_id: u64, me: usize, peer: usize) -> Result<Rings> {
    let name = segment::new_name(comm_id, &format!("{me}-{peer}"));
    let tx = Ring::create(&name, RING_BYTES)?;
    let result = exchange_names(sock, &name).and_then(|(pid, peer_name)| {
        let rx = Ring::open(&peer_name, RING_BYTES)?;
        // Mapped: tell the peer, and wait until it mapped ours before removing our name.
        sock.write_all(&[1])
            .and_then(|_| sock.read_exact(&mut [0u8]))
            .map_err(|e| Error::io("shared memory setup: waiting for the peer to map", e))?;
        Ok((pid, rx))
    });
    Ring::unlink(&name);
    let (peer_pid, rx) = result?;
    Ok(Rings { tx, rx, peer_pid })
}

fn exchange_names(sock: &mut TcpStream, name: &str) -> Result<(i32, String)> {
    let mut msg = Vec::with_capacity(6 + name.len());
    msg.extend_from_slice(&std::process::id().to_le_bytes());
    msg.extend_from_slice(&(name.len() as u16).to_le_bytes());
    msg.extend_from_slice(name.as_bytes());
    sock.write_all(&msg)
        .map_err(|e| Error::io("shared memory setup: sending the segment name", e))?;
    read_name(sock)
}

/// Longest segment name a peer may send (NAME_MAX; ours are about 50 bytes).
const MAX_NAME_LEN: usize = 255;

/// Reads the peer's pid (u32) and segment name (u16 length, then the bytes). The length is
/// checked against [`MAX_NAME_LEN`] before anything is reserved.
fn read_name(sock: &mut impl Read) -> Result<(i32, String)> {
    let mut head = [0u8; 6];
    sock.read_exact(&mut head)
        .map_err(|e| Error::io("shared memory setup: reading the peer's segment name", e))?;
    let pid = u32::from_le_bytes(head[0..4].try_into().unwrap()) as i32;
    let len = u16::from_le_bytes(head[4..6].try_into().unwrap()) as usize;
    if len > MAX_NAME_LEN {
        return Err(Error::InvalidUsage(format!(
            "peer sent a segment name of {len} bytes, over the limit of {MAX_NAME_LEN}"
        )));
    }
    let mut peer_name = vec![0u8; len];
    sock.read_exact(&mut peer_name)
        .map_err(|e| Error::io("shared memory setup: reading the peer's segment name", e))?;
    let peer_name = String::from_utf8(peer_name)
        .ok()
        .filter(|n| segment::checked_name(n).is_some())
        .ok_or_else(|| Error::InvalidUsage("peer sent a malformed segment name".into()))?;
    Ok((pid, peer_name))
}

/// False once process `pid` no longer runs: gone, or a zombie (dead, not yet reaped by its
/// parent: a launcher that waits for its children one by one leaves a killed rank so until
/// its turn, and the peers would wait out their timeout on it).
pub fn alive(pid: i32) -> bool {
    use nix::errno::Errno;
    use nix::sys::signal::kill;
    if matches!(
        kill(nix::unistd::Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    ) {
        return false;
    }
    // /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')' (comm may hold one).
    // Unreadable (another pid namespace, no /proc): assume it runs, as before.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s[s.rfind(')')? + 1..].trim_start().chars().next()?;
            Some(!matches!(state, 'Z' | 'X' | 'x'))
        })
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // Not reaped yet: a zombie once it exited.
        let start = std::time::Instant::now();
        while alive(pid) && start.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!alive(pid), "an exited, unreaped child counts as alive");
        child.wait().unwrap();
        assert!(!alive(pid));
        assert!(alive(std::process::id() as i32));
    }
    use proptest::prelude::*;

    fn message(pid: u32, name: &[u8]) -> Vec<u8> {
        let mut m = pid.to_le_bytes().to_vec();
        m.extend_from_slice(&(name.len() as u16).to_le_bytes());
        m.extend_from_slice(name);
        m
    }

    #[test]
    fn segment_names_are_bounded() {
        let name = segment::new_name(7, "0-1");
        assert_eq!(
            read_name(&mut &message(42, name.as_bytes())[..]).unwrap(),
            (42, name.clone())
        );
        // A length over the limit is refused before anything is reserved or read.
        let mut m = message(42, name.as_bytes());
        m[4..6].copy_from_slice(&u16::MAX.to_le_bytes());
        let mut r = &m[..];
        let e = read_name(&mut r).unwrap_err().to_string();
        assert!(
            e.contains("segment name of 65535 bytes, over the limit of 255"),
            "{e}"
        );
        assert_eq!(r.len(), m.len() - 6);
        // A name that is not one of ours.
        let e = read_name(&mut &message(1, b"/etc/passwd")[..]).unwrap_err();
        assert!(e.to_string().contains("malformed segment name"), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Random or mutated messages: an error or a name of ours within the limit, never a
        /// panic.
        #[test]
        fn read_name_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..400),
            at in any::<usize>(),
            v in any::<u8>(),
            cut in any::<usize>(),
        ) {
            let mut valid = message(9, segment::new_name(3, "1-0").as_bytes());
            let n = valid.len();
            valid[at % n] = v;
            valid.truncate(cut % (n + 1));
            for m in [&bytes, &valid] {
                if let Ok((_, name)) = read_name(&mut &m[..]) {
                    prop_assert!(name.len() <= MAX_NAME_LEN);
                    prop_assert!(segment::checked_name(&name).is_some());
                }
            }
        }
    }
}
