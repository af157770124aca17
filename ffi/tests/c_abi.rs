//! The C ABI from C and C++: installs the library cargo just built into a temporary prefix
//! with `ffi/install.sh`, compiles `tests/c/*.c` and `examples/horovod_allreduce.cc` against
//! the installed header and library (through `pkg-config` when it is available), and runs
//! them: every collective on 2, 3 and 5 forked processes, 4 comms from one thread, the
//! error paths (also linked statically), buffer registration (also over the emulated RDMA
//! link), init from the environment with abort, a rank stopped with SIGSTOP (the others'
//! errors name it), and the Horovod-style example. Also checks the
//! installed tree: the versioned library `libqccl.so.X.Y.Z` with its links `libqccl.so.X` and
//! `libqccl.so`, and that programs linked with `-lqccl` record `libqccl.so.X`.
//!
//! The CMake package (`lib/cmake/qccl`): builds `examples/cmake` with `find_package(qccl)`
//! against the prefix, linked to `qccl::qccl` and to `qccl::qccl_static`, and runs it;
//! checks the version rule (same major, not newer) and that the package still works once the
//! prefix is moved. Where `cmake` is missing these tests print a line and pass, unless
//! `QCCL_REQUIRE_CMAKE=1` (set by `.ci/run`) makes that a failure.
//!
//! Needs a C and a C++ compiler (`CC` / `CXX`, default `cc` / `c++`) and bash.
//! `QCCL_SKIP_C_TESTS=1` skips these tests.

mod common;

use common::{elf_dynamic_names, expected_soname, lib_dir, readelf_soname, root};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

struct Setup {
    prefix: PathBuf,
    bin: PathBuf,
}

fn skip() -> bool {
    if std::env::var_os("QCCL_SKIP_C_TESTS").is_some_and(|v| v != "0") {
        eprintln!("QCCL_SKIP_C_TESTS is set: skipping the C ABI tests");
        return true;
    }
    false
}

fn run_checked(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: could not start {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed ({cmd:?}):\n{text}");
    text
}

fn has_pkg_config() -> bool {
    Command::new("pkg-config")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Compiler and linker flags for the installed library.
fn flags(prefix: &Path, static_link: bool) -> Vec<String> {
    let pc_dir = prefix.join("lib/pkgconfig");
    let mut f: Vec<String> = if has_pkg_config() {
        let mut args = vec!["--cflags", "--libs"];
        if static_link {
            args.push("--static");
        }
        let out = run_checked(
            Command::new("pkg-config")
                .args(&args)
                .arg("qccl")
                .env("PKG_CONFIG_PATH", &pc_dir),
            "pkg-config",
        );
        out.split_whitespace().map(String::from).collect()
    } else {
        // No pkg-config: the same flags by hand (install.sh still wrote qccl.pc).
        let mut v = vec![
            format!("-I{}", prefix.join("include").display()),
            format!("-L{}", prefix.join("lib").display()),
            "-lqccl".to_string(),
        ];
        if static_link {
            v.extend(["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl"].map(String::from));
        }
        v
    };
    if static_link {
        // Link libqccl.a itself rather than the .so next to it.
        let a = prefix.join("lib/libqccl.a").display().to_string();
        for x in f.iter_mut() {
            if x == "-lqccl" {
                *x = a.clone();
            }
        }
    } else {
        f.push(format!("-Wl,-rpath,{}", prefix.join("lib").display()));
    }
    f
}

fn compile(cc: &str, std: &str, src: &Path, out: &Path, flags: &[String]) {
    let mut cmd = Command::new(cc);
    cmd.arg(std)
        .args(["-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(out)
        .arg(src)
        .args(flags)
        .arg("-lm");
    run_checked(&mut cmd, &format!("compiling {}", src.display()));
}

/// This test binary's scratch directory (emptied by the first call).
fn base() -> &'static Path {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("qccl-c-abi");
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        base
    })
}

/// The prefix that `ffi/install.sh` installed the freshly built library into.
fn installed() -> &'static Path {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let prefix = base().join("prefix");
        run_checked(
            Command::new("bash")
                .arg(root().join("ffi/install.sh"))
                .arg("--prefix")
                .arg(&prefix)
                .arg("--from")
                .arg(lib_dir()),
            "ffi/install.sh",
        );
        prefix
    })
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let prefix = installed().to_path_buf();
        let bin = base().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let dynamic = flags(&prefix, false);
        for name in [
            "collectives",
            "group_threads",
            "errors",
            "init_env",
            "hier",
            "plan",
            "shrink",
            "stall",
            "register",
        ] {
            let src = root().join(format!("tests/c/{name}.c"));
            compile(&cc, "-std=c11", &src, &bin.join(name), &dynamic);
        }
        let errors = root().join("tests/c/errors.c");
        compile(
            &cc,
            "-std=c11",
            &errors,
            &bin.join("errors_static"),
            &flags(&prefix, true),
        );
        let example = root().join("examples/horovod_allreduce.cc");
        compile(
            &cxx,
            "-std=c++14",
            &example,
            &bin.join("horovod_allreduce"),
            &dynamic,
        );
        Setup { prefix, bin }
    })
}

/// One multi-process program at a time: they fork up to 5 ranks on a small machine.
static RUNNING: Mutex<()> = Mutex::new(());

fn run(name: &str, args: &[&str]) -> String {
    run_program(&setup().bin.join(name), args)
}

fn run_program(program: &Path, args: &[&str]) -> String {
    let name = program.display();
    let _one = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new(program)
        .args(args)
        // A hang becomes an error naming the stuck peer well before the test's deadline.
        .env("QCCL_TIMEOUT_MS", "30000")
        // cargo points LD_LIBRARY_PATH at the target directory, which would win over the
        // programs' rpath: load the installed library.
        .env_remove("LD_LIBRARY_PATH")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let read = |mut r: Box<dyn std::io::Read + Send>| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = r.read_to_string(&mut s);
                s
            })
        };
        let (o, e) = (read(Box::new(stdout)), read(Box::new(stderr)));
        let status = child.wait();
        let _ = tx.send((status, o.join().unwrap(), e.join().unwrap()));
    });
    match rx.recv_timeout(Duration::from_secs(180)) {
        Ok((status, out, err)) => {
            let status = status.unwrap();
            let text = format!("{out}{err}");
            assert!(
                status.success(),
                "{name} {args:?} failed ({status}):\n{text}"
            );
            print!("{text}");
            text
        }
        Err(_) => {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            panic!("{name} {args:?} did not finish within 180 s");
        }
    }
}

#[test]
fn c_collectives_on_2_processes() {
    if skip() {
        return;
    }
    assert!(run("collectives", &["2"]).contains("collectives on 2 processes: ok"));
}

#[test]
fn c_collectives_on_3_processes() {
    if skip() {
        return;
    }
    assert!(run("collectives", &["3"]).contains("collectives on 3 processes: ok"));
}

#[test]
fn c_collectives_on_5_processes() {
    if skip() {
        return;
    }
    assert!(run("collectives", &["5"]).contains("collectives on 5 processes: ok"));
}

#[test]
fn c_group_drives_4_comms_from_one_thread() {
    if skip() {
        return;
    }
    assert!(run("group_threads", &[]).contains("4 comms on one thread: ok"));
}

#[test]
fn c_survivors_shrink_after_a_rank_is_killed() {
    if skip() {
        return;
    }
    let out = run("shrink", &[]);
    assert!(out.contains("shrink on 4 processes: ok"), "{out}");
    // Every survivor's failure names the killed rank (directly, or through an aborted peer).
    let failed: Vec<&str> = out.lines().filter(|l| l.contains("failed (")).collect();
    assert_eq!(failed.len(), 3, "{out}");
    assert!(failed.iter().all(|l| l.contains("rank 2")), "{out}");
}

#[test]
fn c_buffer_registration_on_2_processes() {
    if skip() {
        return;
    }
    assert!(run("register", &["2"]).contains("registration on 2 processes: ok"));
}

#[test]
fn c_buffer_registration_on_3_processes_over_emulated_ib() {
    if skip() {
        return;
    }
    let out = run("register", &["3", "ib"]);
    assert!(
        out.contains("registration on 3 processes over IB (emulated): ok"),
        "{out}"
    );
    // Every rank's INFO line names the RDMA link: the registered buffers crossed it.
    let ib = out
        .lines()
        .filter(|l| l.contains(" on tcp+ib-emulated "))
        .count();
    assert_eq!(ib, 3, "{out}");
}

#[test]
fn c_error_paths() {
    if skip() {
        return;
    }
    assert!(run("errors", &[]).contains("checks ok"));
}

#[test]
fn c_error_paths_linked_statically() {
    if skip() {
        return;
    }
    assert!(run("errors_static", &[]).contains("checks ok"));
}

#[test]
fn c_init_from_env_and_abort() {
    if skip() {
        return;
    }
    let out = run("init_env", &[]);
    assert!(out.contains("on 3 processes: ok"), "{out}");
    assert!(out.contains("rank 1 called abort()"), "{out}");
}

#[test]
fn c_a_stopped_rank_is_named_by_the_others() {
    if skip() {
        return;
    }
    let out = run("stall", &[]);
    for transport in ["tcp", "shm"] {
        assert!(
            out.contains(&format!("stopped rank over {transport} on 4 processes: ok")),
            "{out}"
        );
    }
    // Three survivors per job, each naming rank 2 (the program checks the address).
    let named = out
        .lines()
        .filter(|l| l.contains("failed after") && l.contains("rank 2 ("))
        .count();
    assert_eq!(named, 6, "{out}");
}

#[test]
fn c_grouped_and_nonblocking_all_reduce_go_hierarchical() {
    if skip() {
        return;
    }
    let out = run("hier", &[]);
    assert!(out.contains("on 4 processes (2 hosts): ok"), "{out}");
    // QCCL_DEBUG=TRACE, QCCL_DEBUG_SUBSYS=COLL log each all-reduce's route: every rank's grouped (1001 elements),
    // non-blocking (1003) and blocking (1002) call ran hierarchically.
    for (count, op) in [(1001, "sum"), (1003, "sum"), (1002, "avg")] {
        let needle = format!("all_reduce(count={count}, float, {op}): hierarchical");
        let ranks: Vec<usize> = (0..4)
            .filter(|r| {
                out.lines()
                    .any(|l| l.contains(&format!("rank {r}: comm ")) && l.contains(&needle))
            })
            .collect();
        assert_eq!(
            ranks,
            [0, 1, 2, 3],
            "\"{needle}\" logged by ranks {ranks:?}:\n{out}"
        );
    }
}

#[test]
fn c_fusion_plan_on_3_processes() {
    if skip() {
        return;
    }
    assert!(run("plan", &["3"]).contains("fusion plan on 3 processes: ok"));
}

#[test]
fn c_fusion_plan_on_1_process() {
    if skip() {
        return;
    }
    assert!(run("plan", &["1"]).contains("fusion plan on 1 processes: ok"));
}

#[test]
fn cxx_horovod_example() {
    if skip() {
        return;
    }
    assert!(run("horovod_allreduce", &["3"]).contains("on 3 ranks: ok"));
}

#[test]
fn installed_pkg_config_file() {
    if skip() {
        return;
    }
    let s = setup();
    let pc = std::fs::read_to_string(s.prefix.join("lib/pkgconfig/qccl.pc")).unwrap();
    assert!(
        pc.contains(&format!("prefix={}", s.prefix.display())),
        "{pc}"
    );
    assert!(pc.contains("Libs: -L${libdir} -lqccl"), "{pc}");
    assert!(
        pc.contains("\nLibs.private: -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc\n"),
        "{pc}"
    );
    assert!(
        pc.contains(&format!("Version: {}", env!("CARGO_PKG_VERSION"))),
        "{pc}"
    );
    for f in ["lib/libqccl.so", "lib/libqccl.a", "include/qccl.h"] {
        assert!(s.prefix.join(f).exists(), "{f} not installed");
    }
    if has_pkg_config() {
        let v = run_checked(
            Command::new("pkg-config")
                .args(["--modversion", "qccl"])
                .env("PKG_CONFIG_PATH", s.prefix.join("lib/pkgconfig")),
            "pkg-config --modversion",
        );
        assert_eq!(v.trim(), env!("CARGO_PKG_VERSION"));
    } else {
        eprintln!("pkg-config not found: compiled with explicit -I/-L flags instead");
    }
}

#[test]
fn installed_library_is_versioned() {
    if skip() {
        return;
    }
    let s = setup();
    let lib = s.prefix.join("lib");
    let version = env!("CARGO_PKG_VERSION");
    let soname = expected_soname();
    let full = format!("libqccl.so.{version}");
    // The file, then the two links: libqccl.so -> libqccl.so.X -> libqccl.so.X.Y.Z.
    let meta = std::fs::symlink_metadata(lib.join(&full))
        .unwrap_or_else(|e| panic!("{full} not installed: {e}"));
    assert!(meta.file_type().is_file(), "{full} is not a regular file");
    for (link, target) in [(soname.as_str(), full.as_str()), ("libqccl.so", &soname)] {
        let got = std::fs::read_link(lib.join(link))
            .unwrap_or_else(|e| panic!("lib/{link} is not a symlink: {e}"));
        assert_eq!(got, Path::new(target), "lib/{link} points elsewhere");
    }
    if !cfg!(target_os = "linux") {
        eprintln!("not Linux: skipping the SONAME / NEEDED checks");
        return;
    }
    let (installed, _) = elf_dynamic_names(&lib.join(&full)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        installed.as_deref(),
        Some(soname.as_str()),
        "SONAME of {full}"
    );
    if let Some(r) = readelf_soname(&lib.join(&full)) {
        assert_eq!(r, installed, "readelf -d disagrees with the ELF parser");
    }
    // What the SONAME is for: a program linked through the libqccl.so link loads libqccl.so.X.
    let (_, needed) =
        elf_dynamic_names(&s.bin.join("collectives")).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        needed.contains(&soname),
        "tests/c/collectives needs {needed:?}, not {soname}"
    );
}

// ---- the CMake package ------------------------------------------------------------------

/// Whether the CMake tests can run: `cmake` is on PATH. Where it is not they print why and
/// pass, except under `QCCL_REQUIRE_CMAKE=1` (CI installs cmake and sets it), where a missing
/// cmake fails them.
fn has_cmake(test: &str) -> bool {
    static FOUND: OnceLock<Option<String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let out = Command::new("cmake").arg("--version").output().ok()?;
        out.status.success().then(|| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
    });
    match found {
        Some(_) => true,
        None if std::env::var_os("QCCL_REQUIRE_CMAKE").is_some_and(|v| v != "0") => {
            panic!("{test}: cmake is not on PATH, and QCCL_REQUIRE_CMAKE is set (install cmake)")
        }
        None => {
            eprintln!(
                "{test}: SKIPPED: cmake is not on PATH (QCCL_REQUIRE_CMAKE=1 makes this fail)"
            );
            false
        }
    }
}

/// `cmake` with these arguments: (succeeded, stdout + stderr). With a prefix, a configure
/// step that looks for packages there.
fn cmake(args: &[&str], prefix: Option<&Path>) -> (bool, String) {
    let mut cmd = Command::new("cmake");
    cmd.args(args);
    if let Some(prefix) = prefix {
        cmd.arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display()))
            // Not a qccl that a user registered (CMake 3.16+ reads these).
            .arg("-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF")
            .arg("-DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF");
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("could not start {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Configures and builds `examples/cmake` against the installed prefix into `base()/dir`
/// (extra configure arguments in `args`), and returns the build directory.
fn build_cmake_example(dir: &str, args: &[&str]) -> PathBuf {
    let build = base().join(dir);
    let src = root().join("examples/cmake");
    let (src, build_s) = (src.display().to_string(), build.display().to_string());
    let mut configure = vec!["-S", &src, "-B", &build_s];
    configure.extend_from_slice(args);
    let (ok, out) = cmake(&configure, Some(installed()));
    assert!(ok, "configuring examples/cmake {args:?} failed:\n{out}");
    assert!(
        out.contains(&format!("qccl {}", env!("CARGO_PKG_VERSION"))),
        "{out}"
    );
    let (ok, out) = cmake(&["--build", &build_s], None);
    assert!(ok, "building examples/cmake {args:?} failed:\n{out}");
    build
}

fn check_cmake_example_runs(build: &Path) {
    let out = run_program(&build.join("allreduce"), &[]);
    assert!(
        out.contains(&format!(
            "qccl {}: all-reduce of 65536 floats on 4 ranks (one process): ok",
            env!("CARGO_PKG_VERSION")
        )),
        "{out}"
    );
    let out = run_program(&build.join("horovod_allreduce"), &["2"]);
    assert!(out.contains("on 2 ranks: ok"), "{out}");
}

#[test]
fn cmake_example_links_qccl_qccl() {
    if skip() || !has_cmake("cmake_example_links_qccl_qccl") {
        return;
    }
    let build = build_cmake_example("cmake-shared", &[]);
    // Linked to the installed library by its SONAME; run without LD_LIBRARY_PATH, so the
    // library is found through the run path CMake gives programs in its build tree.
    if cfg!(target_os = "linux") {
        let (_, needed) =
            elf_dynamic_names(&build.join("allreduce")).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            needed.contains(&expected_soname()),
            "allreduce needs {needed:?}"
        );
    }
    check_cmake_example_runs(&build);
}

#[test]
fn cmake_example_links_qccl_qccl_static() {
    if skip() || !has_cmake("cmake_example_links_qccl_qccl_static") {
        return;
    }
    let build = build_cmake_example("cmake-static", &["-DQCCL_EXAMPLE_STATIC=ON"]);
    if cfg!(target_os = "linux") {
        let (_, needed) =
            elf_dynamic_names(&build.join("allreduce")).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            !needed.iter().any(|n| n.starts_with("libqccl")),
            "allreduce linked statically still needs {needed:?}"
        );
    }
    check_cmake_example_runs(&build);
}

/// A project with no languages (nothing to compile) that calls `find_package(qccl <WANT>)`
/// and prints what it found.
fn cmake_probe(want: &str, prefix: &Path) -> (bool, String) {
    let src = base().join("cmake-probe");
    static WRITE: OnceLock<()> = OnceLock::new();
    WRITE.get_or_init(|| {
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(
            src.join("CMakeLists.txt"),
            r#"cmake_minimum_required(VERSION 3.10)
project(qccl_probe LANGUAGES NONE)
find_package(qccl ${WANT} REQUIRED)
get_target_property(shared qccl::qccl IMPORTED_LOCATION)
get_target_property(static qccl::qccl_static IMPORTED_LOCATION)
get_target_property(inc qccl::qccl INTERFACE_INCLUDE_DIRECTORIES)
get_target_property(libs qccl::qccl_static INTERFACE_LINK_LIBRARIES)
message(STATUS "probe: version=${qccl_VERSION} dir=${qccl_DIR}")
message(STATUS "probe: shared=${shared} static=${static} include=${inc} libs=${libs}")
"#,
        )
        .unwrap();
    });
    let n = {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    };
    let build = base().join(format!("cmake-probe-build-{n}"));
    let (src, build) = (src.display().to_string(), build.display().to_string());
    cmake(
        &["-S", &src, "-B", &build, &format!("-DWANT={want}")],
        Some(prefix),
    )
}

#[test]
fn cmake_package_version_and_relocation() {
    if skip() || !has_cmake("cmake_package_version_and_relocation") {
        return;
    }
    let prefix = installed();
    let version = env!("CARGO_PKG_VERSION");
    let major: u32 = env!("CARGO_PKG_VERSION_MAJOR").parse().unwrap();
    let minor: u32 = env!("CARGO_PKG_VERSION_MINOR").parse().unwrap();
    let expect_paths = |out: &str, p: &Path| {
        let p = p.display();
        for want in [
            format!("version={version} dir={p}/lib/cmake/qccl"),
            format!(
                "shared={p}/lib/libqccl.so.{version} static={p}/lib/libqccl.a include={p}/include"
            ),
            "libs=gcc_s;util;rt;pthread;m;dl;c".to_string(),
        ] {
            assert!(says(out, &want), "no \"{want}\" in:\n{out}");
        }
    };

    // SameMajorVersion: any version of this major up to this one, and none.
    for want in [
        String::new(),
        format!("{major}"),
        format!("{major}.{minor}"),
        version.to_string(),
    ] {
        let (ok, out) = cmake_probe(&want, prefix);
        assert!(ok, "find_package(qccl {want}) failed:\n{out}");
        expect_paths(&out, prefix);
    }
    // A newer minor, the next major, and 99: REQUIRED fails, naming the installed version.
    for want in [
        format!("{major}.{}", minor + 1),
        format!("{}", major + 1),
        "99".to_string(),
    ] {
        let (ok, out) = cmake_probe(&want, prefix);
        assert!(!ok, "find_package(qccl {want} REQUIRED) succeeded:\n{out}");
        assert!(
            says(&out, &format!("requested version \"{want}\""))
                && says(&out, &format!("qcclConfig.cmake, version: {version}")),
            "find_package(qccl {want}) failed for another reason:\n{out}"
        );
    }

    // Relocatable: no file of the package names the prefix, and a copy of the installed
    // tree elsewhere (hard links) finds its own files.
    let cmake_dir = prefix.join("lib/cmake/qccl");
    for f in ["qcclConfig.cmake", "qcclConfigVersion.cmake"] {
        let text = std::fs::read_to_string(cmake_dir.join(f)).unwrap();
        assert!(
            !text.contains(&prefix.display().to_string()),
            "lib/cmake/qccl/{f} names the install prefix:\n{text}"
        );
    }
    let moved = base().join("moved-prefix");
    let files = [
        "include/qccl.h".to_string(),
        format!("lib/libqccl.so.{version}"),
        "lib/libqccl.a".to_string(),
        "lib/cmake/qccl/qcclConfig.cmake".to_string(),
        "lib/cmake/qccl/qcclConfigVersion.cmake".to_string(),
    ];
    for f in &files {
        let to = moved.join(f);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        if std::fs::hard_link(prefix.join(f), &to).is_err() {
            std::fs::copy(prefix.join(f), &to).unwrap();
        }
    }
    let (ok, out) = cmake_probe(&format!("{major}.{minor}"), &moved);
    assert!(ok, "find_package(qccl) in the moved prefix failed:\n{out}");
    expect_paths(&out, &moved);

    // An incomplete install is not found, and says what is missing.
    std::fs::remove_file(moved.join("lib/libqccl.a")).unwrap();
    let (ok, out) = cmake_probe("", &moved);
    assert!(!ok, "found without lib/libqccl.a:\n{out}");
    assert!(says(&out, "lib/libqccl.a is missing"), "{out}");
}

/// Whether CMake's output says `want`: CMake wraps long messages at word boundaries (where
/// depends on the length of the paths in them), so compare with whitespace collapsed.
fn says(out: &str, want: &str) -> bool {
    let flat = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    flat(out).contains(&flat(want))
}
