//! The contract every link kind keeps: a [`Link`] moves the frames of one peer pair (a socket
//! set, a shared-memory ring pair, an in-process channel pair); a [`Connector`] opens the links
//! of one comm, choosing the kind per peer pair. The progress engine (`engine.rs`) drives any
//! mix of links through this contract alone, so a new link kind is a folder of its own plus a
//! line in its connector's choice: no other link and not the engine change.
//!
//! The engine owns the per-exchange state (how far each frame got); a link only moves bytes
//! when asked and says how to sleep on it. A frame is a header (`frame.rs`), the payload, and
//! `Link::pad` zero bytes, written as one ordered byte sequence per stream.

use super::stall::Inspector;
use super::LinkConfig;
use super::RecvReduce;
use crate::error::Result;
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

/// What a link kind may know of a peer pair when asked whether it can connect it
/// (`net::select`).
#[derive(Debug, Clone, Copy)]
pub struct Pair {
    /// QCCL_TRANSPORT.
    pub choice: crate::config::TransportChoice,
    /// Both ranks share a host id.
    pub same_host: bool,
    /// Both ranks have a usable RDMA device (and may use it: QCCL_NET, QCCL_IB_DISABLE).
    pub rdma: bool,
}

/// Which way a pending job moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// A frame leaving this rank.
    Send,
    /// A frame arriving.
    Recv,
}

/// How the engine may sleep until a link can move bytes again.
pub enum Wait<'a> {
    /// `poll` this descriptor (POLLOUT to send, POLLIN to receive): many are watched at once.
    Fd(BorrowedFd<'a>),
    /// Only `Link::sleep` can wait on it (a futex bell), and a sender may wait on our reads:
    /// while other jobs are pending, one such sleep is kept short (1 ms) so they are not
    /// starved.
    Bell,
    /// Only `Link::sleep` can wait on it, but no sender ever waits on it (an unbounded
    /// queue): sleeping on it the whole slice starves nobody.
    Queue,
}

/// One peer pair's frame mover. Calls never block unless named so; `io::ErrorKind::WouldBlock`
/// (or `Interrupted`) means "nothing now".
pub trait Link: Send {
    /// Byte streams a `len`-byte payload is split over (the header travels on stream 0).
    fn streams(&self, len: usize) -> usize {
        let _ = len;
        1
    }

    /// Zero bytes that follow a `len`-byte payload on the wire.
    fn pad(&self, len: usize) -> usize {
        let _ = len;
        0
    }

    /// Writes what fits of `parts` (in order: rest of the header, payload part, padding) on
    /// `stream`; the bytes written. On stream 0 the link notes whether a frame is left half
    /// sent (no abort frame may then be spliced in).
    fn send(&mut self, stream: usize, parts: [&[u8]; 3]) -> io::Result<usize>;

    /// Reads what has arrived on `stream`, up to `buf.len()` bytes of a header or payload;
    /// `Ok(0)`: the peer closed the link.
    fn recv(&mut self, stream: usize, buf: &mut [u8]) -> io::Result<usize>;

    /// True when arriving payload can be reduced straight out of the link's memory
    /// (`RecvReq::reducing`), saving the copy into a landing buffer.
    fn reduces_on_receive(&self) -> bool {
        false
    }

    /// Reduces what has arrived of the payload into `dst` (at offset `at` of the frame's
    /// payload), whole elements only; the bytes consumed. Only where `reduces_on_receive`.
    fn recv_reduce(&mut self, dst: &mut [u8], at: usize, reduce: &RecvReduce<'_>) -> usize {
        let _ = (dst, at, reduce);
        0
    }

    /// Drops up to `n` bytes of padding that have arrived; how many.
    fn skip(&mut self, n: usize) -> usize {
        let _ = n;
        0
    }

    /// How to sleep until `stream` may move bytes in direction `dir`.
    fn wait(&self, stream: usize, dir: Dir) -> Wait<'_>;

    /// Sleeps until `dir` may move bytes, at most `d` (for `Wait::Bell` and `Wait::Queue`).
    fn sleep(&mut self, dir: Dir, d: Duration) {
        let _ = (dir, d);
    }

    /// Checked after every sleep: why the peer is known gone (a link without end-of-file
    /// watches its process), else None.
    fn gone(&self) -> Option<String> {
        None
    }

    /// The error message for a link that closed (`err` None) or failed while moving bytes in
    /// direction `dir`.
    fn lost(&self, dir: Dir, err: Option<&io::Error>) -> String {
        match (dir, err) {
            (_, None) => "connection closed by the peer (it exited, was killed, or aborted)".into(),
            (Dir::Send, Some(e)) => {
                format!("sending failed: {e} (the peer exited or closed the connection)")
            }
            (Dir::Recv, Some(e)) => {
                format!("receiving failed: {e} (the peer exited or closed the connection)")
            }
        }
    }

    /// Reads the `len`-byte reason of an abort frame whose header arrived; bounded in time
    /// (about 500 ms), since the peer is going away.
    fn read_reason(&mut self, len: usize) -> Option<Vec<u8>>;

    /// After a failed send or receive: an abort frame the peer queued behind what is unread
    /// (`skip` bytes left of the frame being read on stream 0, or `head`, the part of a header
    /// read so far): its reason and the rank it names. Bounded; None where the link cannot
    /// tell.
    fn pending_abort(
        &mut self,
        cfg: &LinkConfig,
        peer: usize,
        skip: usize,
        head: &[u8],
    ) -> Option<(String, Option<usize>)> {
        let _ = (cfg, peer, skip, head);
        None
    }

    /// Called when an exchange failed with a frame to this peer not fully sent: from now on
    /// the link must not read that frame's memory, which goes back to the caller (a link
    /// that sends from the caller's memory without a copy stops its device here).
    fn release(&mut self) {}

    /// Best effort, bounded: sends the abort frame (`head`, `reason`) unless a frame is half
    /// sent, then closes.
    fn abort(&mut self, head: &[u8], reason: &[u8]);

    /// The peer's process id where the link maps memory it shares with it (what a comm-wide
    /// shared-memory arena needs), else None.
    fn shared_pid(&self) -> Option<i32> {
        None
    }

    /// The peer's address, for error messages.
    fn addr(&self) -> String;

    /// What the link is, for the connection log ("tcp (2 socket(s))", "shm (pid 7)").
    fn describe(&self) -> String;
}

/// Opens one comm's links, lazily, one peer at a time.
pub trait Connector: Send {
    /// Opens the link to `peer`; both ranks of the pair call it at their first use of it (it
    /// may wait for the peer, within `cfg.timeout`).
    fn connect(&mut self, peer: usize, cfg: &LinkConfig) -> Result<Box<dyn Link>>;

    /// True when the link to `peer` will share memory with its process (known before it is
    /// opened), so a comm whose peers all do can map a comm-wide arena.
    fn shares_memory(&self, peer: usize) -> bool {
        let _ = peer;
        false
    }

    /// The comm's id (names shared segments).
    fn comm_id(&self) -> u64;

    /// After an abort: tells the peers not linked yet, where it can (the abort frame is
    /// `head`, `reason`), and drops half-opened links.
    fn abort(&mut self, head: &[u8], reason: &[u8]) {
        let _ = (head, reason);
    }

    /// The stall inspector whose thread answers probes (over the network), if any.
    fn inspector(&self) -> Option<Arc<Inspector>> {
        None
    }

    /// Human-readable name of `peer` for error messages (its address).
    fn peer_name(&self, peer: usize) -> String;

    /// "tcp", "tcp+shm" or "inproc".
    fn name(&self) -> &'static str;
}
