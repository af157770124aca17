//! Argument checks, run before an operation is queued, so bad input fails before any byte
//! moves and without poisoning the comm.

use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp};

/// `buf` of `coll` holds `have` elements where `want` are needed.
pub fn len(coll: &str, buf: &str, have: usize, want: usize) -> Result<()> {
    if have != want {
        return Err(Error::invalid(format!(
            "{coll}: {buf} holds {have} elements but {want} are needed"
        )));
    }
    Ok(())
}

/// `total` elements must split evenly over `size` ranks.
pub fn divisible(coll: &str, buf: &str, total: usize, size: usize) -> Result<usize> {
    if total % size != 0 {
        return Err(Error::invalid(format!(
            "{coll}: {buf} holds {total} elements, not a multiple of the world size {size}"
        )));
    }
    Ok(total / size)
}

/// `root` must be a rank of the comm.
pub fn root(coll: &str, root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::invalid(format!(
            "{coll}: root {root} is out of range for a comm of {size} ranks"
        )));
    }
    Ok(())
}

/// `peer` must be another rank of the comm.
pub fn peer(what: &str, peer: usize, rank: usize, size: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::invalid(format!(
            "{what}: peer {peer} is out of range for a comm of {size} ranks"
        )));
    }
    if peer == rank {
        return Err(Error::invalid(format!(
            "{what}: peer {peer} is this rank; a rank cannot {what} to or from itself"
        )));
    }
    Ok(())
}

/// `op` must apply to `dtype`.
pub fn op(coll: &str, op: ReduceOp, dtype: DType) -> Result<()> {
    op.check_dtype(dtype)
        .map_err(|e| Error::invalid(format!("{coll}: {e}")))
}
