//! An opened device port with its protection domain: the contract's `Context`.

use super::attrs::{self, PortParams};
use super::cq::VerbsCq;
use super::handles::{CtxHandle, PdHandle, QpHandle};
use super::memory::VerbsRegion;
use super::port::{query_gid, query_port};
use super::qp::VerbsQp;
use crate::error::{Error, Result};
use crate::transport::ib::verbs::{CompletionQueue, Context, LinkLayer, QpCaps, QueuePair, Region};
use ibverbs_sys as ffi;
use std::sync::{Arc, Mutex, Weak};

/// An opened port: `ibv_context` + `ibv_pd`, the port's attributes, and the completion
/// queues made here (so a queue pair can find the raw queue behind a `dyn CompletionQueue`).
pub(super) struct VerbsContext {
    name: String,
    ctx: Arc<CtxHandle>,
    pd: Arc<PdHandle>,
    port: PortParams,
    lid: u16,
    cqs: Mutex<Vec<Weak<VerbsCq>>>,
}

/// Opens `port` of the opened device `ctx`: the port must be ACTIVE; allocates the
/// protection domain.
pub(super) fn open_port(name: &str, ctx: Arc<CtxHandle>, port: u8) -> Result<Arc<VerbsContext>> {
    let attr = query_port(name, &ctx, port)?;
    if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
        return Err(Error::System(format!(
            "port {port} of RDMA device {name} is not ACTIVE (ibv_port_state {}): its link is \
             down; pick another with QCCL_IB_HCA",
            attr.state
        )));
    }
    // SAFETY: `ctx` is open; the PD is freed by PdHandle, which holds an Arc of `ctx`.
    let pd = unsafe { ffi::ibv_alloc_pd(ctx.0) };
    if pd.is_null() {
        return Err(Error::io(
            format!("allocating a protection domain on {name}:{port} (ibv_alloc_pd)"),
            std::io::Error::last_os_error(),
        ));
    }
    let pd = Arc::new(PdHandle::new(pd, ctx.clone()));
    Ok(Arc::new(VerbsContext {
        name: format!("{name}:{port}"),
        ctx,
        pd,
        port: PortParams {
            num: port,
            link_layer: attrs::link_layer(attr.link_layer),
            active_mtu: attr.active_mtu,
        },
        lid: attr.lid,
        cqs: Mutex::new(Vec::new()),
    }))
}

impl VerbsContext {
    /// The `VerbsCq` behind `cq`, if it was made by this context.
    fn own_cq(&self, cq: &Arc<dyn CompletionQueue>) -> Result<Arc<VerbsCq>> {
        let want = Arc::as_ptr(cq) as *const u8;
        let cqs = self.cqs.lock().unwrap_or_else(|p| p.into_inner());
        cqs.iter()
            .filter_map(Weak::upgrade)
            .find(|c| Arc::as_ptr(c) as *const u8 == want)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "a completion queue passed to create_qp on {} was not created by it",
                    self.name
                ))
            })
    }
}

impl Context for VerbsContext {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn link_layer(&self) -> LinkLayer {
        self.port.link_layer
    }

    fn lid(&self) -> u16 {
        match self.port.link_layer {
            LinkLayer::InfiniBand => self.lid,
            LinkLayer::Ethernet => 0,
        }
    }

    fn gid(&self, index: u8) -> Result<[u8; 16]> {
        query_gid(&self.name, &self.ctx, self.port.num, index)
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn Region>> {
        Ok(Box::new(VerbsRegion::alloc(&self.name, &self.pd, len)?))
    }

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Box<dyn Region>> {
        // SAFETY: the caller keeps addr..addr+len allocated while the region and its queue
        // pairs live (this function's contract).
        let region = unsafe { VerbsRegion::register(&self.name, &self.pd, addr, len)? };
        Ok(Box::new(region))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
        let cq = Arc::new(VerbsCq::new(&self.name, &self.ctx, depth)?);
        let mut cqs = self.cqs.lock().unwrap_or_else(|p| p.into_inner());
        cqs.retain(|w| w.strong_count() > 0);
        cqs.push(Arc::downgrade(&cq));
        Ok(cq)
    }

    fn create_qp(
        &self,
        send_cq: &Arc<dyn CompletionQueue>,
        recv_cq: &Arc<dyn CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Box<dyn QueuePair>> {
        let send = self.own_cq(send_cq)?;
        let recv = self.own_cq(recv_cq)?;
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: send.raw(),
            recv_cq: recv.raw(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            // Unsignaled writes must stay unsignaled.
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: the PD and both CQs are live (their handles are held by the QpHandle
        // below); `init` is a valid ibv_qp_init_attr.
        let qp = unsafe { ffi::ibv_create_qp(self.pd.pd, &mut init) };
        if qp.is_null() {
            return Err(Error::io(
                format!(
                    "creating an RC queue pair on {} ({} send, {} receive work requests; \
                     ibv_create_qp)",
                    self.name, caps.max_send_wr, caps.max_recv_wr
                ),
                std::io::Error::last_os_error(),
            ));
        }
        let handle = QpHandle::new(qp, self.pd.clone(), send.handle(), recv.handle());
        Ok(Box::new(VerbsQp::new(
            self.name.clone(),
            handle,
            self.ctx.clone(),
            self.port,
        )))
    }
}
