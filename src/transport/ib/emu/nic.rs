//! The emulated NIC of one context: a TCP listener and its accept thread, one thread per
//! inbound queue-pair connection (the responder, `responder.rs`), and the tables they check
//! (queue pairs, regions, completion queues).

use super::cq::EmuCq;
use super::fault::FaultPlan;
use super::region::RegionTable;
use super::responder::{self, Target};
use super::shared::QpShared;
use super::wire::{Answer, Hello, HELLO_LEN};
use crate::error::{Error, Result};
use nix::poll::{poll, PollFd, PollFlags};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long an accepted connection may take to deliver its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the accept thread looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(50);
/// Most inbound connections at a time (each has a thread); more are dropped at once.
const MAX_CONNECTIONS: usize = 1024;
/// Bound on joining the NIC's threads when its context is dropped.
const JOIN_TIMEOUT: Duration = Duration::from_secs(2);
/// The queue pair of a connection whose hello has not been read yet.
const NO_QP: u32 = u32::MAX;

/// Inbound connections: their sockets (to shut them down) and threads (to join).
#[derive(Default)]
struct Conns {
    next_id: u64,
    open: HashMap<u64, (u32, TcpStream)>,
    threads: Vec<JoinHandle<()>>,
}

/// One context's NIC.
pub struct Nic {
    /// "emu0:1".
    pub name: String,
    /// The job's secret, checked on every inbound connection and sent on every outbound one.
    pub secret: [u8; 16],
    /// The listener: its IP is the GID, its port the LID.
    pub addr: SocketAddr,
    /// Registered memory.
    pub regions: Arc<RegionTable>,
    /// Injected faults.
    pub faults: Arc<FaultPlan>,
    qps: Mutex<HashMap<u32, Arc<QpShared>>>,
    next_qpn: AtomicU32,
    cqs: Mutex<Vec<(usize, Weak<EmuCq>)>>,
    stop: AtomicBool,
    conns: Mutex<Conns>,
    accept_thread: Mutex<Option<JoinHandle<()>>>,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Nic {
    /// Opens a NIC listening on `listener`, and starts its accept thread.
    pub fn start(
        name: String,
        secret: [u8; 16],
        listener: TcpListener,
        faults: Arc<FaultPlan>,
    ) -> Result<Arc<Nic>> {
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io(format!("{name}: reading the listener's address"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(format!("{name}: making the listener non-blocking"), e))?;
        let nic = Arc::new(Nic {
            regions: Arc::new(RegionTable::new(name.clone())),
            name,
            secret,
            addr,
            faults,
            qps: Mutex::new(HashMap::new()),
            // QPNs are 24 bits; start at a random point, as NICs do not reuse them soon.
            next_qpn: AtomicU32::new(rand::random::<u32>() & 0x7f_ffff | 0x100),
            cqs: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            accept_thread: Mutex::new(None),
        });
        let n = nic.clone();
        let t = std::thread::Builder::new()
            .name(nic.thread_name('a'))
            .spawn(move || n.accept_loop(&listener))
            .map_err(|e| Error::io(format!("{}: spawning its accept thread", nic.name), e))?;
        *locked(&nic.accept_thread) = Some(t);
        Ok(nic)
    }

    /// A name for one of this NIC's threads: its port and `role` (a: accept, r: responder,
    /// s and k: a queue pair's sender and answer reader), within Linux's 15 bytes.
    pub fn thread_name(&self, role: char) -> String {
        format!("qccl-emu{}{role}", self.addr.port())
    }

    /// True once the context is being dropped.
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The GID at `index`: only index 0, the listener's IP (IPv4-mapped).
    pub fn gid(&self, index: u8) -> Result<[u8; 16]> {
        if index != 0 {
            return Err(Error::invalid(format!(
                "{}: no GID at index {index} (the emulated port has one, at 0)",
                self.name
            )));
        }
        Ok(gid_of(self.addr.ip()))
    }

    /// Keeps `cq` so that queue pairs created with it can be given its completions.
    pub fn add_cq(&self, cq: &Arc<EmuCq>) {
        let mut cqs = locked(&self.cqs);
        cqs.retain(|(_, w)| w.strong_count() > 0);
        cqs.push((Arc::as_ptr(cq) as *const () as usize, Arc::downgrade(cq)));
    }

    /// The emulated CQ behind `ptr` (a `dyn CompletionQueue`'s data pointer), if this
    /// context created it.
    pub fn find_cq(&self, ptr: *const ()) -> Option<Arc<EmuCq>> {
        locked(&self.cqs)
            .iter()
            .find(|(p, _)| *p == ptr as usize)
            .and_then(|(_, w)| w.upgrade())
    }

    /// A fresh queue pair number (24 bits, not 0, not in use), registered with `make`'s
    /// queue pair.
    pub fn add_qp<T>(&self, make: impl FnOnce(u32) -> (T, Arc<QpShared>)) -> T {
        let mut qps = locked(&self.qps);
        let qpn = loop {
            let n = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
            if n != 0 && !qps.contains_key(&n) {
                break n;
            }
        };
        let (out, shared) = make(qpn);
        qps.insert(qpn, shared);
        out
    }

    /// Removes queue pair `qpn` and cuts the connections writing to it.
    pub fn forget_qp(&self, qpn: u32) {
        locked(&self.qps).remove(&qpn);
        for (q, s) in locked(&self.conns).open.values() {
            if *q == qpn {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    fn accept_loop(self: &Arc<Nic>, listener: &TcpListener) {
        while !self.stopping() {
            let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, ACCEPT_POLL.as_millis() as u16) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    crate::qlog!(Warn, "{}: poll on the listener: {e}", self.name);
                    std::thread::sleep(ACCEPT_POLL);
                    continue;
                }
            }
            let (stream, from) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => {
                    crate::qlog!(Warn, "{}: accept: {e}", self.name);
                    std::thread::sleep(ACCEPT_POLL);
                    continue;
                }
            };
            let mut conns = locked(&self.conns);
            conns.threads.retain(|t| !t.is_finished());
            if conns.threads.len() >= MAX_CONNECTIONS {
                crate::qlog!(
                    Warn,
                    "{}: connection from {from} dropped: {MAX_CONNECTIONS} already open",
                    self.name
                );
                continue;
            }
            let nic = self.clone();
            match std::thread::Builder::new()
                .name(self.thread_name('r'))
                .spawn(move || nic.connection(stream, from))
            {
                Ok(t) => conns.threads.push(t),
                Err(e) => crate::qlog!(Warn, "{}: spawning a connection thread: {e}", self.name),
            }
        }
    }

    /// One inbound connection: the hello, then the responder until it ends.
    fn connection(self: Arc<Nic>, mut stream: TcpStream, from: SocketAddr) {
        // Registered first, so that a shutdown cuts it even while its hello is awaited; after
        // registering, the stop flag is checked (a shutdown sets it before cutting).
        let id = {
            let mut conns = locked(&self.conns);
            let Ok(keep) = stream.try_clone() else {
                return;
            };
            let id = conns.next_id;
            conns.next_id += 1;
            conns.open.insert(id, (NO_QP, keep));
            id
        };
        if !self.stopping() {
            self.serve_connection(&mut stream, from, id);
        }
        locked(&self.conns).open.remove(&id);
    }

    fn serve_connection(&self, stream: &mut TcpStream, from: SocketAddr, id: u64) {
        let mut b = [0u8; HELLO_LEN];
        let read = stream
            .set_nonblocking(false)
            .and_then(|_| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
            .and_then(|_| stream.read_exact(&mut b));
        if let Err(e) = read {
            crate::qlog!(
                Trace,
                "{}: connection from {from}: no hello: {e}",
                self.name
            );
            return;
        }
        let hello = match Hello::decode(&b, &self.secret) {
            Ok(h) => h,
            Err(why) => {
                crate::qlog!(Warn, "{}: connection from {from} refused: {why}", self.name);
                return;
            }
        };
        let qp = {
            // Looked up and tagged under the conns lock too, so `forget_qp` cannot slip
            // between the two.
            let mut conns = locked(&self.conns);
            let qp = locked(&self.qps).get(&hello.target_qpn).cloned();
            if let (Some(_), Some(c)) = (&qp, conns.open.get_mut(&id)) {
                c.0 = hello.target_qpn;
            }
            qp
        };
        let Some(qp) = qp else {
            crate::qlog!(
                Info,
                "{}: connection from {from} for unknown qp {:#x} refused",
                self.name,
                hello.target_qpn
            );
            let _ = stream.write_all(&Answer::UnknownQp.encode());
            return;
        };
        let ready = stream.set_nodelay(true).is_ok()
            && stream.set_read_timeout(None).is_ok()
            && stream.write_all(&Answer::Accepted.encode()).is_ok();
        if ready {
            crate::qlog!(
                Trace,
                "{}: qp {:#x} accepts writes from {from} qp {:#x}",
                self.name,
                hello.target_qpn,
                hello.source_qpn
            );
            let target = Target {
                regions: &self.regions,
                stop: &self.stop,
            };
            responder::serve(&target, &qp, &hello, stream);
        }
    }

    /// Stops the NIC: no new connection, every inbound connection cut, every queue pair still
    /// open moved to the error state, threads joined (bounded).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        // First the accept thread, so no connection thread starts after the others are taken.
        let accept = locked(&self.accept_thread).take();
        super::join_bounded(accept.into_iter().collect(), JOIN_TIMEOUT, &self.name);
        let mut threads = Vec::new();
        let qps: Vec<Arc<QpShared>> = locked(&self.qps).values().cloned().collect();
        for qp in qps {
            let mut g = qp.lock();
            if !g.closed {
                qp.fail(&mut g);
            }
            drop(g);
            qp.cond.notify_all();
        }
        {
            let mut conns = locked(&self.conns);
            for (_, s) in conns.open.values() {
                let _ = s.shutdown(Shutdown::Both);
            }
            threads.append(&mut conns.threads);
        }
        super::join_bounded(threads, JOIN_TIMEOUT, &self.name);
    }
}

/// The GID of `ip`: IPv4-mapped for IPv4, as RoCE v2 GIDs are.
fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}
