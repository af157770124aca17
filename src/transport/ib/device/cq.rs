//! A completion queue with a completion channel: the contract's `CompletionQueue`. `wait`
//! arms the queue's notification and sleeps on the channel's fd (poll(2)) at most the given
//! time.

use super::attrs;
use super::handles::{ChannelHandle, CqHandle, CtxHandle};
use crate::error::{Error, Result};
use crate::transport::ib::verbs::{Completion, CompletionQueue};
use ibverbs_sys as ffi;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

pub(super) struct VerbsCq {
    handle: Arc<CqHandle>,
    name: String,
    /// Completions `wait` found while closing the arm-then-sleep race; `poll` hands them out
    /// first, so order is kept.
    stash: Mutex<VecDeque<Completion>>,
}

impl VerbsCq {
    pub(super) fn new(name: &str, ctx: &Arc<CtxHandle>, depth: u32) -> Result<VerbsCq> {
        let depth = i32::try_from(depth.max(1))
            .map_err(|_| Error::invalid(format!("completion queue depth {depth} is too large")))?;
        // SAFETY: `ctx` is open; the channel is freed by ChannelHandle (which holds `ctx`).
        let ch = unsafe { ffi::ibv_create_comp_channel(ctx.0) };
        if ch.is_null() {
            return Err(Error::io(
                format!("creating a completion channel on {name} (ibv_create_comp_channel)"),
                std::io::Error::last_os_error(),
            ));
        }
        let channel = Arc::new(ChannelHandle::new(ch, ctx.clone()));
        // Non-blocking: `wait` reads events only after poll(2) says one is there, and a
        // second waiter that lost the race must not block in ibv_get_cq_event.
        let fd = channel.fd();
        // SAFETY: fcntl on the channel's own fd, which it keeps open.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(Error::io(
                format!("making {name}'s completion channel non-blocking"),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `ctx` and `channel` are live; the CQ is destroyed by CqHandle, before the
        // channel (it holds the channel's Arc).
        let cq = unsafe { ffi::ibv_create_cq(ctx.0, depth, std::ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(Error::io(
                format!("creating a completion queue of {depth} on {name} (ibv_create_cq)"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(VerbsCq {
            handle: Arc::new(CqHandle { cq, channel }),
            name: name.to_string(),
            stash: Mutex::new(VecDeque::new()),
        })
    }

    pub(super) fn raw(&self) -> *mut ffi::ibv_cq {
        self.handle.cq
    }

    pub(super) fn handle(&self) -> Arc<CqHandle> {
        self.handle.clone()
    }

    /// One `ibv_poll_cq` of up to `max` completions, appended to `out`.
    fn poll_raw(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut wcs = [ffi::ibv_wc::default(); POLL_BATCH];
        let want = max.min(POLL_BATCH);
        let cq = self.handle.cq;
        // SAFETY: `cq` is live; ibv_poll_cq is a static inline in verbs.h calling the
        // provider's poll_cq op, which libibverbs always sets; `wcs` has room for `want`.
        let n = unsafe {
            let ctx = (*cq).context;
            match (*ctx).ops.poll_cq {
                Some(poll) => poll(cq, want as i32, wcs.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            return Err(Error::System(format!(
                "polling a completion queue on {} failed (ibv_poll_cq returned {n})",
                self.name
            )));
        }
        for wc in &wcs[..n as usize] {
            out.push(completion(wc));
        }
        Ok(n as usize)
    }

    /// Arms the queue: the next completion raises an event on the channel.
    fn arm(&self) -> bool {
        let cq = self.handle.cq;
        // SAFETY: `cq` is live; ibv_req_notify_cq is a static inline calling the provider's
        // req_notify_cq op.
        unsafe {
            let ctx = (*cq).context;
            match (*ctx).ops.req_notify_cq {
                Some(notify) => notify(cq, 0) == 0,
                None => false,
            }
        }
    }

    /// Takes and acknowledges the events on the channel (non-blocking).
    fn drain_events(&self) {
        loop {
            let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
            let mut cq_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; out-pointers are valid.
            let rc = unsafe { ffi::ibv_get_cq_event(self.handle.channel.ch, &mut cq, &mut cq_ctx) };
            if rc != 0 {
                return;
            }
            // SAFETY: `cq` is the queue the event was for (this channel serves only ours);
            // acknowledging at once keeps ibv_destroy_cq from waiting.
            unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        }
    }
}

/// The contract's view of one `ibv_wc`.
fn completion(wc: &ffi::ibv_wc) -> Completion {
    let status = attrs::wc_status(
        wc.error()
            .map_or(ffi::ibv_wc_status::IBV_WC_SUCCESS, |e| e.0),
    );
    Completion {
        wr_id: wc.wr_id(),
        status,
        opcode: attrs::wc_opcode(status, wc.opcode()),
        byte_len: wc.len() as u32,
        imm: wc.imm_data().map_or(0, attrs::imm_from_wire),
        qpn: wc.qp_num,
    }
}

impl CompletionQueue for VerbsCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        // Held across the stash and the queue: completions leave in the order they came.
        let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
        let mut taken = 0;
        while taken < max {
            let Some(c) = stash.pop_front() else { break };
            out.push(c);
            taken += 1;
        }
        while taken < max {
            let n = self.poll_raw(out, max - taken)?;
            taken += n;
            if n == 0 {
                break;
            }
        }
        Ok(taken)
    }

    fn wait(&self, d: Duration) {
        {
            let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
            if !stash.is_empty() {
                return;
            }
            if !self.arm() {
                drop(stash);
                // Cannot sleep on the channel: a short sleep keeps the caller's loop bounded
                // without spinning.
                std::thread::sleep(d.min(Duration::from_millis(1)));
                return;
            }
            // A completion that arrived before the arm raises no event: look once more, and
            // keep what is found for the next poll (under the lock, so order holds).
            let mut found = Vec::new();
            if self.poll_raw(&mut found, POLL_BATCH).is_err() || !found.is_empty() {
                stash.extend(found);
                return;
            }
        }
        if d.is_zero() {
            return;
        }
        let mut pfd = libc::pollfd {
            fd: self.handle.channel.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // ppoll: nanosecond timeout, so the wait is never longer than `d`.
        let ts = libc::timespec {
            tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one valid pollfd for the channel's open fd; a valid timespec; no signal
        // mask change (null).
        let ready = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if ready > 0 {
            self.drain_events();
        }
    }
}
