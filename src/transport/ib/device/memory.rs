//! Registered memory (`ibv_reg_mr`): the contract's `Region`.

use super::handles::{MrHandle, PdHandle};
use crate::error::{Error, Result};
use crate::transport::ib::verbs::Region;
use ibverbs_sys as ffi;
use memmap2::MmapMut;
use std::sync::Arc;

/// A registration, over memory it owns (`alloc`) or the caller's (`register`).
pub(super) struct VerbsRegion {
    // Declared first: deregistered before the memory below is unmapped.
    mr: MrHandle,
    ptr: *mut u8,
    len: usize,
    _owned: Option<MmapMut>,
}

// SAFETY: the region is a registration plus an address; libibverbs objects are thread safe
// and the contract says the bytes are only read through raw pointers.
unsafe impl Send for VerbsRegion {}
// SAFETY: as for Send; nothing here is mutated through &self.
unsafe impl Sync for VerbsRegion {}

/// Local and remote writes: the slots.
const SLOT_ACCESS: i32 = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
    | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0) as i32;
/// Local reads only (no flag): the sources of zero-copy writes, which may be read-only pages.
const SOURCE_ACCESS: i32 = 0;

/// Registers `addr..addr+len` on `pd` with `access`.
///
/// # Safety
/// The range must stay allocated until the returned handle is dropped.
unsafe fn reg_mr(
    name: &str,
    pd: &Arc<PdHandle>,
    addr: *mut u8,
    len: usize,
    access: i32,
) -> Result<MrHandle> {
    // SAFETY: `pd` is live; the range is allocated for the handle's life (caller's promise).
    let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr.cast(), len, access) };
    if mr.is_null() {
        return Err(Error::io(
            format!("registering {len} bytes on {name} (ibv_reg_mr)"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(MrHandle::new(mr, pd.clone()))
}

fn check_len(name: &str, len: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid(format!(
            "a memory region on {name} needs at least one byte (asked for 0)"
        )));
    }
    Ok(())
}

impl VerbsRegion {
    /// `len` zeroed bytes from an anonymous mapping (page-aligned), registered.
    pub(super) fn alloc(name: &str, pd: &Arc<PdHandle>, len: usize) -> Result<VerbsRegion> {
        check_len(name, len)?;
        let mut mem = MmapMut::map_anon(len)
            .map_err(|e| Error::io(format!("allocating {len} bytes for {name}"), e))?;
        let ptr = mem.as_mut_ptr();
        // SAFETY: the mapping is owned by the region and unmapped after the registration
        // (field order).
        let mr = unsafe { reg_mr(name, pd, ptr, len, SLOT_ACCESS)? };
        Ok(VerbsRegion {
            mr,
            ptr,
            len,
            _owned: Some(mem),
        })
    }

    /// Registers the caller's memory as a source of writes.
    ///
    /// # Safety
    /// `addr..addr+len` stays allocated until the region and its queue pairs are dropped.
    pub(super) unsafe fn register(
        name: &str,
        pd: &Arc<PdHandle>,
        addr: *mut u8,
        len: usize,
    ) -> Result<VerbsRegion> {
        check_len(name, len)?;
        if addr.is_null() {
            return Err(Error::invalid(format!(
                "cannot register a null address on {name}"
            )));
        }
        // SAFETY: the caller's promise, passed on.
        let mr = unsafe { reg_mr(name, pd, addr, len, SOURCE_ACCESS)? };
        Ok(VerbsRegion {
            mr,
            ptr: addr,
            len,
            _owned: None,
        })
    }
}

impl Region for VerbsRegion {
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}
