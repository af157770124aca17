//! Compression entry points. Their signatures are final; the codecs (issue #4) and
//! HiTopKComm (issue #7) are not built yet, so after checking their arguments they return
//! `qcclUnsupported`.

use crate::coll::no_stream;
use crate::group::guard_op;
use crate::handle;
use crate::last_error::guard;
use crate::types::*;
use qccl_core::{DType, Error, ReduceOp, Result};
use std::ffi::{c_char, c_float, c_int, c_void};
use std::ptr::null_mut;

const NO_CODECS: &str = "compression codecs are not built yet";
const NO_HITOPK: &str = "HiTopKComm is not built yet";

fn non_null<T>(name: &str, p: *const T) -> Result<()> {
    if p.is_null() {
        Err(Error::invalid(format!("{name} is NULL")))
    } else {
        Ok(())
    }
}

/// The arguments a compressed all-reduce shares with `qcclAllReduce`.
fn check_buffers(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
) -> Result<DType> {
    let dtype = DType::from_i32(datatype)?;
    crate::buf::RawBuf::new("recvbuff", recvbuff, count, dtype.size(), 1)?;
    crate::buf::RawBuf::new("sendbuff", sendbuff, count, dtype.size(), 1)?;
    Ok(dtype)
}

/// Creates a codec from a spec such as "qsgd:bits=4,bucket=128" or "topk:density=0.01,ef=1".
/// Not built yet: qcclUnsupported, `*codec = NULL`.
///
/// # Safety
/// `spec` is NULL or a NUL-terminated string; `codec` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn qcclCodecCreate(
    spec: *const c_char,
    codec: *mut qcclCodec_t,
) -> qcclResult_t {
    guard("qcclCodecCreate", null_mut(), || {
        non_null("codec", codec)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { codec.write(null_mut()) };
        non_null("spec", spec)?;
        Err(Error::Unsupported(NO_CODECS.into()))
    })
}

/// Frees a codec. No codec can exist yet: qcclUnsupported.
#[no_mangle]
pub extern "C" fn qcclCodecDestroy(codec: qcclCodec_t) -> qcclResult_t {
    guard("qcclCodecDestroy", null_mut(), || {
        non_null("codec", codec)?;
        Err(Error::Unsupported(NO_CODECS.into()))
    })
}

/// All-reduce with `codec` applied where data leaves and enters each rank; `tensorKey`
/// identifies the tensor across calls (error-feedback state). Not built yet.
///
/// # Safety
/// As `qcclAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclAllReduceCompressed(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    codec: qcclCodec_t,
    tensorKey: u64,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    let _ = tensorKey;
    guard_op("qcclAllReduceCompressed", comm, || {
        handle::comm(comm)?;
        no_stream(stream)?;
        let dtype = check_buffers(sendbuff, recvbuff, count, datatype)?;
        ReduceOp::from_i32(op)?.check_dtype(dtype)?;
        non_null("codec", codec)?;
        Err(Error::Unsupported(NO_CODECS.into()))
    })
}

/// Non-blocking `qcclAllReduceCompressed`. Not built yet: qcclUnsupported, `*request = NULL`.
///
/// # Safety
/// As `qcclIAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclIAllReduceCompressed(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    op: qcclRedOp_t,
    codec: qcclCodec_t,
    tensorKey: u64,
    comm: qcclComm_t,
    request: *mut qcclRequest_t,
) -> qcclResult_t {
    let _ = tensorKey;
    guard("qcclIAllReduceCompressed", comm, || {
        non_null("request", request)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { request.write(null_mut()) };
        handle::comm(comm)?;
        let dtype = check_buffers(sendbuff, recvbuff, count, datatype)?;
        ReduceOp::from_i32(op)?.check_dtype(dtype)?;
        non_null("codec", codec)?;
        Err(Error::Unsupported(NO_CODECS.into()))
    })
}

/// HiTopKComm all-reduce (intra-host reduce-scatter, MSTopK at `density`, inter-host sparse
/// all-gather, intra-host all-gather). Not built yet.
///
/// # Safety
/// As `qcclAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn qcclHiTopKAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: qcclDataType_t,
    density: c_float,
    tensorKey: u64,
    comm: qcclComm_t,
    stream: qcclStream_t,
) -> qcclResult_t {
    let _ = tensorKey;
    guard_op("qcclHiTopKAllReduce", comm, || {
        handle::comm(comm)?;
        no_stream(stream)?;
        let dtype = check_buffers(sendbuff, recvbuff, count, datatype)?;
        if !dtype.is_float() {
            return Err(Error::invalid(format!(
                "HiTopK needs a floating-point datatype, got {dtype}"
            )));
        }
        if !(density > 0.0 && density <= 1.0) {
            return Err(Error::invalid(format!(
                "density {density} is outside (0, 1]"
            )));
        }
        Err(Error::Unsupported(NO_HITOPK.into()))
    })
}

/// Registers the layer layout of fused buffers (`nlayers` names and element counts) for
/// per-layer compression. Not built yet.
///
/// # Safety
/// `names` and `counts` are NULL or hold `nlayers` entries; each name NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn qcclCommSetLayout(
    comm: qcclComm_t,
    nlayers: c_int,
    names: *const *const c_char,
    counts: *const usize,
) -> qcclResult_t {
    guard("qcclCommSetLayout", comm, || {
        handle::comm(comm)?;
        let n = usize::try_from(nlayers)
            .map_err(|_| Error::invalid(format!("nlayers is {nlayers}; it must be >= 0")))?;
        if n > 0 {
            non_null("names", names)?;
            non_null("counts", counts)?;
            for i in 0..n {
                // SAFETY: `names` holds `nlayers` entries by the caller's contract; i < n.
                let name = unsafe { names.add(i).read() };
                if name.is_null() {
                    return Err(Error::invalid(format!("names[{i}] is NULL")));
                }
            }
        }
        Err(Error::Unsupported(NO_CODECS.into()))
    })
}

/// Keeps layers whose name matches `pattern` (e.g. "bias|norm") in full precision. Not built
/// yet.
///
/// # Safety
/// `pattern` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn qcclCommExcludeLayers(
    comm: qcclComm_t,
    pattern: *const c_char,
) -> qcclResult_t {
    guard("qcclCommExcludeLayers", comm, || {
        handle::comm(comm)?;
        non_null("pattern", pattern)?;
        Err(Error::Unsupported(NO_CODECS.into()))
    })
}
