//! Writes `$OUT_DIR/kernels.rs`: every `kernels/*.cu` and `*.cuh` as an `include_str!` entry
//! of src/gpu/kernels.rs's lists, so a new kernel file needs no edit anywhere else.

use std::path::{Path, PathBuf};

fn main() {
    // Read when the script runs, not when it was compiled: a build folder copied to another
    // checkout reuses the compiled script, which must still embed that checkout's kernels.
    let root = std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    let dir = Path::new(&root).join("kernels");
    // Cargo scans a folder given here for any change: a file added, removed or edited.
    println!("cargo:rerun-if-changed=kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let list = |ext: &str| -> String {
        files
            .iter()
            .filter(|f| f.ends_with(ext))
            .map(|f| {
                let path = dir.join(f);
                let path = path.to_str().expect("kernels/ path is UTF-8");
                format!("    Source {{ file: {f:?}, text: include_str!({path:?}) }},\n")
            })
            .collect()
    };
    let code = format!(
        "/// Every kernel file (`kernels/*.cu`), one NVRTC program each, by name.\n\
         pub static SOURCES: &[Source] = &[\n{}];\n\n\
         /// Every header the kernels include (`kernels/*.cuh`), handed to NVRTC by name, so\n\
         /// compiling needs no file system.\n\
         pub static HEADERS: &[Source] = &[\n{}];\n",
        list(".cu"),
        list(".cuh")
    );
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("kernels.rs");
    std::fs::write(out, code).expect("writing OUT_DIR/kernels.rs");
}
