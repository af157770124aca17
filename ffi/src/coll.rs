//! Collective and point-to-point entry points, blocking and non-blocking, and
//! `qcclTest` / `qcclWait`.

use crate::device::launch_on;
use crate::group::{guard_op, hold, launch};
use crate::handle::{self, CommHandle, ReqState};
use crate::last_error::{guard, no_panic};
use crate::nesting::in_group;
use crate::op::{AllReduceArgs, Op};
use crate::plan::{self, GroupSlot, Mode, Routed};
use crate::types::*;
use qccl_core::internal::Coll;
use qccl_core::{Error, Result};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

macro_rules! blocking {
    ($name:literal, $comm:ident, $stream:ident, |$c:ident| $make:expr) => {
        guard_op($name, $comm, || {
            let h = handle::comm($comm)?;
            let op = {
                let $c = &h.comm;
                $make?
            };
            launch_on($comm, h, op, $stream)
        })
    };
}

/// `recvbuff[i] = op over ranks of sendbuff[i]`; in place when `sendbuff == recvbuff`.
///
/// # Safety
/// `sendbuff` and `recvbuff` hold `count` elements of `datatype` (or are unused when count
/// is 0) and stay valid until the call completes (`qcclGroupEnd` inside a group).
#[no_mangle]
pub unsafe extern "C" fn qcclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    guard_op("qcclAllReduce", comm, || {
        let h = handle::comm(comm)?;
        let a = AllReduceArgs::new(&h.comm, sendbuff, recvbuff, count, datatype, op)?;
        if !stream.is_null() || h.comm.device_buffers(&a.call_bufs())? {
            // Device memory or a stream: staged as one plain all-reduce (fusion plans group
            // host tensors).
            let op = Op::all_reduce(&h.comm, a)?;
            return launch_on(comm, h, op, stream);
        }
        let mode = if in_group() {
            Mode::Grouped
        } else {
            Mode::Blocking
        };
        match plan::route(&h, mode, a.send, a.recv, a.dtype, a.op)? {
            Routed::Plain => {
                let op = Op::all_reduce(&h.comm, a)?;
                launch(comm, h, op)
            }
            Routed::Run(op) => launch(comm, h, op),
            Routed::Held => {
                hold(comm, h);
                Ok(())
            }
            Routed::Request(..) => Err(Error::Internal("a request for a blocking call".into())),
        }
    })
}

/// Root's `sendbuff` lands in every rank's `recvbuff` (in place when they are equal on the
/// root; `sendbuff` is ignored elsewhere).
///
/// # Safety
/// As `qcclAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    root: c_int,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclBroadcast", comm, stream, |c| Op::coll(
        c,
        Coll::Broadcast,
        sendbuff,
        recvbuff,
        count,
        datatype,
        qcclSum,
        root
    ))
}

/// Root's `recvbuff[i] = op over ranks of sendbuff[i]`; `recvbuff` is ignored (may be NULL)
/// on other ranks; in place when `sendbuff == recvbuff`.
///
/// # Safety
/// As `qcclAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    root: c_int,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclReduce", comm, stream, |c| Op::coll(
        c,
        Coll::Reduce,
        sendbuff,
        recvbuff,
        count,
        datatype,
        op,
        root
    ))
}

/// Every rank's `sendcount` elements land at part `rank` of `recvbuff` (nranks·sendcount);
/// in place when `sendbuff == recvbuff + rank·sendcount`.
///
/// # Safety
/// As `qcclAllReduce`, with `recvbuff` holding nranks·sendcount elements.
#[no_mangle]
pub unsafe extern "C" fn qcclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: qcclDataType_t,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclAllGather", comm, stream, |c| Op::coll(
        c,
        Coll::AllGather,
        sendbuff,
        recvbuff,
        sendcount,
        datatype,
        qcclSum,
        0
    ))
}

/// Part `rank` (recvcount elements) of the reduction of every rank's `sendbuff`
/// (nranks·recvcount); in place when `recvbuff == sendbuff + rank·recvcount`.
///
/// # Safety
/// As `qcclAllReduce`, with `sendbuff` holding nranks·recvcount elements.
#[no_mangle]
pub unsafe extern "C" fn qcclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclReduceScatter", comm, stream, |c| Op::coll(
        c,
        Coll::ReduceScatter,
        sendbuff,
        recvbuff,
        recvcount,
        datatype,
        op,
        0
    ))
}

/// Part p (`count` elements) of `sendbuff` goes to rank p; part q of `recvbuff` comes from
/// rank q (both nranks·count); in place when `sendbuff == recvbuff`.
///
/// # Safety
/// As `qcclAllReduce`, both buffers holding nranks·count elements.
#[no_mangle]
pub unsafe extern "C" fn qcclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclAlltoAll", comm, stream, |c| Op::coll(
        c,
        Coll::AllToAll,
        sendbuff,
        recvbuff,
        count,
        datatype,
        qcclSum,
        0
    ))
}

/// Sends `count` elements to `peer`, which calls a matching `qcclRecv`.
///
/// # Safety
/// `sendbuff` holds `count` elements and stays valid until the call completes.
#[no_mangle]
pub unsafe extern "C" fn qcclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: qcclDataType_t,
    peer: c_int,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclSend", comm, stream, |c| Op::coll(
        c,
        Coll::Send,
        sendbuff,
        std::ptr::null_mut(),
        count,
        datatype,
        qcclSum,
        peer
    ))
}

/// Receives `count` elements from `peer`, which calls a matching `qcclSend`.
///
/// # Safety
/// `recvbuff` holds `count` elements and stays valid until the call completes.
#[no_mangle]
pub unsafe extern "C" fn qcclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    peer: c_int,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    blocking!("qcclRecv", comm, stream, |c| Op::coll(
        c,
        Coll::Recv,
        std::ptr::null(),
        recvbuff,
        count,
        datatype,
        qcclSum,
        peer
    ))
}

// ---- non-blocking -------------------------------------------------------------------------

/// Checks the out pointer, clears it, checks the comm, builds the op and queues it on the
/// comm's worker; the request goes to `*request`.
///
/// # Safety
/// `request` is NULL or valid for a write.
pub(crate) unsafe fn start(
    comm: qcclComm_t,
    request: *mut qcclRequest_t,
    make: impl FnOnce(&CommHandle) -> Result<Started>,
) -> Result<()> {
    if request.is_null() {
        return Err(Error::invalid("request is NULL"));
    }
    // SAFETY: non-null, and valid for a write by the caller's contract.
    unsafe { request.write(std::ptr::null_mut()) };
    let h = handle::comm(comm)?;
    if in_group() {
        return Err(Error::InvalidUsage(
            "non-blocking calls cannot be made between qcclGroupStart and qcclGroupEnd".into(),
        ));
    }
    let state = match make(&h)? {
        Started::Op(op) => {
            if h.comm.device_buffers(&op.call_bufs())? {
                // SAFETY: the caller's contract (qccl.h): the buffers stay valid until
                // qcclWait returns, which is after the request ended.
                ReqState::Pending(unsafe { crate::device::submit_on_device(&h, op)? })
            } else {
                ReqState::Pending(h.comm.submit(move |e| no_panic(|| op.run(e)))?)
            }
        }
        Started::Fused(slot, tensor) => ReqState::Fused(slot, tensor),
    };
    // SAFETY: as above.
    unsafe { request.write(handle::register_request(state, comm)) };
    Ok(())
}

/// What a non-blocking call starts: an operation to queue, or a tensor of a fusion plan.
pub(crate) enum Started {
    Op(Op),
    Fused(Arc<GroupSlot>, usize),
}

/// Starts an all-reduce (as `qcclAllReduce`); `*request` completes with `qcclWait`. The
/// buffers must stay valid and untouched until then.
///
/// # Safety
/// As `qcclAllReduce` until `qcclWait` returns; `request` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclIAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    comm: qcclComm_t,
    request: *mut qcclRequest_t,
) -> qcclResult_t {
    guard("qcclIAllReduce", comm, || {
        // SAFETY: `request` per this function's contract.
        unsafe {
            start(comm, request, |h| {
                let a = AllReduceArgs::new(&h.comm, sendbuff, recvbuff, count, datatype, op)?;
                if h.comm.device_buffers(&a.call_bufs())? {
                    // Device memory: staged as one plain all-reduce (fusion plans group host
                    // tensors), as the blocking call does.
                    return Op::all_reduce(&h.comm, a).map(Started::Op);
                }
                match plan::route(h, Mode::NonBlocking, a.send, a.recv, a.dtype, a.op)? {
                    Routed::Plain => Op::all_reduce(&h.comm, a).map(Started::Op),
                    Routed::Request(slot, tensor) => Ok(Started::Fused(slot, tensor)),
                    Routed::Run(_) | Routed::Held => {
                        Err(Error::Internal("a fusion group without a request".into()))
                    }
                }
            })
        }
    })
}

/// Starts a reduce-scatter (as `qcclReduceScatter`).
///
/// # Safety
/// As `qcclIAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclIReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    comm: qcclComm_t,
    request: *mut qcclRequest_t,
) -> qcclResult_t {
    guard("qcclIReduceScatter", comm, || {
        // SAFETY: `request` per this function's contract.
        unsafe {
            start(comm, request, |h| {
                let c = Coll::ReduceScatter;
                Op::coll(&h.comm, c, sendbuff, recvbuff, recvcount, datatype, op, 0)
                    .map(Started::Op)
            })
        }
    })
}

/// Starts an all-gather (as `qcclAllGather`).
///
/// # Safety
/// As `qcclIAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclIAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: qcclDataType_t,
    comm: qcclComm_t,
    request: *mut qcclRequest_t,
) -> qcclResult_t {
    guard("qcclIAllGather", comm, || {
        // SAFETY: `request` per this function's contract.
        unsafe {
            start(comm, request, |h| {
                let c = Coll::AllGather;
                Op::coll(
                    &h.comm, c, sendbuff, recvbuff, sendcount, datatype, qcclSum, 0,
                )
                .map(Started::Op)
            })
        }
    })
}

/// `*done = 1` when the request's operation has finished (then its error, if it failed, is
/// returned here too); the request stays valid until `qcclWait`.
///
/// # Safety
/// `done` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclTest(request: qcclRequest_t, done: *mut c_int) -> qcclResult_t {
    let comm = handle::request_comm(request);
    guard("qcclTest", comm, || {
        if done.is_null() {
            return Err(Error::invalid("done is NULL"));
        }
        // SAFETY: non-null, valid for a write by the caller's contract.
        unsafe { done.write(0) };
        let (finished, _) = match handle::test_request(request) {
            Ok(r) => r,
            Err(e) => {
                // A failed operation is finished too.
                if !request.is_null() && !comm.is_null() {
                    // SAFETY: as above.
                    unsafe { done.write(1) };
                }
                return Err(e);
            }
        };
        // SAFETY: as above.
        unsafe { done.write(c_int::from(finished)) };
        Ok(())
    })
}

/// Waits for the request's operation and frees the request; returns the operation's result.
#[no_mangle]
pub extern "C" fn qcclWait(request: qcclRequest_t) -> qcclResult_t {
    let comm = handle::request_comm(request);
    guard("qcclWait", comm, || handle::wait_request(request)?.1)
}
