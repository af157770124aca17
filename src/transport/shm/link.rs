//! The shared-memory link: frames through the pair's rings (`Rings`). Frames are padded to 8
//! bytes, so every frame starts 8-aligned in the ring and no element of any dtype straddles
//! the ring's end: a receive can then reduce straight from `Ring::peek` without copying out
//! first. A ring has no end-of-file, so after each sleep the peer's pid is checked.

use super::{alive, Rings};
use crate::transport::link::{Dir, Link, Wait};
use crate::transport::RecvReduce;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The rings to one peer, and the sockets they were set up over (kept open, unused, until
/// the link closes).
pub struct ShmLink {
    rings: Rings,
    socks: Vec<TcpStream>,
    addr: SocketAddr,
    /// True while a frame is half-written into the ring.
    mid_frame: bool,
}

impl ShmLink {
    /// A link over `rings`, set up over `socks` with the peer at `addr`.
    pub fn new(rings: Rings, socks: Vec<TcpStream>, addr: SocketAddr) -> ShmLink {
        ShmLink {
            rings,
            socks,
            addr,
            mid_frame: false,
        }
    }
}

/// "Nothing now" for a ring that has nothing (an empty ring is no end of file).
fn some(n: usize) -> io::Result<usize> {
    match n {
        0 => Err(io::ErrorKind::WouldBlock.into()),
        n => Ok(n),
    }
}

impl Link for ShmLink {
    fn pad(&self, len: usize) -> usize {
        (8 - len % 8) % 8
    }

    fn send(&mut self, _stream: usize, parts: [&[u8]; 3]) -> io::Result<usize> {
        let n = self.rings.tx.try_write(&parts);
        self.mid_frame = n < parts.iter().map(|p| p.len()).sum();
        Ok(n)
    }

    fn recv(&mut self, _stream: usize, buf: &mut [u8]) -> io::Result<usize> {
        some(self.rings.rx.try_read(buf))
    }

    fn reduces_on_receive(&self) -> bool {
        true
    }

    fn recv_reduce(&mut self, dst: &mut [u8], at: usize, reduce: &RecvReduce<'_>) -> usize {
        let es = reduce.dtype.size();
        let avail = self.rings.rx.peek();
        // Whole elements only; frames are 8-aligned, so none straddles the ring end.
        let n = avail.len().min(dst.len()) / es * es;
        if n > 0 {
            reduce.apply(&mut dst[..n], at, &avail[..n]);
            self.rings.rx.consume(n);
        }
        n
    }

    fn skip(&mut self, n: usize) -> usize {
        let n = self.rings.rx.peek().len().min(n);
        if n > 0 {
            self.rings.rx.consume(n);
        }
        n
    }

    fn wait(&self, _stream: usize, _dir: Dir) -> Wait<'_> {
        Wait::Bell
    }

    fn sleep(&mut self, dir: Dir, d: Duration) {
        match dir {
            Dir::Send => self.rings.tx.wait_writable(d),
            Dir::Recv => self.rings.rx.wait_readable(d),
        }
    }

    fn gone(&self) -> Option<String> {
        let pid = self.rings.peer_pid;
        (!alive(pid)).then(|| format!("its process (pid {pid}) is gone: killed or exited"))
    }

    fn read_reason(&mut self, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut got = 0;
        while got < len && Instant::now() < deadline {
            got += self.rings.rx.try_read(&mut buf[got..]);
        }
        (got == len).then_some(buf)
    }

    fn abort(&mut self, head: &[u8], reason: &[u8]) {
        // All or nothing: a partial abort frame would be garbage to the peer.
        if !self.mid_frame && self.rings.tx.room() >= head.len() + reason.len() {
            self.rings.tx.try_write(&[head, reason]);
        }
        for s in &self.socks {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn shared_pid(&self) -> Option<i32> {
        Some(self.rings.peer_pid)
    }

    fn addr(&self) -> String {
        self.addr.to_string()
    }

    fn describe(&self) -> String {
        format!("shm (pid {})", self.rings.peer_pid)
    }
}
