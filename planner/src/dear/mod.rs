//! DeAR's planning pieces: tensor fusion by a byte threshold ([`crate::fusion::buffer`]) and
//! the Bayesian optimiser that tunes that threshold at run time ([`bayes`]).
//!
//! # DeAR with qccl
//!
//! DeAR (Zhang et al., "Decoupled all-reduce") splits each all-reduce into its two halves
//! and overlaps each with computation: the reduce-scatter of a fused group starts during
//! backpropagation as soon as the group is complete (BackPipe), and the all-gather runs
//! during the next forward pass, waited for just before the first layer of the group needs
//! its parameters (FeedPipe). With qccl, per iteration and on every rank:
//!
//! 1. Backward: push each gradient into a [`FusionBuffer`](crate::fusion::buffer::FusionBuffer) as it becomes ready
//!    (last layer first). Each emitted range is packed into one flat buffer, padded to a
//!    multiple of the rank count (`reduce_scatter` needs that), and handed to
//!    `Comm::reduce_scatter_async(buf, ReduceOp::Avg)`; keep the `Request`.
//!    `flush()` at the end of backward emits the last group.
//! 2. Step: wait for all reduce-scatter requests (DeAR synchronises OP₁ before OP₂); each
//!    rank now holds its averaged shard of every group and may run the optimiser on it.
//! 3. Forward: start `Comm::all_gather_async(shard)` for the groups in forward order (the
//!    reverse of backprop order — the queue runs them in submission order, so the group the
//!    first layers need goes first) and wait for each group's request right before the first
//!    layer in it runs, then unpack the gathered buffer into the tensors.
//!
//! Because every rank pushes the same sizes with the same threshold, all ranks form the same
//! groups and issue the same collectives in the same order, with no negotiation — DeAR's
//! point. The same grouping serves WFBP-style fused all-reduce: hand each group to
//! `Comm::all_reduce_compressed_async` (with a per-group `TensorKey` when error feedback or a
//! layout is used) instead of splitting it.
//!
//! The threshold comes from [`bayes::BayesTuner`]: measure the throughput over a few
//! iterations with the current threshold, `observe` it, and take the next `suggest`ion
//! (rank 0 should tune and broadcast the value, or every rank must observe identical numbers,
//! so the groups stay identical everywhere). Change the threshold only between iterations.
//!
//! ```
//! use qccl_planner::{dear::bayes::BayesTuner, fusion::buffer::fuse};
//!
//! const MB: f64 = 1024.0 * 1024.0;
//! let sizes = [4 << 20, 64 << 10, 16 << 20, 1 << 10, 30 << 20]; // bytes, backprop order
//! let mut tuner = BayesTuner::new(1.0 * MB, 100.0 * MB, 42);
//! for _ in 0..8 {
//!     let threshold = tuner.suggest();
//!     let groups = fuse(&sizes, threshold as usize);
//!     // ... train a few steps with these groups, measure samples per second ...
//!     let throughput = 1000.0 / (groups.len() as f64 + threshold / (8.0 * MB));
//!     tuner.observe(threshold, throughput);
//! }
//! let (best, _) = tuner.best().unwrap();
//! assert!((1.0 * MB..=100.0 * MB).contains(&best));
//! ```

pub mod bayes;
