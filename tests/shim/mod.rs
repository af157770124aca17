//! Runs kernels/*.cu on the CPU through the shim (kernels/shim/qccl_shim.h): builds a driver
//! program per kernel file with g++ and runs one job per call. Shared by the kernel parity
//! tests (`mod shim;` in a test file).
//!
//! Without g++ the tests print why and pass, unless QCCL_REQUIRE_SHIM=1 (set by .ci/run), which
//! turns a missing compiler into a failure.

#![allow(dead_code)]

use qccl::DType;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn work_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kernels-shim")
}

/// True when the shim cannot run and the caller should skip (reason printed); panics instead
/// when QCCL_REQUIRE_SHIM=1.
fn unavailable() -> Option<String> {
    let ok = Command::new("g++")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        return None;
    }
    let why = "g++ not found: the kernel shim tests need it".to_string();
    if std::env::var("QCCL_REQUIRE_SHIM").as_deref() == Ok("1") {
        panic!("{why} (QCCL_REQUIRE_SHIM=1)");
    }
    eprintln!("skipping: {why}");
    Some(why)
}

/// A compiled driver, kernels/shim/<name>_driver.cpp.
#[derive(Clone)]
pub struct Driver {
    exe: PathBuf,
}

/// The driver `name`, built once per test process; None (after printing why) when g++ is
/// missing and not required.
pub fn driver(name: &str) -> Option<Driver> {
    driver_with(name, None)
}

/// As `driver`, built with the preprocessor symbol `define` too (a variant of the shim, such
/// as QCCL_SHIM_UCONTEXT: fiber switches through swapcontext).
pub fn driver_with(name: &str, define: Option<&str>) -> Option<Driver> {
    // One cell per driver, so tests needing different drivers build them in parallel.
    type Cell = Arc<OnceLock<Option<Driver>>>;
    static BUILT: OnceLock<Mutex<HashMap<String, Cell>>> = OnceLock::new();
    let key = format!(
        "{name}{}",
        define.map(|d| format!("-{d}")).unwrap_or_default()
    );
    let cell = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.clone())
        .or_default()
        .clone();
    cell.get_or_init(|| unavailable().is_none().then(|| build(name, &key, define)))
        .clone()
}

fn build(name: &str, key: &str, define: Option<&str>) -> Driver {
    let src = root().join(format!("kernels/shim/{name}_driver.cpp"));
    let dir = work_dir();
    std::fs::create_dir_all(&dir).expect("create the shim work dir");
    let exe = dir.join(format!("{key}_driver"));
    // -ffp-contract=off: no FMA contraction, as the CPU codecs and the NVRTC build (fmad off).
    let out = Command::new("g++")
        .args(["-O2", "-std=c++17", "-ffp-contract=off", "-Wall", "-Werror"])
        .args(define.map(|d| format!("-D{d}")))
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Driver { exe }
}

/// One kernel run: numeric arguments, input buffers and the names of output buffers.
pub struct Job<'a> {
    entry: String,
    nums: Vec<(String, String)>,
    inputs: Vec<(String, &'a [u8])>,
    outputs: Vec<String>,
}

impl<'a> Job<'a> {
    pub fn new(entry: &str) -> Self {
        Job {
            entry: entry.to_string(),
            nums: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
        }
    }

    /// A numeric argument (anything Display: integers, floats).
    pub fn arg(mut self, key: &str, v: impl std::fmt::Display) -> Self {
        self.nums.push((key.to_string(), v.to_string()));
        self
    }

    /// An input buffer, raw bytes.
    pub fn input(mut self, key: &str, bytes: &'a [u8]) -> Self {
        self.inputs.push((key.to_string(), bytes));
        self
    }

    /// An output buffer the driver writes.
    pub fn output(mut self, key: &str) -> Self {
        self.outputs.push(key.to_string());
        self
    }

    /// Runs the job; returns each output's bytes by key. Panics with the driver's stderr if it
    /// fails (a shim abort names the block and thread).
    pub fn run(self, d: &Driver) -> HashMap<String, Vec<u8>> {
        match self.exec(d) {
            Ok(res) => res,
            Err(msg) => panic!("{msg}"),
        }
    }

    /// Runs a job that must fail; returns the driver's stderr.
    pub fn run_failing(self, d: &Driver) -> String {
        match self.exec(d) {
            Ok(_) => panic!("{} succeeded; it should have failed", self.entry),
            Err(msg) => msg,
        }
    }

    fn exec(&self, d: &Driver) -> Result<HashMap<String, Vec<u8>>, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = work_dir().join(format!(
            "job-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the job dir");
        let file = |k: &str| dir.join(k).to_string_lossy().into_owned();
        let mut cmd = Command::new(&d.exe);
        cmd.arg(&self.entry);
        for (k, v) in &self.nums {
            cmd.arg(format!("{k}={v}"));
        }
        for (k, bytes) in &self.inputs {
            std::fs::write(file(k), bytes).expect("write a job input");
            cmd.arg(format!("{k}={}", file(k)));
        }
        for k in &self.outputs {
            cmd.arg(format!("{k}={}", file(k)));
        }
        let out = cmd.output().expect("run the shim driver");
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(format!(
                "{} {} failed ({}):\n{}",
                d.exe.display(),
                self.entry,
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let res = self
            .outputs
            .iter()
            .map(|k| {
                let bytes = std::fs::read(file(k)).expect("read a job output");
                (k.clone(), bytes)
            })
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        Ok(res)
    }
}

/// The counts every kernel is tested at: empty, one, a partial group of eight, a prime past a
/// few blocks, and a large prime.
pub const COUNTS: [usize; 5] = [0, 1, 7, 4099, 1_000_003];

/// A small, fast, seeded generator for test inputs (splitmix64), independent of qccl's Rng.
pub struct Gen(u64);

impl Gen {
    pub fn new(seed: u64) -> Self {
        Gen(seed)
    }

    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u64() as u8).collect()
    }

    /// f32 test values: mostly ordinary magnitudes, with random bit patterns (NaN, infinity,
    /// subnormals) and signed zeros mixed in, unless `finite`.
    pub fn f32s(&mut self, n: usize, finite: bool) -> Vec<f32> {
        (0..n)
            .map(|_| match self.u64() % 16 {
                0 if !finite => f32::from_bits(self.u64() as u32),
                1 => {
                    if self.u64() & 1 == 0 {
                        0.0
                    } else {
                        -0.0
                    }
                }
                2 => ((self.unit() - 0.5) * 1e-6) as f32,
                3 => ((self.unit() - 0.5) * 7e4) as f32,
                _ => ((self.unit() - 0.5) * 4.0) as f32,
            })
            .collect()
    }
}

/// f32s as little-endian bytes.
pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Little-endian bytes as f32s.
pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Asserts two byte buffers are equal, reporting the first differing element of `size` bytes.
pub fn assert_same(what: &str, got: &[u8], want: &[u8], size: usize) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(i) = got
        .chunks(size)
        .zip(want.chunks(size))
        .position(|(g, w)| g != w)
    {
        let r = i * size..(i * size + size).min(got.len());
        panic!(
            "{what}: element {i} differs: got {:02x?}, want {:02x?}",
            &got[r.clone()],
            &want[r]
        );
    }
}

/// True when element bytes `b` of dtype `d` are a NaN.
pub fn is_nan(d: DType, b: &[u8]) -> bool {
    match d {
        DType::Float16 => u16::from_le_bytes([b[0], b[1]]) & 0x7fff > 0x7c00,
        DType::Bfloat16 => u16::from_le_bytes([b[0], b[1]]) & 0x7fff > 0x7f80,
        DType::Float32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
        DType::Float64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
        _ => false,
    }
}

/// Bit-for-bit equality, except that a NaN matches any NaN where `any_nan` (sum, product and
/// division: Rust leaves the sign and payload of their NaN results unspecified).
pub fn check(what: &str, d: DType, got: &[u8], want: &[u8], any_nan: bool) {
    if any_nan {
        let size = d.size();
        let (mut g, mut w) = (got.to_vec(), want.to_vec());
        for (g, w) in g.chunks_mut(size).zip(w.chunks_mut(size)) {
            if is_nan(d, g) && is_nan(d, w) {
                g.fill(0);
                w.fill(0);
            }
        }
        assert_same(what, &g, &w, size)
    } else {
        assert_same(what, got, want, d.size())
    }
}

/// Random elements of `d`: integers uniform over their bits, floats mixing ordinary values
/// with random bit patterns (NaN, infinity, subnormal) and signed zeros.
pub fn random(g: &mut Gen, d: DType, n: usize) -> Vec<u8> {
    match d {
        DType::Float32 => g
            .f32s(n, false)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::Float64 => g
            .f32s(n, false)
            .iter()
            .zip(g.f32s(n, false))
            .flat_map(|(&v, w)| {
                // Keep a NaN's payload and fill the low bits, so f64 NaNs are varied too.
                let x = if v.is_nan() {
                    f64::from_bits((v as f64).to_bits() | w.to_bits() as u64)
                } else {
                    v as f64 + w as f64 * 1e-9
                };
                x.to_le_bytes()
            })
            .collect(),
        DType::Float16 => g
            .f32s(n, false)
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        DType::Bfloat16 => g
            .f32s(n, false)
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        _ => g.bytes(n * d.size()),
    }
}
