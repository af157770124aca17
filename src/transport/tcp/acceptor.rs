//! The listening side of a TCP comm: a thread that accepts, checks each hello, sets up the
//! shared-memory link for a same-host peer, and hands verified connections to the transport.
//! Doing both halves of the accepting side here means a rank that connects never waits on
//! the other rank's main thread (which may itself be connecting elsewhere), so lazy
//! connection cannot deadlock.

use super::handshake;
use crate::error::{Error, Result};
use crate::transport::shm::{self, ShmLink};
use crossbeam_channel::{unbounded, Receiver};
use nix::poll::{poll, PollFd, PollFlags};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A verified incoming connection: peer rank, socket index, stream, and the shared-memory
/// link when the peer is on this host (set up on its first socket).
pub type Incoming = (usize, usize, TcpStream, Option<ShmLink>);

/// The accept thread; stops (and closes the listener) when dropped.
pub struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// Verified connections, in arrival order.
    pub incoming: Receiver<Incoming>,
}

impl Acceptor {
    /// Starts accepting on `listener` for comm `comm_id` of `size` ranks.
    pub fn spawn(
        listener: TcpListener,
        secret: [u8; 16],
        comm_id: u64,
        size: usize,
        me: usize,
        shm_peers: Vec<bool>,
    ) -> Result<Acceptor> {
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("setting the listener non-blocking", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, incoming) = unbounded();
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("qccl-accept-{me}"))
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
                    if poll(&mut fds, 100u16).unwrap_or(0) <= 0 {
                        continue;
                    }
                    let Ok((mut s, from)) = listener.accept() else {
                        continue;
                    };
                    // A stranger gets two seconds to prove the secret, then is dropped.
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                    match handshake::accept(&mut s, &secret, comm_id, size) {
                        Ok((rank, sock)) => {
                            let link = if sock == 0 && shm_peers[rank] {
                                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                                match shm::setup(&mut s, comm_id, me, rank) {
                                    Ok(l) => Some(l),
                                    Err(e) => {
                                        crate::qlog!(
                                            Warn,
                                            "rank {me}: shm setup with rank {rank} failed: {e}"
                                        );
                                        continue;
                                    }
                                }
                            } else {
                                None
                            };
                            if tx.send((rank, sock, s, link)).is_err() {
                                return;
                            }
                        }
                        Err(why) => {
                            crate::qlog!(Warn, "rank {me}: refused connection from {from}: {why}")
                        }
                    }
                }
            })
            .map_err(|e| Error::io("spawning the accept thread", e))?;
        Ok(Acceptor {
            stop,
            thread: Some(thread),
            incoming,
        })
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
