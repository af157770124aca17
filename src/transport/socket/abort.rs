//! Finding the abort frame a peer queued behind data frames before it closed: when our send
//! to a peer that aborted meets the reset first, its reason (naming the rank that really
//! failed) still waits unread on the first socket.

use super::{read_reason, split};
use crate::transport::frame::{FrameKind, Header, HEADER_LEN};
use crate::transport::LinkConfig;
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Reads on from where `sock` (the pair's first of `nsocks` sockets) stands (`skip` bytes of
/// the current frame left, or `head`, the part of a header already read) over whatever data
/// frames were queued, to an abort frame; returns its reason and the rank it names. Bounded:
/// 16 frames, one second in all, and `abort()` on the comm ends it, since the peer is gone or
/// going.
pub fn pending(
    sock: &mut TcpStream,
    nsocks: usize,
    cfg: &LinkConfig,
    peer: usize,
    skip: usize,
    head: &[u8],
) -> Option<(String, Option<usize>)> {
    const MAX_FRAMES: usize = 16;
    let deadline = Instant::now() + Duration::from_secs(1);
    sock.set_nonblocking(false).ok()?;
    // Some bytes, waiting in slices of at most 100 ms so the abort flag is seen.
    let read = |sock: &mut TcpStream, buf: &mut [u8]| -> Option<usize> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || cfg.abort.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let wait = left.min(Duration::from_millis(100));
            sock.set_read_timeout(Some(wait)).ok()?;
            match sock.read(buf) {
                Ok(0) => return None,
                Ok(n) => return Some(n),
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                Err(_) => return None,
            }
        }
    };
    let mut scratch = [0u8; 4096];
    let mut h = [0u8; HEADER_LEN];
    let (mut skip, mut got) = (skip, head.len());
    h[..got].copy_from_slice(head);
    for _ in 0..MAX_FRAMES {
        while skip > 0 {
            let n = skip.min(scratch.len());
            skip -= read(sock, &mut scratch[..n])?;
        }
        while got < HEADER_LEN {
            got += read(sock, &mut h[got..])?;
        }
        let header = Header::decode(&h, peer).ok()?;
        if header.kind == FrameKind::Abort {
            let reason = read_reason(sock, header.len as usize)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_else(|| "(reason lost)".into());
            return Some((reason, header.culprit()));
        }
        // A data frame sent ahead of us: only its first part travels on this socket.
        let (a, b) = split(header.len as usize, nsocks)[0];
        (skip, got) = (b - a, 0);
    }
    None
}
