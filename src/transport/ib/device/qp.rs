//! An RC queue pair: the contract's `QueuePair`.

use super::attrs::{self, PortParams};
use super::handles::{CtxHandle, QpHandle};
use super::port::{query_gid, query_port};
use crate::error::{Error, Result};
use crate::transport::ib::verbs::{
    Endpoint, LinkLayer, PathSettings, QpState, QueuePair, RemoteAddr, Sge,
};
use ffi::ibv_qp_attr_mask as Mask;
use ibverbs_sys as ffi;
use std::sync::Arc;

pub(super) struct VerbsQp {
    name: String,
    handle: QpHandle,
    ctx: Arc<CtxHandle>,
    port: PortParams,
}

impl VerbsQp {
    pub(super) fn new(
        name: String,
        handle: QpHandle,
        ctx: Arc<CtxHandle>,
        port: PortParams,
    ) -> VerbsQp {
        VerbsQp {
            name,
            handle,
            ctx,
            port,
        }
    }

    fn modify(&mut self, what: &str, mut attr: ffi::ibv_qp_attr, mask: Mask) -> Result<()> {
        // SAFETY: the queue pair is live; `attr` is a valid ibv_qp_attr whose fields named
        // by `mask` are set.
        let rc = unsafe { ffi::ibv_modify_qp(self.handle.qp, &mut attr, mask.0 as i32) };
        if rc != 0 {
            return Err(Error::io(
                format!(
                    "moving queue pair {} on {} to {what} (ibv_modify_qp; state was {:?})",
                    self.handle.qpn(),
                    self.name,
                    self.state()
                ),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    fn post_send(&mut self, wr: &mut ffi::ibv_send_wr) -> Result<()> {
        let qp = self.handle.qp;
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `qp` is live; ibv_post_send is a static inline in verbs.h calling the
        // provider's post_send op; `wr` (and the sge it points to) outlive the call, which
        // copies them into the send queue.
        let rc = unsafe {
            let ctx = (*qp).context;
            match (*ctx).ops.post_send {
                Some(post) => post(qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(Error::io(
                format!(
                    "posting an RDMA write on queue pair {} of {} (ibv_post_send; send queue \
                     full or queue pair not in RTS)",
                    self.handle.qpn(),
                    self.name
                ),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }
}

impl QueuePair for VerbsQp {
    fn qpn(&self) -> u32 {
        self.handle.qpn()
    }

    fn state(&self) -> QpState {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        // SAFETY: the queue pair is live; `attr` and `init` are writable.
        let rc = unsafe {
            ffi::ibv_query_qp(
                self.handle.qp,
                &mut attr,
                Mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        if rc != 0 {
            // A queue pair the device cannot even report on is not usable.
            return QpState::Error;
        }
        attrs::qp_state(attr.qp_state)
    }

    fn endpoint(&self, psn: u32, gid_index: u8) -> Result<Endpoint> {
        let gid = query_gid(&self.name, &self.ctx, self.port.num, gid_index)?;
        let lid = match self.port.link_layer {
            LinkLayer::InfiniBand => port_lid(&self.name, &self.ctx, self.port.num)?,
            LinkLayer::Ethernet => 0,
        };
        Ok(Endpoint {
            lid,
            gid,
            qpn: self.handle.qpn(),
            psn: psn & attrs::PSN_MASK,
        })
    }

    fn to_init(&mut self) -> Result<()> {
        let (attr, mask) = attrs::init_attr(&self.port);
        self.modify("INIT", attr, mask)
    }

    fn to_rtr(&mut self, remote: &Endpoint, path: &PathSettings) -> Result<()> {
        let (attr, mask) = attrs::rtr_attr(&self.port, remote, path)?;
        self.modify("RTR", attr, mask)
    }

    fn to_rts(&mut self, psn: u32, path: &PathSettings) -> Result<()> {
        let (attr, mask) = attrs::rts_attr(psn, path)?;
        self.modify("RTS", attr, mask)
    }

    fn to_error(&mut self) -> Result<()> {
        let (attr, mask) = attrs::error_attr();
        self.modify("ERROR", attr, mask)
    }

    fn post_recv(&mut self, wr_id: u64) -> Result<()> {
        let qp = self.handle.qp;
        // No scatter list: a write with immediate only consumes the receive.
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: `qp` is live; ibv_post_recv is a static inline calling the provider's
        // post_recv op; `wr` outlives the call.
        let rc = unsafe {
            let ctx = (*qp).context;
            match (*ctx).ops.post_recv {
                Some(post) => post(qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(Error::io(
                format!(
                    "posting a receive on queue pair {} of {} (ibv_post_recv; receive queue \
                     full or queue pair in RESET)",
                    self.handle.qpn(),
                    self.name
                ),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    fn post_write(
        &mut self,
        wr_id: u64,
        local: Sge,
        remote: RemoteAddr,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: local.addr,
            length: local.len,
            lkey: local.lkey,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: std::ptr::null_mut(),
            // A zero-length write (an immediate alone) carries no scatter entry.
            sg_list: if local.len == 0 {
                std::ptr::null_mut()
            } else {
                &mut sge
            },
            num_sge: i32::from(local.len != 0),
            opcode: match imm {
                Some(_) => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                None => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            },
            send_flags: if signaled {
                ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            },
            ..Default::default()
        };
        if let Some(imm) = imm {
            wr.__bindgen_anon_1.imm_data = attrs::imm_to_wire(imm);
        }
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        };
        self.post_send(&mut wr)
    }
}

/// The port's current LID (it changes when the subnet manager reassigns it).
fn port_lid(name: &str, ctx: &CtxHandle, port: u8) -> Result<u16> {
    Ok(query_port(name, ctx, port)?.lid)
}
