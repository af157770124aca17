//! The rules as rows: which calls a row covers (collective, links, ranks, bytes below a
//! bound) and what it picks. First match wins, so a row only sees the calls the rows above it
//! left.

use super::{CallShape, Flat, Links};
use crate::algo::Algo;
use std::fmt;

/// Which all-reduce a row covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Workload {
    /// Uncompressed.
    AllReduce,
    /// Compressed with a dense codec (quantizers, fp16, ...).
    Compressed,
    /// Compressed with a sparse codec (top-k and kin: a sum of sparse vectors is not sparse).
    Sparse,
}

impl Workload {
    /// Every kind, in the order the tuning file's messages list them.
    pub const ALL: [Workload; 3] = [Workload::AllReduce, Workload::Compressed, Workload::Sparse];

    /// The name a tuning file uses.
    pub fn name(self) -> &'static str {
        match self {
            Workload::AllReduce => "allreduce",
            Workload::Compressed => "compressed",
            Workload::Sparse => "sparse",
        }
    }
}

/// What a row picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pick {
    /// This flat schedule.
    Flat(Flat),
    /// The two-level schedule; the row is passed over where the hosts do not have two levels
    /// (one host, one rank per host, or hosts with different numbers of ranks).
    Hier,
}

impl Pick {
    /// The pick that runs `algo`; None for `auto`, which is no choice.
    pub fn of(algo: Algo) -> Option<Pick> {
        Some(match algo {
            Algo::Auto => return None,
            Algo::Ring => Pick::Flat(Flat::Ring),
            Algo::Tree => Pick::Flat(Flat::Tree),
            Algo::Sra => Pick::Flat(Flat::Sra),
            Algo::AllGather => Pick::Flat(Flat::AllGather),
            Algo::Hier => Pick::Hier,
        })
    }

    /// The name a tuning file uses (`Algo::name`).
    pub fn name(self) -> &'static str {
        match self {
            Pick::Flat(f) => f.algo().name(),
            Pick::Hier => "hier",
        }
    }
}

/// One rule: calls of `coll` (None: any) over `links` (None: any) on `min_ranks..=max_ranks`
/// ranks with fewer than `max_bytes` bytes run `pick`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Row {
    /// Collective; None: any.
    pub coll: Option<Workload>,
    /// Links; None: any.
    pub links: Option<Links>,
    /// Fewest ranks.
    pub min_ranks: usize,
    /// Most ranks (`usize::MAX`: no bound).
    pub max_ranks: usize,
    /// Calls of fewer bytes only (`usize::MAX`: no bound).
    pub max_bytes: usize,
    /// The schedule.
    pub pick: Pick,
}

/// No bound on ranks or bytes.
const ANY: usize = usize::MAX;
const K: usize = 1 << 10;
const M: usize = 1 << 20;

/// A built-in row of the uncompressed all-reduce.
const fn dense(links: Option<Links>, ranks: (usize, usize), max_bytes: usize, f: Flat) -> Row {
    Row {
        coll: Some(Workload::AllReduce),
        links,
        min_ranks: ranks.0,
        max_ranks: ranks.1,
        max_bytes,
        pick: Pick::Flat(f),
    }
}

/// A built-in row covering every call of `coll`.
const fn every(coll: Workload, f: Flat) -> Row {
    Row {
        coll: Some(coll),
        links: None,
        min_ranks: 1,
        max_ranks: ANY,
        max_bytes: ANY,
        pick: Pick::Flat(f),
    }
}

use Flat::{AllGather, Ring, Sra, Tree};
use Links::{Arena, Network, Sockets, Threads};

/// The built-in rules, first match wins. Measured with qccl-perf on 2 to 8 processes on 2 cores
/// (docs/perf-history.md); a tuning file's rows go in front of them.
pub const BUILTIN: &[Row] = &[
    // Several hosts with several ranks each: only 1/local_size of the data crosses the network
    // per rank (Horovod's and CGX's multi-node scheme), compressed or not.
    Row {
        coll: None,
        links: None,
        min_ranks: 1,
        max_ranks: ANY,
        max_bytes: ANY,
        pick: Pick::Hier,
    },
    // 2 ranks: one exchange of the whole buffers beats the ring below 64 KiB (TCP 4 KiB: 7 µs
    // against 13; shared memory on par).
    dense(None, (2, 2), 64 * K, AllGather),
    // Arena: SRA has two synchronisation points per round and one copy in, one reduction, one
    // copy out per element; on 2 ranks it beats the ring from 1 MiB on.
    dense(Some(Arena), (1, 2), M, Ring),
    // On 3 to 8 processes it beats the tree and the ring at every size (4 ranks, 4 KiB 6–13 µs
    // against the tree's 12–30; 64 MiB 32–38 ms against 42–45).
    dense(Some(Arena), (1, ANY), ANY, Sra),
    // 2 ranks over pairwise links: the ring from 64 KiB.
    dense(None, (2, 2), ANY, Ring),
    // Loopback TCP: each of the ring's dependent steps costs a socket round trip; the tree wins
    // below 1 MiB, SRA above (4 ranks, µs per call, 512 KiB slices: 256 KiB tree 177–205
    // against SRA 245–255, 512 KiB 325–357 against 365–380, 1 MiB on par, 4 MiB SRA 3.5–4.2 ms
    // against 4.2–6.0; 3 ranks on par at 256–512 KiB; ring behind SRA from 256 KiB).
    dense(Some(Sockets), (1, ANY), M, Tree),
    // Between hosts the wire sets the pace: SRA, which sends 2(n−1)/n of the buffer per rank
    // over both directions of every link at once, overtakes the tree (whose root link carries
    // the buffer twice each way) from 16 KiB (emulated cluster, one rank per host, 1 Gbit/s:
    // 4 hosts 16 KiB 187–238 µs against 275, 64 KiB 829 against 1097, 1 MiB 13.3 ms against
    // 23.3; 3 hosts 16 KiB 151–186 against 269–276; the tree ahead to 8 KiB).
    dense(Some(Network), (1, ANY), 16 * K, Tree),
    // Threads keep the rules measured for pairwise shared memory: tree below 64 KiB, ring to
    // 1 MiB, SRA above.
    dense(Some(Threads), (1, ANY), 64 * K, Tree),
    dense(Some(Threads), (1, ANY), M, Ring),
    // Pairwise SRA keeps n − 1 slices in flight per rank: up to 8 ranks (config::SRA_IN_FLIGHT),
    // the ring beyond.
    dense(None, (1, 8), ANY, Sra),
    dense(None, (1, ANY), ANY, Ring),
    // Compressed: the all-gather scheme for sparse codecs (a sum of sparse vectors is not
    // sparse), SRA otherwise (two quantizations per element whatever the world size, CGX's
    // choice).
    every(Workload::Sparse, AllGather),
    every(Workload::Compressed, Sra),
];

impl Row {
    /// True when the row covers a call of shape `s` (whatever it picks).
    pub fn matches(&self, s: &CallShape<'_>) -> bool {
        self.coll.is_none_or(|c| c == s.coll)
            && self.links.is_none_or(|l| l == s.links)
            && (self.min_ranks..=self.max_ranks).contains(&s.ranks)
            && s.bytes < self.max_bytes
    }
}

/// `4096` → `4K`, `1048576` → `1M` (exact multiples only; else plain bytes).
pub(super) fn size_name(b: usize) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

/// A row as a tuning file line: `collective links ranks max_bytes algorithm`.
impl fmt::Display for Row {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let coll = self.coll.map_or("*", Workload::name);
        let links = self.links.map_or("*", Links::name);
        let ranks = match (self.min_ranks, self.max_ranks) {
            (1, ANY) => "*".to_string(),
            (a, ANY) => format!("{a}-"),
            (a, b) if a == b => a.to_string(),
            (a, b) => format!("{a}-{b}"),
        };
        let bytes = match self.max_bytes {
            ANY => "*".to_string(),
            b => size_name(b),
        };
        write!(f, "{coll} {links} {ranks} {bytes} {}", self.pick.name())
    }
}
