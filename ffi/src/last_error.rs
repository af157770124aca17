//! Result codes, the boundary guard (no panic crosses it), and `qcclGetLastError`.

use crate::handle;
use crate::types::*;
use qccl_core::Error;
use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs the body of entry point `func`: its error, or a panic (as `qcclInternalError`), is
/// recorded as the thread's last error and as `comm`'s when `comm` is a live comm, and
/// returned as a code.
pub(crate) fn guard(
    func: &'static str,
    comm: qcclComm_t,
    f: impl FnOnce() -> qccl_core::Result<()>,
) -> qcclResult_t {
    let err = match no_panic(f) {
        Ok(()) => return qcclSuccess,
        Err(e) => e,
    };
    // Recording must not unwind either (it only formats and locks).
    let _ = catch_unwind(AssertUnwindSafe(|| record(func, comm, &err)));
    err.code()
}

/// Runs `f`, turning a panic into `Error::Internal` with its message. Also used inside the
/// closures that run in a comm's queue (grouped and non-blocking calls): a panic there
/// would otherwise end the comm's worker thread or never release the queue's turn.
pub(crate) fn no_panic<R>(f: impl FnOnce() -> qccl_core::Result<R>) -> qccl_core::Result<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(a non-string panic payload)".into());
        // Dropping a payload can itself panic; leak it instead.
        std::mem::forget(payload);
        Err(Error::Internal(format!("panic inside qccl: {msg}")))
    })
}

/// Records `err` from `func` as this thread's last error and, if `comm` is live, the comm's.
pub(crate) fn record(func: &str, comm: qcclComm_t, err: &Error) {
    let msg = format!("{func}: {err}");
    if let Some(h) = handle::lookup(comm) {
        *h.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg.clone());
    }
    THREAD_LAST.with(|t| *t.borrow_mut() = Some(msg));
}

thread_local! {
    static THREAD_LAST: RefCell<Option<String>> = const { RefCell::new(None) };
    static RING: RefCell<Ring> = const {
        RefCell::new(Ring {
            next: 0,
            bufs: Vec::new(),
        })
    };
}

const RING_SLOTS: usize = 8;
const SLOT_BYTES: usize = 4096;

/// The strings `qcclGetLastError` returns: each call copies into the next of eight
/// per-thread buffers that live as long as the thread, so a returned pointer never dangles
/// and stays unchanged for the next seven calls on that thread.
struct Ring {
    next: usize,
    bufs: Vec<Box<[u8; SLOT_BYTES]>>,
}

fn to_ring(msg: &str) -> *const c_char {
    RING.with(|r| {
        let mut r = r.borrow_mut();
        if r.bufs.is_empty() {
            r.bufs = (0..RING_SLOTS)
                .map(|_| Box::new([0u8; SLOT_BYTES]))
                .collect();
        }
        let i = r.next;
        r.next = (i + 1) % RING_SLOTS;
        let mut end = msg.len().min(SLOT_BYTES - 1);
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        let buf = &mut r.bufs[i];
        for (d, s) in buf.iter_mut().zip(msg[..end].bytes()) {
            *d = if s == 0 { b' ' } else { s };
        }
        buf[end] = 0;
        buf.as_ptr().cast()
    })
}

/// The text of a result code (static storage).
#[no_mangle]
pub extern "C" fn qcclGetErrorString(result: qcclResult_t) -> *const c_char {
    let s: &'static CStr = match result {
        qcclSuccess => c"no error",
        qcclUnhandledCudaError => c"unhandled CUDA error (not used: qccl is built without CUDA)",
        qcclSystemError => c"system error (a system call failed: socket, bind, thread, memory)",
        qcclInternalError => c"internal error (a bug in qccl, or a panic caught at the C boundary)",
        qcclInvalidArgument => c"invalid argument",
        qcclInvalidUsage => {
            c"invalid usage (destroyed or failed comm, call out of place, ranks that disagree)"
        }
        qcclRemoteError => c"remote error (a peer died, disconnected or failed)",
        qcclInProgress => c"operation in progress",
        qcclTimeout => c"timeout (a wait passed QCCL_TIMEOUT_MS)",
        qcclUnsupported => c"unsupported (not built or not implemented)",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The detailed message of the last failure on `comm` (`NULL`, or a handle that is not a
/// live comm: of the last failure on the calling thread); "" when there was none.
#[no_mangle]
pub extern "C" fn qcclGetLastError(comm: qcclComm_t) -> *const c_char {
    let found = catch_unwind(AssertUnwindSafe(|| {
        let comm_msg = handle::lookup(comm).map(|h| {
            h.last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .or_else(|| {
                    h.comm
                        .async_error()
                        .map(|e| format!("the comm failed: {e}"))
                })
                .unwrap_or_default()
        });
        let msg = comm_msg
            .unwrap_or_else(|| THREAD_LAST.with(|t| t.borrow().clone().unwrap_or_default()));
        to_ring(&msg)
    }));
    found.unwrap_or(c"qcclGetLastError: internal error while reading the message".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: qcclGetLastError returns a NUL-terminated string in a live thread buffer.
        unsafe { CStr::from_ptr(qcclGetLastError(std::ptr::null_mut())) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_internal_error_with_its_message() {
        let code = guard("qcclTestPanic", std::ptr::null_mut(), || {
            panic!("deliberate test panic {}", 42)
        });
        assert_eq!(code, qcclInternalError);
        let msg = last();
        assert!(msg.contains("qcclTestPanic"), "{msg}");
        assert!(msg.contains("deliberate test panic 42"), "{msg}");
        let code = guard("qcclTestPanic2", std::ptr::null_mut(), || {
            std::panic::panic_any(7u32)
        });
        assert_eq!(code, qcclInternalError);
        assert!(last().contains("non-string"));
    }

    #[test]
    fn errors_map_to_their_codes() {
        let code = guard("qcclX", std::ptr::null_mut(), || {
            Err(Error::Unsupported("nope".into()))
        });
        assert_eq!(code, qcclUnsupported);
        assert_eq!(last(), "qcclX: unsupported: nope");
        assert_eq!(guard("qcclY", std::ptr::null_mut(), || Ok(())), qcclSuccess);
        assert_eq!(
            last(),
            "qcclX: unsupported: nope",
            "success keeps the last error"
        );
    }

    #[test]
    fn long_messages_are_truncated_on_a_char_boundary() {
        let long = "é".repeat(5000);
        let p = to_ring(&long);
        // SAFETY: to_ring returns a NUL-terminated string in a live thread buffer.
        let s = unsafe { CStr::from_ptr(p) }.to_str().unwrap();
        assert!(s.len() < SLOT_BYTES && s.chars().all(|c| c == 'é'));
    }

    #[test]
    fn every_code_has_a_string() {
        for code in 0..=9 {
            // SAFETY: static NUL-terminated strings.
            let s = unsafe { CStr::from_ptr(qcclGetErrorString(code)) };
            assert!(!s.to_bytes().is_empty());
            assert_ne!(s.to_bytes(), b"unknown result code");
        }
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(qcclGetErrorString(99)) };
        assert_eq!(s.to_bytes(), b"unknown result code");
    }
}
