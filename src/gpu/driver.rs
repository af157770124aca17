//! The CUDA driver contract: the few driver calls qccl's device path makes, small enough that
//! two implementations keep it: the real one over cudarc's driver API (`cuda/`, feature
//! `cuda`, needs libcuda and a GPU) and an emulated one (`emu/`, `QCCL_GPU_EMULATE=1`) whose
//! "device memory" is host memory it hands out and whose streams are threads, so the device
//! path (pointer checks, staging through pinned memory, stream and event ordering, errors)
//! runs in CI and in real processes with no GPU. The same split as the RDMA link's verbs
//! contract (`transport/ib/verbs.rs`).
//!
//! The shape follows the CUDA driver API, cut to what host staging needs: find where a
//! pointer lives ([`Driver::locate`], `cuPointerGetAttribute`), allocate page-locked host
//! memory ([`Driver::alloc_pinned`], `cuMemHostAlloc` PORTABLE|DEVICEMAP, never
//! write-combined: the CPU reads staged bytes) and device memory ([`Driver::alloc_device`],
//! `cuMemAlloc`, not the async pool, so CUDA IPC can share it later), streams (created, or the
//! caller's borrowed), asynchronous copies between host and device, events, and launches of
//! qccl's own kernels (`kernels/*.cu`): [`Driver::function`] looks an entry point up once per
//! device, [`Stream::launch`] enqueues it with typed arguments ([`Arg`]; typed so that the
//! emulated driver, which runs the same sources on the CPU, knows which are device addresses).
//!
//! Rules both implementations keep (the device path relies on them):
//! - Work on one stream runs in the order it was enqueued; `Stream::wait_event` makes later
//!   work on the stream wait until the event's recorded work is done, without blocking the
//!   caller. An event records the work enqueued on its stream before `Stream::record`.
//! - `copy_to_host`/`copy_to_device` only enqueue: the bytes move when the stream reaches
//!   them, and the host side must stay valid until then (an event or `synchronize` says so).
//! - A failed copy (an address that is not device memory of that stream's device, a length
//!   past the allocation) fails the enqueue call or the next `synchronize`/event wait with
//!   an error naming the address, as CUDA reports `CUDA_ERROR_INVALID_VALUE` /
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`; nothing is written outside the buffers.
//! - Every wait is bounded by the `timeout` it is given and returns an error naming what it
//!   waited for when it passes.
//! - Dropping a stream waits (bounded) for its enqueued work; dropping memory that a stream
//!   may still access is the caller's bug, as in CUDA (the device path synchronises first).

use crate::Result;
use std::time::Duration;

/// Where a pointer's memory lives, as `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
/// CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)` tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory: pageable, page-locked, or unknown to the driver.
    Host,
    /// Memory of device `ordinal` (including managed memory resident there).
    Device {
        /// The device's ordinal, `0..device_count()`.
        ordinal: usize,
    },
}

/// A device's identity, for logs and `# Using devices` lines (nccl-tests style).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal, `0..device_count()`.
    pub ordinal: usize,
    /// "NVIDIA H100 80GB HBM3"; "emulated GPU" for the emulated driver.
    pub name: String,
    /// PCI bus id, "0000:3b:00.0" ("emulated" for the emulated driver).
    pub bus_id: String,
    /// Total memory in bytes.
    pub memory: u64,
}

/// One kernel argument, as the kernel declares it (`cuLaunchKernel` passes each by value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A pointer parameter (`T*`): a device address of the launching device, page-locked
    /// memory from `alloc_pinned`, or 0 (null).
    Ptr(u64),
    /// `uint64_t` (counts).
    U64(u64),
    /// `uint32_t` / `unsigned`.
    U32(u32),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
}

/// A CUDA IPC memory handle (`CUipcMemHandle`): names one device allocation to another
/// process of the same machine, which maps it with [`Driver::ipc_open`]. 64 opaque bytes,
/// sent as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle(pub [u8; 64]);

/// A kernel entry point loaded on one device; `Driver::function` makes it.
pub trait Function: Send + Sync {
    /// The entry point's name, `qccl_reduce_sum_f32`.
    fn name(&self) -> &str;

    /// The device it was loaded on.
    fn ordinal(&self) -> usize;

    /// The implementation's function, for `Stream::launch` of the same driver.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The driver: real (libcuda) or emulated.
pub trait Driver: Send + Sync {
    /// "cuda" or "emulated", for logs.
    fn kind(&self) -> &'static str;

    /// Devices the driver sees (at least 1 once the driver was opened).
    fn device_count(&self) -> usize;

    /// Device `ordinal`'s identity; an error naming the ordinal when out of range.
    fn device(&self, ordinal: usize) -> Result<DeviceInfo>;

    /// Where the memory at `addr` lives. A pointer the driver does not know is `Host` (as
    /// `cuPointerGetAttribute` answers `CUDA_ERROR_INVALID_VALUE` for pageable memory).
    fn locate(&self, addr: u64) -> Result<Memory>;

    /// `len` bytes (at least 1) of page-locked host memory, portable across contexts and
    /// mapped into the device's address space; contents unspecified.
    fn alloc_pinned(&self, len: usize) -> Result<Box<dyn Pinned>>;

    /// `len` bytes (at least 1) of device memory on `ordinal`; contents unspecified.
    fn alloc_device(&self, ordinal: usize, len: usize) -> Result<Box<dyn DeviceMem>>;

    /// Maps another process's device allocation of `len` bytes, named by `handle` (its
    /// [`DeviceMem::ipc_handle`]), into this process on device `ordinal`
    /// (`cuIpcOpenMemHandle_v2` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`): copies and
    /// kernels of that device may then use the returned address; dropping it unmaps
    /// (`cuIpcCloseMemHandle`), leaving the exporter's memory alone. A handle of this very
    /// process is refused, as CUDA refuses it; so is one whose allocation is gone or smaller
    /// than `len`, naming what was wrong.
    fn ipc_open(
        &self,
        ordinal: usize,
        handle: &IpcHandle,
        len: usize,
    ) -> Result<Box<dyn DeviceMem>>;

    /// Page-locks the `len` bytes of host memory at `ptr` (`cuMemHostRegister`, PORTABLE: for
    /// every device, registered from device `ordinal`'s context), so that copies between them
    /// and a device run as DMA straight from and into them (CGX's registered shared-memory
    /// segments: the arena, `gpu::arena`); unregistered when the returned value is dropped
    /// (`cuMemHostUnregister`). Memory registered already, or device memory, is refused
    /// naming it.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one mapping of this process, page-aligned, that stays mapped
    /// until the returned value is dropped.
    unsafe fn register_host(
        &self,
        ordinal: usize,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registered>>;

    /// A new stream of qccl's own on device `ordinal` (non-blocking with respect to the
    /// legacy default stream).
    fn create_stream(&self, ordinal: usize) -> Result<Box<dyn Stream>>;

    /// The caller's stream `raw` (a `CUstream` / `cudaStream_t`; null: the legacy default
    /// stream) on device `ordinal`, borrowed: dropping it leaves the stream alone.
    ///
    /// # Safety
    /// `raw` must be null or a stream of device `ordinal` that outlives the returned value.
    unsafe fn borrow_stream(
        &self,
        ordinal: usize,
        raw: *mut std::ffi::c_void,
    ) -> Result<Box<dyn Stream>>;

    /// Kernel entry point `name` of qccl's `kernels/` on device `ordinal`. The first call for
    /// a device loads the kernels for it (the real driver: the kernel file's NVRTC image; the
    /// emulated one: the file built for the CPU), later calls reuse the module. An unknown
    /// name is `InvalidArgument` naming it; no way to build the kernels is `Unsupported`.
    fn function(&self, ordinal: usize, name: &str) -> Result<std::sync::Arc<dyn Function>>;
}

/// Page-locked host memory; freed on drop.
pub trait Pinned: Send {
    /// First byte (host address).
    fn ptr(&self) -> *mut u8;

    /// Bytes.
    fn len(&self) -> usize;

    /// True when `len()` is 0.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Host memory page-locked by `Driver::register_host`; unregistered on drop.
pub trait Registered: Send {
    /// Bytes registered.
    fn len(&self) -> usize;

    /// True when `len()` is 0.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Device memory; freed on drop.
pub trait DeviceMem: Send {
    /// First byte (device address).
    fn addr(&self) -> u64;

    /// Bytes.
    fn len(&self) -> usize;

    /// True when `len()` is 0.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Device ordinal.
    fn ordinal(&self) -> usize;

    /// The handle another process of this machine opens this allocation with
    /// (`cuIpcGetMemHandle`; memory from `alloc_device`, whose first byte it names). Memory
    /// mapped by `ipc_open` is not exported again (an error).
    fn ipc_handle(&self) -> Result<IpcHandle>;
}

/// A stream: work on it runs in order.
pub trait Stream: Send {
    /// Its device's ordinal.
    fn ordinal(&self) -> usize;

    /// The handle a caller passes as `qcclStream_t` (`CUstream`; the emulated driver's own
    /// handles for its streams; null for the legacy default stream).
    fn raw(&self) -> *mut std::ffi::c_void;

    /// Enqueues a copy of `len` bytes from device address `src` to host memory `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must be valid for writes, and not be read or written by anything else,
    /// until the copy is known done (an event recorded after it, or `synchronize`).
    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()>;

    /// Enqueues a copy of `len` bytes from host memory `src` to device address `dst`.
    ///
    /// # Safety
    /// `src..src+len` must be valid for reads, and not be written, until the copy is known
    /// done.
    unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;

    /// Enqueues a copy of `len` bytes from device address `src` to device address `dst`,
    /// both memory of this stream's device (`cuMemcpyDtoDAsync`; the ranges must not overlap).
    /// The device's copy bandwidth is what the kernels are measured against
    /// (`gpu::bench`).
    ///
    /// # Safety
    /// Nothing else may write `src..src+len`, or read or write `dst..dst+len`, until the
    /// copy is known done.
    unsafe fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<()>;

    /// Records an event after the work enqueued so far.
    fn record(&self) -> Result<Box<dyn Event>>;

    /// Makes the work enqueued after this call wait for `event` (which may belong to another
    /// stream of the same device); does not block the caller.
    fn wait_event(&self, event: &dyn Event) -> Result<()>;

    /// Enqueues a wait until the 32-bit word at `word` is at least `value` (cyclically, as
    /// `cuStreamWaitValue32` with GEQ: `(int32_t)(*word - value) >= 0`): work enqueued after it waits, the caller does not
    /// block. The host releases the stream by storing the value (how a call on a stream
    /// returns at once and the stream waits for qccl's worker).
    ///
    /// # Safety
    /// `word` must lie in page-locked memory from this driver's `alloc_pinned`, 4-byte
    /// aligned, and stay allocated until the wait is known done.
    unsafe fn wait_word(&self, word: *const u32, value: u32) -> Result<()>;

    /// Enqueues storing `value` in the 32-bit word at `word` once the work enqueued before it
    /// is done, its writes visible to the host first (`cuStreamWriteValue32`, with its
    /// default memory barrier): the host learns how far a stream got by reading the word,
    /// with no driver call (which a thread blocked on a full queue can hold up).
    ///
    /// # Safety
    /// As `wait_word`: `word` in page-locked memory from this driver's `alloc_pinned`,
    /// 4-byte aligned, allocated until the store is known done.
    unsafe fn write_word(&self, word: *mut u32, value: u32) -> Result<()>;

    /// Enqueues kernel `f` on a 1-D grid of `grid` blocks of `block` threads (no dynamic
    /// shared memory) with `args`. Errors (a function of another device or driver, an empty
    /// grid or block, arguments that do not fit the kernel where the driver can tell) name the
    /// kernel; a kernel that faults fails the stream (sticky) as a failed copy does.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, and every memory range
    /// the kernel reads or writes through them must stay valid (and not be touched by
    /// anything else) until the launch is known done, as for the copies.
    unsafe fn launch(&self, f: &dyn Function, grid: u32, block: u32, args: &[Arg]) -> Result<()>;

    /// Blocks until all work enqueued so far is done, at most `timeout`; its first error.
    fn synchronize(&self, timeout: Duration) -> Result<()>;
}

/// An event: a point in a stream's work.
pub trait Event: Send + Sync {
    /// True when the recorded work is done; the work's error if it failed.
    fn query(&self) -> Result<bool>;

    /// Blocks until the recorded work is done, at most `timeout`; its error if it failed.
    fn synchronize(&self, timeout: Duration) -> Result<()>;

    /// The implementation's event, for `Stream::wait_event` of the same driver.
    fn as_any(&self) -> &dyn std::any::Any;
}
