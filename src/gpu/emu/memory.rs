//! Emulated device memory and pinned host memory.
//!
//! Device memory is a memfd mapped twice: `PROT_NONE` at the address handed out as the device
//! address, so any host read or write through a device pointer faults (as it would on a real
//! GPU), and read-write at a private address the stream workers copy through. Live
//! allocations sit in a table ordered by device address, which `locate` and the copy checks
//! search.
//!
//! A copy holds the allocation (not its address) from enqueue to execution and copies under
//! the allocation's read lock after checking it is still mapped; freeing takes the write lock
//! and unmaps, so a free returns only once no copy is in flight, no copy starts after it, and
//! a copy that finds its allocation freed fails instead of touching unmapped memory (or a new
//! allocation that reused the address).

use crate::error::{Error, Result};
use crate::gpu::driver::IpcHandle;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// The host's page size.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a constant of the system; no memory is involved.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page)
            .ok()
            .filter(|&p| p > 0)
            .unwrap_or(4096)
    })
}

/// `len` rounded up to whole pages, or an error when that overflows.
fn round_to_pages(len: usize) -> Result<usize> {
    let page = page_size();
    len.checked_next_multiple_of(page)
        .ok_or_else(|| Error::invalid(format!("{len} bytes cannot be rounded to whole pages")))
}

/// The last OS error as a `System` error, with what was being done.
fn os_error(what: impl std::fmt::Display) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

/// The two mappings of one allocation's memfd; unmapped on drop. The memfd stays open with
/// them: another process maps the same memory through it (`/proc/<pid>/fd/<fd>`), which is
/// how the emulated driver shares device memory over CUDA IPC.
struct Mapping {
    /// `PROT_NONE`: the device address.
    device: NonNull<c_void>,
    /// Read-write: where the bytes are reached.
    host: NonNull<u8>,
    /// Bytes mapped (whole pages).
    mapped: usize,
    /// The memfd both map.
    fd: std::os::fd::OwnedFd,
}

// SAFETY: the mappings are plain memory owned by this value; which thread unmaps them does
// not matter, and access to the bytes is serialised by `Allocation::mapping`'s lock.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared access only reads the pointers.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A fresh memfd of `mapped` bytes (whole pages, at least one) mapped twice.
    fn new(mapped: usize) -> Result<Mapping> {
        // SAFETY: the name is a NUL-terminated literal; MFD_CLOEXEC keeps the fd out of
        // child processes.
        let fd = unsafe { libc::memfd_create(c"qccl-gpu-emu".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create for emulated device memory"));
        }
        // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let size = libc::off_t::try_from(mapped)
            .map_err(|_| Error::invalid(format!("{mapped} bytes do not fit an off_t")))?;
        // SAFETY: `raw` is a live memfd owned by `fd`.
        if unsafe { libc::ftruncate(raw, size) } != 0 {
            return Err(os_error(format!("ftruncate of a {mapped}-byte memfd")));
        }
        Mapping::of(fd, mapped)
    }

    /// Maps the first `mapped` bytes (whole pages, at least one) of memfd `fd` twice.
    fn of(fd: std::os::fd::OwnedFd, mapped: usize) -> Result<Mapping> {
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let map = |prot| {
            // SAFETY: a new shared mapping of the memfd's first `mapped` bytes (the caller
            // checked its size) at an address the kernel picks; it overlaps nothing of ours.
            let p =
                unsafe { libc::mmap(std::ptr::null_mut(), mapped, prot, libc::MAP_SHARED, raw, 0) };
            if p == libc::MAP_FAILED {
                Err(os_error(format!(
                    "mmap of {mapped} bytes of emulated device memory"
                )))
            } else {
                NonNull::new(p).ok_or_else(|| Error::System("mmap returned null".into()))
            }
        };
        let device = map(libc::PROT_NONE)?;
        let host = match map(libc::PROT_READ | libc::PROT_WRITE) {
            Ok(h) => h.cast::<u8>(),
            Err(e) => {
                // SAFETY: `device` was mapped above with this length and is not used again.
                unsafe { libc::munmap(device.as_ptr(), mapped) };
                return Err(e);
            }
        };
        Ok(Mapping {
            device,
            host,
            mapped,
            fd,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: both were mapped in `new` with `mapped` bytes and are unmapped only here;
        // the owning allocation's write lock guarantees no copy is using `host`.
        unsafe {
            libc::munmap(self.device.as_ptr(), self.mapped);
            libc::munmap(self.host.as_ptr().cast(), self.mapped);
        }
    }
}

/// One live (or just freed) device allocation.
pub struct Allocation {
    /// Unique in the process, for errors (device addresses are reused after a free).
    pub id: u64,
    /// Device ordinal.
    pub ordinal: usize,
    /// Device address of the first byte.
    pub addr: u64,
    /// Bytes requested (the mapping is this rounded up to pages).
    pub len: usize,
    /// Bytes mapped at `addr`: `len` rounded up to pages.
    pub mapped: usize,
    /// Another process's memory, mapped by `ipc_open` (not exported again).
    pub imported: bool,
    /// `None` once freed.
    mapping: RwLock<Option<Mapping>>,
}

/// Why a copy through an allocation could not run.
pub struct Freed;

impl Allocation {
    /// True when `addr..addr+len` (len >= 1) lies inside the requested bytes.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr
            && (addr - self.addr)
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.len as u64)
    }

    /// "the 4096-byte allocation 3 at 0x7f.. on device 0", for errors.
    pub fn describe(&self) -> String {
        format!(
            "the {}-byte allocation {} at 0x{:x} on device {}",
            self.len, self.id, self.addr, self.ordinal
        )
    }

    /// Copies `len` bytes from host memory `src` to `offset` bytes into the allocation.
    ///
    /// # Safety
    /// `src..src+len` must be valid for reads; `offset + len <= self.len`.
    pub unsafe fn write(
        &self,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> std::result::Result<(), Freed> {
        let mapping = self.mapping.read().unwrap_or_else(|p| p.into_inner());
        let m = mapping.as_ref().ok_or(Freed)?;
        debug_assert!(offset + len <= self.len);
        // SAFETY: the allocation is mapped while the read lock is held, `offset + len` is
        // inside it (checked at enqueue), and the caller vouches for `src`. The host range
        // was checked not to overlap any device mapping, and the private mapping's address
        // is never handed out, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, m.host.as_ptr().add(offset), len) };
        Ok(())
    }

    /// Copies `len` bytes at `offset` bytes into the allocation to host memory `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes; `offset + len <= self.len`.
    pub unsafe fn read(
        &self,
        offset: usize,
        dst: *mut u8,
        len: usize,
    ) -> std::result::Result<(), Freed> {
        let mapping = self.mapping.read().unwrap_or_else(|p| p.into_inner());
        let m = mapping.as_ref().ok_or(Freed)?;
        debug_assert!(offset + len <= self.len);
        // SAFETY: as in `write`, with the roles of the two ranges swapped.
        unsafe { std::ptr::copy_nonoverlapping(m.host.as_ptr().add(offset), dst, len) };
        Ok(())
    }

    /// The allocation's bytes at their host alias, kept mapped until the view is dropped
    /// (a launch holds it while its kernel runs; a free waits for it).
    pub fn host_view(&self) -> std::result::Result<HostView<'_>, Freed> {
        let mapping = self.mapping.read().unwrap_or_else(|p| p.into_inner());
        if mapping.is_none() {
            return Err(Freed);
        }
        Ok(HostView { mapping })
    }

    /// Unmaps the memory once no copy is using it.
    fn unmap(&self) {
        let mut mapping = self.mapping.write().unwrap_or_else(|p| p.into_inner());
        mapping.take();
    }
}

/// A live allocation's host alias (see [`Allocation::host_view`]).
pub struct HostView<'a> {
    mapping: std::sync::RwLockReadGuard<'a, Option<Mapping>>,
}

impl HostView<'_> {
    /// The host address of the allocation's first byte.
    pub fn base(&self) -> *mut u8 {
        self.mapping
            .as_ref()
            .map_or(std::ptr::null_mut(), |m| m.host.as_ptr())
    }
}

/// Most device memory an emulated device hands out (what [`crate::gpu::driver::DeviceInfo`]
/// reports): 16 GiB.
pub const DEVICE_MEMORY: u64 = 16 << 30;

/// The driver's live allocations, by device address.
pub struct MemoryTable {
    inner: Mutex<Tables>,
}

struct Tables {
    by_addr: BTreeMap<u64, Arc<Allocation>>,
    /// Bytes mapped per device, against [`DEVICE_MEMORY`].
    used: Vec<u64>,
}

impl MemoryTable {
    /// An empty table for `devices` devices.
    pub fn new(devices: usize) -> MemoryTable {
        MemoryTable {
            inner: Mutex::new(Tables {
                by_addr: BTreeMap::new(),
                used: vec![0; devices],
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `len` (>= 1) bytes on device `ordinal` (checked by the caller).
    pub fn alloc(self: &Arc<Self>, ordinal: usize, len: usize) -> Result<EmuDeviceMem> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let mapped = round_to_pages(len)?;
        {
            // Reserved before mapping, so that concurrent allocations cannot overshoot.
            let mut t = self.lock();
            if t.used[ordinal].saturating_add(mapped as u64) > DEVICE_MEMORY {
                return Err(Error::System(format!(
                    "out of memory on emulated device {ordinal}: {len} bytes requested, {} of \
                     {DEVICE_MEMORY} in use (CUDA_ERROR_OUT_OF_MEMORY)",
                    t.used[ordinal]
                )));
            }
            t.used[ordinal] += mapped as u64;
        }
        let mapping = match Mapping::new(mapped) {
            Ok(m) => m,
            Err(e) => {
                self.lock().used[ordinal] -= mapped as u64;
                return Err(e);
            }
        };
        let alloc = Arc::new(Allocation {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ordinal,
            addr: mapping.device.as_ptr() as u64,
            len,
            mapped,
            imported: false,
            mapping: RwLock::new(Some(mapping)),
        });
        Ok(self.insert(alloc))
    }

    fn insert(self: &Arc<Self>, alloc: Arc<Allocation>) -> EmuDeviceMem {
        self.lock().by_addr.insert(alloc.addr, alloc.clone());
        EmuDeviceMem {
            alloc,
            table: self.clone(),
        }
    }

    /// Maps the allocation `handle` names (another process's, [`EmuDeviceMem::ipc_handle`])
    /// on device `ordinal`, `len` bytes of it.
    pub fn open_ipc(
        self: &Arc<Self>,
        ordinal: usize,
        handle: &IpcHandle,
        len: usize,
    ) -> Result<EmuDeviceMem> {
        let h = Exported::decode(handle)?;
        if h.pid == std::process::id() {
            return Err(Error::invalid(format!(
                "a CUDA IPC handle of this very process (pid {}): CUDA opens handles of other \
                 processes only (CUDA_ERROR_INVALID_CONTEXT)",
                h.pid
            )));
        }
        if len == 0 || len as u64 > h.len {
            return Err(Error::invalid(format!(
                "{len} bytes of a {}-byte allocation shared over CUDA IPC by pid {}",
                h.len, h.pid
            )));
        }
        let path = format!("/proc/{}/fd/{}", h.pid, h.fd);
        let gone = |why: String| {
            Error::invalid(format!(
                "the device allocation pid {} shared over CUDA IPC is gone ({why}) \
                 (CUDA_ERROR_INVALID_VALUE)",
                h.pid
            ))
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| gone(format!("{path}: {e}")))?;
        let meta = file.metadata().map_err(|e| gone(e.to_string()))?;
        // Descriptor numbers are reused: the inode says it is still the same memfd.
        if (meta.ino(), meta.dev()) != (h.ino, h.dev) || meta.len() < h.mapped {
            return Err(gone(format!("{path} is another file now")));
        }
        let mapping = Mapping::of(file.into(), h.mapped as usize)?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(1 << 62);
        let alloc = Arc::new(Allocation {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ordinal,
            addr: mapping.device.as_ptr() as u64,
            len,
            mapped: mapping.mapped,
            imported: true,
            mapping: RwLock::new(Some(mapping)),
        });
        self.lock().used[ordinal] += alloc.mapped as u64;
        Ok(self.insert(alloc))
    }

    /// The allocation whose requested bytes hold `addr`.
    pub fn find(&self, addr: u64) -> Option<Arc<Allocation>> {
        let t = self.lock();
        let (_, a) = t.by_addr.range(..=addr).next_back()?;
        a.contains(addr, 1).then(|| a.clone())
    }

    /// A device mapping (whole pages, padding included) overlapping `addr..addr+len`.
    pub fn overlapping(&self, addr: u64, len: usize) -> Option<Arc<Allocation>> {
        let end = addr.saturating_add(len as u64);
        let t = self.lock();
        // Allocations do not overlap, so only the last one starting before `end` can reach
        // into the range.
        let (_, a) = t.by_addr.range(..end).next_back()?;
        (a.addr + a.mapped as u64 > addr).then(|| a.clone())
    }

    fn free(&self, alloc: &Allocation) {
        let mut t = self.lock();
        if t.by_addr.remove(&alloc.addr).is_some() {
            t.used[alloc.ordinal] -= alloc.mapped as u64;
        }
        drop(t);
        alloc.unmap();
    }
}

/// Device memory handed to the caller; freed (unmapped) on drop.
pub struct EmuDeviceMem {
    alloc: Arc<Allocation>,
    table: Arc<MemoryTable>,
}

impl crate::gpu::driver::DeviceMem for EmuDeviceMem {
    fn addr(&self) -> u64 {
        self.alloc.addr
    }

    fn len(&self) -> usize {
        self.alloc.len
    }

    fn ordinal(&self) -> usize {
        self.alloc.ordinal
    }

    fn ipc_handle(&self) -> Result<IpcHandle> {
        self.export()
    }
}

/// What an emulated IPC handle holds: where the exporter's memfd is and which file it must
/// still be.
struct Exported {
    pid: u32,
    fd: i32,
    dev: u64,
    ino: u64,
    len: u64,
    mapped: u64,
}

impl Exported {
    const MAGIC: [u8; 8] = *b"qcclemu1";

    fn encode(&self) -> IpcHandle {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(&Self::MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.dev.to_le_bytes());
        b[24..32].copy_from_slice(&self.ino.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b[40..48].copy_from_slice(&self.mapped.to_le_bytes());
        IpcHandle(b)
    }

    fn decode(h: &IpcHandle) -> Result<Exported> {
        let b = &h.0;
        if b[..8] != Self::MAGIC {
            return Err(Error::invalid(
                "not a CUDA IPC handle of the emulated driver (CUDA_ERROR_INVALID_VALUE)",
            ));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Ok(Exported {
            pid: u32_at(8),
            fd: u32_at(12) as i32,
            dev: u64_at(16),
            ino: u64_at(24),
            len: u64_at(32),
            mapped: u64_at(40),
        })
    }
}

impl EmuDeviceMem {
    fn export(&self) -> Result<IpcHandle> {
        if self.alloc.imported {
            return Err(Error::invalid(format!(
                "{} was mapped from another process over CUDA IPC: it is not exported again",
                self.alloc.describe()
            )));
        }
        let mapping = self.alloc.mapping.read().unwrap_or_else(|p| p.into_inner());
        let m = mapping
            .as_ref()
            .ok_or_else(|| Error::invalid(format!("{} was freed", self.alloc.describe())))?;
        let what = "reading an emulated allocation's memfd";
        let meta = std::fs::File::from(m.fd.try_clone().map_err(|e| Error::io(what, e))?)
            .metadata()
            .map_err(|e| Error::io(what, e))?;
        Ok(Exported {
            pid: std::process::id(),
            fd: std::os::fd::AsRawFd::as_raw_fd(&m.fd),
            dev: meta.dev(),
            ino: meta.ino(),
            len: self.alloc.len as u64,
            mapped: self.alloc.mapped as u64,
        }
        .encode())
    }
}

impl Drop for EmuDeviceMem {
    fn drop(&mut self) {
        self.table.free(&self.alloc);
    }
}

/// The live page-locked ranges (`alloc_pinned`), which kernels may be given as they are.
#[derive(Default)]
pub struct PinnedTable {
    ranges: Mutex<BTreeMap<u64, usize>>,
}

impl PinnedTable {
    /// True when `addr` lies in a live range.
    pub fn contains(&self, addr: u64) -> bool {
        self.last_at_or_below(addr)
            .is_some_and(|(start, len)| addr - start < len as u64)
    }

    /// True when `addr` is just past the end of a live range (where a zero-length piece at
    /// the end of a buffer starts). Another mapping may begin at that very address, so ask
    /// this only once `addr` is in no allocation.
    pub fn ends_at(&self, addr: u64) -> bool {
        self.last_at_or_below(addr.wrapping_sub(1))
            .is_some_and(|(start, len)| addr.checked_sub(start) == Some(len as u64))
    }

    fn last_at_or_below(&self, addr: u64) -> Option<(u64, usize)> {
        let ranges = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        ranges
            .range(..=addr)
            .next_back()
            .map(|(&start, &len)| (start, len))
    }
}

/// Host memory page-locked by `register_host`: listed in the driver's `PinnedTable` (copies
/// treat it as page-locked, kernels may be given it) until dropped.
pub struct EmuRegistered {
    start: u64,
    len: usize,
    table: Arc<PinnedTable>,
}

impl EmuRegistered {
    /// Lists `start..start+len` in `table`: refused when empty, not page-aligned, or
    /// overlapping a range listed already (CUDA's `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
    pub fn new(start: u64, len: usize, table: &Arc<PinnedTable>) -> Result<EmuRegistered> {
        if len == 0 || !start.is_multiple_of(page_size() as u64) {
            return Err(Error::invalid(format!(
                "registering {len} bytes at {start:#x}: not a page-aligned range of at least \
                 one byte (CUDA_ERROR_INVALID_VALUE)"
            )));
        }
        let mut ranges = table.ranges.lock().unwrap_or_else(|p| p.into_inner());
        let end = start + len as u64;
        let below = ranges.range(..end).next_back();
        if let Some((&s, &l)) = below.filter(|(&s, &l)| s + l as u64 > start) {
            return Err(Error::invalid(format!(
                "registering {len} bytes at {start:#x}: {s:#x} ({l} bytes) is page-locked \
                 already (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)"
            )));
        }
        ranges.insert(start, len);
        Ok(EmuRegistered {
            start,
            len,
            table: table.clone(),
        })
    }
}

impl crate::gpu::driver::Registered for EmuRegistered {
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for EmuRegistered {
    fn drop(&mut self) {
        self.table
            .ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.start);
    }
}

/// Page-aligned host memory (an anonymous mapping), listed in the driver's `PinnedTable`
/// while it lives (`locate` still answers `Host` for it, as CUDA does).
pub struct EmuPinned {
    ptr: NonNull<u8>,
    len: usize,
    mapped: usize,
    table: Arc<PinnedTable>,
}

// SAFETY: the mapping is owned by this value; callers synchronise access to the bytes.
unsafe impl Send for EmuPinned {}

impl EmuPinned {
    /// `len` (>= 1) bytes, listed in `table`.
    pub fn new(len: usize, table: &Arc<PinnedTable>) -> Result<EmuPinned> {
        let mapped = round_to_pages(len)?;
        // SAFETY: a new private anonymous mapping at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error(format!("mmap of {len} bytes of pinned memory")));
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::System("mmap returned null".into()))?;
        table
            .ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ptr.as_ptr() as u64, len);
        Ok(EmuPinned {
            ptr,
            len,
            mapped,
            table: table.clone(),
        })
    }
}

impl crate::gpu::driver::Pinned for EmuPinned {
    fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for EmuPinned {
    fn drop(&mut self) {
        self.table
            .ranges
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(self.ptr.as_ptr() as u64));
        // SAFETY: mapped in `new` with `mapped` bytes, unmapped only here.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
    }
}
