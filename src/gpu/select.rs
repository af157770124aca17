//! The process's driver for device buffers: the emulated one under `QCCL_GPU_EMULATE=N`
//! (N devices, for tests and machines without a GPU), else the real one when libcuda and a
//! device are usable. Chosen once per process (the emulated devices' memory must outlive
//! every comm, as a GPU's does).

use super::driver::Driver;
use super::emu::EmuDriver;
use crate::error::{Error, Result};
use std::sync::{Arc, OnceLock};

/// Most emulated devices (a node's worth).
const MAX_EMULATED: usize = 16;

static DRIVER: OnceLock<Result<Arc<dyn Driver>>> = OnceLock::new();
/// Set by [`emulate`]; wins over the probed choice.
static CHOSEN: OnceLock<Arc<dyn Driver>> = OnceLock::new();
/// The emulated driver, once one was chosen (for its fault injection, [`emulated`]).
static EMULATED: OnceLock<Arc<EmuDriver>> = OnceLock::new();

/// The emulated driver with `n` devices: the process's one.
fn emu(n: usize) -> Arc<EmuDriver> {
    EMULATED.get_or_init(|| Arc::new(EmuDriver::new(n))).clone()
}

/// The process's emulated driver, if it runs on one (tests plan faults on it:
/// `EmuDriver::fail_next_copy`).
pub fn emulated_driver() -> Option<Arc<EmuDriver>> {
    driver().ok()?;
    EMULATED.get().cloned()
}

/// The driver, or why there is none (`Unsupported`, naming what is missing).
pub fn driver() -> Result<Arc<dyn Driver>> {
    if let Some(d) = CHOSEN.get() {
        return Ok(d.clone());
    }
    DRIVER.get_or_init(open).clone()
}

/// Chooses the emulated driver with `n` devices for this process, as QCCL_GPU_EMULATE=n
/// would, for tests that cannot set the variable before the process starts (a comm that
/// already staged buffers keeps its driver). An error when another choice was made so.
pub fn emulate(n: usize) -> Result<Arc<dyn Driver>> {
    let d = CHOSEN.get_or_init(|| emu(n)).clone();
    if d.device_count() != n {
        return Err(Error::InvalidUsage(format!(
            "the emulated driver with {} device(s) was already chosen for this process",
            d.device_count()
        )));
    }
    Ok(d)
}

fn open() -> Result<Arc<dyn Driver>> {
    if let Some(n) = emulated(std::env::var("QCCL_GPU_EMULATE").ok().as_deref())? {
        crate::qlog!(Info, "device buffers: emulated driver, {n} device(s)");
        return Ok(emu(n));
    }
    real()
}

/// QCCL_GPU_EMULATE: unset, empty or 0 for none; 1..=16 devices.
fn emulated(v: Option<&str>) -> Result<Option<usize>> {
    let Some(v) = v.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match v.parse::<usize>() {
        Ok(0) => Ok(None),
        Ok(n) if n <= MAX_EMULATED => Ok(Some(n)),
        _ => Err(Error::invalid(format!(
            "QCCL_GPU_EMULATE={v}: expected a number of emulated devices, 0 to {MAX_EMULATED}"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn real() -> Result<Arc<dyn Driver>> {
    Ok(Arc::new(super::cuda::CudaDriver::open()?))
}

#[cfg(not(feature = "cuda"))]
fn real() -> Result<Arc<dyn Driver>> {
    Err(Error::Unsupported(
        "device buffers: qccl was built without the `cuda` feature (QCCL_GPU_EMULATE=1 \
         selects the emulated driver)"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qccl_gpu_emulate_is_a_device_count() {
        assert_eq!(emulated(None).unwrap(), None);
        assert_eq!(emulated(Some(" ")).unwrap(), None);
        assert_eq!(emulated(Some("0")).unwrap(), None);
        assert_eq!(emulated(Some("2")).unwrap(), Some(2));
        for bad in ["x", "-1", "17"] {
            let e = emulated(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("QCCL_GPU_EMULATE"), "{e}");
        }
    }
}
