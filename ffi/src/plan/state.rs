//! A comm's fusion plan and where its iteration is (`PlanState`), and the completion shared by
//! a non-blocking group's tensors (`GroupSlot`): the data the comm handle holds, apart from
//! the routing in `plan` (so the handle and the routing do not import each other).

use crate::buf::RawBuf;
use qccl_core::fused::FusionPlan;
use qccl_core::{Error, ReduceOp, Request, Result};
use qccl_planner::{JsonFile, Plan};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// How an all-reduce was issued.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    Blocking,
    Grouped,
    NonBlocking,
}

/// A comm's plan and where its current iteration is.
pub(crate) struct PlanState {
    pub(super) path: String,
    pub(super) plan: FusionPlan,
    /// The tensor the next submission is.
    pub(super) next: usize,
    pub(super) open: Option<OpenGroup>,
    /// `next` at the first grouped submission of the running qcclGroupStart/End: where the
    /// iteration returns to if the group runs nothing.
    pub(super) group_mark: Option<usize>,
}

/// The fusion group being filled.
pub(super) struct OpenGroup {
    pub(super) mode: Mode,
    pub(super) op: ReduceOp,
    pub(super) tensors: Vec<(Option<RawBuf>, RawBuf)>,
    pub(super) slot: Arc<GroupSlot>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// "tensors 2 to 5", "tensor 4": tensor ranges as C users count them (inclusive).
pub(super) fn tensors(r: Range<usize>) -> String {
    match r.len() {
        0 | 1 => format!("tensor {}", r.start),
        _ => format!("tensors {} to {}", r.start, r.end - 1),
    }
}

/// Reads and checks a plan file; every problem is an argument error naming the file.
pub(crate) fn load(path: &str, what: &str) -> Result<PlanState> {
    let wrap = |e: Error| {
        let msg = match e {
            Error::InvalidArgument(m) | Error::System(m) => m,
            other => other.to_string(),
        };
        Error::invalid(format!("{what} {path}: {msg}"))
    };
    let text = std::fs::read_to_string(path).map_err(|e| wrap(Error::System(e.to_string())))?;
    let plan =
        FusionPlan::new(&Plan::from_json(&text).map_err(wrap)?.fused(), None).map_err(wrap)?;
    if plan.num_tensors() == 0 {
        return Err(wrap(Error::invalid("the plan has no groups")));
    }
    Ok(PlanState {
        path: path.to_string(),
        plan,
        next: 0,
        open: None,
        group_mark: None,
    })
}

impl PlanState {
    /// The same plan at the start of an iteration (for another comm).
    pub(crate) fn fresh(&self) -> PlanState {
        PlanState {
            path: self.path.clone(),
            plan: self.plan.clone(),
            next: 0,
            open: None,
            group_mark: None,
        }
    }
}

/// The plan of QCCL_PLAN_FILE, if it is set (read when a comm is created).
pub(crate) fn from_env() -> Result<Option<PlanState>> {
    match std::env::var("QCCL_PLAN_FILE") {
        Ok(p) if !p.is_empty() => load(&p, "QCCL_PLAN_FILE").map(Some),
        _ => Ok(None),
    }
}

/// The completion of a non-blocking fusion group, shared by the requests of its tensors.
pub(crate) struct GroupSlot {
    pub(super) group: usize,
    pub(super) range: Range<usize>,
    state: Mutex<SlotState>,
    done: Condvar,
}

enum SlotState {
    /// Tensors `range.start..next` submitted.
    Open {
        next: usize,
    },
    Running(Request<()>),
    /// One waiter took the request and waits on it; the others wait for `Done`.
    Waiting,
    Done(Result<()>),
}

impl GroupSlot {
    pub(super) fn new(group: usize, range: Range<usize>) -> GroupSlot {
        let next = range.start;
        GroupSlot {
            group,
            range,
            state: Mutex::new(SlotState::Open { next }),
            done: Condvar::new(),
        }
    }

    pub(super) fn submitted(&self, next: usize) {
        if let SlotState::Open { next: n } = &mut *lock(&self.state) {
            *n = next;
        }
    }

    pub(super) fn start(&self, req: Request<()>) {
        *lock(&self.state) = SlotState::Running(req);
    }

    pub(super) fn finish(&self, r: Result<()>) {
        *lock(&self.state) = SlotState::Done(r);
        self.done.notify_all();
    }

    /// The error of waiting for tensor `tensor` while its group still needs tensors (waiting
    /// would hang: the missing calls come from the waiter's own program), else None.
    pub(crate) fn incomplete(&self, tensor: usize) -> Option<Error> {
        let SlotState::Open { next } = *lock(&self.state) else {
            return None;
        };
        Some(Error::InvalidUsage(format!(
            "tensor {tensor} is in fusion group {} ({}) which is incomplete: submit {} first",
            self.group,
            tensors(self.range.clone()),
            tensors(next..self.range.end)
        )))
    }

    /// Whether the group finished (with its error if it failed); never blocks.
    pub(crate) fn test(&self) -> Result<bool> {
        let mut s = lock(&self.state);
        if let SlotState::Running(req) = &mut *s {
            if !req.test() {
                return Ok(false);
            }
            let SlotState::Running(req) = std::mem::replace(&mut *s, SlotState::Waiting) else {
                unreachable!("matched above")
            };
            // Finished: returns at once.
            *s = SlotState::Done(req.wait());
            self.done.notify_all();
        }
        match &*s {
            SlotState::Done(r) => r.clone().map(|()| true),
            _ => Ok(false),
        }
    }

    /// Waits for tensor `tensor`'s group; an incomplete group is an error, not a hang.
    pub(crate) fn wait(&self, tensor: usize) -> Result<()> {
        if let Some(e) = self.incomplete(tensor) {
            return Err(e);
        }
        let mut s = lock(&self.state);
        loop {
            match std::mem::replace(&mut *s, SlotState::Waiting) {
                SlotState::Running(req) => {
                    // Wait without the lock, so qcclTest on the group's other tensors answers.
                    drop(s);
                    let r = req.wait();
                    self.finish(r.clone());
                    return r;
                }
                SlotState::Done(r) => {
                    *s = SlotState::Done(r.clone());
                    return r;
                }
                SlotState::Waiting => {
                    s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                open @ SlotState::Open { .. } => {
                    // Reopened? Not possible (a slot never goes back); answer as incomplete.
                    *s = open;
                    drop(s);
                    return Err(self.incomplete(tensor).unwrap_or_else(|| {
                        Error::Internal("fusion group slot changed state".into())
                    }));
                }
            }
        }
    }
}
