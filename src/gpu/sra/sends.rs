//! The bytes an exchange sends, handed to the progress engine as each peer's encode completes
//! on the GPU (its event), rather than after the whole stream: the transport moves the first
//! peer's bytes while the stream still encodes the next's.

use crate::error::{Error, Result};
use crate::gpu::driver::Event;
use crate::transport::SendSource;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

type Slot<'a> = (Option<&'a dyn Event>, *const u8, usize);

/// Where each peer's send slot is and the event after the encode that fills it.
pub(super) struct EncodedSends<'a> {
    /// By peer: the event (None: nothing was encoded, the bytes are ready), the first byte
    /// and the length.
    slots: Vec<Option<Slot<'a>>>,
    /// Peers whose bytes were not written yet when first asked.
    waited: Vec<bool>,
    /// The word a failed device decode sets.
    bad: *const i32,
    timeout: Duration,
    deadline: Instant,
}

impl<'a> EncodedSends<'a> {
    /// The sends of one exchange over `n` ranks: `(peer, event, slot, len)` for each peer;
    /// the bytes must all be written within `timeout` of now.
    pub(super) fn new(
        n: usize,
        timeout: Duration,
        bad: *const i32,
        bytes: impl IntoIterator<Item = (usize, Option<&'a dyn Event>, *const u8, usize)>,
    ) -> EncodedSends<'a> {
        let mut slots = vec![None; n];
        for (p, e, at, len) in bytes {
            slots[p] = Some((e, at, len));
        }
        let now = Instant::now();
        EncodedSends {
            slots,
            waited: vec![false; n],
            bad,
            timeout,
            deadline: now
                .checked_add(timeout)
                .unwrap_or(now + Duration::from_secs(86_400)),
        }
    }

    /// Sends that started after their exchange did, once their encode completed.
    pub(super) fn late(&self) -> u64 {
        self.waited.iter().filter(|&&w| w).count() as u64
    }

    fn slot(&self, peer: usize) -> Result<Slot<'a>> {
        self.slots
            .get(peer)
            .copied()
            .flatten()
            .ok_or_else(|| Error::Internal(format!("no encoded bytes for rank {peer}")))
    }
}

impl<'a> SendSource<'a> for EncodedSends<'a> {
    fn ready(&mut self, peer: usize) -> Result<Option<&'a [u8]>> {
        let (event, at, len) = self.slot(peer)?;
        if let Some(e) = event {
            if !e.query()? {
                if Instant::now() >= self.deadline {
                    return Err(Error::Timeout(format!(
                        "compressed all-reduce on device buffers: the bytes encoded for rank \
                         {peer} were not written after {:?}",
                        self.timeout
                    )));
                }
                self.waited[peer] = true;
                return Ok(None);
            }
        }
        // SAFETY: page-locked, aligned and alive for the call; the device writes it (a
        // failed decode) and the host only reads it, atomically.
        if unsafe { AtomicI32::from_ptr(self.bad.cast_mut()) }.load(Ordering::Acquire) != 0 {
            return Err(Error::invalid(
                "compressed all-reduce on device buffers: a received chunk failed its codec's \
                 checks on the device",
            ));
        }
        if len == 0 {
            return Ok(Some(&[]));
        }
        // SAFETY: `len` bytes of a send slot of the call's page-locked wire, alive while the
        // exchange runs; the encode's event completed, so no copy writes them any more, and
        // nothing else does until the exchange returns. Or, forwarded (no event), a receive
        // slot the previous exchange filled: the next receive into its set is the exchange
        // after this one.
        Ok(Some(unsafe { std::slice::from_raw_parts(at, len) }))
    }

    fn wait(&mut self, peer: usize, d: Duration) {
        if let Ok((Some(e), _, _)) = self.slot(peer) {
            let left = self.deadline.saturating_duration_since(Instant::now());
            // A wait that ends early is asked again; its error comes from `ready`.
            let _ = e.synchronize(d.min(left));
        }
    }
}
