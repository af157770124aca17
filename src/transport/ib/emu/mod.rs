//! The emulated RDMA fabric: the verbs contract (`verbs.rs`) carried out over TCP between
//! real processes, with the semantics and the failures of an RC queue pair, so that the RDMA
//! link runs (and fails) in CI with no NIC. Selected with `QCCL_IB_EMULATE=1`.
//!
//! # Model
//! - [`EmuFabric`] has one device, `emu0`, with one active Ethernet (RoCE-like) port, 1.
//!   Opening it makes a context that owns an emulated NIC: a TCP listener on the fabric's
//!   bind address (ephemeral port) and the threads that carry out remote writes into this
//!   process's registered memory.
//! - Endpoints: the GID (index 0, the only one) is the listener's IP, IPv4-mapped
//!   (`::ffff:a.b.c.d`, as RoCE v2 GIDs are) or IPv6 as is; the LID is the listener's TCP port
//!   (a real RoCE port has LID 0: here it is what makes the address complete). The bind
//!   address must be one the peers can reach: it is what the GID tells them.
//! - A queue pair moving to RTS opens one TCP connection to its peer's NIC; every request of
//!   the queue pair travels on it, in order, and the peer's NIC answers each (ACK or NAK) on
//!   the same connection. The connection opens with a hello carrying the job's secret
//!   (compared in constant time; a wrong one is logged and dropped with nothing else read)
//!   and the target QPN (unknown: refused, and `to_rts` fails naming it).
//! - Initiator: a write's bytes are copied out of the local region when it is sent and
//!   travel with its request; a signaled write completes with success once its ACK is back,
//!   so the bytes are in the remote region first. Local checks happen at post time (unknown
//!   lkey: `LocalProtection`; sge outside its region: `LocalLength`), reported in order as a
//!   NIC would; more than `max_send_wr` writes outstanding (or `max_recv_wr` receives) is an
//!   immediate error, as `ENOMEM` from `ibv_post_send`.
//! - Responder: the queue pair must be RTR or later (a write arriving earlier waits, bounded,
//!   as a NIC's retries would) and connected to the sender, and the PSN must be the next one;
//!   else the request is dropped and the initiator fails with `RetryExceeded` (a NIC stays
//!   silent until its retries run out; the emulation says so at once). An unknown or
//!   deregistered rkey, or a range outside the region, is a `RemoteAccess` NAK, and both
//!   queue pairs go to the error state. A write with immediate takes one posted receive and
//!   completes it (`RecvWriteImm`, byte_len, imm, the receive's wr_id) after placing the
//!   bytes; with none posted the responder waits on the initiator's behalf, `rnr_retry` times
//!   10 ms (7: forever, telling the initiator it is alive meanwhile), then NAKs:
//!   `RnrRetryExceeded` at the initiator, whose queue pair goes to the error state (the
//!   responder's stays as it is, as on a NIC). A zero-length write checks no rkey.
//! - Error state: every queued write and posted receive completes with `WrFlush` (the failed
//!   one first with its own status); posts after that complete with `WrFlush` too. Error
//!   completions carry opcode `Unknown`.
//! - Lost peer: a connection that ends (EOF, reset: the peer's queue pair, context or
//!   process is gone) fails the oldest outstanding write with `RetryExceeded` and flushes the
//!   rest; with nothing outstanding, the next write fails so. A peer that stays connected but
//!   silent fails it after the ACK timeout: 4.096 us x 2^timeout x (retry_cnt + 1), within
//!   1 to 5 s.
//! - Completion queues are bounded; an overrun is reported by every later `poll` (see
//!   `cq.rs`).
//! - Drop: a region returns only once no NIC thread copies into or out of it; a queue pair
//!   closes its connection and the ones to it, joins its threads, and returns only once no
//!   write for it is being placed (none is after); a context stops its
//!   NIC (listener, connection threads, all joined within a bound) and moves its queue pairs
//!   still open to the error state.
//!
//! # Fault injection
//! `QCCL_IB_EMULATE_FAULT=<kind>@<n>` (read by [`EmuFabric::from_env`]; counts are per
//! process) or `EmuFabric::with_fault` (this crate's tests; counts per fabric):
//! - `cqe@n`: the n-th signaled write completes with `RemoteOperation` instead of being sent;
//! - `qp@n`: the queue pair goes to the error state before the n-th `post_write`;
//! - `rkey@n`: the n-th write is sent with an rkey no NIC issues, so the peer refuses it
//!   (`RemoteAccess`);
//! - `drop@n`: the n-th write's connection is cut instead, as a lost peer (`RetryExceeded`).
//!
//! Speed is not the point, but a write costs one copy out of the local region, one socket
//! write of header and payload, and one copy into the remote region: no per-byte work.

mod cq;
pub mod fault;
mod initiator;
mod nic;
mod qp;
mod region;
mod responder;
mod shared;
mod wire;

#[cfg(test)]
mod tests;

use fault::FaultPlan;

use crate::error::{Error, Result};
use crate::transport::ib::verbs::{
    CompletionQueue, Context, DeviceInfo, Fabric, LinkLayer, PortInfo, QpCaps, QueuePair, Region,
};
use cq::EmuCq;
use nic::Nic;
use qp::EmuQp;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The emulated device's name.
pub const DEVICE: &str = "emu0";

/// The emulated fabric of one job (see the module doc).
pub struct EmuFabric {
    secret: [u8; 16],
    bind: IpAddr,
    faults: Arc<FaultPlan>,
}

impl EmuFabric {
    /// A fabric whose NICs listen on `bind` and accept only connections that know `secret`
    /// (the job's); no fault injected.
    pub fn new(secret: [u8; 16], bind: IpAddr) -> EmuFabric {
        EmuFabric {
            secret,
            bind,
            faults: Arc::new(FaultPlan::new(None)),
        }
    }

    /// As [`EmuFabric::new`], with the fault named by `QCCL_IB_EMULATE_FAULT` if set (an
    /// error names a malformed value).
    pub fn from_env(secret: [u8; 16], bind: IpAddr) -> Result<EmuFabric> {
        Ok(EmuFabric {
            faults: fault::from_env()?,
            ..EmuFabric::new(secret, bind)
        })
    }

    /// The same fabric injecting `fault`, counted over this fabric's queue pairs (tests).
    #[cfg(test)]
    pub fn with_fault(self, fault: fault::Fault) -> EmuFabric {
        EmuFabric {
            faults: Arc::new(FaultPlan::new(Some(fault))),
            ..self
        }
    }
}

impl Fabric for EmuFabric {
    fn kind(&self) -> &'static str {
        "emulated"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![DeviceInfo {
            name: DEVICE.into(),
            ports: vec![PortInfo {
                num: 1,
                active: true,
                link_layer: LinkLayer::Ethernet,
            }],
        }])
    }

    fn open(&self, name: &str, port: u8) -> Result<Arc<dyn Context>> {
        if name != DEVICE || port != 1 {
            return Err(Error::invalid(format!(
                "emulated fabric: no device port {name}:{port} (it has {DEVICE}:1)"
            )));
        }
        let ctx_name = format!("{DEVICE}:{port}");
        let listener = TcpListener::bind(SocketAddr::new(self.bind, 0)).map_err(|e| {
            Error::io(
                format!("{ctx_name}: listening on {} for its NIC", self.bind),
                e,
            )
        })?;
        let nic = Nic::start(ctx_name, self.secret, listener, self.faults.clone())?;
        crate::qlog!(Info, "{}: emulated NIC listening on {}", nic.name, nic.addr);
        Ok(Arc::new(EmuContext { nic }))
    }
}

/// An opened emulated port (see the module doc); dropping it stops its NIC.
pub struct EmuContext {
    nic: Arc<Nic>,
}

impl Context for EmuContext {
    fn name(&self) -> String {
        self.nic.name.clone()
    }

    fn link_layer(&self) -> LinkLayer {
        LinkLayer::Ethernet
    }

    fn lid(&self) -> u16 {
        self.nic.addr.port()
    }

    fn gid(&self, index: u8) -> Result<[u8; 16]> {
        self.nic.gid(index)
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Region>> {
        Ok(Box::new(self.nic.regions.alloc(len)?))
    }

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Box<dyn Region>> {
        // SAFETY: the caller keeps the memory valid as `Context::register` requires.
        Ok(Box::new(unsafe {
            self.nic.regions.register(addr, len, None)
        }?))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
        if depth == 0 {
            return Err(Error::invalid(format!(
                "{}: a completion queue needs a depth of at least 1",
                self.nic.name
            )));
        }
        let cq = Arc::new(EmuCq::new(depth, self.nic.name.clone()));
        self.nic.add_cq(&cq);
        Ok(cq)
    }

    fn create_qp(
        &self,
        send_cq: &Arc<dyn CompletionQueue>,
        recv_cq: &Arc<dyn CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Box<dyn QueuePair>> {
        let find = |cq: &Arc<dyn CompletionQueue>, which: &str| {
            self.nic
                .find_cq(Arc::as_ptr(cq) as *const ())
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "{}: the {which} completion queue was not created by this context",
                        self.nic.name
                    ))
                })
        };
        let (send_cq, recv_cq) = (find(send_cq, "send")?, find(recv_cq, "receive")?);
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
            return Err(Error::invalid(format!(
                "{}: queue pair caps {caps:?}: both queues need room for one request",
                self.nic.name
            )));
        }
        let nic = self.nic.clone();
        let qp = self
            .nic
            .add_qp(|qpn| EmuQp::new(nic, qpn, send_cq, recv_cq, caps));
        Ok(Box::new(qp))
    }
}

impl Drop for EmuContext {
    fn drop(&mut self) {
        self.nic.shutdown();
    }
}

/// Joins `threads`, waiting at most `limit` in all; a thread still running then is left
/// detached and logged (a bug: every NIC thread exits once its socket is shut down).
fn join_bounded(threads: Vec<JoinHandle<()>>, limit: Duration, owner: &str) {
    let deadline = Instant::now() + limit;
    for t in threads {
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if t.is_finished() {
            let _ = t.join();
        } else {
            crate::qlog!(Warn, "{owner}: a NIC thread did not stop within {limit:?}");
        }
    }
}
