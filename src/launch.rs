//! Start N local ranks of this program, like `mpirun -np N` on one machine.
//!
//! A program that supports `-np N` starts a [`Launch`] when it is not a rank already (no
//! launcher variables in its environment); each copy it starts finds QCCL_RANK and calls
//! [`Comm::from_env`](crate::Comm::from_env):
//!
//! ```no_run
//! use qccl::launch::Launch;
//! use std::time::Duration;
//!
//! if std::env::var_os("QCCL_RANK").is_none() {
//!     let code = Launch::new(4).args(["--size", "1M"]).timeout(Duration::from_secs(600)).run()?;
//!     std::process::exit(code);
//! }
//! let comm = qccl::Comm::from_env()?;
//! # Ok::<(), qccl::Error>(())
//! ```
//!
//! Each rank is this executable, under this process's `argv[0]` (so that a program that reads
//! its name, like `all_reduce_perf` as a link to `qccl-perf`, behaves the same), with the
//! arguments given to [`Launch::args`], stdin closed, stdout and stderr shared with this
//! process (by convention only rank 0 prints the report), and this process's environment plus
//! QCCL_RANK, QCCL_WORLD_SIZE, QCCL_LOCAL_RANK (all = the rank), QCCL_COMM_ID
//! (127.0.0.1 and a free port, held by a [`ReservedPort`] for the whole job: rank 0 hosts the
//! rendezvous there) and QCCL_SECRET (random, one per job). Everything else is inherited
//! unchanged, QCCL_HOSTID included: all ranks of one launch claim the same host, unless
//! [`Launch::hosts`] splits them into emulated hosts (each its own QCCL_HOSTID, and
//! QCCL_LOCAL_RANK the rank on it), to run the multi-host routes on one machine.
//!
//! Binding, as `mpirun`'s default when the ranks fit the CPUs this process may run on: rank r
//! is bound to the r-th of them ([`Bind::Core`]). Unlike mpirun, ranks that outnumber the CPUs
//! are bound round-robin too when each CPU gets the same number: unbound, the kernel placed
//! 4 ranks on this 2-CPU VM two ways from run to run, and one of them was 1.3-1.5x slower
//! (shared-memory all-reduce 4-256 KiB: 7.3 / 14.5 / 31 / 77 us against 5.2 / 10 / 21 / 49,
//! the bound figures every time). Uneven counts stay unbound: 5 ranks bound 3 + 2 were no
//! faster, sometimes slower.
//! (The launcher binds itself to each rank's CPU while it starts that rank, and returns to its
//! own set once all are started.)
//! Unbound, Linux on this VM kept moving two busy ranks onto one CPU for seconds at a time,
//! with the other idle (2-rank 256 MiB all-reduce 55 ms bound, 150–180 ms in those spells).

#![forbid(unsafe_code)]

use crate::{Error, Result};
use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A job of N local ranks of this program: built with [`Launch::new`] and the setters, started
/// and waited for by [`Launch::run`].
#[derive(Debug, Clone)]
pub struct Launch {
    np: usize,
    args: Vec<OsString>,
    timeout: Option<Duration>,
    finished: Vec<i32>,
    bind: Bind,
    lost_allowed: usize,
    hosts: usize,
}

/// Where the ranks may run (`mpirun --bind-to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Bind {
    /// [`Bind::Core`] when that spreads the ranks evenly over the CPUs this process may use
    /// (they fit, or each CPU gets the same number), else [`Bind::None`].
    Auto,
    /// Rank r on the (r mod CPUs)-th CPU this process may use.
    Core,
    /// Wherever the kernel puts them.
    None,
}

impl std::str::FromStr for Bind {
    type Err = Error;

    /// `auto`, `core` or `none`.
    fn from_str(s: &str) -> Result<Bind> {
        match s {
            "auto" => Ok(Bind::Auto),
            "core" => Ok(Bind::Core),
            "none" => Ok(Bind::None),
            _ => Err(Error::invalid(format!(
                "bind: '{s}' is not one of auto, core, none"
            ))),
        }
    }
}

impl Launch {
    /// `np` ranks, no arguments, no timeout; any non-zero exit is a failure.
    pub fn new(np: usize) -> Launch {
        Launch {
            np,
            args: Vec::new(),
            timeout: None,
            finished: Vec::new(),
            bind: Bind::Auto,
            lost_allowed: 0,
            hosts: 1,
        }
    }

    /// Splits the ranks into `hosts` emulated hosts of consecutive ranks, the same number on
    /// each (rank r on host r / (np / hosts)): each rank gets QCCL_HOSTID `emuhost<h>` and
    /// its rank on that host as QCCL_LOCAL_RANK, so the multi-host routes (the hierarchical
    /// all-reduce, HiTopKComm) run on one machine, TCP over loopback between the hosts and
    /// shared memory inside each, as `perf-tests/emucluster` does without its shaped links.
    pub fn hosts(mut self, hosts: usize) -> Launch {
        self.hosts = hosts;
        self
    }

    /// Up to `n` ranks may fail (a non-zero exit or a signal) without ending the job: the
    /// others run on, as survivors that shrink their comm ([`Comm::shrink_failed`]) do
    /// (Open MPI's `mpirun --with-ft ulfm`). Each loss is reported on stderr; one more fails
    /// the job as usual.
    ///
    /// [`Comm::shrink_failed`]: crate::Comm::shrink_failed
    pub fn allow_lost_ranks(mut self, n: usize) -> Launch {
        self.lost_allowed = n;
        self
    }

    /// Where the ranks run ([`Bind::Auto`] unless set).
    pub fn bind(mut self, bind: Bind) -> Launch {
        self.bind = bind;
        self
    }

    /// The arguments every rank gets (without `-np N`, or the ranks would launch again).
    pub fn args<I, S>(mut self, args: I) -> Launch
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Kills the ranks still running when the job has taken longer than `timeout`.
    pub fn timeout(mut self, timeout: Duration) -> Launch {
        self.timeout = Some(timeout);
        self
    }

    /// A rank exiting with `code` has finished, with an outcome to pass on rather than a
    /// failure (qccl-perf: some results were wrong): the other ranks are left to finish, and
    /// [`run`](Launch::run) returns the code. Other non-zero exits, and deaths by a signal,
    /// are failures.
    pub fn finished_code(mut self, code: i32) -> Launch {
        self.finished.push(code);
        self
    }

    /// Starts the ranks and waits for all of them. Returns `Ok(0)` when every rank exited 0,
    /// else the largest of the [`finished_code`](Launch::finished_code)s ranks exited with.
    /// When a rank fails, or the timeout passes, kills the ranks still running and returns the
    /// error: a `Remote` error naming the failed rank, its pid and how it ended, or a
    /// `Timeout`; `System` when a rank cannot be started or waited for.
    pub fn run(&self) -> Result<i32> {
        if self.np == 0 {
            return Err(Error::invalid("launch: need at least 1 rank"));
        }
        if self.hosts == 0 || !self.np.is_multiple_of(self.hosts) {
            return Err(Error::invalid(format!(
                "launch: {} ranks do not split into {} hosts of the same size",
                self.np, self.hosts
            )));
        }
        let per_host = self.np / self.hosts;
        let exe = std::env::current_exe()
            .map_err(|e| Error::io("cannot find this program's executable", e))?;
        // Held until the job ends: no other process can take the port before rank 0 binds it.
        let reserved = ReservedPort::loopback()
            .map_err(|e| Error::io("cannot reserve a free port on 127.0.0.1", e))?;
        let port = reserved.port();
        let secret = format!("{:032x}", rand::random::<u128>());
        let argv0 = std::env::args_os().next();
        let allowed = allowed_cpus()?;
        let cpus = self.cpus(&allowed);
        let restore = Restore(allowed);
        let start = Instant::now();
        let mut kids = Ranks(Vec::with_capacity(self.np));
        for r in 0..self.np {
            let mut cmd = Command::new(&exe);
            if let Some(name) = &argv0 {
                cmd.arg0(name);
            }
            if !cpus.is_empty() {
                // A child inherits this process's affinity at fork: set before, restored
                // after the last (setting the child's from here would race with its start).
                let cpu = cpus[r % cpus.len()];
                set_affinity(&[cpu])
                    .map_err(|e| Error::io(format!("cannot bind rank {r} to CPU {cpu}"), e))?;
            }
            if self.hosts > 1 {
                cmd.env("QCCL_HOSTID", format!("emuhost{}", r / per_host));
            }
            let spawned = cmd
                .args(&self.args)
                .env("QCCL_RANK", r.to_string())
                .env("QCCL_WORLD_SIZE", self.np.to_string())
                .env("QCCL_LOCAL_RANK", (r % per_host).to_string())
                .env("QCCL_COMM_ID", format!("127.0.0.1:{port}"))
                .env("QCCL_SECRET", &secret)
                .stdin(Stdio::null())
                .spawn();
            match spawned {
                Ok(c) => kids.0.push((r, c)),
                Err(e) => {
                    let what = format!("cannot start rank {r} ({})", exe.display());
                    return Err(Error::io(what, e));
                }
            }
        }
        drop(restore);
        let (mut code, mut lost) = (0, 0);
        loop {
            let mut i = 0;
            while i < kids.0.len() {
                let (r, child) = &mut kids.0[i];
                match child.try_wait() {
                    Ok(None) => i += 1,
                    Ok(Some(s)) if s.code() == Some(0) => {
                        kids.0.remove(i);
                    }
                    Ok(Some(s)) if s.code().is_some_and(|c| self.finished.contains(&c)) => {
                        code = code.max(s.code().unwrap_or(0));
                        kids.0.remove(i);
                    }
                    Ok(Some(s)) if lost < self.lost_allowed => {
                        lost += 1;
                        eprintln!(
                            "launch: rank {r} (pid {}) ended: {}; the others go on ({} more may be lost)",
                            child.id(),
                            describe(s),
                            self.lost_allowed - lost
                        );
                        kids.0.remove(i);
                    }
                    Ok(Some(s)) => {
                        let (rank, pid) = (*r, child.id());
                        kids.0.remove(i);
                        let rest = kids.kill_all();
                        return Err(Error::Remote {
                            rank,
                            addr: format!("pid {pid}"),
                            msg: format!(
                                "failed: {}; killed the ranks still running {rest:?}",
                                describe(s)
                            ),
                        });
                    }
                    Err(e) => return Err(Error::io(format!("waiting for rank {r}"), e)),
                }
            }
            if kids.0.is_empty() {
                return Ok(code);
            }
            if let Some(t) = self.timeout.filter(|&t| start.elapsed() > t) {
                let rest = kids.kill_all();
                return Err(Error::Timeout(format!(
                    "the job timed out after {} s; killed the ranks still running {rest:?}",
                    t.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A TCP port on 127.0.0.1 that the kernel hands to no one else while this value lives, but
/// that a process may still bind and listen on explicitly with SO_REUSEADDR, as Rust's
/// `TcpListener::bind` (and so qccl's rendezvous root) does.
///
/// It holds a socket bound to the port with SO_REUSEADDR that never listens. Linux (4.6 and
/// later) then picks the port neither for a `bind` to port 0 nor for an outgoing
/// connection's local end, while an explicit SO_REUSEADDR `bind` + `listen` succeeds (only
/// one such listener at a time). Binding port 0 and closing the socket to "find a free port"
/// instead leaves a window in which another process, or any outgoing connection, may take
/// the port before the rank binds it.
#[derive(Debug)]
pub struct ReservedPort {
    _sock: OwnedFd,
    port: u16,
}

impl ReservedPort {
    /// Reserves a free port on 127.0.0.1 (the socket is close-on-exec: ranks do not inherit it).
    pub fn loopback() -> std::io::Result<ReservedPort> {
        use nix::sys::socket::{
            bind, getsockname, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType,
            SockaddrIn,
        };
        let sock = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        setsockopt(&sock, sockopt::ReuseAddr, &true)?;
        bind(sock.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, 0))?;
        let port = getsockname::<SockaddrIn>(sock.as_raw_fd())?.port();
        Ok(ReservedPort { _sock: sock, port })
    }

    /// The reserved port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Launch {
    /// The CPUs (of those this process may use) the ranks are bound to in turn; empty: none.
    fn cpus(&self, allowed: &[usize]) -> Vec<usize> {
        match self.bind {
            Bind::None => Vec::new(),
            Bind::Auto
                if self.np > allowed.len() && !self.np.is_multiple_of(allowed.len().max(1)) =>
            {
                Vec::new()
            }
            _ => allowed.to_vec(),
        }
    }
}

/// The CPUs this process may run on, ascending.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    let allowed = sched_getaffinity(Pid::from_raw(0))
        .map_err(|e| Error::io("cannot read this process's CPU affinity", e.into()))?;
    Ok((0..CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .collect())
}

/// Binds this process (and so the children it starts from now on) to `cpus`.
fn set_affinity(cpus: &[usize]) -> std::io::Result<()> {
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c)?;
    }
    Ok(sched_setaffinity(Pid::from_raw(0), &set)?)
}

/// Puts this process's affinity back when dropped.
struct Restore(Vec<usize>);

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = set_affinity(&self.0);
    }
}

/// A CPU list as the kernel writes one (`0-3,8`).
pub fn cpu_list(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if j == i {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The ranks still running, as (rank, process); dropping it kills them (an early return, a
/// panic), so that no rank outlives the launch.
struct Ranks(Vec<(usize, Child)>);

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}

impl Ranks {
    /// Kills every rank, then reaps them all; returns their ranks.
    fn kill_all(&mut self) -> Vec<usize> {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
        }
        self.0
            .drain(..)
            .map(|(r, mut c)| {
                let _ = c.wait();
                r
            })
            .collect()
    }
}

/// How a rank ended: "exit code 3", "killed by signal 9".
fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => format!("{s}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list(&[]), "");
        assert_eq!(cpu_list(&[3]), "3");
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8]), "0-3,8");
        assert_eq!(cpu_list(&[0, 2, 4, 5]), "0,2,4-5");
    }

    #[test]
    fn bind_parses_mpiruns_words() {
        assert_eq!("core".parse::<Bind>().unwrap(), Bind::Core);
        assert_eq!("none".parse::<Bind>().unwrap(), Bind::None);
        assert_eq!("auto".parse::<Bind>().unwrap(), Bind::Auto);
        let e = "socket".parse::<Bind>().unwrap_err().to_string();
        assert!(
            e.contains("'socket'") && e.contains("auto, core, none"),
            "{e}"
        );
    }

    #[test]
    fn a_reserved_port_is_bound_explicitly_but_never_handed_out() {
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};
        let held = ReservedPort::loopback().unwrap();
        let port = held.port();
        assert_ne!(port, 0);
        // Ports the kernel picks while the reservation lives (port-0 binds, a connection's
        // local end): never this one. (Also run in a network namespace whose ephemeral range
        // was narrowed to 71 ports, so that these binds take nearly all of them.)
        let others: Vec<TcpListener> = (0..64)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        assert!(others
            .iter()
            .all(|l| l.local_addr().unwrap().port() != port));
        assert!((0..8).all(|_| ReservedPort::loopback().unwrap().port() != port));
        // The rank that binds it explicitly listens there, and only one can.
        let root = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let e = TcpListener::bind(("127.0.0.1", port)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        assert_ne!(c.local_addr().unwrap().port(), port);
        c.write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        root.accept().unwrap().0.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
    }
}
