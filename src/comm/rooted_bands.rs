//! Broadcast and reduce on device buffers staged in bands (`bands.rs`): the chain
//! (`algo::chain`) runs in slices (`Ctx::nslices`) on any links, one host's arena included,
//! so a piece is one of its slices, started once this rank's input of it landed and done
//! once passed on. The page-locked copy is one buffer of the call's: this rank's input
//! comes in (none on a broadcast's other ranks), the result goes out (a broadcast's other
//! ranks and its root out of place, a reduce's root; off the root a reduce only reads).
//! The entries for calls that return once done (`rooted_in_bands_at`, queued:
//! `submit_rooted_in_bands`) say where a call does not take the path, so that the caller
//! stages it whole; on a stream `Comm::enqueue_coll_dense_at` takes it.

use super::bands::{Bands, Schedule};
use super::Comm;
use crate::algo::chunk_slices;
use crate::coll::call::{Coll, CollCall};
use crate::error::Result;
use crate::gpu::staging::CallBuf;
use std::ffi::c_void;

impl Comm {
    /// The broadcast or reduce `call` on `send` and `recv` (the root's own: a broadcast's
    /// `send` and a reduce's `recv` are read and written only on the root; `send` None: in
    /// place) over the chain cut in bands of its slices, when it has at least one element
    /// on a comm of more than one rank that may band, this rank's buffers all device
    /// memory; None otherwise. Any links, one host's too: the chain's exchanges take a
    /// call slice by slice everywhere. The page-locked copy is one buffer of the call's:
    /// this rank's input comes in (none on a broadcast's other ranks), the result goes out
    /// (the broadcast's other ranks, the root out of place; the reduce's root).
    pub(super) fn rooted_bands_of(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        let (n, coll) = (self.size, call.coll);
        if call.count == 0 || n < 2 || !self.may_band() {
            return Ok(None);
        }
        let root = call.rank_arg();
        let (es, len) = (call.dtype.size(), call.count * call.dtype.size());
        let is_root = self.rank == root;
        let (input, output) = match coll {
            Coll::Broadcast if is_root => (Some(send.unwrap_or(recv)), send.map(|_| recv)),
            Coll::Broadcast => (None, Some(recv)),
            _ => (Some(send.unwrap_or(recv)), is_root.then_some(recv)),
        };
        let mut bufs: Vec<CallBuf> = input
            .map(|addr| CallBuf {
                addr,
                len,
                reads: true,
                writes: output == Some(addr),
            })
            .into_iter()
            .collect();
        if let Some(addr) = output.filter(|&o| Some(o) != input) {
            bufs.push(CallBuf {
                addr,
                len,
                reads: false,
                writes: true,
            });
        }
        let pieces = chunk_slices(call.count, 1, es, self.config.slice_bytes());
        let ends = |_: usize, at: usize| {
            let at = at as u64;
            (input.map(|d| d + at), output.map(|d| d + at))
        };
        let shape = (call.count, call.dtype, call.op);
        self.cut_in_bands(
            Schedule::Coll(coll, root),
            shape,
            pieces,
            (len, bufs),
            &ends,
        )
    }

    /// The broadcast or reduce `call` (checked here) on `send` and `recv` (a broadcast's
    /// `send` and a reduce's `recv` are the root's only; `send` None: in place) staged in
    /// bands of the chain's slices when it takes that path (`rooted_bands_of`: device
    /// buffers on a comm that may band), ordered on the caller's `stream` (null: the legacy
    /// default stream) and returning once the result is on the device: true. False,
    /// nothing done, otherwise (the caller stages it as any other call).
    ///
    /// # Safety
    /// The buffers this rank uses must be valid for the call's bytes, and touched by
    /// nothing else, until this returns; `stream` null or a live stream of their device.
    #[doc(hidden)]
    pub unsafe fn rooted_in_bands_at(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        let Some(plan) = self.checked_rooted(call, send, recv)? else {
            return Ok(false);
        };
        // SAFETY: the caller's promise, passed on.
        unsafe { self.run_bands_waiting(plan, stream) }.map(|_| true)
    }

    /// As [`Comm::rooted_in_bands_at`] with the legacy default stream, but queued behind
    /// the comm's earlier operations and returning at once (`qcclIBroadcast`,
    /// `qcclIReduce`): the request, which ends once the result is on the device; None,
    /// nothing done, where the call does not take that path.
    ///
    /// # Safety
    /// As [`Comm::rooted_in_bands_at`], until the request has ended.
    #[doc(hidden)]
    pub unsafe fn submit_rooted_in_bands(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<crate::Request<()>>> {
        let Some(plan) = self.checked_rooted(call, send, recv)? else {
            return Ok(None);
        };
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit_bands(plan) }.map(Some)
    }

    /// `call` checked, cut in bands when it is a broadcast or reduce that takes that path.
    fn checked_rooted(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<Option<Bands>> {
        self.check(call)?;
        if !matches!(call.coll, Coll::Broadcast | Coll::Reduce) {
            return Ok(None);
        }
        self.rooted_bands_of(call, send, recv)
    }
}
