//! Host identity and the node/local-rank topology derived from it.

use crate::sys::hostname;

/// Identity of this host: ranks with equal ids can share memory.
///
/// QCCL_HOSTID if set and non-empty (containers that share a host but not a boot id, or tests
/// that simulate several hosts); otherwise `hostname:boot_id` from
/// `/proc/sys/kernel/random/boot_id`, or the bare host name where that file does not exist.
pub fn host_id() -> String {
    host_id_from(
        std::env::var("QCCL_HOSTID").ok(),
        &hostname(),
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok(),
    )
}

fn host_id_from(env: Option<String>, hostname: &str, boot_id: Option<String>) -> String {
    if let Some(id) = env.filter(|s| !s.trim().is_empty()) {
        return id.trim().to_string();
    }
    match boot_id.as_deref().map(str::trim).filter(|b| !b.is_empty()) {
        Some(boot) => format!("{hostname}:{boot}"),
        None => hostname.to_string(),
    }
}

/// Identity of this machine (its kernel's boot id, else its host name), whatever QCCL_HOSTID
/// says: ranks with equal machine ids compete for the same cores, which decides whether their
/// waits may spin (emulated hosts and containers with their own host names share them).
pub fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|b| b.trim().to_string())
        .filter(|b| !b.is_empty())
        .unwrap_or_else(hostname)
}

/// Where the ranks live: nodes (distinct host ids) and each rank's place on its node.
///
/// Nodes are numbered by first appearance in rank order; a rank's local rank is its position
/// among its node's ranks in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// This rank's node.
    pub node: usize,
    /// Number of nodes.
    pub nnodes: usize,
    /// This rank's position among its node's ranks.
    pub local_rank: usize,
    /// Number of ranks on this rank's node.
    pub local_size: usize,
    /// Node of every rank.
    pub node_of: Vec<usize>,
    /// Ranks of every node, ascending.
    pub ranks_of_node: Vec<Vec<usize>>,
}

impl Topology {
    /// Topology of a world whose rank `r` runs on host `host_ids[r]`, seen from `rank`.
    ///
    /// # Panics
    /// If `rank >= host_ids.len()`.
    pub fn new(host_ids: &[String], rank: usize) -> Topology {
        assert!(
            rank < host_ids.len(),
            "Topology::new: rank {rank} is out of range for {} host ids",
            host_ids.len()
        );
        let mut names: Vec<&str> = Vec::new();
        let mut ranks_of_node: Vec<Vec<usize>> = Vec::new();
        let mut node_of = Vec::with_capacity(host_ids.len());
        for (r, h) in host_ids.iter().enumerate() {
            let n = match names.iter().position(|x| *x == h.as_str()) {
                Some(n) => n,
                None => {
                    names.push(h);
                    ranks_of_node.push(Vec::new());
                    names.len() - 1
                }
            };
            node_of.push(n);
            ranks_of_node[n].push(r);
        }
        let node = node_of[rank];
        let mine = &ranks_of_node[node];
        Topology {
            node,
            nnodes: ranks_of_node.len(),
            local_rank: mine.iter().position(|&r| r == rank).unwrap_or(0),
            local_size: mine.len(),
            node_of,
            ranks_of_node,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_of_a_b_a_b_c() {
        let ids: Vec<String> = ["a", "b", "a", "b", "c"].map(String::from).to_vec();
        let t = Topology::new(&ids, 2);
        assert_eq!(t.node_of, vec![0, 1, 0, 1, 2]);
        assert_eq!(t.ranks_of_node, vec![vec![0, 2], vec![1, 3], vec![4]]);
        assert_eq!((t.node, t.nnodes, t.local_rank, t.local_size), (0, 3, 1, 2));
        let t = Topology::new(&ids, 3);
        assert_eq!((t.node, t.local_rank, t.local_size), (1, 1, 2));
        let t = Topology::new(&ids, 4);
        assert_eq!((t.node, t.local_rank, t.local_size), (2, 0, 1));
        let t = Topology::new(&ids, 0);
        assert_eq!((t.node, t.local_rank), (0, 0));
    }

    #[test]
    fn host_id_sources() {
        assert_eq!(host_id_from(Some("box7".into()), "h", None), "box7");
        assert_eq!(
            host_id_from(Some("  ".into()), "h", Some("abc-def\n".into())),
            "h:abc-def"
        );
        assert_eq!(host_id_from(None, "h", None), "h");
        assert!(!host_id().is_empty());
    }
}
