//! `kernels/draw.cuh`, the C twin of the codecs' counter-based draw, against the Rust one bit
//! for bit: compiled as C (`CC`, default `cc`) and as C++ (`CXX`, default `c++`, as the kernel
//! shim compiles the kernels), it prints site keys, draws, element bits, uniforms and random-k
//! indices for awkward inputs, and every line must equal what `qccl::codec` computes.
//! Needs a C and a C++ compiler, as the C ABI tests do.

use qccl::codec::{draw, draw32, uniform24, Site};
use qccl::internal::select_randk;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const KEYS: [u64; 5] = [0, 1, 0x0123_4567_89ab_cdef, u64::MAX, 0x8000_0000_0000_0000];
const INDICES: [u64; 8] = [0, 1, 2, 7, 4099, 1_000_003, 1 << 40, u64::MAX];
const SITES: [[u64; 4]; 4] = [
    [0, 0, 0, 0],
    [1, 2, 3, 4],
    [u64::MAX, 1 << 63, 4096, 7],
    [0x5eed, 123_456, 1_000_003, 255],
];
/// (n, k) pairs for random-k: k 0, 1, n − 1 and n, primes, k dividing n and not.
const RANDK: [(u64, u64); 8] = [
    (1, 1),
    (7, 3),
    (100, 7),
    (4099, 41),
    (1_000_003, 1000),
    (50, 49),
    (64, 64),
    (10, 0),
];

fn list(v: &[u64]) -> String {
    v.iter()
        .map(|x| format!("{x}ULL"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The C program: one line per value, in the order `expected` writes them.
fn program() -> String {
    let sites: Vec<String> = SITES.iter().map(|s| format!("{{{}}}", list(s))).collect();
    let randk: Vec<String> = RANDK
        .iter()
        .map(|&(n, k)| format!("{{{n}ULL, {k}ULL}}"))
        .collect();
    format!(
        r#"#include <stdio.h>
#include "draw.cuh"
static const unsigned long long keys[] = {{{keys}}};
static const unsigned long long idx[] = {{{idx}}};
static const unsigned long long sites[][4] = {{{sites}}};
static const unsigned long long randk[][2] = {{{randk}}};
int main(void) {{
    unsigned a, b, t;
    for (a = 0; a < sizeof sites / sizeof sites[0]; a++)
        printf("key %llu\n", qccl_site_key(sites[a][0], sites[a][1], sites[a][2], sites[a][3]));
    for (a = 0; a < sizeof keys / sizeof keys[0]; a++)
        for (b = 0; b < sizeof idx / sizeof idx[0]; b++) {{
            /* u·2^24 is the exact integer r24: prints the float without rounding. */
            float u = qccl_uniform24(keys[a], idx[b]);
            printf("draw %llu bits %u u %u\n", qccl_draw(keys[a], idx[b]),
                   qccl_draw32(keys[a], idx[b]), (unsigned)(u * 16777216.0f));
        }}
    for (a = 0; a < sizeof randk / sizeof randk[0]; a++) {{
        printf("randk");
        for (t = 0; t < randk[a][1]; t++)
            printf(" %llu", qccl_randk_index(keys[2], randk[a][0], randk[a][1], t));
        printf("\n");
    }}
    return 0;
}}
"#,
        keys = list(&KEYS),
        idx = list(&INDICES),
        sites = sites.join(", "),
        randk = randk.join(", "),
    )
}

/// What the Rust codecs compute, in the program's format.
fn expected() -> String {
    let mut s = String::new();
    for [seed, step, chunk, rank] in SITES {
        let k = Site {
            seed,
            step,
            chunk,
            rank,
        }
        .key();
        writeln!(s, "key {k}").unwrap();
    }
    for key in KEYS {
        for i in INDICES {
            writeln!(
                s,
                "draw {} bits {} u {}",
                draw(key, i),
                draw32(key, i),
                (uniform24(key, i) * 16_777_216.0) as u32
            )
            .unwrap();
        }
    }
    let mut idx = Vec::new();
    for (n, k) in RANDK {
        select_randk(n as usize, k as usize, KEYS[2], &mut idx);
        s.push_str("randk");
        for i in &idx {
            write!(s, " {i}").unwrap();
        }
        s.push('\n');
    }
    s
}

fn kernels() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// Compiles `program()` with `compiler` (extra `flags`), runs it, returns its output.
fn run_twin(compiler: &str, flags: &[&str], tag: &str) -> String {
    let dir = std::env::temp_dir().join(format!("qccl-draw-twin-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("twin.c");
    let bin = dir.join("twin");
    std::fs::write(&src, program()).unwrap();
    let out = Command::new(compiler)
        .args(flags)
        .arg("-Wall")
        .arg("-Wextra")
        .arg("-Werror")
        .arg("-I")
        .arg(kernels())
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap_or_else(|e| panic!("could not start {compiler}: {e} (set CC / CXX)"));
    assert!(
        out.status.success(),
        "{compiler} failed on kernels/draw.cuh:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&bin).output().unwrap();
    assert!(run.status.success());
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8(run.stdout).unwrap()
}

fn check(got: &str, compiler: &str) {
    let want = expected();
    for (n, (g, w)) in got.lines().zip(want.lines()).enumerate() {
        assert_eq!(g, w, "{compiler}: line {n} of the draw.cuh twin differs");
    }
    assert_eq!(got.lines().count(), want.lines().count(), "{compiler}");
}

#[test]
fn c_twin_matches_rust() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    check(&run_twin(&cc, &["-std=c99", "-O2"], "c"), &cc);
}

#[test]
fn cxx_twin_matches_rust() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    check(
        &run_twin(&cxx, &["-x", "c++", "-std=c++17", "-O2"], "cxx"),
        &cxx,
    );
}
