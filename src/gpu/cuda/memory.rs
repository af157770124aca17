//! Where a pointer lives (`cuPointerGetAttribute`), and the two kinds of memory the driver
//! hands out: page-locked host memory (`cuMemHostAlloc`) and device memory (`cuMemAlloc`).

use super::call::{check, failed};
use super::context::Context;
use crate::error::{Error, Result};
use crate::gpu::driver::{DeviceMem, IpcHandle, Memory, Pinned, Registered};
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

/// `Ok` when `addr..addr+len` is device memory of device `ordinal` that a copy may touch,
/// so that it cannot fault on the device (an illegal address would poison the context for
/// the whole process). Memory from `cuMemAlloc`/`cudaMalloc` must hold the whole range in one
/// allocation; other device memory (mapped piece by piece with `cuMemMap`, as PyTorch's
/// expandable segments are, where each piece is an allocation to the driver) may span pieces
/// that lie back to back. A context must be current.
pub(super) fn check_device_range(ordinal: usize, addr: u64, len: usize) -> Result<()> {
    let mut at = addr;
    loop {
        match locate(at)? {
            Memory::Device { ordinal: o } if o == ordinal => {}
            Memory::Device { ordinal: o } => {
                return Err(Error::invalid(format!(
                    "{len} bytes at address {addr:#x}: {at:#x} is memory of CUDA device {o}, \
                     not of device {ordinal} (the stream's)"
                )))
            }
            Memory::Host if at == addr => {
                return Err(Error::invalid(format!(
                    "{len} bytes at address {addr:#x} are not device memory (host memory, or \
                     unknown to the CUDA driver)"
                )))
            }
            Memory::Host => {
                return Err(Error::invalid(format!(
                    "{len} bytes at device address {addr:#x} run past their allocation (device \
                     memory ends at {at:#x})"
                )))
            }
        }
        // SAFETY: RANGE_START_ADDR is a CUdeviceptr, RANGE_SIZE a size_t.
        let start = unsafe { attribute::<u64>(at, Attr::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)? };
        // SAFETY: as above.
        let size = unsafe { attribute::<usize>(at, Attr::CU_POINTER_ATTRIBUTE_RANGE_SIZE)? };
        let (Some(start), Some(size)) = (start, size) else {
            // A driver that gives no range for device memory: the copy goes ahead with the
            // driver's own checks, rather than refusing memory that may well be valid.
            return Ok(());
        };
        match next_piece(addr, len, at, start, size as u64)? {
            None => return Ok(()),
            Some(end) if at == addr && is_cu_mem_alloc(addr)? => {
                return Err(Error::invalid(format!(
                    "{len} bytes at device address {addr:#x} run past their allocation \
                     ({start:#x}, {size} bytes, ending at {end:#x})"
                )))
            }
            Some(next) => at = next,
        }
    }
}

/// True for memory from `cuMemAlloc`/`cudaMalloc`: the only kind that legacy CUDA IPC can
/// share (`CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`), unlike `cuMemMap`ped or
/// stream-ordered pool memory. A context must be current.
fn is_cu_mem_alloc(addr: u64) -> Result<bool> {
    // SAFETY: the attribute is a boolean the driver writes into the zeroed u32 (whether it
    // writes one byte or four, the value is non-zero exactly when true).
    let legacy =
        unsafe { attribute::<u32>(addr, Attr::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)? };
    Ok(legacy.is_some_and(|v| v != 0))
}

/// Where the check of `addr..addr+len` goes on after the allocation `start..start+size`
/// that holds `at`: `None` when the allocation covers the rest, else the address after it.
pub(super) fn next_piece(
    addr: u64,
    len: usize,
    at: u64,
    start: u64,
    size: u64,
) -> Result<Option<u64>> {
    let past = || {
        Error::invalid(format!(
            "{len} bytes at device address {addr:#x} run past the end of the address space"
        ))
    };
    let end = addr.checked_add(len as u64).ok_or_else(past)?;
    let alloc_end = start.checked_add(size).ok_or_else(past)?;
    if at < start || alloc_end <= at {
        return Err(Error::System(format!(
            "the CUDA driver places address {at:#x} in the allocation {start:#x} ({size} \
             bytes), which does not hold it (cuPointerGetAttribute RANGE_START_ADDR/RANGE_SIZE)"
        )));
    }
    Ok((alloc_end < end).then_some(alloc_end))
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

/// Host memory page-locked with `cuMemHostRegister` (PORTABLE: every context's copies use
/// it as page-locked), unregistered with `cuMemHostUnregister`.
pub(super) struct CudaRegistered {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: only the address is kept, to unregister it once, in Drop (thread safe with the
// context current); the bytes are the caller's.
unsafe impl Send for CudaRegistered {}

impl CudaRegistered {
    /// Registers `ptr..ptr+len` in `ctx`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one page-aligned mapping that stays mapped until the value is
    /// dropped.
    pub(super) unsafe fn register(
        ctx: Arc<Context>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<CudaRegistered> {
        check_len(len, "registered host memory")?;
        let _current = ctx.enter()?;
        // SAFETY: the caller's promise: a live mapping of `len` bytes, unregistered in Drop
        // before it goes.
        let r =
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        check(r, "cuMemHostRegister", || {
            format!("page-locking {len} bytes of host memory at {ptr:p}")
        })?;
        Ok(CudaRegistered { ptr, len, ctx })
    }
}

impl Registered for CudaRegistered {
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaRegistered {
    fn drop(&mut self) {
        let done = self.ctx.enter().and_then(|_current| {
            // SAFETY: registered in `register`, unregistered once, here, while still mapped
            // (the owner drops this first).
            let r = unsafe { sys::cuMemHostUnregister(self.ptr.cast()) };
            check(r, "cuMemHostUnregister", || {
                format!("unregistering {} bytes at {:p}", self.len, self.ptr)
            })
        });
        if let Err(e) = done {
            crate::qlog!(Warn, "{e}");
        }
    }
}

/// Device memory from `cuMemAlloc` (not the stream-ordered pool, so CUDA IPC can share it),
/// freed with `cuMemFree`; or another process's, mapped with `cuIpcOpenMemHandle_v2` and
/// unmapped with `cuIpcCloseMemHandle` (the exporter's memory is left alone).
pub(super) struct CudaDeviceMem {
    addr: u64,
    len: usize,
    ctx: Arc<Context>,
    /// Mapped from another process (`open`), not allocated here.
    imported: bool,
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
        Ok(CudaDeviceMem {
            addr,
            len,
            ctx,
            imported: false,
        })
    }

    /// Maps the allocation `handle` names into `ctx`, `len` bytes of it.
    pub(super) fn open(ctx: Arc<Context>, handle: &IpcHandle, len: usize) -> Result<CudaDeviceMem> {
        check_len(len, "memory shared over CUDA IPC")?;
        let _current = ctx.enter()?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut addr: sys::CUdeviceptr = 0;
        let lazy = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: `addr` is a valid out-pointer; the handle is passed by value; the mapping
        // is closed in Drop.
        let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut addr, h, lazy) };
        check(r, "cuIpcOpenMemHandle", || {
            format!(
                "mapping {len} bytes of another process's memory on CUDA device {}",
                ctx.ordinal()
            )
        })?;
        Ok(CudaDeviceMem {
            addr,
            len,
            ctx,
            imported: true,
        })
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

    fn ipc_handle(&self) -> Result<IpcHandle> {
        if self.imported {
            return Err(Error::invalid(format!(
                "device address {:#x} was mapped from another process over CUDA IPC: it is \
                 not exported again",
                self.addr
            )));
        }
        let _current = self.ctx.enter()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `h` is a valid out-pointer; `addr` is the first byte of a live cuMemAlloc
        // allocation of this context.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, self.addr) };
        check(r, "cuIpcGetMemHandle", || {
            format!(
                "sharing {} bytes at device address {:#x} on CUDA device {}",
                self.len,
                self.addr,
                self.ctx.ordinal()
            )
        })?;
        Ok(IpcHandle(h.reserved.map(|b| b as u8)))
    }
}

impl Drop for CudaDeviceMem {
    fn drop(&mut self) {
        let done = self.ctx.enter().and_then(|_current| {
            let (r, call) = if self.imported {
                // SAFETY: opened by cuIpcOpenMemHandle_v2 in this context and closed once,
                // here; the users synchronise before dropping it.
                (
                    unsafe { sys::cuIpcCloseMemHandle(self.addr) },
                    "cuIpcCloseMemHandle",
                )
            } else {
                // SAFETY: allocated by cuMemAlloc in this context and freed once, here.
                (unsafe { sys::cuMemFree_v2(self.addr) }, "cuMemFree")
            };
            check(r, call, || {
                format!(
                    "releasing {} bytes at device address {:#x} on CUDA device {}",
                    self.len,
                    self.addr,
                    self.ctx.ordinal()
                )
            })
        });
        if let Err(e) = done {
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
    fn ranges_are_checked_allocation_by_allocation() {
        let (start, size) = (0x1000, 256);
        // Covered by the allocation.
        assert_eq!(next_piece(0x1000, 256, 0x1000, start, size), Ok(None));
        assert_eq!(next_piece(0x10ff, 1, 0x10ff, start, size), Ok(None));
        assert_eq!(next_piece(0x1080, 0, 0x1080, start, size), Ok(None));
        // Going on after it: the next allocation must hold 0x1100.
        assert_eq!(next_piece(0x10ff, 2, 0x10ff, start, size), Ok(Some(0x1100)));
        assert_eq!(
            next_piece(0x1000, 4096, 0x1000, start, size),
            Ok(Some(0x1100))
        );
        // Past the address space.
        let e = next_piece(u64::MAX, 2, u64::MAX, start, size).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("0xffffffffffffffff"), "{e}");
        // A range that does not hold the address is the driver's inconsistency.
        let e = next_piece(0x2000, 1, 0x2000, start, size).unwrap_err();
        assert!(matches!(e, Error::System(_)), "{e}");
        assert!(next_piece(0xfff, 1, 0xfff, start, size).is_err());
    }

    #[test]
    fn empty_allocations_are_refused_before_the_driver() {
        let e = check_len(0, "device memory").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(check_len(1, "device memory"), Ok(()));
    }
}
