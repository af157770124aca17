//! Every kernel of `kernels/` compiles with NVRTC, for the architectures qccl's GPUs have (sm_80,
//! sm_90), as PTX and as CUBIN, and exports the entry points its source declares. No GPU needed:
//! only libnvrtc (`QCCL_NVRTC_LIB`, or on the library path; .ci/run installs the
//! `nvidia-cuda-nvrtc` wheel). Without it the test skips, unless QCCL_REQUIRE_NVRTC=1.
//!
//! Also, without NVRTC: the library embeds exactly the files in `kernels/`.
#![cfg(feature = "cuda")]

use std::collections::BTreeSet;
use std::path::PathBuf;

use qccl::internal::kernels::{self, Source};
use qccl::internal::nvrtc::{self, Compiler, Program, Target};
use qccl::{DType, ReduceOp};

const ARCHS: [u32; 2] = [80, 90];

fn kernels_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// NVRTC's version, or `None` (with a note) where it is absent and not required.
fn nvrtc_or_skip() -> Option<(u32, u32)> {
    match nvrtc::version() {
        Ok(v) => Some(v),
        Err(e) if std::env::var("QCCL_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("QCCL_REQUIRE_NVRTC=1 but NVRTC cannot be used: {e}")
        }
        Err(e) => {
            eprintln!("skipped (set QCCL_NVRTC_LIB, or QCCL_REQUIRE_NVRTC=1 to fail): {e}");
            None
        }
    }
}

/// The files of `kernels/` ending in `ext`, sorted.
fn files_on_disk(ext: &str) -> BTreeSet<String> {
    std::fs::read_dir(kernels_dir())
        .expect("kernels/")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(ext))
        .collect()
}

#[test]
fn embedded_lists_match_the_folder() {
    for (ext, list) in [(".cu", kernels::SOURCES), (".cuh", kernels::HEADERS)] {
        let embedded: BTreeSet<String> = list.iter().map(|s| s.file.to_string()).collect();
        assert_eq!(
            embedded,
            files_on_disk(ext),
            "src/gpu/kernels.rs must embed every kernels/*{ext} (and nothing else)"
        );
        for s in list {
            let disk = std::fs::read_to_string(kernels_dir().join(s.file)).unwrap();
            assert_eq!(
                disk, s.text,
                "{}: embedded text differs from the file",
                s.file
            );
        }
    }
}

/// `.entry NAME(` lines of a PTX text.
fn ptx_entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|l| l[..l.find('(').unwrap_or(l.len())].trim().to_string())
        .collect()
}

/// What is wrong with one file's PTX against its declared entry points.
fn check_entries(src: &Source, sm: u32, entries: &BTreeSet<String>) -> Vec<String> {
    let mut bad = Vec::new();
    let declared = src.entry_points();
    if declared.is_empty() {
        bad.push(format!(
            "{}: no `extern \"C\" __global__ void NAME(` found",
            src.file
        ));
    }
    for pattern in &declared {
        if !entries.iter().any(|e| kernels::matches(pattern, e)) {
            bad.push(format!(
                "{} (compute_{sm}): declares {pattern} but the PTX has no such .entry",
                src.file
            ));
        }
    }
    for e in entries {
        if !declared.iter().any(|p| kernels::matches(p, e)) {
            bad.push(format!(
                "{} (compute_{sm}): .entry {e} matches no declaration the parser found",
                src.file
            ));
        }
    }
    bad
}

/// What is wrong with a CUBIN: not a 64-bit little-endian CUDA ELF, or a kernel's code
/// section missing.
fn check_cubin(src: &Source, sm: u32, cubin: &[u8], entries: &BTreeSet<String>) -> Vec<String> {
    const EM_CUDA: u16 = 190;
    let mut bad = Vec::new();
    let machine = cubin.get(18..20).map(|b| u16::from_le_bytes([b[0], b[1]]));
    if !cubin.starts_with(b"\x7fELF\x02\x01") || machine != Some(EM_CUDA) {
        bad.push(format!(
            "{} (sm_{sm}): not a CUDA ELF (first bytes {:02x?})",
            src.file,
            &cubin[..cubin.len().min(20)]
        ));
        return bad;
    }
    for e in entries {
        let section = format!(".text.{e}\0");
        if !cubin
            .windows(section.len())
            .any(|w| w == section.as_bytes())
        {
            bad.push(format!("{} (sm_{sm}): no code section for {e}", src.file));
        }
    }
    bad
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let Some(version) = nvrtc_or_skip() else {
        return;
    };
    let compiler = Compiler::new(None);
    let start = std::time::Instant::now();
    // One thread per file: NVRTC compiles independent programs concurrently.
    let results: Vec<(Vec<String>, BTreeSet<String>)> = std::thread::scope(|s| {
        let compiler = &compiler;
        let handles: Vec<_> = kernels::SOURCES
            .iter()
            .map(|src| s.spawn(move || compile_one(compiler, src)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut problems = Vec::new();
    let mut all_entries = BTreeSet::new();
    for (p, e) in results {
        problems.extend(p);
        all_entries.extend(e);
    }
    eprintln!(
        "NVRTC {}.{}: {} files, {} entry points, {:.1} s",
        version.0,
        version.1,
        kernels::SOURCES.len(),
        all_entries.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));

    // The device reduction needs a kernel for every dtype and op (avg: floats only).
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            if op.check_dtype(d).is_err() {
                continue;
            }
            let name = format!("qccl_reduce_{}_{}", op.name(), suffix(d));
            assert!(all_entries.contains(&name), "no kernel {name}");
        }
        if d.is_float() {
            let name = format!("qccl_finish_avg_{}", suffix(d));
            assert!(all_entries.contains(&name), "no kernel {name}");
        }
    }
}

/// On a GPU: every kernel, compiled for the device as qccl will compile it (CUBIN for its
/// `sm_XY`, or PTX), loads into the driver, and each of its entry points resolves.
#[test]
#[ignore = "needs a CUDA GPU and libnvrtc (QCCL_REQUIRE_GPU=1 fails instead of skipping)"]
fn every_kernel_loads_on_the_device() {
    use qccl::internal::cudarc::driver::CudaContext;
    use qccl::internal::cudarc::nvrtc::Ptx;
    if let Err(e) = qccl::gpu::available() {
        assert_ne!(
            std::env::var("QCCL_REQUIRE_GPU").as_deref(),
            Ok("1"),
            "QCCL_REQUIRE_GPU=1 but no GPU: {e}"
        );
        eprintln!("skipped: {e}");
        return;
    }
    let version = nvrtc_or_skip().expect("NVRTC is needed on a GPU machine");
    let ctx = CudaContext::new(0).expect("context on device 0");
    let (major, minor) = ctx.compute_capability().unwrap();
    let sm = u32::try_from(major * 10 + minor).unwrap();
    let compiler = Compiler::new(None);
    let mut loaded = 0;
    for src in kernels::SOURCES {
        let program = Program::kernel(src);
        let image = compiler.for_device(&program, sm).unwrap();
        let ptx = compiler.compile(&program, Target::Ptx, image.sm).unwrap();
        let entries = ptx_entries(std::str::from_utf8(&ptx.bytes).unwrap());
        let module = match image.target {
            Target::Cubin => Ptx::from_binary(image.bytes.clone()),
            Target::Ptx => Ptx::from_src(String::from_utf8(image.bytes.clone()).unwrap()),
        };
        let module = ctx
            .load_module(module)
            .unwrap_or_else(|e| panic!("{} ({:?}, sm_{}): {e}", src.file, image.target, image.sm));
        for e in &entries {
            module
                .load_function(e)
                .unwrap_or_else(|err| panic!("{}: {e} does not resolve: {err}", src.file));
            loaded += 1;
        }
    }
    eprintln!(
        "{} (sm_{sm}), NVRTC {}.{}: {loaded} kernels loaded",
        ctx.name().unwrap_or_default(),
        version.0,
        version.1
    );
}

/// One file as PTX and CUBIN for every arch: its problems and its entry points.
fn compile_one(compiler: &Compiler, src: &Source) -> (Vec<String>, BTreeSet<String>) {
    let program = Program::kernel(src);
    let mut problems = Vec::new();
    let mut all_entries = BTreeSet::new();
    for sm in ARCHS {
        let ptx = match compiler.compile(&program, Target::Ptx, sm) {
            Ok(p) => p,
            Err(e) => {
                problems.push(e.to_string());
                continue;
            }
        };
        let entries = ptx_entries(std::str::from_utf8(&ptx.bytes).expect("PTX is text"));
        problems.extend(check_entries(src, sm, &entries));
        match compiler.compile(&program, Target::Cubin, sm) {
            Ok(cubin) => problems.extend(check_cubin(src, sm, &cubin.bytes, &entries)),
            Err(e) => problems.push(e.to_string()),
        }
        all_entries.extend(entries);
    }
    (problems, all_entries)
}

/// The kernels' dtype suffix (kernels/reduce.cu).
fn suffix(d: DType) -> &'static str {
    qccl::internal::kernels::dtype_suffix(d)
}
