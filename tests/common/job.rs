//! Ranks as OS processes: the test binary re-executes itself, and its `child` test runs the
//! scenario named in QCCL_TEST_CHILD as one rank (QCCL_RANK, QCCL_WORLD_SIZE, QCCL_COMM_ID
//! and QCCL_SECRET set by [`Job`]).

use qccl::launch::ReservedPort;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The variable naming a child's scenario.
pub const CHILD: &str = "QCCL_TEST_CHILD";

/// A command that runs this test binary's `child` test as scenario `scenario`.
pub fn child_command(scenario: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child",
        "--nocapture",
        "--test-threads",
        "1",
        "-q",
    ])
    .env(CHILD, scenario)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    cmd
}

/// Ends a child process: exit code `ok` on success, else the error printed after
/// `QCCL-TEST-ERROR:` (what the parent's assertions look for) and exit code `failed`.
pub fn exit_with(result: Result<(), String>, ok: i32, failed: i32) -> ! {
    let code = match result {
        Ok(()) => ok,
        Err(e) => {
            eprintln!("QCCL-TEST-ERROR: {e}");
            failed
        }
    };
    std::process::exit(code)
}

/// One job's ranks, rendezvousing at 127.0.0.1:`port`.
pub struct Job {
    /// Held for the job's life: rank 0 binds the port, but no other process or connection
    /// gets it from the kernel in the meantime (picking a free port and releasing it let
    /// another process take it under load: "Address already in use").
    port: ReservedPort,
    secret: String,
    size: usize,
}

impl Job {
    /// A job of `size` ranks with a fresh port and secret.
    pub fn new(size: usize) -> Job {
        let port = ReservedPort::loopback().expect("reserving a port");
        let secret = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        Job { port, secret, size }
    }

    /// The rendezvous port (rank 0 listens there).
    pub fn port(&self) -> u16 {
        self.port.port()
    }

    /// Starts rank `rank` running `scenario` with `env` added.
    pub fn spawn(&self, rank: usize, scenario: &str, env: &[(&str, &str)]) -> Child {
        let mut cmd = child_command(scenario);
        cmd.env("QCCL_RANK", rank.to_string())
            .env("QCCL_WORLD_SIZE", self.size.to_string())
            .env("QCCL_COMM_ID", format!("127.0.0.1:{}", self.port.port()))
            .env("QCCL_SECRET", &self.secret);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.spawn().expect("spawning a rank")
    }

    /// Runs every rank and waits for all of them (each at most `limit`).
    pub fn run(&self, scenario: &str, env: &[(&str, &str)], limit: Duration) -> Vec<Output> {
        let children: Vec<Child> = (0..self.size)
            .map(|r| self.spawn(r, scenario, env))
            .collect();
        children.into_iter().map(|c| wait(c, limit)).collect()
    }
}

/// Waits for `c` at most `limit`, killing it past that.
pub fn wait(mut c: Child, limit: Duration) -> Output {
    let start = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = c.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    c.wait_with_output().unwrap()
}

/// A rank's exit status and output, for assertion messages.
pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The shared-memory segments in /dev/shm created by any of `pids`.
pub fn leftover_segments(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.starts_with("qccl-") && pids.iter().any(|p| n.contains(&format!("-p{p}-")))
                })
                .collect()
        })
        .unwrap_or_default()
}
