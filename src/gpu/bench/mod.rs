//! Kernel throughput on one device against the device's own copy bandwidth, measured in one
//! run (issue #22's figures; `qccl-gpu-bench` prints them): a device-to-device copy, the
//! reduction kernels, and each codec's encode with error feedback and decode+add through its
//! launch plan, the calls the compressed all-reduce makes.
//!
//! Each row counts the bytes its work must at least read and write (`traffic`), as the copy's
//! bandwidth is counted (bytes read and written): copy 2·4n for n f32s, reduction 3·size·n
//! (two inputs, one output), encode+EF 3·4n + payload (x and the residual read, the residual
//! and the payload written), decode+add 2·4m + payload where m is n, or the k elements a
//! sparse payload's (index, value) pairs add to. A kernel that needs several passes (top-k's
//! selection) is thus charged for one: the ratio to the copy is its efficiency against the
//! memory system. Each row also has its element rate (`Measure::algbw`, n·size per second,
//! nccl-tests' algbw), the same for every codec whatever it moves.
//!
//! Time is the host's wall clock over `iters` enqueued launches and one synchronize, after
//! `warmup` launches: the launches queue back to back, so for large buffers this is the
//! device's time. A codec's rows also say how that time splits among the plan's kernels
//! (`Measure::kernels`, from a separate pass that runs them one at a time: `profile.rs`).

mod profile;

use super::driver::{Arg, DeviceMem, Driver, Stream};
use super::kernels::dtype_suffix;
use super::plans::{grid_for, plan_for, BLOCK};
use crate::codec::{CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::types::DType;
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Elements (f32 for the codecs; each dtype's own for the reductions).
    pub count: usize,
    /// Timed launches per row.
    pub iters: usize,
    /// Untimed launches first.
    pub warmup: usize,
    /// Codec specs (`qsgd:bits=4,bucket=128`, ...): encode+EF and decode+add rows each.
    pub codecs: Vec<String>,
    /// Reduction kernels' dtypes (sum).
    pub reductions: Vec<DType>,
    /// Longest one row may take to synchronize.
    pub timeout: Duration,
}

/// One measured row.
#[derive(Debug, Clone, PartialEq)]
pub struct Measure {
    /// "copy", "reduce sum f32", "encode+ef qsgd:bits=4,bucket=128", "decode+add ...".
    pub name: String,
    /// Elements per launch.
    pub count: usize,
    /// Bytes of one element.
    pub size: usize,
    /// Bytes read and written per launch (the module's model).
    pub traffic: u64,
    /// Mean seconds per launch.
    pub seconds: f64,
    /// A launch plan's kernels (entry point, mean seconds per launch of the row), each run
    /// alone between two synchronizes in a pass of their own (`profile.rs`): which kernel
    /// takes the time, not the row's speed. Empty for a row of one kernel or copy.
    pub kernels: Vec<(String, f64)>,
}

impl Measure {
    /// Element bytes processed per second, GB/s (count·size per launch).
    pub fn algbw(&self) -> f64 {
        if self.seconds > 0.0 {
            (self.count * self.size) as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }

    /// Traffic bandwidth, GB/s (1e9 bytes).
    pub fn gbps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.traffic as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// Runs every row of `cfg` on device `ordinal` of `driver`; the copy first (the others are
/// read against it).
pub fn run(driver: &dyn Driver, ordinal: usize, cfg: &BenchConfig) -> Result<Vec<Measure>> {
    if cfg.count == 0 || cfg.iters == 0 {
        return Err(Error::invalid(
            "gpu bench: the element count and the iterations must be at least 1",
        ));
    }
    let specs = cfg
        .codecs
        .iter()
        .map(|s| CodecSpec::parse(s))
        .collect::<Result<Vec<_>>>()?;
    let s = driver.create_stream(ordinal)?;
    let n = cfg.count;
    let f32s = |what: &str| {
        driver
            .alloc_device(ordinal, 4 * n)
            .map_err(|e| e.prefixed(&format!("gpu bench: {what} ({} bytes): ", 4 * n)))
    };
    let x = f32s("input")?;
    let y = f32s("output")?;
    // Gradient-like values, so that the codecs' data-dependent work is representative.
    let host: Vec<u8> = (0..n)
        .flat_map(|i| ((i as f32 * 0.618_034).sin() * 1e-2).to_le_bytes())
        .collect();
    // SAFETY: `host` lives until the synchronize below; `x` and `y` hold 4n bytes each.
    unsafe {
        s.copy_to_device(x.addr(), host.as_ptr(), host.len())?;
        s.copy_to_device(y.addr(), host.as_ptr(), host.len())?;
    }
    s.synchronize(cfg.timeout)?;
    let mut out = Vec::new();
    let copy = 2 * 4 * n as u64;
    // SAFETY: `x` and `y` are distinct allocations of 4n bytes, used by nothing else.
    out.push(time(&*s, cfg, "copy".into(), (n, 4), copy, || unsafe {
        s.copy_on_device(y.addr(), x.addr(), 4 * n)
    })?);
    for &dtype in &cfg.reductions {
        out.push(reduction(driver, &*s, cfg, dtype, (&*x, &*y))?);
    }
    for (spec, text) in specs.iter().zip(&cfg.codecs) {
        out.extend(codec(driver, &*s, cfg, (spec, text), (&*x, &*y))?);
    }
    Ok(out)
}

/// `out = out + x` with the reduction kernel of `dtype` over `cfg.count` elements (the
/// buffers hold 4 bytes an element, enough for every dtype up to 4 bytes; wider dtypes use
/// half as many elements).
fn reduction(
    driver: &dyn Driver,
    s: &dyn Stream,
    cfg: &BenchConfig,
    dtype: DType,
    (x, y): (&dyn DeviceMem, &dyn DeviceMem),
) -> Result<Measure> {
    let size = dtype.size();
    let n = cfg.count * 4 / size;
    let f = driver.function(
        s.ordinal(),
        &format!("qccl_reduce_sum_{}", dtype_suffix(dtype)),
    )?;
    let args = [
        Arg::Ptr(y.addr()),
        Arg::Ptr(y.addr()),
        Arg::Ptr(x.addr()),
        Arg::U64(n as u64),
    ];
    let name = format!("reduce sum {}", dtype_suffix(dtype));
    let traffic = 3 * (size * n) as u64;
    // SAFETY: reduce.cu's qccl_reduce_sum_T(T* out, const T* a, const T* b, uint64_t n) over
    // n elements of `size` bytes: 4·count bytes, what `x` and `y` hold; in place on `y`.
    time(s, cfg, name, (n, size), traffic, || unsafe {
        s.launch(&*f, grid_for(n.div_ceil(4)), BLOCK, &args)
    })
}

/// Encode with error feedback, then decode+add, of `spec`'s codec over `x` into `y`.
fn codec(
    driver: &dyn Driver,
    s: &dyn Stream,
    cfg: &BenchConfig,
    (spec, text): (&CodecSpec, &str),
    (x, y): (&dyn DeviceMem, &dyn DeviceMem),
) -> Result<Vec<Measure>> {
    let n = cfg.count;
    let ordinal = s.ordinal();
    let plan = plan_for(driver, ordinal, &**spec.codec())?;
    let alloc = |len: usize| driver.alloc_device(ordinal, len.max(1));
    let (payload, scratch, res) = (
        alloc(plan.payload_len(n))?,
        alloc(plan.scratch_len(n))?,
        alloc(4 * n)?,
    );
    let zeros = vec![0u8; 4 * n];
    let bad = driver.alloc_pinned(4)?;
    // SAFETY: `zeros` lives until the synchronize below; `res` holds 4n bytes; `bad` is a
    // page-locked word of ours.
    unsafe {
        s.copy_to_device(res.addr(), zeros.as_ptr(), zeros.len())?;
        bad.ptr().cast::<i32>().write_volatile(0);
    }
    s.synchronize(cfg.timeout)?;
    let p = plan.payload_len(n) as u64;
    let f32s = 4 * n as u64;
    // A sparse payload is (u32 index, f32 value) pairs: decode+add touches only those.
    let added = match plan.codec() {
        CodecId::TopK | CodecId::MsTopK | CodecId::RandK => p / 2,
        _ => f32s,
    };
    // SAFETY (all four closures): `x`, `y` and `res` hold n f32s, `payload` and `scratch`
    // the plan's lengths for n, `bad` a page-locked word; all live until this function
    // returns, after `time`'s and `profile`'s synchronizes, and nothing else touches them
    // (the profiling stream runs after the timed one is synchronised).
    let encode_on = |s: &dyn Stream| unsafe {
        plan.encode_ef(
            s,
            x.addr(),
            res.addr(),
            0,
            payload.addr(),
            n,
            7,
            scratch.addr(),
        )
    };
    let decode_on = |s: &dyn Stream| unsafe {
        plan.decode(
            s,
            payload.addr(),
            y.addr(),
            n,
            true,
            bad.ptr() as u64,
            scratch.addr(),
        )
    };
    let mut encode = time(
        s,
        cfg,
        format!("encode+ef {text}"),
        (n, 4),
        3 * f32s + p,
        || encode_on(s),
    )?;
    let mut decode = time(
        s,
        cfg,
        format!("decode+add {text}"),
        (n, 4),
        2 * added + p,
        || decode_on(s),
    )?;
    encode.kernels = profile(driver, ordinal, cfg, encode_on)?;
    decode.kernels = profile(driver, ordinal, cfg, decode_on)?;
    // SAFETY: the stream is synchronised (`time`), so the word is no longer written.
    if unsafe { bad.ptr().cast::<i32>().read_volatile() } != 0 {
        return Err(Error::Internal(format!(
            "gpu bench: {text}: decode refused the payload its own encode wrote"
        )));
    }
    Ok(vec![encode, decode])
}

/// Runs of a plan the kernel profile averages over (each kernel alone, synchronised).
const PROFILE_RUNS: usize = 5;

/// Each kernel's mean seconds per run of `enqueue` (a plan's launches on the stream it is
/// given), over up to `PROFILE_RUNS` runs on a stream of its own that runs them one at a
/// time.
fn profile(
    driver: &dyn Driver,
    ordinal: usize,
    cfg: &BenchConfig,
    enqueue: impl Fn(&dyn Stream) -> Result<()>,
) -> Result<Vec<(String, f64)>> {
    let s = profile::Profiled::new(driver.create_stream(ordinal)?, cfg.timeout);
    let runs = cfg.iters.min(PROFILE_RUNS);
    for _ in 0..runs {
        enqueue(&s)?;
    }
    s.synchronize(cfg.timeout)?;
    Ok(s.take(runs))
}

/// `cfg.warmup` then `cfg.iters` launches of `enqueue`, timed over the latter.
fn time(
    s: &dyn Stream,
    cfg: &BenchConfig,
    name: String,
    (count, size): (usize, usize),
    traffic: u64,
    enqueue: impl Fn() -> Result<()>,
) -> Result<Measure> {
    for _ in 0..cfg.warmup {
        enqueue()?;
    }
    s.synchronize(cfg.timeout)?;
    let start = Instant::now();
    for _ in 0..cfg.iters {
        enqueue()?;
    }
    s.synchronize(cfg.timeout)?;
    Ok(Measure {
        name,
        count,
        size,
        traffic,
        seconds: start.elapsed().as_secs_f64() / cfg.iters as f64,
        kernels: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::emu::EmuDriver;

    /// Every row runs under the emulated driver (its kernels built for the CPU by the shim);
    /// the figures mean nothing there, only that the rows run and decode accepts encode's
    /// payloads.
    #[test]
    fn every_row_runs_on_the_emulated_device() {
        let d = EmuDriver::new(1);
        if let Err(Error::Unsupported(why)) = d.function(0, "qccl_reduce_sum_f32") {
            assert_ne!(
                std::env::var("QCCL_REQUIRE_SHIM").as_deref(),
                Ok("1"),
                "QCCL_REQUIRE_SHIM=1 but {why}"
            );
            eprintln!("skipped: {why}");
            return;
        }
        let cfg = BenchConfig {
            count: 4099,
            iters: 2,
            warmup: 1,
            codecs: [
                "fp16",
                "qsgd:bits=4,bucket=128",
                "topk:density=0.01",
                "efsign",
            ]
            .map(String::from)
            .to_vec(),
            reductions: vec![DType::Float32, DType::Bfloat16, DType::Float64],
            timeout: Duration::from_secs(60),
        };
        let rows = run(&d, 0, &cfg).unwrap();
        let names: Vec<&str> = rows.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names[0], "copy");
        assert!(names.contains(&"reduce sum bf16"), "{names:?}");
        assert!(names.contains(&"decode+add topk:density=0.01"), "{names:?}");
        assert_eq!(rows.len(), 1 + 3 + 2 * 4);
        assert_eq!(rows[0].traffic, 8 * 4099);
        assert!(rows
            .iter()
            .all(|m| m.seconds > 0.0 && m.gbps() > 0.0 && m.algbw() > 0.0));
        // Sparse decode+add is charged for the pairs it adds, not the whole buffer.
        let topk = rows
            .iter()
            .find(|m| m.name == "decode+add topk:density=0.01")
            .unwrap();
        assert_eq!(topk.traffic, 16 * 41); // 41 pairs: read 8·41, read and write 4·41 each
                                           // Each codec row says which kernels its plan ran, in order, and for how long.
        let qsgd = rows
            .iter()
            .find(|m| m.name == "encode+ef qsgd:bits=4,bucket=128")
            .unwrap();
        let names: Vec<&str> = qsgd.kernels.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["qccl_qsgd_bounds_ef", "qccl_qsgd_levels_ef"]);
        assert!(qsgd.kernels.iter().all(|&(_, t)| t > 0.0));
        assert!(rows[0].kernels.is_empty());
        // Bad input is refused before anything is allocated.
        let none = BenchConfig { count: 0, ..cfg };
        assert!(matches!(run(&d, 0, &none), Err(Error::InvalidArgument(_))));
    }
}
