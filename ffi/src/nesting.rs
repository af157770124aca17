//! How deep this thread stands inside `qcclGroupStart`/`qcclGroupEnd`. A leaf of its own so
//! that describing a call (`op.rs`) can ask without importing the group that queues it.

use std::cell::Cell;

thread_local! {
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// True between `qcclGroupStart` and the matching outermost `qcclGroupEnd` on this thread.
pub(crate) fn in_group() -> bool {
    depth() > 0
}

/// Groups open on this thread.
pub(crate) fn depth() -> usize {
    DEPTH.with(Cell::get)
}

/// A `qcclGroupStart`.
pub(crate) fn enter() {
    DEPTH.with(|d| d.set(d.get() + 1));
}

/// A `qcclGroupEnd` of an open group: the depth left.
pub(crate) fn leave() -> usize {
    DEPTH.with(|d| {
        let left = d.get().saturating_sub(1);
        d.set(left);
        left
    })
}
