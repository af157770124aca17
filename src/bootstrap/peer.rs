//! What the rendezvous exchanges: each rank's description of itself, and the world they
//! form (a leaf: the root, the joining side and the wire format all speak of these).

use std::net::SocketAddr;

/// What every rank tells the others about itself at init.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerInfo {
    /// Rank in the world, `0..size`.
    pub rank: usize,
    /// Host identity ([`super::host_id`]): equal ids mean shared memory is possible.
    pub host_id: String,
    /// Machine identity ([`super::machine_id`]): equal ids share cores.
    pub machine_id: String,
    /// Address the rank's transport listens on.
    pub addr: SocketAddr,
    /// Process id (for diagnostics and same-process detection).
    pub pid: u32,
    /// CPUs the rank may run on (its affinity), ascending; empty when unknown. The ranks of
    /// one machine together may use the union: that, not the machine's CPU count, decides
    /// whether they have a core each to spin on (taskset, cpusets, Slurm's cgroups).
    pub cpus: Vec<usize>,
    /// The rank has a usable RDMA device and may use it (`transport::ib`): a pair whose ranks
    /// both do talks over RDMA across hosts.
    pub rdma: bool,
    /// The rank asked for CUDA IPC between the ranks of its machine (QCCL_CUDA_IPC=1): a
    /// comm uses it only when every rank did.
    pub cuda_ipc: bool,
}

/// The result of a successful rendezvous, identical on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    /// Random id of this communicator, chosen by the root; peers repeat it in their handshakes.
    pub comm_id: u64,
    /// Every rank's [`PeerInfo`], indexed by rank.
    pub peers: Vec<PeerInfo>,
}

impl World {
    /// True when every rank asked for CUDA IPC, all on one machine, and there are at least
    /// two: a comm of these ranks agrees on it before each dense call (`comm/cuda_ipc.rs`;
    /// ranks that share a process reach each other's device memory at its address).
    pub fn cuda_ipc(&self) -> bool {
        let p = &self.peers;
        p.len() >= 2
            && p.iter()
                .all(|q| q.cuda_ipc && q.machine_id == p[0].machine_id)
    }
}
