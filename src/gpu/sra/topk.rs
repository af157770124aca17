//! HiTopKComm's device steps (`comm/gpu_topk.rs` runs the call): MSTopK on this rank's
//! owned slice with error feedback fused (the `mstopk` codec's launch plan, whose payload is
//! HiTopK's pairs: k u32 indices, then k f32 values, the selection keyed as the host's), the
//! pairs copied to the host for the inter-host all-gather, and the scatter-add of every
//! host's pairs, in host order, into the zeroed slice. Only the pairs cross PCIe. Runs on the
//! comm's device side (`GpuLane`: its stream, scratch and residuals), each step returning
//! once done.

use super::state::{lock, DeviceState, GpuLane, Sizes};
use crate::codec::ef::TensorKey;
use crate::codec::CodecSpec;
use crate::error::{Error, Result};
use crate::gpu::driver::Driver;
use crate::gpu::plans::{plan_for, CodecPlan};
use std::sync::Arc;
use std::time::Duration;

/// HiTopKComm's MSTopK at one density on one device, its kernels loaded.
pub struct DeviceTopK {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    plan: Box<dyn CodecPlan>,
    /// The tensor whose residual the selection keeps (error feedback), if any.
    key: Option<TensorKey>,
    timeout: Duration,
}

impl DeviceTopK {
    /// MSTopK at `density` with `samplings` threshold searches on device `ordinal`;
    /// `Unsupported` when its kernels cannot be loaded.
    pub fn new(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        (density, samplings): (f64, u32),
        key: Option<TensorKey>,
        timeout: Duration,
    ) -> Result<DeviceTopK> {
        let spec = CodecSpec::parse(&format!("mstopk:density={density},samplings={samplings}"))?;
        let plan = plan_for(&*driver, ordinal, &**spec.codec())?;
        DeviceState::functions(&*driver, ordinal)?;
        Ok(DeviceTopK {
            driver,
            ordinal,
            plan,
            key,
            timeout,
        })
    }

    /// Copies `count` f32s from `src` to `dst` on `lane` (an out-of-place call's input into
    /// its buffer); returns once done.
    pub fn copy(&self, lane: &GpuLane, src: u64, dst: u64, count: usize) -> Result<()> {
        lane.on_state((&*self.driver, self.ordinal), self.timeout, |st| {
            st.compensate(src, None, dst, count)
        })
    }

    /// Selects the top k of the `count` f32s at `slice` (device memory), after adding the
    /// tensor's residual, and returns the pairs (the payload) on the host; the residual
    /// keeps what was not selected. `site_key`: the host's `Site::key` for the slice.
    pub fn select(
        &self,
        lane: &GpuLane,
        slice: u64,
        count: usize,
        site_key: u64,
    ) -> Result<Vec<u8>> {
        let len = self.plan.payload_len(count);
        let mut pairs = vec![0u8; len];
        if count == 0 {
            return Ok(pairs);
        }
        lane.on_state((&*self.driver, self.ordinal), self.timeout, |st| {
            let wait = (&*lane.moved, self.timeout);
            let res = st.residual(
                &*self.driver,
                self.key.as_ref(),
                count,
                lane.take_forgotten(),
                wait,
            )?;
            self.reserve(st, lane, len, count)?;
            let (payload, scratch) = (
                super::state::addr(&st.payload),
                super::state::addr(&st.scratch),
            );
            let s = &*st.stream;
            // SAFETY: `slice` holds `count` f32s of the call's buffer (valid until the call
            // returns, after the synchronize `on_state` makes), the residual `count` f32s,
            // `payload` and `scratch` the room `reserve` made; `pairs` lives past the
            // synchronize.
            unsafe {
                match res {
                    Some(r) => self
                        .plan
                        .encode_ef(s, slice, r, 0, payload, count, site_key, scratch)?,
                    None => self
                        .plan
                        .encode(s, slice, payload, count, site_key, scratch)?,
                }
                s.copy_to_host(pairs.as_mut_ptr(), payload, len)?;
            }
            Ok(())
        })?;
        lane.add_bytes(len as u64, 0);
        Ok(pairs)
    }

    /// Zeroes the `count` f32s at `slice` and adds every block of `all` (the pairs of each
    /// host, `all.len() / block` of them) in order; an error when a block fails the codec's
    /// checks (an index out of range or not increasing).
    pub fn scatter_add(&self, lane: &GpuLane, slice: u64, count: usize, all: &[u8]) -> Result<()> {
        let block = self.plan.payload_len(count);
        if count == 0 {
            return Ok(());
        }
        if block == 0 || !all.len().is_multiple_of(block) {
            return Err(Error::Internal(format!(
                "HiTopK: {} gathered bytes are not whole blocks of {block}",
                all.len()
            )));
        }
        lane.on_state((&*self.driver, self.ordinal), self.timeout, |st| {
            self.reserve(st, lane, block, count)?;
            st.zero(slice, count)?;
            let (payload, scratch) = (
                super::state::addr(&st.payload),
                super::state::addr(&st.scratch),
            );
            let bad = st.words.bad_ptr() as u64;
            let s = &*st.stream;
            for b in all.chunks_exact(block) {
                // SAFETY: `b` (pageable host memory, alive past the synchronize) holds one
                // payload; `payload`, `scratch` the room `reserve` made, reused block after
                // block in the stream's order; `slice` as in `select`; `bad` the lane's
                // page-locked word.
                unsafe {
                    s.copy_to_device(payload, b.as_ptr(), block)?;
                    self.plan
                        .decode(s, payload, slice, count, true, bad, scratch)?;
                }
            }
            Ok(())
        })?;
        lane.add_bytes(0, all.len() as u64);
        if lock(&lane.state).as_ref().is_some_and(|st| st.words.bad()) {
            return Err(Error::invalid(
                "HiTopK on device buffers: a gathered block of pairs failed its checks on the \
                 device",
            ));
        }
        Ok(())
    }

    /// Grows the lane's payload and scratch for a payload of `len` bytes over `count`
    /// elements.
    fn reserve(
        &self,
        st: &mut DeviceState,
        lane: &GpuLane,
        len: usize,
        count: usize,
    ) -> Result<()> {
        let sizes = Sizes {
            slot: 0,
            payload: len,
            scratch: self.plan.scratch_len(count),
            work: 0,
        };
        st.reserve(&*self.driver, &sizes, 1, &lane.moved, self.timeout)
    }
}
