//! What the ranks of a comm using CUDA IPC say to each other before each dense all-reduce,
//! reduce-scatter and all-gather (`comm/cuda_ipc.rs` has the why): a 128-byte descriptor
//! per rank per call (the bytes it stages, its buffers' device and the rank's shared copy),
//! and one byte saying whether each rank could set the path up.

use super::Engine;
use crate::error::{Error, Result};
use crate::gpu::driver::IpcHandle;
use crate::gpu::ipc::Shared;
use crate::types::DType;

/// Bytes of a descriptor on the wire.
const DESCRIPTOR: usize = 128;
/// Bytes of the bus id a descriptor carries (PCI bus ids are 12; longer ones are cut).
const BUS_ID: usize = 32;

/// What a rank says before a dense all-reduce on a comm using CUDA IPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Descriptor {
    /// The call's bytes (every rank must agree).
    pub(crate) bytes: u64,
    /// Its buffers' device (bus id) and its staged scratch; None for host buffers.
    pub(crate) device: Option<(String, Shared)>,
}

impl Descriptor {
    /// A rank whose buffers are host memory (or staged) this call.
    pub(crate) fn host(bytes: usize) -> Descriptor {
        Descriptor {
            bytes: bytes as u64,
            device: None,
        }
    }

    fn encode(&self) -> [u8; DESCRIPTOR] {
        let mut b = [0u8; DESCRIPTOR];
        b[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        if let Some((bus, s)) = &self.device {
            b[0] = 1;
            b[4..8].copy_from_slice(&s.pid.to_le_bytes());
            b[16..24].copy_from_slice(&(s.len as u64).to_le_bytes());
            b[24..32].copy_from_slice(&s.addr.to_le_bytes());
            let bus = &bus.as_bytes()[..bus.len().min(BUS_ID)];
            b[32..32 + bus.len()].copy_from_slice(bus);
            b[64..128].copy_from_slice(&s.handle.0);
        }
        b
    }

    fn decode(b: &[u8]) -> Descriptor {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let device = (b[0] == 1).then(|| {
            let bus = &b[32..32 + BUS_ID];
            let end = bus.iter().position(|&c| c == 0).unwrap_or(BUS_ID);
            let mut handle = [0u8; 64];
            handle.copy_from_slice(&b[64..128]);
            (
                String::from_utf8_lossy(&bus[..end]).into_owned(),
                Shared {
                    handle: IpcHandle(handle),
                    len: u64_at(16) as usize,
                    pid: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
                    addr: u64_at(24),
                },
            )
        });
        Descriptor {
            bytes: u64_at(8),
            device,
        }
    }
}

/// Every rank's descriptor, in rank order (an all-gather in the call's turn); an error on
/// every rank alike when the ranks disagree on the call's size.
pub(crate) fn exchange(e: &mut Engine, mine: &Descriptor) -> Result<Vec<Descriptor>> {
    let n = e.size;
    let mut all = vec![0u8; DESCRIPTOR * n];
    e.all_gather(Some(&mine.encode()), &mut all, DESCRIPTOR, DType::Uint8)?;
    let table: Vec<Descriptor> = all.chunks(DESCRIPTOR).map(Descriptor::decode).collect();
    if let Some((q, d)) = table
        .iter()
        .enumerate()
        .find(|(_, d)| d.bytes != table[0].bytes)
    {
        return Err(Error::InvalidUsage(format!(
            "all_reduce: the ranks disagree on its size: rank 0 reduces {} bytes, rank {q} {}",
            table[0].bytes, d.bytes
        )));
    }
    Ok(table)
}

/// The ranks' scratch buffers when every rank's buffers are on one device.
pub(crate) fn on_one_device(table: &[Descriptor]) -> Option<Vec<Shared>> {
    let first = &table[0].device.as_ref()?.0;
    table
        .iter()
        .map(|d| match &d.device {
            Some((bus, s)) if bus == first => Some(*s),
            _ => None,
        })
        .collect()
}

/// True on every rank when every rank says `ok` (an all-gather of one byte: also a barrier).
pub(crate) fn all_ok(e: &mut Engine, ok: bool) -> Result<bool> {
    let mut all = vec![0u8; e.size];
    e.all_gather(Some(&[u8::from(ok)]), &mut all, 1, DType::Uint8)?;
    Ok(all.iter().all(|&b| b == 1))
}
