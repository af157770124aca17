//! RDMA links (InfiniBand, RoCE): the verbs contract (`verbs.rs`) and its two
//! implementations, the real device (`device/`, feature `rdma`) and an emulated fabric
//! (`emu/`, `QCCL_IB_EMULATE=1`).

// The link (in progress) uses it; until then nothing does.
#[allow(dead_code)]
pub mod verbs;

// The real device: libibverbs through the `ibverbs` crate's raw bindings (ibverbs-sys).
#[cfg(feature = "rdma")]
pub mod device;
