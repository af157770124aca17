//! The state an emulated queue pair shares between its handle (`qp.rs`), its sender and
//! answer threads (`initiator.rs`) and the NIC's responder threads (`responder.rs`): posted
//! work, the connection's progress, and how completions and the error state's flushes are
//! reported.

use super::cq::EmuCq;
use crate::transport::ib::verbs::{
    Completion, QpCaps, QpState, RemoteAddr, Sge, WcOpcode, WcStatus,
};
use std::collections::VecDeque;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::Instant;

/// PSNs are 24 bits.
pub const PSN_MASK: u32 = 0xff_ffff;

/// What the responder side knows of its connected peer (set at RTR).
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// The peer NIC's listener.
    pub addr: SocketAddr,
    /// The peer's queue pair: the only one allowed to write to this one.
    pub qpn: u32,
    /// The PSN the peer's next request must carry.
    pub next_psn: u32,
}

/// A posted write not yet sent.
#[derive(Clone, Copy)]
pub struct SendWr {
    pub wr_id: u64,
    pub local: Sge,
    pub remote: RemoteAddr,
    pub imm: Option<u32>,
    pub signaled: bool,
    /// Found at post time (bad lkey or sge): completes with this when its turn comes.
    pub local_error: Option<WcStatus>,
}

/// A sent write waiting for its answer.
pub struct Inflight {
    pub wr_id: u64,
    pub signaled: bool,
    pub psn: u32,
    pub sent_at: Instant,
}

/// A queue pair's mutable state.
pub struct Inner {
    /// The verbs state.
    pub state: QpState,
    /// Posted receives' wr_ids, in order.
    pub recvs: VecDeque<u64>,
    pub pending: VecDeque<SendWr>,
    pub inflight: VecDeque<Inflight>,
    /// Set at RTR.
    pub peer: Option<Peer>,
    pub sq_psn: u32,
    /// The handle was dropped: the threads exit, inbound requests are dropped.
    pub closed: bool,
    /// The outbound connection, shut down on error or drop (wakes the threads).
    pub conn: Option<TcpStream>,
    /// The connection ended with nothing in flight: the next write fails.
    pub peer_lost: bool,
    pub last_answer: Instant,
}

/// Where a failing work request sits among the others, for completion order.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// The oldest in flight (its answer came back).
    Oldest,
    /// Newer than everything in flight, older than everything pending (just taken off the
    /// pending queue).
    Next,
}

/// A queue pair's state shared by its handle, its threads and the NIC's responder threads.
pub struct QpShared {
    /// Queue pair number.
    pub qpn: u32,
    /// "emu0:1 qp 0x123", for messages.
    pub name: String,
    /// Where sends complete.
    pub send_cq: Arc<EmuCq>,
    /// Where receives complete.
    pub recv_cq: Arc<EmuCq>,
    /// Work queue sizes.
    pub caps: QpCaps,
    inner: Mutex<Inner>,
    /// Signalled on every change of `inner` a thread may wait for.
    pub cond: Condvar,
    /// Held (read) by a responder while it places bytes for this queue pair; dropping the
    /// queue pair takes it (write) after closing it, so no write lands after the drop.
    pub placing: RwLock<()>,
    /// Held (read) by the initiator's sender while it copies a write's bytes out of local
    /// memory; `to_error` and the drop take it (write) after stopping the queue pair, so no
    /// local memory is read once they return (a failed exchange hands its buffers back).
    pub reading: RwLock<()>,
}

impl QpShared {
    /// A queue pair's state in the Reset state, nothing posted.
    pub fn new(
        qpn: u32,
        name: String,
        send_cq: Arc<EmuCq>,
        recv_cq: Arc<EmuCq>,
        caps: QpCaps,
    ) -> QpShared {
        QpShared {
            qpn,
            name,
            send_cq,
            recv_cq,
            caps,
            inner: Mutex::new(Inner {
                state: QpState::Reset,
                recvs: VecDeque::new(),
                pending: VecDeque::new(),
                inflight: VecDeque::new(),
                peer: None,
                sq_psn: 0,
                closed: false,
                conn: None,
                peer_lost: false,
                last_answer: Instant::now(),
            }),
            cond: Condvar::new(),
            placing: RwLock::new(()),
            reading: RwLock::new(()),
        }
    }

    /// The state, locked.
    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn complete(&self, cq: &EmuCq, wr_id: u64, status: WcStatus, opcode: WcOpcode) {
        cq.push(Completion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            imm: 0,
            qpn: self.qpn,
        });
    }

    /// Moves to the error state: `failed` (a work request taken off the queues, at `pos`)
    /// completes with its status, everything else queued or posted with `WrFlush`, in order;
    /// the connection is shut down. Completions are pushed under the lock, so each CQ sees
    /// this queue pair's completions in order.
    pub fn fail_at(&self, g: &mut Inner, failed: Option<(u64, WcStatus)>, pos: Position) {
        let flush =
            |wr_id| self.complete(&self.send_cq, wr_id, WcStatus::WrFlush, WcOpcode::Unknown);
        let already_failed = g.state == QpState::Error;
        let report = |(wr_id, status): (u64, WcStatus)| {
            // Already failed: the request was queued behind the failure, so it is flushed.
            let status = if already_failed {
                WcStatus::WrFlush
            } else {
                status
            };
            self.complete(&self.send_cq, wr_id, status, WcOpcode::Unknown)
        };
        if pos == Position::Oldest {
            if let Some(f) = failed {
                report(f);
            }
        }
        for w in g.inflight.drain(..) {
            flush(w.wr_id);
        }
        if pos == Position::Next {
            if let Some(f) = failed {
                report(f);
            }
        }
        for w in g.pending.drain(..) {
            flush(w.wr_id);
        }
        for wr_id in g.recvs.drain(..) {
            self.complete(&self.recv_cq, wr_id, WcStatus::WrFlush, WcOpcode::Unknown);
        }
        if g.state != QpState::Error {
            crate::qlog!(
                Info,
                "{}: to the error state{}",
                self.name,
                failed.map_or(String::new(), |(id, s)| format!(
                    " (wr_id {id}: {})",
                    s.describe()
                ))
            );
        }
        g.state = QpState::Error;
        if let Some(c) = g.conn.take() {
            let _ = c.shutdown(Shutdown::Both);
        }
        self.cond.notify_all();
    }

    /// Waits for a copy out of local memory in progress; none starts after the queue pair
    /// left RTS (the sender checks under `reading`).
    pub fn await_reads(&self) {
        drop(self.reading.write().unwrap_or_else(|p| p.into_inner()));
    }

    /// Moves to the error state, flushing everything (see `fail_at`).
    pub fn fail(&self, g: &mut Inner) {
        self.fail_at(g, None, Position::Oldest);
    }

    /// Completes a receive taken off the queue with `WrFlush`.
    pub fn flush_recv(&self, wr_id: u64) {
        self.complete(&self.recv_cq, wr_id, WcStatus::WrFlush, WcOpcode::Unknown);
    }

    /// Completes a posted receive consumed by a write with immediate.
    pub fn complete_recv(&self, wr_id: u64, byte_len: u32, imm: u32) {
        self.recv_cq.push(Completion {
            wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::RecvWriteImm,
            byte_len,
            imm,
            qpn: self.qpn,
        });
    }
}
