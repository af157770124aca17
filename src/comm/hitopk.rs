//! HiTopKComm (Shi et al., "hierarchical top-k communication", Algorithm 2) as a built-in
//! collective, with the paper's baselines behind the same call:
//!
//! 1. intra-host reduce-scatter (shared memory): rank j of a host owns 1/n of the sum;
//! 2. MSTopK (Algorithm 1) on the owned slice with k = ρ·d/n, after adding the slice's
//!    error-feedback residual (what earlier calls did not send);
//! 3. all-gather of the (index, value) pairs among the ranks with the same local rank, one per
//!    host (the network), and scatter-add of all of them, host by host, into a zeroed slice;
//! 4. intra-host all-gather of the slices.
//!
//! Only step 3 crosses hosts, with ρ·d/n pairs per rank. Every rank ends bit-identical: the
//! slices are summed in host order on every member of an inter-host group, and copied within
//! a host. Baselines: `NaiveAg` (every rank's own top-k at density ρ all-gathered over the
//! whole comm and scatter-added), `TreeAr` (dense tree all-reduce), `TwoDTar` (dense
//! hierarchical all-reduce).

use super::hier::Hier;
use super::{Comm, Compression};
use crate::algo::Algo;
use crate::algo::{part, Wire};
use crate::codec::ef::TensorKey;
use crate::codec::mstopk::mstopk_select;
use crate::codec::sparse::{check_len, k_of};
use crate::codec::{CodecSpec, Site};
use crate::coll::call::{Coll, CollCall};
use crate::error::{Error, Result};
use crate::tuning::Flat;
use crate::types::{DType, Element, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// HiTopKComm or one of the paper's baselines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TopKScheme {
    /// Hierarchical top-k (Algorithm 2).
    HiTopK,
    /// Flat all-gather of every rank's top-k (MSTopK at density ρ over the whole tensor).
    NaiveAg,
    /// Dense binary-tree all-reduce.
    TreeAr,
    /// Dense two-level all-reduce (intra reduce-scatter, inter all-reduce, intra all-gather).
    TwoDTar,
}

impl TopKScheme {
    /// Parses `hitopk`, `naiveag`, `treear`, `2dtar` (case-insensitive).
    pub fn parse(s: &str) -> Result<TopKScheme> {
        match s.trim().to_ascii_lowercase().as_str() {
            "hitopk" => Ok(TopKScheme::HiTopK),
            "naiveag" | "naive_ag" => Ok(TopKScheme::NaiveAg),
            "treear" | "tree_ar" | "tree" => Ok(TopKScheme::TreeAr),
            "2dtar" | "hier" => Ok(TopKScheme::TwoDTar),
            other => Err(Error::invalid(format!(
                "unknown top-k scheme '{other}' (valid: hitopk, naiveag, treear, 2dtar)"
            ))),
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            TopKScheme::HiTopK => "hitopk",
            TopKScheme::NaiveAg => "naiveag",
            TopKScheme::TreeAr => "treear",
            TopKScheme::TwoDTar => "2dtar",
        }
    }
}

/// Options of a top-k all-reduce.
#[derive(Debug, Clone)]
pub struct TopK {
    /// Fraction ρ of the elements sent, in (0, 1].
    pub density: f64,
    /// Names the tensor across calls (its error-feedback residual); needed with error feedback.
    pub key: Option<TensorKey>,
    /// Keep what the top-k step did not send and add it next call (default on).
    pub error_feedback: bool,
    /// MSTopK's number of threshold searches (Algorithm 1's N, default 30).
    pub samplings: u32,
    /// Return the indices this rank selected (tests, debugging).
    pub record_indices: bool,
}

impl TopK {
    /// Density ρ, error feedback on, 30 samplings.
    pub fn new(density: f64) -> TopK {
        TopK {
            density,
            key: None,
            error_feedback: true,
            samplings: 30,
            record_indices: false,
        }
    }

    /// Sets the tensor key.
    pub fn key(mut self, key: impl Into<TensorKey>) -> TopK {
        self.key = Some(key.into());
        self
    }

    /// Switches error feedback.
    pub fn error_feedback(mut self, on: bool) -> TopK {
        self.error_feedback = on;
        self
    }
}

/// What a top-k all-reduce did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopKReport {
    /// The scheme that ran.
    pub scheme: TopKScheme,
    /// Payload bytes this rank sent and received.
    pub wire: Wire,
    /// HiTopKComm's steps (the paper's Figure 8): intra-host reduce-scatter, MSTopK, inter-host
    /// all-gather with scatter-add, intra-host all-gather. Zero for the baselines.
    pub steps: [Duration; 4],
    /// Of step 3, the scatter-add alone.
    pub scatter_add: Duration,
    /// Elements this rank selected (k), 0 for the dense baselines.
    pub k: usize,
    /// With `record_indices`: the selected indices, relative to this rank's owned slice
    /// (`algo::part(count, local_size, local_rank)`) for HiTopK, to the tensor for NaiveAg.
    pub indices: Option<Vec<u32>>,
}

impl Comm {
    /// HiTopKComm all-reduce (sum) of `buf` in place at density ρ, error feedback keyed by
    /// `key` (see [`Comm::topk_all_reduce`]).
    pub fn hitopk_all_reduce<T: Element>(
        &self,
        buf: &mut [T],
        density: f64,
        key: impl Into<TensorKey>,
    ) -> Result<TopKReport> {
        self.topk_all_reduce(buf, TopKScheme::HiTopK, &TopK::new(density).key(key))
    }

    /// Sparse (or, for the dense baselines, plain) all-reduce (sum) of `buf` in place with
    /// `scheme`. Float types (f16/bf16/f64 through f32).
    pub fn topk_all_reduce<T: Element>(
        &self,
        buf: &mut [T],
        scheme: TopKScheme,
        o: &TopK,
    ) -> Result<TopKReport> {
        let count = buf.len();
        let call = self.prepare_topk(count, T::DTYPE, scheme, o)?;
        self.queue.run_declared(call.coded_calls(), |e| {
            call.run(e, bytemuck::cast_slice_mut(buf))
        })
    }

    /// Starts [`Comm::topk_all_reduce`]; the request returns the buffer and the report.
    pub fn topk_all_reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        scheme: TopKScheme,
        o: &TopK,
    ) -> Result<crate::Request<(Vec<T>, TopKReport)>> {
        let call = self.prepare_topk(buf.len(), T::DTYPE, scheme, o)?;
        self.queue
            .submit_holding((), Some(call.coded_calls()), move |e, _| {
                let r = call.run(e, bytemuck::cast_slice_mut(&mut buf))?;
                Ok((buf, r))
            })
    }

    #[doc(hidden)]
    /// Checks a top-k all-reduce and resolves what it needs before any byte moves (the C ABI
    /// runs the result on the engine).
    pub fn prepare_topk(
        &self,
        count: usize,
        dtype: DType,
        scheme: TopKScheme,
        o: &TopK,
    ) -> Result<PreparedTopK> {
        const C: &str = "topk_all_reduce";
        // An all-reduce first (sizes); then what top-k adds.
        self.check(&CollCall::new(Coll::AllReduce, count, dtype))?;
        if !dtype.is_float() {
            return Err(Error::invalid(format!(
                "{C}: top-k compresses floating-point data, not {dtype}"
            )));
        }
        if !(o.density > 0.0 && o.density <= 1.0) {
            return Err(Error::invalid(format!(
                "{C}: density {} is outside (0, 1]",
                o.density
            )));
        }
        if !(1..=1000).contains(&o.samplings) {
            return Err(Error::invalid(format!(
                "{C}: samplings {} is outside 1..=1000",
                o.samplings
            )));
        }
        let sparse = matches!(scheme, TopKScheme::HiTopK | TopKScheme::NaiveAg);
        if sparse && o.error_feedback && o.key.is_none() {
            return Err(Error::invalid(format!(
                "{C}: error feedback needs a tensor key with the call"
            )));
        }
        check_len(count)?;
        let kind = match scheme {
            TopKScheme::HiTopK => Kind::HiTopK(self.hierarchy_for(C)?),
            TopKScheme::NaiveAg => {
                let spec = format!(
                    "mstopk:density={},samplings={},ef={}",
                    o.density, o.samplings, o.error_feedback as u8
                );
                let mut c = Compression::new(CodecSpec::parse(&spec)?).algo(Algo::AllGather);
                c.key = o.key.clone();
                Kind::Coded(self.prepare_all_reduce_compressed(count, dtype, ReduceOp::Sum, &c)?)
            }
            TopKScheme::TreeAr => Kind::Tree,
            TopKScheme::TwoDTar => Kind::TwoLevel(self.hierarchy_for(C)?),
        };
        Ok(PreparedTopK {
            kind,
            scheme,
            opts: o.clone(),
            count,
            dtype,
            seed: self.config.seed,
            rank: self.rank,
        })
    }

    /// The two-level split, which needs the same number of ranks on every host (one host, or
    /// one rank per host, are fine).
    fn hierarchy_for(&self, what: &str) -> Result<Arc<Hier>> {
        let uniform = self
            .topo
            .ranks_of_node
            .iter()
            .all(|r| r.len() == self.topo.local_size);
        if !uniform {
            return Err(Error::Unsupported(format!(
                "{what}: the hierarchical schemes need the same number of ranks on every host; \
                 hosts have {:?}",
                self.topo
                    .ranks_of_node
                    .iter()
                    .map(Vec::len)
                    .collect::<Vec<_>>()
            )));
        }
        self.hierarchy()
    }
}

enum Kind {
    HiTopK(Arc<Hier>),
    Coded(super::PreparedAllReduce),
    /// TreeAR: the dense all-reduce on the binary tree.
    Tree,
    /// 2DTAR: the dense hierarchical all-reduce.
    TwoLevel(Arc<Hier>),
}

/// A HiTopKComm call as the device path runs it.
pub(super) struct TopKOnDevice<'a> {
    pub(super) hier: &'a Arc<Hier>,
    pub(super) opts: &'a TopK,
    pub(super) count: usize,
    pub(super) dtype: DType,
    pub(super) seed: u64,
    pub(super) rank: usize,
}

/// The key of a HiTopK call's selection (step `step`) on this rank's owned slice starting at
/// element `at`: the host's and the device's alike.
pub(super) fn selection_key(seed: u64, step: u64, at: usize, rank: usize) -> u64 {
    Site {
        seed,
        step,
        chunk: at as u64,
        rank: rank as u64,
    }
    .key()
}

/// A checked top-k all-reduce, ready to run on its comm's engine.
pub struct PreparedTopK {
    kind: Kind,
    scheme: TopKScheme,
    opts: TopK,
    count: usize,
    dtype: DType,
    seed: u64,
    rank: usize,
}

impl PreparedTopK {
    /// How many compressed calls `run` makes (declared by a call queued on a stream:
    /// `Comm::on_stream`): one for HiTopK (none on no elements) and the compressed schemes,
    /// none for the dense ones.
    #[doc(hidden)]
    pub fn coded_calls(&self) -> u64 {
        match self.kind {
            Kind::HiTopK(_) => u64::from(self.count > 0),
            Kind::Coded(_) => 1,
            Kind::Tree | Kind::TwoLevel(_) => 0,
        }
    }

    /// The compressed all-reduce a naive all-gather call (`NaiveAg`: MSTopK over the whole
    /// tensor, the all-gather scheme) is, and the k its report names; the call itself for
    /// the other schemes. On device buffers the core's entry for compressed all-reduces
    /// (`Comm::all_reduce_compressed_at`) then runs MSTopK on the GPU instead of staging it.
    #[doc(hidden)]
    pub fn into_compressed(
        self: Box<Self>,
    ) -> std::result::Result<(super::PreparedAllReduce, usize), Box<PreparedTopK>> {
        let call = *self;
        match call.kind {
            Kind::Coded(c) => Ok((c, k_of(call.opts.density, call.count))),
            kind => Err(Box::new(PreparedTopK { kind, ..call })),
        }
    }

    /// The call as the device path runs it (`gpu_topk.rs`), when it is HiTopKComm; None
    /// otherwise.
    pub(super) fn on_device(&self) -> Option<TopKOnDevice<'_>> {
        match &self.kind {
            Kind::HiTopK(hier) => Some(TopKOnDevice {
                hier,
                opts: &self.opts,
                count: self.count,
                dtype: self.dtype,
                seed: self.seed,
                rank: self.rank,
            }),
            _ => None,
        }
    }

    /// Runs the call on `e` (the engine of the comm that prepared it, inside its turn) over
    /// `buf`, `count` elements of the prepared dtype, in place.
    pub fn run(&self, e: &mut crate::coll::Engine, buf: &mut [u8]) -> Result<TopKReport> {
        let mut report = TopKReport {
            scheme: self.scheme,
            wire: Wire::default(),
            steps: [Duration::ZERO; 4],
            scatter_add: Duration::ZERO,
            k: 0,
            indices: None,
        };
        if buf.len() != self.count * self.dtype.size() {
            return Err(Error::invalid(format!(
                "topk_all_reduce: a buffer of {} bytes for a call prepared for {} elements of {}",
                buf.len(),
                self.count,
                self.dtype
            )));
        }
        match &self.kind {
            Kind::TwoLevel(h) => {
                report.wire = h.all_reduce_dense(buf, self.count, self.dtype)?;
            }
            Kind::Tree => {
                let w0 = e.wire;
                let (count, dtype) = (self.count, self.dtype);
                e.all_reduce(None, buf, count, dtype, ReduceOp::Sum, Flat::Tree)?;
                report.wire = e.wire - w0;
            }
            Kind::Coded(call) => {
                let r = call.run(e, None, buf)?;
                report.wire = r.wire;
                report.k = k_of(self.opts.density, self.count);
            }
            Kind::HiTopK(h) => {
                super::compress::with_f32(None, buf, self.dtype, |_, work| {
                    h.aborting(self.hitopk(e, h, work, &mut report))
                })?;
            }
        }
        Ok(report)
    }

    /// Algorithm 2 on an f32 buffer.
    fn hitopk(
        &self,
        e: &mut crate::coll::Engine,
        h: &Hier,
        work: &mut [f32],
        report: &mut TopKReport,
    ) -> Result<()> {
        let count = work.len();
        if count == 0 {
            return Ok(());
        }
        let (local, me) = h.intra_shape();
        let mine = part(count, local, me, 1);
        let step = e.coded_calls;
        e.coded_calls += 1;
        // 1. Intra-host reduce-scatter.
        let t = Instant::now();
        report.wire += h.intra_reduce_scatter(work)?;
        report.steps[0] = t.elapsed();
        // 2. MSTopK on the owned slice, compensated by its residual.
        let t = Instant::now();
        let slice = &mut work[mine.clone()];
        let k = k_of(self.opts.density, slice.len());
        let key = self.opts.key.as_ref().filter(|_| self.opts.error_feedback);
        if let Some(k) = key {
            // A key used on device buffers before starts again from zero on the host.
            e.gpu.forget_later(k);
        }
        let mut residual = match key {
            Some(k) => Some(std::mem::take(e.residuals.get(k, slice.len()))),
            None => None,
        };
        if let Some(r) = residual.as_deref_mut() {
            crate::codec::ef::compensate(slice, r);
        }
        let site_key = selection_key(self.seed, step, mine.start, self.rank);
        let mut idx = Vec::with_capacity(k);
        mstopk_select(slice, k, self.opts.samplings, site_key, &mut idx);
        let mut pairs = vec![0u8; 8 * idx.len()];
        let (ib, vb) = pairs.split_at_mut(4 * idx.len());
        for ((&i, ic), vc) in idx
            .iter()
            .zip(ib.chunks_exact_mut(4))
            .zip(vb.chunks_exact_mut(4))
        {
            ic.copy_from_slice(&i.to_le_bytes());
            vc.copy_from_slice(&slice[i as usize].to_le_bytes());
        }
        if let Some(r) = residual.as_deref_mut() {
            // What was not sent stays for the next call.
            r.copy_from_slice(slice);
            for &i in &idx {
                r[i as usize] = 0.0;
            }
        }
        if let (Some(k), Some(r)) = (key, residual) {
            e.residuals.put(k, r);
        }
        report.k = idx.len();
        report.steps[1] = t.elapsed();
        // 3. All-gather of the pairs among the ranks with this local rank; scatter-add in
        //    host order.
        let t = Instant::now();
        let (all, wire) = h.inter_all_gather(&pairs)?;
        report.wire += wire;
        let t_add = Instant::now();
        slice.fill(0.0);
        if !pairs.is_empty() {
            for block in all.chunks_exact(pairs.len()) {
                crate::codec::sparse::decode(block, slice, true)?;
            }
        }
        report.scatter_add = t_add.elapsed();
        report.steps[2] = t.elapsed();
        // 4. Intra-host all-gather.
        let t = Instant::now();
        report.wire += h.intra_all_gather(work)?;
        report.steps[3] = t.elapsed();
        if self.opts.record_indices {
            report.indices = Some(idx);
        }
        Ok(())
    }
}
