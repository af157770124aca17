//! The verbs contract: the few verbs calls the RDMA link makes, small enough that two
//! implementations keep it: the real one over the `ibverbs` crate (`device/`, feature `rdma`)
//! and an emulated fabric with the same semantics (`emu/`, `QCCL_IB_EMULATE=1`), which lets the
//! link's protocol (slots, credits, completions, errors, teardown) run in CI with real
//! processes and no NIC.
//!
//! The shape follows libibverbs, cut to what a reliable-connected (RC) link needs: open a
//! device port ([`Fabric::open`]), which also allocates its protection domain; register memory
//! ([`Context::alloc`], [`Context::register`]); create completion queues and RC queue pairs;
//! move a queue pair through INIT, RTR and RTS ([`QueuePair::to_init`], `to_rtr`, `to_rts`);
//! post receives, RDMA writes and RDMA writes with immediate; poll completions. Failures are
//! reported the way a NIC reports them: a completion with an error status (remote access
//! error, RNR retries exceeded, transport retries exceeded), after which the queue pair is in
//! the error state and every work request still queued on it completes with `WrFlush`.
//!
//! Rules both implementations keep (the link relies on them):
//! - Work requests on one queue pair execute in order; an RDMA write's bytes are in the
//!   remote region before the remote receive completion of any later write with immediate on
//!   that queue pair, and before the local send completion of the write itself.
//! - A write with immediate consumes one posted receive at the target; with none posted the
//!   target answers RNR and the initiator retries up to `rnr_retry` times (7 = forever), then
//!   completes the write with `RnrRetryExceeded`.
//! - A write outside the target region (address, length, or an rkey the target does not
//!   know or has deregistered) fails at the initiator with `RemoteAccess` and moves both
//!   queue pairs to the error state.
//! - Unsignaled writes produce no success completion, but an error completes them anyway.
//! - Dropping a queue pair, a region or a context never blocks for long and never writes
//!   into memory the caller still owns; dropping a region after its queue pairs is safe.

use crate::error::Result;
use std::sync::Arc;
use std::time::Duration;

/// A device (HCA) the fabric can open, as `ibv_get_device_list` and `ibv_query_port` see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// "mlx5_0", "rxe0"; "emu0" for the emulated fabric.
    pub name: String,
    /// Its ports (numbered from 1, as in verbs).
    pub ports: Vec<PortInfo>,
}

/// One port of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub num: u8,
    /// The port is ACTIVE (a link is up).
    pub active: bool,
    /// InfiniBand (LID-routed) or Ethernet (RoCE: GID-routed).
    pub link_layer: LinkLayer,
}

/// The port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: peers are reached by LID.
    InfiniBand,
    /// RoCE: peers are reached by GID (QCCL_IB_GID_INDEX).
    Ethernet,
}

/// What one side of an RC connection tells the other (over the bootstrap socket) so the
/// other can move its queue pair to RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Local identifier of the port (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's GID at the configured index (RoCE), as 16 bytes.
    pub gid: [u8; 16],
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number this side sends (24 bits).
    pub psn: u32,
}

impl Endpoint {
    /// Bytes of [`Endpoint::to_bytes`].
    pub const LEN: usize = 26;

    /// The wire form (little-endian), for the bootstrap exchange.
    pub fn to_bytes(self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..2].copy_from_slice(&self.lid.to_le_bytes());
        b[2..18].copy_from_slice(&self.gid);
        b[18..22].copy_from_slice(&self.qpn.to_le_bytes());
        b[22..26].copy_from_slice(&self.psn.to_le_bytes());
        b
    }

    /// Reads the wire form back.
    pub fn from_bytes(b: &[u8; Self::LEN]) -> Endpoint {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[2..18]);
        Endpoint {
            lid: u16::from_le_bytes([b[0], b[1]]),
            gid,
            qpn: u32::from_le_bytes(b[18..22].try_into().unwrap()),
            psn: u32::from_le_bytes(b[22..26].try_into().unwrap()),
        }
    }
}

/// Path and retry settings applied when a queue pair moves to RTR and RTS (NCCL's
/// NCCL_IB_* variables, here QCCL_IB_*).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathSettings {
    /// GID table index used on RoCE (QCCL_IB_GID_INDEX, default 0).
    pub gid_index: u8,
    /// Local ACK timeout exponent: 4.096 us * 2^timeout (QCCL_IB_TIMEOUT, default 20, as
    /// NCCL's since 2.14).
    pub timeout: u8,
    /// Transport retries before a write fails (QCCL_IB_RETRY_CNT, default 7).
    pub retry_cnt: u8,
    /// RNR retries before a write fails, 7 = forever (default 7).
    pub rnr_retry: u8,
    /// Service level (QCCL_IB_SL, default 0).
    pub sl: u8,
    /// Traffic class (QCCL_IB_TC, default 0).
    pub tc: u8,
}

impl Default for PathSettings {
    fn default() -> PathSettings {
        PathSettings {
            gid_index: 0,
            timeout: 20,
            retry_cnt: 7,
            rnr_retry: 7,
            sl: 0,
            tc: 0,
        }
    }
}

/// Sizes of a queue pair's work queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send work requests outstanding at most.
    pub max_send_wr: u32,
    /// Receive work requests outstanding at most.
    pub max_recv_wr: u32,
}

/// A queue pair's state, as `ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// Created, not yet initialised.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: every work request completes with `WrFlush`.
    Error,
}

/// A local buffer of registered memory, as `ibv_sge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (inside a region registered on the same context).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// Where a write lands in the peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAddr {
    /// Address in the peer's region.
    pub addr: u64,
    /// The peer region's remote key.
    pub rkey: u32,
}

/// A completion's status, as `ibv_wc_status` (the ones the link tells apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// IBV_WC_SUCCESS.
    Success,
    /// IBV_WC_LOC_LEN_ERR: a receive too small, or an sge past its region.
    LocalLength,
    /// IBV_WC_LOC_PROT_ERR: an lkey this context does not know.
    LocalProtection,
    /// IBV_WC_WR_FLUSH_ERR: flushed because the queue pair is in the error state.
    WrFlush,
    /// IBV_WC_REM_ACCESS_ERR: the peer refused the rkey, address or length.
    RemoteAccess,
    /// IBV_WC_REM_OP_ERR: the peer could not complete the operation.
    RemoteOperation,
    /// IBV_WC_RETRY_EXC_ERR: no answer from the peer within timeout x retry_cnt.
    RetryExceeded,
    /// IBV_WC_RNR_RETRY_EXC_ERR: the peer had no receive posted, rnr_retry times.
    RnrRetryExceeded,
    /// Any other status, by its verbs number.
    Other(u32),
}

impl WcStatus {
    /// `ibv_wc_status_str`'s words, for error messages.
    pub fn describe(&self) -> String {
        match self {
            WcStatus::Success => "success".into(),
            WcStatus::LocalLength => "local length error".into(),
            WcStatus::LocalProtection => "local protection error".into(),
            WcStatus::WrFlush => "work request flushed error".into(),
            WcStatus::RemoteAccess => "remote access error".into(),
            WcStatus::RemoteOperation => "remote operation error".into(),
            WcStatus::RetryExceeded => "transport retry counter exceeded".into(),
            WcStatus::RnrRetryExceeded => "RNR retry counter exceeded".into(),
            WcStatus::Other(n) => format!("completion status {n}"),
        }
    }
}

/// What a completion completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A local RDMA write (with or without immediate).
    Write,
    /// A receive consumed by the peer's write with immediate.
    RecvWriteImm,
    /// Unknown: error completions may not say.
    Unknown,
}

/// One work completion, as `ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id, as posted.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What completed (meaningful on success).
    pub opcode: WcOpcode,
    /// Bytes written into this side's memory by the peer (RecvWriteImm).
    pub byte_len: u32,
    /// The immediate value (RecvWriteImm).
    pub imm: u32,
    /// The queue pair this completion belongs to.
    pub qpn: u32,
}

/// A fabric: the devices on this host and a way to open them (real verbs or emulated).
pub trait Fabric: Send + Sync {
    /// "verbs" or "emulated", for logs and `# Using devices`.
    fn kind(&self) -> &'static str;

    /// The devices present; empty when there are none (not an error).
    fn devices(&self) -> Result<Vec<DeviceInfo>>;

    /// Opens `port` of device `name` and allocates its protection domain.
    fn open(&self, name: &str, port: u8) -> Result<Arc<dyn Context>>;
}

/// An opened device port with its protection domain (`ibv_context` + `ibv_pd`).
pub trait Context: Send + Sync {
    /// "mlx5_0:1", "emu0:1".
    fn name(&self) -> String;

    /// The port's link layer.
    fn link_layer(&self) -> LinkLayer;

    /// The port's LID (0 on RoCE).
    fn lid(&self) -> u16;

    /// The GID at `index`; an error naming the index where the table has none.
    fn gid(&self, index: u8) -> Result<[u8; 16]>;

    /// Allocates `len` bytes of zeroed, page-aligned memory and registers it for local
    /// access and remote writes (the link's slots).
    fn alloc(&self, len: usize) -> Result<Box<dyn Region>>;

    /// Registers memory the caller owns as a source of writes: local reads only, no peer may
    /// write it (the registration cache's entries: user buffers sent without a copy).
    ///
    /// # Safety
    /// The bytes a posted work request names must stay allocated until it completes, or the
    /// region is dropped, or its queue pair's `to_error` or drop returned: after any of those
    /// the device reads none of them.
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Box<dyn Region>>;

    /// A completion queue with room for `depth` completions.
    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>>;

    /// An RC queue pair in the Reset state whose completions go to `send_cq` and `recv_cq`.
    fn create_qp(
        &self,
        send_cq: &Arc<dyn CompletionQueue>,
        recv_cq: &Arc<dyn CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Box<dyn QueuePair>>;
}

/// Registered memory (`ibv_mr`). Remote writes may change its bytes at any time a queue pair
/// allows them: read it through raw pointers, never through a long-lived `&[u8]`.
pub trait Region: Send + Sync {
    /// First byte.
    fn ptr(&self) -> *mut u8;

    /// Bytes.
    fn len(&self) -> usize;

    /// True when `len()` is 0.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Local key, for [`Sge::lkey`].
    fn lkey(&self) -> u32;

    /// Remote key, for a peer's [`RemoteAddr::rkey`].
    fn rkey(&self) -> u32;

    /// The address a peer writes to (the region's first byte as the NIC sees it).
    fn addr(&self) -> u64 {
        self.ptr() as u64
    }
}

/// A completion queue (`ibv_cq`), shared by the queue pairs that report to it.
pub trait CompletionQueue: Send + Sync {
    /// Moves up to `max` completions into `out`; how many (0: none now).
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize>;

    /// Blocks until a completion may be ready, at most `d` (may return early).
    fn wait(&self, d: Duration);
}

/// A reliable-connected queue pair (`ibv_qp`, IBV_QPT_RC).
pub trait QueuePair: Send {
    /// Its number.
    fn qpn(&self) -> u32;

    /// Its current state.
    fn state(&self) -> QpState;

    /// What the peer needs to connect to it, with `psn` as the first sequence number and
    /// the GID at `gid_index` (RoCE).
    fn endpoint(&self, psn: u32, gid_index: u8) -> Result<Endpoint>;

    /// Reset -> Init, allowing remote writes.
    fn to_init(&mut self) -> Result<()>;

    /// Init -> RTR, connected to `remote`.
    fn to_rtr(&mut self, remote: &Endpoint, path: &PathSettings) -> Result<()>;

    /// RTR -> RTS, sending from `psn`.
    fn to_rts(&mut self, psn: u32, path: &PathSettings) -> Result<()>;

    /// Any state -> Error: queued work is flushed (`WcStatus::WrFlush`), the peer's next
    /// write fails. Used on abort and by fault injection.
    fn to_error(&mut self) -> Result<()>;

    /// Posts a receive for a peer's write with immediate (no scatter list: the data goes
    /// where the write says). Allowed from Init on.
    fn post_recv(&mut self, wr_id: u64) -> Result<()>;

    /// Posts an RDMA write of `local` to `remote`, with `imm` delivered to the peer's next
    /// receive when given. `signaled`: a success completion is reported on the send queue.
    fn post_write(
        &mut self,
        wr_id: u64,
        local: Sge,
        remote: RemoteAddr,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()>;
}
