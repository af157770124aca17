//! Opening one RC connection over the pair's verified bootstrap socket, as shm's setup does:
//! each side creates its completion queue, queue pair and two registered regions (the receive
//! ring the peer writes into, and the staging ring it writes from), posts its receives, and
//! sends its endpoint, its ring's address and rkey and the ring's shape; then both move their
//! queue pairs INIT -> RTR -> RTS and confirm to each other before anything is written.

use super::slots::{RECVS, SLOTS, SLOT_BYTES};
use super::verbs::{
    CompletionQueue, Context, Endpoint, Fabric, PathSettings, QpCaps, QueuePair, Region, RemoteAddr,
};
use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::sync::Arc;

/// "QCIB": the setup message's first bytes.
const MAGIC: u32 = 0x5143_4942;
/// Bumped when the message or the slot protocol changes.
const VERSION: u32 = 1;
/// Bytes of the setup message.
const MSG_LEN: usize = 4 + 4 + Endpoint::LEN + 8 + 4 + 4 + 4;
/// Bytes after the ring in the receive region: the word credit writes land on.
pub const CREDIT_WORD: usize = 64;
/// Bytes of each region: the ring, then the credit word.
pub const REGION_BYTES: usize = SLOTS * SLOT_BYTES + CREDIT_WORD;
/// wr_ids below are receives; data and credit writes are tagged above.
pub const RECV_TAG: u64 = 1 << 60;

/// The fabric a comm's RDMA links use and the one port opened on it.
pub struct IbNet {
    /// "verbs" or "emulated".
    pub kind: &'static str,
    /// The opened port ("mlx5_0:1", "emu0:1") with its protection domain.
    pub ctx: Arc<dyn Context>,
    /// Path and retry settings (QCCL_IB_*).
    pub path: PathSettings,
    // The fabric outlives the contexts opened on it.
    _fabric: Arc<dyn Fabric>,
}

impl IbNet {
    /// Opens `dev`'s port with its protection domain.
    pub fn open(dev: &super::Device) -> Result<IbNet> {
        let ctx = dev.fabric.open(&dev.name, dev.port)?;
        Ok(IbNet {
            kind: dev.fabric.kind(),
            ctx,
            path: dev.path,
            _fabric: dev.fabric.clone(),
        })
    }
}

/// The fabric QCCL_IB_EMULATE and the build select: the emulated one listening on `ip`, or
/// the real devices (feature `rdma`).
pub fn fabric(emulate: bool, secret: [u8; 16], ip: IpAddr) -> Result<Arc<dyn Fabric>> {
    if emulate {
        return Ok(Arc::new(super::emu::EmuFabric::from_env(secret, ip)?));
    }
    real_fabric()
}

#[cfg(feature = "rdma")]
fn real_fabric() -> Result<Arc<dyn Fabric>> {
    Ok(Arc::new(super::device::VerbsFabric::new()?))
}

#[cfg(not(feature = "rdma"))]
fn real_fabric() -> Result<Arc<dyn Fabric>> {
    Err(Error::Unsupported(
        "RDMA devices: qccl was built without feature `rdma` (QCCL_IB_EMULATE=1 selects the \
         emulated fabric)"
            .into(),
    ))
}

/// One side of a connected pair: its queue pair and memory, and where the peer's ring is.
/// Fields drop in order: the queue pair before the memory it may access.
pub struct Conn {
    /// The RC queue pair, in RTS.
    pub qp: Box<dyn QueuePair>,
    /// The receive ring (the peer writes it), then the credit word.
    pub inbox: Box<dyn Region>,
    /// The staging ring this side writes from, then the credit word's source.
    pub outbox: Box<dyn Region>,
    /// Send and receive completions.
    pub cq: Arc<dyn CompletionQueue>,
    /// The peer's receive region.
    pub remote: RemoteAddr,
    /// "emu0:1", for messages.
    pub port: String,
    /// "verbs" or "emulated".
    pub kind: &'static str,
    /// Keeps the port open while the connection lives.
    pub _ctx: Arc<dyn Context>,
}

/// What one side sends the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Hello {
    ep: Endpoint,
    ring: RemoteAddr,
    slots: u32,
    slot_bytes: u32,
}

impl Hello {
    fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&VERSION.to_le_bytes());
        let mut at = 8;
        b[at..at + Endpoint::LEN].copy_from_slice(&self.ep.to_bytes());
        at += Endpoint::LEN;
        b[at..at + 8].copy_from_slice(&self.ring.addr.to_le_bytes());
        b[at + 8..at + 12].copy_from_slice(&self.ring.rkey.to_le_bytes());
        b[at + 12..at + 16].copy_from_slice(&self.slots.to_le_bytes());
        b[at + 16..at + 20].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b
    }

    fn decode(b: &[u8; MSG_LEN]) -> std::result::Result<Hello, String> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        if u32_at(0) != MAGIC {
            return Err("not an RDMA setup message".into());
        }
        if u32_at(4) != VERSION {
            return Err(format!(
                "RDMA setup version {} (this build speaks {VERSION})",
                u32_at(4)
            ));
        }
        let mut at = 8;
        let ep = Endpoint::from_bytes(b[at..at + Endpoint::LEN].try_into().unwrap());
        at += Endpoint::LEN;
        let h = Hello {
            ep,
            ring: RemoteAddr {
                addr: u64::from_le_bytes(b[at..at + 8].try_into().unwrap()),
                rkey: u32_at(at + 8),
            },
            slots: u32_at(at + 12),
            slot_bytes: u32_at(at + 16),
        };
        if (h.slots as usize, h.slot_bytes as usize) != (SLOTS, SLOT_BYTES) {
            return Err(format!(
                "the peer's ring has {} slots of {} bytes, this one {SLOTS} of {SLOT_BYTES}",
                h.slots, h.slot_bytes
            ));
        }
        Ok(h)
    }
}

/// Connects this side of the pair over `sock` (blocking, with a read timeout set by the
/// caller); both ranks call it at the same point.
pub fn connect(net: &IbNet, sock: &mut TcpStream) -> Result<Conn> {
    let ctx = net.ctx.clone();
    // Memory first: on an early return, locals drop in reverse, the queue pair first.
    let inbox = ctx.alloc(REGION_BYTES)?;
    let outbox = ctx.alloc(REGION_BYTES)?;
    let depth = (2 * SLOTS + 4 + RECVS) as u32;
    let cq = ctx.create_cq(depth)?;
    let caps = QpCaps {
        max_send_wr: (2 * SLOTS + 4) as u32,
        max_recv_wr: RECVS as u32,
    };
    let mut qp = ctx.create_qp(&cq, &cq, caps)?;
    qp.to_init()?;
    for i in 0..RECVS as u64 {
        qp.post_recv(RECV_TAG | i)?;
    }
    let psn = rand::random::<u32>() & 0xff_ffff;
    let mine = Hello {
        ep: qp.endpoint(psn, net.path.gid_index)?,
        ring: RemoteAddr {
            addr: inbox.addr(),
            rkey: inbox.rkey(),
        },
        slots: SLOTS as u32,
        slot_bytes: SLOT_BYTES as u32,
    };
    sock.write_all(&mine.encode())
        .map_err(|e| Error::io("RDMA setup: sending the endpoint", e))?;
    let mut b = [0u8; MSG_LEN];
    sock.read_exact(&mut b)
        .map_err(|e| Error::io("RDMA setup: reading the peer's endpoint", e))?;
    let theirs = Hello::decode(&b).map_err(Error::InvalidUsage)?;
    qp.to_rtr(&theirs.ep, &net.path)?;
    qp.to_rts(psn, &net.path)?;
    // Both in RTS, receives posted: from here either side may write.
    sock.write_all(&[1])
        .and_then(|()| sock.read_exact(&mut [0u8]))
        .map_err(|e| Error::io("RDMA setup: waiting for the peer's queue pair", e))?;
    Ok(Conn {
        qp,
        inbox,
        outbox,
        cq,
        remote: theirs.ring,
        port: ctx.name(),
        kind: net.kind,
        _ctx: ctx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            ep: Endpoint {
                lid: 7,
                gid: [3; 16],
                qpn: 0x12345,
                psn: 0xabcdef,
            },
            ring: RemoteAddr {
                addr: 0x7f00_dead_b000,
                rkey: 99,
            },
            slots: SLOTS as u32,
            slot_bytes: SLOT_BYTES as u32,
        }
    }

    #[test]
    fn setup_messages_round_trip_and_mismatches_are_named() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut b = h.encode();
        b[0] ^= 1;
        assert_eq!(Hello::decode(&b), Err("not an RDMA setup message".into()));
        let mut b = h.encode();
        b[4] = 9;
        assert!(Hello::decode(&b)
            .unwrap_err()
            .contains("RDMA setup version 9"));
        let other = Hello { slots: 4, ..h };
        assert!(Hello::decode(&other.encode())
            .unwrap_err()
            .contains("the peer's ring has 4 slots"));
    }
}
