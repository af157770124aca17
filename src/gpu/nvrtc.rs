//! NVRTC: CUDA C source to a CUBIN for a device's exact `sm_XY`, or to PTX (`compute_XY`) when
//! this NVRTC does not know the device (the driver then compiles the PTX; the reverse, PTX
//! newer than the driver, is refused by the driver, so CUBIN is the first choice). Results are
//! cached per (target, arch, NVRTC version, hash of sources and options), in memory and,
//! optionally, on disk.
//!
//! libnvrtc is opened at run time: `QCCL_NVRTC_LIB` (the library file, or the folder holding
//! `libnvrtc.so.13`/`.so.12`, e.g. the `nvidia-cuda-nvrtc` wheel's `nvidia/cu13/lib`) is
//! loaded first; otherwise cudarc's search by name (`LD_LIBRARY_PATH`, the system paths).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys;

use super::cache::{default_cache_dir, StableHash};
use super::kernels;
use crate::{Error, Result};

/// What NVRTC produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for exactly `sm_XY` (`-arch=sm_XY`).
    Cubin,
    /// PTX for `compute_XY` (`-arch=compute_XY`), which the driver compiles for any device of
    /// that capability or newer.
    Ptx,
}

impl Target {
    fn arch_flag(self, sm: u32) -> String {
        match self {
            Target::Cubin => format!("-arch=sm_{sm}"),
            Target::Ptx => format!("-arch=compute_{sm}"),
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Target::Cubin => "cubin",
            Target::Ptx => "ptx",
        }
    }

    /// A cheap sanity check of an image read back from the disk cache.
    fn looks_valid(self, bytes: &[u8]) -> bool {
        match self {
            Target::Cubin => bytes.starts_with(b"\x7fELF"),
            Target::Ptx => bytes.windows(8).any(|w| w == b".version"),
        }
    }
}

/// A program to compile: a main source and the headers it may `#include` by name.
#[derive(Debug, Clone, Copy)]
pub struct Program<'a> {
    /// Name used in NVRTC's messages (`reduce.cu`).
    pub name: &'a str,
    /// The source text.
    pub source: &'a str,
    /// `(include name, text)` pairs: `#include "common.cuh"` finds `("common.cuh", ...)`.
    pub headers: &'a [(&'a str, &'a str)],
    /// Whether NVRTC may contract `a * b + c` into one fused multiply-add. Off for anything
    /// that must match the CPU bit for bit: Rust never fuses, so a fused kernel rounds once
    /// where the CPU rounds twice.
    pub fmad: bool,
}

impl Program<'static> {
    /// The NVRTC program of one `kernels/` file: every embedded header, `fmad` off (every
    /// kernel's result is compared bit for bit with the CPU's; the memory-bound reductions lose
    /// nothing by it).
    pub fn kernel(source: &kernels::Source) -> Program<'static> {
        static HEADERS: OnceLock<Vec<(&'static str, &'static str)>> = OnceLock::new();
        let headers =
            HEADERS.get_or_init(|| kernels::HEADERS.iter().map(|h| (h.file, h.text)).collect());
        Program {
            name: source.file,
            source: source.text,
            headers,
            fmad: false,
        }
    }
}

impl Program<'_> {
    fn options(&self, target: Target, sm: u32) -> Vec<String> {
        vec![
            target.arch_flag(sm),
            "--std=c++17".into(),
            format!("--fmad={}", self.fmad),
        ]
    }
}

/// A compiled image.
#[derive(Debug)]
pub struct Image {
    /// CUBIN or PTX.
    pub target: Target,
    /// The architecture it was compiled for (80 for `sm_80` / `compute_80`).
    pub sm: u32,
    /// The CUBIN (an ELF file) or the PTX text (without a trailing NUL).
    pub bytes: Vec<u8>,
    /// NVRTC's log (warnings); empty when the image came from the disk cache.
    pub log: String,
    /// Whether the image was read from the disk cache rather than compiled.
    pub from_disk: bool,
}

/// NVRTC's version, `(major, minor)`, once libnvrtc is loaded; `Unsupported` when it cannot be.
pub fn version() -> Result<(u32, u32)> {
    static LOADED: OnceLock<Result<(u32, u32)>> = OnceLock::new();
    LOADED.get_or_init(load).clone()
}

/// The `sm` numbers this NVRTC compiles for (75, 80, 86, 90, ...), ascending.
pub fn supported_archs() -> Result<Vec<u32>> {
    version()?;
    let mut n: c_int = 0;
    // SAFETY: libnvrtc is loaded (version() succeeded); `n` is a valid out-pointer.
    check(
        unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) },
        "nvrtcGetNumSupportedArchs",
    )?;
    let mut archs = vec![0 as c_int; usize::try_from(n).unwrap_or(0)];
    // SAFETY: `archs` holds exactly the `n` ints NVRTC said it would write.
    check(
        unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) },
        "nvrtcGetSupportedArchs",
    )?;
    let mut archs: Vec<u32> = archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect();
    archs.sort_unstable();
    Ok(archs)
}

/// Compiles programs, remembering the results.
#[derive(Debug)]
pub struct Compiler {
    memory: Mutex<HashMap<Key, Arc<Image>>>,
    disk: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    target: Target,
    sm: u32,
    nvrtc: (u32, u32),
    hash: u64,
}

impl Compiler {
    /// A compiler caching in memory, and on disk under `disk` when given.
    pub fn new(disk: Option<PathBuf>) -> Compiler {
        Compiler {
            memory: Mutex::new(HashMap::new()),
            disk,
        }
    }

    /// The process's compiler, caching on disk under `QCCL_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/qccl`, else `$HOME/.cache/qccl`; `QCCL_CACHE_DIR=` (empty) turns the
    /// disk cache off.
    pub fn shared() -> &'static Compiler {
        static SHARED: OnceLock<Compiler> = OnceLock::new();
        SHARED.get_or_init(|| Compiler::new(default_cache_dir(|v| std::env::var_os(v))))
    }

    /// The program for a device of capability `sm` (e.g. 90): a CUBIN when this NVRTC knows
    /// `sm_XY`, else PTX for the newest architecture it knows below it.
    pub fn for_device(&self, program: &Program, sm: u32) -> Result<Arc<Image>> {
        let archs = supported_archs()?;
        if archs.contains(&sm) {
            return self.compile(program, Target::Cubin, sm);
        }
        match archs.iter().rev().find(|&&a| a < sm) {
            Some(&older) => self.compile(program, Target::Ptx, older),
            None => Err(Error::Unsupported(format!(
                "NVRTC {} compiles for sm {archs:?}, nothing for a device of capability sm_{sm}",
                fmt_version(version()?)
            ))),
        }
    }

    /// `program` as `target` for architecture `sm`, from the cache when it is there. A
    /// compile error is `Internal` with NVRTC's log.
    pub fn compile(&self, program: &Program, target: Target, sm: u32) -> Result<Arc<Image>> {
        let nvrtc = version()?;
        let options = program.options(target, sm);
        let key = Key {
            target,
            sm,
            nvrtc,
            hash: hash_program(program, &options),
        };
        if let Some(hit) = self.lock().get(&key) {
            return Ok(hit.clone());
        }
        let file = self.disk.as_ref().map(|dir| {
            dir.join(format!(
                "{}.{}{sm}.nvrtc{}.{}.{:016x}.{}",
                program.name,
                if target == Target::Cubin {
                    "sm"
                } else {
                    "compute"
                },
                nvrtc.0,
                nvrtc.1,
                key.hash,
                target.suffix()
            ))
        });
        let image = match file.as_deref().and_then(|f| read_cached(f, target)) {
            Some(bytes) => Image {
                target,
                sm,
                bytes,
                log: String::new(),
                from_disk: true,
            },
            None => {
                let (bytes, log) = run_nvrtc(program, target, &options)?;
                if let Some(f) = &file {
                    write_cached(f, &bytes);
                }
                Image {
                    target,
                    sm,
                    bytes,
                    log,
                    from_disk: false,
                }
            }
        };
        let image = Arc::new(image);
        self.lock().insert(key, image.clone());
        Ok(image)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Arc<Image>>> {
        // The map holds finished images only; a panic elsewhere cannot leave it half-written.
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn read_cached(file: &Path, target: Target) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).ok()?;
    // A truncated or foreign file is recompiled (and then overwritten).
    target.looks_valid(&bytes).then_some(bytes)
}

/// Best effort: a cache that cannot be written costs a recompile next time, nothing more.
fn write_cached(file: &Path, bytes: &[u8]) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // Written aside and renamed, so a concurrent reader sees the whole file or none.
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, file)
    };
    if let Err(e) = write() {
        crate::qlog!(Warn, "NVRTC cache {}: {e}", file.display());
    }
}

/// The stable hash of the sources, header names and options (the disk cache's key).
fn hash_program(p: &Program, options: &[String]) -> u64 {
    let mut h = StableHash::new();
    h.eat(p.name.as_bytes());
    h.eat(p.source.as_bytes());
    for (name, text) in p.headers {
        h.eat(name.as_bytes());
        h.eat(text.as_bytes());
    }
    for o in options {
        h.eat(o.as_bytes());
    }
    h.finish()
}

/// Frees an NVRTC program on every path out.
struct Prog(sys::nvrtcProgram);

impl Drop for Prog {
    fn drop(&mut self) {
        // SAFETY: self.0 came from a successful nvrtcCreateProgram and is destroyed only here.
        unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn run_nvrtc(p: &Program, target: Target, options: &[String]) -> Result<(Vec<u8>, String)> {
    let cstr = |what: &str, s: &str| {
        CString::new(s).map_err(|_| Error::invalid(format!("{}: {what} holds a NUL byte", p.name)))
    };
    let source = cstr("the source", p.source)?;
    let name = cstr("the name", p.name)?;
    let header_texts = p
        .headers
        .iter()
        .map(|(_, text)| cstr("a header", text))
        .collect::<Result<Vec<_>>>()?;
    let header_names = p
        .headers
        .iter()
        .map(|(n, _)| cstr("a header name", n))
        .collect::<Result<Vec<_>>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
    let opts = options
        .iter()
        .map(|o| cstr("an option", o))
        .collect::<Result<Vec<_>>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    let count = |n: usize| c_int::try_from(n).map_err(|_| Error::invalid("too many headers"));

    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive until this function returns, the
    // two header arrays have `headers.len()` entries; NVRTC copies what it keeps.
    check(
        unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                source.as_ptr(),
                name.as_ptr(),
                count(p.headers.len())?,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    let prog = Prog(raw);
    // SAFETY: a live program; `opt_ptrs` holds `options.len()` NUL-terminated strings.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(prog.0, count(opt_ptrs.len())?, opt_ptrs.as_ptr()) };
    let log = program_log(&prog)?;
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Internal(format!(
            "NVRTC {} could not compile {} ({}): {}\n{log}",
            version().map(fmt_version).unwrap_or_default(),
            p.name,
            options.join(" "),
            result_name(compiled),
        )));
    }
    let bytes = match target {
        Target::Cubin => read_output(&prog, sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN, "CUBIN")?,
        Target::Ptx => {
            let mut ptx = read_output(&prog, sys::nvrtcGetPTXSize, sys::nvrtcGetPTX, "PTX")?;
            // NVRTC counts the terminating NUL; the image is the text.
            while ptx.last() == Some(&0) {
                ptx.pop();
            }
            ptx
        }
    };
    Ok((bytes, log))
}

type SizeFn = unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult;
type DataFn = unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult;

fn read_output(prog: &Prog, size_fn: SizeFn, data_fn: DataFn, what: &str) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: a live, compiled program; `size` is a valid out-pointer.
    check(unsafe { size_fn(prog.0, &mut size) }, what)?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has the `size` bytes NVRTC said it writes.
    check(unsafe { data_fn(prog.0, buf.as_mut_ptr().cast()) }, what)?;
    Ok(buf)
}

fn program_log(prog: &Prog) -> Result<String> {
    let log = read_output(
        prog,
        sys::nvrtcGetProgramLogSize,
        sys::nvrtcGetProgramLog,
        "the program log",
    )?;
    let text = CStr::from_bytes_until_nul(&log)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&log).into_owned());
    Ok(text.trim_end().to_string())
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Internal(format!("{what}: {}", result_name(r))))
    }
}

fn result_name(r: sys::nvrtcResult) -> String {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code; it is
    // called only once libnvrtc is loaded (every caller compiled or queried first).
    let s = unsafe { sys::nvrtcGetErrorString(r) };
    if s.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null, static, NUL-terminated (above).
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

fn fmt_version((major, minor): (u32, u32)) -> String {
    format!("{major}.{minor}")
}

/// Opens libnvrtc (`QCCL_NVRTC_LIB` first) and asks its version.
fn load() -> Result<(u32, u32)> {
    if let Some(lib) = std::env::var_os("QCCL_NVRTC_LIB").filter(|v| !v.is_empty()) {
        preload(Path::new(&lib))?;
    }
    // SAFETY: only dlopens libnvrtc's candidate names (and closes them again); libnvrtc's
    // initialisers are those of any NVRTC user.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Unsupported(
            "no NVRTC library (libnvrtc.so.13 or .so.12) found: set QCCL_NVRTC_LIB to it \
             (or its folder), or add its folder to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: libnvrtc is present (checked above); two valid out-pointers.
    check(
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
    )?;
    let v = (
        u32::try_from(major).unwrap_or(0),
        u32::try_from(minor).unwrap_or(0),
    );
    crate::qlog!(Info, "NVRTC {} loaded", fmt_version(v));
    Ok(v)
}

/// Loads the library at `path` (a file, or a folder holding `libnvrtc.so.13` or `.so.12`) for
/// the rest of the process. cudarc then opens libnvrtc by name, and the dynamic loader hands
/// back this copy: a name matching an already loaded library's soname is that library.
fn preload(path: &Path) -> Result<()> {
    let file = if path.is_dir() {
        ["libnvrtc.so.13", "libnvrtc.so.12"]
            .iter()
            .map(|n| path.join(n))
            .find(|f| f.exists())
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "QCCL_NVRTC_LIB={}: no libnvrtc.so.13 or libnvrtc.so.12 in that folder",
                    path.display()
                ))
            })?
    } else {
        path.to_path_buf()
    };
    let c = CString::new(file.as_os_str().as_bytes())
        .map_err(|_| Error::invalid("QCCL_NVRTC_LIB holds a NUL byte"))?;
    // SAFETY: a NUL-terminated path; the handle is never closed, so the library stays loaded
    // for every later NVRTC call of the process.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated message valid until the next dl call
        // on this thread; it is copied at once.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(Error::Unsupported(format!(
            "QCCL_NVRTC_LIB={}: cannot load it: {why}",
            file.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exercises the wrapper: a header included by name, fmad off, a pasted entry point.
    const SAXPY: &str = r#"
#include "scale.cuh"
#define AXPY(T, suffix) \
    extern "C" __global__ void axpy_##suffix(T* y, const T* x, T a, unsigned long long n) { \
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
             i < n; i += (unsigned long long)gridDim.x * blockDim.x) \
            y[i] = scale(a, x[i]) + y[i]; \
    }
AXPY(float, f32)
AXPY(double, f64)
"#;
    const SCALE: &str =
        "#pragma once\ntemplate <class T> __device__ T scale(T a, T x) { return a * x; }\n";

    fn program(fmad: bool) -> Program<'static> {
        Program {
            name: "axpy.cu",
            source: SAXPY,
            headers: &[("scale.cuh", SCALE)],
            fmad,
        }
    }

    /// NVRTC, when this machine has it; tests that need it return early with a note otherwise.
    fn nvrtc() -> Option<(u32, u32)> {
        match version() {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("skipped: {e}");
                None
            }
        }
    }

    #[test]
    fn hash_covers_sources_headers_and_options() {
        let p = program(false);
        let o = p.options(Target::Ptx, 80);
        let h = hash_program(&p, &o);
        assert_eq!(h, hash_program(&p, &o));
        assert_ne!(
            h,
            hash_program(&program(true), &program(true).options(Target::Ptx, 80))
        );
        assert_ne!(h, hash_program(&p, &p.options(Target::Ptx, 90)));
        assert_ne!(h, hash_program(&p, &p.options(Target::Cubin, 80)));
        let other = Program {
            headers: &[("scale.cuh", "#pragma once\n")],
            ..p
        };
        assert_ne!(h, hash_program(&other, &o));
    }

    #[test]
    fn ptx_and_cubin_with_headers() {
        let Some(_) = nvrtc() else { return };
        let c = Compiler::new(None);
        for sm in [80, 90] {
            let ptx = c.compile(&program(false), Target::Ptx, sm).unwrap();
            let text = std::str::from_utf8(&ptx.bytes).unwrap();
            assert!(text.contains(&format!(".target sm_{sm}")), "{text}");
            for name in ["axpy_f32", "axpy_f64"] {
                assert!(
                    text.contains(&format!(".entry {name}(")),
                    "{name} missing:\n{text}"
                );
            }
            // fmad off: the multiply and the add stay two instructions.
            assert!(
                !text.contains("fma.rn.f32"),
                "fused with --fmad=false:\n{text}"
            );
            assert!(
                text.contains("mul.rn.f32") || text.contains("mul.f32"),
                "{text}"
            );

            let cubin = c.compile(&program(false), Target::Cubin, sm).unwrap();
            assert!(cubin.bytes.starts_with(b"\x7fELF\x02"), "not a 64-bit ELF");
            assert!(!cubin.from_disk);
        }
        // fmad on lets NVRTC fuse: the option reaches the compiler.
        let fused = c.compile(&program(true), Target::Ptx, 80).unwrap();
        assert!(std::str::from_utf8(&fused.bytes)
            .unwrap()
            .contains("fma.rn.f32"));
    }

    #[test]
    fn memory_cache_returns_the_same_image() {
        let Some(_) = nvrtc() else { return };
        let c = Compiler::new(None);
        let a = c.compile(&program(false), Target::Ptx, 80).unwrap();
        let b = c.compile(&program(false), Target::Ptx, 80).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let other = c.compile(&program(false), Target::Ptx, 90).unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
    }

    #[test]
    fn disk_cache_is_read_back_and_checked() {
        let Some(_) = nvrtc() else { return };
        let dir = std::env::temp_dir().join(format!("qccl-nvrtc-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = Compiler::new(Some(dir.clone()))
            .compile(&program(false), Target::Cubin, 80)
            .unwrap();
        assert!(!first.from_disk);
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");

        let second = Compiler::new(Some(dir.clone()))
            .compile(&program(false), Target::Cubin, 80)
            .unwrap();
        assert!(second.from_disk);
        assert_eq!(first.bytes, second.bytes);

        // A damaged file is not trusted: compiled again and replaced.
        std::fs::write(&files[0], b"garbage").unwrap();
        let third = Compiler::new(Some(dir.clone()))
            .compile(&program(false), Target::Cubin, 80)
            .unwrap();
        assert!(!third.from_disk);
        assert_eq!(std::fs::read(&files[0]).unwrap(), first.bytes);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn compile_error_carries_the_log() {
        let Some(_) = nvrtc() else { return };
        let bad = Program {
            name: "broken.cu",
            source: "extern \"C\" __global__ void k(float* x) { x[0] = undeclared_name; }\n",
            headers: &[],
            fmad: false,
        };
        let err = Compiler::new(None)
            .compile(&bad, Target::Ptx, 80)
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Internal(_)), "{err:?}");
        assert!(msg.contains("broken.cu"), "{msg}");
        assert!(msg.contains("undeclared_name"), "no NVRTC log in: {msg}");
    }

    #[test]
    fn device_arch_picks_cubin_or_older_ptx() {
        let Some(_) = nvrtc() else { return };
        let archs = supported_archs().unwrap();
        assert!(archs.contains(&80) && archs.contains(&90), "{archs:?}");
        let c = Compiler::new(None);
        let exact = c.for_device(&program(false), 90).unwrap();
        assert_eq!((exact.target, exact.sm), (Target::Cubin, 90));
        // A device newer than anything this NVRTC knows: PTX of the newest arch it knows.
        let newest = *archs.last().unwrap();
        let future = c.for_device(&program(false), newest + 1).unwrap();
        assert_eq!((future.target, future.sm), (Target::Ptx, newest));
        // Older than anything it knows: refused.
        let too_old = c.for_device(&program(false), archs[0] - 1).unwrap_err();
        assert!(matches!(too_old, Error::Unsupported(_)), "{too_old:?}");
    }
}
