//! Deriving a per-rank count from a Rust slice (the typed in-place calls); every rule of a
//! call itself is `call::CollCall::validate`'s.

use crate::error::{Error, Result};

/// `total` elements must split evenly over `size` ranks.
pub fn divisible(coll: &str, buf: &str, total: usize, size: usize) -> Result<usize> {
    if !total.is_multiple_of(size) {
        return Err(Error::invalid(format!(
            "{coll}: {buf} holds {total} elements, not a multiple of the world size {size}"
        )));
    }
    Ok(total / size)
}
