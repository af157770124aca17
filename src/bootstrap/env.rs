//! Environment init: rank, world size and rendezvous address from a launcher's variables.
//!
//! Rank and size come from the first launcher whose variables are present, in this order:
//!
//! | source     | rank                   | size                   | local rank                    |
//! |------------|------------------------|------------------------|-------------------------------|
//! | `qccl`     | QCCL_RANK              | QCCL_WORLD_SIZE        | QCCL_LOCAL_RANK               |
//! | `torchrun` | RANK                   | WORLD_SIZE             | LOCAL_RANK                    |
//! | `OpenMPI`  | OMPI_COMM_WORLD_RANK   | OMPI_COMM_WORLD_SIZE   | OMPI_COMM_WORLD_LOCAL_RANK    |
//! | `PMI`      | PMI_RANK               | PMI_SIZE               | MPI_LOCALRANKID, PMI_LOCAL_RANK |
//! | `Slurm`    | SLURM_PROCID           | SLURM_NTASKS           | SLURM_LOCALID                 |
//!
//! The rendezvous address is QCCL_COMM_ID (`host:port`, `[v6]:port`), else MASTER_ADDR and
//! MASTER_PORT + 1, whichever launcher gave the rank: torchrun's own store already listens on
//! MASTER_PORT itself. The secret is QCCL_SECRET (32 hex digits), else
//! one derived from the rendezvous address, world size and the job ids the launchers export:
//! every rank of a job derives the same, another job (almost surely) a different one, but
//! anyone who can read those variables can derive it too.

use crate::error::{Error, Result};
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};

/// What the environment says about this process's place in the world.
#[derive(Clone, PartialEq, Eq)]
pub struct EnvInit {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// Where the bootstrap root listens (rank 0 hosts it).
    pub root: SocketAddr,
    /// Secret presented to the root (QCCL_SECRET, or derived).
    pub secret: [u8; 16],
    /// Launcher whose variables gave rank and size: `qccl`, `torchrun`, `OpenMPI`, `PMI` or
    /// `Slurm`.
    pub source: &'static str,
}

impl fmt::Debug for EnvInit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnvInit")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("root", &self.root)
            .field("secret", &format_args!("<hidden>"))
            .field("source", &self.source)
            .finish()
    }
}

struct Launcher {
    name: &'static str,
    rank: &'static str,
    size: &'static str,
    local: &'static [&'static str],
}

const LAUNCHERS: [Launcher; 5] = [
    Launcher {
        name: "qccl",
        rank: "QCCL_RANK",
        size: "QCCL_WORLD_SIZE",
        local: &["QCCL_LOCAL_RANK"],
    },
    Launcher {
        name: "torchrun",
        rank: "RANK",
        size: "WORLD_SIZE",
        local: &["LOCAL_RANK"],
    },
    Launcher {
        name: "OpenMPI",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local: &["OMPI_COMM_WORLD_LOCAL_RANK"],
    },
    Launcher {
        name: "PMI",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"],
    },
    Launcher {
        name: "Slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local: &["SLURM_LOCALID"],
    },
];

/// Job identifiers that enter the derived secret, when set.
const JOB_IDS: [&str; 10] = [
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "OMPI_MCA_orte_ess_jobid",
    "OMPI_MCA_ess_base_jobid",
    "PMIX_NAMESPACE",
    "PMI_JOBID",
    "PBS_JOBID",
    "LSB_JOBID",
    "FLUX_JOB_ID",
];

/// `detect_from` over the process environment.
pub fn detect() -> Result<EnvInit> {
    detect_from(|k| std::env::var(k).ok())
}

/// Detects rank, size, rendezvous address and secret from the variables `get` returns (empty
/// values count as unset). Errors name the variable and its value (never QCCL_SECRET's value).
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Result<EnvInit> {
    let get = |k: &str| {
        get(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let num = |k: &str, v: &str| -> Result<usize> {
        v.parse::<usize>()
            .map_err(|_| Error::invalid(format!("{k}={v} is not a non-negative integer")))
    };

    let Some((l, rank_v, size_v)) = LAUNCHERS.iter().find_map(|l| {
        let (r, s) = (get(l.rank), get(l.size));
        (r.is_some() || s.is_some()).then_some((l, r, s))
    }) else {
        return Err(Error::invalid(
            "no launcher variables found: set QCCL_RANK, QCCL_WORLD_SIZE and QCCL_COMM_ID=host:port \
             (or run under torchrun, mpirun, srun or another PMI launcher)",
        ));
    };
    let (rank_v, size_v) = match (rank_v, size_v) {
        (Some(r), Some(s)) => (r, s),
        (Some(r), None) => {
            return Err(Error::invalid(format!(
                "{}={r} is set but {} is not",
                l.rank, l.size
            )))
        }
        (None, Some(s)) => {
            return Err(Error::invalid(format!(
                "{}={s} is set but {} is not",
                l.size, l.rank
            )))
        }
        (None, None) => unreachable!("find_map only yields launchers with a variable set"),
    };
    let rank = num(l.rank, &rank_v)?;
    let size = num(l.size, &size_v)?;
    if size == 0 {
        return Err(Error::invalid(format!(
            "{}=0: the world size must be at least 1",
            l.size
        )));
    }
    if rank >= size {
        return Err(Error::invalid(format!(
            "{}={rank} is not below {}={size}",
            l.rank, l.size
        )));
    }
    let local_rank = match l.local.iter().find_map(|k| get(k).map(|v| (k, v))) {
        Some((k, v)) => Some(num(k, &v)?),
        None => None,
    };

    let (root, root_src) = if let Some(v) = get("QCCL_COMM_ID") {
        let (host, port) = v
            .rsplit_once(':')
            .ok_or_else(|| Error::invalid(format!("QCCL_COMM_ID={v} is not host:port")))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port = parse_port("QCCL_COMM_ID", &v, port)?;
        (resolve("QCCL_COMM_ID", &v, host, port)?, "QCCL_COMM_ID")
    } else {
        match (get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(a), Some(p)) => {
                let port = parse_port("MASTER_PORT", &p, &p)?
                    .checked_add(1)
                    .ok_or_else(|| {
                        Error::invalid(format!(
                        "MASTER_PORT={p}: qccl rendezvouses on MASTER_PORT + 1, which is past 65535"
                    ))
                    })?;
                (
                    resolve("MASTER_ADDR", &a, &a, port)?,
                    "MASTER_ADDR and MASTER_PORT",
                )
            }
            (Some(a), None) => {
                return Err(Error::invalid(format!(
                    "MASTER_ADDR={a} is set but MASTER_PORT is not"
                )))
            }
            (None, Some(p)) => {
                return Err(Error::invalid(format!(
                    "MASTER_PORT={p} is set but MASTER_ADDR is not"
                )))
            }
            (None, None) => {
                return Err(Error::invalid(format!(
                    "{} variables give rank {rank} of {size} but no rendezvous address: set \
                     QCCL_COMM_ID=host:port or MASTER_ADDR and MASTER_PORT",
                    l.name
                )))
            }
        }
    };

    let secret = match get("QCCL_SECRET") {
        Some(hex) => parse_secret(&hex)?,
        None => {
            let jobs: Vec<(&str, String)> = JOB_IDS
                .iter()
                .filter_map(|k| get(k).map(|v| (*k, v)))
                .collect();
            let names: Vec<&str> = jobs.iter().map(|(k, _)| *k).collect();
            crate::qlog!(
                Info,
                "bootstrap: QCCL_SECRET not set; using a secret derived from the rendezvous \
                 address, world size and job ids {names:?} (weaker: anyone who can read these \
                 can derive it; set QCCL_SECRET to 32 hex digits for a strong one)"
            );
            derive_secret(root, size, &jobs)
        }
    };

    crate::qlog!(
        Info,
        "bootstrap: rank {rank} of {size}{} from {} variables ({}, {}); rendezvous at {root} from \
         {root_src}",
        local_rank
            .map(|l| format!(" (local rank {l})"))
            .unwrap_or_default(),
        l.name,
        l.rank,
        l.size
    );
    Ok(EnvInit {
        rank,
        size,
        local_rank,
        root,
        secret,
        source: l.name,
    })
}

fn parse_port(var: &str, value: &str, port: &str) -> Result<u16> {
    match port.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(Error::invalid(format!(
            "{var}={value}: port '{port}' is not in 1..=65535"
        ))),
    }
}

/// Resolves `host` (IPv4 preferred).
fn resolve(var: &str, value: &str, host: &str, port: u16) -> Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("{var}={value}: cannot resolve '{host}': {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| Error::invalid(format!("{var}={value}: '{host}' has no address")))
}

/// 32 hex digits. The error never repeats the value: it is a secret.
fn parse_secret(hex: &str) -> Result<[u8; 16]> {
    if hex.len() != 32 {
        return Err(Error::invalid(format!(
            "QCCL_SECRET must be 32 hex digits (128 bits), got {} characters",
            hex.chars().count()
        )));
    }
    let mut out = [0u8; 16];
    let digit = |pos: usize| {
        char::from(hex.as_bytes()[pos]).to_digit(16).ok_or_else(|| {
            Error::invalid(format!(
                "QCCL_SECRET must be 32 hex digits; character {} is not one",
                pos + 1
            ))
        })
    };
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = (digit(2 * i)? * 16 + digit(2 * i + 1)?) as u8;
    }
    Ok(out)
}

/// Deterministic 128-bit FNV-1a over the rendezvous address, size and job ids (not
/// cryptographic: it keeps other jobs out, not attackers who can read the environment).
fn derive_secret(root: SocketAddr, size: usize, jobs: &[(&str, String)]) -> [u8; 16] {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut text = format!("qccl-derived-secret-v1\0{root}\0{size}");
    for (k, v) in jobs {
        text.push('\0');
        text.push_str(k);
        text.push('=');
        text.push_str(v);
    }
    let mut h = OFFSET;
    for b in text.bytes() {
        h ^= u128::from(b);
        h = h.wrapping_mul(PRIME);
    }
    h.to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn detect_map(vars: &[(&str, &str)]) -> Result<EnvInit> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect_from(|k| m.get(k).cloned())
    }

    fn err(vars: &[(&str, &str)]) -> String {
        let e = detect_map(vars).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        e.to_string()
    }

    #[test]
    fn qccl_variables() {
        let e = detect_map(&[
            ("QCCL_RANK", "1"),
            ("QCCL_WORLD_SIZE", "2"),
            ("QCCL_COMM_ID", "127.0.0.1:29500"),
            ("QCCL_SECRET", "000102030405060708090a0B0c0d0e0f"),
            // Lower-priority launchers are ignored.
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "8"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.size, e.local_rank, e.source),
            (1, 2, None, "qccl")
        );
        assert_eq!(e.root, "127.0.0.1:29500".parse().unwrap());
        let want: Vec<u8> = (0..16).collect();
        assert_eq!(e.secret.to_vec(), want);
        assert!(format!("{e:?}").contains("<hidden>"));
        let v6 = detect_map(&[
            ("QCCL_RANK", "0"),
            ("QCCL_WORLD_SIZE", "1"),
            ("QCCL_COMM_ID", "[::1]:1234"),
        ])
        .unwrap();
        assert_eq!(v6.root, "[::1]:1234".parse().unwrap());
    }

    #[test]
    fn torchrun_variables_and_derived_secret() {
        let base = [
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "job-a"),
        ];
        let r2 = detect_map(&[&base[..], &[("RANK", "2"), ("LOCAL_RANK", "0")]].concat()).unwrap();
        assert_eq!(
            (r2.rank, r2.size, r2.local_rank, r2.source),
            (2, 4, Some(0), "torchrun")
        );
        assert_eq!(r2.root, "127.0.0.1:29501".parse().unwrap());
        // Every rank of the job derives the same secret; another job a different one.
        let r3 = detect_map(&[&base[..], &[("RANK", "3")]].concat()).unwrap();
        assert_eq!(r3.secret, r2.secret);
        let mut other = base;
        other[3] = ("TORCHELASTIC_RUN_ID", "job-b");
        let o = detect_map(&[&other[..], &[("RANK", "3")]].concat()).unwrap();
        assert_ne!(o.secret, r2.secret);
    }

    #[test]
    fn openmpi_pmi_slurm_variables() {
        let e = detect_map(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("QCCL_COMM_ID", "127.0.0.1:5000"),
            ("MASTER_ADDR", "10.9.9.9"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.size, e.local_rank, e.source),
            (3, 4, Some(1), "OpenMPI")
        );
        assert_eq!(e.root, "127.0.0.1:5000".parse().unwrap());

        let e = detect_map(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "6000"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.size, e.local_rank, e.source),
            (0, 2, Some(0), "PMI")
        );

        let e = detect_map(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_ID", "1234"),
            ("QCCL_COMM_ID", "127.0.0.1:7000"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.size, e.local_rank, e.source),
            (5, 8, Some(1), "Slurm")
        );
        let other_job = detect_map(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_ID", "1235"),
            ("QCCL_COMM_ID", "127.0.0.1:7000"),
        ])
        .unwrap();
        assert_ne!(other_job.secret, e.secret);
    }

    #[test]
    fn missing_address() {
        let s = err(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        assert!(
            s.contains(
                "OpenMPI variables give rank 3 of 4 but no rendezvous address: set \
                 QCCL_COMM_ID=host:port or MASTER_ADDR and MASTER_PORT"
            ),
            "{s}"
        );
        let s = err(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")]);
        assert!(
            s.contains("MASTER_ADDR=h is set but MASTER_PORT is not"),
            "{s}"
        );
        assert!(err(&[]).contains("no launcher variables found"));
    }

    #[test]
    fn bad_values() {
        let addr = ("QCCL_COMM_ID", "127.0.0.1:1");
        let s = err(&[("RANK", "x"), ("WORLD_SIZE", "4"), addr]);
        assert!(s.contains("RANK=x is not a non-negative integer"), "{s}");
        let s = err(&[("PMI_RANK", "0"), ("PMI_SIZE", "-2"), addr]);
        assert!(
            s.contains("PMI_SIZE=-2 is not a non-negative integer"),
            "{s}"
        );
        let s = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "0"), addr]);
        assert!(
            s.contains("SLURM_NTASKS=0: the world size must be at least 1"),
            "{s}"
        );
        let s = err(&[("QCCL_RANK", "4"), ("QCCL_WORLD_SIZE", "4"), addr]);
        assert!(
            s.contains("QCCL_RANK=4 is not below QCCL_WORLD_SIZE=4"),
            "{s}"
        );
        let s = err(&[("RANK", "1"), addr]);
        assert!(s.contains("RANK=1 is set but WORLD_SIZE is not"), "{s}");
        let s = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "a"),
            addr,
        ]);
        assert!(
            s.contains("LOCAL_RANK=a is not a non-negative integer"),
            "{s}"
        );
        let s = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "99999"),
        ]);
        assert!(
            s.contains("MASTER_PORT=99999: port '99999' is not in 1..=65535"),
            "{s}"
        );
        let s = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("QCCL_COMM_ID", "nohost"),
        ]);
        assert!(s.contains("QCCL_COMM_ID=nohost is not host:port"), "{s}");
        let s = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            addr,
            ("QCCL_SECRET", "abc"),
        ]);
        assert!(
            s.contains("QCCL_SECRET must be 32 hex digits (128 bits), got 3"),
            "{s}"
        );
        let bad = "0123456789abcdef0123456789abcdeg";
        let s = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            addr,
            ("QCCL_SECRET", bad),
        ]);
        assert!(s.contains("character 32 is not one"), "{s}");
        assert!(!s.contains(bad), "the secret must not be echoed: {s}");
    }
}
