//! C buffers: checked (null, overflow, wrap-around) into `RawBuf`s when a call is made,
//! turned into slices only when the operation runs.

use qccl_core::{Error, Result};
use std::ffi::c_void;

/// A byte range of the caller's memory.
///
/// The C caller promises (the documented contract of every call) that the memory is valid
/// for the call's duration: until it returns for blocking calls, until `qcclGroupEnd` for
/// grouped ones, until `qcclWait` for non-blocking ones; and that nothing else writes a
/// buffer the call reads, or touches a buffer it writes, meanwhile.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a RawBuf is only turned into a slice by the one operation it was made for, while
// the caller keeps the memory alive and unaliased (see above); moving it to the comm's worker
// thread is what non-blocking and grouped calls need.
unsafe impl Send for RawBuf {}

impl RawBuf {
    pub(crate) const EMPTY: RawBuf = RawBuf {
        ptr: std::ptr::null_mut(),
        len: 0,
    };

    /// Checks `count` elements of `es` bytes, times `mult` (the world size for the whole
    /// buffers of all-gather, reduce-scatter and all-to-all), at `ptr`: NULL with a non-zero
    /// size, a size that overflows, or a range past the end of the address space are errors
    /// naming `name`.
    pub(crate) fn new(
        name: &str,
        ptr: *const c_void,
        count: usize,
        es: usize,
        mult: usize,
    ) -> Result<RawBuf> {
        let len = count
            .checked_mul(mult)
            .and_then(|n| n.checked_mul(es))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                let what = if mult == 1 {
                    format!("count {count} × {es} bytes")
                } else {
                    format!("count {count} × {mult} ranks × {es} bytes")
                };
                Error::invalid(format!(
                    "{name}: {what} overflows (more than isize::MAX bytes)"
                ))
            })?;
        if len == 0 {
            return Ok(RawBuf::EMPTY);
        }
        if ptr.is_null() {
            return Err(Error::invalid(format!(
                "{name} is NULL but count is {count} (> 0)"
            )));
        }
        if (ptr as usize).checked_add(len).is_none() {
            return Err(Error::invalid(format!(
                "{name} {ptr:p} + {len} bytes wraps around the address space"
            )));
        }
        Ok(RawBuf {
            ptr: ptr as *mut u8,
            len,
        })
    }

    /// The same length at `ptr` (a staged copy of this buffer).
    pub(crate) fn at(ptr: *mut u8, len: usize) -> RawBuf {
        if len == 0 {
            return RawBuf::EMPTY;
        }
        RawBuf { ptr, len }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn start(&self) -> usize {
        self.ptr as usize
    }

    /// True when both are non-empty and share a byte.
    pub(crate) fn overlaps(&self, other: &RawBuf) -> bool {
        self.len > 0
            && other.len > 0
            && self.start() < other.start() + other.len
            && other.start() < self.start() + self.len
    }

    /// True when `self` starts `offset` bytes into `other` (and both are non-empty).
    pub(crate) fn starts_at(&self, other: &RawBuf, offset: usize) -> bool {
        self.len > 0 && other.len > 0 && self.start() == other.start() + offset
    }

    /// The memory as a shared slice.
    ///
    /// # Safety
    /// The caller's contract (type docs) holds for the slice's whole life, and no `&mut`
    /// slice of an overlapping `RawBuf` is alive meanwhile.
    pub(crate) unsafe fn slice<'a>(&self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: non-null, `len` bytes inside the address space and at most isize::MAX
        // (checked in `new`); valid and not written meanwhile by this function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The memory as a mutable slice.
    ///
    /// # Safety
    /// As `slice`, and no other slice of an overlapping `RawBuf` is alive meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(&self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`; exclusive by this function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks() {
        let p = 0x1000 as *const c_void;
        assert!(RawBuf::new("x", std::ptr::null(), 0, 4, 1).is_ok());
        let e = RawBuf::new("sendbuff", std::ptr::null(), 3, 4, 1).unwrap_err();
        assert!(e.to_string().contains("sendbuff is NULL"), "{e}");
        let e = RawBuf::new("recvbuff", p, usize::MAX / 2, 4, 1).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        let e = RawBuf::new("recvbuff", p, usize::MAX / 8, 2, 3).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        let e = RawBuf::new("b", usize::MAX as *const c_void, 2, 1, 1).unwrap_err();
        assert!(e.to_string().contains("wraps"), "{e}");
        let a = RawBuf::new("a", p, 4, 4, 1).unwrap();
        let b = RawBuf::new("b", 0x100c as *const c_void, 4, 4, 1).unwrap();
        let c = RawBuf::new("c", 0x1010 as *const c_void, 4, 4, 1).unwrap();
        assert!(a.overlaps(&b) && !a.overlaps(&c) && !a.overlaps(&RawBuf::EMPTY));
        assert!(c.starts_at(&a, 16) && !c.starts_at(&a, 12));
    }
}
