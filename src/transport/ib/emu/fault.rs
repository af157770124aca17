//! Fault injection: one planned failure, for the link's fault tests. Set programmatically
//! (`EmuFabric::with_fault`, in this crate's tests) or, for real processes, with
//! `QCCL_IB_EMULATE_FAULT=<kind>@<n>` ([`EmuFabric::from_env`](super::EmuFabric::from_env)).

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The environment variable read by [`from_env`].
pub const ENV: &str = "QCCL_IB_EMULATE_FAULT";

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `cqe`: the n-th signaled write is not sent and completes with `RemoteOperation`;
    /// its queue pair goes to the error state (as after any error completion).
    Cqe,
    /// `qp`: the queue pair goes to the error state just before the n-th `post_write`,
    /// which then completes with `WrFlush`.
    Qp,
    /// `rkey`: the n-th write is sent with an rkey no NIC issues (0), so the responder
    /// refuses it: `RemoteAccess`, both queue pairs in the error state.
    Rkey,
    /// `drop`: the n-th write's connection is cut instead of sending it, as when the peer
    /// is lost: `RetryExceeded`, the queue pair in the error state.
    Drop,
}

/// A planned fault: `kind` at the `n`-th event it counts (from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// What goes wrong.
    pub kind: FaultKind,
    /// At which event: signaled writes for `cqe`, `post_write` calls for `qp`, writes for
    /// `rkey` and `drop`.
    pub n: u64,
}

impl Fault {
    /// Parses `<kind>@<n>` (kind `cqe`, `qp`, `rkey` or `drop`; n >= 1).
    pub fn parse(s: &str) -> Result<Fault> {
        let bad = |why: &str| {
            Error::invalid(format!(
                "{ENV}={s:?}: {why}; expected <kind>@<n> with kind cqe, qp, rkey or drop and \
                 n >= 1 (e.g. cqe@3)"
            ))
        };
        let (kind, n) = s.trim().split_once('@').ok_or_else(|| bad("no '@'"))?;
        let kind = match kind {
            "cqe" => FaultKind::Cqe,
            "qp" => FaultKind::Qp,
            "rkey" => FaultKind::Rkey,
            "drop" => FaultKind::Drop,
            _ => return Err(bad(&format!("unknown kind {kind:?}"))),
        };
        let n: u64 = n
            .parse()
            .map_err(|_| bad(&format!("{n:?} is not a count")))?;
        if n == 0 {
            return Err(bad("n counts from 1"));
        }
        Ok(Fault { kind, n })
    }
}

/// Which event of a fault's kind is happening: counters shared by every queue pair under
/// one plan.
#[derive(Debug, Default)]
pub struct FaultPlan {
    fault: Option<Fault>,
    signaled_writes: AtomicU64,
    posts: AtomicU64,
    writes: AtomicU64,
}

impl FaultPlan {
    /// A plan that injects `fault` (none: counts nothing, injects nothing).
    pub fn new(fault: Option<Fault>) -> FaultPlan {
        FaultPlan {
            fault,
            ..FaultPlan::default()
        }
    }

    /// Counts a `post_write`: true when the queue pair must fail before it (`qp`).
    pub fn on_post(&self) -> bool {
        self.hit(FaultKind::Qp, &self.posts)
    }

    /// Counts a write about to be sent: the fault to apply to it, if any.
    pub fn on_send(&self, signaled: bool) -> Option<FaultKind> {
        let mut out = None;
        if signaled && self.hit(FaultKind::Cqe, &self.signaled_writes) {
            out = Some(FaultKind::Cqe);
        }
        for kind in [FaultKind::Rkey, FaultKind::Drop] {
            if self.hit(kind, &self.writes) {
                out = Some(kind);
            }
        }
        out
    }

    fn hit(&self, kind: FaultKind, counter: &AtomicU64) -> bool {
        match self.fault {
            Some(f) if f.kind == kind => counter.fetch_add(1, Ordering::Relaxed) + 1 == f.n,
            _ => false,
        }
    }
}

/// The process's plan from [`ENV`], parsed once: counts are per process, across every
/// fabric made by `from_env`.
pub fn from_env() -> Result<Arc<FaultPlan>> {
    static PLAN: OnceLock<Result<Arc<FaultPlan>>> = OnceLock::new();
    PLAN.get_or_init(|| {
        let fault = match std::env::var(ENV) {
            Ok(v) if !v.trim().is_empty() => Some(Fault::parse(&v)?),
            _ => None,
        };
        if let Some(f) = fault {
            crate::qlog!(Warn, "{ENV}: injecting fault {:?} at event {}", f.kind, f.n);
        }
        Ok(Arc::new(FaultPlan::new(fault)))
    })
    .clone()
}
