//! A device's identity: name, PCI bus id, total memory (device management calls, which need
//! no context).

use super::call::check;
use super::context::Context;
use crate::error::Result;
use crate::gpu::driver::DeviceInfo;
use cudarc::driver::sys;
use std::ffi::c_char;

/// Room for the name and bus id strings: names are well under 100 bytes, bus ids
/// "0000:3b:00.0" are 13 with the NUL.
const NAME_BYTES: usize = 256;
const BUS_ID_BYTES: usize = 64;

/// The string the driver wrote into `buf` (up to the first NUL; the whole buffer if none).
pub(super) fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Device `ctx.ordinal()`'s identity.
pub(super) fn info(ctx: &Context) -> Result<DeviceInfo> {
    let ordinal = ctx.ordinal();
    let dev = ctx.device();
    let what = || format!("describing CUDA device {ordinal}");
    let mut name = [0 as c_char; NAME_BYTES];
    // SAFETY: `name` has NAME_BYTES writable bytes and the driver is told so; `dev` came
    // from cuDeviceGet.
    let r = unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), NAME_BYTES as i32, dev) };
    check(r, "cuDeviceGetName", what)?;
    let mut bus_id = [0 as c_char; BUS_ID_BYTES];
    // SAFETY: as above, BUS_ID_BYTES writable bytes.
    let r = unsafe { sys::cuDeviceGetPCIBusId(bus_id.as_mut_ptr(), BUS_ID_BYTES as i32, dev) };
    check(r, "cuDeviceGetPCIBusId", what)?;
    let mut memory: usize = 0;
    // SAFETY: `memory` is a valid out-pointer.
    let r = unsafe { sys::cuDeviceTotalMem_v2(&mut memory, dev) };
    check(r, "cuDeviceTotalMem", what)?;
    Ok(DeviceInfo {
        ordinal,
        name: c_string(&name),
        bus_id: c_string(&bus_id),
        memory: memory as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_strings_end_at_the_first_nul_or_the_buffer() {
        let mut buf = [0 as c_char; 16];
        for (i, b) in b"NVIDIA H100".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(c_string(&buf), "NVIDIA H100");
        let full = [b'a' as c_char; 4];
        assert_eq!(c_string(&full), "aaaa");
        assert_eq!(c_string(&[0 as c_char; 4]), "");
    }
}
