//! Planned faults and delays, for tests of the device path's error and ordering rules: set
//! on [`EmuDriver`](super::EmuDriver) per device, taken by the next copies enqueued on that
//! device (so which copy gets one is decided at enqueue, deterministically).

use std::sync::Mutex;
use std::time::Duration;

/// What happens to one copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyFault {
    /// The copy fails when the stream reaches it (sticky, as an illegal address).
    pub fail: bool,
    /// The stream waits this long before running the copy (a slow kernel ahead of it).
    pub delay: Option<Duration>,
}

#[derive(Default)]
struct Planned {
    failures: u64,
    delays: Vec<Duration>,
}

/// Per device: the planned faults not taken yet.
pub struct Faults {
    devices: Mutex<Vec<Planned>>,
}

impl Faults {
    /// No faults planned on `devices` devices.
    pub fn new(devices: usize) -> Faults {
        Faults {
            devices: Mutex::new((0..devices).map(|_| Planned::default()).collect()),
        }
    }

    fn with<T>(&self, ordinal: usize, f: impl FnOnce(&mut Planned) -> T) -> T {
        let mut d = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut d[ordinal])
    }

    /// The next copy enqueued on `ordinal` fails.
    pub fn fail_next_copy(&self, ordinal: usize) {
        self.with(ordinal, |p| p.failures += 1);
    }

    /// The next copy enqueued on `ordinal` waits `delay` first.
    pub fn delay_next_copy(&self, ordinal: usize, delay: Duration) {
        self.with(ordinal, |p| p.delays.push(delay));
    }

    /// What happens to a copy being enqueued on `ordinal`.
    pub fn take(&self, ordinal: usize) -> CopyFault {
        self.with(ordinal, |p| {
            let fail = p.failures > 0;
            p.failures -= u64::from(fail);
            let delay = (!p.delays.is_empty()).then(|| p.delays.remove(0));
            CopyFault { fail, delay }
        })
    }
}
