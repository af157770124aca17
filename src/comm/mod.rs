//! The communicator: who we are in the world, and an ordered queue of operations.

mod api;
mod arena_turn;
mod bands;
mod compress;
mod cuda_ipc;
#[cfg(feature = "cuda")]
mod cuda_slices;
mod dense_call;
mod device;
mod device_all_reduce;
mod gpu_hier;
mod gpu_hier_stream;
mod gpu_sra;
mod gpu_topk;
mod gpu_topk_stream;
mod hier;
mod hitopk;
mod ipc_turn;
mod pipeline;
mod queue;
mod register;
mod rooted_bands;
mod route;
mod shrink;
mod split;

pub use compress::{Compression, PreparedAllReduce, Report};
pub use hitopk::{PreparedTopK, TopK, TopKReport, TopKScheme};
pub use queue::Request;
pub use register::{RegHandle, Registrations};
pub use route::AllReduceCall;

use crate::bootstrap::{
    self, host_id, join, machine_id, select_interface, PeerInfo, Topology, UniqueId,
};
use crate::coll::Engine;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::ib;
use crate::transport::inproc::InProcConnector;
use crate::transport::link::Connector;
use crate::transport::net::select::{self, Kind};
use crate::transport::net::NetConnector;
use crate::transport::{LinkConfig, Transport};
use crate::tuning::{Hosts, Links, Tuning};
use queue::Queue;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How this comm reaches its peers; split comms use the same kind.
#[derive(Clone)]
enum Fabric {
    Tcp {
        ip: IpAddr,
        peers: Vec<SocketAddr>,
        /// This rank's usable RDMA port, if any.
        rdma: Option<Arc<ib::Device>>,
    },
    InProc,
}

/// Where a comm's ranks run.
#[derive(Debug, Clone)]
struct Placement {
    /// Host of every rank: ranks of one host share memory.
    host_ids: Vec<String>,
    /// Which ranks have a usable RDMA device (`transport::ib`).
    rdma: Vec<bool>,
    /// Ranks of the job (the comm this one was split from, if any) on this machine, whatever
    /// hosts they emulate: with more of them than cores, waits yield instead of spinning.
    machine_ranks: usize,
    /// The cores those ranks may run on between them.
    machine_cores: usize,
    /// Another rank of this comm runs in this process (threads, or two `Comm::init`s of one
    /// process): calls on a caller's stream then return once done (`device.rs` says why).
    process_peers: bool,
    /// Every rank asked for CUDA IPC (QCCL_CUDA_IPC=1), all on one machine, and there are
    /// at least two: the same on every rank (`comm/cuda_ipc.rs`).
    cuda_ipc: bool,
}

/// A communicator: a group of ranks that run collectives together.
///
/// All ranks must call the same collectives in the same order. Blocking calls return when
/// this rank's part is complete; `*_async` calls return a [`Request`] that owns the buffers.
/// Every wait is bounded by `QCCL_TIMEOUT_MS`; after any failure the comm is failed and
/// every later call returns that error.
pub struct Comm {
    rank: usize,
    size: usize,
    topo: Topology,
    place: Placement,
    comm_id: u64,
    secret: [u8; 16],
    config: Config,
    /// The all-reduce rules (QCCL_TUNING_FILE's rows ahead of the built-in table), shared
    /// with the comms split off this one.
    tuning: Arc<Tuning>,
    /// How the ranks reach each other and where they run: what the rules look at.
    links: Links,
    hosts: Hosts,
    fabric: Fabric,
    queue: Arc<Queue>,
    worker: Option<JoinHandle<()>>,
    splits: std::sync::atomic::AtomicU64,
    hier: std::sync::Mutex<Option<Arc<hier::Hier>>>,
    /// Layouts of fused buffers, by tensor key (compressed calls).
    layouts:
        std::sync::Mutex<std::collections::HashMap<crate::TensorKey, crate::codec::layout::Layout>>,
    /// The layout of unkeyed compressed calls of its size (C ABI's qcclCommSetLayout).
    default_layout: std::sync::Mutex<Option<crate::codec::layout::Layout>>,
    /// Layers kept uncompressed (from the config; qcclCommExcludeLayers changes it).
    filter: std::sync::Mutex<crate::codec::layout::Filter>,
    transport: &'static str,
    /// Over TCP: the transport's listener, held open (a second descriptor of the same
    /// socket) for the comm's whole life, so that after a failure the survivors can still
    /// reach each other at the addresses they know, to shrink (`shrink.rs`).
    rescue: Option<TcpListener>,
    /// After `shrink`: the thread answering latecomers' joins, for the comm's life.
    shrinker: std::sync::Mutex<Option<shrink::Server>>,
    /// Over TCP: the transport's stall inspector (`transport::stall`), whose accept thread
    /// a shrink stops, answering its probes itself.
    inspector: Option<Arc<crate::transport::stall::Inspector>>,
    /// Buffers registered with the comm (`register`), shared with its links.
    registry: Arc<crate::transport::registry::Registry>,
    /// The comm's device: that of its first call on device memory (an NCCL comm belongs to
    /// one device).
    device: std::sync::OnceLock<usize>,
    /// Staging of device buffers, on the comm's device.
    staging: std::sync::Mutex<Option<crate::gpu::staging::Staging>>,
    /// Staging of queued calls (`submit_on_buffers`), used only in the comm's turn: a
    /// caller holding `staging` waits for its turn, so queued calls cannot share it.
    queued_staging: Arc<std::sync::Mutex<Option<crate::gpu::staging::Staging>>>,
    /// Page-locked buffers of calls on callers' streams, capped (QCCL_STAGING_BYTES).
    pinned_pool: Arc<crate::gpu::staging::Pool>,
    /// Compressed all-reduces with the codecs on the GPU (shared with the engine).
    gpu_lane: Arc<crate::gpu::sra::state::GpuLane>,
    /// Dense all-reduces over CUDA IPC (`cuda_ipc.rs`): the device side, used only in the
    /// comm's turn, made by the first such call.
    ipc_lane: Arc<std::sync::Mutex<Option<crate::gpu::ipc::IpcLane>>>,
    /// All-reduces that ran over CUDA IPC.
    ipc_calls: Arc<std::sync::atomic::AtomicU64>,
    /// Dense calls on device buffers through the shared-memory arena (`arena_turn.rs`): the
    /// device side, used only in the comm's turn, made by the first such call.
    arena_lane: Arc<std::sync::Mutex<Option<crate::gpu::arena::ArenaLane>>>,
    /// Calls that ran through the arena on device buffers.
    arena_calls: Arc<std::sync::atomic::AtomicU64>,
    /// Dense all-reduces on device buffers across hosts staged piece by piece (`bands.rs`).
    piecewise_calls: Arc<std::sync::atomic::AtomicU64>,
}

/// The cores the ranks on `me`'s machine may run on between them: the union of their CPU
/// lists, not one process's share (a launcher that binds each rank to one core leaves the
/// ranks a core each) nor the machine's count (taskset, cpusets and Slurm's cgroups give a
/// job fewer). The machine's online CPUs when a rank could not tell its own.
fn machine_cores(peers: &[PeerInfo], me: &PeerInfo) -> usize {
    cores_in(
        peers
            .iter()
            .filter(|p| p.machine_id == me.machine_id)
            .map(|p| &p.cpus[..]),
    )
}

/// CPUs in the union of the `lists` (empty list: unknown, then the machine's online CPUs).
fn cores_in<'a>(lists: impl Iterator<Item = &'a [usize]> + Clone) -> usize {
    if lists.clone().any(|l| l.is_empty()) {
        return online_cpus();
    }
    let union: std::collections::BTreeSet<usize> = lists.flatten().copied().collect();
    union.len().max(1)
}

fn online_cpus() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |n| n.max(1) as usize,
        )
}

fn link_config(
    rank: usize,
    size: usize,
    place: &Placement,
    config: &Config,
    abort: Arc<AtomicBool>,
) -> LinkConfig {
    // Spinning only pays when every rank on this machine has a core to spin on; otherwise
    // yield the core to a peer for the same time before blocking.
    let budget = Duration::from_micros(config.spin_us);
    let oversubscribed = place.machine_ranks > place.machine_cores;
    crate::qlog!(
        Info,
        "rank {rank}: {} ranks on {} cores of this machine: waits {}",
        place.machine_ranks,
        place.machine_cores,
        if oversubscribed { "yield" } else { "spin" }
    );
    let (spin, yield_for) = if oversubscribed {
        (Duration::ZERO, budget)
    } else {
        (budget, Duration::ZERO)
    };
    LinkConfig {
        rank,
        size,
        timeout: config.timeout,
        spin,
        yield_for,
        abort,
        arena_chunk: config.shm_arena_chunk,
        inspector: None,
        registry: Default::default(),
    }
}

impl Comm {
    /// Joins the comm described by `id` as `rank` of `size` ranks over TCP; blocks until all
    /// ranks joined (or `config.init_timeout` passes).
    pub fn init(id: &UniqueId, rank: usize, size: usize, config: Config) -> Result<Comm> {
        check_rank(rank, size)?;
        config.validate()?;
        // Before the rendezvous: a bad tuning file fails this rank alone, before any byte moves.
        let tuning = Arc::new(Tuning::load(config.tuning_file.as_deref())?);
        let (ifname, ip) =
            select_interface(config.socket_ifname.as_deref(), Some(id.root_addr().ip()))?;
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::io(format!("binding a listener on {ifname} ({ip})"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("reading the listener's address", e))?;
        crate::qlog!(Info, "rank {rank}: listening on {addr} ({ifname})");
        let rdma = ib::Device::probe(&config.ib, id.secret(), ip)?;
        let me = PeerInfo {
            rank,
            host_id: host_id(),
            machine_id: machine_id(),
            addr,
            pid: std::process::id(),
            cpus: crate::launch::allowed_cpus().unwrap_or_default(),
            rdma: rdma.is_some(),
            cuda_ipc: config.cuda_ipc,
        };
        let world = join(id, &me, size, Instant::now() + config.init_timeout)?;
        let peers: Vec<SocketAddr> = world.peers.iter().map(|p| p.addr).collect();
        let process_peers = world
            .peers
            .iter()
            .any(|p| p.rank != rank && p.pid == me.pid && p.machine_id == me.machine_id);
        let cuda_ipc = world.cuda_ipc();
        let place = Placement {
            process_peers,
            cuda_ipc,
            machine_ranks: world
                .peers
                .iter()
                .filter(|p| p.machine_id == me.machine_id)
                .count(),
            machine_cores: machine_cores(&world.peers, &me),
            rdma: world.peers.iter().map(|p| p.rdma).collect(),
            host_ids: world.peers.into_iter().map(|p| p.host_id).collect(),
        };
        Comm::build(
            rank,
            place,
            world.comm_id,
            id.secret(),
            config,
            tuning,
            Fabric::Tcp { ip, peers, rdma },
            Some(listener),
        )
    }

    /// Joins the job described by the environment: QCCL_RANK / QCCL_WORLD_SIZE / QCCL_COMM_ID,
    /// or torchrun, OpenMPI, PMI or Slurm variables (see `bootstrap::env`). Rank 0 hosts the
    /// rendezvous at the given address.
    pub fn from_env() -> Result<Comm> {
        let env = bootstrap::detect()?;
        let config = Config::from_env()?;
        if env.rank == 0 {
            let listener = TcpListener::bind(env.root).map_err(|e| {
                Error::io(
                    format!("rank 0: binding the rendezvous address {}", env.root),
                    e,
                )
            })?;
            bootstrap::spawn_root(listener, env.secret, config.init_timeout)?;
        }
        let id = UniqueId::with_root(env.root, env.secret);
        Comm::init(&id, env.rank, env.size, config)
    }

    /// `n` ranks as threads of this process, connected by the in-process transport: one
    /// `Comm` per rank, to be moved to its own thread.
    pub fn init_threads(n: usize, config: Config) -> Result<Vec<Comm>> {
        Comm::init_threads_on_hosts(&vec![host_id(); n], config)
    }

    /// Like [`Comm::init_threads`], with rank i pretending to run on host `host_ids[i]`
    /// (for testing multi-host topologies).
    pub fn init_threads_on_hosts(host_ids: &[String], config: Config) -> Result<Vec<Comm>> {
        if host_ids.is_empty() {
            return Err(Error::invalid("a comm needs at least one rank (got 0)"));
        }
        config.validate()?;
        let tuning = Arc::new(Tuning::load(config.tuning_file.as_deref())?);
        let comm_id: u64 = rand::random();
        let secret: [u8; 16] = rand::random();
        (0..host_ids.len())
            .map(|r| {
                let place = Placement {
                    host_ids: host_ids.to_vec(),
                    rdma: vec![false; host_ids.len()],
                    machine_ranks: host_ids.len(),
                    // Threads share this process's CPUs.
                    machine_cores: cores_in(std::iter::once(
                        &crate::launch::allowed_cpus().unwrap_or_default()[..],
                    )),
                    process_peers: host_ids.len() > 1,
                    // Threads of one process reach each other's device memory directly.
                    cuda_ipc: config.cuda_ipc
                        && host_ids.len() > 1
                        && host_ids.iter().all(|h| *h == host_ids[0]),
                };
                Comm::build(
                    r,
                    place,
                    comm_id,
                    secret,
                    config.clone(),
                    tuning.clone(),
                    Fabric::InProc,
                    None,
                )
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        rank: usize,
        place: Placement,
        comm_id: u64,
        secret: [u8; 16],
        config: Config,
        tuning: Arc<Tuning>,
        fabric: Fabric,
        listener: Option<TcpListener>,
    ) -> Result<Comm> {
        let host_ids = &place.host_ids;
        let size = host_ids.len();
        let topo = Topology::new(host_ids, rank);
        let abort = Arc::new(AtomicBool::new(false));
        let mut link = link_config(rank, size, &place, &config, abort.clone());
        // Some peer over sockets or RDMA (no comm-wide arena then).
        let mut over_network = false;
        let rescue = match &listener {
            Some(l) => Some(
                l.try_clone()
                    .map_err(|e| Error::io("duplicating the listener", e))?,
            ),
            None => None,
        };
        let connector: Box<dyn Connector> = match (&fabric, listener) {
            (Fabric::Tcp { peers, rdma, .. }, Some(l)) => {
                // Each pair's link kind, as NCCL picks a transport per pair; both ranks know
                // both ranks' devices, so they agree.
                let kinds: Vec<Kind> = (0..size)
                    .map(|p| {
                        select::choose(&select::Pair {
                            choice: config.transport,
                            same_host: host_ids[p] == host_ids[rank],
                            rdma: place.rdma[p] && place.rdma[rank],
                        })
                    })
                    .collect();
                over_network =
                    (0..size).any(|p| p != rank && matches!(kinds[p], Kind::Socket | Kind::Ib));
                // One opened port per comm, for its RDMA links.
                let ib = match rdma {
                    Some(dev) if (0..size).any(|p| p != rank && kinds[p] == Kind::Ib) => {
                        Some(Arc::new(ib::setup::IbNet::open(dev)?))
                    }
                    _ => None,
                };
                Box::new(NetConnector::new(
                    l,
                    peers.clone(),
                    comm_id,
                    secret,
                    config.nsocks_per_peer,
                    kinds,
                    ib,
                    &mut link,
                )?)
            }
            (Fabric::InProc, _) => Box::new(InProcConnector::join(comm_id, &link)?),
            (Fabric::Tcp { .. }, None) => {
                return Err(Error::Internal("tcp comm without a listener".into()))
            }
        };
        let registry = link.registry.clone();
        let transport = Transport::new(link, connector);
        crate::qlog!(
            Info,
            "rank {rank}/{size}: comm {comm_id:#018x} on {} (node {} of {}, local rank {} of {})",
            transport.name(),
            topo.node,
            topo.nnodes,
            topo.local_rank,
            topo.local_size
        );
        let transport_name = transport.name();
        let inspector = transport.inspector();
        let links = match (&fabric, over_network) {
            (_, true) if topo.nnodes > 1 => Links::Network,
            (_, true) => Links::Sockets,
            (Fabric::Tcp { .. }, false) => Links::Arena,
            (Fabric::InProc, false) => Links::Threads,
        };
        let hosts = Hosts::new(
            topo.ranks_of_node.iter().map(Vec::len).collect(),
            topo.local_size,
        );
        let gpu_lane: Arc<crate::gpu::sra::state::GpuLane> = Default::default();
        let engine = Engine {
            t: transport,
            scratch: Default::default(),
            rank,
            size,
            slice: config.slice_bytes(),
            sra_slice: config.sra_slice_bytes(size),
            wire: Default::default(),
            residuals: Default::default(),
            coded_calls: 0,
            gpu: gpu_lane.clone(),
            cuda_ipc: place.cuda_ipc,
        };
        let (queue, jobs) = Queue::new(engine, abort);
        let q = queue.clone();
        let worker = std::thread::Builder::new()
            .name(format!("qccl-worker-{rank}"))
            .spawn(move || {
                for (ticket, job) in jobs {
                    q.run_job(ticket, job);
                }
            })
            .map_err(|e| Error::io("spawning the comm's worker thread", e))?;
        let filter = config.filter.clone();
        let pinned_pool = Arc::new(crate::gpu::staging::Pool::new(config.staging_bytes));
        Ok(Comm {
            rank,
            size,
            topo,
            place,
            comm_id,
            secret,
            config,
            tuning,
            links,
            hosts,
            fabric,
            queue,
            worker: Some(worker),
            splits: Default::default(),
            hier: Default::default(),
            layouts: Default::default(),
            default_layout: Default::default(),
            filter: std::sync::Mutex::new(filter),
            transport: transport_name,
            rescue,
            shrinker: Default::default(),
            inspector,
            registry,
            device: Default::default(),
            staging: Default::default(),
            queued_staging: Default::default(),
            pinned_pool,
            gpu_lane,
            ipc_lane: Default::default(),
            ipc_calls: Default::default(),
            arena_lane: Default::default(),
            arena_calls: Default::default(),
            piecewise_calls: Default::default(),
        })
    }

    /// This rank, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Index of this rank's host among the comm's hosts (numbered by first appearance).
    pub fn node(&self) -> usize {
        self.topo.node
    }

    /// Number of distinct hosts in the comm.
    pub fn num_nodes(&self) -> usize {
        self.topo.nnodes
    }

    /// This rank's index among the ranks on its host.
    pub fn local_rank(&self) -> usize {
        self.topo.local_rank
    }

    /// Number of ranks on this rank's host.
    pub fn local_size(&self) -> usize {
        self.topo.local_size
    }

    /// The comm's configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What carries this comm's traffic: "tcp", "tcp+shm" or "inproc".
    pub fn transport_name(&self) -> &'static str {
        self.transport
    }

    #[doc(hidden)]
    /// How the ranks reach each other, as the all-reduce rules (and a tuning file) name it.
    pub fn links(&self) -> Links {
        self.links
    }

    /// The comm's random 64-bit id (same on every rank).
    pub fn id(&self) -> u64 {
        self.comm_id
    }

    /// The error that failed this comm, if one did (NCCL's `ncclCommGetAsyncError`).
    pub fn async_error(&self) -> Option<Error> {
        self.queue.failed()
    }

    /// The comm's error if it failed: a call on a caller's stream is refused before it
    /// enqueues anything (it would only fail in its turn, the stream released).
    pub(super) fn refuse_if_failed(&self) -> Result<()> {
        self.queue.failed().map_or(Ok(()), Err)
    }

    /// Aborts the comm: the running operation and all later ones fail, peers are told and
    /// connections closed. Returns within about a second; the process stays usable.
    pub fn abort(&self) {
        self.queue.abort();
    }
}

fn check_rank(rank: usize, size: usize) -> Result<()> {
    if size == 0 {
        return Err(Error::invalid(
            "world size 0: a comm needs at least one rank",
        ));
    }
    if rank >= size {
        return Err(Error::invalid(format!(
            "rank {rank} is out of range for a world of {size} ranks"
        )));
    }
    Ok(())
}

impl Drop for Comm {
    fn drop(&mut self) {
        self.queue.close();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(rank: usize, machine: &str, cpus: &[usize]) -> PeerInfo {
        PeerInfo {
            rank,
            host_id: format!("h{rank}"),
            machine_id: machine.into(),
            addr: "127.0.0.1:9".parse().unwrap(),
            pid: rank as u32,
            cpus: cpus.to_vec(),
            rdma: false,
            cuda_ipc: false,
        }
    }

    #[test]
    fn machine_cores_is_the_union_of_the_machines_cpu_lists() {
        // Bound one per CPU: 2 cores; both on CPU 0: 1; other machines do not count.
        let bound = [
            peer(0, "a", &[0]),
            peer(1, "a", &[1]),
            peer(2, "b", &[2, 3, 4]),
        ];
        assert_eq!(machine_cores(&bound, &bound[0]), 2);
        assert_eq!(machine_cores(&bound, &bound[2]), 3);
        let pinned = [peer(0, "a", &[0]), peer(1, "a", &[0])];
        assert_eq!(machine_cores(&pinned, &pinned[1]), 1);
        let free = [peer(0, "a", &[0, 1, 2]), peer(1, "a", &[1, 2, 3])];
        assert_eq!(machine_cores(&free, &free[0]), 4);
        // A rank that could not read its affinity: the machine's count.
        let unknown = [peer(0, "a", &[0]), peer(1, "a", &[])];
        assert_eq!(machine_cores(&unknown, &unknown[0]), online_cpus());
    }

    #[test]
    fn an_operation_that_runs_other_than_it_declared_fails_the_comm() {
        let comm = Comm::init_threads(1, Config::default()).unwrap().remove(0);
        // Declared right: the step a later declared call gets counts it.
        let req = comm
            .queue
            .submit_holding((), Some(0), |_, _| Ok(()))
            .unwrap();
        req.wait().unwrap();
        // Declared one compressed call, ran none: later calls' steps would be wrong.
        let req = comm
            .queue
            .submit_holding((), Some(1), |_, _| Ok(()))
            .unwrap();
        let err = req.wait().unwrap_err().to_string();
        assert!(
            err.contains("declared 1 compressed calls and ran 0"),
            "{err}"
        );
        assert!(comm.queue.failed().is_some(), "the comm did not fail");
    }
}
