//! Registries of live comms, requests and codecs.
//!
//! A `qcclComm_t` or `qcclRequest_t` is a token, never dereferenced: a number the library
//! hands out once (never reused in the life of the process) and looks up here. So a call on
//! a destroyed or invented handle finds nothing and returns `qcclInvalidUsage` instead of
//! touching freed memory, and a comm destroyed while another thread still uses it stays alive
//! (`Arc`) until that call returns.

use crate::plan::state::{GroupSlot, PlanState};
use crate::types::*;
use qccl_core::{CodecSpec, Comm, Error, Request, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

/// A live comm and the message of its last failure (`qcclGetLastError`).
pub(crate) struct CommHandle {
    pub comm: Comm,
    pub last_error: Mutex<Option<String>>,
    /// The fusion plan (QCCL_PLAN_FILE, qcclCommSetPlan) and its iteration.
    pub plan: Mutex<Option<PlanState>>,
}

/// What a non-blocking call left behind: running, or finished with its result.
pub(crate) enum ReqState {
    Pending(Request<()>),
    Done(Result<()>),
    /// Tensor `.1` of a fusion plan: completes with its group.
    Fused(Arc<GroupSlot>, usize),
}

pub(crate) struct ReqEntry {
    pub state: ReqState,
    /// The comm the request runs on, to record its error there.
    pub comm: qcclComm_t,
}

// SAFETY: `comm` is only a token (never dereferenced); `Request` is Send.
unsafe impl Send for ReqEntry {}

static NEXT: AtomicUsize = AtomicUsize::new(1);
static COMMS: LazyLock<Mutex<HashMap<usize, Arc<CommHandle>>>> = LazyLock::new(Default::default);
static REQUESTS: LazyLock<Mutex<HashMap<usize, ReqEntry>>> = LazyLock::new(Default::default);

/// Handles look like aligned addresses in a range unlikely to hold anything else, so a
/// pointer of some other kind passed by mistake is not found.
const BASE: usize = if usize::BITS == 64 {
    0x5143_0000_0000
} else {
    0x5143_0000
};

fn next_token() -> usize {
    BASE + (NEXT.fetch_add(1, Ordering::Relaxed) << 4)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers a new comm with its fusion plan, if any; returns its handle.
pub(crate) fn register(comm: Comm, plan: Option<PlanState>) -> qcclComm_t {
    let token = next_token();
    let h = Arc::new(CommHandle {
        comm,
        last_error: Mutex::new(None),
        plan: Mutex::new(plan),
    });
    lock(&COMMS).insert(token, h);
    token as qcclComm_t
}

/// The live comm behind `c`, if any.
pub(crate) fn lookup(c: qcclComm_t) -> Option<Arc<CommHandle>> {
    if c.is_null() {
        return None;
    }
    lock(&COMMS).get(&(c as usize)).cloned()
}

/// The live comm behind `c`, or the error for a NULL, destroyed or unknown handle.
pub(crate) fn comm(c: qcclComm_t) -> Result<Arc<CommHandle>> {
    if c.is_null() {
        return Err(Error::invalid("comm is NULL"));
    }
    lookup(c).ok_or_else(|| not_live(c))
}

fn not_live(c: qcclComm_t) -> Error {
    Error::InvalidUsage(format!(
        "comm {c:p} is not a live communicator: it was destroyed or aborted, or was never \
         returned by qcclCommInitRank/qcclCommInitAll/qcclCommInitFromEnv/qcclCommSplit"
    ))
}

/// Unregisters `c` and returns it (the caller drops it outside the registry lock: dropping a
/// comm waits for its queued operations).
pub(crate) fn unregister(c: qcclComm_t) -> Result<Arc<CommHandle>> {
    if c.is_null() {
        return Err(Error::invalid("comm is NULL"));
    }
    let removed = lock(&COMMS).remove(&(c as usize));
    removed.ok_or_else(|| not_live(c))
}

/// Registers a request of a non-blocking call on `comm`; returns its handle.
pub(crate) fn register_request(state: ReqState, comm: qcclComm_t) -> qcclRequest_t {
    let token = next_token();
    lock(&REQUESTS).insert(token, ReqEntry { state, comm });
    token as qcclRequest_t
}

fn req_not_live(r: qcclRequest_t) -> Error {
    Error::InvalidUsage(format!(
        "request {r:p} is not live: qcclWait already freed it, or it was never returned by a \
         qcclI* call"
    ))
}

/// Polls request `r`: `Ok((done, comm))`, with the operation's error once it is done and
/// failed. The request stays registered until `wait_request`.
pub(crate) fn test_request(r: qcclRequest_t) -> Result<(bool, qcclComm_t)> {
    if r.is_null() {
        return Err(Error::invalid("request is NULL"));
    }
    let mut reqs = lock(&REQUESTS);
    let entry = reqs.get_mut(&(r as usize)).ok_or_else(|| req_not_live(r))?;
    let comm = entry.comm;
    if let ReqState::Fused(slot, _) = &entry.state {
        return slot.test().map(|done| (done, comm));
    }
    if let ReqState::Pending(req) = &mut entry.state {
        if !req.test() {
            return Ok((false, comm));
        }
        let ReqState::Pending(req) = std::mem::replace(&mut entry.state, ReqState::Done(Ok(())))
        else {
            unreachable!()
        };
        // Finished: `wait` returns at once.
        entry.state = ReqState::Done(req.wait());
    }
    match &entry.state {
        ReqState::Done(Err(e)) => Err(e.clone()),
        _ => Ok((true, comm)),
    }
}

/// Removes request `r` and waits for it (outside the registry lock); returns its comm and the
/// operation's result.
pub(crate) fn wait_request(r: qcclRequest_t) -> Result<(qcclComm_t, Result<()>)> {
    if r.is_null() {
        return Err(Error::invalid("request is NULL"));
    }
    let entry = {
        let mut reqs = lock(&REQUESTS);
        let entry = reqs.get(&(r as usize)).ok_or_else(|| req_not_live(r))?;
        if let ReqState::Fused(slot, tensor) = &entry.state {
            if let Some(e) = slot.incomplete(*tensor) {
                // The request stays live, to be waited for once the group is complete.
                return Ok((entry.comm, Err(e)));
            }
        }
        reqs.remove(&(r as usize)).ok_or_else(|| req_not_live(r))?
    };
    let result = match entry.state {
        ReqState::Pending(req) => req.wait(),
        ReqState::Done(res) => res,
        ReqState::Fused(slot, tensor) => slot.wait(tensor),
    };
    Ok((entry.comm, result))
}

/// The comm a request runs on, if the request is live.
pub(crate) fn request_comm(r: qcclRequest_t) -> qcclComm_t {
    lock(&REQUESTS)
        .get(&(r as usize))
        .map_or(std::ptr::null_mut(), |e| e.comm)
}

static CODECS: LazyLock<Mutex<HashMap<usize, Arc<CodecSpec>>>> = LazyLock::new(Default::default);

/// Registers a codec; returns its handle.
pub(crate) fn register_codec(codec: CodecSpec) -> qcclCodec_t {
    let token = next_token();
    lock(&CODECS).insert(token, Arc::new(codec));
    token as qcclCodec_t
}

fn not_live_codec(c: qcclCodec_t) -> Error {
    Error::InvalidUsage(format!(
        "codec {c:p} is not a live codec: it was destroyed, or was never returned by \
         qcclCodecCreate"
    ))
}

/// The live codec behind `c`, or the error for a NULL, destroyed or unknown handle.
pub(crate) fn codec(c: qcclCodec_t) -> Result<Arc<CodecSpec>> {
    if c.is_null() {
        return Err(Error::invalid("codec is NULL"));
    }
    lock(&CODECS)
        .get(&(c as usize))
        .cloned()
        .ok_or_else(|| not_live_codec(c))
}

/// Unregisters `c` (calls already running with it keep their own reference).
pub(crate) fn unregister_codec(c: qcclCodec_t) -> Result<()> {
    if c.is_null() {
        return Err(Error::invalid("codec is NULL"));
    }
    let removed = lock(&CODECS).remove(&(c as usize));
    removed.map(drop).ok_or_else(|| not_live_codec(c))
}
