//! Gives libqccl.so the SONAME `libqccl.so.<major>` (the crate version's major), so that
//! programs linked against it record the major version and `ffi/install.sh` can install it
//! as a normal versioned shared library (`libqccl.so.X.Y.Z`, `libqccl.so.X`, `libqccl.so`).
//! Only the cdylib gets the flag, and only on ELF targets (macOS would need
//! `-install_name`, Windows has no SONAME).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let elf = var("CARGO_CFG_TARGET_FAMILY")
        .split(',')
        .any(|f| f == "unix")
        && var("CARGO_CFG_TARGET_VENDOR") != "apple";
    if elf {
        let major = env!("CARGO_PKG_VERSION_MAJOR");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libqccl.so.{major}");
    }
}
