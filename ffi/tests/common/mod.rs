//! Shared by the ffi integration tests: where libqccl.so / libqccl.a are.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The directory holding a freshly built libqccl.so and libqccl.a: `QCCL_FFI_LIB_DIR` if
/// set (to test another build), else this build's profile directory after
/// `cargo build -p qccl-ffi` into it.
///
/// The build is needed because cargo builds a library for its package's integration tests
/// only when they can link it, and this one has no rlib (the `qccl` crate owns
/// libqccl.rlib). Cargo holds no lock while tests run, so the nested build does not wait.
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("QCCL_FFI_LIB_DIR") {
            return PathBuf::from(d);
        }
        // This test binary is <target>/<profile>/deps/<name>.
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let target_dir = profile_dir.parent().unwrap();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(root())
            .args(["build", "--quiet", "-p", "qccl-ffi", "--target-dir"])
            .arg(target_dir);
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(other) => {
                cmd.args(["--profile", other]);
            }
            None => {}
        }
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for f in ["libqccl.so", "libqccl.a"] {
            assert!(
                profile_dir.join(f).exists(),
                "{f} not in {} after {cmd:?}",
                profile_dir.display()
            );
        }
        profile_dir
    })
}

/// The dynamic-section names of an ELF file: its SONAME (`DT_SONAME`) and the libraries it
/// needs (`DT_NEEDED`, in order). Read from the file itself, so no binutils are needed:
/// `Err` says why the file could not be read as ELF (not ELF, truncated, no dynamic
/// section).
pub fn elf_dynamic_names(path: &Path) -> Result<(Option<String>, Vec<String>), String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |what: &str| format!("{}: {what}", path.display());
    if b.len() < 52 || &b[..4] != b"\x7fELF" {
        return Err(bad("not an ELF file"));
    }
    let wide = match b[4] {
        1 => false,
        2 => true,
        _ => return Err(bad("unknown ELF class")),
    };
    let le = match b[5] {
        1 => true,
        2 => false,
        _ => return Err(bad("unknown ELF byte order")),
    };
    // An unsigned integer of `n` bytes at `at`, in the file's byte order.
    let uint = |at: usize, n: usize| -> Result<u64, String> {
        let s = b.get(at..at + n).ok_or_else(|| bad("truncated"))?;
        let mut v = 0u64;
        for i in 0..n {
            v = (v << 8) | u64::from(s[if le { n - 1 - i } else { i }]);
        }
        Ok(v)
    };
    let word = if wide { 8 } else { 4 };
    let at = |v: u64| usize::try_from(v).map_err(|_| bad("offset out of range"));
    let (phoff, phentsize, phnum) = if wide {
        (uint(0x20, 8)?, uint(0x36, 2)?, uint(0x38, 2)?)
    } else {
        (uint(0x1c, 4)?, uint(0x2a, 2)?, uint(0x2c, 2)?)
    };
    // (p_type, p_offset, p_vaddr, p_filesz) of every program header.
    let mut segments = Vec::new();
    for i in 0..phnum {
        let h = at(phoff + i * phentsize)?;
        let (off, vaddr, filesz) = if wide {
            (uint(h + 8, 8)?, uint(h + 16, 8)?, uint(h + 32, 8)?)
        } else {
            (uint(h + 4, 4)?, uint(h + 8, 4)?, uint(h + 16, 4)?)
        };
        segments.push((uint(h, 4)?, off, vaddr, filesz));
    }
    const PT_LOAD: u64 = 1;
    const PT_DYNAMIC: u64 = 2;
    let &(_, dyn_off, _, dyn_size) = segments
        .iter()
        .find(|s| s.0 == PT_DYNAMIC)
        .ok_or_else(|| bad("no PT_DYNAMIC segment"))?;
    // DT_* entries: (tag, value) pairs of two words each, up to DT_NULL.
    let (mut strtab, mut soname, mut needed) = (None, None, Vec::new());
    let mut e = at(dyn_off)?;
    while e + 2 * word <= at(dyn_off + dyn_size)? {
        let (tag, val) = (uint(e, word)?, uint(e + word, word)?);
        match tag {
            0 => break,
            1 => needed.push(val),
            5 => strtab = Some(val),
            14 => soname = Some(val),
            _ => {}
        }
        e += 2 * word;
    }
    // DT_STRTAB is an address: find it in the loaded segments.
    let strtab = strtab.ok_or_else(|| bad("no DT_STRTAB"))?;
    let &(_, load_off, load_vaddr, _) = segments
        .iter()
        .find(|s| s.0 == PT_LOAD && s.2 <= strtab && strtab < s.2 + s.3)
        .ok_or_else(|| bad("DT_STRTAB is outside the loaded segments"))?;
    let strtab = at(strtab - load_vaddr + load_off)?;
    let string = |i: u64| -> Result<String, String> {
        let s = b.get(strtab + at(i)?..).ok_or_else(|| bad("truncated"))?;
        let end = s
            .iter()
            .position(|&c| c == 0)
            .ok_or_else(|| bad("truncated"))?;
        Ok(String::from_utf8_lossy(&s[..end]).into_owned())
    };
    let soname = soname.map(string).transpose()?;
    let needed = needed.into_iter().map(string).collect::<Result<_, _>>()?;
    Ok((soname, needed))
}

/// `readelf -d`'s SONAME of `path`: `None` when readelf is not installed, `Some(None)` when
/// the file has none. Used to check `elf_dynamic_names` where binutils are present.
pub fn readelf_soname(path: &Path) -> Option<Option<String>> {
    let out = Command::new("readelf").arg("-d").arg(path).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Some(text.lines().find(|l| l.contains("(SONAME)")).and_then(|l| {
        let (_, rest) = l.split_once('[')?;
        Some(rest.split_once(']')?.0.to_string())
    }))
}

/// The SONAME libqccl.so must carry: `libqccl.so.<major>` (set by ffi/build.rs).
pub fn expected_soname() -> String {
    format!("libqccl.so.{}", env!("CARGO_PKG_VERSION_MAJOR"))
}
