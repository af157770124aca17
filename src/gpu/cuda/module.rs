//! qccl's kernels on a device: each `kernels/*.cu` file's NVRTC image (CUBIN for the device's
//! exact `sm_XY`, else PTX, from `gpu::nvrtc`'s cache) loaded into the device's primary
//! context on first use (`cuModuleLoadData`), and entry points looked up in it once
//! (`cuModuleGetFunction`). Modules stay loaded while the driver or a function lives.

use super::call::check;
use super::context::Context;
use crate::error::{Error, Result};
use crate::gpu::driver::Function;
use crate::gpu::kernels::{self, Source};
use crate::gpu::nvrtc::{Compiler, Program, Target};
use cudarc::driver::sys::{self, CUresult};
use std::collections::HashMap;
use std::ffi::{c_int, CString};
use std::sync::{Arc, Mutex};

/// One loaded kernel file; unloaded on drop.
struct Module {
    ctx: Arc<Context>,
    raw: sys::CUmodule,
}

// SAFETY: a CUmodule is a handle of its context, usable from any thread that makes the
// context current (every call here enters it); unloaded once, in Drop.
unsafe impl Send for Module {}
// SAFETY: as for Send; shared use only looks functions up (thread safe in the driver).
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        let unloaded = self.ctx.enter().and_then(|_current| {
            // SAFETY: loaded by cuModuleLoadData and unloaded once, here; every function of
            // it holds this module, so none is used after.
            let r = unsafe { sys::cuModuleUnload(self.raw) };
            check(r, "cuModuleUnload", || {
                format!("unloading kernels on CUDA device {}", self.ctx.ordinal())
            })
        });
        if let Err(e) = unloaded {
            crate::qlog!(Warn, "{e}");
        }
    }
}

/// A kernel entry point on one device.
pub(super) struct CudaFunction {
    name: String,
    ordinal: usize,
    raw: sys::CUfunction,
    _module: Arc<Module>,
}

// SAFETY: a CUfunction is a handle inside its module, which this value keeps loaded; the
// driver lets any thread launch it with the context current.
unsafe impl Send for CudaFunction {}
// SAFETY: as for Send; launching through a shared reference mutates nothing here.
unsafe impl Sync for CudaFunction {}

impl CudaFunction {
    pub(super) fn raw(&self) -> sys::CUfunction {
        self.raw
    }
}

impl Function for CudaFunction {
    fn name(&self) -> &str {
        &self.name
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One device's loaded kernel files and looked-up functions.
pub(super) struct Modules {
    ctx: Arc<Context>,
    files: Mutex<HashMap<&'static str, Arc<Module>>>,
    functions: Mutex<HashMap<String, Arc<CudaFunction>>>,
}

impl Modules {
    pub(super) fn new(ctx: Arc<Context>) -> Modules {
        Modules {
            ctx,
            files: Mutex::default(),
            functions: Mutex::default(),
        }
    }

    /// Entry point `name`, looked up once.
    pub(super) fn function(&self, name: &str) -> Result<Arc<CudaFunction>> {
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let cname = CString::new(name).map_err(|_| kernels::unknown_kernel(name))?;
        for source in kernels::sources_for(name)? {
            let module = self.module(source)?;
            let _current = self.ctx.enter()?;
            let mut raw: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: a loaded module of the current context, a NUL-terminated name and a
            // valid out-pointer.
            let r = unsafe { sys::cuModuleGetFunction(&mut raw, module.raw, cname.as_ptr()) };
            if r == CUresult::CUDA_ERROR_NOT_FOUND {
                continue;
            }
            check(r, "cuModuleGetFunction", || {
                format!("finding kernel {name} of {}", source.file)
            })?;
            let f = Arc::new(CudaFunction {
                name: name.to_string(),
                ordinal: self.ctx.ordinal(),
                raw,
                _module: module,
            });
            functions.insert(name.to_string(), f.clone());
            return Ok(f);
        }
        Err(kernels::unknown_kernel(name))
    }

    /// `source` loaded on this device, compiled by NVRTC on first use.
    fn module(&self, source: &'static Source) -> Result<Arc<Module>> {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = files.get(source.file) {
            return Ok(m.clone());
        }
        let ordinal = self.ctx.ordinal();
        let sm = capability(&self.ctx)?;
        let image = Compiler::shared().for_device(&Program::kernel(source), sm)?;
        let mut bytes = image.bytes.clone();
        if image.target == Target::Ptx {
            // cuModuleLoadData reads PTX as a NUL-terminated string.
            bytes.push(0);
        }
        let _current = self.ctx.enter()?;
        let mut raw: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `bytes` is a CUBIN or NUL-terminated PTX alive for the call (the driver
        // copies what it keeps); `raw` is a valid out-pointer; the context is current.
        let r = unsafe { sys::cuModuleLoadData(&mut raw, bytes.as_ptr().cast()) };
        check(r, "cuModuleLoadData", || {
            format!(
                "loading {} ({:?} for sm_{}) on CUDA device {ordinal}",
                source.file, image.target, image.sm
            )
        })?;
        let module = Arc::new(Module {
            ctx: self.ctx.clone(),
            raw,
        });
        files.insert(source.file, module.clone());
        Ok(module)
    }
}

/// The device's compute capability as NVRTC's `sm` number (9.0 is 90).
fn capability(ctx: &Context) -> Result<u32> {
    let ordinal = ctx.ordinal();
    let attribute = |a: sys::CUdevice_attribute| -> Result<u32> {
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer and a device from cuDeviceGet.
        let r = unsafe { sys::cuDeviceGetAttribute(&mut v, a, ctx.device()) };
        check(r, "cuDeviceGetAttribute", || {
            format!("reading CUDA device {ordinal}'s compute capability")
        })?;
        u32::try_from(v).map_err(|_| {
            Error::System(format!(
                "CUDA device {ordinal} reports a negative compute capability"
            ))
        })
    };
    use sys::CUdevice_attribute::*;
    let major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(major * 10 + minor)
}
