//! Registered memory of an emulated context: the key table the NIC checks every access
//! against, and the `Region` handles that own an entry.
//!
//! Every copy into or out of a region happens under the entry's read lock, after checking it
//! is still registered; dropping a region takes the write lock, so it returns only once no
//! NIC thread is copying, and no copy starts after it. Copies are memcpy of data already
//! received (or to be sent), never a socket read, so the drop waits microseconds.

use crate::error::{Error, Result};
use crate::transport::ib::verbs::Region;
use std::alloc::Layout;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Alignment of [`RegionTable::alloc`]'s memory.
const PAGE: usize = 4096;

/// One registration.
pub struct Entry {
    addr: u64,
    len: usize,
    /// False once deregistered; guards the memory (see the module doc).
    live: RwLock<bool>,
    /// Peers may write it (allocated slots); registered user memory is a write source only.
    remote_write: bool,
}

impl Entry {
    /// True when `addr..addr+len` lies inside the region.
    pub fn contains(&self, addr: u64, len: u32) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.addr + self.len as u64)
    }

    /// True when a peer may write `addr..addr+len` with this region's key.
    pub fn writable(&self, addr: u64, len: u32) -> bool {
        self.remote_write && self.contains(addr, len)
    }

    /// Copies `src` to `addr` (checked with [`Entry::writable`]); false when the region was
    /// deregistered meanwhile.
    pub fn write(&self, addr: u64, src: &[u8]) -> bool {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        if !*live || !self.writable(addr, src.len() as u32) {
            return false;
        }
        // SAFETY: the range is inside a live registration (checked above, under the read
        // lock that deregistration waits for), so it is memory the registrant keeps valid
        // for remote writes; `src` is our own buffer and cannot overlap it.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) };
        true
    }

    /// Appends the bytes at `addr..addr+len` to `dst`; false when deregistered or outside.
    pub fn read(&self, addr: u64, len: u32, dst: &mut Vec<u8>) -> bool {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        if !*live || !self.contains(addr, len) {
            return false;
        }
        // SAFETY: as in `write`: a live registration's bytes, valid while the read lock is
        // held. They are read as plain bytes; a concurrent writer (the caller posted the
        // write and then changed the buffer) is the caller's race, as on a real NIC.
        let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        dst.extend_from_slice(src);
        true
    }
}

/// The context's registrations, by key (lkey and rkey are the same number, as on mlx5).
pub struct RegionTable {
    name: String,
    next_key: AtomicU32,
    entries: Mutex<HashMap<u32, Arc<Entry>>>,
}

impl RegionTable {
    /// An empty table; `name` (the context's) is for errors.
    pub fn new(name: String) -> RegionTable {
        RegionTable {
            name,
            // Keys start at a random point so that a key from another context or run is
            // unlikely to be valid by accident; 0 is never issued.
            next_key: AtomicU32::new(rand::random::<u32>() >> 8 | 1),
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The live registration with key `key`, if any.
    pub fn get(&self, key: u32) -> Option<Arc<Entry>> {
        self.lock().get(&key).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `addr..addr+len`; `owned` is the layout it was allocated with when the
    /// region owns it (freed on drop): such regions are the slots peers write, the others
    /// sources of writes only.
    ///
    /// # Safety
    /// As `Context::register`: the memory stays valid until the returned region is dropped.
    pub unsafe fn register(
        self: &Arc<RegionTable>,
        addr: *mut u8,
        len: usize,
        owned: Option<Layout>,
    ) -> Result<EmuRegion> {
        if addr.is_null() || len == 0 || len > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "{}: cannot register {len} bytes at {addr:p} (null, empty, or 4 GiB or more)",
                self.name
            )));
        }
        let mut entries = self.lock();
        let key = loop {
            let k = self.next_key.fetch_add(1, Ordering::Relaxed);
            if k != 0 && !entries.contains_key(&k) {
                break k;
            }
        };
        let entry = Arc::new(Entry {
            addr: addr as u64,
            len,
            live: RwLock::new(true),
            remote_write: owned.is_some(),
        });
        entries.insert(key, entry.clone());
        Ok(EmuRegion {
            table: self.clone(),
            entry,
            key,
            owned,
        })
    }

    /// Allocates `len` zeroed page-aligned bytes and registers them.
    pub fn alloc(self: &Arc<RegionTable>, len: usize) -> Result<EmuRegion> {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .map_err(|e| Error::invalid(format!("{}: allocating {len} bytes: {e}", self.name)))?;
        if len == 0 {
            return Err(Error::invalid(format!(
                "{}: cannot allocate an empty region",
                self.name
            )));
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::System(format!(
                "{}: out of memory allocating a {len}-byte region",
                self.name
            )));
        }
        // SAFETY: the region owns the allocation and frees it only after deregistering.
        unsafe { self.register(ptr, len, Some(layout)) }.inspect_err(|_| {
            // SAFETY: allocated just above with this layout, never handed out.
            unsafe { std::alloc::dealloc(ptr, layout) }
        })
    }
}

/// A registered region; dropping it deregisters (see the module doc), then frees memory it
/// allocated.
pub struct EmuRegion {
    table: Arc<RegionTable>,
    entry: Arc<Entry>,
    key: u32,
    owned: Option<Layout>,
}

impl Region for EmuRegion {
    fn ptr(&self) -> *mut u8 {
        self.entry.addr as *mut u8
    }

    fn len(&self) -> usize {
        self.entry.len
    }

    fn lkey(&self) -> u32 {
        self.key
    }

    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for EmuRegion {
    fn drop(&mut self) {
        self.table.lock().remove(&self.key);
        // Waits for a copy in progress; none starts after.
        *self.entry.live.write().unwrap_or_else(|p| p.into_inner()) = false;
        if let Some(layout) = self.owned {
            // SAFETY: allocated by `RegionTable::alloc` with this layout; deregistered above,
            // so no NIC thread touches it any more.
            unsafe { std::alloc::dealloc(self.entry.addr as *mut u8, layout) };
        }
    }
}
