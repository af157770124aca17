//! Launch plans: a codec's or reduction's kernels (`kernels/`) in the order, shape and
//! arguments its shim driver (`kernels/shim/*_driver.cpp`) launches them, over the driver
//! contract, so the device path can encode, decode and reduce on the GPU. Each plan looks its
//! functions up once per device and only enqueues. Today: the float codecs (`floats.rs`),
//! qsgd (`qsgd.rs`), efsign and onebit (`sign.rs`) and the sparse ones (`sparse/`).

mod codec;
mod floats;
mod qsgd;
mod sign;
mod sparse;

pub use codec::{plan_for, CodecPlan};
pub use floats::{Convert, FloatPlan};
pub use qsgd::QsgdPlan;
pub use sign::SignPlan;
pub use sparse::SparsePlan;

/// Threads a block for grid-stride kernels.
pub const BLOCK: u32 = 256;

/// Most blocks a grid-stride launch uses: enough to fill any current device; the threads
/// stride over the rest.
pub const MAX_GRID: u32 = 1024;

/// Blocks for a grid-stride launch over `items` units of work (one thread each).
pub fn grid_for(items: usize) -> u32 {
    let blocks = items.div_ceil(BLOCK as usize);
    u32::try_from(blocks).unwrap_or(MAX_GRID).clamp(1, MAX_GRID)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_small_work_and_stop_at_the_cap() {
        assert_eq!(grid_for(0), 1);
        assert_eq!(grid_for(1), 1);
        assert_eq!(grid_for(256), 1);
        assert_eq!(grid_for(257), 2);
        assert_eq!(grid_for(usize::MAX), MAX_GRID);
    }
}
