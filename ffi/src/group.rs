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
use crate::types::*;
use qccl_core::internal::Engine;
use qccl_core::{Error, Result};
use std::cell::RefCell;
use std::sync::Arc;

type Batch = (usize, Arc<CommHandle>, Vec<Op>);

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

/// Runs `op` on comm `token` now, or queues it when a group is open.
pub(crate) fn launch(token: qcclComm_t, h: Arc<CommHandle>, op: Op) -> Result<()> {
    let op = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if !in_group() {
            return Some(op);
        }
        let key = token as usize;
        match g.batches.iter_mut().find(|(k, _, _)| *k == key) {
            Some((_, _, ops)) => ops.push(op),
            None => g.batches.push((key, h.clone(), vec![op])),
        }
        None
    });
    let Some(op) = op else {
        return Ok(()); // queued
    };
    op.run_blocking(&h.comm)
}

/// Enlists comm `token` in the open group without an operation: a fusion plan holds a
/// tensor of it (`plan::Routed::Held`), to be checked at qcclGroupEnd.
pub(crate) fn hold(token: qcclComm_t, h: Arc<CommHandle>) {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        let key = token as usize;
        if !g.batches.iter().any(|(k, _, _)| *k == key) {
            g.batches.push((key, h, Vec::new()));
        }
    });
}

/// A comm's batch, checked: collectives in call order, then every send and receive
/// together.
struct Prepared {
    colls: Vec<Op>,
    p2p: P2pPlan,
}

impl Prepared {
    fn new(h: &CommHandle, ops: Vec<Op>) -> Result<Prepared> {
        let (p2p, colls): (Vec<Op>, Vec<Op>) = ops.into_iter().partition(Op::is_p2p);
        let p2p = P2pPlan::new(h.comm.rank(), h.comm.size(), p2p)?;
        Ok(Prepared { colls, p2p })
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
    for (key, h, ops) in batches {
        match plan::check_group_end(&h).and_then(|()| Prepared::new(&h, ops)) {
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

fn run_batches(prepared: Vec<(usize, Arc<CommHandle>, Prepared)>) -> Result<()> {
    let mut handles = Vec::with_capacity(prepared.len());
    let mut pending = Vec::new();
    let mut errors: Vec<(usize, Error)> = Vec::new();
    let mut inline = None;
    for (key, h, p) in prepared {
        if inline.is_none() {
            inline = Some((key, p));
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
    if let Some((key, p)) = inline {
        if let Err(e) = handles[0].comm.execute(|e| no_panic(|| p.run(e))) {
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
        let comms: Vec<Arc<CommHandle>> = batches.iter().map(|(_, h, _)| h.clone()).collect();
        let ready = match first_error {
            Some(e) => {
                let n: usize = batches.iter().map(|(_, _, ops)| ops.len()).sum();
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
