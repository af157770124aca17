//! The responder: carries out one connection's writes into this NIC's memory, in order, and
//! answers each. A write is checked (queue pair connected to the sender, PSN in sequence, rkey
//! and range), its payload read, a receive taken for a write with immediate (waiting as RNR
//! retries allow), then its bytes placed and only then the receive completed and the write
//! acknowledged, so both sides see the bytes before any completion about them.

use super::region::RegionTable;
use super::shared::{QpShared, PSN_MASK};
use super::wire::{self, Got, Hello, Request, Response, REQ_LEN};
use crate::transport::ib::verbs::QpState;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a write may wait for its queue pair to reach RTR (the peer connected first):
/// about a NIC's transport retries at the longest ACK timeout the emulation uses.
const RTR_WAIT: Duration = Duration::from_secs(5);
/// One RNR retry's wait for a receive (a NIC's min_rnr_timer).
const RNR_STEP: Duration = Duration::from_millis(10);
/// `rnr_retry` value meaning "retry forever".
const RNR_FOREVER: u8 = 7;

/// What a responder needs of its NIC: the registered memory, and whether the NIC is
/// stopping.
pub struct Target<'a> {
    /// The NIC's regions, by rkey.
    pub regions: &'a RegionTable,
    /// Set while the NIC is being dropped.
    pub stop: &'a AtomicBool,
}

impl Target<'_> {
    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// Why a request got no answer: the connection is to be closed.
struct Close;

/// Serves requests on `stream` for `qp` until the connection ends or fails.
pub fn serve(nic: &Target<'_>, qp: &QpShared, hello: &Hello, stream: &mut TcpStream) {
    let mut head = [0u8; REQ_LEN];
    let mut payload = Vec::new();
    loop {
        match wire::read_message(stream, &mut head) {
            Ok(Got::Done) => {}
            Ok(Got::Idle) => continue,
            Ok(Got::Closed) | Err(_) => return,
        }
        let req = match Request::decode(&head) {
            Ok(r) => r,
            Err(e) => {
                crate::qlog!(Warn, "{}: {e} from qp {:#x}", qp.name, hello.source_qpn);
                return;
            }
        };
        let answer = match handle(nic, qp, hello, &req, stream, &mut payload) {
            Ok(a) => a,
            Err(Close) => return,
        };
        let sent = stream.write_all(&answer.encode(req.psn));
        if answer == Response::NakRemoteAccess {
            // This side goes to the error state only once the initiator has its NAK: failing
            // first flushes this side's receives, and its comm, seeing them, may tear the
            // connection down before the NAK is sent, so that the initiator saw a lost peer
            // (RetryExceeded) instead of the remote access error (seen in CI under load).
            qp.fail(&mut qp.lock());
        }
        if sent.is_err() || answer != Response::Ack {
            // After a NAK the initiator's queue pair is in the error state: nothing follows.
            return;
        }
    }
}

fn handle(
    nic: &Target<'_>,
    qp: &QpShared,
    hello: &Hello,
    req: &Request,
    stream: &mut TcpStream,
    payload: &mut Vec<u8>,
) -> Result<Response, Close> {
    if let Some(nak) = accept(nic, qp, hello, req)? {
        return Ok(nak);
    }
    // A zero-length write checks no rkey (as the InfiniBand spec says).
    let target = if req.len == 0 {
        None
    } else {
        match nic.regions.get(req.rkey) {
            Some(e) if e.writable(req.addr, req.len) => Some(e),
            found => {
                crate::qlog!(
                    Warn,
                    "{}: remote access error: write of {} bytes at {:#x} with rkey {:#x} from \
                     qp {:#x}: {}",
                    qp.name,
                    req.len,
                    req.addr,
                    req.rkey,
                    hello.source_qpn,
                    if found.is_some() {
                        "outside the region"
                    } else {
                        "unknown rkey"
                    }
                );
                // `serve` fails the queue pair once the NAK is sent.
                return Ok(Response::NakRemoteAccess);
            }
        }
    };
    payload.resize(req.len as usize, 0);
    if stream.read_exact(payload).is_err() {
        return Err(Close);
    }
    let recv = match req.imm {
        Some(_) => match take_recv(nic, qp, hello, req, stream)? {
            Ok(wr_id) => Some(wr_id),
            Err(nak) => return Ok(nak),
        },
        None => None,
    };
    // No placement once the queue pair is dropped (its drop waits for this one).
    let _placing = qp.placing.read().unwrap_or_else(|p| p.into_inner());
    if qp.lock().closed {
        return Err(Close);
    }
    if let Some(e) = target {
        if !e.write(req.addr, payload) {
            crate::qlog!(
                Warn,
                "{}: remote access error: rkey {:#x} deregistered during a write",
                qp.name,
                req.rkey
            );
            if let Some(id) = recv {
                qp.lock().recvs.push_front(id);
            }
            // `serve` fails the queue pair once the NAK is sent.
            return Ok(Response::NakRemoteAccess);
        }
    }
    if let Some(wr_id) = recv {
        let g = qp.lock();
        if g.state == QpState::Error || g.closed {
            // Failed while the bytes were placed: the receive was taken off the queue before
            // the flush, so flush it here.
            drop(g);
            qp.flush_recv(wr_id);
            return Ok(Response::NakDropped);
        }
        qp.complete_recv(wr_id, req.len, req.imm.unwrap_or(0));
    }
    Ok(Response::Ack)
}

/// Checks the request may be carried out: the queue pair is (or soon gets) connected to the
/// sender, and the PSN is the next one. A NAK when not (logged), `Close` when the queue pair
/// or the NIC is going away.
fn accept(
    nic: &Target<'_>,
    qp: &QpShared,
    hello: &Hello,
    req: &Request,
) -> Result<Option<Response>, Close> {
    let deadline = Instant::now() + RTR_WAIT;
    let mut g = qp.lock();
    loop {
        if g.closed || nic.stopping() {
            return Err(Close);
        }
        match g.state {
            QpState::Rtr | QpState::Rts => break,
            QpState::Error => return Ok(Some(Response::NakDropped)),
            QpState::Reset | QpState::Init => {
                let now = Instant::now();
                if now >= deadline {
                    crate::qlog!(
                        Warn,
                        "{}: write from qp {:#x} dropped: still not RTR after {RTR_WAIT:?}",
                        qp.name,
                        hello.source_qpn
                    );
                    return Ok(Some(Response::NakDropped));
                }
                let step = (deadline - now).min(Duration::from_millis(50));
                g = qp
                    .cond
                    .wait_timeout(g, step)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }
    let peer = g.peer.expect("RTR has a peer");
    if peer.qpn != hello.source_qpn {
        crate::qlog!(
            Warn,
            "{}: write from qp {:#x} dropped: connected to qp {:#x}",
            qp.name,
            hello.source_qpn,
            peer.qpn
        );
        return Ok(Some(Response::NakDropped));
    }
    if req.psn != peer.next_psn {
        crate::qlog!(
            Warn,
            "{}: write from qp {:#x} dropped: psn {:#x} out of sequence (expected {:#x})",
            qp.name,
            hello.source_qpn,
            req.psn,
            peer.next_psn
        );
        return Ok(Some(Response::NakDropped));
    }
    if let Some(p) = g.peer.as_mut() {
        p.next_psn = (p.next_psn + 1) & PSN_MASK;
    }
    Ok(None)
}

/// Takes the next posted receive for a write with immediate, waiting up to the initiator's
/// RNR retries (forever for 7) and telling it the responder is still there meanwhile.
fn take_recv(
    nic: &Target<'_>,
    qp: &QpShared,
    hello: &Hello,
    req: &Request,
    stream: &mut TcpStream,
) -> Result<Result<u64, Response>, Close> {
    let mut tries = 0u32;
    loop {
        let mut g = qp.lock();
        if g.closed || nic.stopping() {
            return Err(Close);
        }
        if g.state == QpState::Error {
            return Ok(Err(Response::NakDropped));
        }
        if let Some(wr_id) = g.recvs.pop_front() {
            return Ok(Ok(wr_id));
        }
        if hello.rnr_retry != RNR_FOREVER && tries >= hello.rnr_retry as u32 {
            crate::qlog!(
                Info,
                "{}: no receive posted for a write with immediate from qp {:#x} after {tries} \
                 RNR retries",
                qp.name,
                hello.source_qpn
            );
            return Ok(Err(Response::NakRnr));
        }
        let (g, waited) = qp
            .cond
            .wait_timeout(g, RNR_STEP)
            .unwrap_or_else(|p| p.into_inner());
        if waited.timed_out() && g.recvs.is_empty() {
            drop(g);
            tries += 1;
            // An RNR NAK on the wire: the initiator's ACK timer restarts.
            if stream
                .write_all(&Response::Waiting.encode(req.psn))
                .is_err()
            {
                return Err(Close);
            }
        }
    }
}
