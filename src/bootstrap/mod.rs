//! Bootstrap: unique id, root rendezvous, environment detection, host topology.
//!
//! How a world comes together:
//!
//! 1. One process calls [`UniqueId::new`]: it picks a network interface ([`select_interface`]),
//!    listens on a free port there and starts the root server ([`spawn_root`]) in a background
//!    thread. The 128-byte id carries the root's address and a random 128-bit secret; the
//!    application hands it to every rank (MPI broadcast, a file, ...). Alternatively every rank
//!    reads its rank, world size, root address and secret from a launcher's environment
//!    ([`detect`]) and builds the id with [`UniqueId::with_root`].
//! 2. Every rank calls [`join`] with its [`PeerInfo`] (rank, [`host_id`], transport listen
//!    address, pid). The root checks the secret (strangers are turned away, the job goes on),
//!    the protocol version, the world size and that no rank joins twice; any inconsistency fails
//!    the whole init with a message sent to every connected rank.
//! 3. When all ranks joined, the root sends every rank the same [`World`]: a random comm id and
//!    the peer table in rank order. [`Topology`] derives nodes and local ranks from it.
//!
//! The wire format is described in `wire.rs`; the id layout in [`UniqueId`].

pub mod env;
pub mod host;
pub mod ifaddr;
mod peer;
pub mod rendezvous;
pub mod root;
pub mod unique_id;
mod wire;

/// Version of the bootstrap protocol (unique id layout and rendezvous messages). A root and a
/// rank speaking different versions fail the init with a message naming both versions.
pub const PROTOCOL_VERSION: u32 = 5;

pub use env::detect;
pub use host::{host_id, machine_id, Topology};
pub use ifaddr::select_interface;
pub use peer::PeerInfo;
pub use rendezvous::join;
pub use root::spawn_root;
pub use unique_id::UniqueId;
