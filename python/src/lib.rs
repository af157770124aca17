//! `qccl._qccl`: the native module of the `qccl` Python package (PyO3, abi3).
//!
//! Buffers are numpy arrays (or anything with `__array_interface__`) and torch CPU tensors,
//! read and written in place through their data pointer: no copy. They must be C-contiguous
//! and of one of qccl's ten element types. The GIL is released while a collective runs, so
//! other Python threads go on; the caller must not resize or free a buffer while a call on it
//! runs (the call holds a reference to the object, so it cannot be collected).
//!
//! qccl's errors become the exceptions of `qccl.errors` carrying qccl's message.

use device::{Job, Outcome, Target};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyType};
use qccl::internal::{Buf as CallSize, Coll, CollCall};
use qccl::{
    Algo, Compression, Config, DType, Layout, ReduceOp, RegHandle, TopK, TopKScheme, UniqueId,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod device;
mod emulated;

// ---- errors ----------------------------------------------------------------------------------

/// The `qccl.errors` class for a qccl error.
fn class_name(e: &qccl::Error) -> &'static str {
    match e {
        qccl::Error::InvalidArgument(_) => "InvalidArgumentError",
        qccl::Error::InvalidUsage(_) => "InvalidUsageError",
        qccl::Error::System(_) => "QcclSystemError",
        qccl::Error::Remote { .. } => "RemoteError",
        qccl::Error::Timeout(_) => "QcclTimeoutError",
        qccl::Error::Aborted(_) => "AbortedError",
        qccl::Error::Unsupported(_) => "UnsupportedError",
        qccl::Error::Internal(_) => "InternalError",
        _ => "QcclError",
    }
}

/// A Python exception of the matching `qccl.errors` class with qccl's message.
fn py_err(e: qccl::Error) -> PyErr {
    Python::with_gil(|py| {
        let msg = e.to_string();
        let class = py
            .import("qccl.errors")
            .and_then(|m| m.getattr(class_name(&e)))
            .and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(c) => PyErr::from_type(c, msg),
            Err(_) => PyRuntimeError::new_err(msg),
        }
    })
}

/// An error of a given `qccl.errors` class raised by the binding itself.
fn err(class: &'static str, msg: String) -> PyErr {
    py_err(match class {
        "unsupported" => qccl::Error::Unsupported(msg),
        "usage" => qccl::Error::InvalidUsage(msg),
        _ => qccl::Error::InvalidArgument(msg),
    })
}

trait IntoPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for qccl::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(py_err)
    }
}

// ---- buffers ---------------------------------------------------------------------------------

/// A contiguous host buffer of a Python object.
#[derive(Clone, Copy)]
struct Buf {
    ptr: usize,
    bytes: usize,
    numel: usize,
    dtype: DType,
    readonly: bool,
    /// Device memory by its owner's word (a CUDA tensor or `__cuda_array_interface__`):
    /// never read or written here, only through the device path (`device.rs`).
    device: bool,
    /// The v3 CUDA array interface's `stream`, if it names one.
    stream: Option<u64>,
}

impl Buf {
    /// No buffer (a call's unused side).
    const EMPTY: Buf = Buf {
        ptr: 0,
        bytes: 0,
        numel: 0,
        dtype: DType::Uint8,
        readonly: false,
        device: false,
        stream: None,
    };

    /// The buffer as bytes.
    ///
    /// Callers pass only buffers whose object they hold for the duration of the use (an
    /// argument of the running call), and never two overlapping buffers of which one is
    /// mutable (see `distinct`).
    fn slice<'a>(&self) -> &'a [u8] {
        if self.bytes == 0 {
            return &[];
        }
        // SAFETY: `ptr` is the data pointer of a live, C-contiguous host buffer of `bytes`
        // bytes (checked by `buf_of`); its object is an argument of the running call, so it
        // is not collected before the call returns. No mutable slice over the same bytes
        // exists at the same time (`distinct` is checked before a pair is used).
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes) }
    }

    /// The buffer as mutable bytes; see `slice`.
    #[allow(clippy::mut_from_ref)]
    fn slice_mut<'a>(&self) -> PyResult<&'a mut [u8]> {
        if self.readonly {
            return Err(err("invalid", "the output buffer is read-only".to_string()));
        }
        if self.bytes == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `slice`, and the buffer is writable (not flagged read-only); the
        // binding creates at most one slice (mutable or not) over these bytes per call.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.bytes) })
    }

    fn overlaps(&self, o: &Buf) -> bool {
        self.bytes > 0 && o.bytes > 0 && self.ptr < o.ptr + o.bytes && o.ptr < self.ptr + self.bytes
    }

    /// The same non-empty bytes (two empty buffers are never "the same": nothing aliases).
    fn same(&self, o: &Buf) -> bool {
        self.bytes > 0 && self.ptr == o.ptr && self.bytes == o.bytes
    }
}

/// torch's dtype names (`str(tensor.dtype)`) and numpy's type strings.
fn dtype_of_name(name: &str) -> Option<DType> {
    Some(match name {
        "torch.int8" | "|i1" | "<i1" => DType::Int8,
        "torch.uint8" | "|u1" | "<u1" => DType::Uint8,
        "torch.int32" | "<i4" => DType::Int32,
        "torch.uint32" | "<u4" => DType::Uint32,
        "torch.int64" | "<i8" => DType::Int64,
        "torch.uint64" | "<u8" => DType::Uint64,
        "torch.float16" | "<f2" => DType::Float16,
        "torch.float32" | "<f4" => DType::Float32,
        "torch.float64" | "<f8" => DType::Float64,
        "torch.bfloat16" => DType::Bfloat16,
        _ => return None,
    })
}

const DTYPES: &str =
    "int8, uint8, int32, uint32, int64, uint64, float16, float32, float64, bfloat16";

/// Reads the data pointer, size and element type of a torch tensor or an object with the
/// numpy array interface.
fn buf_of(what: &str, obj: &Bound<'_, PyAny>) -> PyResult<Buf> {
    if obj.hasattr("data_ptr")? && obj.hasattr("is_contiguous")? {
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" && device != "cuda" {
            return Err(err(
                "unsupported",
                format!("{what}: a tensor on device '{device}'; qccl handles CPU and CUDA tensors"),
            ));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(err(
                "invalid",
                format!("{what}: the tensor is not contiguous (call .contiguous() first)"),
            ));
        }
        let name: String = obj.getattr("dtype")?.str()?.extract()?;
        let dtype = dtype_of_name(&name).ok_or_else(|| {
            err(
                "unsupported",
                format!("{what}: dtype {name} is not supported by qccl (supported: {DTYPES})"),
            )
        })?;
        let numel: usize = obj.call_method0("numel")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        return Ok(Buf {
            ptr,
            bytes: numel * dtype.size(),
            numel,
            dtype,
            readonly: false,
            device: device == "cuda",
            stream: None,
        });
    }
    if let Some(ai) = device::interface(obj)? {
        let mut b = interface_buf(what, &ai, "__cuda_array_interface__")?;
        b.device = true;
        b.stream = device::interface_stream(what, &ai)?;
        return Ok(b);
    }
    let ai = obj.getattr("__array_interface__").map_err(|_| {
        PyTypeError::new_err(format!(
            "{what}: expected a numpy array, a torch tensor or an object with \
             __cuda_array_interface__, got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    interface_buf(what, ai.downcast::<PyDict>()?, "__array_interface__")
}

/// The buffer an array interface dict describes (numpy's `__array_interface__` or the CUDA
/// array interface, which share these keys): C-contiguous, of a qccl element type.
fn interface_buf(what: &str, ai: &Bound<'_, PyDict>, name: &str) -> PyResult<Buf> {
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        ai.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("{what}: {name} has no '{k}'")))
    };
    if ai.get_item("mask")?.is_some_and(|m| !m.is_none()) {
        return Err(err(
            "unsupported",
            format!("{what}: masked arrays are not supported ({name} has a mask)"),
        ));
    }
    let typestr: String = get("typestr")?.extract()?;
    let dtype = dtype_of_name(&typestr).ok_or_else(|| {
        err(
            "unsupported",
            format!(
                "{what}: array type '{typestr}' is not supported by qccl (supported: {DTYPES}, little-endian)"
            ),
        )
    })?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let numel: usize = shape.iter().product();
    if let Some(strides) = ai.get_item("strides")? {
        if !strides.is_none() && numel > 1 {
            let strides: Vec<isize> = strides.extract()?;
            let mut expect = dtype.size() as isize;
            for (s, n) in strides.iter().zip(&shape).rev() {
                if *n > 1 && *s != expect {
                    return Err(err(
                        "invalid",
                        format!(
                            "{what}: the array is not C-contiguous (strides {strides:?} for \
                             shape {shape:?}; make a contiguous copy first)"
                        ),
                    ));
                }
                expect *= *n as isize;
            }
        }
    }
    let (ptr, readonly): (usize, bool) = get("data")?.extract()?;
    Ok(Buf {
        ptr,
        bytes: numel * dtype.size(),
        numel,
        dtype,
        readonly,
        device: false,
        stream: None,
    })
}

fn opt_buf(what: &str, obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Buf>> {
    obj.filter(|o| !o.is_none())
        .map(|o| buf_of(what, o))
        .transpose()
}

/// `send` and `recv` must have the same element type and must not partly overlap; the same
/// buffer twice means in place (returns None for send).
fn pair(coll: &str, send: Option<Buf>, recv: &Buf) -> PyResult<Option<Buf>> {
    let Some(s) = send else { return Ok(None) };
    if s.dtype != recv.dtype {
        return Err(err(
            "invalid",
            format!(
                "{coll}: send is {} but recv is {}; both must have one element type",
                s.dtype, recv.dtype
            ),
        ));
    }
    if s.same(recv) {
        return Ok(None);
    }
    if s.overlaps(recv) {
        return Err(err(
            "invalid",
            format!("{coll}: send and recv overlap without being the same buffer"),
        ));
    }
    Ok(Some(s))
}

fn per_rank(coll: &str, what: &str, numel: usize, size: usize) -> PyResult<usize> {
    if !numel.is_multiple_of(size) {
        return Err(err(
            "invalid",
            format!("{coll}: {what} has {numel} elements, not a multiple of the {size} ranks"),
        ));
    }
    Ok(numel / size)
}

// ---- arguments -------------------------------------------------------------------------------

/// A reduction op: its name (`sum`, `prod`, `max`, `min`, `avg`) or NCCL number.
fn op_of(op: &Bound<'_, PyAny>) -> PyResult<ReduceOp> {
    if let Ok(v) = op.extract::<i32>() {
        return ReduceOp::from_i32(v).py();
    }
    let s: String = op.extract()?;
    match s.to_ascii_lowercase().as_str() {
        "sum" => Ok(ReduceOp::Sum),
        "prod" | "product" => Ok(ReduceOp::Prod),
        "max" => Ok(ReduceOp::Max),
        "min" => Ok(ReduceOp::Min),
        "avg" | "mean" => Ok(ReduceOp::Avg),
        other => Err(err(
            "invalid",
            format!("unknown reduction op '{other}' (valid: sum, prod, max, min, avg)"),
        )),
    }
}

fn algo_of(algo: Option<&str>) -> PyResult<Option<Algo>> {
    algo.map(|a| Algo::parse(a).py()).transpose()
}

fn config(timeout: Option<f64>) -> PyResult<Config> {
    let mut c = Config::from_env().py()?;
    if let Some(t) = timeout {
        if !(t > 0.0 && t.is_finite()) {
            return Err(err("invalid", format!("timeout must be positive, got {t}")));
        }
        c.timeout = Duration::from_secs_f64(t);
        c.init_timeout = c.timeout;
    }
    Ok(c)
}

// ---- the comm ------------------------------------------------------------------------------

/// A qccl communicator: one rank of a group of processes (see `qccl.Comm`).
#[pyclass(module = "qccl._qccl", name = "Comm", frozen)]
struct PyComm {
    inner: Mutex<Option<Arc<qccl::Comm>>>,
    rank: usize,
    size: usize,
    /// The objects registered under each handle (`register`), one per registration: held
    /// until their deregistration (or `close`), so a registered buffer is not freed.
    registered: Mutex<HashMap<u64, Vec<Py<PyAny>>>>,
}

impl PyComm {
    fn wrap(c: qccl::Comm) -> PyComm {
        PyComm {
            rank: c.rank(),
            size: c.size(),
            inner: Mutex::new(Some(Arc::new(c))),
            registered: Mutex::new(HashMap::new()),
        }
    }

    fn registered(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<Py<PyAny>>>> {
        self.registered.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn comm(&self) -> PyResult<Arc<qccl::Comm>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| err("usage", "the comm is closed".to_string()))
    }
}

fn report_dict<'py>(
    py: Python<'py>,
    algo: &str,
    sent: u64,
    received: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("algo", algo)?;
    d.set_item("sent", sent)?;
    d.set_item("received", received)?;
    Ok(d)
}

/// A typed view of a float buffer for the top-k calls.
macro_rules! with_float {
    ($buf:expr, $dtype:expr, |$s:ident| $body:expr) => {
        match $dtype {
            DType::Float32 => {
                let $s: &mut [f32] = cast($buf)?;
                $body
            }
            DType::Float64 => {
                let $s: &mut [f64] = cast($buf)?;
                $body
            }
            DType::Float16 => {
                let $s: &mut [half::f16] = cast($buf)?;
                $body
            }
            DType::Bfloat16 => {
                let $s: &mut [half::bf16] = cast($buf)?;
                $body
            }
            other => Err(qccl::Error::Unsupported(format!(
                "top-k all-reduce needs a floating-point buffer, got {other}"
            ))),
        }
    };
}

fn cast<T: bytemuck::Pod>(b: &mut [u8]) -> qccl::Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(b)
        .map_err(|e| qccl::Error::invalid(format!("the buffer is not aligned for its type: {e}")))
}

#[pymethods]
impl PyComm {
    /// Joins the group of `size` ranks named by `unique_id` (bytes from `qccl.unique_id()`)
    /// as `rank`. `timeout` (seconds) bounds the rendezvous and every later wait (default:
    /// QCCL_TIMEOUT_MS).
    #[staticmethod]
    #[pyo3(signature = (unique_id, rank, size, timeout=None))]
    fn init(
        py: Python<'_>,
        unique_id: &[u8],
        rank: usize,
        size: usize,
        timeout: Option<f64>,
    ) -> PyResult<PyComm> {
        let id = UniqueId::from_bytes(unique_id).py()?;
        let cfg = config(timeout)?;
        let c = py
            .allow_threads(|| qccl::Comm::init(&id, rank, size, cfg))
            .py()?;
        Ok(PyComm::wrap(c))
    }

    /// Joins the group described by the environment (torchrun, mpirun, srun or QCCL_*).
    #[staticmethod]
    fn from_env(py: Python<'_>) -> PyResult<PyComm> {
        Ok(PyComm::wrap(py.allow_threads(qccl::Comm::from_env).py()?))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// This rank among the ranks of its host.
    #[getter]
    fn local_rank(&self) -> PyResult<usize> {
        Ok(self.comm()?.local_rank())
    }

    /// The number of ranks on this host.
    #[getter]
    fn local_size(&self) -> PyResult<usize> {
        Ok(self.comm()?.local_size())
    }

    /// The transport between the ranks (`shm`, `tcp`, `inproc`, ...).
    #[getter]
    fn transport(&self) -> PyResult<&'static str> {
        Ok(self.comm()?.transport_name())
    }

    /// True once `close()` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// recv[i] = op over ranks of send[i]; in place in `send` when `recv` is None. `op`: "sum"
    /// (default), "prod", "max", "min", "avg" (floats) or NCCL's number; `algo`: ring, tree,
    /// sra, auto. Returns the algorithm that ran (None when enqueued on a stream).
    #[pyo3(signature = (send, recv=None, op=None, algo=None, stream=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        algo: Option<&str>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<String>> {
        let c = self.comm()?;
        let op = op.map(op_of).transpose()?.unwrap_or(ReduceOp::Sum);
        let algo = algo_of(algo)?;
        let s = buf_of("all_reduce: send", send)?;
        let (send, recv) = match opt_buf("all_reduce: recv", recv)? {
            Some(r) => (pair("all_reduce", Some(s), &r)?, r),
            None => (None, s),
        };
        if let Some(t) = device::target(stream, &[send, Some(recv)])? {
            let (n, dt) = (recv.numel, recv.dtype);
            let call = CollCall::new(Coll::AllReduce, n, dt)
                .op(op)
                .bufs(sized(send), CallSize::Bytes(recv.bytes));
            check(&c, &call).py()?;
            let prepared = c.prepare_all_reduce(n, dt, op, algo).py()?;
            if c.dense_path(t.stream()) {
                // The core's entry: over CUDA IPC when every rank's buffers are on one device,
                // else through one host's arena, the GPU copying into and out of it.
                return device::run_dense(py, &c, t, &prepared, send, recv).map(Some);
            }
            let job = Job::AllReduce(Box::new(prepared));
            return Ok(
                device::run(py, &c, t, job, send, recv)?.and_then(|o| match o {
                    Outcome::Algo(a) => Some(a.name().to_string()),
                    _ => None,
                }),
            );
        }
        let (rs, n, dt) = (recv.slice_mut()?, recv.numel, recv.dtype);
        let ss = send.map(|b| b.slice());
        let a = py
            .allow_threads(|| c.all_reduce_raw(ss, rs, n, dt, op, algo))
            .py()?;
        Ok(Some(a.name().to_string()))
    }

    /// Rank r's `recv` gets the reduction of part r of every rank's `send` (size x len(recv)).
    /// With `send` None, `recv` is the whole buffer and the result lands in this rank's part.
    #[pyo3(signature = (send, recv, op=None, stream=None))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const C: &str = "reduce_scatter";
        let c = self.comm()?;
        let op = op.map(op_of).transpose()?.unwrap_or(ReduceOp::Sum);
        let r = buf_of("reduce_scatter: recv", recv)?;
        let s = pair(C, opt_buf("reduce_scatter: send", send)?, &r)?;
        let count = match s {
            Some(_) => r.numel,
            None => per_rank(C, "the buffer", r.numel, self.size)?,
        };
        if let Some(t) = device::target(stream, &[s, Some(r)])? {
            let call = CollCall::new(Coll::ReduceScatter, count, r.dtype)
                .op(op)
                .bufs(sized(s), CallSize::Bytes(r.bytes));
            return on_device(py, &c, t, call, s, r);
        }
        let (rs, ss, dt) = (r.slice_mut()?, s.map(|b| b.slice()), r.dtype);
        py.allow_threads(|| c.reduce_scatter_raw(ss, rs, count, dt, op))
            .py()
    }

    /// `recv` (size x len(send)) gets every rank's `send` in rank order; in place when `send`
    /// is None or this rank's part of `recv`.
    #[pyo3(signature = (send, recv, stream=None))]
    fn all_gather(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const C: &str = "all_gather";
        let c = self.comm()?;
        let r = buf_of("all_gather: recv", recv)?;
        let s0 = opt_buf("all_gather: send", send)?;
        let count = match s0 {
            Some(s) => s.numel,
            None => per_rank(C, "recv", r.numel, self.size)?,
        };
        let s = match s0 {
            Some(s) if s.overlaps(&r) => {
                // In place is only the rank's own slot of recv.
                let slot = r.ptr + self.rank * count * r.dtype.size();
                if s.ptr != slot || s.dtype != r.dtype {
                    return Err(err(
                        "invalid",
                        format!("{C}: send overlaps recv without being this rank's slot of it"),
                    ));
                }
                None
            }
            s => pair(C, s, &r)?,
        };
        if let Some(t) = device::target(stream, &[s0, Some(r)])? {
            let call = CollCall::new(Coll::AllGather, count, r.dtype)
                .bufs(sized(s), CallSize::Bytes(r.bytes));
            return on_device(py, &c, t, call, s, r);
        }
        let (rs, ss, dt) = (r.slice_mut()?, s.map(|b| b.slice()), r.dtype);
        py.allow_threads(|| c.all_gather_raw(ss, rs, count, dt))
            .py()
    }

    /// Broadcast of `buf` from `root`, in place.
    #[pyo3(signature = (buf, root, stream=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        root: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let c = self.comm()?;
        let b = buf_of("broadcast: buf", buf)?;
        if let Some(t) = device::target(stream, &[Some(b)])? {
            let call = CollCall::new(Coll::Broadcast, b.numel, b.dtype)
                .root(root)
                .bufs(CallSize::None, CallSize::Bytes(b.bytes));
            return on_device(py, &c, t, call, None, b);
        }
        let (bs, n, dt) = (b.slice_mut()?, b.numel, b.dtype);
        py.allow_threads(|| c.broadcast_raw(None, bs, n, dt, root))
            .py()
    }

    /// Reduction of every rank's `send` onto root's `recv`; in place in `recv` when `send` is
    /// None; `recv` may be None off the root.
    #[pyo3(signature = (send, recv, op=None, root=0, stream=None))]
    fn reduce(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: Option<&Bound<'_, PyAny>>,
        op: Option<&Bound<'_, PyAny>>,
        root: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const C: &str = "reduce";
        let c = self.comm()?;
        let op = op.map(op_of).transpose()?.unwrap_or(ReduceOp::Sum);
        let s = opt_buf("reduce: send", send)?;
        let r = opt_buf("reduce: recv", recv)?;
        if let Some(t) = device::target(stream, &[s, r])? {
            let (send, recv, n) = match (s, r) {
                (None, None) => {
                    return Err(err("invalid", format!("{C}: give send, recv or both")))
                }
                (Some(s), None) => (Some(s), Buf::EMPTY, s.numel),
                (s, Some(r)) => {
                    let s = pair(C, s, &r)?;
                    (s, r, s.map_or(r.numel, |s| s.numel))
                }
            };
            let dt = send.map_or(recv.dtype, |s| s.dtype);
            let call = CollCall::new(Coll::Reduce, n, dt)
                .op(op)
                .root(root)
                .bufs(sized(send), CallSize::Bytes(recv.bytes));
            return on_device(py, &c, t, call, send, recv);
        }
        match (s, r) {
            (None, None) => Err(err("invalid", format!("{C}: give send, recv or both"))),
            (Some(s), None) => {
                let (ss, n, dt) = (s.slice(), s.numel, s.dtype);
                py.allow_threads(|| c.reduce_raw(Some(ss), &mut [], n, dt, op, root))
                    .py()
            }
            (s, Some(r)) => {
                let s = pair(C, s, &r)?;
                let n = s.map_or(r.numel, |s| s.numel);
                let (rs, ss, dt) = (r.slice_mut()?, s.map(|b| b.slice()), r.dtype);
                py.allow_threads(|| c.reduce_raw(ss, rs, n, dt, op, root))
                    .py()
            }
        }
    }

    /// Part p of `send` goes to rank p; part q of `recv` comes from rank q.
    #[pyo3(signature = (send, recv, stream=None))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const C: &str = "all_to_all";
        let c = self.comm()?;
        let r = buf_of("all_to_all: recv", recv)?;
        let s = buf_of("all_to_all: send", send)?;
        if pair(C, Some(s), &r)?.is_none() {
            return Err(err(
                "invalid",
                format!("{C}: send and recv must be distinct buffers"),
            ));
        }
        let count = per_rank(C, "send", s.numel, self.size)?;
        if let Some(t) = device::target(stream, &[Some(s), Some(r)])? {
            let call = CollCall::new(Coll::AllToAll, count, r.dtype)
                .bufs(CallSize::Bytes(s.bytes), CallSize::Bytes(r.bytes));
            return on_device(py, &c, t, call, Some(s), r);
        }
        let (rs, ss, dt) = (r.slice_mut()?, s.slice(), r.dtype);
        py.allow_threads(|| c.all_to_all_raw(ss, rs, count, dt))
            .py()
    }

    /// Root's `recv` (size x len(send)) gets every rank's `send` in rank order; `recv` may be
    /// None off the root.
    #[pyo3(signature = (send, recv, root=0, stream=None))]
    fn gather(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        root: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const C: &str = "gather";
        let c = self.comm()?;
        let s = buf_of("gather: send", send)?;
        let r = opt_buf("gather: recv", recv)?;
        if let Some(r) = r {
            if s.dtype != r.dtype || s.overlaps(&r) {
                return Err(err(
                    "invalid",
                    format!("{C}: send and recv must be distinct buffers of one element type"),
                ));
            }
        }
        if let Some(t) = device::target(stream, &[Some(s), r])? {
            let r = r.unwrap_or(Buf::EMPTY);
            let call = CollCall::new(Coll::Gather, s.numel, s.dtype)
                .root(root)
                .bufs(CallSize::Bytes(s.bytes), CallSize::Bytes(r.bytes));
            return on_device(py, &c, t, call, Some(s), r);
        }
        let rs = match r {
            Some(r) => r.slice_mut()?,
            None => &mut [],
        };
        let (ss, n, dt) = (s.slice(), s.numel, s.dtype);
        py.allow_threads(|| c.gather_raw(ss, rs, n, dt, root)).py()
    }

    /// Part r of root's `send` (size x len(recv)) lands in rank r's `recv`; `send` may be None
    /// off the root.
    #[pyo3(signature = (send, recv, root=0, stream=None))]
    fn scatter(
        &self,
        py: Python<'_>,
        send: Option<&Bound<'_, PyAny>>,
        recv: &Bound<'_, PyAny>,
        root: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        const C: &str = "scatter";
        let c = self.comm()?;
        let r = buf_of("scatter: recv", recv)?;
        let s = opt_buf("scatter: send", send)?;
        if let Some(s) = s {
            if s.dtype != r.dtype || s.overlaps(&r) {
                return Err(err(
                    "invalid",
                    format!("{C}: send and recv must be distinct buffers of one element type"),
                ));
            }
        }
        if let Some(t) = device::target(stream, &[s, Some(r)])? {
            let s = s.unwrap_or(Buf::EMPTY);
            let call = CollCall::new(Coll::Scatter, r.numel, r.dtype)
                .root(root)
                .bufs(CallSize::Bytes(s.bytes), CallSize::Bytes(r.bytes));
            return on_device(py, &c, t, call, Some(s), r);
        }
        let ss = s.map_or(&[][..], |b| b.slice());
        let (rs, n, dt) = (r.slice_mut()?, r.numel, r.dtype);
        py.allow_threads(|| c.scatter_raw(ss, rs, n, dt, root)).py()
    }

    /// Sends `buf` to `peer` (which calls `recv`).
    #[pyo3(signature = (buf, peer, stream=None))]
    fn send(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let c = self.comm()?;
        let b = buf_of("send: buf", buf)?;
        if let Some(t) = device::target(stream, &[Some(b)])? {
            let call = CollCall::new(Coll::Send, b.numel, b.dtype)
                .root(peer)
                .bufs(CallSize::Bytes(b.bytes), CallSize::None);
            return on_device(py, &c, t, call, Some(b), Buf::EMPTY);
        }
        let (bs, n, dt) = (b.slice(), b.numel, b.dtype);
        py.allow_threads(|| c.send_raw(bs, n, dt, peer)).py()
    }

    /// Receives `buf` from `peer` (which calls `send`).
    #[pyo3(signature = (buf, peer, stream=None))]
    fn recv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let c = self.comm()?;
        let b = buf_of("recv: buf", buf)?;
        if let Some(t) = device::target(stream, &[Some(b)])? {
            let call = CollCall::new(Coll::Recv, b.numel, b.dtype)
                .root(peer)
                .bufs(CallSize::None, CallSize::Bytes(b.bytes));
            return on_device(py, &c, t, call, None, b);
        }
        let (bs, n, dt) = (b.slice_mut()?, b.numel, b.dtype);
        py.allow_threads(|| c.recv_raw(bs, n, dt, peer)).py()
    }

    /// Returns when every rank called `barrier`.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.comm()?;
        py.allow_threads(|| c.barrier()).py()
    }

    /// Compressed all-reduce (sum or avg of float buffers) with codec `spec` ("qsgd:bits=4,
    /// bucket=128", "topk:density=0.01,ef=1", "fp16", ...); in place when `recv` is None.
    /// `key` (str or int) names the tensor across calls: it keys the error-feedback residual and
    /// the layout. Every rank ends bit-identical. Returns {"algo", "sent", "received"}.
    #[pyo3(signature = (send, spec, recv=None, op=None, key=None, algo=None, intra_host=false, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_compressed<'py>(
        &self,
        py: Python<'py>,
        send: &Bound<'py, PyAny>,
        spec: &str,
        recv: Option<&Bound<'py, PyAny>>,
        op: Option<&Bound<'py, PyAny>>,
        key: Option<&Bound<'py, PyAny>>,
        algo: Option<&str>,
        intra_host: bool,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let c = self.comm()?;
        let op = op.map(op_of).transpose()?.unwrap_or(ReduceOp::Sum);
        let mut comp = Compression::parse(spec).py()?.intra_host(intra_host);
        if let Some(k) = key_of(key)? {
            comp = comp.key(k);
        }
        if let Some(a) = algo_of(algo)? {
            comp = comp.algo(a);
        }
        let s = buf_of("all_reduce_compressed: send", send)?;
        let (send, recv) = match opt_buf("all_reduce_compressed: recv", recv)? {
            Some(r) => (pair("all_reduce_compressed", Some(s), &r)?, r),
            None => (None, s),
        };
        if let Some(t) = device::target(stream, &[send, Some(recv)])? {
            let (n, dt) = (recv.numel, recv.dtype);
            let call = CollCall::new(Coll::AllReduce, n, dt)
                .op(op)
                .bufs(sized(send), CallSize::Bytes(recv.bytes))
                .codec(&comp.codec, comp.key.is_some());
            check(&c, &call).py()?;
            let prepared = c.prepare_all_reduce_compressed(n, dt, op, &comp).py()?;
            let rep = device::run_compressed(py, &c, t, prepared, send, recv)?;
            return rep
                .map(|r| report_dict(py, r.algo.name(), r.wire.sent, r.wire.received))
                .transpose();
        }
        let (rs, ss, n, dt) = (
            recv.slice_mut()?,
            send.map(|b| b.slice()),
            recv.numel,
            recv.dtype,
        );
        let rep = py
            .allow_threads(|| c.all_reduce_compressed_raw(ss, rs, n, dt, op, &comp))
            .py()?;
        report_dict(py, rep.algo.name(), rep.wire.sent, rep.wire.received).map(Some)
    }

    /// Top-k all-reduce (sum) of `buf` in place at `density`: HiTopKComm ("hitopk") or a
    /// baseline ("naiveag", "treear", "2dtar"), error feedback keyed by `key`. Returns
    /// {"algo", "sent", "received", "k"}.
    #[pyo3(signature = (buf, density, key=None, scheme="hitopk", error_feedback=true, samplings=30, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn topk_all_reduce<'py>(
        &self,
        py: Python<'py>,
        buf: &Bound<'py, PyAny>,
        density: f64,
        key: Option<&Bound<'py, PyAny>>,
        scheme: &str,
        error_feedback: bool,
        samplings: u32,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let c = self.comm()?;
        let scheme = TopKScheme::parse(scheme).py()?;
        let mut o = TopK::new(density).error_feedback(error_feedback);
        o.samplings = samplings;
        if let Some(k) = key_of(key)? {
            o = o.key(k);
        }
        let b = buf_of("topk_all_reduce: buf", buf)?;
        let rep = if let Some(t) = device::target(stream, &[Some(b)])? {
            let prepared = c.prepare_topk(b.numel, b.dtype, scheme, &o).py()?;
            let prepared = match Box::new(prepared).into_compressed() {
                // The naive all-gather is a compressed all-reduce (MSTopK, all-gather
                // scheme): on device buffers its codec runs on the GPU.
                Ok((call, k)) => {
                    let Some(r) = device::run_compressed(py, &c, t, call, None, b)? else {
                        return Ok(None);
                    };
                    let d = report_dict(py, scheme.name(), r.wire.sent, r.wire.received)?;
                    d.set_item("k", k)?;
                    return Ok(Some(d));
                }
                Err(p) => p,
            };
            // HiTopKComm with its top-k on the GPU: returning once done, or (float32)
            // enqueued on a stream.
            let ptr = b.ptr as u64;
            if let device::Target::Wait = t {
                // SAFETY: `buf` is a live device array of this call, kept by the caller
                // until it returns.
                let done = py
                    .allow_threads(|| unsafe { c.hitopk_on_device(&prepared, None, ptr) })
                    .py()?;
                if let Some(rep) = done {
                    let d = report_dict(py, rep.scheme.name(), rep.wire.sent, rep.wire.received)?;
                    d.set_item("k", rep.k)?;
                    return Ok(Some(d));
                }
            } else {
                let s = t.stream() as u64;
                // SAFETY: NCCL's contract, stated in the Python docs: `buf` stays alive
                // until the stream passed the call, a live stream of its device.
                let enqueued = py
                    .allow_threads(|| unsafe {
                        let s = s as *mut std::ffi::c_void;
                        c.enqueue_hitopk_on_device(&prepared, None, ptr, s)
                    })
                    .py()?;
                if enqueued.is_some() {
                    return Ok(None);
                }
            }
            match device::run(py, &c, t, Job::TopK(Arc::from(prepared)), None, b)? {
                Some(Outcome::TopK(rep)) => rep,
                _ => return Ok(None),
            }
        } else {
            let (bs, dt) = (b.slice_mut()?, b.dtype);
            py.allow_threads(|| with_float!(bs, dt, |s| c.topk_all_reduce(s, scheme, &o)))
                .py()?
        };
        let d = report_dict(py, rep.scheme.name(), rep.wire.sent, rep.wire.received)?;
        d.set_item("k", rep.k)?;
        Ok(Some(d))
    }

    /// Registers the layout (`[(name, count), ...]`) of the buffer called with tensor `key`.
    fn set_layout(&self, key: &Bound<'_, PyAny>, layers: Vec<(String, usize)>) -> PyResult<()> {
        let c = self.comm()?;
        let k = key_of(Some(key))?.expect("key given");
        c.set_layout(k, Layout::new(layers)).py()
    }

    /// Removes the layout of `key`; True if there was one.
    fn remove_layout(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let c = self.comm()?;
        let k = key_of(Some(key))?.expect("key given");
        Ok(c.remove_layout(&k))
    }

    /// Drops the error-feedback residual of `key`; True if there was one.
    fn forget_residual(&self, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let c = self.comm()?;
        let k = key_of(Some(key))?.expect("key given");
        c.forget_residual(&k).py()
    }

    /// Splits the comm (collective): ranks with one `color` form a new comm, ordered by
    /// `key`; a negative color takes no part and gets None.
    #[pyo3(signature = (color, key=0))]
    fn split(&self, py: Python<'_>, color: i32, key: i32) -> PyResult<Option<PyComm>> {
        let c = self.comm()?;
        let sub = py.allow_threads(|| c.split(color, key)).py()?;
        Ok(sub.map(PyComm::wrap))
    }

    /// A comm of `members` (ascending ranks of this comm) made by the members alone (MPI's
    /// `MPI_Comm_create_group`); ranks outside the list do not call it. `tag` tells apart
    /// groups of the same members (every member passes the same).
    #[pyo3(signature = (members, tag=0))]
    fn create_group(&self, py: Python<'_>, members: Vec<usize>, tag: u64) -> PyResult<PyComm> {
        let c = self.comm()?;
        let sub = py.allow_threads(|| c.create_group(&members, tag)).py()?;
        Ok(PyComm::wrap(sub))
    }

    /// Registers `buf` (a C-contiguous numpy array or CPU tensor, as the collectives take)
    /// with the comm, as NCCL's `ncclCommRegister`: collectives on it may then be sent
    /// straight from it by links that can (RDMA); elsewhere nothing changes. Returns an int
    /// handle for `deregister`. The same pages registered again give the same handle,
    /// counted: each registration needs its `deregister`. Local, not collective. The comm
    /// holds a reference to `buf` until then, so it is not freed while registered.
    fn register(&self, buf: &Bound<'_, PyAny>) -> PyResult<u64> {
        let c = self.comm()?;
        let b = buf_of("register: buf", buf)?;
        if b.device {
            return Err(err(
                "unsupported",
                "register: device buffers cannot be registered yet (host memory only)".to_string(),
            ));
        }
        if b.bytes == 0 {
            return Err(err(
                "invalid",
                "register: buf is empty; register at least one byte".to_string(),
            ));
        }
        // With the GIL held (registering only records the range): the registration and the
        // reference to `buf` change together, as no other thread runs this meanwhile.
        let mut reg = self.registered();
        let h = c.register_raw(b.ptr as *const u8, b.bytes).py()?.into_raw();
        reg.entry(h).or_default().push(buf.clone().unbind());
        Ok(h)
    }

    /// Drops one registration made by `register` (and the comm's reference to its buffer).
    /// A handle this comm did not hand out, or already deregistered as often as it was
    /// registered, raises `InvalidArgumentError`.
    fn deregister(&self, handle: &Bound<'_, PyAny>) -> PyResult<()> {
        let c = self.comm()?;
        let h: u64 = handle.extract().map_err(|_| {
            err(
                "invalid",
                format!(
                    "deregister: handle must be the int register returned, got {}",
                    handle
                        .repr()
                        .map(|r| r.to_string())
                        .unwrap_or_else(|_| "?".into())
                ),
            )
        })?;
        let gone = {
            // As in `register`: the GIL stays held, so the two change together.
            let mut reg = self.registered();
            c.deregister(RegHandle::from_raw(h)).py()?;
            let gone = reg.get_mut(&h).and_then(Vec::pop);
            if reg.get(&h).is_some_and(Vec::is_empty) {
                reg.remove(&h);
            }
            gone
        };
        drop(gone); // with the GIL held, outside the lock
        Ok(())
    }

    /// {"ranges": buffers registered, "made": device registrations links made of them (0
    /// until a link that sends from registered memory, RDMA, used one), "wire" and
    /// "wire_made": the same for qccl's own wire buffers that compressed calls encode into}.
    fn registrations<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.comm()?.registrations();
        let d = PyDict::new(py);
        d.set_item("ranges", r.ranges)?;
        d.set_item("made", r.made)?;
        d.set_item("wire", r.wire)?;
        d.set_item("wire_made", r.wire_made)?;
        Ok(d)
    }

    /// {"calls": compressed all-reduces on device buffers that ran their codecs on the GPU,
    /// "to_host" / "to_device": encoded bytes they copied each way, ..., "through_arena":
    /// dense calls on device buffers through the shared-memory arena, "piecewise": dense
    /// all-reduces on device buffers across hosts staged piece by piece} (the rest are
    /// staged whole through page-locked memory and compressed by the CPU).
    fn device_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.comm()?;
        let s = py.allow_threads(|| c.device_stats()).py()?;
        let d = PyDict::new(py);
        d.set_item("calls", s.calls)?;
        d.set_item("enqueued", s.enqueued)?;
        d.set_item("to_host", s.to_host)?;
        d.set_item("to_device", s.to_device)?;
        d.set_item("exchanges", s.exchanges)?;
        d.set_item("overlapped", s.overlapped)?;
        d.set_item("late_sends", s.late_sends)?;
        d.set_item("through_arena", c.arena_device_calls())?;
        d.set_item("piecewise", c.piecewise_calls())?;
        Ok(d)
    }

    /// The message of the error that failed this comm, or None.
    fn async_error(&self) -> PyResult<Option<String>> {
        Ok(self.comm()?.async_error().map(|e| e.to_string()))
    }

    /// Aborts the comm: the running call and all later ones raise; peers are told.
    fn abort(&self, py: Python<'_>) {
        let c = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(c) = c {
            py.allow_threads(|| c.abort());
        }
    }

    /// Closes the comm: its thread and connections end once running calls returned.
    fn close(&self, py: Python<'_>) {
        let c = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        // The registrations end with the comm: release their buffers (with the GIL held).
        let registered = std::mem::take(&mut *self.registered());
        drop(registered);
        py.allow_threads(move || drop(c));
    }

    fn __repr__(&self) -> String {
        format!(
            "<qccl.Comm rank {} of {}{}>",
            self.rank,
            self.size,
            if self.closed() { ", closed" } else { "" }
        )
    }
}

/// The size of a call's buffer for `CollCall::validate` (None: in place or unused).
fn sized(b: Option<Buf>) -> CallSize {
    b.map_or(CallSize::None, |b| CallSize::Bytes(b.bytes))
}

/// Validates `call` as the core's `*_raw` calls do (the error names the collective).
fn check(c: &qccl::Comm, call: &CollCall<'_>) -> qccl::Result<()> {
    let shape = qccl::internal::Shape {
        rank: c.rank(),
        size: c.size(),
    };
    call.validate(shape)
        .map_err(|e| e.prefixed(&format!("{}: ", call.coll.name())))
}

/// Runs a validated collective through the device path (see `device.rs`).
fn on_device(
    py: Python<'_>,
    c: &Arc<qccl::Comm>,
    t: Target,
    call: CollCall<'static>,
    send: Option<Buf>,
    recv: Buf,
) -> PyResult<()> {
    let job = Job::coll(c, call).py()?;
    device::run(py, c, t, job, send, recv).map(drop)
}

fn key_of(key: Option<&Bound<'_, PyAny>>) -> PyResult<Option<qccl::TensorKey>> {
    let Some(k) = key.filter(|k| !k.is_none()) else {
        return Ok(None);
    };
    if let Ok(v) = k.extract::<u64>() {
        return Ok(Some(v.into()));
    }
    let s: String = k
        .extract()
        .map_err(|_| PyTypeError::new_err("a tensor key is a str or a non-negative int"))?;
    Ok(Some(s.into()))
}

/// A new unique id (128 bytes) whose rendezvous root runs in this process until all ranks
/// joined (or QCCL_INIT_TIMEOUT_MS passed). Hand it to every rank's `Comm.init`.
#[pyfunction]
fn unique_id(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let id = py.allow_threads(UniqueId::new).py()?;
    Ok(PyBytes::new(py, id.as_bytes()))
}

/// The size in bytes of one element of a supported dtype name, or None.
#[pyfunction]
fn dtype_size(name: &str) -> Option<usize> {
    dtype_of_name(name).map(|d| d.size())
}

/// The driver device buffers would go through ("cuda", "emulated"), or None when there is
/// none (internal: the device tests choose their cases by it).
#[pyfunction]
fn _gpu_driver() -> Option<&'static str> {
    qccl::internal::gpu().ok().map(|d| d.kind())
}

#[pymodule]
fn _qccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyComm>()?;
    m.add_function(wrap_pyfunction!(unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_size, m)?)?;
    m.add_function(wrap_pyfunction!(_gpu_driver, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    if emulated::wanted() {
        m.add_class::<emulated::EmuArray>()?;
        m.add_class::<emulated::EmuStream>()?;
    }
    Ok(())
}
