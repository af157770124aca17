//! RDMA links (InfiniBand, RoCE): the verbs contract (`verbs.rs`) and its two
//! implementations, the real device (`device/`, feature `rdma`) and an emulated fabric
//! (`emu/`, `QCCL_IB_EMULATE=1`); the link over it (`link.rs`, with its slot protocol in
//! `slots.rs` and connection setup in `setup.rs`) and its settings (`config.rs`).

pub mod config;
// `EmuFabric::with_fault` serves the emulator's own tests only.
#[allow(dead_code)]
pub mod emu;
pub mod link;
pub mod setup;
pub mod slots;
// Parts of the contract only the fabrics use.
#[allow(dead_code)]
pub mod verbs;

/// Whether a peer pair may talk over RDMA (`net::select`): both ranks have a usable device
/// (QCCL_NET, QCCL_IB_DISABLE, QCCL_IB_HCA and the devices found, exchanged at init).
pub fn can_connect(pair: &crate::transport::link::Pair) -> bool {
    pair.rdma
}

use crate::error::{Error, Result};
use config::{IbConfig, NetChoice};
use std::net::IpAddr;
use std::sync::Arc;
use verbs::{Fabric, PathSettings};

/// The RDMA port a rank found usable at init; each comm's links open it (`setup::IbNet`).
pub struct Device {
    fabric: Arc<dyn Fabric>,
    /// "mlx5_0", "emu0".
    pub name: String,
    /// Port number (1-based).
    pub port: u8,
    /// QCCL_IB_GID_INDEX, QCCL_IB_TIMEOUT, ...
    pub path: PathSettings,
}

impl Device {
    /// The first port QCCL_IB_HCA allows on the fabric QCCL_IB_EMULATE selects, the emulated
    /// one listening on `ip`; None where RDMA is off or no port is usable, and an error
    /// naming why where QCCL_NET=IB asks for it.
    pub fn probe(cfg: &IbConfig, secret: [u8; 16], ip: IpAddr) -> Result<Option<Arc<Device>>> {
        if !cfg.allowed() {
            return Ok(None);
        }
        let required = cfg.net == NetChoice::Ib;
        let found = setup::fabric(cfg.emulate, secret, ip).and_then(|fabric| {
            let devices = fabric.devices()?;
            config::pick_port(&devices, cfg.hca.as_ref())
                .map(|(name, port)| (fabric, name, port))
                .map_err(Error::Unsupported)
        });
        match found {
            Ok((fabric, name, port)) => {
                crate::qlog!(Info, "RDMA: using {name}:{port} ({} fabric)", fabric.kind());
                Ok(Some(Arc::new(Device {
                    fabric,
                    name,
                    port,
                    path: cfg.path,
                })))
            }
            Err(e) if required => Err(e.prefixed("QCCL_NET=IB: ")),
            Err(e) => {
                crate::qlog!(Info, "RDMA not used: {e}");
                Ok(None)
            }
        }
    }
}
