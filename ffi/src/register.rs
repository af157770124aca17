//! Buffer registration (NCCL's `ncclCommRegister` / `ncclCommDeregister`): `Comm::register`
//! and `Comm::deregister` behind the C ABI. The `void*` handle is the registration's number
//! (`RegHandle::into_raw`) as a pointer value: never dereferenced, and never NULL.

use crate::handle;
use crate::last_error::guard;
use crate::types::*;
use qccl_core::{Error, RegHandle};
use std::ffi::c_void;
use std::ptr::null_mut;

/// Registers `size` bytes at `buff` with `comm` (whole pages, as a NIC pins them) and sets
/// `*handle` for `qcclCommDeregister`. Registering the same pages again returns the same
/// handle, counted: each registration needs its deregistration. Local, not collective.
/// Deregister before freeing the buffer.
///
/// # Safety
/// `handle` is NULL or valid for a write. `buff` is only recorded, never read here.
#[no_mangle]
pub unsafe extern "C" fn qcclCommRegister(
    comm: qcclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> qcclResult_t {
    guard("qcclCommRegister", comm, || {
        if handle.is_null() {
            return Err(Error::invalid("handle is NULL"));
        }
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { handle.write(null_mut()) };
        let h = handle::comm(comm)?;
        if buff.is_null() {
            return Err(Error::invalid(format!(
                "buff is NULL (size {size}); register a live buffer"
            )));
        }
        if size == 0 {
            return Err(Error::invalid("size is 0; register at least one byte"));
        }
        let reg = h.comm.register_raw(buff.cast_const().cast(), size)?;
        let raw = usize::try_from(reg.into_raw())
            .map_err(|_| Error::Internal("registration number overflows a pointer".into()))?;
        // SAFETY: as above.
        unsafe { handle.write(raw as *mut c_void) };
        Ok(())
    })
}

/// Drops one registration made by `qcclCommRegister`; the last one of a buffer releases what
/// links made of it. A handle `comm` did not hand out, or already fully deregistered, is
/// `qcclInvalidArgument`.
#[no_mangle]
pub extern "C" fn qcclCommDeregister(comm: qcclComm_t, handle: *mut c_void) -> qcclResult_t {
    guard("qcclCommDeregister", comm, || {
        let h = handle::comm(comm)?;
        if handle.is_null() {
            return Err(Error::invalid(
                "handle is NULL; pass the handle qcclCommRegister set",
            ));
        }
        h.comm
            .deregister(RegHandle::from_raw(handle as usize as u64))
    })
}
