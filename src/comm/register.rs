//! Buffer registration, as NCCL's `ncclCommRegister` / `ncclCommDeregister`: a buffer used
//! again and again (a gradient bucket, a parameter shard) is registered once, and links that
//! can send straight from registered memory (the RDMA link) then skip the copy into their
//! staging slots. Registration is optional: unregistered buffers work unchanged.

use super::Comm;
use crate::error::Result;
use crate::types::Element;

/// What [`Comm::register`] returns, for [`Comm::deregister`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegHandle(u64);

impl RegHandle {
    /// The handle as a number (the C ABI's `void*`, Python's int).
    pub fn into_raw(self) -> u64 {
        self.0
    }

    /// A handle back from [`RegHandle::into_raw`]; `deregister` refuses numbers it never
    /// handed out.
    pub fn from_raw(raw: u64) -> RegHandle {
        RegHandle(raw)
    }
}

/// Counts of a comm's registrations (see [`Comm::registrations`]).
pub use crate::transport::registry::Stats as Registrations;

impl Comm {
    /// Registers `buf` with this comm. Until [`Comm::deregister`], collectives whose send
    /// data lies inside it may be sent straight from it over RDMA (registered with the device
    /// on first use, a whole number of pages); everywhere else nothing changes. Registering
    /// the same pages again returns the same handle, counted.
    ///
    /// Deregister before freeing or reallocating the buffer: a NIC keeps the pages it
    /// registered and would send their old bytes.
    pub fn register<T: Element>(&self, buf: &[T]) -> Result<RegHandle> {
        self.register_raw(buf.as_ptr().cast(), std::mem::size_of_val(buf))
    }

    /// [`Comm::register`] for `len` bytes at `ptr` (the C ABI's and Python's way in). Nothing
    /// is read or written here; a collective reads only the bytes it is given.
    pub fn register_raw(&self, ptr: *const u8, len: usize) -> Result<RegHandle> {
        self.registry.register(ptr, len).map(RegHandle)
    }

    /// Drops one registration made by [`Comm::register`]; the last one of a buffer releases
    /// its device registrations. A handle this comm did not hand out (or already
    /// deregistered) is an `InvalidArgument`.
    pub fn deregister(&self, handle: RegHandle) -> Result<()> {
        self.registry.deregister(handle.0)
    }

    /// How many buffers are registered, and how many device registrations links made of
    /// them (0 until a link that uses them sends from one); the same for qccl's own wire
    /// buffers, which compressed calls encode into.
    pub fn registrations(&self) -> Registrations {
        self.registry.stats()
    }
}
