//! Compression entry points: codecs from spec strings, compressed all-reduce (blocking,
//! grouped, non-blocking), layouts, and the HiTopKComm all-reduce.

use crate::coll::{start, Started};
use crate::device::launch_on;
use crate::group::guard_op;
use crate::handle;
use crate::last_error::guard;
use crate::op::Op;
use crate::types::*;
use qccl_core::{CodecSpec, Compression, Error, Layout, Result};
use std::ffi::CStr;
use std::ffi::{c_char, c_float, c_int, c_void};
use std::ptr::null_mut;

fn non_null<T>(name: &str, p: *const T) -> Result<()> {
    if p.is_null() {
        Err(Error::invalid(format!("{name} is NULL")))
    } else {
        Ok(())
    }
}

/// A NUL-terminated C string as UTF-8.
///
/// # Safety
/// `p` is non-null and NUL-terminated.
unsafe fn text<'a>(name: &str, p: *const c_char) -> Result<&'a str> {
    non_null(name, p)?;
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::invalid(format!("{name} is not valid UTF-8")))
}

/// Creates a codec from a spec such as "qsgd:bits=4,bucket=128" or "topk:density=0.01,ef=1";
/// a bad spec is qcclInvalidArgument with the bad field named in `qcclGetLastError(NULL)`.
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
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let spec = CodecSpec::parse(unsafe { text("spec", spec) }?)?;
        // SAFETY: as above.
        unsafe { codec.write(handle::register_codec(spec)) };
        Ok(())
    })
}

/// Frees a codec. Calls already running with it are unaffected.
#[no_mangle]
pub extern "C" fn qcclCodecDestroy(codec: qcclCodec_t) -> qcclResult_t {
    guard("qcclCodecDestroy", null_mut(), || {
        handle::unregister_codec(codec)
    })
}

/// The call's compression: the codec, keyed by `tensorKey` (error-feedback residual and
/// layout), on the comm's default schedule.
fn compression(codec: qcclCodec_t, tensor_key: u64) -> Result<Compression> {
    let spec = handle::codec(codec)?;
    Ok(Compression::new((*spec).clone()).key(tensor_key))
}

/// All-reduce with `codec` applied where data leaves and enters each rank; `tensorKey`
/// identifies the tensor across calls (error-feedback residual). Float types, sum or avg; in
/// place when `sendbuff == recvbuff`; every rank ends bit-identical.
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
    guard_op("qcclAllReduceCompressed", comm, || {
        let h = handle::comm(comm)?;
        let c = compression(codec, tensorKey)?;
        let op = Op::all_reduce_compressed(&h.comm, sendbuff, recvbuff, count, datatype, op, &c)?;
        launch_on(comm, h, op, stream)
    })
}

/// Non-blocking `qcclAllReduceCompressed`; `*request` completes with `qcclWait`.
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
    guard("qcclIAllReduceCompressed", comm, || {
        // SAFETY: `request` per this function's contract.
        unsafe {
            start(comm, request, |h| {
                let comp = compression(codec, tensorKey)?;
                Op::all_reduce_compressed(&h.comm, sendbuff, recvbuff, count, datatype, op, &comp)
                    .map(Started::Op)
            })
        }
    })
}

/// HiTopKComm all-reduce (sum): intra-host reduce-scatter, MSTopK at `density` on each rank's
/// slice, inter-host all-gather of (index, value) pairs with scatter-add, intra-host
/// all-gather; error feedback on the top-k residual keyed by `tensorKey`. Float types; in place
/// when `sendbuff == recvbuff`; every rank ends bit-identical.
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
    guard_op("qcclHiTopKAllReduce", comm, || {
        let h = handle::comm(comm)?;
        // Checked as qcclAllReduce's, then by the core's top-k rules (dtype, density).
        let op = Op::hitopk(
            &h.comm,
            sendbuff,
            recvbuff,
            count,
            datatype,
            density as f64,
            tensorKey,
        )?;
        launch_on(comm, h, op, stream)
    })
}

/// Registers the layer layout of fused buffers (`nlayers` names and element counts): a
/// compressed all-reduce whose count equals the layout's total compresses each layer on its
/// own, keeping excluded and small layers (QCCL_COMPRESSION_MINIMAL_SIZE) in full precision.
/// `nlayers == 0` removes the layout. Local: every rank registers the same layout.
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
        let h = handle::comm(comm)?;
        let n = usize::try_from(nlayers)
            .map_err(|_| Error::invalid(format!("nlayers is {nlayers}; it must be >= 0")))?;
        if n == 0 {
            return h.comm.set_default_layout(None);
        }
        non_null("names", names)?;
        non_null("counts", counts)?;
        let mut layers = Vec::with_capacity(n);
        let mut total: usize = 0;
        for i in 0..n {
            // SAFETY: `names` and `counts` hold `nlayers` entries by the caller's contract.
            let (name, count) = unsafe { (names.add(i).read(), counts.add(i).read()) };
            if name.is_null() {
                return Err(Error::invalid(format!("names[{i}] is NULL")));
            }
            // SAFETY: non-null and NUL-terminated by the caller's contract.
            let name = unsafe { text(&format!("names[{i}]"), name) }?;
            total = total
                .checked_add(count)
                .ok_or_else(|| Error::invalid("the layer counts overflow size_t"))?;
            layers.push((name.to_string(), count));
        }
        h.comm.set_default_layout(Some(Layout::new(layers)))
    })
}

/// Keeps layers whose name contains one of the `|`- or `,`-separated patterns (e.g.
/// "bias|norm") in full precision; replaces QCCL_COMPRESSION_EXCLUDE for this comm. An empty
/// pattern excludes nothing.
///
/// # Safety
/// `pattern` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn qcclCommExcludeLayers(
    comm: qcclComm_t,
    pattern: *const c_char,
) -> qcclResult_t {
    guard("qcclCommExcludeLayers", comm, || {
        let h = handle::comm(comm)?;
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let pattern = unsafe { text("pattern", pattern) }?;
        let list = pattern
            .split(['|', ','])
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        h.comm.set_exclude_patterns(list);
        Ok(())
    })
}
