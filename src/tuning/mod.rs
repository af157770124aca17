//! Algorithm choice for all-reduce, in one place: [`Tuning::choose`] turns a call's shape
//! (collective, bytes, ranks, links, hosts) and the user's request (QCCL_ALGO or the call's
//! algorithm) into a [`Resolved`] schedule, so that what runs below the comm never sees `auto`
//! or `hier`. The rules are rows of one table (`table::BUILTIN`), first match wins; a tuning
//! file (QCCL_TUNING_FILE, written by `qccl-perf --calibrate --tuning-out`) puts its rows in
//! front of them, so a cluster can replace thresholds measured elsewhere with its own (NCCL's
//! `src/graph/tuning.cc` plays the same part with its bandwidth and latency tables).

mod file;
mod table;

pub use file::{parse, HEADER};
pub use table::{Pick, Row, Workload, BUILTIN};

use crate::algo::Algo;
use crate::error::{Error, Result};
use std::path::Path;

/// How a comm's ranks reach each other, as far as choosing an algorithm goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Links {
    /// Some peer over TCP, every rank on one host: loopback, where the CPUs' copies, not the
    /// wire, set the pace (a job run with QCCL_TRANSPORT=tcp on one machine).
    Sockets,
    /// Some peer over TCP on another host: a network link, where the bytes each link
    /// carries set the pace.
    Network,
    /// Every peer over shared memory: the comm-wide arena (`transport::shm::arena`) serves SRA.
    Arena,
    /// Threads of one process (frames over channels).
    Threads,
}

impl Links {
    /// Every kind, in the order the tuning file's messages list them.
    pub const ALL: [Links; 4] = [Links::Threads, Links::Arena, Links::Sockets, Links::Network];

    /// The name a tuning file uses.
    pub fn name(self) -> &'static str {
        match self {
            Links::Sockets => "sockets",
            Links::Network => "network",
            Links::Arena => "arena",
            Links::Threads => "threads",
        }
    }
}

/// A flat all-reduce schedule: all the engine runs (the hierarchical one is two levels of
/// these, composed above it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Flat {
    /// Reduce-scatter then all-gather around a ring.
    Ring,
    /// Reduce up and broadcast down a binary tree.
    Tree,
    /// Scatter-reduce-allgather (pairwise, or through the shared-memory arena).
    Sra,
    /// Every rank's whole buffer to everyone in one exchange.
    AllGather,
}

impl Flat {
    /// The public name of this schedule (what calls return and descriptors carry).
    pub fn algo(self) -> Algo {
        match self {
            Flat::Ring => Algo::Ring,
            Flat::Tree => Algo::Tree,
            Flat::Sra => Algo::Sra,
            Flat::AllGather => Algo::AllGather,
        }
    }
}

/// What an all-reduce runs, with nothing left to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolved {
    /// One level, on the comm's own engine.
    Flat(Flat),
    /// Two levels (`comm::hier`): fixed intra-host phases (the arena, else the ring), and an
    /// inter-host all-reduce whose flat schedule the inter-host comm takes from this same
    /// table for each piece, by that piece's bytes, that comm's size and links.
    Hier,
}

/// The hosts of a comm, as far as the hierarchical schedule goes (computed once per comm).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    /// Ranks on each host, by host.
    pub per_host: Vec<usize>,
    /// Ranks on this rank's host.
    pub local_size: usize,
}

impl Hosts {
    /// The hosts of a comm whose host `i` has `per_host[i]` ranks, this rank's having
    /// `local_size`.
    pub fn new(per_host: Vec<usize>, local_size: usize) -> Hosts {
        Hosts {
            per_host,
            local_size,
        }
    }

    /// Every host has the same number of ranks: the two levels can be split.
    pub fn uniform(&self) -> bool {
        self.per_host.iter().all(|&n| n == self.local_size)
    }

    /// Several hosts with several ranks each, the same number on each: where the two levels
    /// pay (one host needs no network level, one rank per host no shared-memory level).
    pub fn two_levels(&self) -> bool {
        self.uniform() && self.per_host.len() > 1 && self.local_size > 1
    }
}

/// One call, as the choice sees it.
#[derive(Debug, Clone, Copy)]
pub struct CallShape<'a> {
    /// Which collective.
    pub coll: Workload,
    /// Bytes of the call's buffer (count × element size).
    pub bytes: usize,
    /// Ranks in the comm.
    pub ranks: usize,
    /// How they reach each other.
    pub links: Links,
    /// Their hosts.
    pub hosts: &'a Hosts,
}

/// The rules of a comm: a tuning file's rows, if any, ahead of the built-in table.
#[derive(Debug, Clone, Default)]
pub struct Tuning {
    /// The file's rows (empty without one).
    rows: Vec<Row>,
}

impl Tuning {
    /// The built-in table with `rows` in front of it.
    pub fn with_rows(rows: Vec<Row>) -> Tuning {
        Tuning { rows }
    }

    /// The rules of a comm: the tuning file at `path` (QCCL_TUNING_FILE) read and checked,
    /// else the built-in table alone. Errors name the file and line.
    pub fn load(path: Option<&Path>) -> Result<Tuning> {
        let Some(path) = path else {
            return Ok(Tuning::default());
        };
        let origin = format!("QCCL_TUNING_FILE={}", path.display());
        // Unreadable is the user's input being wrong, as a bad row is (IA from the C ABI).
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid(format!("{origin}: cannot read it: {e}")))?;
        let rows = parse(&text, &origin)?;
        crate::qlog!(
            Info,
            "{origin}: {} rows ahead of the built-in table",
            rows.len()
        );
        Ok(Tuning { rows })
    }

    /// The file's rows.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// The schedule of a call of shape `s` asked to run `request`: an explicit flat algorithm
    /// as asked, `hier` if the hosts allow it, `auto` by the first matching row.
    pub fn choose(&self, s: &CallShape<'_>, request: Algo) -> Result<Resolved> {
        let flat = match request {
            Algo::Auto => return Ok(self.auto(s)),
            Algo::Hier if s.hosts.uniform() => return Ok(Resolved::Hier),
            Algo::Hier => {
                return Err(Error::Unsupported(format!(
                    "hierarchical all_reduce needs the same number of ranks on every host; hosts have {:?}",
                    s.hosts.per_host
                )))
            }
            Algo::Ring => Flat::Ring,
            Algo::Tree => Flat::Tree,
            Algo::Sra => Flat::Sra,
            Algo::AllGather => Flat::AllGather,
        };
        Ok(Resolved::Flat(flat))
    }

    /// The `auto` flat schedule of a call that runs on one level (a level of a hierarchy):
    /// rows that pick `hier` are passed over.
    pub fn flat(&self, s: &CallShape<'_>) -> Flat {
        self.rows
            .iter()
            .chain(BUILTIN)
            .find_map(|r| match r.pick {
                Pick::Flat(f) if r.matches(s) => Some(f),
                _ => None,
            })
            // The built-in table ends with a row for every call of each collective.
            .unwrap_or(Flat::Ring)
    }

    fn auto(&self, s: &CallShape<'_>) -> Resolved {
        let two_levels = s.hosts.two_levels();
        let row = self
            .rows
            .iter()
            .chain(BUILTIN)
            .find(|r| r.matches(s) && (r.pick != Pick::Hier || two_levels));
        match row.map(|r| r.pick) {
            Some(Pick::Hier) => Resolved::Hier,
            Some(Pick::Flat(f)) => Resolved::Flat(f),
            None => Resolved::Flat(Flat::Ring),
        }
    }
}

#[cfg(test)]
mod tests;
