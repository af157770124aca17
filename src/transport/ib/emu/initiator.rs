//! The initiator's two threads per connected queue pair: one sends its writes in order, one
//! reads the responder's answers and completes the writes.

use super::fault::{FaultKind, FaultPlan};
use super::region::RegionTable;
use super::shared::{Inflight, Position, QpShared, PSN_MASK};
use super::wire::{self, Got, Request, Response, REQ_LEN, RESP_LEN};
use crate::transport::ib::verbs::{QpState, WcOpcode, WcStatus};
use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

/// The initiator's sender: takes posted writes in order, copies their bytes out of the
/// local region, and sends each as one request.
pub fn send_loop(qp: &QpShared, regions: &RegionTable, faults: &FaultPlan, mut stream: TcpStream) {
    let mut buf = Vec::new();
    loop {
        let wr = {
            let mut g = qp.lock();
            loop {
                if g.closed || g.state != QpState::Rts {
                    return;
                }
                // Left queued while its bytes are copied, so a failure meanwhile flushes it
                // in order with the others.
                if let Some(wr) = g.pending.front().copied() {
                    break wr;
                }
                g = qp.cond.wait(g).unwrap_or_else(|p| p.into_inner());
            }
        };
        let fault = if wr.local_error.is_none() {
            faults.on_send(wr.signaled)
        } else {
            None
        };
        buf.clear();
        buf.resize(REQ_LEN, 0);
        // The region may have been deregistered since the post. The copy runs under
        // `reading`, after checking the queue pair is still sending (see `await_reads`).
        let reading = qp.reading.read().unwrap_or_else(|p| p.into_inner());
        {
            let g = qp.lock();
            if g.closed || g.state != QpState::Rts {
                return;
            }
        }
        let copied = wr.local_error.is_some()
            || wr.local.len == 0
            || regions
                .get(wr.local.lkey)
                .is_some_and(|e| e.read(wr.local.addr, wr.local.len, &mut buf));
        drop(reading);
        let mut g = qp.lock();
        if g.closed || g.state != QpState::Rts {
            // Flushed with the rest (or dropped).
            return;
        }
        g.pending.pop_front();
        let failure = if let Some(st) = wr.local_error {
            Some(st)
        } else if !copied {
            Some(WcStatus::LocalProtection)
        } else if fault == Some(FaultKind::Cqe) {
            crate::qlog!(Warn, "{}: injected fault: error completion", qp.name);
            Some(WcStatus::RemoteOperation)
        } else if g.peer_lost {
            Some(WcStatus::RetryExceeded)
        } else {
            None
        };
        if let Some(st) = failure {
            qp.fail_at(&mut g, Some((wr.wr_id, st)), Position::Next);
            return;
        }
        let psn = g.sq_psn;
        g.sq_psn = (psn + 1) & PSN_MASK;
        let rkey = if fault == Some(FaultKind::Rkey) {
            crate::qlog!(Warn, "{}: injected fault: write with a wrong rkey", qp.name);
            0
        } else {
            wr.remote.rkey
        };
        let req = Request {
            psn,
            addr: wr.remote.addr,
            rkey,
            len: wr.local.len,
            imm: wr.imm,
        };
        buf[..REQ_LEN].copy_from_slice(&req.encode());
        g.inflight.push_back(Inflight {
            wr_id: wr.wr_id,
            signaled: wr.signaled,
            psn,
            sent_at: Instant::now(),
        });
        drop(g);
        if fault == Some(FaultKind::Drop) {
            crate::qlog!(Warn, "{}: injected fault: connection cut", qp.name);
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        if let Err(e) = stream.write_all(&buf) {
            // The answer reader sees the connection end and fails what is in flight.
            crate::qlog!(Info, "{}: sending a write: {e}", qp.name);
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// The initiator's answer reader: completes writes as the responder answers them, in order;
/// fails the queue pair on a NAK, on a silent peer (ACK timeout) or a lost connection.
pub fn answer_loop(qp: &QpShared, mut stream: TcpStream, timeout: Duration) {
    let mut b = [0u8; RESP_LEN];
    loop {
        let got = wire::read_message(&mut stream, &mut b);
        let mut g = qp.lock();
        if g.closed || g.state == QpState::Error {
            return;
        }
        let answer = match got {
            Ok(Got::Done) => Response::decode(&b),
            Ok(Got::Idle) => {
                let late = g
                    .inflight
                    .front()
                    .is_some_and(|w| w.sent_at.max(g.last_answer) + timeout <= Instant::now());
                if late {
                    let w = g.inflight.pop_front().expect("checked");
                    crate::qlog!(
                        Warn,
                        "{}: no answer from peer qp {} within {timeout:?}",
                        qp.name,
                        g.peer
                            .map_or(String::new(), |p| format!("{:#x} at {}", p.qpn, p.addr))
                    );
                    qp.fail_at(
                        &mut g,
                        Some((w.wr_id, WcStatus::RetryExceeded)),
                        Position::Oldest,
                    );
                    return;
                }
                continue;
            }
            Ok(Got::Closed) | Err(_) => {
                // The peer's NIC (or the process) is gone.
                match g.inflight.pop_front() {
                    Some(w) => {
                        crate::qlog!(Info, "{}: connection to the peer lost", qp.name);
                        qp.fail_at(
                            &mut g,
                            Some((w.wr_id, WcStatus::RetryExceeded)),
                            Position::Oldest,
                        );
                    }
                    None => {
                        g.peer_lost = true;
                        qp.cond.notify_all();
                    }
                }
                return;
            }
        };
        g.last_answer = Instant::now();
        let (resp, psn) = match answer {
            Ok((Response::Waiting, _)) => continue,
            Ok(a) => a,
            Err(e) => {
                crate::qlog!(Warn, "{}: peer NIC sent {e}", qp.name);
                qp.fail(&mut g);
                return;
            }
        };
        let Some(w) = g.inflight.pop_front() else {
            crate::qlog!(
                Warn,
                "{}: peer NIC answered psn {psn} with nothing in flight",
                qp.name
            );
            qp.fail(&mut g);
            return;
        };
        let status = match resp {
            _ if w.psn != psn => {
                crate::qlog!(
                    Warn,
                    "{}: peer NIC answered psn {psn}, expected {}",
                    qp.name,
                    w.psn
                );
                WcStatus::RemoteOperation
            }
            Response::Ack | Response::Waiting => {
                if w.signaled {
                    qp.complete(&qp.send_cq, w.wr_id, WcStatus::Success, WcOpcode::Write);
                }
                continue;
            }
            Response::NakRnr => WcStatus::RnrRetryExceeded,
            Response::NakRemoteAccess => WcStatus::RemoteAccess,
            Response::NakDropped => WcStatus::RetryExceeded,
        };
        qp.fail_at(&mut g, Some((w.wr_id, status)), Position::Oldest);
        return;
    }
}
