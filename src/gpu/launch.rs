//! Kernel arguments laid out as `cuLaunchKernel` takes them: one 8-byte, 8-aligned slot per
//! argument holding its value in native byte order, and an array of pointers to the slots
//! (`void** kernelParams`). Both drivers launch through it; the emulated one rewrites pointer
//! slots to its host aliases first.

use super::driver::Arg;
use std::ffi::c_void;

/// One argument's value; the kernel reads its parameter's size from the start.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Slot([u8; 8]);

/// The values of one launch's arguments.
pub(crate) struct ArgBlock {
    slots: Vec<Slot>,
}

impl ArgBlock {
    /// The values of `args` (pointers as the addresses given).
    pub(crate) fn new(args: &[Arg]) -> ArgBlock {
        let slots = args
            .iter()
            .map(|a| {
                let mut s = [0u8; 8];
                match *a {
                    Arg::Ptr(v) | Arg::U64(v) => s.copy_from_slice(&v.to_ne_bytes()),
                    Arg::U32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::I32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F64(v) => s.copy_from_slice(&v.to_ne_bytes()),
                }
                Slot(s)
            })
            .collect();
        ArgBlock { slots }
    }

    /// Replaces argument `i`'s value with the pointer `addr`.
    pub(crate) fn set_ptr(&mut self, i: usize, addr: u64) {
        self.slots[i] = Slot(addr.to_ne_bytes());
    }

    /// `kernelParams`: a pointer to each slot, valid while `self` lives unchanged.
    pub(crate) fn params(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| (s as *mut Slot).cast())
            .collect()
    }
}

impl Arg {
    /// The parameter type letter of kernels/shim/emu_entry.h this argument fits.
    pub(crate) fn code(&self) -> char {
        match self {
            Arg::Ptr(_) => 'p',
            Arg::U64(_) => 'U',
            Arg::U32(_) => 'u',
            Arg::I32(_) => 'i',
            Arg::F32(_) => 'f',
            Arg::F64(_) => 'd',
        }
    }
}

/// The C type a parameter letter of kernels/shim/emu_entry.h stands for, for messages.
pub(crate) fn type_name(code: char) -> &'static str {
    match code {
        'p' => "a pointer",
        'U' => "uint64_t",
        'u' => "uint32_t",
        'i' => "int32_t",
        'I' => "int64_t",
        'f' => "float",
        'd' => "double",
        _ => "a type no Arg passes",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_hold_values_from_their_start() {
        let args = [
            Arg::Ptr(0x1234_5678_9abc),
            Arg::U32(7),
            Arg::I32(-2),
            Arg::F32(1.5),
            Arg::F64(-0.25),
            Arg::U64(u64::MAX - 1),
        ];
        let mut block = ArgBlock::new(&args);
        block.set_ptr(0, 0x42);
        let p = block.params();
        assert_eq!(p.len(), 6);
        // SAFETY: each pointer is to an 8-byte, 8-aligned slot of `block`, alive here.
        unsafe {
            assert_eq!(*(p[0] as *const u64), 0x42);
            assert_eq!(*(p[1] as *const u32), 7);
            assert_eq!(*(p[2] as *const i32), -2);
            assert_eq!(*(p[3] as *const f32), 1.5);
            assert_eq!(*(p[4] as *const f64), -0.25);
            assert_eq!(*(p[5] as *const u64), u64::MAX - 1);
        }
        let codes: String = args.iter().map(Arg::code).collect();
        assert_eq!(codes, "puifdU");
    }
}
