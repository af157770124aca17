//! The first bytes on every peer connection: the job's secret, the comm id and who is calling.
//! A connection that fails the check is dropped before any frame is read from it.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::TcpStream;

const HELLO_MAGIC: u32 = 0x5143_4853; // "QCHS"
const ACK_MAGIC: u32 = 0x5143_4f4b; // "QCOK"
/// The answer of a rank whose comm failed: it takes no new connection.
const NAK_MAGIC: u32 = 0x5143_4e4f; // "QCNO"
/// Bytes of a hello.
pub const HELLO_LEN: usize = 40;
/// The socket index of a hello that asks the stall inspector for the rank's status
/// (`transport::stall`) instead of opening a peer connection.
pub const PROBE_SOCK: u32 = u32::MAX;

/// What a connecting rank says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The job's secret, from the unique id.
    pub secret: [u8; 16],
    /// The comm's id, from the rendezvous.
    pub comm_id: u64,
    /// The connecting rank.
    pub rank: u32,
    /// Which of the peer pair's sockets this is.
    pub sock: u32,
}

impl Hello {
    /// The hello's bytes on the wire.
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&crate::bootstrap::PROTOCOL_VERSION.to_le_bytes());
        b[8..24].copy_from_slice(&self.secret);
        b[24..32].copy_from_slice(&self.comm_id.to_le_bytes());
        b[32..36].copy_from_slice(&self.rank.to_le_bytes());
        b[36..40].copy_from_slice(&self.sock.to_le_bytes());
        b
    }
}

/// True when `head` (a connection's first 4 bytes) starts a hello.
pub fn is_hello(head: &[u8; 4]) -> bool {
    u32::from_le_bytes(*head) == HELLO_MAGIC
}

/// Connector side: sends the hello and waits for the acknowledgement.
pub fn connect(stream: &mut TcpStream, hello: &Hello) -> Result<()> {
    stream
        .write_all(&hello.encode())
        .map_err(|e| Error::io("sending connection hello", e))?;
    let mut ack = [0u8; 8];
    stream.read_exact(&mut ack).map_err(|e| {
        Error::io(
            "waiting for the peer to accept the connection (wrong secret or comm id?)",
            e,
        )
    })?;
    match u32::from_le_bytes(ack[0..4].try_into().unwrap()) {
        ACK_MAGIC => Ok(()),
        NAK_MAGIC => Err(Error::Aborted(
            "the peer's comm has failed: it takes no new connection".into(),
        )),
        _ => Err(Error::InvalidUsage(
            "peer answered the connection hello with garbage".into(),
        )),
    }
}

/// Acceptor side, once the `HELLO_LEN` bytes of a hello arrived (the accept thread reads them
/// without blocking, never more): the caller's rank and socket index ([`PROBE_SOCK`] for a
/// probe), or why it is refused (the connection is then dropped without an answer).
pub fn verify(
    hello: &[u8; HELLO_LEN],
    secret: &[u8; 16],
    comm_id: u64,
    size: usize,
) -> std::result::Result<(usize, u32), String> {
    let (rank, sock) = check(hello, secret, comm_id, size)?;
    Ok((rank, sock as u32))
}

/// Answers a verified hello: accepted, or refused because this rank's comm failed. The
/// stream may be non-blocking: the 8 bytes are the first written to it, so they fit the
/// socket buffer, and a short write counts as a failure.
pub fn answer(stream: &mut TcpStream, accept: bool) -> std::result::Result<(), String> {
    let mut ack = [0u8; 8];
    let magic = if accept { ACK_MAGIC } else { NAK_MAGIC };
    ack[0..4].copy_from_slice(&magic.to_le_bytes());
    match stream.write(&ack) {
        Ok(8) => Ok(()),
        Ok(n) => Err(format!("sending the answer: only {n} of 8 bytes fit")),
        Err(e) => Err(format!("sending the answer: {e}")),
    }
}

/// Decodes and checks a hello: the caller's rank and socket index, or why it is refused.
fn check(
    b: &[u8; HELLO_LEN],
    secret: &[u8; 16],
    comm_id: u64,
    size: usize,
) -> std::result::Result<(usize, usize), String> {
    if u32::from_le_bytes(b[0..4].try_into().unwrap()) != HELLO_MAGIC {
        return Err("not a qccl hello".into());
    }
    let version = u32::from_le_bytes(b[4..8].try_into().unwrap());
    if version != crate::bootstrap::PROTOCOL_VERSION {
        return Err(format!("protocol version {version}"));
    }
    if &b[8..24] != secret {
        return Err("wrong secret".into());
    }
    let their_comm = u64::from_le_bytes(b[24..32].try_into().unwrap());
    if their_comm != comm_id {
        return Err(format!("comm id {their_comm:#x} is not this comm's"));
    }
    let rank = u32::from_le_bytes(b[32..36].try_into().unwrap()) as usize;
    let sock = u32::from_le_bytes(b[36..40].try_into().unwrap()) as usize;
    if rank >= size {
        return Err(format!("rank {rank} out of range"));
    }
    Ok((rank, sock))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> impl Strategy<Value = Hello> {
        (any::<[u8; 16]>(), any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(secret, comm_id, rank, sock)| Hello {
                secret,
                comm_id,
                rank,
                sock,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// Random bytes: refused, or accepted only with our magic, version, secret and comm
        /// id and a rank in range.
        #[test]
        fn random_hellos_never_panic(
            b in any::<[u8; HELLO_LEN]>(),
            secret in any::<[u8; 16]>(),
            comm_id in any::<u64>(),
            size in 0usize..1 << 20,
            pick in any::<u32>(),
        ) {
            let (r, asked) =
                crate::test_alloc::requested(|| check(&b, &secret, comm_id, size));
            prop_assert!(asked <= 1024, "{asked} bytes requested");
            if let Ok((rank, _)) = r {
                prop_assert!(rank < size);
                prop_assert_eq!(&b[8..24], &secret[..]);
            }
            // The same bytes with a valid head, then with our secret and comm id too, so the
            // later checks run: the rank decides.
            let mut b = b;
            b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
            b[4..8].copy_from_slice(&crate::bootstrap::PROTOCOL_VERSION.to_le_bytes());
            prop_assert!(check(&b, &secret, comm_id, size).is_err());
            b[8..24].copy_from_slice(&secret);
            b[24..32].copy_from_slice(&comm_id.to_le_bytes());
            // A rank in range about half the time.
            b[32..36].copy_from_slice(&(pick % (2 * size as u32 + 1)).to_le_bytes());
            let rank = u32::from_le_bytes(b[32..36].try_into().unwrap()) as usize;
            let sock = u32::from_le_bytes(b[36..40].try_into().unwrap()) as usize;
            let r = check(&b, &secret, comm_id, size);
            prop_assert_eq!(r.is_ok(), rank < size);
            if let Ok(got) = r {
                prop_assert_eq!(got, (rank, sock));
            }
        }

        /// A valid hello round-trips; changing any byte of magic, version, secret or comm id
        /// refuses it, and a changed rank is accepted only in range.
        #[test]
        fn hellos_round_trip_and_mutations_are_refused(
            h in hello(),
            extra in 0usize..1000,
            at in 0..HELLO_LEN,
            flip in 1..=255u8,
        ) {
            let size = h.rank as usize + 1 + extra;
            let b = h.encode();
            prop_assert_eq!(
                check(&b, &h.secret, h.comm_id, size),
                Ok((h.rank as usize, h.sock as usize))
            );
            prop_assert!(check(&b, &h.secret, h.comm_id, h.rank as usize).is_err());
            let mut m = b;
            m[at] ^= flip;
            let r = check(&m, &h.secret, h.comm_id, size);
            match at {
                0..32 => prop_assert!(r.is_err(), "byte {} changed: {:?}", at, r),
                32..36 => {
                    let rank = u32::from_le_bytes(m[32..36].try_into().unwrap()) as usize;
                    prop_assert_eq!(r.is_ok(), rank < size);
                }
                _ => prop_assert_eq!(r.map(|(_, s)| s as u32).ok(), Some(u32::from_le_bytes(m[36..40].try_into().unwrap()))),
            }
        }
    }
}
