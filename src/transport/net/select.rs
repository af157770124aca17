//! Which link kind serves a peer pair, chosen the way NCCL's `canConnect` chain chooses: each
//! kind, in order of preference, says whether it can connect the pair, and the first that can
//! wins. Both ranks decide from what both know (host ids, the configuration), so they agree
//! without a message. A new kind adds its `can_connect` and a row in [`ORDER`].

#[cfg(test)]
use crate::config::TransportChoice;
pub use crate::transport::link::Pair;

/// The link kinds a network comm opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Rings in shared memory (`transport::shm`).
    Shm,
    /// RDMA writes into registered slot rings (`transport::ib`).
    Ib,
    /// TCP sockets (`transport::socket`).
    Socket,
}

/// A kind's test: can it connect this pair?
type CanConnect = fn(&Pair) -> bool;

/// The kinds by preference, each with its test.
const ORDER: &[(Kind, CanConnect)] = &[
    (Kind::Shm, crate::transport::shm::can_connect),
    (Kind::Ib, crate::transport::ib::can_connect),
    (Kind::Socket, crate::transport::socket::can_connect),
];

/// The first kind that can connect `pair`.
pub fn choose(pair: &Pair) -> Kind {
    ORDER
        .iter()
        .find(|(_, can)| can(pair))
        .map_or(Kind::Socket, |&(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_on_one_host_unless_told_otherwise() {
        let pick = |choice, same_host| {
            choose(&Pair {
                choice,
                same_host,
                rdma: false,
            })
        };
        assert_eq!(pick(TransportChoice::Auto, true), Kind::Shm);
        assert_eq!(pick(TransportChoice::Auto, false), Kind::Socket);
        assert_eq!(pick(TransportChoice::Tcp, true), Kind::Socket);
        assert_eq!(pick(TransportChoice::Shm, false), Kind::Shm);
    }

    #[test]
    fn rdma_between_hosts_and_where_shared_memory_is_off() {
        let pick = |choice, same_host, rdma| {
            choose(&Pair {
                choice,
                same_host,
                rdma,
            })
        };
        // As NCCL: the network between hosts, RDMA when both ranks have a device.
        assert_eq!(pick(TransportChoice::Auto, false, true), Kind::Ib);
        assert_eq!(pick(TransportChoice::Auto, false, false), Kind::Socket);
        // One host stays on shared memory unless it is disabled.
        assert_eq!(pick(TransportChoice::Auto, true, true), Kind::Shm);
        assert_eq!(pick(TransportChoice::Tcp, true, true), Kind::Ib);
        assert_eq!(pick(TransportChoice::Shm, false, true), Kind::Shm);
    }
}
