//! The byte buffers compressed schedules encode into and send from. Each is registered with
//! the comm's registry (as qccl's own), so a link that sends from registered memory (RDMA)
//! takes an encoded chunk straight from where the codec wrote it, with no copy into its
//! slots. They are kept in the comm's scratch across calls, so the device registrations are
//! made once; a buffer that must grow is deregistered before its memory is freed.

use crate::transport::registry::Registry;
use std::sync::Arc;

/// One registered, growable byte buffer.
pub struct WireBuf {
    bytes: Vec<u8>,
    registry: Arc<Registry>,
    /// The registration of `bytes`' whole capacity, if any.
    handle: Option<u64>,
}

impl WireBuf {
    /// An empty buffer registering with `registry`.
    pub fn new(registry: Arc<Registry>) -> WireBuf {
        WireBuf {
            bytes: Vec::new(),
            registry,
            handle: None,
        }
    }

    /// The buffer resized to `len` bytes (contents unspecified), its memory registered. A
    /// caller that resizes it again to at most `len` keeps it in the registered memory.
    pub fn fit(&mut self, len: usize) -> &mut Vec<u8> {
        if len > self.bytes.capacity() {
            self.deregister();
            // Room to grow, so slices of slightly different sizes do not move it each call.
            let cap = len.max(self.bytes.capacity() * 3 / 2);
            self.bytes = Vec::with_capacity(cap);
        }
        if self.handle.is_none() && self.bytes.capacity() > 0 {
            // A failed registration only means this buffer is staged.
            self.handle = self
                .registry
                .register_own(self.bytes.as_ptr(), self.bytes.capacity())
                .ok();
        }
        self.bytes.resize(len, 0);
        &mut self.bytes
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn deregister(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = self.registry.deregister(h);
        }
    }
}

impl Drop for WireBuf {
    /// Deregistered before the memory is freed (a NIC would keep sending the old pages).
    fn drop(&mut self) {
        self.deregister();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_memory_stays_registered_as_it_grows_and_not_after() {
        let reg = Arc::new(Registry::default());
        let mut b = WireBuf::new(reg.clone());
        b.fit(100);
        assert_eq!(reg.stats().wire, 1);
        assert_eq!(reg.stats().ranges, 0);
        let found = |b: &WireBuf| {
            let p = b.bytes();
            reg.find(p.as_ptr(), p.len(), 1, |_, _| Some(Arc::new(0u8)))
                .is_some()
        };
        assert!(found(&b));
        b.fit(10);
        assert!(found(&b));
        // Growing moves it: the old memory is deregistered, the new registered.
        b.fit(1 << 20);
        assert_eq!(reg.stats().wire, 1);
        assert!(found(&b));
        drop(b);
        assert_eq!(reg.stats().wire, 0);
    }
}
