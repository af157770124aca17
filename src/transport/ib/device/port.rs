//! Queries of an opened device's port: its attributes and its GID table.

use super::handles::CtxHandle;
use crate::error::{Error, Result};
use ibverbs_sys as ffi;

/// `ibv_query_port` of `num` on an opened device.
pub(super) fn query_port(name: &str, ctx: &CtxHandle, num: u8) -> Result<ffi::ibv_port_attr> {
    let mut attr = ffi::ibv_port_attr::default();
    // SAFETY: `ctx` is open; `attr` is a writable ibv_port_attr, at least as large as the
    // (compat) struct the exported ibv_query_port fills.
    let rc =
        unsafe { ffi::ibv_query_port(ctx.0, num, (&mut attr as *mut ffi::ibv_port_attr).cast()) };
    if rc != 0 {
        return Err(Error::io(
            format!("querying port {num} of RDMA device {name} (ibv_query_port)"),
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(attr)
}

/// `ibv_query_gid` of `index` on `port`.
pub(super) fn query_gid(name: &str, ctx: &CtxHandle, port: u8, index: u8) -> Result<[u8; 16]> {
    let mut gid = ffi::ibv_gid { raw: [0; 16] };
    // SAFETY: `ctx` is open; `gid` is a writable ibv_gid.
    let rc = unsafe { ffi::ibv_query_gid(ctx.0, port, i32::from(index), &mut gid) };
    if rc != 0 {
        return Err(Error::invalid(format!(
            "{name} has no GID at index {index} (ibv_query_gid: {}); check QCCL_IB_GID_INDEX",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: every bit pattern of the union is a valid [u8; 16].
    let raw = unsafe { gid.raw };
    // An unpopulated entry of a RoCE GID table reads as zeros rather than failing.
    if raw == [0; 16] {
        return Err(Error::invalid(format!(
            "{name} has no GID at index {index} (the entry is empty); check QCCL_IB_GID_INDEX"
        )));
    }
    Ok(raw)
}
