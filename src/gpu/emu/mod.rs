//! The emulated CUDA driver: the driver contract (`driver.rs`) with CUDA's semantics and no
//! GPU, so that the device path (pointer checks, staging, stream and event ordering, sticky
//! errors) runs in CI, in real processes.
//!
//! # Model
//! - [`EmuDriver::new`]`(n)` has `n` devices named "emulated GPU", bus id "emulated:N",
//!   16 GiB each (allocations past that fail as `CUDA_ERROR_OUT_OF_MEMORY`).
//! - Device memory (`memory.rs`) is not host-dereferenceable at its device address: a memfd
//!   mapped `PROT_NONE` there (a host read or write through a device pointer faults) and
//!   read-write at a private address the streams copy through. `locate` answers `Device`
//!   for any byte of a live allocation's requested length, else `Host` (pinned memory too:
//!   an anonymous mapping, listed only so that kernels may be given it).
//! - CUDA IPC: an allocation's memfd stays open, and its handle names it (pid, descriptor,
//!   inode); `ipc_open` in another process of the machine maps it through
//!   `/proc/<pid>/fd/<fd>` (the inode checked: descriptor numbers are reused) and lists the
//!   mapping like an allocation of its own, so copies and kernels there reach the
//!   exporter's bytes. A handle of the opening process itself is refused, as CUDA does.
//! - Kernels (`compile.rs`, `library.rs`): `function` builds the kernel's `kernels/*.cu` file
//!   for the CPU with g++ through the shim (cached on disk, loaded once per process) and a
//!   launch runs it on the stream's worker, in order with the copies, with device-pointer
//!   arguments translated to their allocations' host aliases (see `EmuStream::launch`). A
//!   kernel that reads or writes past its buffers is not caught (it runs in this process);
//!   a shim failure in fiber mode (a barrier not every thread reaches) aborts the process, as
//!   the shim does in its test drivers.
//! - Streams (`stream.rs`) are FIFOs run in order by one worker thread each. Copies are
//!   checked at enqueue (the device range inside one live allocation of the stream's device,
//!   the host range non-null and not device memory: else `InvalidArgument` naming the
//!   address, length and device, as `CUDA_ERROR_INVALID_VALUE`) and only enqueued; a copy
//!   whose allocation was freed before it ran fails without touching it. A failure makes the
//!   stream sticky-failed: later enqueues, `synchronize` and the events recorded after it
//!   return the error. `wait_event` enqueues a wait; the worker blocks, not the caller.
//! - Handles: a created stream's `raw()` is a process-unique id as a pointer;
//!   `borrow_stream(ordinal, null)` is the device's legacy default stream (one per device,
//!   created on demand, joined when the driver is dropped); a handle of a live stream of
//!   this driver borrows it (same FIFO); anything else is `InvalidArgument`. The legacy
//!   default stream does not synchronise with other streams: qccl's streams are
//!   non-blocking, as `create_stream` promises.
//! - `register_host` lists a host range with the page-locked memory (`alloc_pinned`'s):
//!   copies and kernels treat it alike; a range overlapping one listed already, or device
//!   memory, is refused.
//! - A copy with pageable host memory (not from `alloc_pinned` or `register_host`) on a stream held at a word
//!   returns only once the stream ran it, as CUDA's does (here at most 30 s, then an error
//!   naming it); elsewhere it is asynchronous, where CUDA's would wait for the stream too.
//! - Allocating page-locked or device memory synchronises implicitly, as CUDA documents:
//!   work enqueued afterwards on any stream of the device waits for the work enqueued
//!   before on all of them (`implicit_sync`), so a stream held at a word holds everything
//!   enqueued after the allocation.
//! - A stream holds at most 1024 operations pending (QCCL_GPU_EMULATE_QUEUE_DEPTH sets
//!   another depth): an enqueue past that blocks until one ends, as CUDA's does past some
//!   1000 pending launches (here at most 60 s, then an error saying the queue is full).
//!   With QCCL_GPU_EMULATE_FULL_QUEUE_LOCK=1 such a blocked enqueue holds a process-wide
//!   driver lock that event queries and records wait for (the likely cause of a hang on an
//!   H200: a thread that must query events for the queue to drain then never can).
//! - `write_word` stores its value once the stream reaches it (`cuStreamWriteValue32`).
//! - Dropping a created stream refuses new work, waits up to 10 s for what is enqueued,
//!   abandons the rest (its events fail), and joins the worker.
//!
//! # Faults
//! [`EmuDriver::fail_next_copy`] makes the next copy enqueued on a device fail when its
//! stream reaches it (a sticky error), [`EmuDriver::delay_next_copy`] makes it wait first
//! (a slow kernel ahead of it, for ordering tests).

mod compile;
mod event;
mod fault;
mod library;
mod memory;
mod stream;

#[cfg(test)]
mod tests;

pub use event::EmuEvent;
pub use library::EmuFunction;
pub use memory::{EmuDeviceMem, EmuPinned, EmuRegistered, DEVICE_MEMORY};
pub use stream::EmuStream;

use crate::error::{Error, Result};
use crate::gpu::driver::{
    DeviceInfo, DeviceMem, Driver, Function, IpcHandle, Memory, Pinned, Registered, Stream,
};
use fault::Faults;
use memory::{MemoryTable, PinnedTable};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use stream::{StreamCore, DROP_DRAIN};

/// What the driver's handles share: memory, faults and the stream registry.
pub(crate) struct Shared {
    devices: usize,
    memory: Arc<MemoryTable>,
    /// Live page-locked memory, which kernels may be given.
    pinned: Arc<PinnedTable>,
    faults: Faults,
    /// Kernels looked up so far, by device and name.
    functions: Mutex<HashMap<(usize, String), Arc<EmuFunction>>>,
    /// Created streams by handle, for `borrow_stream`.
    streams: Mutex<HashMap<u64, Weak<StreamCore>>>,
    /// Each device's legacy default stream, once borrowed.
    defaults: Mutex<Vec<Option<Arc<StreamCore>>>>,
}

impl Shared {
    /// Removes a created stream from the registry (it is being dropped).
    fn forget_stream(&self, id: u64) {
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }
}

/// The emulated driver. Dropping it drains and joins the legacy default streams; created
/// streams and memory stay usable until they are dropped.
pub struct EmuDriver {
    shared: Arc<Shared>,
}

impl EmuDriver {
    /// A driver with `devices` devices (0 is taken as 1: a driver sees at least one).
    pub fn new(devices: usize) -> EmuDriver {
        let devices = devices.max(1);
        EmuDriver {
            shared: Arc::new(Shared {
                devices,
                memory: Arc::new(MemoryTable::new(devices)),
                pinned: Arc::default(),
                faults: Faults::new(devices),
                functions: Mutex::default(),
                streams: Mutex::new(HashMap::new()),
                defaults: Mutex::new(vec![None; devices]),
            }),
        }
    }

    fn check_ordinal(&self, ordinal: usize) -> Result<()> {
        if ordinal < self.shared.devices {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "device ordinal {ordinal} is out of range: the emulated driver has {} \
                 device(s) (CUDA_ERROR_INVALID_DEVICE)",
                self.shared.devices
            )))
        }
    }

    /// The next copy enqueued on device `ordinal` (on any stream) fails when its stream
    /// reaches it, making that stream sticky-failed.
    pub fn fail_next_copy(&self, ordinal: usize) -> Result<()> {
        self.check_ordinal(ordinal)?;
        self.shared.faults.fail_next_copy(ordinal);
        Ok(())
    }

    /// The next copy enqueued on device `ordinal` (without a delay of its own) waits `delay`
    /// on its stream before it runs: a slow kernel ahead of it. Calls queue up, one per copy.
    pub fn delay_next_copy(&self, ordinal: usize, delay: std::time::Duration) -> Result<()> {
        self.check_ordinal(ordinal)?;
        self.shared.faults.delay_next_copy(ordinal, delay);
        Ok(())
    }

    /// CUDA's implicit synchronisation, as an allocation of page-locked or device memory
    /// does it: work enqueued afterwards on any stream of device `ordinal` waits for all
    /// work enqueued before on every stream of it (a stream held at a word holds the whole
    /// device's later work).
    fn implicit_sync(&self, ordinal: usize) {
        let mut cores: Vec<Arc<StreamCore>> = self
            .shared
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .filter(|c| c.ordinal == ordinal)
            .collect();
        if let Some(d) = &self
            .shared
            .defaults
            .lock()
            .unwrap_or_else(|p| p.into_inner())[ordinal]
        {
            cores.push(d.clone());
        }
        // Closed or failed streams have nothing left to wait for.
        let points: Vec<_> = cores.iter().filter_map(|c| c.record().ok()).collect();
        for c in &cores {
            for p in &points {
                // A closed or failed stream runs nothing more: nothing to hold there.
                let _ = c.wait(p.clone());
            }
        }
    }

    /// Device `ordinal`'s legacy default stream, started on first use.
    fn default_stream(&self, ordinal: usize) -> Result<Arc<StreamCore>> {
        let mut defaults = self
            .shared
            .defaults
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(core) = &defaults[ordinal] {
            return Ok(core.clone());
        }
        let core = StreamCore::start(
            0,
            ordinal,
            format!("the legacy default stream of emulated device {ordinal}"),
        )?;
        defaults[ordinal] = Some(core.clone());
        Ok(core)
    }

    fn handle(&self, core: Arc<StreamCore>, owned: bool) -> Box<dyn Stream> {
        Box::new(EmuStream {
            core,
            shared: self.shared.clone(),
            owned,
        })
    }
}

impl Drop for EmuDriver {
    fn drop(&mut self) {
        let defaults = std::mem::take(
            &mut *self
                .shared
                .defaults
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for core in defaults.into_iter().flatten() {
            core.close(DROP_DRAIN);
        }
    }
}

impl Driver for EmuDriver {
    fn kind(&self) -> &'static str {
        "emulated"
    }

    fn device_count(&self) -> usize {
        self.shared.devices
    }

    fn device(&self, ordinal: usize) -> Result<DeviceInfo> {
        self.check_ordinal(ordinal)?;
        Ok(DeviceInfo {
            ordinal,
            name: "emulated GPU".into(),
            bus_id: format!("emulated:{ordinal}"),
            memory: DEVICE_MEMORY,
        })
    }

    fn locate(&self, addr: u64) -> Result<Memory> {
        Ok(match self.shared.memory.find(addr) {
            Some(a) => Memory::Device { ordinal: a.ordinal },
            None => Memory::Host,
        })
    }

    fn alloc_pinned(&self, len: usize) -> Result<Box<dyn Pinned>> {
        if len == 0 {
            return Err(Error::invalid(
                "pinned memory of 0 bytes requested: at least 1 (CUDA_ERROR_INVALID_VALUE)",
            ));
        }
        let pinned = EmuPinned::new(len, &self.shared.pinned)?;
        // Page-locked memory is the context's (portable): every device synchronises.
        for ordinal in 0..self.shared.devices {
            self.implicit_sync(ordinal);
        }
        Ok(Box::new(pinned))
    }

    fn alloc_device(&self, ordinal: usize, len: usize) -> Result<Box<dyn DeviceMem>> {
        self.check_ordinal(ordinal)?;
        if len == 0 {
            return Err(Error::invalid(format!(
                "device memory of 0 bytes requested on device {ordinal}: at least 1 \
                 (CUDA_ERROR_INVALID_VALUE)"
            )));
        }
        let mem = self.shared.memory.alloc(ordinal, len)?;
        self.implicit_sync(ordinal);
        Ok(Box::new(mem))
    }

    fn ipc_open(
        &self,
        ordinal: usize,
        handle: &IpcHandle,
        len: usize,
    ) -> Result<Box<dyn DeviceMem>> {
        self.check_ordinal(ordinal)?;
        Ok(Box::new(self.shared.memory.open_ipc(ordinal, handle, len)?))
    }

    unsafe fn register_host(
        &self,
        ordinal: usize,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registered>> {
        self.check_ordinal(ordinal)?;
        if self.shared.memory.overlapping(ptr as u64, len).is_some() {
            return Err(Error::invalid(format!(
                "registering {len} bytes at {ptr:p}: device memory, not host memory \
                 (CUDA_ERROR_INVALID_VALUE)"
            )));
        }
        Ok(Box::new(EmuRegistered::new(
            ptr as u64,
            len,
            &self.shared.pinned,
        )?))
    }

    fn create_stream(&self, ordinal: usize) -> Result<Box<dyn Stream>> {
        // Process-unique, so that one driver refuses another's handles.
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        self.check_ordinal(ordinal)?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let core = StreamCore::start(
            id,
            ordinal,
            format!("emulated stream {id} on device {ordinal}"),
        )?;
        self.shared
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::downgrade(&core));
        Ok(self.handle(core, true))
    }

    unsafe fn borrow_stream(&self, ordinal: usize, raw: *mut c_void) -> Result<Box<dyn Stream>> {
        self.check_ordinal(ordinal)?;
        if raw.is_null() {
            return Ok(self.handle(self.default_stream(ordinal)?, false));
        }
        let id = raw as usize as u64;
        let core = self
            .shared
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .and_then(Weak::upgrade)
            .filter(|c| c.is_open());
        let Some(core) = core else {
            return Err(Error::invalid(format!(
                "stream handle {raw:p} is not a stream of the emulated driver \
                 (CUDA_ERROR_INVALID_HANDLE)"
            )));
        };
        if core.ordinal != ordinal {
            return Err(Error::invalid(format!(
                "stream handle {raw:p} is {}, not a stream of device {ordinal}",
                core.name
            )));
        }
        Ok(self.handle(core, false))
    }

    fn function(&self, ordinal: usize, name: &str) -> Result<Arc<dyn Function>> {
        self.check_ordinal(ordinal)?;
        let key = (ordinal, name.to_string());
        let known = self
            .shared
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned();
        let f = match known {
            Some(f) => f,
            None => {
                // Looked up unlocked: the first use of a file builds it (seconds).
                let f = Arc::new(library::function(ordinal, name)?);
                self.shared
                    .functions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key, f.clone());
                f
            }
        };
        Ok(f)
    }
}
