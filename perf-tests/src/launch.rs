//! `-np N`: run N copies of this program on 127.0.0.1 as one job, and watch them.

use std::ffi::OsStr;
use std::io::Read;
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Exit code of a rank whose results had wrong elements (the run itself completed).
pub const EXIT_WRONG: i32 = 1;
/// Exit code for errors: bad arguments, a failed comm, a failed rank, the timeout.
pub const EXIT_ERROR: i32 = 2;

/// A free port on 127.0.0.1 (bound, read, released: rank 0 binds it again right away).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// 32 random hex digits for QCCL_SECRET.
fn secret() -> String {
    let mut b = [0u8; 16];
    let from_os = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if from_os.is_err() {
        // Randomly keyed SipHash (std seeds it from the OS), with time and pid as input.
        use std::hash::{BuildHasher, Hasher};
        for half in b.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.write_u32(std::process::id());
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => format!("{s}"),
    }
}

fn kill_all(kids: &mut [(usize, Child)]) {
    for (_, c) in kids.iter_mut() {
        let _ = c.kill();
    }
    for (_, c) in kids.iter_mut() {
        let _ = c.wait();
    }
}

/// Spawns `np` ranks of this executable with `args` (without `-np`), named `argv0` so that a
/// program name like `all_reduce_perf` still selects the collective. Waits for all of them;
/// when one fails (other than by finding wrong results) or `timeout` passes, kills the rest.
/// Returns the exit code: 0, [`EXIT_WRONG`] or [`EXIT_ERROR`].
pub fn launch(np: usize, argv0: &OsStr, args: &[String], timeout: Duration) -> i32 {
    let fail = |what: String| {
        eprintln!("qccl-perf: {what}");
        EXIT_ERROR
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail(format!("cannot find this program's executable: {e}")),
    };
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => return fail(format!("cannot find a free port on 127.0.0.1: {e}")),
    };
    let secret = secret();
    let start = Instant::now();
    let mut kids: Vec<(usize, Child)> = Vec::with_capacity(np);
    for r in 0..np {
        let spawned = Command::new(&exe)
            .arg0(argv0)
            .args(args)
            .env("QCCL_RANK", r.to_string())
            .env("QCCL_WORLD_SIZE", np.to_string())
            .env("QCCL_LOCAL_RANK", r.to_string())
            .env("QCCL_COMM_ID", format!("127.0.0.1:{port}"))
            .env("QCCL_SECRET", &secret)
            .stdin(Stdio::null())
            .spawn();
        match spawned {
            Ok(c) => kids.push((r, c)),
            Err(e) => {
                kill_all(&mut kids);
                return fail(format!("cannot start rank {r} ({}): {e}", exe.display()));
            }
        }
    }
    let mut wrong = false;
    loop {
        let mut i = 0;
        while i < kids.len() {
            let (r, child) = &mut kids[i];
            match child.try_wait() {
                Ok(None) => i += 1,
                Ok(Some(s)) if s.code() == Some(0) => {
                    kids.remove(i);
                }
                Ok(Some(s)) if s.code() == Some(EXIT_WRONG) => {
                    wrong = true;
                    kids.remove(i);
                }
                Ok(Some(s)) => {
                    let (r, pid) = (*r, child.id());
                    kids.remove(i);
                    let rest: Vec<usize> = kids.iter().map(|(r, _)| *r).collect();
                    kill_all(&mut kids);
                    return fail(format!(
                        "rank {r} (pid {pid}) failed: {}; killed the ranks still running {rest:?}",
                        describe(s)
                    ));
                }
                Err(e) => {
                    let r = *r;
                    kill_all(&mut kids);
                    return fail(format!("waiting for rank {r}: {e}"));
                }
            }
        }
        if kids.is_empty() {
            return if wrong { EXIT_WRONG } else { 0 };
        }
        if start.elapsed() > timeout {
            let rest: Vec<usize> = kids.iter().map(|(r, _)| *r).collect();
            kill_all(&mut kids);
            return fail(format!(
                "timed out after {:.0} s (--timeout); killed the ranks still running {rest:?}",
                timeout.as_secs_f64()
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
