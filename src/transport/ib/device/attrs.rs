//! Pure translations between the verbs contract and libibverbs' numbers: completion statuses
//! and opcodes, the immediate's byte order, and the `ibv_modify_qp` attributes of each state
//! change (NCCL's values). No device calls, so all of it is tested on any machine.

use crate::error::{Error, Result};
use crate::transport::ib::verbs::{Endpoint, LinkLayer, PathSettings, QpState, WcOpcode, WcStatus};
use ffi::ibv_qp_attr_mask as Mask;
use ibverbs_sys as ffi;

/// Minimum RNR NAK timer the responder advertises (12: 0.64 ms, as NCCL).
pub(super) const MIN_RNR_TIMER: u8 = 12;
/// Outstanding RDMA reads/atomics as initiator and responder (NCCL: 1; the link only writes).
pub(super) const MAX_RD_ATOMIC: u8 = 1;
/// Hop limit of the global route header on RoCE (NCCL: 255).
pub(super) const HOP_LIMIT: u8 = 255;
/// Packet sequence numbers are 24 bits.
pub(super) const PSN_MASK: u32 = 0x00ff_ffff;

/// `ibv_wc_status` to the contract's status.
pub(super) fn wc_status(status: u32) -> WcStatus {
    use ffi::ibv_wc_status as s;
    match status {
        s::IBV_WC_SUCCESS => WcStatus::Success,
        s::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLength,
        s::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
        s::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlush,
        s::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        s::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperation,
        s::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        s::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        other => WcStatus::Other(other),
    }
}

/// `ibv_wc_opcode` to the contract's opcode; error completions do not carry a valid opcode.
pub(super) fn wc_opcode(status: WcStatus, opcode: u32) -> WcOpcode {
    use ffi::ibv_wc_opcode as o;
    match (status, opcode) {
        (WcStatus::Success, o::IBV_WC_RDMA_WRITE) => WcOpcode::Write,
        (WcStatus::Success, o::IBV_WC_RECV_RDMA_WITH_IMM) => WcOpcode::RecvWriteImm,
        _ => WcOpcode::Unknown,
    }
}

/// The immediate as `ibv_send_wr.imm_data` wants it: network byte order (`__be32`).
pub(super) fn imm_to_wire(imm: u32) -> u32 {
    imm.to_be()
}

/// The immediate a receive completion carries (network byte order) as the sender's value.
pub(super) fn imm_from_wire(wire: u32) -> u32 {
    u32::from_be(wire)
}

/// `ibv_qp_state` to the contract's state. SQD (draining) still sends: RTS; SQE (send queue
/// error) and anything unknown: Error.
pub(super) fn qp_state(state: u32) -> QpState {
    use ffi::ibv_qp_state as q;
    match state {
        q::IBV_QPS_RESET => QpState::Reset,
        q::IBV_QPS_INIT => QpState::Init,
        q::IBV_QPS_RTR => QpState::Rtr,
        q::IBV_QPS_RTS | q::IBV_QPS_SQD => QpState::Rts,
        _ => QpState::Error,
    }
}

/// `ibv_port_attr.link_layer` to the contract's; UNSPECIFIED is InfiniBand (old drivers).
pub(super) fn link_layer(raw: u8) -> LinkLayer {
    if u32::from(raw) == ffi::IBV_LINK_LAYER_ETHERNET {
        LinkLayer::Ethernet
    } else {
        LinkLayer::InfiniBand
    }
}

/// Bytes of an `ibv_mtu` value (for logs and checks): 256 << (mtu - 1).
pub(super) fn mtu_bytes(mtu: ffi::ibv_mtu) -> Option<u32> {
    (ffi::IBV_MTU_256..=ffi::IBV_MTU_4096)
        .contains(&mtu)
        .then(|| 256 << (mtu - 1))
}

/// What the attributes need from the local port.
#[derive(Debug, Clone, Copy)]
pub(super) struct PortParams {
    pub num: u8,
    pub link_layer: LinkLayer,
    /// The port's active MTU (`ibv_port_attr.active_mtu`): the path MTU, as NCCL uses.
    pub active_mtu: ffi::ibv_mtu,
}

/// Reset -> Init: port, pkey 0, local and remote writes allowed.
pub(super) fn init_attr(port: &PortParams) -> (ffi::ibv_qp_attr, Mask) {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: port.num,
        qp_access_flags: (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0,
        ..Default::default()
    };
    let mask = Mask::IBV_QP_STATE
        | Mask::IBV_QP_PKEY_INDEX
        | Mask::IBV_QP_PORT
        | Mask::IBV_QP_ACCESS_FLAGS;
    (attr, mask)
}

/// The settings' ranges as verbs takes them; an error names the QCCL_IB_* variable.
pub(super) fn check_path(path: &PathSettings) -> Result<()> {
    let checks = [
        ("QCCL_IB_TIMEOUT", path.timeout, 31),
        ("QCCL_IB_RETRY_CNT", path.retry_cnt, 7),
        ("rnr_retry", path.rnr_retry, 7),
        ("QCCL_IB_SL", path.sl, 15),
    ];
    for (name, v, max) in checks {
        if v > max {
            return Err(Error::invalid(format!(
                "{name}={v} is out of range for verbs (0..={max})"
            )));
        }
    }
    Ok(())
}

/// Init -> RTR, connected to `remote`: path MTU from the port, RNR timer, one outstanding
/// read, and the address vector: GID-routed (global route header, GID index, traffic class)
/// on RoCE, LID-routed on InfiniBand.
pub(super) fn rtr_attr(
    port: &PortParams,
    remote: &Endpoint,
    path: &PathSettings,
) -> Result<(ffi::ibv_qp_attr, Mask)> {
    check_path(path)?;
    if mtu_bytes(port.active_mtu).is_none() {
        return Err(Error::System(format!(
            "port {} reports active MTU {} that verbs does not define",
            port.num, port.active_mtu
        )));
    }
    let mut ah = ffi::ibv_ah_attr {
        sl: path.sl,
        src_path_bits: 0,
        port_num: port.num,
        ..Default::default()
    };
    match port.link_layer {
        LinkLayer::Ethernet => {
            ah.is_global = 1;
            ah.grh.dgid.raw = remote.gid;
            ah.grh.flow_label = 0;
            ah.grh.sgid_index = path.gid_index;
            ah.grh.hop_limit = HOP_LIMIT;
            ah.grh.traffic_class = path.tc;
        }
        LinkLayer::InfiniBand => {
            ah.is_global = 0;
            ah.dlid = remote.lid;
        }
    }
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
        path_mtu: port.active_mtu,
        dest_qp_num: remote.qpn,
        rq_psn: remote.psn & PSN_MASK,
        max_dest_rd_atomic: MAX_RD_ATOMIC,
        min_rnr_timer: MIN_RNR_TIMER,
        ah_attr: ah,
        ..Default::default()
    };
    let mask = Mask::IBV_QP_STATE
        | Mask::IBV_QP_AV
        | Mask::IBV_QP_PATH_MTU
        | Mask::IBV_QP_DEST_QPN
        | Mask::IBV_QP_RQ_PSN
        | Mask::IBV_QP_MAX_DEST_RD_ATOMIC
        | Mask::IBV_QP_MIN_RNR_TIMER;
    Ok((attr, mask))
}

/// RTR -> RTS: ACK timeout, transport and RNR retries, first PSN, one outstanding read.
pub(super) fn rts_attr(psn: u32, path: &PathSettings) -> Result<(ffi::ibv_qp_attr, Mask)> {
    check_path(path)?;
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
        timeout: path.timeout,
        retry_cnt: path.retry_cnt,
        rnr_retry: path.rnr_retry,
        sq_psn: psn & PSN_MASK,
        max_rd_atomic: MAX_RD_ATOMIC,
        ..Default::default()
    };
    let mask = Mask::IBV_QP_STATE
        | Mask::IBV_QP_TIMEOUT
        | Mask::IBV_QP_RETRY_CNT
        | Mask::IBV_QP_RNR_RETRY
        | Mask::IBV_QP_SQ_PSN
        | Mask::IBV_QP_MAX_QP_RD_ATOMIC;
    Ok((attr, mask))
}

/// Any state -> Error.
pub(super) fn error_attr() -> (ffi::ibv_qp_attr, Mask) {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
        ..Default::default()
    };
    (attr, Mask::IBV_QP_STATE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(link_layer: LinkLayer) -> PortParams {
        PortParams {
            num: 1,
            link_layer,
            active_mtu: ffi::IBV_MTU_4096,
        }
    }

    fn remote() -> Endpoint {
        Endpoint {
            lid: 0x12,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            qpn: 0x1234,
            psn: 0x0abc_def0,
        }
    }

    #[test]
    fn every_status_the_link_tells_apart_maps_to_its_own_variant() {
        use ffi::ibv_wc_status as s;
        let cases = [
            (s::IBV_WC_SUCCESS, WcStatus::Success),
            (s::IBV_WC_LOC_LEN_ERR, WcStatus::LocalLength),
            (s::IBV_WC_LOC_PROT_ERR, WcStatus::LocalProtection),
            (s::IBV_WC_WR_FLUSH_ERR, WcStatus::WrFlush),
            (s::IBV_WC_REM_ACCESS_ERR, WcStatus::RemoteAccess),
            (s::IBV_WC_REM_OP_ERR, WcStatus::RemoteOperation),
            (s::IBV_WC_RETRY_EXC_ERR, WcStatus::RetryExceeded),
            (s::IBV_WC_RNR_RETRY_EXC_ERR, WcStatus::RnrRetryExceeded),
            (s::IBV_WC_FATAL_ERR, WcStatus::Other(19)),
            (s::IBV_WC_GENERAL_ERR, WcStatus::Other(21)),
        ];
        for (raw, want) in cases {
            assert_eq!(wc_status(raw), want, "ibv_wc_status {raw}");
        }
        // The verbs numbers the contract's doc names (ibv_wc_status in verbs.h).
        assert_eq!(
            (s::IBV_WC_REM_ACCESS_ERR, s::IBV_WC_RNR_RETRY_EXC_ERR),
            (10, 13)
        );
    }

    #[test]
    fn opcodes_count_only_on_success() {
        use ffi::ibv_wc_opcode as o;
        assert_eq!(
            wc_opcode(WcStatus::Success, o::IBV_WC_RDMA_WRITE),
            WcOpcode::Write
        );
        assert_eq!(
            wc_opcode(WcStatus::Success, o::IBV_WC_RECV_RDMA_WITH_IMM),
            WcOpcode::RecvWriteImm
        );
        assert_eq!(
            wc_opcode(WcStatus::Success, o::IBV_WC_SEND),
            WcOpcode::Unknown
        );
        assert_eq!(
            wc_opcode(WcStatus::WrFlush, o::IBV_WC_RDMA_WRITE),
            WcOpcode::Unknown
        );
    }

    #[test]
    fn the_immediate_travels_big_endian_and_comes_back_unchanged() {
        let imm = 0x0102_0304u32;
        let wire = imm_to_wire(imm);
        assert_eq!(
            wire.to_ne_bytes(),
            [1, 2, 3, 4],
            "network byte order in memory"
        );
        assert_eq!(imm_from_wire(wire), imm);
        for v in [0, 1, u32::MAX, 0x8000_0000, 0xdead_beef] {
            assert_eq!(imm_from_wire(imm_to_wire(v)), v);
        }
    }

    #[test]
    fn qp_states_and_link_layers_map() {
        use ffi::ibv_qp_state as q;
        assert_eq!(qp_state(q::IBV_QPS_RESET), QpState::Reset);
        assert_eq!(qp_state(q::IBV_QPS_INIT), QpState::Init);
        assert_eq!(qp_state(q::IBV_QPS_RTR), QpState::Rtr);
        assert_eq!(qp_state(q::IBV_QPS_RTS), QpState::Rts);
        assert_eq!(qp_state(q::IBV_QPS_SQE), QpState::Error);
        assert_eq!(qp_state(q::IBV_QPS_ERR), QpState::Error);
        assert_eq!(
            link_layer(ffi::IBV_LINK_LAYER_ETHERNET as u8),
            LinkLayer::Ethernet
        );
        assert_eq!(
            link_layer(ffi::IBV_LINK_LAYER_INFINIBAND as u8),
            LinkLayer::InfiniBand
        );
        assert_eq!(
            link_layer(ffi::IBV_LINK_LAYER_UNSPECIFIED as u8),
            LinkLayer::InfiniBand
        );
        assert_eq!(mtu_bytes(ffi::IBV_MTU_1024), Some(1024));
        assert_eq!(mtu_bytes(ffi::IBV_MTU_4096), Some(4096));
        assert_eq!(mtu_bytes(0), None);
    }

    #[test]
    fn init_allows_local_and_remote_writes_on_the_port() {
        let (attr, mask) = init_attr(&PortParams {
            num: 2,
            ..port(LinkLayer::InfiniBand)
        });
        assert_eq!(attr.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(attr.port_num, 2);
        assert_eq!(attr.qp_access_flags, 1 | 2, "LOCAL_WRITE | REMOTE_WRITE");
        assert_eq!(mask.0, 1 | 8 | 16 | 32);
    }

    #[test]
    fn rtr_on_roce_routes_by_gid_with_the_settings() {
        let path = PathSettings {
            gid_index: 3,
            tc: 106,
            sl: 5,
            ..PathSettings::default()
        };
        let (attr, mask) = rtr_attr(&port(LinkLayer::Ethernet), &remote(), &path).unwrap();
        assert_eq!(attr.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(attr.path_mtu, ffi::IBV_MTU_4096);
        assert_eq!(attr.dest_qp_num, 0x1234);
        assert_eq!(attr.rq_psn, 0x00bc_def0, "24-bit PSN");
        assert_eq!(attr.min_rnr_timer, MIN_RNR_TIMER);
        assert_eq!(attr.max_dest_rd_atomic, 1);
        let ah = attr.ah_attr;
        assert_eq!(ah.is_global, 1);
        // SAFETY: reading the raw bytes of a plain 16-byte union.
        assert_eq!(unsafe { ah.grh.dgid.raw }, remote().gid);
        assert_eq!(ah.grh.sgid_index, 3);
        assert_eq!(ah.grh.hop_limit, 255);
        assert_eq!(ah.grh.traffic_class, 106);
        assert_eq!((ah.sl, ah.port_num), (5, 1));
        let want = Mask::IBV_QP_STATE
            | Mask::IBV_QP_AV
            | Mask::IBV_QP_PATH_MTU
            | Mask::IBV_QP_DEST_QPN
            | Mask::IBV_QP_RQ_PSN
            | Mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | Mask::IBV_QP_MIN_RNR_TIMER;
        assert_eq!(mask.0, want.0);
    }

    #[test]
    fn rtr_on_infiniband_routes_by_lid() {
        let mut p = port(LinkLayer::InfiniBand);
        p.active_mtu = ffi::IBV_MTU_2048;
        let (attr, _) = rtr_attr(&p, &remote(), &PathSettings::default()).unwrap();
        assert_eq!(attr.ah_attr.is_global, 0);
        assert_eq!(attr.ah_attr.dlid, 0x12);
        assert_eq!(attr.path_mtu, ffi::IBV_MTU_2048);
    }

    #[test]
    fn rts_carries_timeout_and_retries() {
        let path = PathSettings {
            timeout: 18,
            retry_cnt: 5,
            rnr_retry: 6,
            ..PathSettings::default()
        };
        let (attr, mask) = rts_attr(0x0100_0007, &path).unwrap();
        assert_eq!(attr.qp_state, ffi::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!((attr.timeout, attr.retry_cnt, attr.rnr_retry), (18, 5, 6));
        assert_eq!(attr.sq_psn, 7);
        assert_eq!(attr.max_rd_atomic, 1);
        assert_eq!(mask.0, 1 | 512 | 1024 | 2048 | 65536 | 8192);
        let (attr, mask) = error_attr();
        assert_eq!(attr.qp_state, ffi::ibv_qp_state::IBV_QPS_ERR);
        assert_eq!(mask.0, 1);
    }

    #[test]
    fn out_of_range_settings_name_their_variable() {
        let bad = PathSettings {
            timeout: 32,
            ..PathSettings::default()
        };
        let e = rts_attr(0, &bad)
            .err()
            .expect("timeout 32 refused")
            .to_string();
        assert!(e.contains("QCCL_IB_TIMEOUT=32"), "{e}");
        let bad = PathSettings {
            sl: 16,
            ..PathSettings::default()
        };
        let e = rtr_attr(&port(LinkLayer::Ethernet), &remote(), &bad)
            .err()
            .expect("sl 16 refused")
            .to_string();
        assert!(e.contains("QCCL_IB_SL=16"), "{e}");
        let mut p = port(LinkLayer::Ethernet);
        p.active_mtu = 9;
        assert!(rtr_attr(&p, &remote(), &PathSettings::default()).is_err());
    }
}
