//! Test helpers over the emulated GPU driver, added to the module only when QCCL_GPU_EMULATE
//! is set (internal, underscore-named: the Python device tests' way to get device memory
//! without a GPU). `_EmuArray` is emulated device memory exposing `__cuda_array_interface__`
//! (host code touching its address faults, as with a GPU pointer), filled and read through
//! the driver's copies; `_EmuStream` is a stream of the emulated driver, whose handle the
//! calls' `stream=` takes.

use crate::{err, py_err};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use qccl::internal::gpu_driver::{DeviceMem, Driver, Stream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a helper copy may wait for its stream.
const WAIT: Duration = Duration::from_secs(60);

/// True when QCCL_GPU_EMULATE asks for emulated devices (the helpers are added then).
pub(crate) fn wanted() -> bool {
    std::env::var("QCCL_GPU_EMULATE").is_ok_and(|v| !matches!(v.trim(), "" | "0"))
}

/// The process's driver, which must be the emulated one.
fn driver() -> PyResult<Arc<dyn Driver>> {
    let d = qccl::internal::gpu().map_err(py_err)?;
    if d.kind() != "emulated" {
        return Err(err(
            "usage",
            format!(
                "the qccl test helpers need the emulated driver, not '{}'",
                d.kind()
            ),
        ));
    }
    Ok(d)
}

/// Emulated device memory holding a C-contiguous array of `shape` and `typestr`.
#[pyclass(module = "qccl._qccl", name = "_EmuArray", frozen)]
pub(crate) struct EmuArray {
    driver: Arc<dyn Driver>,
    mem: Mutex<Box<dyn DeviceMem>>,
    addr: u64,
    nbytes: usize,
    ordinal: usize,
    shape: Vec<usize>,
    typestr: String,
}

impl EmuArray {
    /// Runs `f` on the caller's stream `raw` (0: a new stream of the helper's), then waits
    /// for that stream.
    fn on_stream(
        &self,
        py: Python<'_>,
        raw: u64,
        f: impl FnOnce(&dyn Stream) -> qccl::Result<()> + Send,
    ) -> PyResult<()> {
        let (driver, ordinal) = (self.driver.clone(), self.ordinal);
        py.allow_threads(move || {
            let s = if raw == 0 {
                driver.create_stream(ordinal)?
            } else {
                // SAFETY: a handle of the emulated driver, which refuses handles of streams
                // it does not know (InvalidArgument) instead of dereferencing them.
                unsafe { driver.borrow_stream(ordinal, raw as *mut std::ffi::c_void)? }
            };
            f(&*s)?;
            s.synchronize(WAIT)
        })
        .map_err(py_err)
    }
}

#[pymethods]
impl EmuArray {
    #[new]
    #[pyo3(signature = (shape, typestr, device=0))]
    fn new(shape: Vec<usize>, typestr: &str, device: usize) -> PyResult<EmuArray> {
        // Any numpy type string ("<u2" too: bfloat16 bits for a tensor-like wrapper).
        let itemsize = typestr
            .get(2..)
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| err("invalid", format!("_EmuArray: bad typestr '{typestr}'")))?;
        let nbytes = shape.iter().product::<usize>() * itemsize;
        let driver = driver()?;
        let mem = driver.alloc_device(device, nbytes.max(1)).map_err(py_err)?;
        Ok(EmuArray {
            addr: mem.addr(),
            mem: Mutex::new(mem),
            driver,
            nbytes,
            ordinal: device,
            shape,
            typestr: typestr.to_string(),
        })
    }

    /// The CUDA array interface (v3, C-contiguous, no stream).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", &self.typestr)?;
        d.set_item("data", (self.addr, false))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// The device address.
    #[getter]
    fn ptr(&self) -> u64 {
        self.addr
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Copies `data` (exactly `nbytes` bytes) in, on `stream` (a handle of the emulated
    /// driver; 0: a stream of the helper's), and waits for that stream.
    #[pyo3(signature = (data, stream=0))]
    fn copy_in(&self, py: Python<'_>, data: Vec<u8>, stream: u64) -> PyResult<()> {
        if data.len() != self.nbytes {
            return Err(err(
                "invalid",
                format!(
                    "_EmuArray.copy_in: {} bytes for {}",
                    data.len(),
                    self.nbytes
                ),
            ));
        }
        let _mem = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        let (addr, n, src) = (self.addr, self.nbytes, &data);
        // SAFETY: `data` (borrowed, not moved: it must outlive the copy) lives past the
        // stream's synchronize in `on_stream`; the memory holds `n` bytes and stays allocated
        // (its lock is held).
        self.on_stream(py, stream, move |s| unsafe {
            s.copy_to_device(addr, src.as_ptr(), n)
        })
    }

    /// Its bytes, copied out on `stream` (as `copy_in`) once the stream's earlier work is done.
    #[pyo3(signature = (stream=0))]
    fn copy_out<'py>(&self, py: Python<'py>, stream: u64) -> PyResult<Bound<'py, PyBytes>> {
        let _mem = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = vec![0u8; self.nbytes];
        let (addr, n, dst) = (self.addr, self.nbytes, out.as_mut_ptr() as usize);
        // SAFETY: `out` outlives the stream's synchronize in `on_stream` and is not touched
        // until then; the memory holds `n` bytes and stays allocated (its lock is held).
        self.on_stream(py, stream, move |s| unsafe {
            s.copy_to_host(dst as *mut u8, addr, n)
        })?;
        Ok(PyBytes::new(py, &out))
    }
}

/// A stream of the emulated driver.
#[pyclass(module = "qccl._qccl", name = "_EmuStream", frozen)]
pub(crate) struct EmuStream {
    stream: Mutex<Box<dyn Stream>>,
    handle: u64,
}

#[pymethods]
impl EmuStream {
    #[new]
    #[pyo3(signature = (device=0))]
    fn new(device: usize) -> PyResult<EmuStream> {
        let stream = driver()?.create_stream(device).map_err(py_err)?;
        Ok(EmuStream {
            handle: stream.raw() as u64,
            stream: Mutex::new(stream),
        })
    }

    /// The handle to pass as `stream=`.
    #[getter]
    fn handle(&self) -> u64 {
        self.handle
    }

    /// Waits (at most `timeout` seconds) for the work enqueued on the stream; raises its error.
    #[pyo3(signature = (timeout=60.0))]
    fn synchronize(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = Duration::from_secs_f64(timeout.max(0.0));
        py.allow_threads(|| {
            let s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
            s.synchronize(t)
        })
        .map_err(py_err)
    }
}
