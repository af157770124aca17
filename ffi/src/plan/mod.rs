//! Fusion plans for C callers (QCCL_PLAN_FILE, `qcclCommSetPlan`): while a comm has a plan,
//! its float32 sum/avg all-reduces issued with `qcclIAllReduce` or inside a group are the
//! plan's tensors in order; when a call completes a fusion group, the group's tensors are
//! reduced together, dense or with the group's codec (`qccl::fused::FusionPlan`, shared with the
//! Rust `PlanRunner`), and each result is written back to its tensor's recvbuff.
//!
//! The tensors of a group are issued one way: all non-blocking (each gets a request that
//! completes with the group, see `GroupSlot`) or all in one qcclGroupStart/End (the group's
//! all-reduce joins the batch; an incomplete group at qcclGroupEnd is an error). A blocking
//! qcclAllReduce can only be a group of one tensor.

pub(crate) mod state;

use crate::buf::RawBuf;
use crate::handle::CommHandle;
use crate::last_error::no_panic;
use crate::op::Op;
use qccl_core::{DType, Error, ReduceOp, Result};
use state::{lock, tensors, OpenGroup};
use std::sync::Arc;

pub(crate) use state::{from_env, load, GroupSlot, Mode, PlanState};

/// Replaces `h`'s plan (None: no plan). Requests of an incomplete fusion group of the old plan
/// fail (their tensors were never reduced).
pub(crate) fn set(h: &CommHandle, plan: Option<PlanState>) {
    let old = std::mem::replace(&mut *lock(&h.plan), plan);
    if let Some(o) = old.and_then(|s| s.open) {
        o.slot.finish(Err(Error::InvalidUsage(format!(
            "the plan was replaced while fusion group {} ({}) was incomplete; its tensors were \
             not reduced",
            o.slot.group,
            tensors(o.slot.range.clone())
        ))));
    }
}

/// What the plan made of an all-reduce call.
pub(crate) enum Routed {
    /// The plan does not apply (no plan, another dtype or op): an ordinary all-reduce.
    Plain,
    /// A tensor of a fusion group that is not complete yet (grouped): nothing to run now.
    Held,
    /// A complete fusion group to run now (blocking) or at qcclGroupEnd (grouped).
    Run(Op),
    /// Non-blocking: the tensor's completion (its group's).
    Request(Arc<GroupSlot>, usize),
}

/// Routes an all-reduce through `h`'s plan (checked buffers, `send` None in place).
pub(crate) fn route(
    h: &CommHandle,
    mode: Mode,
    send: Option<RawBuf>,
    recv: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<Routed> {
    let mut guard = lock(&h.plan);
    let Some(st) = guard.as_mut() else {
        return Ok(Routed::Plain);
    };
    if dtype != DType::Float32 || !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return Ok(Routed::Plain);
    }
    let t = st.next;
    let g = st.plan.group_of(t);
    let range = st.plan.tensors(g);
    let where_ = format!(
        "tensor {t} is in fusion group {g} ({})",
        tensors(range.clone())
    );
    if mode == Mode::Blocking && range.len() > 1 {
        return Err(Error::InvalidUsage(format!(
            "a fusion plan ({}) is active and this call is its {where_}: issue it with \
             qcclIAllReduce or between qcclGroupStart and qcclGroupEnd (a blocking \
             qcclAllReduce can only be a fusion group of one tensor)",
            st.path
        )));
    }
    let mut parts = match &st.open {
        Some(o) if o.mode != mode => {
            return Err(Error::InvalidUsage(format!(
                "{where_}, whose earlier tensors were issued {}, but this one {}: issue all \
                 tensors of a fusion group the same way",
                how(o.mode),
                how(mode)
            )))
        }
        Some(o) if o.op != op => {
            return Err(Error::invalid(format!(
                "{where_}: its op {op} differs from {}, the op of the group's earlier tensors",
                o.op
            )))
        }
        Some(o) => o.tensors.clone(),
        None => Vec::new(),
    };
    check_disjoint(t, range.start, &parts, send, recv)?;
    parts.push((send, recv));
    let complete = t + 1 == range.end;
    // Prepare before changing any state: a failure leaves the plan where it was.
    let run = if complete {
        let count = parts.iter().map(|(_, r)| r.len() / 4).sum();
        let call = st.plan.prepare(&h.comm, g, count, op)?;
        Some(Op::Fused {
            call: Box::new(call),
            parts,
        })
    } else {
        None
    };
    if mode == Mode::Grouped && st.group_mark.is_none() {
        st.group_mark = Some(t);
    }
    let open = st.open.get_or_insert_with(|| OpenGroup {
        mode,
        op,
        tensors: Vec::new(),
        slot: Arc::new(GroupSlot::new(g, range.clone())),
    });
    open.tensors.push((send, recv));
    let slot = open.slot.clone();
    slot.submitted(t + 1);
    st.next = if t + 1 == st.plan.num_tensors() {
        0
    } else {
        t + 1
    };
    let Some(op) = run else {
        return Ok(match mode {
            Mode::NonBlocking => Routed::Request(slot, t),
            _ => Routed::Held,
        });
    };
    st.open = None;
    if mode != Mode::NonBlocking {
        return Ok(Routed::Run(op));
    }
    match h.comm.submit(move |e| no_panic(|| op.run(e))) {
        Ok(req) => slot.start(req),
        Err(e) => slot.finish(Err(e.clone())),
    }
    Ok(Routed::Request(slot, t))
}

fn how(m: Mode) -> &'static str {
    match m {
        Mode::NonBlocking => "with qcclIAllReduce",
        _ => "inside qcclGroupStart/qcclGroupEnd",
    }
}

/// The tensors of a fused group are read and written together: refuses a new tensor whose
/// recvbuff overlaps any buffer of the group's earlier tensors, or whose sendbuff overlaps
/// one of their recvbuffs (sendbuffs may share memory: they are only read).
fn check_disjoint(
    t: usize,
    first: usize,
    parts: &[(Option<RawBuf>, RawBuf)],
    send: Option<RawBuf>,
    recv: RawBuf,
) -> Result<()> {
    for (k, (s, r)) in parts.iter().enumerate() {
        let clash = recv.overlaps(r)
            || s.is_some_and(|s| recv.overlaps(&s))
            || send.is_some_and(|s| s.overlaps(r));
        if clash {
            return Err(Error::invalid(format!(
                "tensor {t}'s buffers overlap those of tensor {} of the same fusion group",
                first + k
            )));
        }
    }
    Ok(())
}

/// At the outermost qcclGroupEnd, before anything runs: a fusion group begun in the group
/// must be complete.
pub(crate) fn check_group_end(h: &CommHandle) -> Result<()> {
    let guard = lock(&h.plan);
    let Some(st) = guard.as_ref() else {
        return Ok(());
    };
    match &st.open {
        Some(o) if o.mode == Mode::Grouped => Err(Error::InvalidUsage(format!(
            "tensor {} is in fusion group {} ({}) which is incomplete at qcclGroupEnd: submit \
             {} in the same group",
            st.next - 1,
            o.slot.group,
            tensors(o.slot.range.clone()),
            tensors(st.next..o.slot.range.end)
        ))),
        _ => Ok(()),
    }
}

/// The outermost qcclGroupEnd ran (or queued) the group's operations.
pub(crate) fn group_ran(h: &CommHandle) {
    if let Some(st) = lock(&h.plan).as_mut() {
        st.group_mark = None;
    }
}

/// The outermost qcclGroupEnd ran nothing: the plan's iteration returns to where it was
/// before the group's first tensor.
pub(crate) fn group_abandoned(h: &CommHandle) {
    if let Some(st) = lock(&h.plan).as_mut() {
        if let Some(mark) = st.group_mark.take() {
            st.next = mark;
            if st.open.as_ref().is_some_and(|o| o.mode == Mode::Grouped) {
                st.open = None;
            }
        }
    }
}
