//! Builds one `kernels/*.cu` file for the CPU: the emulated driver's way to run qccl's kernels
//! (the same sources NVRTC compiles) through the shim (`kernels/shim/qccl_shim.h`).
//!
//! From the embedded sources (written to a scratch folder, so an installed library needs no
//! source tree): `g++ -E` lists the file's entry points with their macro-pasted names made
//! concrete (read back with `gpu::kernels::entry_points`), then a generated C++ file includes
//! the shim, the `.cu` file and `kernels/shim/emu_entry.h` and exports one packed entry per
//! kernel; `g++ -shared -fPIC -O2 -ffp-contract=off` builds it. The shared object is cached
//! in the NVRTC cache's folder (`QCCL_CACHE_DIR`, ...), named by a hash of the sources, the
//! options and the compiler's version, written aside and renamed (processes may race).
//!
//! Shim mode, per file: fiber mode when the preprocessed file (its headers included) calls
//! any synchronising function (`__syncthreads`, `__syncwarp`, shuffles, votes), sequential
//! otherwise. Sound for every kernel of such a file (fiber mode runs any kernel, only more
//! slowly); a sequential file cannot synchronise.

use crate::error::{Error, Result};
use crate::gpu::cache::{default_cache_dir, StableHash};
use crate::gpu::kernels::{self, Source};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

const SHIM: &str = include_str!("../../../kernels/shim/qccl_shim.h");
const ENTRY: &str = include_str!("../../../kernels/shim/emu_entry.h");

/// The compiler, and its options (no FMA contraction: the kernels match the CPU bit for bit).
const CXX: &str = "g++";
const FLAGS: &[&str] = &["-std=c++17", "-O2", "-ffp-contract=off", "-fPIC", "-shared"];

/// Calls that need the shim's fiber mode.
const SYNC_CALLS: &[&str] = &[
    "__syncthreads",
    "__syncwarp",
    "__shfl_sync",
    "__shfl_up_sync",
    "__shfl_down_sync",
    "__shfl_xor_sync",
    "__ballot_sync",
    "__all_sync",
    "__any_sync",
];

/// Bumped when the generated file's shape changes, so older cached builds are not reused.
const GENERATOR: &str = "qccl-emu-kernels-1";

/// A built shared object.
pub(super) struct Built {
    pub path: PathBuf,
    /// A scratch folder to remove once the object is loaded (no disk cache).
    pub scratch: Option<PathBuf>,
}

/// The compiler's `--version` line, or `Unsupported` when there is none.
fn compiler_version() -> Result<String> {
    static VERSION: OnceLock<Result<String>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            let unsupported = |why: String| {
                Error::Unsupported(format!(
                    "the emulated GPU runs kernel launches by building kernels/ with {CXX}, \
                     and {why}: install {CXX} to launch kernels under QCCL_GPU_EMULATE"
                ))
            };
            match Command::new(CXX).arg("--version").output() {
                Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string()),
                Ok(out) => Err(unsupported(format!(
                    "`{CXX} --version` failed ({})",
                    out.status
                ))),
                Err(e) => Err(unsupported(format!("{CXX} cannot be run ({e})"))),
            }
        })
        .clone()
}

/// The cache key of `source`'s build.
fn key(source: &Source, compiler: &str) -> u64 {
    let mut h = StableHash::new();
    for part in [GENERATOR, compiler, SHIM, ENTRY, source.file, source.text] {
        h.eat(part.as_bytes());
    }
    for f in FLAGS {
        h.eat(f.as_bytes());
    }
    for header in kernels::HEADERS {
        h.eat(header.file.as_bytes());
        h.eat(header.text.as_bytes());
    }
    h.finish()
}

/// `source` built for the CPU: from the disk cache, or compiled now (seconds).
pub(super) fn build(source: &Source) -> Result<Built> {
    let compiler = compiler_version()?;
    let hash = key(source, &compiler);
    // A cache folder that cannot be made is no cache (a build in the temporary folder).
    let cache = default_cache_dir(|v| std::env::var_os(v))
        .filter(|dir| std::fs::create_dir_all(dir).is_ok());
    let cached = cache
        .as_ref()
        .map(|dir| dir.join(format!("{}.emu.{hash:016x}.so", source.file)));
    if let Some(file) = cached.as_ref().filter(|f| is_shared_object(f)) {
        return Ok(Built {
            path: file.clone(),
            scratch: None,
        });
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let scratch = cache
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!(
            ".emu-build-{}-{}-{}",
            source.file,
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
    let built = compile_in(&scratch, source);
    let built = built.and_then(|object| match &cached {
        Some(file) => {
            std::fs::rename(&object, file)
                .map_err(|e| Error::io(format!("moving {} to the cache", object.display()), e))?;
            Ok(Built {
                path: file.clone(),
                scratch: None,
            })
        }
        None => Ok(Built {
            path: object,
            scratch: Some(scratch.clone()),
        }),
    });
    if !matches!(&built, Ok(b) if b.scratch.is_some()) {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    built
}

/// A cached file that starts as an ELF file does (a truncated one is rebuilt).
fn is_shared_object(file: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(file)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"\x7fELF"
}

/// Writes the sources into `dir`, generates the entries and compiles; the object's path.
fn compile_in(dir: &Path, source: &Source) -> Result<PathBuf> {
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap_or(dir))
            .and_then(|_| std::fs::write(&path, text))
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    };
    write(source.file, source.text)?;
    for h in kernels::HEADERS {
        write(h.file, h.text)?;
    }
    write("shim/qccl_shim.h", SHIM)?;
    write("shim/emu_entry.h", ENTRY)?;

    let pre = run(
        Command::new(CXX)
            .args(["-std=c++17", "-E", "-P", "-DQCCL_SHIM=1", "-x", "c++"])
            .arg(dir.join(source.file)),
        source,
        "preprocessing",
    )?;
    let pre = String::from_utf8_lossy(&pre);
    let names = kernels::entry_points(&pre);
    let fibers = needs_fibers(&pre);
    write("entries.cpp", &generate(source.file, &names, fibers))?;

    let object = dir.join("kernels.so");
    run(
        Command::new(CXX)
            .args(FLAGS)
            .arg("-o")
            .arg(&object)
            .arg(dir.join("entries.cpp")),
        source,
        "compiling",
    )?;
    Ok(object)
}

/// Whether a preprocessed file calls anything that needs the shim's fiber mode.
fn needs_fibers(preprocessed: &str) -> bool {
    SYNC_CALLS.iter().any(|call| preprocessed.contains(call))
}

/// The generated C++ file: the shim, the kernel file, and one packed entry per kernel.
fn generate(file: &str, names: &[String], fibers: bool) -> String {
    let mut out = format!(
        "// Generated by qccl's emulated GPU driver: {file}'s kernels for the CPU.\n\
         #define QCCL_SHIM_THROW 1\n\
         #include \"shim/qccl_shim.h\"\n\
         #include \"{file}\"\n\
         #include \"shim/emu_entry.h\"\n"
    );
    for name in names {
        out.push_str(&format!("QCCL_EMU_ENTRY({name}, {})\n", u8::from(fibers)));
    }
    out
}

/// Runs a compiler step; its stdout, or `Internal` with its messages.
fn run(cmd: &mut Command, source: &Source, what: &str) -> Result<Vec<u8>> {
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("running {CXX} for {}", source.file), e))?;
    if out.status.success() {
        return Ok(out.stdout);
    }
    let log = String::from_utf8_lossy(&out.stderr);
    let log: String = log.chars().take(4000).collect();
    Err(Error::Internal(format!(
        "{what} {} for the emulated GPU failed ({}):\n{log}",
        source.file, out.status
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_file_has_one_entry_per_kernel() {
        let g = generate("x.cu", &["a_k".into(), "b_k".into()], true);
        assert!(g.contains("#define QCCL_SHIM_THROW 1\n"), "{g}");
        assert!(g.contains("#include \"x.cu\"\n"), "{g}");
        assert!(
            g.ends_with("QCCL_EMU_ENTRY(a_k, 1)\nQCCL_EMU_ENTRY(b_k, 1)\n"),
            "{g}"
        );
    }

    #[test]
    fn synchronising_files_run_as_fibers() {
        assert!(!needs_fibers(
            "extern \"C\" __global__ void k(int* x) { x[0] = 1; }"
        ));
        for call in SYNC_CALLS {
            assert!(needs_fibers(&format!(
                "void k() {{ {call}(0xffffffffu, 1); }}"
            )));
        }
    }

    #[test]
    fn the_key_follows_the_source() {
        let a = Source {
            file: "a.cu",
            text: "x",
        };
        let b = Source {
            file: "a.cu",
            text: "y",
        };
        assert_ne!(key(&a, "g++ 13"), key(&b, "g++ 13"));
        assert_ne!(key(&a, "g++ 13"), key(&a, "g++ 14"));
        assert_eq!(key(&a, "g++ 13"), key(&a, "g++ 13"));
    }
}
