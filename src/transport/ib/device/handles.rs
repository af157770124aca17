//! Owning wrappers of the raw libibverbs objects, each destroying its object on drop and
//! holding an `Arc` of what it was created from, so destruction runs in the only order verbs
//! accepts whatever order the caller drops things in: queue pairs, then completion queues
//! (and their completion channel), then memory regions, then the protection domain, then the
//! device context.
//!
//! Destroy calls that fail are ignored: drop cannot report them, and verbs only fails them
//! for objects still in use, which the `Arc`s rule out.

use ibverbs_sys as ffi;
use std::sync::Arc;

/// An opened device (`ibv_context`).
pub(super) struct CtxHandle(pub(super) *mut ffi::ibv_context);

// SAFETY: libibverbs objects may be used from any thread ("all verbs are thread safe",
// rdma-core's libibverbs documentation); the pointer is owned and freed once, in Drop.
unsafe impl Send for CtxHandle {}
// SAFETY: as for Send; shared use only calls thread-safe verbs.
unsafe impl Sync for CtxHandle {}

impl Drop for CtxHandle {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device and closed only here; every object created from
        // it holds an Arc of this handle, so none is left.
        unsafe { ffi::ibv_close_device(self.0) };
    }
}

/// A protection domain (`ibv_pd`).
pub(super) struct PdHandle {
    pub(super) pd: *mut ffi::ibv_pd,
    _ctx: Arc<CtxHandle>,
}

impl PdHandle {
    pub(super) fn new(pd: *mut ffi::ibv_pd, ctx: Arc<CtxHandle>) -> PdHandle {
        PdHandle { pd, _ctx: ctx }
    }
}

// SAFETY: see CtxHandle.
unsafe impl Send for PdHandle {}
// SAFETY: see CtxHandle.
unsafe impl Sync for PdHandle {}

impl Drop for PdHandle {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd and freed only here; its regions and queue pairs
        // hold Arcs of this handle and are gone.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A completion channel (`ibv_comp_channel`): the fd a completion queue's events arrive on.
pub(super) struct ChannelHandle {
    pub(super) ch: *mut ffi::ibv_comp_channel,
    _ctx: Arc<CtxHandle>,
}

// SAFETY: see CtxHandle.
unsafe impl Send for ChannelHandle {}
// SAFETY: see CtxHandle.
unsafe impl Sync for ChannelHandle {}

impl ChannelHandle {
    pub(super) fn new(ch: *mut ffi::ibv_comp_channel, ctx: Arc<CtxHandle>) -> ChannelHandle {
        ChannelHandle { ch, _ctx: ctx }
    }

    /// The channel's file descriptor.
    pub(super) fn fd(&self) -> i32 {
        // SAFETY: `ch` is a live channel (owned by self).
        unsafe { (*self.ch).fd }
    }
}

impl Drop for ChannelHandle {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_comp_channel; its completion queue holds an Arc of
        // this handle and is destroyed already.
        unsafe { ffi::ibv_destroy_comp_channel(self.ch) };
    }
}

/// A completion queue (`ibv_cq`).
pub(super) struct CqHandle {
    pub(super) cq: *mut ffi::ibv_cq,
    pub(super) channel: Arc<ChannelHandle>,
}

// SAFETY: see CtxHandle (ibv_poll_cq and ibv_req_notify_cq lock inside the provider).
unsafe impl Send for CqHandle {}
// SAFETY: see CtxHandle.
unsafe impl Sync for CqHandle {}

impl Drop for CqHandle {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq; queue pairs reporting to it hold Arcs of this
        // handle and are destroyed; every event taken from its channel was acknowledged when
        // it was taken, so ibv_destroy_cq does not wait for acknowledgements.
        unsafe { ffi::ibv_destroy_cq(self.cq) };
    }
}

/// A memory registration (`ibv_mr`).
pub(super) struct MrHandle {
    pub(super) mr: *mut ffi::ibv_mr,
    _pd: Arc<PdHandle>,
}

// SAFETY: see CtxHandle.
unsafe impl Send for MrHandle {}
// SAFETY: see CtxHandle.
unsafe impl Sync for MrHandle {}

impl MrHandle {
    pub(super) fn new(mr: *mut ffi::ibv_mr, pd: Arc<PdHandle>) -> MrHandle {
        MrHandle { mr, _pd: pd }
    }

    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration owned by self.
        unsafe { (*self.mr).lkey }
    }

    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: as in lkey.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for MrHandle {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr and deregistered only here. A queue pair may still
        // name its keys, but after deregistration the NIC refuses them (remote access error)
        // instead of touching the memory, which the contract allows.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// A queue pair (`ibv_qp`).
pub(super) struct QpHandle {
    pub(super) qp: *mut ffi::ibv_qp,
    _pd: Arc<PdHandle>,
    _send_cq: Arc<CqHandle>,
    _recv_cq: Arc<CqHandle>,
}

// SAFETY: see CtxHandle.
unsafe impl Send for QpHandle {}

impl QpHandle {
    pub(super) fn new(
        qp: *mut ffi::ibv_qp,
        pd: Arc<PdHandle>,
        send_cq: Arc<CqHandle>,
        recv_cq: Arc<CqHandle>,
    ) -> QpHandle {
        QpHandle {
            qp,
            _pd: pd,
            _send_cq: send_cq,
            _recv_cq: recv_cq,
        }
    }

    pub(super) fn qpn(&self) -> u32 {
        // SAFETY: `qp` is a live queue pair owned by self.
        unsafe { (*self.qp).qp_num }
    }
}

impl Drop for QpHandle {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp and destroyed only here, before the completion
        // queues and protection domain it holds Arcs of. Destroying flushes its work
        // requests without waiting on the peer.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
    }
}
