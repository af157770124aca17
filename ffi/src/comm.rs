//! Version, unique id, comm creation, split, destroy, abort and queries.

use crate::handle;
use crate::last_error::guard;
use crate::nesting::in_group;
use crate::plan;
use crate::types::*;
use qccl_core::{Comm, Config, Error, Result, UniqueId};
use std::ffi::{c_char, c_int, CStr};
use std::ptr::null_mut;

/// Checks an out pointer.
fn out<T>(name: &str, p: *mut T) -> Result<()> {
    if p.is_null() {
        Err(Error::invalid(format!("{name} is NULL")))
    } else {
        Ok(())
    }
}

fn positive(name: &str, v: c_int) -> Result<usize> {
    match usize::try_from(v) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(Error::invalid(format!(
            "{name} is {v}; it must be at least 1"
        ))),
    }
}

/// `*version = QCCL_VERSION_CODE` (major·10000 + minor·100 + patch).
///
/// # Safety
/// `version` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclGetVersion(version: *mut c_int) -> qcclResult_t {
    guard("qcclGetVersion", null_mut(), || {
        out("version", version)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { version.write(QCCL_VERSION_CODE) };
        Ok(())
    })
}

/// Creates a unique id and hosts its rendezvous root in this process (a thread that serves
/// until every rank joined or QCCL_INIT_TIMEOUT_MS passed), like `ncclGetUniqueId`: call it
/// on one rank and send the bytes to the others.
///
/// # Safety
/// `uniqueId` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclGetUniqueId(uniqueId: *mut qcclUniqueId) -> qcclResult_t {
    guard("qcclGetUniqueId", null_mut(), || {
        out("uniqueId", uniqueId)?;
        let id = UniqueId::new()?;
        let mut c = qcclUniqueId {
            internal: [0; QCCL_UNIQUE_ID_BYTES],
        };
        for (d, s) in c.internal.iter_mut().zip(id.as_bytes()) {
            *d = *s as _;
        }
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { uniqueId.write(c) };
        Ok(())
    })
}

/// Joins the comm of `commId` as `rank` of `nranks` (blocks until every rank joined).
///
/// # Safety
/// `comm` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommInitRank(
    comm: *mut qcclComm_t,
    nranks: c_int,
    commId: qcclUniqueId,
    rank: c_int,
) -> qcclResult_t {
    guard("qcclCommInitRank", null_mut(), || {
        out("comm", comm)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { comm.write(null_mut()) };
        let size = positive("nranks", nranks)?;
        let r = match usize::try_from(rank) {
            Ok(r) if r < size => r,
            _ => {
                return Err(Error::invalid(format!(
                    "rank {rank} is out of range for {nranks} ranks (valid: 0..={})",
                    size - 1
                )))
            }
        };
        let bytes: Vec<u8> = commId.internal.iter().map(|&b| b as u8).collect();
        let id = UniqueId::from_bytes(&bytes).map_err(|e| {
            Error::invalid(format!("commId: {e}; pass the bytes qcclGetUniqueId made"))
        })?;
        let config = Config::from_env()?;
        let plan = plan::from_env()?; // a bad plan fails before the rendezvous
        let c = Comm::init(&id, r, size, config)?;
        // SAFETY: as above.
        unsafe { comm.write(handle::register(c, plan)) };
        Ok(())
    })
}

/// `ndev` ranks in this process (threads' comms over the in-process transport), like
/// `ncclCommInitAll`; `devlist` (CUDA devices) is ignored and may be NULL. Drive them from
/// one thread inside a group, or one thread each.
///
/// # Safety
/// `comms` is NULL or valid for `ndev` writes.
#[no_mangle]
pub unsafe extern "C" fn qcclCommInitAll(
    comms: *mut qcclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> qcclResult_t {
    let _ = devlist;
    guard("qcclCommInitAll", null_mut(), || {
        out("comms", comms)?;
        let n = positive("ndev", ndev)?;
        let config = Config::from_env()?;
        let plan = plan::from_env()?;
        let all = Comm::init_threads(n, config)?;
        for (i, c) in all.into_iter().enumerate() {
            // Each comm has its own iteration of the plan.
            let plan = plan.as_ref().map(plan::PlanState::fresh);
            // SAFETY: `comms` holds `ndev` = n slots by the caller's contract; i < n.
            unsafe { comms.add(i).write(handle::register(c, plan)) };
        }
        Ok(())
    })
}

/// Joins the job described by launcher variables: QCCL_RANK/QCCL_WORLD_SIZE/QCCL_COMM_ID,
/// torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), OpenMPI, PMI or Slurm.
///
/// # Safety
/// `comm` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommInitFromEnv(comm: *mut qcclComm_t) -> qcclResult_t {
    guard("qcclCommInitFromEnv", null_mut(), || {
        out("comm", comm)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { comm.write(null_mut()) };
        let plan = plan::from_env()?;
        let c = Comm::from_env()?;
        // SAFETY: as above.
        unsafe { comm.write(handle::register(c, plan)) };
        Ok(())
    })
}

/// Collective over `comm`: ranks with the same `color` form `*newcomm`, ranked by `key`
/// (ties by rank); `QCCL_SPLIT_NOCOLOR` (-1) takes no part and gets NULL.
///
/// # Safety
/// `newcomm` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommSplit(
    comm: qcclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut qcclComm_t,
) -> qcclResult_t {
    guard("qcclCommSplit", comm, || {
        out("newcomm", newcomm)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { newcomm.write(null_mut()) };
        let h = handle::comm(comm)?;
        if color < QCCL_SPLIT_NOCOLOR {
            return Err(Error::invalid(format!(
                "color {color}: a color is >= 0, or QCCL_SPLIT_NOCOLOR (-1)"
            )));
        }
        if in_group() {
            return Err(Error::Unsupported(
                "qcclCommSplit between qcclGroupStart and qcclGroupEnd is not supported; \
                 split from one thread per rank"
                    .into(),
            ));
        }
        if let Some(child) = h.comm.split(color, key)? {
            // SAFETY: as above.
            // QCCL_PLAN_FILE is the initial comms' (the data-parallel gradients); a split
            // comm gets a plan only through qcclCommSetPlan.
            unsafe { newcomm.write(handle::register(child, None)) };
        }
        Ok(())
    })
}

/// The survivors' comm (NCCL's `ncclCommShrink`, MPI ULFM's `MPIX_Comm_shrink`): every rank
/// but `excludeRanks[0..excludeCount]` calls it with the same list, on the comm that failed,
/// before aborting or destroying it; `excludeRanks` NULL: the survivors agree on which ranks
/// are gone. A survivor's new rank is its old rank minus the excluded ranks below it. `comm`
/// is aborted first; destroy it afterwards.
///
/// # Safety
/// `excludeRanks` is NULL or holds `excludeCount` ints; `newcomm` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommShrink(
    comm: qcclComm_t,
    exclude_ranks: *const c_int,
    exclude_count: c_int,
    newcomm: *mut qcclComm_t,
) -> qcclResult_t {
    guard("qcclCommShrink", comm, || {
        out("newcomm", newcomm)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { newcomm.write(null_mut()) };
        let h = handle::comm(comm)?;
        let count = usize::try_from(exclude_count)
            .map_err(|_| Error::invalid(format!("excludeCount is {exclude_count}, below 0")))?;
        if in_group() {
            return Err(Error::Unsupported(
                "qcclCommShrink between qcclGroupStart and qcclGroupEnd is not supported".into(),
            ));
        }
        let child = if exclude_ranks.is_null() {
            if count > 0 {
                return Err(Error::invalid(format!(
                    "excludeRanks is NULL but excludeCount is {count}"
                )));
            }
            h.comm.shrink_failed()?
        } else {
            // SAFETY: non-null, holding `count` ints by the caller's contract.
            let ranks = unsafe { std::slice::from_raw_parts(exclude_ranks, count) };
            let ranks = ranks
                .iter()
                .map(|&r| {
                    usize::try_from(r)
                        .map_err(|_| Error::invalid(format!("excludeRanks holds rank {r}")))
                })
                .collect::<Result<Vec<_>>>()?;
            h.comm.shrink(&ranks)?
        };
        // SAFETY: as above. A shrunk comm gets a fusion plan only through qcclCommSetPlan.
        unsafe { newcomm.write(handle::register(child, None)) };
        Ok(())
    })
}

/// Frees `comm` after its queued operations finished; NULL is a no-op. Later calls with the
/// handle return qcclInvalidUsage.
#[no_mangle]
pub extern "C" fn qcclCommDestroy(comm: qcclComm_t) -> qcclResult_t {
    guard("qcclCommDestroy", comm, || {
        if comm.is_null() {
            return Ok(());
        }
        let h = handle::unregister(comm)?;
        drop(h); // waits for queued operations when this is the last reference
        Ok(())
    })
}

/// Aborts `comm` (running and queued operations fail, peers are told; returns within about
/// a second) and frees it.
#[no_mangle]
pub extern "C" fn qcclCommAbort(comm: qcclComm_t) -> qcclResult_t {
    guard("qcclCommAbort", comm, || {
        if comm.is_null() {
            return Ok(());
        }
        let h = handle::unregister(comm)?;
        h.comm.abort();
        drop(h);
        Ok(())
    })
}

/// `*count` = number of ranks.
///
/// # Safety
/// `count` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommCount(comm: qcclComm_t, count: *mut c_int) -> qcclResult_t {
    guard("qcclCommCount", comm, || {
        out("count", count)?;
        let h = handle::comm(comm)?;
        let n = c_int::try_from(h.comm.size()).map_err(|_| Error::Internal("size".into()))?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { count.write(n) };
        Ok(())
    })
}

/// `*rank` = this rank.
///
/// # Safety
/// `rank` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommUserRank(comm: qcclComm_t, rank: *mut c_int) -> qcclResult_t {
    guard("qcclCommUserRank", comm, || {
        out("rank", rank)?;
        let h = handle::comm(comm)?;
        let r = c_int::try_from(h.comm.rank()).map_err(|_| Error::Internal("rank".into()))?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { rank.write(r) };
        Ok(())
    })
}

/// `*asyncError` = the code of the error that failed the comm, or qcclSuccess.
///
/// # Safety
/// `asyncError` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCommGetAsyncError(
    comm: qcclComm_t,
    asyncError: *mut qcclResult_t,
) -> qcclResult_t {
    guard("qcclCommGetAsyncError", comm, || {
        out("asyncError", asyncError)?;
        let h = handle::comm(comm)?;
        let code = h.comm.async_error().map_or(qcclSuccess, |e| e.code());
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { asyncError.write(code) };
        Ok(())
    })
}

/// Sets `comm`'s fusion plan from the JSON file at `path` (as QCCL_PLAN_FILE does at init);
/// NULL clears it. Local, not collective: every rank sets the same plan at the same point.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn qcclCommSetPlan(comm: qcclComm_t, path: *const c_char) -> qcclResult_t {
    guard("qcclCommSetPlan", comm, || {
        let h = handle::comm(comm)?;
        if in_group() {
            return Err(Error::InvalidUsage(
                "qcclCommSetPlan cannot be called between qcclGroupStart and qcclGroupEnd".into(),
            ));
        }
        let plan = if path.is_null() {
            None
        } else {
            // SAFETY: non-null and NUL-terminated by the caller's contract.
            let p = unsafe { CStr::from_ptr(path) };
            let p = p
                .to_str()
                .map_err(|_| Error::invalid("path is not UTF-8"))?;
            Some(plan::load(p, "plan file")?)
        };
        plan::set(&h, plan);
        Ok(())
    })
}
