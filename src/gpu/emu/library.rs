//! The emulated driver's kernels: each `kernels/*.cu` file built for the CPU (`compile.rs`)
//! and loaded with `dlopen` on first use, once per process (never unloaded: a launch may be
//! running in it), and the entry points found in them.

use super::compile;
use crate::error::{Error, Result};
use crate::gpu::driver::Function;
use crate::gpu::kernels::{self, Source};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// `qccl_emu_<name>` of kernels/shim/emu_entry.h.
pub(super) type Entry =
    unsafe extern "C" fn(c_uint, c_uint, *mut *mut c_void, *mut c_char, usize) -> c_int;

/// `qccl_emu_sig_<name>`.
type Signature = unsafe extern "C" fn() -> *const c_char;

/// A loaded shared object.
struct Library {
    handle: *mut c_void,
    file: &'static str,
}

// SAFETY: a dlopen handle is process-wide and dlsym is thread safe; the library is never
// closed, so the handle stays valid on every thread.
unsafe impl Send for Library {}
// SAFETY: as for Send; only dlsym is called through a shared reference.
unsafe impl Sync for Library {}

impl Library {
    /// `source`'s library, built and loaded on first use (a failure is remembered too).
    fn of(source: &'static Source) -> Result<Arc<Library>> {
        type Cell = Arc<OnceLock<Result<Arc<Library>>>>;
        static LOADED: OnceLock<Mutex<HashMap<&'static str, Cell>>> = OnceLock::new();
        let cell = LOADED
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(source.file)
            .or_default()
            .clone();
        cell.get_or_init(|| Library::load(source).map(Arc::new))
            .clone()
    }

    fn load(source: &'static Source) -> Result<Library> {
        let built = compile::build(source)?;
        let path = CString::new(built.path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::invalid(format!("{} holds a NUL byte", built.path.display())))?;
        // SAFETY: a NUL-terminated path of a shared object this process built from qccl's
        // sources; its initialisers only set up the shim's globals.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if let Some(dir) = built.scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
        if handle.is_null() {
            return Err(Error::Internal(format!(
                "loading {} (the emulated GPU's build of {}): {}",
                built.path.display(),
                source.file,
                dl_error()
            )));
        }
        Ok(Library {
            handle,
            file: source.file,
        })
    }

    /// The symbol `name`, if the library exports it.
    fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: a live handle (never closed) and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// dlerror's message.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call on
    // this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// A kernel of the emulated driver: its packed entry and parameter types.
#[derive(Clone)]
pub struct EmuFunction {
    name: Arc<str>,
    ordinal: usize,
    /// One letter per parameter (kernels/shim/emu_entry.h).
    pub(super) signature: Arc<str>,
    pub(super) entry: Entry,
    /// The file it came from, for messages.
    pub(super) file: &'static str,
    _library: Arc<Library>,
}

impl Function for EmuFunction {
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

/// Kernel `name` for device `ordinal`: searched in the files whose entry points match it.
pub(super) fn function(ordinal: usize, name: &str) -> Result<EmuFunction> {
    for source in kernels::sources_for(name)? {
        let library = Library::of(source)?;
        let (Some(entry), Some(signature)) = (
            library.symbol(&format!("qccl_emu_{name}")),
            library.symbol(&format!("qccl_emu_sig_{name}")),
        ) else {
            continue;
        };
        // SAFETY: both symbols are the functions emu_entry.h's QCCL_EMU_ENTRY defines with
        // exactly these C signatures.
        let (entry, signature) = unsafe {
            (
                std::mem::transmute::<*mut c_void, Entry>(entry),
                std::mem::transmute::<*mut c_void, Signature>(signature),
            )
        };
        // SAFETY: returns a static NUL-terminated string of the library, which is never
        // unloaded.
        let signature = unsafe { CStr::from_ptr(signature()) }.to_string_lossy();
        return Ok(EmuFunction {
            name: name.into(),
            ordinal,
            signature: signature.into(),
            entry,
            file: library.file,
            _library: library,
        });
    }
    Err(kernels::unknown_kernel(name))
}
