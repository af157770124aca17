//! Where a pointer lives (`cuPointerGetAttribute`), and the two kinds of memory the driver
//! hands out: page-locked host memory (`cuMemHostAlloc`) and device memory (`cuMemAlloc`).

use super::call::{check, failed};
use super::context::Context;
use crate::error::{Error, Result};
use crate::gpu::driver::{DeviceMem, Memory, Pinned};
use cudarc::driver::sys::{self, CUpointer_attribute as Attr, CUresult};
use std::sync::Arc;

/// Pinned memory flags: usable from every context (PORTABLE) and mapped into the device's
/// address space (DEVICEMAP). Never WRITECOMBINED: the CPU reads the staged bytes, and reads
/// of write-combined memory are uncached and slow.
pub(super) const PINNED_FLAGS: u32 = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;

/// The contract's `Memory` for a `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` value: `Some(true)` for
/// memory of a device (whose ordinal is asked next), `Some(false)` for host memory, `None`
/// for a value this build does not know.
pub(super) fn is_device_memory(memory_type: u32) -> Option<bool> {
    const HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
    const DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    const ARRAY: u32 = sys::CUmemorytype::CU_MEMORYTYPE_ARRAY as u32;
    const UNIFIED: u32 = sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;
    match memory_type {
        HOST => Some(false),
        DEVICE | ARRAY | UNIFIED => Some(true),
        _ => None,
    }
}

/// One attribute of `addr` (`cuPointerGetAttribute`), or `None` when the driver does not know
/// the address (`CUDA_ERROR_INVALID_VALUE`: pageable host memory, or nothing at all). A
/// context must be current.
///
/// # Safety
/// `T` must be the attribute's documented type (unsigned int, int, CUdeviceptr, size_t).
unsafe fn attribute<T: Default>(addr: u64, attr: Attr) -> Result<Option<T>> {
    let mut value = T::default();
    // SAFETY: `value` is a valid, writable T, the type the driver writes for `attr` (the
    // caller's promise); the address is only looked up, never dereferenced.
    let r = unsafe { sys::cuPointerGetAttribute((&mut value as *mut T).cast(), attr, addr) };
    match r {
        CUresult::CUDA_SUCCESS => Ok(Some(value)),
        CUresult::CUDA_ERROR_INVALID_VALUE => Ok(None),
        r => Err(failed(
            r,
            "cuPointerGetAttribute",
            format!("looking up address {addr:#x} ({attr:?})"),
        )),
    }
}

/// Where `addr` lives. A context must be current.
pub(super) fn locate(addr: u64) -> Result<Memory> {
    // SAFETY: MEMORY_TYPE is an unsigned int (CUmemorytype).
    let Some(memory_type) =
        (unsafe { attribute::<u32>(addr, Attr::CU_POINTER_ATTRIBUTE_MEMORY_TYPE)? })
    else {
        return Ok(Memory::Host);
    };
    match is_device_memory(memory_type) {
        Some(false) => Ok(Memory::Host),
        Some(true) => {
            // SAFETY: DEVICE_ORDINAL is an int.
            let ordinal =
                unsafe { attribute::<i32>(addr, Attr::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)? };
            match ordinal.map(usize::try_from) {
                Some(Ok(ordinal)) => Ok(Memory::Device { ordinal }),
                _ => Err(Error::System(format!(
                    "the CUDA driver says address {addr:#x} is device memory but names no \
                     device ordinal for it (cuPointerGetAttribute DEVICE_ORDINAL: {ordinal:?})"
                ))),
            }
        }
        None => Err(Error::System(format!(
            "the CUDA driver reports memory type {memory_type} for address {addr:#x}, \
             which qccl does not know (cuPointerGetAttribute MEMORY_TYPE)"
        ))),
    }
}

/// `Ok` when `addr..addr+len` lies inside one allocation of device `ordinal`, so that a copy
/// cannot fault on the device (an illegal address would poison the context for the whole
/// process). A context must be current.
pub(super) fn check_device_range(ordinal: usize, addr: u64, len: usize) -> Result<()> {
    let what = || format!("{len} bytes at address {addr:#x}");
    match locate(addr)? {
        Memory::Device { ordinal: o } if o == ordinal => {}
        Memory::Device { ordinal: o } => {
            return Err(Error::invalid(format!(
                "{} are memory of CUDA device {o}, not of device {ordinal} (the stream's)",
                what()
            )))
        }
        Memory::Host => {
            return Err(Error::invalid(format!(
                "{} are not device memory (host memory, or unknown to the CUDA driver)",
                what()
            )))
        }
    }
    // SAFETY: RANGE_START_ADDR is a CUdeviceptr, RANGE_SIZE a size_t.
    let start = unsafe { attribute::<u64>(addr, Attr::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)? };
    // SAFETY: as above.
    let size = unsafe { attribute::<usize>(addr, Attr::CU_POINTER_ATTRIBUTE_RANGE_SIZE)? };
    match (start, size) {
        (Some(start), Some(size)) => within(addr, len, start, size as u64),
        _ => Err(Error::System(format!(
            "the CUDA driver gives no allocation range for device address {addr:#x} \
             (cuPointerGetAttribute RANGE_START_ADDR/RANGE_SIZE)"
        ))),
    }
}

/// `Ok` when `addr..addr+len` lies inside the allocation `start..start+size`.
pub(super) fn within(addr: u64, len: usize, start: u64, size: u64) -> Result<()> {
    let end = addr.checked_add(len as u64);
    let alloc_end = start.saturating_add(size);
    match end {
        Some(end) if addr >= start && end <= alloc_end => Ok(()),
        _ => Err(Error::invalid(format!(
            "{len} bytes at device address {addr:#x} run past their allocation \
             ({start:#x}, {size} bytes)"
        ))),
    }
}

/// The contract's lengths: at least one byte.
fn check_len(len: usize, what: &str) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid(format!(
            "{what} needs at least one byte (asked for 0)"
        )));
    }
    Ok(())
}

/// Page-locked host memory from `cuMemHostAlloc`, freed with `cuMemFreeHost`.
pub(super) struct CudaPinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the block is plain host memory owned by this value (freed once, in Drop, from any
// thread: cuMemFreeHost is thread safe with the context current); the contract's users only
// reach the bytes through the raw pointer.
unsafe impl Send for CudaPinned {}

impl CudaPinned {
    /// `len` bytes, allocated in `ctx` (portable: usable from every context).
    pub(super) fn alloc(ctx: Arc<Context>, len: usize) -> Result<CudaPinned> {
        check_len(len, "pinned host memory")?;
        let _current = ctx.enter()?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the block is freed in Drop.
        let r = unsafe { sys::cuMemHostAlloc(&mut ptr, len, PINNED_FLAGS) };
        check(r, "cuMemHostAlloc", || {
            format!("allocating {len} bytes of pinned host memory")
        })?;
        Ok(CudaPinned {
            ptr: ptr.cast(),
            len,
            ctx,
        })
    }
}

impl Pinned for CudaPinned {
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaPinned {
    fn drop(&mut self) {
        let freed = self.ctx.enter().and_then(|_current| {
            // SAFETY: allocated by cuMemHostAlloc and freed once, here; the contract makes
            // any stream still using it the caller's bug.
            let r = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
            check(r, "cuMemFreeHost", || {
                format!(
                    "freeing {} bytes of pinned memory at {:p}",
                    self.len, self.ptr
                )
            })
        });
        if let Err(e) = freed {
            crate::qlog!(Warn, "{e}");
        }
    }
}

/// Device memory from `cuMemAlloc` (not the stream-ordered pool, so CUDA IPC can share it),
/// freed with `cuMemFree`.
pub(super) struct CudaDeviceMem {
    addr: u64,
    len: usize,
    ctx: Arc<Context>,
}

impl CudaDeviceMem {
    /// `len` bytes on `ctx`'s device.
    pub(super) fn alloc(ctx: Arc<Context>, len: usize) -> Result<CudaDeviceMem> {
        check_len(len, "device memory")?;
        let _current = ctx.enter()?;
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-pointer; the allocation is freed in Drop.
        let r = unsafe { sys::cuMemAlloc_v2(&mut addr, len) };
        check(r, "cuMemAlloc", || {
            format!("allocating {len} bytes on CUDA device {}", ctx.ordinal())
        })?;
        Ok(CudaDeviceMem { addr, len, ctx })
    }
}

impl DeviceMem for CudaDeviceMem {
    fn addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
}

impl Drop for CudaDeviceMem {
    fn drop(&mut self) {
        let freed = self.ctx.enter().and_then(|_current| {
            // SAFETY: allocated by cuMemAlloc in this context and freed once, here.
            let r = unsafe { sys::cuMemFree_v2(self.addr) };
            check(r, "cuMemFree", || {
                format!(
                    "freeing {} bytes at device address {:#x} on CUDA device {}",
                    self.len,
                    self.addr,
                    self.ctx.ordinal()
                )
            })
        });
        if let Err(e) = freed {
            crate::qlog!(Warn, "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_memory_is_portable_and_mapped_never_write_combined() {
        assert_eq!(PINNED_FLAGS, 0x1 | 0x2);
        assert_eq!(PINNED_FLAGS & sys::CU_MEMHOSTALLOC_WRITECOMBINED, 0);
    }

    #[test]
    fn memory_types_map_to_host_or_device() {
        assert_eq!(is_device_memory(1), Some(false)); // CU_MEMORYTYPE_HOST
        assert_eq!(is_device_memory(2), Some(true)); // CU_MEMORYTYPE_DEVICE
        assert_eq!(is_device_memory(3), Some(true)); // CU_MEMORYTYPE_ARRAY
        assert_eq!(is_device_memory(4), Some(true)); // CU_MEMORYTYPE_UNIFIED
        assert_eq!(is_device_memory(0), None);
        assert_eq!(is_device_memory(5), None);
    }

    #[test]
    fn ranges_must_lie_inside_their_allocation() {
        let (start, size) = (0x1000, 256);
        assert_eq!(within(0x1000, 256, start, size), Ok(()));
        assert_eq!(within(0x10ff, 1, start, size), Ok(()));
        assert_eq!(within(0x1080, 0, start, size), Ok(()));
        let past = within(0x10ff, 2, start, size).unwrap_err();
        assert!(matches!(past, Error::InvalidArgument(_)), "{past}");
        let msg = past.to_string();
        assert!(msg.contains("0x10ff") && msg.contains("0x1000"), "{msg}");
        assert!(within(0xfff, 1, start, size).is_err());
        assert!(within(u64::MAX, 2, start, size).is_err());
    }

    #[test]
    fn empty_allocations_are_refused_before_the_driver() {
        let e = check_len(0, "device memory").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(check_len(1, "device memory"), Ok(()));
    }
}
