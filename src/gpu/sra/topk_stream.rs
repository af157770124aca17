//! The device side of HiTopKComm on float32 device buffers made on a caller's stream
//! (`comm/gpu_topk_stream.rs` runs the host side in the comm's turn). As a hierarchical
//! call on a stream (`pieces.rs`), every device operation is enqueued when the call is
//! made and tied to the host's steps by the lane's `summed` word, two values a call:
//! - the lane's stream: the input copied into the receive buffer (out of place), then
//!   (the caller's `stage`) the whole buffer's copy to a page-locked copy; a wait for value
//!   1 (the worker's intra-host reduce-scatter is done), this rank's owned slice copied in,
//!   MSTopK with error feedback fused (the `mstopk` plan, keyed as the host's), the pairs
//!   copied after the page-locked buffer, event 0; a wait for value 2 (every host's pairs
//!   gathered after them), the slice zeroed and each host's pairs added in host order,
//!   the slice copied back, event 1;
//! - the caller's stream: the buffer's copy out once the worker's intra-host all-gather is
//!   done (the staging word).
//!
//! The page-locked copy is the call's f32s, then this rank's pairs, then every host's.

use super::pieces::PieceBoard;
use super::state::{GpuLane, Sizes};
use super::DeviceTopK;
use crate::error::Result;
use crate::gpu::driver::Stream;
use std::ops::Range;
use std::sync::Arc;

/// A HiTopK call on a stream as the device runs it: its buffers and elements, this rank's
/// owned slice, the selection's site key and the hosts whose pairs are gathered.
pub(crate) struct TopKShape {
    pub(crate) send: Option<u64>,
    pub(crate) recv: u64,
    pub(crate) count: usize,
    pub(crate) mine: Range<usize>,
    pub(crate) site_key: u64,
    pub(crate) hosts: usize,
}

impl DeviceTopK {
    /// Bytes of one rank's pairs for an owned slice of `count` elements.
    pub(crate) fn pairs_len(&self, count: usize) -> usize {
        self.plan.payload_len(count)
    }

    /// Enqueues HiTopK `shape` on float32 behind the work on `caller` (see the module):
    /// room first (before anything holds the caller's stream), then `stage` (given the
    /// lane's stream) starts the one band of the page-locked copy (copies in behind the
    /// input's copy, out on the caller's stream) and returns it with the copy's address;
    /// `hand` gives it and the call's board to the worker (it gives them back when the
    /// comm failed). An error after `hand` fails the board.
    pub(crate) fn enqueue_stream<B>(
        &self,
        lane: &GpuLane,
        caller: &dyn Stream,
        shape: &TopKShape,
        stage: impl FnOnce(&dyn Stream) -> Result<(B, *mut u8)>,
        hand: impl FnOnce(B, Arc<PieceBoard>) -> std::result::Result<(), B>,
    ) -> Result<()> {
        let mut guard = lane.locked((&*self.driver, self.ordinal))?;
        let st = guard.as_mut().expect("made by locked");
        let n = shape.mine.len();
        let len = self.pairs_len(n);
        let wait = (&*lane.moved, self.timeout);
        let forgotten = lane.take_forgotten();
        // An empty owned slice selects nothing and keeps no residual (as `select`).
        let key = self.key.as_ref().filter(|_| n > 0);
        let res = st.residual(&*self.driver, key, n, forgotten, wait)?;
        let sizes = Sizes {
            slot: 0,
            payload: len,
            scratch: self.plan.scratch_len(n),
            work: 0,
        };
        st.reserve(&*self.driver, &sizes, 1, &lane.moved, self.timeout)?;
        st.stream.wait_event(&*caller.record()?)?;
        let (send, recv, count) = (shape.send, shape.recv, shape.count);
        st.compensate(send.unwrap_or(recv), None, recv, count)?;
        let (band, pinned) = stage(&*st.stream)?;
        let base = st.summed_seq;
        let board = PieceBoard::handed(st, 2, band, hand, "HiTopK on device buffers")?;
        let enqueued = (|| -> Result<()> {
            let (payload, scratch) = (
                super::state::addr(&st.payload),
                super::state::addr(&st.scratch),
            );
            let (at, bytes) = (4 * shape.mine.start, 4 * n);
            let slice = recv + at as u64;
            let summed = st.words.summed_ptr();
            let mine = 4 * count;
            let all = mine + len;
            let s = &*st.stream;
            // SAFETY (all the block): `summed` is the lane's page-locked word; the slice
            // lies in the call's receive buffer (valid until the stream passed the call:
            // the caller's promise); the page-locked copy holds the call's f32s, this
            // rank's pairs and `shape.hosts` blocks of pairs after them, the call's until
            // its band ends (after event 1: the worker waits for it first); `payload`,
            // `scratch` and the residual the room made above, used in the stream's order.
            unsafe {
                s.wait_word(summed, base.wrapping_add(1))?;
                if n > 0 {
                    s.copy_to_device(slice, pinned.add(at), bytes)?;
                    match res {
                        Some(r) => self.plan.encode_ef(
                            s,
                            slice,
                            r,
                            0,
                            payload,
                            n,
                            shape.site_key,
                            scratch,
                        )?,
                        None => self
                            .plan
                            .encode(s, slice, payload, n, shape.site_key, scratch)?,
                    }
                    s.copy_to_host(pinned.add(mine), payload, len)?;
                }
                board.post_event(0, st.mark()?);
                s.wait_word(summed, base.wrapping_add(2))?;
                if n > 0 {
                    st.zero(slice, n)?;
                    let bad = st.words.bad_ptr() as u64;
                    for h in 0..shape.hosts {
                        s.copy_to_device(payload, pinned.add(all + h * len), len)?;
                        self.plan.decode(s, payload, slice, n, true, bad, scratch)?;
                    }
                    s.copy_to_host(pinned.add(at), slice, bytes)?;
                }
                board.post_event(1, st.mark()?);
            }
            lane.add_bytes(len as u64, (shape.hosts * len) as u64);
            Ok(())
        })();
        board.end_enqueue(st, enqueued)
    }
}
