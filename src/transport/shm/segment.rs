//! A POSIX shared-memory segment, created (mode 0600, must not exist) or opened by name and
//! mapped whole: the common ground of the pairwise rings (`ring.rs`) and the comm-wide arena
//! (`arena.rs`). Header words are handed out as atomics; data areas only through `unsafe`
//! accessors whose callers name the protocol that makes the access exclusive.

use crate::error::{Error, Result};
use memmap2::MmapMut;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// One mapped segment.
pub struct Segment {
    /// Owns the mapping; all access goes through `base`.
    _map: MmapMut,
    base: *mut u8,
    len: usize,
}

// SAFETY: `base` points into the mapping owned by `_map`, which moves with the Segment; the
// shared words are atomics and data areas are handed over by their users' protocols, so
// using a Segment from another thread is as safe as from this one.
unsafe impl Send for Segment {}

/// Every qccl segment's name starts with this (then the comm id, `-p<creator pid>`, and what
/// the segment is): the sweep below, tests and operators read the creator from it.
const PREFIX: &str = "/qccl-";

/// A fresh name for a segment of comm `comm_id` created by this process; `what` tells the
/// segments of one process and comm apart (e.g. `0-1` for the ring from rank 0 to rank 1).
pub fn new_name(comm_id: u64, what: &str) -> String {
    format!(
        "{PREFIX}{comm_id:016x}-p{}-{what}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// `name` if it is one a qccl peer would have made (prefix, no further `/`), for names
/// received from peers before opening them.
pub fn checked_name(name: &str) -> Option<&str> {
    (name.starts_with(PREFIX) && !name[1..].contains('/')).then_some(name)
}

impl Segment {
    /// Creates segment `name` of `len` bytes (mode 0600; it must not exist) and maps it.
    pub fn create(name: &str, len: usize) -> Result<Segment> {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_stale);
        let fd = shm_open(
            name,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(|e| Error::System(format!("shm_open({name}) to create: {e}")))?;
        let file = std::fs::File::from(fd);
        file.set_len(len as u64)
            .map_err(|e| Error::io(format!("sizing shared memory segment {name}"), e))?;
        Segment::map(&file, name, len)
    }

    /// Maps the existing segment `name`, which must have `len` bytes.
    pub fn open(name: &str, len: usize) -> Result<Segment> {
        let fd = shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| Error::System(format!("shm_open({name}): {e}")))?;
        let file = std::fs::File::from(fd);
        let have = file
            .metadata()
            .map_err(|e| Error::io(format!("reading the size of {name}"), e))?
            .len();
        if have != len as u64 {
            return Err(Error::InvalidUsage(format!(
                "shared memory segment {name} has {have} bytes, expected {len}"
            )));
        }
        Segment::map(&file, name, len)
    }

    fn map(file: &std::fs::File, name: &str, len: usize) -> Result<Segment> {
        // Populated (MAP_POPULATE): every page is allocated and mapped now, at setup, not
        // by page faults during the first collectives that reach it. A ring's small messages
        // walk through it, and each arena slot first reaches the end of its area at the first
        // call of a larger size: unpopulated, the first 4 calls of every new size (one per
        // slot) ran 2-5x slower (4 ranks, 64 KiB: 215-363 us against 55).
        //
        // SAFETY: the segment was sized before mapping and is never truncated while mapped
        // (only the ranks it was made for know its random name, and it is unlinked once they
        // mapped it). Concurrent access by them goes only through the atomics below and the
        // data areas their protocols hand over.
        let mut map = unsafe { memmap2::MmapOptions::new().populate().map_mut(file) }
            .map_err(|e| Error::io(format!("mapping shared memory segment {name}"), e))?;
        let base = map.as_mut_ptr();
        Ok(Segment {
            _map: map,
            base,
            len,
        })
    }

    /// Removes the name; mappings stay valid until dropped.
    pub fn unlink(name: &str) {
        let _ = shm_unlink(name);
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The 8-aligned word at `off`, as an atomic.
    pub fn word64(&self, off: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= self.len,
            "word64 at {off}"
        );
        // SAFETY: checked above: aligned (the mapping is page-aligned) and inside the mapping,
        // which outlives the returned borrow; all processes access the word atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    /// The 4-aligned word at `off`, as an atomic.
    pub fn word32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= self.len,
            "word32 at {off}"
        );
        // SAFETY: as in `word64`.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    /// Pointer to byte `off` (at most the length), for copies the caller's protocol allows.
    pub fn ptr(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len, "offset {off} past the segment");
        // SAFETY: inside the mapping (checked); only the pointer is computed.
        unsafe { self.base.add(off) }
    }

    /// Bytes [off, off + len) to read.
    ///
    /// # Safety
    /// No process writes them while the slice lives (the caller's protocol).
    pub unsafe fn bytes(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len, "bytes {off}+{len} past the segment");
        // SAFETY: inside the mapping (checked); unwritten while borrowed (the caller's promise).
        unsafe { std::slice::from_raw_parts(self.base.add(off), len) }
    }

    /// Bytes [off, off + len) to write.
    ///
    /// # Safety
    /// No process reads or writes them while the slice lives, and no other slice of them
    /// exists in this one (the caller's protocol).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len, "bytes {off}+{len} past the segment");
        // SAFETY: inside the mapping (checked); exclusive while borrowed (the caller's promise).
        unsafe { std::slice::from_raw_parts_mut(self.base.add(off), len) }
    }
}

/// Removes this user's qccl segments whose creator is gone. A segment's name is unlinked as
/// soon as the peers mapped it, so only a process killed during the few milliseconds of a
/// link's setup leaves one behind; the next qccl process on the host clears it. Names carry
/// the creator's pid (`qccl-<comm>-p<pid>-...`); a live pid, another user's file, or one
/// younger than a minute is kept.
fn sweep_stale() {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    // The owner of /proc/self is this process's effective user.
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix(&PREFIX[1..])
            .and_then(|rest| rest.split('-').find_map(|f| f.strip_prefix('p')))
            .and_then(|p| p.parse::<i32>().ok());
        // Older than a minute too: a link's setup takes milliseconds, and a creator in
        // another pid namespace (containers sharing /dev/shm) looks gone from here.
        let mine = entry.metadata().is_ok_and(|m| {
            let age = m.modified().ok().and_then(|t| t.elapsed().ok());
            m.uid() == me && age.is_some_and(|a| a > std::time::Duration::from_secs(60))
        });
        if let (Some(pid), true) = (pid, mine) {
            if pid > 0 && !super::alive(pid) {
                Segment::unlink(&format!("/{name}"));
                crate::qlog!(
                    Info,
                    "removed /dev/shm/{name}, left by process {pid} (gone)"
                );
            }
        }
    }
}
