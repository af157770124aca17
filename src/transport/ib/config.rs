//! The RDMA link's settings, from NCCL's variables with a QCCL_ prefix: QCCL_NET, QCCL_IB_DISABLE,
//! QCCL_IB_HCA, QCCL_IB_GID_INDEX, QCCL_IB_TIMEOUT, QCCL_IB_RETRY_CNT, QCCL_IB_SL, QCCL_IB_TC
//! and QCCL_IB_EMULATE (the emulated fabric, `ib::emu`).

use super::verbs::{DeviceInfo, PathSettings};
use crate::error::{Error, Result};

/// Which network link carries traffic between ranks that do not share memory (QCCL_NET).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NetChoice {
    /// RDMA where both ranks have a usable device, sockets otherwise.
    #[default]
    Auto,
    /// RDMA; a rank without a usable device fails at init.
    Ib,
    /// TCP sockets only.
    Socket,
}

/// The RDMA settings of a comm.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IbConfig {
    /// QCCL_NET.
    pub net: NetChoice,
    /// QCCL_IB_DISABLE=1: never RDMA (QCCL_NET=IB then fails).
    pub disable: bool,
    /// QCCL_IB_HCA: which devices and ports may be used.
    pub hca: Option<HcaFilter>,
    /// QCCL_IB_GID_INDEX, QCCL_IB_TIMEOUT, QCCL_IB_RETRY_CNT, QCCL_IB_SL, QCCL_IB_TC.
    pub path: PathSettings,
    /// QCCL_IB_EMULATE=1: the emulated fabric instead of the devices.
    pub emulate: bool,
}

impl IbConfig {
    /// The settings from the environment (each variable found is logged at INFO).
    pub fn from_env() -> Result<IbConfig> {
        IbConfig::parse(|name| {
            let v = std::env::var(name).ok()?;
            crate::qlog!(Info, "{name} set by environment to {v}");
            Some(v)
        })
    }

    /// The settings from `get`, a variable lookup.
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<IbConfig> {
        let mut c = IbConfig::default();
        if let Some(v) = get("QCCL_NET") {
            c.net = match v.trim().to_ascii_lowercase().as_str() {
                "" => NetChoice::Auto,
                "ib" => NetChoice::Ib,
                "socket" => NetChoice::Socket,
                _ => {
                    return Err(Error::invalid(format!(
                        "QCCL_NET={v} is not one of IB, Socket"
                    )))
                }
            };
        }
        c.disable = flag(&get, "QCCL_IB_DISABLE")?;
        c.emulate = flag(&get, "QCCL_IB_EMULATE")?;
        if let Some(v) = get("QCCL_IB_HCA").filter(|v| !v.trim().is_empty()) {
            c.hca = Some(HcaFilter::parse(&v)?);
        }
        let p = &mut c.path;
        p.gid_index = number(&get, "QCCL_IB_GID_INDEX", 0, 255)?.unwrap_or(p.gid_index);
        p.timeout = number(&get, "QCCL_IB_TIMEOUT", 1, 31)?.unwrap_or(p.timeout);
        p.retry_cnt = number(&get, "QCCL_IB_RETRY_CNT", 0, 7)?.unwrap_or(p.retry_cnt);
        p.sl = number(&get, "QCCL_IB_SL", 0, 15)?.unwrap_or(p.sl);
        p.tc = number(&get, "QCCL_IB_TC", 0, 255)?.unwrap_or(p.tc);
        if c.disable && c.net == NetChoice::Ib {
            return Err(Error::invalid("QCCL_NET=IB contradicts QCCL_IB_DISABLE=1"));
        }
        Ok(c)
    }

    /// Whether this rank may use RDMA at all (before looking for a device).
    pub fn allowed(&self) -> bool {
        !self.disable && self.net != NetChoice::Socket
    }
}

/// A 0/1 variable.
fn flag(get: &impl Fn(&str) -> Option<String>, name: &str) -> Result<bool> {
    match get(name).as_deref().map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(Error::invalid(format!("{name}={v} is not 0 or 1"))),
    }
}

/// A number in `lo..=hi`.
fn number(get: &impl Fn(&str) -> Option<String>, name: &str, lo: u8, hi: u8) -> Result<Option<u8>> {
    let Some(v) = get(name) else { return Ok(None) };
    match v.trim().parse::<u32>() {
        Ok(n) if (lo as u32..=hi as u32).contains(&n) => Ok(Some(n as u8)),
        _ => Err(Error::invalid(format!(
            "{name}={v} is not a number in {lo}..={hi}"
        ))),
    }
}

/// QCCL_IB_HCA, NCCL_IB_HCA's syntax: a comma-separated list of `device[:port]`; a leading
/// `^` excludes the listed ones instead, a leading `=` (after any `^`) compares names exactly
/// instead of as prefixes ("mlx5" matches mlx5_0 and mlx5_1; "=mlx5_1" only mlx5_1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaFilter {
    /// `^`: the list names what not to use.
    pub exclude: bool,
    /// `=`: names match exactly.
    pub exact: bool,
    /// Device names (or prefixes) with an optional port.
    pub entries: Vec<(String, Option<u8>)>,
}

impl HcaFilter {
    /// Parses the variable's value.
    pub fn parse(spec: &str) -> Result<HcaFilter> {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let mut entries = Vec::new();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, port) = match item.split_once(':') {
                Some((n, p)) => {
                    let port = p
                        .trim()
                        .parse::<u8>()
                        .ok()
                        .filter(|&p| p > 0)
                        .ok_or_else(|| {
                            Error::invalid(format!(
                            "QCCL_IB_HCA={spec}: port \"{p}\" of {n} is not a number in 1..=255"
                        ))
                        })?;
                    (n.trim(), Some(port))
                }
                None => (item, None),
            };
            if name.is_empty() {
                return Err(Error::invalid(format!(
                    "QCCL_IB_HCA={spec}: an entry has no device name"
                )));
            }
            entries.push((name.to_string(), port));
        }
        if entries.is_empty() {
            return Err(Error::invalid(format!(
                "QCCL_IB_HCA={spec} names no device"
            )));
        }
        Ok(HcaFilter {
            exclude,
            exact,
            entries,
        })
    }

    /// Whether port `port` of device `name` may be used.
    pub fn allows(&self, name: &str, port: u8) -> bool {
        let listed = self.entries.iter().any(|(n, p)| {
            let name_ok = if self.exact {
                n == name
            } else {
                name.starts_with(n.as_str())
            };
            name_ok && p.is_none_or(|p| p == port)
        });
        listed != self.exclude
    }
}

/// The first active port that `filter` allows, as (device, port); else why there is none.
pub fn pick_port(
    devices: &[DeviceInfo],
    filter: Option<&HcaFilter>,
) -> std::result::Result<(String, u8), String> {
    if devices.is_empty() {
        return Err("no RDMA device found".into());
    }
    let mut seen = Vec::new();
    for d in devices {
        for p in &d.ports {
            let allowed = filter.is_none_or(|f| f.allows(&d.name, p.num));
            if allowed && p.active {
                return Ok((d.name.clone(), p.num));
            }
            let why = match (allowed, p.active) {
                (false, _) => "excluded by QCCL_IB_HCA",
                _ => "not active",
            };
            seen.push(format!("{}:{} {why}", d.name, p.num));
        }
    }
    Err(format!("no usable RDMA port ({})", seen.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::super::verbs::{LinkLayer, PortInfo};
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<IbConfig> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        IbConfig::parse(|n| m.get(n).cloned())
    }

    #[test]
    fn defaults_and_every_variable() {
        let d = parse(&[]).unwrap();
        assert_eq!(d, IbConfig::default());
        assert!(d.allowed());
        let c = parse(&[
            ("QCCL_NET", "IB"),
            ("QCCL_IB_EMULATE", "1"),
            ("QCCL_IB_HCA", "^=mlx5_0:1,mlx5_1"),
            ("QCCL_IB_GID_INDEX", "3"),
            ("QCCL_IB_TIMEOUT", "14"),
            ("QCCL_IB_RETRY_CNT", "5"),
            ("QCCL_IB_SL", "2"),
            ("QCCL_IB_TC", "106"),
        ])
        .unwrap();
        assert_eq!(c.net, NetChoice::Ib);
        assert!(c.emulate && !c.disable);
        let p = c.path;
        assert_eq!(
            (p.gid_index, p.timeout, p.retry_cnt, p.sl, p.tc, p.rnr_retry),
            (3, 14, 5, 2, 106, 7)
        );
        let h = c.hca.unwrap();
        assert!(h.exclude && h.exact);
        assert_eq!(
            h.entries,
            vec![("mlx5_0".into(), Some(1)), ("mlx5_1".into(), None)]
        );
        assert_eq!(
            parse(&[("QCCL_NET", "socket")]).unwrap().net,
            NetChoice::Socket
        );
        assert!(!parse(&[("QCCL_NET", "Socket")]).unwrap().allowed());
        assert!(!parse(&[("QCCL_IB_DISABLE", "1")]).unwrap().allowed());
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        let bad = |vars: &[(&str, &str)], needle: &str| {
            let e = parse(vars).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        };
        bad(
            &[("QCCL_NET", "rdma")],
            "QCCL_NET=rdma is not one of IB, Socket",
        );
        bad(
            &[("QCCL_IB_DISABLE", "yes")],
            "QCCL_IB_DISABLE=yes is not 0 or 1",
        );
        bad(&[("QCCL_IB_EMULATE", "2")], "QCCL_IB_EMULATE=2");
        bad(
            &[("QCCL_IB_TIMEOUT", "32")],
            "QCCL_IB_TIMEOUT=32 is not a number in 1..=31",
        );
        bad(&[("QCCL_IB_RETRY_CNT", "8")], "QCCL_IB_RETRY_CNT=8");
        bad(&[("QCCL_IB_SL", "-1")], "QCCL_IB_SL=-1");
        bad(&[("QCCL_IB_TC", "256")], "QCCL_IB_TC=256");
        bad(&[("QCCL_IB_GID_INDEX", "x")], "QCCL_IB_GID_INDEX=x");
        bad(&[("QCCL_IB_HCA", "mlx5_0:x")], "port \"x\" of mlx5_0");
        bad(&[("QCCL_IB_HCA", "mlx5_0:0")], "port \"0\"");
        bad(&[("QCCL_IB_HCA", "^")], "names no device");
        bad(&[("QCCL_IB_HCA", ":1")], "an entry has no device name");
        bad(
            &[("QCCL_NET", "IB"), ("QCCL_IB_DISABLE", "1")],
            "QCCL_NET=IB contradicts QCCL_IB_DISABLE=1",
        );
    }

    #[test]
    fn hca_filters_match_as_nccl_does() {
        let f = |s: &str| HcaFilter::parse(s).unwrap();
        // Prefix by default, any port unless given.
        assert!(f("mlx5").allows("mlx5_3", 2));
        assert!(f("mlx5_0:1,mlx5_1").allows("mlx5_0", 1));
        assert!(!f("mlx5_0:1,mlx5_1").allows("mlx5_0", 2));
        assert!(f("mlx5_0:1,mlx5_1").allows("mlx5_1", 2));
        assert!(!f("mlx5_0:1").allows("rxe0", 1));
        // Exact names.
        assert!(!f("=mlx5").allows("mlx5_0", 1));
        assert!(f("=mlx5_0").allows("mlx5_0", 1));
        // Exclusion.
        assert!(!f("^mlx5_0").allows("mlx5_0", 1));
        assert!(f("^mlx5_0").allows("rxe0", 1));
        assert!(f("^mlx5_0:1").allows("mlx5_0", 2));
        assert!(f("^=mlx5").allows("mlx5_0", 1));
    }

    #[test]
    fn the_first_allowed_active_port_is_picked_else_why_not() {
        let port = |num, active| PortInfo {
            num,
            active,
            link_layer: LinkLayer::Ethernet,
        };
        let devs = vec![
            DeviceInfo {
                name: "mlx5_0".into(),
                ports: vec![port(1, false), port(2, true)],
            },
            DeviceInfo {
                name: "rxe0".into(),
                ports: vec![port(1, true)],
            },
        ];
        assert_eq!(pick_port(&devs, None), Ok(("mlx5_0".into(), 2)));
        let only_rxe = HcaFilter::parse("rxe").unwrap();
        assert_eq!(pick_port(&devs, Some(&only_rxe)), Ok(("rxe0".into(), 1)));
        let port1 = HcaFilter::parse("mlx5_0:1").unwrap();
        assert_eq!(
            pick_port(&devs, Some(&port1)),
            Err(
                "no usable RDMA port (mlx5_0:1 not active, mlx5_0:2 excluded by QCCL_IB_HCA, \
                 rxe0:1 excluded by QCCL_IB_HCA)"
                    .into()
            )
        );
        assert_eq!(pick_port(&[], None), Err("no RDMA device found".into()));
    }
}
