//! RDMA links (InfiniBand, RoCE): the verbs contract (`verbs.rs`) and its two
//! implementations, the real device (`device/`, feature `rdma`) and an emulated fabric
//! (`emu/`, `QCCL_IB_EMULATE=1`); the link over it (`link.rs`, with its slot protocol in
//! `slots.rs` and connection setup in `setup.rs`) and its settings (`config.rs`).

pub mod config;
// The real device: libibverbs through the `ibverbs` crate's raw bindings (ibverbs-sys).
#[cfg(feature = "rdma")]
pub mod device;
pub mod emu;
pub mod link;
pub mod setup;
pub mod slots;
// Parts of the contract only the real device reads (feature `rdma`: link layer, LID, GID), and
// `Context::register`, kept for a registration cache (not written yet).
#[allow(dead_code)]
pub mod verbs;
pub mod zcopy;

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
    /// naming why where QCCL_NET=IB asks for it. The emulated fabric's own settings
    /// (QCCL_IB_EMULATE_FAULT) are checked whenever it is asked for.
    pub fn probe(cfg: &IbConfig, secret: [u8; 16], ip: IpAddr) -> Result<Option<Arc<Device>>> {
        if !cfg.allowed() {
            return Ok(None);
        }
        let required = cfg.net == NetChoice::Ib;
        let fabric = match setup::fabric(cfg.emulate, secret, ip) {
            Err(e) if cfg.emulate => return Err(e),
            f => f,
        };
        let found = fabric.and_then(|fabric| {
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

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[test]
    fn rdma_off_or_unavailable_is_none_unless_qccl_net_asks_for_it() {
        let off = IbConfig {
            disable: true,
            emulate: true,
            ..Default::default()
        };
        assert!(Device::probe(&off, [0; 16], LOCAL).unwrap().is_none());
        let socket = IbConfig {
            net: NetChoice::Socket,
            emulate: true,
            ..Default::default()
        };
        assert!(Device::probe(&socket, [0; 16], LOCAL).unwrap().is_none());
        // The emulated fabric's one port, unless QCCL_IB_HCA leaves it out.
        let emu = IbConfig {
            emulate: true,
            ..Default::default()
        };
        let dev = Device::probe(&emu, [0; 16], LOCAL).unwrap().unwrap();
        assert_eq!((dev.name.as_str(), dev.port), ("emu0", 1));
        let excluded = IbConfig {
            hca: Some(config::HcaFilter::parse("^emu").unwrap()),
            ..emu.clone()
        };
        assert!(Device::probe(&excluded, [0; 16], LOCAL).unwrap().is_none());
        let required = IbConfig {
            net: NetChoice::Ib,
            ..excluded
        };
        let e = Device::probe(&required, [0; 16], LOCAL)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("QCCL_NET=IB: no usable RDMA port (emu0:1 excluded by QCCL_IB_HCA)"),
            "{e}"
        );
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn devices_need_feature_rdma() {
        let ib = IbConfig {
            net: NetChoice::Ib,
            ..Default::default()
        };
        let e = Device::probe(&ib, [0; 16], LOCAL).err().unwrap();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        assert!(
            e.to_string()
                .contains("qccl was built without feature `rdma`"),
            "{e}"
        );
        // Not asked for: no RDMA, no error.
        let auto = IbConfig::default();
        assert!(Device::probe(&auto, [0; 16], LOCAL).unwrap().is_none());
    }
}
