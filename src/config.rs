//! Run-time configuration: defaults, overridden by QCCL_* environment variables.

use crate::algo::Algo;
use crate::codec::layout::Filter;
use crate::codec::CodecSpec;
use crate::error::{Error, Result};
use std::time::Duration;

/// Which transport carries traffic between two ranks (QCCL_TRANSPORT, QCCL_SHM_DISABLE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransportChoice {
    /// Shared memory between ranks with the same host identity, TCP otherwise.
    Auto,
    /// TCP between every pair.
    Tcp,
    /// Shared memory between every pair (all ranks must really share a machine).
    Shm,
}

/// Communicator configuration. `Config::default()` holds the built-in defaults;
/// `Config::from_env()` applies QCCL_* variables on top.
#[derive(Debug, Clone)]
pub struct Config {
    /// Bound on every wait inside a collective (QCCL_TIMEOUT_MS, default 300000).
    pub timeout: Duration,
    /// Bound on `Comm::init` waiting for all ranks (QCCL_INIT_TIMEOUT_MS, default = timeout).
    pub init_timeout: Duration,
    /// Slice size in bytes that messages are cut into (QCCL_BUFFSIZE); `None`:
    /// `DEFAULT_SLICE` ([`Config::slice_bytes`]).
    pub buffsize: Option<usize>,
    /// Bytes per piece of a pipelined hierarchical all-reduce (QCCL_CHUNKSIZE, default 4 MiB;
    /// 0 = no pipelining): larger buffers go through in pieces, the network phase of one
    /// overlapping the shared-memory phase of the next.
    pub chunksize: usize,
    /// Largest bytes per owner and round of the shared-memory arena (QCCL_SHM_ARENA_CHUNK, a
    /// multiple of 64 from 4096 up); None: by the comm's size (`shm::arena::default_chunk`).
    pub shm_arena_chunk: Option<usize>,
    /// Default all-reduce algorithm (QCCL_ALGO).
    pub algo: Algo,
    /// Rules for `auto` measured on this cluster (QCCL_TUNING_FILE, `qccl-perf --calibrate
    /// --tuning-out`): read and checked at comm init, its rows ahead of the built-in table.
    pub tuning_file: Option<std::path::PathBuf>,
    /// Interface selection for the TCP transport, NCCL_SOCKET_IFNAME syntax (QCCL_SOCKET_IFNAME).
    pub socket_ifname: Option<String>,
    /// TCP sockets per peer pair (QCCL_NSOCKS_PERPEER, default 1).
    pub nsocks_per_peer: usize,
    /// Per-peer transport selection (QCCL_TRANSPORT=auto|tcp|shm; QCCL_SHM_DISABLE=1 = tcp).
    /// `Tcp` means no shared memory: the network link (`ib`) still decides between RDMA and
    /// sockets.
    pub transport: TransportChoice,
    /// The RDMA link's settings (QCCL_NET, QCCL_IB_*).
    pub ib: crate::transport::ib::config::IbConfig,
    /// Microseconds a wait spins (or, with more local ranks than cores, yields) before it
    /// blocks (QCCL_SPIN_US, default 250: longer than one wake-up of a blocked process).
    pub spin_us: u64,
    /// Seed of the codecs' random streams (QCCL_SEED, default 0): runs repeat exactly.
    pub seed: u64,
    /// Codec applied to plain float Sum/Avg all_reduce calls (QCCL_COMPRESSION, default none).
    pub compression: Option<CodecSpec>,
    /// Layers kept uncompressed (QCCL_COMPRESSION_EXCLUDE, comma-separated name substrings,
    /// default "bias,bn,norm"; QCCL_COMPRESSION_MINIMAL_SIZE elements, default 16).
    pub filter: Filter,
    /// Page-locked bytes that calls on device buffers enqueued on a caller's stream may hold
    /// between them until they finish (QCCL_STAGING_BYTES, default 256 MiB; a larger call
    /// still runs, alone): enqueueing more waits for earlier calls.
    pub staging_bytes: usize,
    /// Dense all-reduces of the ranks of one machine (processes or threads) reduce
    /// device buffers on the GPU through CUDA IPC, without staging them through host memory
    /// (QCCL_CUDA_IPC=1, default off). Used only when every rank of the comm asked for it at
    /// init; each such call then exchanges a short descriptor first, host buffers too.
    pub cuda_ipc: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            timeout: Duration::from_millis(300_000),
            init_timeout: Duration::from_millis(300_000),
            buffsize: None,
            chunksize: 4 << 20,
            shm_arena_chunk: None,
            algo: Algo::Auto,
            tuning_file: None,
            socket_ifname: None,
            nsocks_per_peer: 1,
            transport: TransportChoice::Auto,
            ib: Default::default(),
            spin_us: 250,
            seed: 0,
            compression: None,
            filter: Filter::default(),
            staging_bytes: crate::gpu::staging::DEFAULT_STAGING_BYTES,
            cuda_ipc: false,
        }
    }
}

fn env_var(name: &str) -> Option<String> {
    let v = std::env::var(name).ok()?;
    crate::qlog!(Info, "{name} set by environment to {v}");
    Some(v)
}

fn env_num(name: &str) -> Result<Option<u64>> {
    match env_var(name) {
        None => Ok(None),
        Some(v) => parse_size(&v)
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("{name}={v} is not a non-negative number"))),
    }
}

/// Parses a byte count with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1u64 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(mult)
}

/// Default slice, over sockets and shared memory alike: fewer hand-overs per call. Over TCP,
/// 2 ranks on loopback with both CPUs' placement checked (interleaved, µs per call): 1 MiB
/// 180–193 against 226–760 with 256 KiB slices, 4 MiB 740–960 against 920–1050 (one pair the
/// other way), 16–64 MiB on par; 4 ranks on par. (An earlier run that had 256 KiB ahead at
/// 1–16 MiB did not know the host moves the two vCPUs apart for minutes at a time.)
pub const DEFAULT_SLICE: usize = 512 * 1024;

/// Pairwise SRA keeps (n − 1) slices per rank in flight (one to every peer per round); past
/// about an L2 of them the transport's copies miss the cache. Over TCP on 2 vCPUs (1 MiB L2
/// each), µs per call: 4 ranks 256 KiB slices 5–10% faster than 512 KiB at 1–64 MiB, 8 ranks
/// 128 KiB 12–14% faster at 4–16 MiB, 3 ranks 512 KiB ahead at 1 MiB (docs/perf-history.md).
pub const SRA_IN_FLIGHT: usize = 1 << 20;

/// Smallest slice the SRA rule picks.
const MIN_SRA_SLICE: usize = 64 * 1024;

impl Config {
    /// Checks the sizes every algorithm relies on, naming the variable and the range; every
    /// init calls it (a `Config` built in code gets the same checks as the environment's).
    pub fn validate(&self) -> Result<()> {
        const MIN: usize = 4096;
        const MAX: usize = 1 << 30;
        let range = |v: usize| (MIN..=MAX).contains(&v);
        if let Some(b) = self.buffsize.filter(|&b| !range(b)) {
            return Err(Error::invalid(format!(
                "QCCL_BUFFSIZE={b} is outside 4096 bytes..1 GiB"
            )));
        }
        if self.chunksize != 0 && !range(self.chunksize) {
            return Err(Error::invalid(format!(
                "QCCL_CHUNKSIZE={} is outside 4096 bytes..1 GiB (0 disables pipelining)",
                self.chunksize
            )));
        }
        if let Some(b) = self.shm_arena_chunk.filter(|&b| !range(b) || b % 64 != 0) {
            return Err(Error::invalid(format!(
                "QCCL_SHM_ARENA_CHUNK={b} must be a multiple of 64 from 4096 to 1 GiB"
            )));
        }
        if !(1..=16).contains(&self.nsocks_per_peer) {
            return Err(Error::invalid(format!(
                "QCCL_NSOCKS_PERPEER={} is outside 1..=16",
                self.nsocks_per_peer
            )));
        }
        Ok(())
    }

    /// The slice size of a comm: QCCL_BUFFSIZE, else `DEFAULT_SLICE`.
    pub fn slice_bytes(&self) -> usize {
        self.buffsize.unwrap_or(DEFAULT_SLICE)
    }

    /// The slice of pairwise SRA on `size` ranks: QCCL_BUFFSIZE, else `DEFAULT_SLICE` cut to
    /// the power of two at or below `SRA_IN_FLIGHT` / (size − 1), at least 64 KiB.
    pub fn sra_slice_bytes(&self, size: usize) -> usize {
        self.buffsize.unwrap_or_else(|| {
            let share = SRA_IN_FLIGHT / size.saturating_sub(1).max(1);
            (1usize << share.ilog2()).clamp(MIN_SRA_SLICE, DEFAULT_SLICE)
        })
    }
}

impl Config {
    /// Defaults overridden by QCCL_* variables; each one found is logged at INFO.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Some(ms) = env_num("QCCL_TIMEOUT_MS")? {
            c.timeout = Duration::from_millis(ms.max(1));
            c.init_timeout = c.timeout;
        }
        if let Some(ms) = env_num("QCCL_INIT_TIMEOUT_MS")? {
            c.init_timeout = Duration::from_millis(ms.max(1));
        }
        let size = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
        if let Some(b) = env_num("QCCL_BUFFSIZE")? {
            c.buffsize = Some(size(b));
        }
        if let Some(b) = env_num("QCCL_CHUNKSIZE")? {
            c.chunksize = size(b);
        }
        if let Some(b) = env_num("QCCL_SHM_ARENA_CHUNK")? {
            c.shm_arena_chunk = Some(size(b));
        }
        if let Some(a) = env_var("QCCL_ALGO") {
            c.algo = Algo::parse(&a).map_err(|e| Error::invalid(format!("QCCL_ALGO: {e}")))?;
        }
        c.tuning_file = env_var("QCCL_TUNING_FILE")
            .filter(|s| !s.trim().is_empty())
            .map(std::path::PathBuf::from);
        c.socket_ifname = env_var("QCCL_SOCKET_IFNAME").filter(|s| !s.is_empty());
        if let Some(n) = env_num("QCCL_NSOCKS_PERPEER")? {
            c.nsocks_per_peer = size(n);
        }
        if let Some(t) = env_var("QCCL_TRANSPORT") {
            c.transport = match t.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => TransportChoice::Auto,
                "tcp" => TransportChoice::Tcp,
                "shm" => TransportChoice::Shm,
                other => {
                    return Err(Error::invalid(format!(
                        "QCCL_TRANSPORT={other} is not one of auto, tcp, shm"
                    )))
                }
            };
        }
        if env_var("QCCL_SHM_DISABLE").is_some_and(|v| v.trim() == "1") {
            if c.transport == TransportChoice::Shm {
                return Err(Error::invalid(
                    "QCCL_SHM_DISABLE=1 contradicts QCCL_TRANSPORT=shm",
                ));
            }
            c.transport = TransportChoice::Tcp;
        }
        c.ib = crate::transport::ib::config::IbConfig::from_env()?;
        if let Some(us) = env_num("QCCL_SPIN_US")? {
            c.spin_us = us;
        }
        if let Some(seed) = env_num("QCCL_SEED")? {
            c.seed = seed;
        }
        if let Some(spec) = env_var("QCCL_COMPRESSION") {
            let spec = CodecSpec::parse(&spec)
                .map_err(|e| Error::invalid(format!("QCCL_COMPRESSION: {e}")))?;
            c.compression = (!spec.is_identity()).then_some(spec);
        }
        if let Some(list) = env_var("QCCL_COMPRESSION_EXCLUDE") {
            c.filter.exclude = list
                .split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect();
        }
        if let Some(n) = env_num("QCCL_COMPRESSION_MINIMAL_SIZE")? {
            c.filter.min_size = n as usize;
        }
        if let Some(b) = env_num("QCCL_STAGING_BYTES")? {
            c.staging_bytes = size(b);
        }
        if let Some(v) = env_var("QCCL_CUDA_IPC") {
            c.cuda_ipc = match v.trim() {
                "" | "0" => false,
                "1" => true,
                other => {
                    return Err(Error::invalid(format!(
                        "QCCL_CUDA_IPC={other} is not 0 or 1"
                    )))
                }
            };
        }
        c.validate()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("256M"), Some(256 << 20));
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_size("x"), None);
        assert!(Algo::parse("bogus").is_err());
        assert_eq!(Algo::parse("SRA").unwrap(), Algo::Sra);
    }

    #[test]
    fn sra_slices_shrink_with_the_peers_unless_set() {
        let c = Config::default();
        let kib = |n: usize| c.sra_slice_bytes(n) >> 10;
        assert_eq!([kib(1), kib(2), kib(3), kib(4)], [512, 512, 512, 256]);
        assert_eq!([kib(5), kib(8), kib(9), kib(64)], [256, 128, 128, 64]);
        let set = Config {
            buffsize: Some(3 << 20),
            ..Config::default()
        };
        assert_eq!(set.sra_slice_bytes(8), 3 << 20);
    }

    #[test]
    fn sizes_out_of_range_are_refused_by_name() {
        let bad = |c: Config, needle: &str| {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        };
        let d = Config::default;
        bad(
            Config {
                buffsize: Some(4095),
                ..d()
            },
            "QCCL_BUFFSIZE=4095 is outside",
        );
        bad(
            Config {
                buffsize: Some(2 << 30),
                ..d()
            },
            "QCCL_BUFFSIZE=2147483648",
        );
        bad(
            Config {
                chunksize: 100,
                ..d()
            },
            "QCCL_CHUNKSIZE=100",
        );
        bad(
            Config {
                shm_arena_chunk: Some(4100),
                ..d()
            },
            "QCCL_SHM_ARENA_CHUNK=4100",
        );
        bad(
            Config {
                nsocks_per_peer: 0,
                ..d()
            },
            "QCCL_NSOCKS_PERPEER=0",
        );
        for ok in [4096, 4097, 5001, 1 << 30] {
            Config {
                buffsize: Some(ok),
                ..d()
            }
            .validate()
            .unwrap();
        }
        Config {
            chunksize: 0,
            ..d()
        }
        .validate()
        .unwrap();
    }
}
