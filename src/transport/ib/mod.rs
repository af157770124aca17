//! RDMA links (InfiniBand, RoCE): the verbs contract (`verbs.rs`) and its two
//! implementations, the real device (`device/`, feature `rdma`) and an emulated fabric
//! (`emu/`, `QCCL_IB_EMULATE=1`).

// The link (in progress) uses it; until then nothing does.
#[allow(dead_code)]
pub mod verbs;

// The emulated fabric; the link (in progress) selects it with QCCL_IB_EMULATE=1.
#[allow(dead_code)]
pub mod emu;
