//! Shared-memory links between ranks on the same host: one ring per direction (`ring.rs`).
//!
//! Both ranks of a pair set the link up over their already verified TCP connection: each
//! creates its outgoing ring under a random name (mode 0600), sends the name and its pid,
//! maps the peer's ring, and unlinks its own name once the peer confirms it mapped it. From
//! then on nothing is left in /dev/shm, even if a process is killed with SIGKILL. A peer that
//! dies is noticed through its pid, since a ring has no end-of-file.

pub mod arena;
pub mod futex;
pub mod ring;
pub mod segment;

use crate::error::{Error, Result};
use ring::Ring;
use std::io::{Read, Write};
use std::net::TcpStream;

/// Data bytes of each ring.
pub const RING_BYTES: usize = 4 << 20;

/// The two rings to one peer, and the peer's pid for liveness checks.
pub struct ShmLink {
    /// This rank writes, the peer reads.
    pub tx: Ring,
    /// The peer writes, this rank reads.
    pub rx: Ring,
    /// The peer's process id.
    pub peer_pid: i32,
}

/// Sets up the link to `peer` over `sock` (blocking, with a read timeout); both ranks call it
/// at the same point.
pub fn setup(sock: &mut TcpStream, comm_id: u64, me: usize, peer: usize) -> Result<ShmLink> {
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
    Ok(ShmLink { tx, rx, peer_pid })
}

fn exchange_names(sock: &mut TcpStream, name: &str) -> Result<(i32, String)> {
    let mut msg = Vec::with_capacity(6 + name.len());
    msg.extend_from_slice(&std::process::id().to_le_bytes());
    msg.extend_from_slice(&(name.len() as u16).to_le_bytes());
    msg.extend_from_slice(name.as_bytes());
    sock.write_all(&msg)
        .map_err(|e| Error::io("shared memory setup: sending the segment name", e))?;
    let mut head = [0u8; 6];
    sock.read_exact(&mut head)
        .map_err(|e| Error::io("shared memory setup: reading the peer's segment name", e))?;
    let pid = u32::from_le_bytes(head[0..4].try_into().unwrap()) as i32;
    let len = u16::from_le_bytes(head[4..6].try_into().unwrap()) as usize;
    let mut peer_name = vec![0u8; len.min(255)];
    sock.read_exact(&mut peer_name)
        .map_err(|e| Error::io("shared memory setup: reading the peer's segment name", e))?;
    let peer_name = String::from_utf8(peer_name)
        .ok()
        .filter(|n| segment::checked_name(n).is_some())
        .ok_or_else(|| Error::InvalidUsage("peer sent a malformed segment name".into()))?;
    Ok((pid, peer_name))
}

/// False once process `pid` no longer exists.
pub fn alive(pid: i32) -> bool {
    use nix::errno::Errno;
    use nix::sys::signal::kill;
    !matches!(
        kill(nix::unistd::Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    )
}
