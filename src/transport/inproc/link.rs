//! The in-process link: each frame (header and payload, in one buffer) is one message on an
//! unbounded channel, so a send never waits and a receive reads the frame in place, copying
//! or reducing straight out of it.

use crate::transport::link::{Dir, Link, Wait};
use crate::transport::RecvReduce;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::io;
use std::time::Duration;

/// One frame's bytes: header, then payload.
pub type Frame = Vec<u8>;

/// The channels to one peer thread.
pub struct InprocLink {
    tx: Sender<Frame>,
    rx: Receiver<Frame>,
    /// The frame being read, and how far.
    cur: Option<(Frame, usize)>,
    name: String,
}

impl InprocLink {
    /// A link over the channel pair to a peer called `name` in messages.
    pub fn new(tx: Sender<Frame>, rx: Receiver<Frame>, name: String) -> InprocLink {
        InprocLink {
            tx,
            rx,
            cur: None,
            name,
        }
    }

    /// The unread rest of the current frame, fetching the next when none is left; Ok(None)
    /// when none has come, Err when the peer's end is closed.
    fn unread(&mut self) -> Result<Option<&[u8]>, ()> {
        if self.cur.as_ref().is_none_or(|(f, at)| *at == f.len()) {
            self.cur = match self.rx.try_recv() {
                Ok(f) => Some((f, 0)),
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => return Err(()),
            };
        }
        Ok(self.cur.as_ref().map(|(f, at)| &f[*at..]))
    }

    fn consume(&mut self, n: usize) {
        if let Some((_, at)) = &mut self.cur {
            *at += n;
        }
    }
}

impl Link for InprocLink {
    fn send(&mut self, _stream: usize, parts: [&[u8]; 3]) -> io::Result<usize> {
        // The engine offers the whole frame at once, and the channel takes it whole.
        let len = parts.iter().map(|p| p.len()).sum();
        let mut frame = Vec::with_capacity(len);
        parts.iter().for_each(|p| frame.extend_from_slice(p));
        self.tx
            .send(frame)
            .map_err(|_| io::ErrorKind::BrokenPipe.into())
            .map(|()| len)
    }

    fn recv(&mut self, _stream: usize, buf: &mut [u8]) -> io::Result<usize> {
        match self.unread() {
            Ok(Some(b)) => {
                let n = b.len().min(buf.len());
                buf[..n].copy_from_slice(&b[..n]);
                self.consume(n);
                Ok(n)
            }
            Ok(None) => Err(io::ErrorKind::WouldBlock.into()),
            Err(()) => Ok(0),
        }
    }

    fn reduces_on_receive(&self) -> bool {
        // The frame's payload is already in memory: reducing from it saves a copy too.
        true
    }

    fn recv_reduce(&mut self, dst: &mut [u8], at: usize, reduce: &RecvReduce<'_>) -> usize {
        match self.unread() {
            Ok(Some(b)) => {
                // A frame arrives whole: the payload's rest is all here.
                let n = b.len().min(dst.len());
                reduce.apply(&mut dst[..n], at, &b[..n]);
                self.consume(n);
                n
            }
            _ => 0,
        }
    }

    fn wait(&self, _stream: usize, _dir: Dir) -> Wait<'_> {
        Wait::Queue
    }

    fn sleep(&mut self, _dir: Dir, d: Duration) {
        if self.cur.as_ref().is_some_and(|(f, at)| *at < f.len()) {
            return;
        }
        match self.rx.recv_timeout(d) {
            Ok(f) => self.cur = Some((f, 0)),
            Err(RecvTimeoutError::Timeout) => {}
            // Seen as end of file by the next receive.
            Err(RecvTimeoutError::Disconnected) => {}
        }
    }

    fn lost(&self, _dir: Dir, _err: Option<&io::Error>) -> String {
        "the peer's endpoint is closed (its comm was dropped or aborted)".into()
    }

    fn read_reason(&mut self, len: usize) -> Option<Vec<u8>> {
        let b = self.unread().ok()??;
        let n = b.len().min(len);
        let reason = b[..n].to_vec();
        self.consume(n);
        (n == len).then_some(reason)
    }

    fn abort(&mut self, head: &[u8], reason: &[u8]) {
        let _ = self.send(0, [head, reason, &[]]);
        // Dropping the link closes the channels: the peer's later receives see the end.
    }

    fn addr(&self) -> String {
        self.name.clone()
    }

    fn describe(&self) -> String {
        "inproc".into()
    }
}
