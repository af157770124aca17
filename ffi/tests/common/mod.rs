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
