//! The 128-byte unique id handed to every rank (like `ncclUniqueId`).

use super::ifaddr::select_interface;
use super::root::spawn_root;
use super::PROTOCOL_VERSION;
use crate::config::Config;
use crate::error::{Error, Result};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::time::Duration;

/// Size of a unique id in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

const MAGIC: [u8; 4] = *b"QCID";
const OFF_VERSION: usize = 4;
const OFF_SECRET: usize = 8;
const OFF_FAMILY: usize = 24;
const OFF_PORT: usize = 25;
const OFF_IP: usize = 27;

/// Identifies one world: the root's address and a random secret the ranks must present.
///
/// Byte layout (128 bytes, the size of `ncclUniqueId`):
///
/// | offset | size | field                                                        |
/// |--------|------|--------------------------------------------------------------|
/// | 0      | 4    | magic `b"QCID"`                                              |
/// | 4      | 4    | protocol version, u32 little-endian (`PROTOCOL_VERSION`)   |
/// | 8      | 16   | random secret                                                |
/// | 24     | 1    | address family of the root: 4 or 6                           |
/// | 25     | 2    | root port, u16 big-endian                                    |
/// | 27     | 16   | root IP (IPv4 in the first 4 bytes, the rest zero)           |
/// | 43     | 85   | zero padding                                                 |
///
/// `Debug` shows the version and root address but never the secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Creates an id and hosts its root in this process (like `ncclGetUniqueId`).
    ///
    /// Chooses the interface with `select_interface` honouring QCCL_SOCKET_IFNAME, listens on
    /// a free port there and starts the root thread, whose deadline is QCCL_INIT_TIMEOUT_MS
    /// (default: QCCL_TIMEOUT_MS, 300000 ms) from now.
    pub fn new() -> Result<UniqueId> {
        let cfg = Config::from_env()?;
        UniqueId::new_with(cfg.socket_ifname.as_deref(), cfg.init_timeout)
    }

    /// [`UniqueId::new`] with an explicit interface spec (QCCL_SOCKET_IFNAME syntax, `None` for
    /// the default choice) and root deadline.
    pub fn new_with(ifname: Option<&str>, deadline: Duration) -> Result<UniqueId> {
        let (name, ip) = select_interface(ifname, None)?;
        crate::qlog!(Info, "bootstrap: root on interface {name} ({ip})");
        UniqueId::new_at(ip, deadline)
    }

    /// Creates an id whose root listens on `ip` (port chosen by the system) and runs in this
    /// process until all ranks joined or `deadline` passed.
    pub fn new_at(ip: IpAddr, deadline: Duration) -> Result<UniqueId> {
        let listener = TcpListener::bind((ip, 0))
            .map_err(|e| Error::io(format!("bootstrap root: bind to {ip} port 0"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io(format!("bootstrap root: local_addr of {ip}"), e))?;
        let secret: [u8; 16] = rand::random();
        spawn_root(listener, secret, deadline)?;
        Ok(UniqueId::with_root(addr, secret))
    }

    /// An id for a root at `addr` with `secret`, without starting a server (the root runs
    /// elsewhere, e.g. on rank 0 after environment detection).
    pub fn with_root(addr: SocketAddr, secret: [u8; 16]) -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..4].copy_from_slice(&MAGIC);
        b[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[OFF_SECRET..OFF_SECRET + 16].copy_from_slice(&secret);
        match addr.ip() {
            IpAddr::V4(v4) => {
                b[OFF_FAMILY] = 4;
                b[OFF_IP..OFF_IP + 4].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[OFF_FAMILY] = 6;
                b[OFF_IP..OFF_IP + 16].copy_from_slice(&v6.octets());
            }
        }
        b[OFF_PORT..OFF_PORT + 2].copy_from_slice(&addr.port().to_be_bytes());
        UniqueId(b)
    }

    /// Parses an id received from another process. Checks the length (128), the magic and the
    /// address family; an unknown protocol version is accepted here and reported by the
    /// rendezvous, where both sides' versions are known.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let b: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::invalid(format!(
                "a unique id is {UNIQUE_ID_BYTES} bytes, got {}",
                bytes.len()
            ))
        })?;
        if b[..4] != MAGIC {
            return Err(Error::invalid(format!(
                "not a qccl unique id: magic is {:02x?}, expected {MAGIC:02x?} (\"QCID\")",
                &b[..4]
            )));
        }
        if b[OFF_FAMILY] != 4 && b[OFF_FAMILY] != 6 {
            return Err(Error::invalid(format!(
                "unique id has address family byte {}, expected 4 or 6",
                b[OFF_FAMILY]
            )));
        }
        Ok(UniqueId(b))
    }

    /// The 128 bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// Address of the root server.
    pub fn root_addr(&self) -> SocketAddr {
        let b = &self.0;
        let port = u16::from_be_bytes([b[OFF_PORT], b[OFF_PORT + 1]]);
        let ip = if b[OFF_FAMILY] == 6 {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[OFF_IP..OFF_IP + 16]);
            IpAddr::V6(Ipv6Addr::from(o))
        } else {
            IpAddr::V4(Ipv4Addr::new(
                b[OFF_IP],
                b[OFF_IP + 1],
                b[OFF_IP + 2],
                b[OFF_IP + 3],
            ))
        };
        SocketAddr::new(ip, port)
    }

    /// The secret every rank presents to the root.
    pub fn secret(&self) -> [u8; 16] {
        let mut s = [0u8; 16];
        s.copy_from_slice(&self.0[OFF_SECRET..OFF_SECRET + 16]);
        s
    }

    /// Protocol version of the library that made the id.
    pub fn version(&self) -> u32 {
        let b = &self.0;
        u32::from_le_bytes([
            b[OFF_VERSION],
            b[OFF_VERSION + 1],
            b[OFF_VERSION + 2],
            b[OFF_VERSION + 3],
        ])
    }

    /// The same id stamped with another protocol version (tests of version mismatches).
    #[cfg(test)]
    pub(crate) fn with_version(mut self, version: u32) -> UniqueId {
        self.0[OFF_VERSION..OFF_VERSION + 4].copy_from_slice(&version.to_le_bytes());
        self
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("version", &self.version())
            .field("root", &self.root_addr())
            .field("secret", &format_args!("<hidden>"))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_roundtrip() {
        let addr: SocketAddr = "192.0.2.7:29500".parse().unwrap();
        let secret = [0xab; 16];
        let id = UniqueId::with_root(addr, secret);
        let b = id.as_bytes();
        assert_eq!(&b[..4], b"QCID");
        assert_eq!(&b[4..8], &PROTOCOL_VERSION.to_le_bytes());
        assert_eq!(&b[8..24], &secret);
        assert_eq!(b[24], 4);
        assert_eq!(&b[25..27], &29500u16.to_be_bytes());
        assert_eq!(&b[27..31], &[192, 0, 2, 7]);
        assert!(b[31..].iter().all(|&x| x == 0));
        let back = UniqueId::from_bytes(b).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.root_addr(), addr);
        assert_eq!(back.secret(), secret);
        assert_eq!(back.version(), PROTOCOL_VERSION);

        let v6: SocketAddr = "[fd00::2]:1234".parse().unwrap();
        let id6 = UniqueId::with_root(v6, secret);
        assert_eq!(id6.as_bytes()[24], 6);
        assert_eq!(
            UniqueId::from_bytes(id6.as_bytes()).unwrap().root_addr(),
            v6
        );
    }

    #[test]
    fn from_bytes_checks_length_and_magic_but_not_version() {
        let id = UniqueId::with_root("127.0.0.1:1".parse().unwrap(), [1; 16]);
        let e = UniqueId::from_bytes(&id.as_bytes()[..127]).unwrap_err();
        assert!(e.to_string().contains("128 bytes, got 127"), "{e}");
        let mut b = *id.as_bytes();
        b[0] = b'X';
        let e = UniqueId::from_bytes(&b).unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        let mut b = *id.as_bytes();
        b[24] = 5;
        assert!(UniqueId::from_bytes(&b).is_err());
        let v9 = UniqueId::from_bytes(id.with_version(9).as_bytes()).unwrap();
        assert_eq!(v9.version(), 9);
    }

    #[test]
    fn debug_hides_the_secret() {
        let secret = [0x5a; 16];
        let id = UniqueId::with_root("10.1.2.3:4567".parse().unwrap(), secret);
        let s = format!("{id:?}");
        assert!(s.contains("10.1.2.3:4567"), "{s}");
        assert!(s.contains("<hidden>"), "{s}");
        assert!(!s.contains("90") && !s.contains("5a"), "{s}");
    }
}
