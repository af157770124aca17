//! Network interface selection with NCCL_SOCKET_IFNAME semantics (QCCL_SOCKET_IFNAME).

use crate::error::{Error, Result};
use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;
use std::net::IpAddr;

/// One interface that is up, with its usable addresses (IPv4, and IPv6 except link-local).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Iface {
    name: String,
    loopback: bool,
    /// (address, netmask) in the order getifaddrs lists them.
    addrs: Vec<(IpAddr, Option<IpAddr>)>,
}

impl Iface {
    /// The address to use: of `near`'s family (in its subnet first) if there is one, else the
    /// first IPv4, else the first IPv6.
    fn pick(&self, near: Option<IpAddr>) -> IpAddr {
        if let Some(n) = near {
            if let Some((a, _)) = self.addrs.iter().find(|(a, m)| in_subnet(*a, *m, n)) {
                return *a;
            }
            if let Some((a, _)) = self.addrs.iter().find(|(a, _)| a.is_ipv4() == n.is_ipv4()) {
                return *a;
            }
        }
        self.addrs
            .iter()
            .find(|(a, _)| a.is_ipv4())
            .unwrap_or(&self.addrs[0])
            .0
    }

    fn contains(&self, near: IpAddr) -> bool {
        self.addrs.iter().any(|(a, m)| in_subnet(*a, *m, near))
    }

    fn has_ipv4(&self) -> bool {
        self.addrs.iter().any(|(a, _)| a.is_ipv4())
    }
}

/// True when `near` is in the subnet of `addr`/`mask` (without a mask: equal addresses).
fn in_subnet(addr: IpAddr, mask: Option<IpAddr>, near: IpAddr) -> bool {
    match (addr, mask, near) {
        (IpAddr::V4(a), Some(IpAddr::V4(m)), IpAddr::V4(n)) => {
            let m = u32::from(m);
            u32::from(a) & m == u32::from(n) & m
        }
        (IpAddr::V6(a), Some(IpAddr::V6(m)), IpAddr::V6(n)) => {
            let m = u128::from(m);
            u128::from(a) & m == u128::from(n) & m
        }
        _ => addr == near,
    }
}

fn usable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(_) => true,
        // Link-local IPv6 needs a scope id that addresses in the id and tables do not carry.
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) != 0xfe80,
    }
}

/// The interfaces that are up and have a usable address, in getifaddrs order.
fn list_interfaces() -> Result<Vec<Iface>> {
    let all = getifaddrs().map_err(|e| Error::System(format!("getifaddrs: {e}")))?;
    let mut out: Vec<Iface> = Vec::new();
    for ifa in all {
        if !ifa.flags.contains(InterfaceFlags::IFF_UP) {
            continue;
        }
        let ip_of = |s: &nix::sys::socket::SockaddrStorage| -> Option<IpAddr> {
            if let Some(v4) = s.as_sockaddr_in() {
                return Some(IpAddr::V4(v4.ip()));
            }
            s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        };
        let Some(ip) = ifa.address.as_ref().and_then(ip_of) else {
            continue;
        };
        if !usable(ip) {
            continue;
        }
        let mask = ifa.netmask.as_ref().and_then(ip_of);
        let loopback = ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK) || ip.is_loopback();
        match out.iter_mut().find(|i| i.name == ifa.interface_name) {
            Some(i) => {
                i.addrs.push((ip, mask));
                i.loopback |= loopback;
            }
            None => out.push(Iface {
                name: ifa.interface_name.clone(),
                loopback,
                addrs: vec![(ip, mask)],
            }),
        }
    }
    Ok(out)
}

/// Chooses the interface and address to listen on.
///
/// `spec` follows NCCL_SOCKET_IFNAME: a comma-separated list of interface-name prefixes
/// (`eth,ib`); a leading `^` makes it a list to exclude (`^docker,lo`); a leading `=` (after the
/// `^`, if any) means exact names (`=eth0`, `^=eth0`). When nothing matches the error lists the
/// candidates. Among several matches, one whose subnet contains `near` wins, then getifaddrs
/// order (for exclude lists, non-loopback interfaces first).
///
/// Without a spec: if `near` is a loopback address, the loopback interface; else if `near` is
/// given, an interface whose subnet contains it; else the first non-loopback interface with an
/// IPv4 address not named `docker*`, `virbr*` or `veth*`, then such an interface with only
/// IPv6, then loopback. An interface with both IPv4 and IPv6 gives its IPv4 address unless
/// `near` is IPv6. Only interfaces that are up are considered.
pub fn select_interface(spec: Option<&str>, near: Option<IpAddr>) -> Result<(String, IpAddr)> {
    let ifaces = list_interfaces()?;
    let (name, ip) = choose(&ifaces, spec, near)?;
    crate::qlog!(
        Trace,
        "bootstrap: interface {name} ({ip}) chosen for spec {spec:?}, near {near:?}"
    );
    Ok((name, ip))
}

fn candidates(ifaces: &[Iface]) -> String {
    if ifaces.is_empty() {
        return "none (no interface is up with an address)".into();
    }
    ifaces
        .iter()
        .map(|i| format!("{} ({})", i.name, i.pick(None)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn choose(ifaces: &[Iface], spec: Option<&str>, near: Option<IpAddr>) -> Result<(String, IpAddr)> {
    let spec = spec.map(str::trim).filter(|s| !s.is_empty());
    let chosen = match spec {
        Some(spec) => {
            let (exclude, rest) = match spec.strip_prefix('^') {
                Some(r) => (true, r),
                None => (false, spec),
            };
            let (exact, rest) = match rest.strip_prefix('=') {
                Some(r) => (true, r),
                None => (false, rest),
            };
            let names: Vec<&str> = rest
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect();
            let hit = |i: &Iface| {
                names.iter().any(|n| {
                    if exact {
                        i.name == *n
                    } else {
                        i.name.starts_with(n)
                    }
                })
            };
            let mut matched: Vec<&Iface> = ifaces.iter().filter(|i| hit(i) != exclude).collect();
            if exclude {
                // Stable: keeps getifaddrs order within each group.
                matched.sort_by_key(|i| i.loopback);
            }
            let best = near
                .and_then(|n| matched.iter().find(|i| i.contains(n)))
                .or(matched.first())
                .copied();
            match best {
                Some(i) => i,
                None => {
                    return Err(Error::invalid(format!(
                        "QCCL_SOCKET_IFNAME={spec} matches no interface; candidates: {}",
                        candidates(ifaces)
                    )))
                }
            }
        }
        None => {
            let virt = |i: &&Iface| {
                ["docker", "virbr", "veth"]
                    .iter()
                    .any(|p| i.name.starts_with(p))
            };
            let lo = || ifaces.iter().find(|i| i.loopback);
            let by_near = near.and_then(|n| {
                if n.is_loopback() {
                    lo()
                } else {
                    ifaces.iter().find(|i| i.contains(n))
                }
            });
            let real = || ifaces.iter().filter(|i| !i.loopback).filter(|i| !virt(i));
            let found = by_near
                .or_else(|| real().find(|i| i.has_ipv4()))
                .or_else(|| real().next())
                .or_else(lo);
            match found {
                Some(i) => i,
                None => {
                    return Err(Error::System(format!(
                        "no usable network interface; candidates: {}",
                        candidates(ifaces)
                    )))
                }
            }
        }
    };
    Ok((chosen.name.clone(), chosen.pick(near)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn iface(name: &str, addrs: &[(&str, &str)]) -> Iface {
        Iface {
            name: name.into(),
            loopback: name == "lo",
            addrs: addrs.iter().map(|(a, m)| (ip(a), Some(ip(m)))).collect(),
        }
    }

    fn fake() -> Vec<Iface> {
        vec![
            iface(
                "lo",
                &[
                    ("127.0.0.1", "255.0.0.0"),
                    ("::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
                ],
            ),
            iface("docker0", &[("172.17.0.1", "255.255.0.0")]),
            iface(
                "eth0",
                &[
                    ("fd00::2", "ffff:ffff:ffff:ffff::"),
                    ("192.0.2.2", "255.255.255.0"),
                ],
            ),
            iface("eth1", &[("10.0.0.5", "255.255.0.0")]),
            iface("ib0", &[("fd01::5", "ffff:ffff:ffff:ffff::")]),
        ]
    }

    fn pick(spec: Option<&str>, near: Option<&str>) -> Result<(String, IpAddr)> {
        choose(&fake(), spec, near.map(ip))
    }

    #[test]
    fn specs_on_a_fake_host() {
        assert_eq!(
            pick(Some("lo"), None).unwrap(),
            ("lo".into(), ip("127.0.0.1"))
        );
        assert_eq!(pick(Some("=lo"), None).unwrap().0, "lo");
        assert_eq!(
            pick(Some("eth"), None).unwrap(),
            ("eth0".into(), ip("192.0.2.2"))
        );
        assert_eq!(pick(Some("eth"), Some("10.0.7.7")).unwrap().0, "eth1");
        assert_eq!(pick(Some("=eth1"), None).unwrap().0, "eth1");
        assert!(pick(Some("=eth"), None).is_err());
        assert_eq!(pick(Some("^lo"), None).unwrap().0, "docker0");
        assert_eq!(pick(Some("^docker,lo"), None).unwrap().0, "eth0");
        assert_eq!(pick(Some("^=eth0,docker0,eth1,ib0"), None).unwrap().0, "lo");
        assert_eq!(
            pick(Some("ib"), None).unwrap(),
            ("ib0".into(), ip("fd01::5"))
        );
        let e = pick(Some("xyz"), None).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(
            e.to_string().contains(
                "QCCL_SOCKET_IFNAME=xyz matches no interface; candidates: lo (127.0.0.1), \
                 docker0 (172.17.0.1), eth0 (192.0.2.2), eth1 (10.0.0.5), ib0 (fd01::5)"
            ),
            "{e}"
        );
    }

    #[test]
    fn defaults_on_a_fake_host() {
        assert_eq!(pick(None, None).unwrap(), ("eth0".into(), ip("192.0.2.2")));
        assert_eq!(
            pick(None, Some("127.0.0.1")).unwrap(),
            ("lo".into(), ip("127.0.0.1"))
        );
        assert_eq!(pick(None, Some("::1")).unwrap(), ("lo".into(), ip("::1")));
        assert_eq!(pick(None, Some("10.0.200.1")).unwrap().0, "eth1");
        assert_eq!(pick(None, Some("172.17.3.3")).unwrap().0, "docker0");
        assert_eq!(
            pick(None, Some("fd00::9")).unwrap(),
            ("eth0".into(), ip("fd00::2"))
        );
        // Unknown subnet: the default choice.
        assert_eq!(pick(None, Some("198.51.100.1")).unwrap().0, "eth0");
        // Only virtual and IPv6-only interfaces besides lo.
        let v = vec![fake()[0].clone(), fake()[1].clone(), fake()[4].clone()];
        assert_eq!(choose(&v, None, None).unwrap().0, "ib0");
        let v = vec![fake()[0].clone(), fake()[1].clone()];
        assert_eq!(choose(&v, None, None).unwrap().0, "lo");
        assert!(choose(&[], None, None).is_err());
    }

    #[test]
    fn specs_on_this_host() {
        assert_eq!(
            select_interface(Some("lo"), None).unwrap(),
            ("lo".into(), ip("127.0.0.1"))
        );
        assert_eq!(select_interface(Some("=lo"), None).unwrap().0, "lo");
        assert!(select_interface(Some("=l"), None).is_err());
        match select_interface(Some("^lo"), None) {
            Ok((name, _)) => assert_ne!(name, "lo"),
            Err(e) => assert!(e.to_string().contains("candidates: lo (127.0.0.1)"), "{e}"),
        }
        let e = select_interface(Some("nosuch"), None).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        let s = e.to_string();
        assert!(
            s.contains("QCCL_SOCKET_IFNAME=nosuch matches no interface; candidates: "),
            "{s}"
        );
        assert!(s.contains("lo (127.0.0.1)"), "{s}");
        assert_eq!(
            select_interface(None, Some(ip("127.0.0.1"))).unwrap().1,
            ip("127.0.0.1")
        );
        assert!(select_interface(None, None).is_ok());
    }
}
