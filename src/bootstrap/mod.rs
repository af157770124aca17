//! Bootstrap: unique id, root rendezvous, environment detection, host topology.

pub mod host;
