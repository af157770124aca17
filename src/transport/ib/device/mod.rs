//! The real verbs device: the verbs contract (`super::verbs`) over libibverbs, through the
//! `ibverbs` crate's raw bindings (`ibverbs::ffi`). Built with cargo feature `rdma`.
//!
//! Why the raw bindings and not the crate's safe API: its `Context` always queries port 1 and
//! refuses inactive ports, hides the `ibv_context` pointer, its protection domain, completion
//! queues and queue pairs borrow the context by lifetime (they cannot live in the `Arc`s the
//! contract hands out), it connects a queue pair in one step with its own attributes, and it
//! posts only IBV_WR_SEND (no RDMA write, no immediate). What it would cover (listing device
//! names) needs the raw device pointers for `ibv_open_device` anyway. So every verbs call
//! here goes through `ibverbs::ffi`, each wrapped once (`handles`) with its `// SAFETY:`.
//!
//! Layout: `handles` owns the raw objects and fixes their drop order; `attrs` translates
//! between the contract's values and verbs' numbers (tested without a device); `context`,
//! `memory`, `cq` and `qp` implement the contract's traits.

mod attrs;
mod context;
mod cq;
mod handles;
mod memory;
mod port;
mod qp;

use super::verbs::{Context, DeviceInfo, Fabric, PortInfo};
use crate::error::{Error, Result};
use context::{open_port, VerbsContext};
use handles::CtxHandle;
use ibverbs_sys as ffi;
use std::ffi::CStr;
use std::sync::Arc;

/// What `open` says when the host has no RDMA device at all.
pub(crate) const NO_DEVICE_HINT: &str = "no RDMA device found (ibv_get_device_list lists none): \
     this host has no InfiniBand/RoCE device or no kernel RDMA support. Load one (soft-RoCE: \
     `rdma link add rxe0 type rxe netdev eth0`), name a present one with QCCL_IB_HCA, or run \
     over the emulated fabric with QCCL_IB_EMULATE=1";

/// The devices libibverbs finds on this host.
pub struct VerbsFabric {
    _private: (),
}

impl VerbsFabric {
    /// The fabric of this host's verbs devices. Opens nothing: a host with no device gets a
    /// fabric whose `devices()` is empty.
    pub fn new() -> Result<VerbsFabric> {
        Ok(VerbsFabric { _private: () })
    }
}

/// `ibv_get_device_list`'s array, freed on drop.
struct DeviceList {
    list: *mut *mut ffi::ibv_device,
    len: usize,
}

impl DeviceList {
    /// The devices present. A host without kernel RDMA support (ENOSYS) has none; any other
    /// failure is an error.
    fn get() -> Result<DeviceList> {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is freed in Drop.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOSYS) {
                return Ok(DeviceList {
                    list: std::ptr::null_mut(),
                    len: 0,
                });
            }
            return Err(Error::io("listing RDMA devices (ibv_get_device_list)", err));
        }
        Ok(DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    /// (name, device pointer) of each device; the pointers live as long as the list.
    fn entries(&self) -> Vec<(String, *mut ffi::ibv_device)> {
        (0..self.len)
            .map(|i| {
                // SAFETY: `list` holds `len` valid device pointers (ibv_get_device_list).
                let dev = unsafe { *self.list.add(i) };
                // SAFETY: `dev` is a listed device; its name is a NUL-terminated string
                // owned by the list (copied out here).
                let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
                (name.to_string_lossy().into_owned(), dev)
            })
            .collect()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: returned by ibv_get_device_list and freed once; contexts opened from
            // its devices stay valid after the list is freed (verbs.h).
            unsafe { ffi::ibv_free_device_list(self.list) };
        }
    }
}

/// Opens `dev` (`ibv_open_device`).
fn open_device(name: &str, dev: *mut ffi::ibv_device) -> Result<Arc<CtxHandle>> {
    // SAFETY: `dev` comes from a live device list.
    let ctx = unsafe { ffi::ibv_open_device(dev) };
    if ctx.is_null() {
        return Err(Error::io(
            format!("opening RDMA device {name} (ibv_open_device)"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(Arc::new(CtxHandle(ctx)))
}

/// Number of physical ports of an opened device (`ibv_query_device`).
fn port_count(name: &str, ctx: &CtxHandle) -> Result<u8> {
    let mut attr = ffi::ibv_device_attr::default();
    // SAFETY: `ctx` is open; `attr` is a valid, writable ibv_device_attr.
    let rc = unsafe { ffi::ibv_query_device(ctx.0, &mut attr) };
    if rc != 0 {
        return Err(Error::io(
            format!("querying RDMA device {name} (ibv_query_device)"),
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(attr.phys_port_cnt)
}

impl Fabric for VerbsFabric {
    fn kind(&self) -> &'static str {
        "verbs"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let list = DeviceList::get()?;
        let mut out = Vec::new();
        for (name, dev) in list.entries() {
            let ctx = open_device(&name, dev)?;
            let mut ports = Vec::new();
            for num in 1..=port_count(&name, &ctx)? {
                let attr = port::query_port(&name, &ctx, num)?;
                ports.push(PortInfo {
                    num,
                    active: attr.state == ffi::ibv_port_state::IBV_PORT_ACTIVE,
                    link_layer: attrs::link_layer(attr.link_layer),
                });
            }
            out.push(DeviceInfo { name, ports });
        }
        Ok(out)
    }

    fn open(&self, name: &str, port: u8) -> Result<Arc<dyn Context>> {
        let list = DeviceList::get()?;
        let entries = list.entries();
        if entries.is_empty() {
            return Err(Error::System(format!(
                "cannot open RDMA device {name}:{port}: {NO_DEVICE_HINT}"
            )));
        }
        let Some(&(_, dev)) = entries.iter().find(|(n, _)| n == name) else {
            let present: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
            return Err(Error::invalid(format!(
                "no RDMA device named {name} (present: {}); check QCCL_IB_HCA",
                present.join(", ")
            )));
        };
        let ctx = open_device(name, dev)?;
        let count = port_count(name, &ctx)?;
        if port == 0 || port > count {
            return Err(Error::invalid(format!(
                "RDMA device {name} has ports 1..={count}, not {port}; check QCCL_IB_HCA"
            )));
        }
        let ctx: Arc<VerbsContext> = open_port(name, ctx, port)?;
        Ok(ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine (CI) has no RDMA device: the fabric is made, lists nothing, and `open`
    /// fails with the clear error. On a host with a device the first two still hold and
    /// `open` of a made-up name lists the present ones.
    #[test]
    fn without_a_device_the_fabric_lists_none_and_open_says_why() {
        let fabric = VerbsFabric::new().expect("VerbsFabric::new opens nothing");
        assert_eq!(fabric.kind(), "verbs");
        let devices = fabric.devices().expect("devices() lists, empty or not");
        let err = match fabric.open("qccl-no-such-hca", 1) {
            Ok(_) => panic!("opened a device that does not exist"),
            Err(e) => e.to_string(),
        };
        if devices.is_empty() {
            assert!(err.contains("no RDMA device"), "{err}");
            assert!(err.contains("QCCL_IB_HCA"), "{err}");
            assert!(err.contains("QCCL_IB_EMULATE=1"), "{err}");
            assert!(err.contains("qccl-no-such-hca:1"), "{err}");
        } else {
            assert!(
                err.contains("no RDMA device named qccl-no-such-hca"),
                "{err}"
            );
            assert!(err.contains(&devices[0].name), "{err}");
        }
    }
}
