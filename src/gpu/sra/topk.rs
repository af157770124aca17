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
use crate::gpu::plans::{plan_for, CodecPlan, Convert};
use crate::types::DType;
use std::sync::Arc;
use std::time::Duration;

/// HiTopKComm's MSTopK at one density on one device, its kernels loaded.
pub struct DeviceTopK {
    pub(super) driver: Arc<dyn Driver>,
    pub(super) ordinal: usize,
    pub(super) plan: Box<dyn CodecPlan>,
    /// The tensor whose residual the selection keeps (error feedback), if any.
    pub(super) key: Option<TensorKey>,
    pub(super) timeout: Duration,
    /// The call's buffers to and from f32 (None: float32), as the host's `with_f32`.
    convert: Option<Convert>,
}

impl DeviceTopK {
    /// MSTopK at `density` with `samplings` threshold searches on device `ordinal`, for
    /// buffers of float type `dtype`; `Unsupported` when its kernels cannot be loaded.
    pub fn new(
        driver: Arc<dyn Driver>,
        (ordinal, dtype): (usize, DType),
        (density, samplings): (f64, u32),
        key: Option<TensorKey>,
        timeout: Duration,
    ) -> Result<DeviceTopK> {
        let spec = CodecSpec::parse(&format!("mstopk:density={density},samplings={samplings}"))?;
        let plan = plan_for(&*driver, ordinal, &**spec.codec())?;
        DeviceState::functions(&*driver, ordinal)?;
        let convert = Convert::new(&*driver, ordinal, dtype)?;
        Ok(DeviceTopK {
            driver,
            ordinal,
            plan,
            key,
            timeout,
            convert,
        })
    }

    /// The call's f32 work buffer of `count` elements, its input in it: `recv` (`send`, out
    /// of place, copied in), or for another float type the lane's f32 copy of the input
    /// (which stays the call's until it ends: it runs alone in its comm's turn). Returns
    /// once done.
    pub fn widen(&self, lane: &GpuLane, send: Option<u64>, recv: u64, count: usize) -> Result<u64> {
        let input = send.unwrap_or(recv);
        let mut work = recv;
        self.on_state(lane, |st| {
            let Some(convert) = &self.convert else {
                return st.compensate(input, None, recv, count);
            };
            let sizes = Sizes {
                slot: 0,
                payload: 0,
                scratch: 0,
                work: 4 * count,
            };
            st.reserve(&*self.driver, &sizes, 1, &lane.moved, self.timeout)?;
            work = super::state::addr(&st.work);
            // SAFETY: the call's `count` input elements (valid until it returns: the
            // caller's promise) into the f32 copy `reserve` sized.
            unsafe { convert.run(&*st.stream, true, input, work, count) }
        })?;
        Ok(work)
    }

    /// Converts the f32 `work` buffer back into `recv` for another float type (nothing for
    /// float32); returns once done.
    pub fn narrow(&self, lane: &GpuLane, work: u64, recv: u64, count: usize) -> Result<()> {
        let Some(convert) = &self.convert else {
            return Ok(());
        };
        // SAFETY: `work`'s `count` f32s into the call's buffer (valid until it returns).
        self.on_state(lane, |st| unsafe {
            convert.run(&*st.stream, false, work, recv, count)
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
        self.on_state(lane, |st| {
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
        self.on_state(lane, |st| {
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

    /// Runs `f` on `lane`'s device state, then waits for its stream.
    fn on_state(
        &self,
        lane: &GpuLane,
        f: impl FnOnce(&mut DeviceState) -> Result<()>,
    ) -> Result<()> {
        lane.on_state((&*self.driver, self.ordinal), self.timeout, f)
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
