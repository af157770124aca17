//! Is a CUDA driver usable: libcuda present, `cuInit` succeeds, at least one device. Probed once
//! per process, since `cuInit` is not free and the answer does not change.
//!
//! The order matters: cudarc's dynamic loading panics on the first driver call when libcuda
//! cannot be opened, so its presence is checked before anything is called.

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::{Error, Result};

/// The process's answer: the device count, or why there is none.
pub(super) fn device_count() -> Result<usize> {
    static PROBE: OnceLock<Result<usize>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Result<usize> {
    // SAFETY: only dlopens the candidate names of libcuda (and closes them again); opening the
    // driver library runs its initialisers, which any CUDA program does on start.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Unsupported(
            "no CUDA driver (libcuda.so.1) found".into(),
        ));
    }
    match result::init() {
        Ok(()) => {}
        // A driver installed on a machine without a GPU (or with none visible) says so here.
        Err(result::DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => {
            return Err(no_device());
        }
        Err(e) => {
            return Err(Error::Unsupported(format!(
                "the CUDA driver did not initialise: {e}"
            )))
        }
    }
    let n = result::device::get_count()
        .map_err(|e| Error::Unsupported(format!("the CUDA driver cannot count devices: {e}")))?;
    match usize::try_from(n) {
        Ok(n) if n > 0 => {
            crate::qlog!(Info, "CUDA driver found, {n} device(s)");
            Ok(n)
        }
        _ => Err(no_device()),
    }
}

fn no_device() -> Error {
    Error::Unsupported("no CUDA device".into())
}
