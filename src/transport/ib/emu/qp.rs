//! Emulated RC queue pairs: the `QueuePair` handle, its state machine, posting, and the
//! connection to the peer's NIC (the state it shares with the NIC's threads: `shared.rs`).

use super::cq::EmuCq;
use super::initiator;
use super::nic::Nic;
use super::shared::{Inner, Peer, QpShared, SendWr, PSN_MASK};
use super::wire::{Answer, Hello, ANSWER_LEN};
use crate::error::{Error, Result};
use crate::transport::ib::verbs::{
    Endpoint, PathSettings, QpCaps, QpState, QueuePair, RemoteAddr, Sge, WcOpcode, WcStatus,
};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bound on connecting to the peer's NIC and on its answer to the hello.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the answer reader looks at its ACK timer.
const ACK_POLL: Duration = Duration::from_millis(50);
/// Shortest and longest ACK timeout: verbs' 4.096 us x 2^timeout x (retry_cnt + 1), kept
/// within these so a lost peer is noticed in seconds, and a loaded machine is no lost peer.
const ACK_TIMEOUT_MIN: Duration = Duration::from_secs(1);
const ACK_TIMEOUT_MAX: Duration = Duration::from_secs(5);
/// Bound on joining a queue pair's threads when it is dropped (they exit as soon as their
/// socket is shut down; this only guards against a bug).
const JOIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The `QueuePair` handle.
pub struct EmuQp {
    shared: Arc<QpShared>,
    nic: Arc<Nic>,
    threads: Vec<JoinHandle<()>>,
}

impl EmuQp {
    /// A new queue pair in the Reset state, registered with `nic` as `qpn`.
    pub fn new(
        nic: Arc<Nic>,
        qpn: u32,
        send_cq: Arc<EmuCq>,
        recv_cq: Arc<EmuCq>,
        caps: QpCaps,
    ) -> (EmuQp, Arc<QpShared>) {
        let name = format!("{} qp {qpn:#x}", nic.name);
        let shared = Arc::new(QpShared::new(qpn, name, send_cq, recv_cq, caps));
        let qp = EmuQp {
            shared: shared.clone(),
            nic,
            threads: Vec::new(),
        };
        (qp, shared)
    }

    fn transition(&self, from: QpState, to: QpState) -> Result<MutexGuard<'_, Inner>> {
        let g = self.shared.lock();
        if g.state != from {
            return Err(Error::InvalidUsage(format!(
                "{}: cannot move from {:?} to {to:?}: only {from:?} -> {to:?}",
                self.shared.name, g.state
            )));
        }
        Ok(g)
    }

    /// Connects to the peer's NIC and says hello; the stream, ready for requests.
    fn connect(&self, peer: &Peer, rnr_retry: u8) -> Result<TcpStream> {
        let name = &self.shared.name;
        let what = |e: std::io::Error| {
            Error::io(
                format!(
                    "{name}: connecting to peer qp {:#x} at {} (its NIC)",
                    peer.qpn, peer.addr
                ),
                e,
            )
        };
        let mut s = TcpStream::connect_timeout(&peer.addr, CONNECT_TIMEOUT).map_err(what)?;
        s.set_nodelay(true).map_err(what)?;
        s.set_read_timeout(Some(CONNECT_TIMEOUT)).map_err(what)?;
        let hello = Hello {
            secret: self.nic.secret,
            target_qpn: peer.qpn,
            source_qpn: self.shared.qpn,
            rnr_retry,
        };
        s.write_all(&hello.encode()).map_err(what)?;
        let mut a = [0u8; ANSWER_LEN];
        if let Err(e) = s.read_exact(&mut a) {
            return Err(Error::System(format!(
                "{name}: the NIC at {} refused the connection to qp {:#x} without an answer \
                 (another job's NIC, a wrong secret, or gone): {e}",
                peer.addr, peer.qpn
            )));
        }
        match Answer::decode(&a) {
            Some(Answer::Accepted) => {}
            Some(Answer::UnknownQp) => {
                return Err(Error::InvalidUsage(format!(
                    "{name}: the NIC at {} has no queue pair {:#x}",
                    peer.addr, peer.qpn
                )))
            }
            None => {
                return Err(Error::System(format!(
                    "{name}: the NIC at {} answered the hello with garbage",
                    peer.addr
                )))
            }
        }
        s.set_read_timeout(Some(ACK_POLL)).map_err(what)?;
        Ok(s)
    }
}

/// The address an endpoint names: the GID's IP (IPv4-mapped or IPv6) and the LID as port.
fn peer_addr(remote: &Endpoint) -> Result<SocketAddr> {
    if remote.lid == 0 {
        return Err(Error::invalid(format!(
            "emulated fabric: endpoint of qp {:#x} has LID 0; the emulation needs the peer \
             NIC's port there",
            remote.qpn
        )));
    }
    let v6 = Ipv6Addr::from(remote.gid);
    let ip = match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    };
    Ok(SocketAddr::new(ip, remote.lid))
}

/// verbs' ACK timeout for `path`, within the emulation's bounds.
pub fn ack_timeout(path: &PathSettings) -> Duration {
    let one = Duration::from_nanos(4096).saturating_mul(1u32 << path.timeout.min(31));
    let total = one.saturating_mul(path.retry_cnt as u32 + 1);
    if path.timeout == 0 {
        // 0 is "infinite" in verbs.
        return ACK_TIMEOUT_MAX;
    }
    total.clamp(ACK_TIMEOUT_MIN, ACK_TIMEOUT_MAX)
}

impl QueuePair for EmuQp {
    fn qpn(&self) -> u32 {
        self.shared.qpn
    }

    fn state(&self) -> QpState {
        self.shared.lock().state
    }

    fn endpoint(&self, psn: u32, gid_index: u8) -> Result<Endpoint> {
        Ok(Endpoint {
            lid: self.nic.addr.port(),
            gid: self.nic.gid(gid_index)?,
            qpn: self.shared.qpn,
            psn: psn & PSN_MASK,
        })
    }

    fn to_init(&mut self) -> Result<()> {
        let mut g = self.transition(QpState::Reset, QpState::Init)?;
        g.state = QpState::Init;
        Ok(())
    }

    fn to_rtr(&mut self, remote: &Endpoint, _path: &PathSettings) -> Result<()> {
        let addr = peer_addr(remote)?;
        let mut g = self.transition(QpState::Init, QpState::Rtr)?;
        g.peer = Some(Peer {
            addr,
            qpn: remote.qpn,
            next_psn: remote.psn & PSN_MASK,
        });
        g.state = QpState::Rtr;
        drop(g);
        // Requests that arrived early wait for this.
        self.shared.cond.notify_all();
        Ok(())
    }

    fn to_rts(&mut self, psn: u32, path: &PathSettings) -> Result<()> {
        let peer = {
            let g = self.transition(QpState::Rtr, QpState::Rts)?;
            g.peer.expect("RTR has a peer")
        };
        let stream = self.connect(&peer, path.rnr_retry)?;
        let clone = |s: &TcpStream| {
            s.try_clone()
                .map_err(|e| Error::io(format!("{}: cloning its socket", self.shared.name), e))
        };
        let (sender, keep) = (clone(&stream)?, clone(&stream)?);
        let reader = stream;
        let mut g = self.transition(QpState::Rtr, QpState::Rts)?;
        g.sq_psn = psn & PSN_MASK;
        g.conn = Some(keep);
        g.last_answer = Instant::now();
        g.state = QpState::Rts;
        drop(g);
        let timeout = ack_timeout(path);
        let spawn = |role: char, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(self.nic.thread_name(role))
                .spawn(f)
        };
        let (shared, regions, faults) = (
            self.shared.clone(),
            self.nic.regions.clone(),
            self.nic.faults.clone(),
        );
        let started = spawn(
            's',
            Box::new(move || initiator::send_loop(&shared, &regions, &faults, sender)),
        )
        .and_then(|t| {
            self.threads.push(t);
            let shared = self.shared.clone();
            spawn(
                'k',
                Box::new(move || initiator::answer_loop(&shared, reader, timeout)),
            )
        });
        match started {
            Ok(t) => {
                self.threads.push(t);
                Ok(())
            }
            Err(e) => {
                let mut g = self.shared.lock();
                self.shared.fail(&mut g);
                Err(Error::io(
                    format!("{}: spawning its NIC thread", self.shared.name),
                    e,
                ))
            }
        }
    }

    fn to_error(&mut self) -> Result<()> {
        {
            let mut g = self.shared.lock();
            self.shared.fail(&mut g);
        }
        self.shared.await_reads();
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<()> {
        let s = &self.shared;
        let mut g = s.lock();
        match g.state {
            QpState::Reset => {
                return Err(Error::InvalidUsage(format!(
                    "{}: post_recv in the Reset state (allowed from Init on)",
                    s.name
                )))
            }
            QpState::Error => {
                s.complete(&s.recv_cq, wr_id, WcStatus::WrFlush, WcOpcode::Unknown);
                return Ok(());
            }
            _ => {}
        }
        if g.recvs.len() >= s.caps.max_recv_wr as usize {
            return Err(Error::System(format!(
                "{}: receive queue full ({} posted, max_recv_wr {})",
                s.name,
                g.recvs.len(),
                s.caps.max_recv_wr
            )));
        }
        g.recvs.push_back(wr_id);
        drop(g);
        s.cond.notify_all();
        Ok(())
    }

    fn post_write(
        &mut self,
        wr_id: u64,
        local: Sge,
        remote: RemoteAddr,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        let s = &self.shared;
        let mut g = s.lock();
        match g.state {
            QpState::Rts => {}
            QpState::Error => {
                s.complete(&s.send_cq, wr_id, WcStatus::WrFlush, WcOpcode::Unknown);
                return Ok(());
            }
            st => {
                return Err(Error::InvalidUsage(format!(
                    "{}: post_write in the {st:?} state (writes need RTS)",
                    s.name
                )))
            }
        }
        let outstanding = g.pending.len() + g.inflight.len();
        if outstanding >= s.caps.max_send_wr as usize {
            return Err(Error::System(format!(
                "{}: send queue full ({outstanding} writes outstanding, max_send_wr {})",
                s.name, s.caps.max_send_wr
            )));
        }
        if self.nic.faults.on_post() {
            crate::qlog!(Warn, "{}: injected fault: to the error state", s.name);
            s.fail(&mut g);
            s.complete(&s.send_cq, wr_id, WcStatus::WrFlush, WcOpcode::Unknown);
            return Ok(());
        }
        // A zero-length sge is not checked, as on a NIC.
        let local_error = match self.nic.regions.get(local.lkey) {
            _ if local.len == 0 => None,
            None => Some(WcStatus::LocalProtection),
            Some(e) if !e.contains(local.addr, local.len) => Some(WcStatus::LocalLength),
            Some(_) => None,
        };
        g.pending.push_back(SendWr {
            wr_id,
            local,
            remote,
            imm,
            signaled,
            local_error,
        });
        drop(g);
        s.cond.notify_all();
        Ok(())
    }
}

impl Drop for EmuQp {
    fn drop(&mut self) {
        // Destroying a queue pair completes nothing (as ibv_destroy_qp).
        {
            let mut g = self.shared.lock();
            g.closed = true;
            if let Some(c) = g.conn.take() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        self.shared.cond.notify_all();
        self.shared.await_reads();
        // Waits for a placement in progress (a memcpy); none starts after `closed`.
        drop(
            self.shared
                .placing
                .write()
                .unwrap_or_else(|p| p.into_inner()),
        );
        self.nic.forget_qp(self.shared.qpn);
        super::join_bounded(
            std::mem::take(&mut self.threads),
            JOIN_TIMEOUT,
            &self.shared.name,
        );
    }
}
