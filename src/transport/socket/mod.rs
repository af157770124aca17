//! The socket link: one or more TCP streams per peer pair (QCCL_NSOCKS_PERPEER), non-blocking,
//! TCP_NODELAY, 4 MiB buffers. A payload of [`MIN_SPLIT`] bytes or more is split evenly over
//! the streams; the header travels on the first, written with the payload in one `writev`.
//! The streams arrive verified and configured from the connector (`transport::net`).

mod abort;

use super::engine::tile;
use super::link::{Dir, Link, Wait};
use super::LinkConfig;
use crate::error::{Error, Result};
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::Duration;

/// Socket buffer size asked for (root may exceed the kernel's default cap).
const SOCKET_BUF: usize = 4 << 20;

/// Payloads below this go on one socket even when the pair has several.
pub const MIN_SPLIT: usize = 64 * 1024;

/// Byte ranges of a `len`-byte payload on each of `nsocks` sockets.
pub fn split(len: usize, nsocks: usize) -> Vec<(usize, usize)> {
    tile(len, streams(len, nsocks)).collect()
}

fn streams(len: usize, nsocks: usize) -> usize {
    if len < MIN_SPLIT {
        1
    } else {
        nsocks
    }
}

/// Whether a peer pair may talk over sockets (`net::select`): always, the kind of last resort.
pub fn can_connect(_pair: &crate::transport::link::Pair) -> bool {
    true
}

/// The sockets to one peer.
pub struct SocketLink {
    /// One or more streams; frame headers travel on the first.
    socks: Vec<TcpStream>,
    /// The peer's listening address, for messages.
    addr: SocketAddr,
    /// True while a frame is half-sent on the first socket.
    mid_frame: bool,
}

impl SocketLink {
    /// A link over `socks`, already configured (`configure`).
    pub fn new(socks: Vec<TcpStream>, addr: SocketAddr) -> SocketLink {
        SocketLink {
            socks,
            addr,
            mid_frame: false,
        }
    }
}

/// Readies a verified stream for the data path: no Nagle delay, large buffers, non-blocking.
pub fn configure(s: &TcpStream) -> Result<()> {
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

/// Reads an abort frame's `len`-byte reason from `sock`, blocking at most 500 ms.
fn read_reason(sock: &mut TcpStream, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let _ = sock.set_nonblocking(false);
    let _ = sock.set_read_timeout(Some(Duration::from_millis(500)));
    sock.read_exact(&mut buf).ok().map(|()| buf)
}

impl Link for SocketLink {
    fn streams(&self, len: usize) -> usize {
        streams(len, self.socks.len())
    }

    fn send(&mut self, stream: usize, parts: [&[u8]; 3]) -> io::Result<usize> {
        let [head, data, _] = parts;
        let sock = &mut self.socks[stream];
        let res = if head.is_empty() {
            sock.write(data)
        } else {
            sock.write_vectored(&[IoSlice::new(head), IoSlice::new(data)])
        };
        if stream == 0 {
            // Remember a frame not sent whole: an abort frame must not be spliced into it.
            match &res {
                Ok(n) => self.mid_frame = *n < head.len() + data.len(),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    self.mid_frame = true
                }
                Err(_) => {}
            }
        }
        res
    }

    fn recv(&mut self, stream: usize, buf: &mut [u8]) -> io::Result<usize> {
        self.socks[stream].read(buf)
    }

    fn wait(&self, stream: usize, _dir: Dir) -> Wait<'_> {
        Wait::Fd(self.socks[stream].as_fd())
    }

    fn read_reason(&mut self, len: usize) -> Option<Vec<u8>> {
        read_reason(&mut self.socks[0], len)
    }

    fn pending_abort(
        &mut self,
        cfg: &LinkConfig,
        peer: usize,
        skip: usize,
        head: &[u8],
    ) -> Option<(String, Option<usize>)> {
        let nsocks = self.socks.len();
        abort::pending(&mut self.socks[0], nsocks, cfg, peer, skip, head)
    }

    fn abort(&mut self, head: &[u8], reason: &[u8]) {
        if !self.mid_frame {
            // Best effort and bounded: the peer may be gone or not reading.
            let s = &self.socks[0];
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
            let mut w = s;
            let _ = w.write_all(head).and_then(|_| w.write_all(reason));
        }
        for s in &self.socks {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn addr(&self) -> String {
        self.addr.to_string()
    }

    fn describe(&self) -> String {
        format!("tcp ({} socket(s))", self.socks.len())
    }
}

#[cfg(test)]
mod tests;
