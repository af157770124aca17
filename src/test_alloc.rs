//! Unit-test builds only: a global allocator that counts, per thread, the bytes requested
//! while a measurement is open, so that decoder properties can bound what bytes from the
//! network make the process allocate (not only what the decoded value holds).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Bytes requested on this thread since the open measurement began; `None` when none is.
    static REQUESTED: Cell<Option<usize>> = const { Cell::new(None) };
}

fn note(bytes: usize) {
    // `try_with`: the allocator may run while the thread's locals are being torn down.
    let _ = REQUESTED.try_with(|r| {
        if let Some(n) = r.get() {
            r.set(Some(n.saturating_add(bytes)));
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only a
// destructor-free thread local, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // The whole new size: an upper bound on what growing costs.
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` and returns its result with the bytes it requested from the allocator on this
/// thread (growth by `realloc` counted at its full new size). Not reentrant.
pub(crate) fn requested<T>(f: impl FnOnce() -> T) -> (T, usize) {
    REQUESTED.with(|r| r.set(Some(0)));
    let out = f();
    let n = REQUESTED.with(|r| r.take()).unwrap_or(0);
    (out, n)
}
