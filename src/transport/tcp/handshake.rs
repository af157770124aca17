//! The first bytes on every peer connection: the job's secret, the comm id and who is calling.
//! A connection that fails the check is dropped before any frame is read from it.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::TcpStream;

const HELLO_MAGIC: u32 = 0x5143_4853; // "QCHS"
const ACK_MAGIC: u32 = 0x5143_4f4b; // "QCOK"
/// Bytes of a hello.
pub const HELLO_LEN: usize = 40;

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
    fn encode(&self) -> [u8; HELLO_LEN] {
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
    if u32::from_le_bytes(ack[0..4].try_into().unwrap()) != ACK_MAGIC {
        return Err(Error::InvalidUsage(
            "peer answered the connection hello with garbage".into(),
        ));
    }
    Ok(())
}

/// Acceptor side: reads a hello and checks it. Returns the caller's rank and socket index,
/// or why it was refused (the connection is then dropped without an answer).
pub fn accept(
    stream: &mut TcpStream,
    secret: &[u8; 16],
    comm_id: u64,
    size: usize,
) -> std::result::Result<(usize, usize), String> {
    let mut b = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut b)
        .map_err(|e| format!("no complete hello: {e}"))?;
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
    let mut ack = [0u8; 8];
    ack[0..4].copy_from_slice(&ACK_MAGIC.to_le_bytes());
    stream
        .write_all(&ack)
        .map_err(|e| format!("sending ack: {e}"))?;
    Ok((rank, sock))
}
