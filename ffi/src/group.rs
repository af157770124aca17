//! `qcclGroupStart` / `qcclGroupEnd`: calls made in between are queued per comm and run at
//! the outermost `qcclGroupEnd`.
//!
//! At the end, each comm's batch runs as one operation of that comm (in its turn after
//! earlier operations): its collectives in call order, then all its sends and receives
//! together (`op::P2pPlan`), so no order of sends and receives deadlocks. What can be checked
//! without peers (self sends matched by self receives, receive buffers that overlap others)
//! is checked for every comm before any batch starts, so such an error fails no comm. The first comm's
//! batch runs on the calling thread and every other comm's on its own worker, all at once, so
//! several comms driven from one thread (after `qcclCommInitAll`) progress together.
//! `qcclGroupEnd` returns when every batch has finished, with the first error.
//!
//! A grouped call that fails its argument checks returns its error at once and spoils the
//! group: the outermost `qcclGroupEnd` then runs nothing and returns that error again
//! (the comms stay usable).

use crate::handle::CommHandle;
use crate::last_error::{guard, no_panic, record};
use crate::nesting::{self, in_group};
use crate::op::{Op, P2pPlan};
use crate::plan;
use crate::spans::Spans;
use crate::types::*;
use qccl_core::internal::Engine;
use qccl_core::{Error, Request, Result};
use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;

/// One comm's queued calls.
struct Batch {
    key: usize,
    h: Arc<CommHandle>,
    ops: Vec<Op>,
    /// The stream its calls named (one per comm and group; 0: NULL).
    stream: usize,
}

#[derive(Default)]
struct Group {
    batches: Vec<Batch>,
    first_error: Option<Error>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// The body of an entry point that starts an operation: like `guard`, and a failure inside
/// a group spoils the group.
pub(crate) fn guard_op(
    func: &'static str,
    comm: qcclComm_t,
    f: impl FnOnce() -> Result<()>,
) -> qcclResult_t {
    guard(func, comm, || {
        let r = f();
        if let Err(e) = &r {
            GROUP.with(|g| {
                let mut g = g.borrow_mut();
                if in_group() && g.first_error.is_none() {
                    g.first_error = Some(e.clone());
                }
            });
        }
        r
    })
}

/// Runs `op` (host buffers, NULL stream) on comm `token` now, or queues it when a group is
/// open.
pub(crate) fn launch(token: qcclComm_t, h: Arc<CommHandle>, op: Op) -> Result<()> {
    if !in_group() {
        return op.run_blocking(&h.comm);
    }
    queue(token, h, op, std::ptr::null_mut())
}

/// Queues `op` on comm `token` in the open group, ordered on `stream` (device buffers are
/// staged at `qcclGroupEnd`).
pub(crate) fn queue(
    token: qcclComm_t,
    h: Arc<CommHandle>,
    op: Op,
    stream: qcclStream_t,
) -> Result<()> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        let key = token as usize;
        match g.batches.iter_mut().find(|b| b.key == key) {
            Some(b) if b.ops.is_empty() || b.stream == stream as usize => {
                b.stream = stream as usize;
                b.ops.push(op);
            }
            Some(b) => {
                return Err(Error::Unsupported(format!(
                    "stream {stream:p} in a group whose earlier calls on this comm named stream \
                     {:p}: one stream per comm in a group is supported",
                    b.stream as *const c_void
                )))
            }
            None => g.batches.push(Batch {
                key,
                h,
                ops: vec![op],
                stream: stream as usize,
            }),
        }
        Ok(())
    })
}

/// Enlists comm `token` in the open group without an operation: a fusion plan holds a
/// tensor of it (`plan::Routed::Held`), to be checked at qcclGroupEnd.
pub(crate) fn hold(token: qcclComm_t, h: Arc<CommHandle>) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        let key = token as usize;
        if !g.batches.iter().any(|b| b.key == key) {
            g.batches.push(Batch {
                key,
                h,
                ops: Vec::new(),
                stream: 0,
            });
        }
    });
}

/// A comm's batch, checked: collectives in call order, then every send and receive
/// together.
struct Prepared {
    colls: Vec<Op>,
    p2p: P2pPlan,
    /// Device buffers or a stream: where the calls' buffers are staged.
    staged: Option<Staged>,
}

/// A batch on device memory or a stream: its buffers merged for staging, and the stream.
struct Staged {
    spans: Spans,
    stream: usize,
}

impl Prepared {
    fn new(h: &CommHandle, ops: Vec<Op>, stream: usize) -> Result<Prepared> {
        let staged = staging(h, &ops, stream)?;
        let (p2p, colls): (Vec<Op>, Vec<Op>) = ops.into_iter().partition(Op::is_p2p);
        let p2p = P2pPlan::new(h.comm.rank(), h.comm.size(), p2p)?;
        Ok(Prepared { colls, p2p, staged })
    }

    /// Moves every buffer to where staging put it (`hosts`: an address per span).
    fn map_bufs(&mut self, spans: &Spans, hosts: &[*mut u8]) {
        let hosts: Vec<usize> = hosts.iter().map(|&h| h as usize).collect();
        let f = |b| spans.map(&hosts, b);
        self.colls.iter_mut().for_each(|op| op.map_bufs(&f));
        self.p2p.map_bufs(&f);
    }

    /// How many compressed calls `run` makes, when known before it runs (sends and
    /// receives make none).
    fn coded_calls(&self) -> Option<u64> {
        self.colls.iter().map(Op::coded_calls).sum()
    }

    fn run(self, e: &mut Engine) -> Result<()> {
        for op in self.colls {
            op.run(e)?;
        }
        if !self.p2p.is_empty() {
            self.p2p.run(e)?;
        }
        Ok(())
    }
}

/// Checks every batch before any runs (an error found here fails no comm): fusion plans
/// with a group begun here must have it complete, and each batch's operations must fit.
fn prepare_batches(batches: Vec<Batch>) -> Result<Vec<(usize, Arc<CommHandle>, Prepared)>> {
    let mut prepared = Vec::with_capacity(batches.len());
    for Batch {
        key,
        h,
        ops,
        stream,
    } in batches
    {
        match plan::check_group_end(&h).and_then(|()| Prepared::new(&h, ops, stream)) {
            // A comm enlisted only for a plan's tensors may have nothing to run.
            Ok(p) if p.colls.is_empty() && p.p2p.is_empty() => {}
            Ok(p) => prepared.push((key, h, p)),
            Err(e) => {
                let e = e.prefixed("none of the group's operations ran: ");
                record("qcclGroupEnd", key as qcclComm_t, &e);
                return Err(e);
            }
        }
    }
    Ok(prepared)
}

/// How a batch's buffers are staged: None for host buffers on the NULL stream (the host
/// path); checked before any batch runs.
fn staging(h: &CommHandle, ops: &[Op], stream: usize) -> Result<Option<Staged>> {
    let spans = Spans::of(ops.iter().flat_map(Op::call_bufs));
    if stream == 0 && !h.comm.device_buffers(spans.bufs())? {
        return Ok(None);
    }
    if stream != 0 {
        // The group returns once its calls are enqueued: host memory the caller may change
        // as soon as it returns cannot be part of it.
        if ops.iter().any(Op::is_fused) {
            return Err(Error::Unsupported(
                "a fusion plan's tensors in a group whose calls name a stream".into(),
            ));
        }
        for b in spans.bufs() {
            if !h.comm.device_buffers(std::slice::from_ref(b))? {
                return Err(Error::Unsupported(format!(
                    "host buffer {:#x} ({} bytes) in a group whose calls name a stream: \
                     device buffers only (or NULL as the stream)",
                    b.addr, b.len
                )));
            }
        }
    }
    Ok(Some(Staged { spans, stream }))
}

/// Starts a batch on device memory: enqueued on its stream (the stream waits for it; its
/// failure is the comm's async error), or, on the NULL stream, queued with a request that
/// ends once the results are on the device.
fn run_staged(
    h: &CommHandle,
    mut p: Prepared,
    spans: Spans,
    stream: usize,
) -> Result<Option<Request<()>>> {
    let bufs = spans.bufs().to_vec();
    let coded = p.coded_calls();
    let run = move |e: &mut Engine, hosts: &[*mut u8]| {
        no_panic(|| {
            p.map_bufs(&spans, hosts);
            p.run(e)
        })
    };
    if stream == 0 {
        // SAFETY: the caller's contract (qccl.h): grouped buffers stay valid until
        // qcclGroupEnd returns, which waits for the request.
        return unsafe { h.comm.submit_on_buffers(bufs, coded, run) }.map(Some);
    }
    // SAFETY: the caller's contract: device buffers stay valid until the stream passes the
    // group's work, and `stream` is a live stream of their device.
    unsafe { h.comm.on_stream(&bufs, stream as *mut c_void, coded, run) }.map(|()| None)
}

fn run_batches(prepared: Vec<(usize, Arc<CommHandle>, Prepared)>) -> Result<()> {
    let mut handles = Vec::with_capacity(prepared.len());
    let mut pending = Vec::new();
    let mut errors: Vec<(usize, Error)> = Vec::new();
    let mut inline = None;
    for (key, h, mut p) in prepared {
        if let Some(Staged { spans, stream }) = p.staged.take() {
            match run_staged(&h, p, spans, stream) {
                Ok(Some(req)) => pending.push((key, req)),
                Ok(None) => {}
                Err(e) => errors.push((key, e)),
            }
        } else if inline.is_none() {
            inline = Some((key, h.clone(), p));
        } else {
            match h.comm.submit(move |e| no_panic(|| p.run(e))) {
                Ok(req) => pending.push((key, req)),
                Err(e) => errors.push((key, e)),
            }
        }
        // Kept until every batch finished: dropping the last reference to a comm (destroyed
        // during the group) waits for its queued batch, which may need the others.
        handles.push(h);
    }
    if let Some((key, h, p)) = inline {
        if let Err(e) = h.comm.execute(|e| no_panic(|| p.run(e))) {
            errors.insert(0, (key, e));
        }
    }
    for (key, req) in pending {
        if let Err(e) = req.wait() {
            errors.push((key, e));
        }
    }
    for (key, e) in &errors {
        record("qcclGroupEnd", *key as qcclComm_t, e);
    }
    drop(handles);
    match errors.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// Opens a group (groups nest; only the outermost end runs the queued calls).
#[no_mangle]
pub extern "C" fn qcclGroupStart() -> qcclResult_t {
    guard("qcclGroupStart", std::ptr::null_mut(), || {
        nesting::enter();
        Ok(())
    })
}

/// Closes a group; the outermost end runs every queued call and returns when all finished.
#[no_mangle]
pub extern "C" fn qcclGroupEnd() -> qcclResult_t {
    guard("qcclGroupEnd", std::ptr::null_mut(), || {
        let taken = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if nesting::depth() == 0 {
                return Err(Error::InvalidUsage(
                    "qcclGroupEnd without a matching qcclGroupStart".into(),
                ));
            }
            if nesting::leave() > 0 {
                return Ok(None);
            }
            Ok(Some((std::mem::take(&mut g.batches), g.first_error.take())))
        })?;
        let Some((batches, first_error)) = taken else {
            return Ok(());
        };
        let comms: Vec<Arc<CommHandle>> = batches.iter().map(|b| b.h.clone()).collect();
        let ready = match first_error {
            Some(e) => {
                let n: usize = batches.iter().map(|b| b.ops.len()).sum();
                Err(e.prefixed(&format!(
                    "a call in this group failed, so none of the {n} queued operations ran: "
                )))
            }
            None => prepare_batches(batches),
        };
        // Fusion plans follow what happened to the group's tensors: reduced, or never taken.
        match ready {
            Err(e) => {
                comms.iter().for_each(|h| plan::group_abandoned(h));
                Err(e)
            }
            Ok(prepared) => {
                comms.iter().for_each(|h| plan::group_ran(h));
                drop(comms);
                run_batches(prepared)
            }
        }
    })
}
