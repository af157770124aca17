//! The emulated driver against the contract's rules.

use super::*;
use crate::gpu::driver::Event;
use std::process::Command;
use std::time::{Duration, Instant};

/// Generous bound for waits that should end at once (CI machines are slow and shared).
const T: Duration = Duration::from_secs(20);

/// Set in a child process run by a test of this file; names what the child does.
const CHILD_ENV: &str = "QCCL_GPU_EMU_TEST_CHILD";

/// A page-locked word, 0 until the test stores to it, that a stream was told to wait for:
/// how the tests hold a stream. Each test synchronizes the stream before the gate drops.
struct Gate {
    mem: Box<dyn Pinned>,
}

impl Gate {
    /// Makes `s` wait until the word holds `value`.
    fn hold(d: &EmuDriver, s: &dyn Stream, value: u32) -> Gate {
        let gate = Gate {
            mem: d.alloc_pinned(8).unwrap(),
        };
        gate.word().store(0, std::sync::atomic::Ordering::Release);
        // SAFETY: page-locked and aligned; the gate outlives the wait (see above).
        unsafe { s.wait_word(gate.mem.ptr() as *const u32, value) }.unwrap();
        gate
    }

    /// The word, to store to.
    fn word(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: page-locked, page-aligned and ours for as long as `self` lives.
        unsafe { &*(self.mem.ptr() as *const std::sync::atomic::AtomicU32) }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn to_device(s: &dyn Stream, dst: u64, src: &[u8]) -> Result<()> {
    // SAFETY: `src` outlives the copy: every test synchronises before dropping it.
    unsafe { s.copy_to_device(dst, src.as_ptr(), src.len()) }
}

fn to_host(s: &dyn Stream, dst: &mut [u8], src: u64) -> Result<()> {
    // SAFETY: as in `to_device`.
    unsafe { s.copy_to_host(dst.as_mut_ptr(), src, dst.len()) }
}

fn is_invalid(r: Result<()>, needles: &[&str]) {
    match r {
        Err(Error::InvalidArgument(m)) => {
            for n in needles {
                assert!(m.contains(n), "{m:?} does not name {n:?}");
            }
        }
        other => panic!("expected InvalidArgument naming {needles:?}, got {other:?}"),
    }
}

/// Runs this binary's test `name` alone in a child process with [`CHILD_ENV`] set.
fn run_child(name: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .output()
        .unwrap()
}

fn in_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == name)
}

#[test]
fn devices() {
    let d = EmuDriver::new(2);
    assert_eq!(d.kind(), "emulated");
    assert_eq!(d.device_count(), 2);
    let info = d.device(1).unwrap();
    assert_eq!(info.ordinal, 1);
    assert_eq!(info.name, "emulated GPU");
    assert_eq!(info.bus_id, "emulated:1");
    assert_eq!(info.memory, 16 << 30);
    let e = d.device(2).unwrap_err().to_string();
    assert!(e.contains("ordinal 2") && e.contains("2 device"), "{e}");
    is_invalid(d.alloc_device(5, 1).map(|_| ()), &["ordinal 5"]);
    is_invalid(d.create_stream(2).map(|_| ()), &["ordinal 2"]);
    assert_eq!(EmuDriver::new(0).device_count(), 1);
}

#[test]
fn allocations() {
    let d = EmuDriver::new(1);
    is_invalid(d.alloc_device(0, 0).map(|_| ()), &["0 bytes"]);
    is_invalid(d.alloc_pinned(0).map(|_| ()), &["0 bytes"]);
    let page = memory::page_size();
    let m = d.alloc_device(0, 10).unwrap();
    assert_eq!((m.len(), m.ordinal()), (10, 0));
    assert_eq!(m.addr() % page as u64, 0);
    let p = d.alloc_pinned(3).unwrap();
    assert_eq!(p.len(), 3);
    assert_eq!(p.ptr() as usize % page, 0);
    // Past the device's memory: out of memory, with the device named.
    match d.alloc_device(0, DEVICE_MEMORY as usize) {
        Err(Error::System(m)) => assert!(m.contains("device 0") && m.contains("OUT_OF_MEMORY")),
        other => panic!("expected out of memory, got {:?}", other.map(|m| m.len())),
    }
    // Freed memory is counted back: the whole device fits once `m` is gone.
    drop(m);
    let all = d.alloc_device(0, DEVICE_MEMORY as usize).unwrap();
    assert_eq!(all.len() as u64, DEVICE_MEMORY);
}

#[test]
fn locate_bounds() {
    let d = EmuDriver::new(2);
    let a = d.alloc_device(0, 4099).unwrap();
    let b = d.alloc_device(1, 1).unwrap();
    let dev0 = Memory::Device { ordinal: 0 };
    assert_eq!(d.locate(a.addr()).unwrap(), dev0);
    assert_eq!(d.locate(a.addr() + 2000).unwrap(), dev0);
    assert_eq!(d.locate(a.addr() + 4098).unwrap(), dev0);
    assert_eq!(d.locate(a.addr() + 4099).unwrap(), Memory::Host);
    assert_eq!(d.locate(a.addr() - 1).unwrap(), Memory::Host);
    assert_eq!(d.locate(b.addr()).unwrap(), Memory::Device { ordinal: 1 });
    assert_eq!(d.locate(b.addr() + 1).unwrap(), Memory::Host);
    let p = d.alloc_pinned(100).unwrap();
    assert_eq!(d.locate(p.ptr() as u64).unwrap(), Memory::Host);
    let v = [0u8; 4];
    assert_eq!(d.locate(v.as_ptr() as u64).unwrap(), Memory::Host);
    assert_eq!(d.locate(0).unwrap(), Memory::Host);
    let addr = a.addr();
    drop(a);
    assert_eq!(d.locate(addr).unwrap(), Memory::Host);
}

/// Host -> device -> host through pinned memory and plain vectors, at awkward sizes and
/// offsets, on two devices.
#[test]
fn copies_round_trip() {
    let d = EmuDriver::new(2);
    for ordinal in 0..2 {
        let s = d.create_stream(ordinal).unwrap();
        for (i, len) in [1usize, 4099, (1 << 20) + 3].into_iter().enumerate() {
            for offset in [0usize, 1, 4095, 4097] {
                let mem = d.alloc_device(ordinal, offset + len + 5).unwrap();
                let data = pattern(len, (i * 7 + offset) as u8);
                let pinned = d.alloc_pinned(len).unwrap();
                // SAFETY: `pinned` holds `len` bytes, written before any copy reads them.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), pinned.ptr(), len) };
                let at = mem.addr() + offset as u64;
                // SAFETY: `pinned` lives until after the synchronize below.
                unsafe { s.copy_to_device(at, pinned.ptr(), len).unwrap() };
                let mut back = vec![0u8; len];
                to_host(&*s, &mut back, at).unwrap();
                // The neighbouring bytes are untouched (zero: fresh memfd pages).
                let mut edges = [0xAAu8; 2];
                if offset > 0 {
                    to_host(&*s, &mut edges[..1], at - 1).unwrap();
                }
                to_host(&*s, &mut edges[1..], at + len as u64).unwrap();
                s.synchronize(T).unwrap();
                assert!(back == data, "len {len} offset {offset} device {ordinal}");
                assert_eq!(edges, [if offset > 0 { 0 } else { 0xAA }, 0]);
            }
        }
    }
}

/// Registered host memory counts as page-locked (a copy from it on a held stream returns at
/// once, as from `alloc_pinned`'s) until unregistered; a range registered already, device
/// memory and a misaligned start are refused.
#[test]
fn registered_host_memory_is_page_locked_until_dropped() {
    let d = EmuDriver::new(1);
    let page = memory::page_size();
    let mut host = vec![0u8; 4 * page];
    let at = host.as_mut_ptr().align_offset(page);
    // SAFETY (all registrations): a page-aligned range of `host`, which outlives them.
    let range = unsafe { host.as_mut_ptr().add(at) };
    let reg = unsafe { d.register_host(0, range, 2 * page) }.unwrap();
    assert_eq!(reg.len(), 2 * page);
    let err = |r: Result<Box<dyn Registered>>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        err(unsafe { d.register_host(0, range.wrapping_add(page), page) })
            .contains("page-locked already")
    );
    assert!(
        err(unsafe { d.register_host(0, range.wrapping_add(1), page) }).contains("page-aligned")
    );
    let mem = d.alloc_device(0, page).unwrap();
    assert!(
        err(unsafe { d.register_host(0, mem.addr() as *mut u8, page) }).contains("device memory")
    );
    // A stream held at a word: a copy from page-locked memory only enqueues.
    let s = d.create_stream(0).unwrap();
    let gate = Gate::hold(&d, &*s, 1);
    // SAFETY: `range` holds `page` bytes, alive until the synchronize below.
    unsafe { s.copy_to_device(mem.addr(), range, page) }.unwrap();
    gate.word().store(1, std::sync::atomic::Ordering::Release);
    s.synchronize(T).unwrap();
    drop(reg);
    // Unregistered: the same range registers again.
    drop(unsafe { d.register_host(0, range, 2 * page) }.unwrap());
}

#[test]
fn copies_on_the_device_and_refuses_overlap_and_other_devices() {
    let d = EmuDriver::new(2);
    let s = d.create_stream(0).unwrap();
    for len in [1usize, 4099, (1 << 20) + 3] {
        let (a, b) = (
            d.alloc_device(0, len + 8).unwrap(),
            d.alloc_device(0, len).unwrap(),
        );
        let data = pattern(len, len as u8);
        to_device(&*s, a.addr() + 8, &data).unwrap();
        // SAFETY: both ranges inside live allocations of device 0, untouched until the
        // synchronize below.
        unsafe { s.copy_on_device(b.addr(), a.addr() + 8, len).unwrap() };
        let mut back = vec![0u8; len];
        to_host(&*s, &mut back, b.addr()).unwrap();
        s.synchronize(T).unwrap();
        assert!(back == data, "len {len}");
        // Overlapping ranges of one allocation are refused before anything is enqueued.
        // SAFETY: refused: nothing is enqueued.
        is_invalid(
            unsafe { s.copy_on_device(a.addr(), a.addr() + len as u64 / 2, len) },
            &["overlap"],
        );
    }
    let other = d.alloc_device(1, 64).unwrap();
    let mine = d.alloc_device(0, 64).unwrap();
    // SAFETY: refused: nothing is enqueued.
    is_invalid(
        unsafe { s.copy_on_device(mine.addr(), other.addr(), 64) },
        &["not memory of device 0"],
    );
    s.synchronize(T).unwrap();
}

#[test]
fn zero_length_copy_is_a_no_op() {
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    // Nothing is checked or enqueued for 0 bytes, as CUDA returns success at once.
    // SAFETY: 0 bytes: no memory is touched.
    unsafe {
        s.copy_to_device(0xdead, std::ptr::null(), 0).unwrap();
        s.copy_to_host(std::ptr::null_mut(), 0, 0).unwrap();
    }
    s.synchronize(T).unwrap();
}

#[test]
fn many_ops_run_in_order() {
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 4096).unwrap();
    let inputs: Vec<Vec<u8>> = (0..200).map(|i| pattern(1000 + i, i as u8)).collect();
    let mut outputs: Vec<Vec<u8>> = inputs.iter().map(|v| vec![0; v.len()]).collect();
    let mut events = Vec::new();
    // The first write waits, so everything after it is queued behind it.
    d.delay_next_copy(0, Duration::from_millis(300)).unwrap();
    for (i, (input, output)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
        to_device(&*s, mem.addr() + i as u64, input).unwrap();
        to_host(&*s, output, mem.addr() + i as u64).unwrap();
        events.push(s.record().unwrap());
    }
    assert!(
        !events[0].query().unwrap(),
        "the delayed copy cannot be done yet"
    );
    events.last().unwrap().synchronize(T).unwrap();
    for e in &events {
        assert!(e.query().unwrap());
    }
    for (i, (a, b)) in inputs.iter().zip(&outputs).enumerate() {
        assert!(a == b, "copy pair {i} ran out of order");
    }
}

/// A slow copy on A; B waits for A's event, then reads what A wrote.
#[test]
fn wait_event_orders_two_streams() {
    let d = EmuDriver::new(1);
    let a = d.create_stream(0).unwrap();
    let b = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 1 << 16).unwrap();
    let data = pattern(1 << 16, 9);
    let mut back = vec![0u8; 1 << 16];
    d.delay_next_copy(0, Duration::from_millis(300)).unwrap();
    let start = Instant::now();
    to_device(&*a, mem.addr(), &data).unwrap();
    let done_a = a.record().unwrap();
    b.wait_event(&*done_a).unwrap();
    to_host(&*b, &mut back, mem.addr()).unwrap();
    let done_b = b.record().unwrap();
    // Nothing above blocks the caller.
    assert!(start.elapsed() < Duration::from_millis(250));
    assert!(!done_b.query().unwrap());
    b.synchronize(T).unwrap();
    assert!(done_a.query().unwrap());
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert!(back == data, "B read before A's copy was done");
}

#[test]
fn events_query_and_synchronize() {
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    // An event on an idle stream completes at once.
    let idle = s.record().unwrap();
    idle.synchronize(T).unwrap();
    assert!(idle.query().unwrap());
    let mem = d.alloc_device(0, 8).unwrap();
    let data = [1u8; 8];
    d.delay_next_copy(0, Duration::from_millis(400)).unwrap();
    to_device(&*s, mem.addr(), &data).unwrap();
    let e = s.record().unwrap();
    assert!(!e.query().unwrap());
    match e.synchronize(Duration::from_millis(20)) {
        // Event 3: the allocation above recorded one (implicit synchronisation).
        Err(Error::Timeout(m)) => assert!(m.contains("event 3 of emulated stream"), "{m}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    match s.synchronize(Duration::from_millis(20)) {
        Err(Error::Timeout(m)) => {
            assert!(
                m.contains("emulated stream") && m.contains("pending"),
                "{m}"
            )
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    e.synchronize(T).unwrap();
    assert!(e.query().unwrap());
    s.synchronize(T).unwrap();
    // An event of another driver kind is refused.
    struct Foreign;
    impl Event for Foreign {
        fn query(&self) -> Result<bool> {
            Ok(true)
        }
        fn synchronize(&self, _: Duration) -> Result<()> {
            Ok(())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
    is_invalid(s.wait_event(&Foreign), &["not the emulated driver's"]);
}

#[test]
fn bad_ranges_refused_at_enqueue() {
    let d = EmuDriver::new(2);
    let s = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 100).unwrap();
    let other = d.alloc_device(1, 100).unwrap();
    let mut host = [0u8; 200];
    let base = format!("0x{:x}", mem.addr());
    // Unknown address, past the end, one past the end, on another device.
    let v = host.as_ptr() as u64;
    is_invalid(
        to_host(&*s, &mut host[..4], v),
        &["not in a live allocation", "device 0"],
    );
    is_invalid(
        to_host(&*s, &mut host[..101], mem.addr()),
        &[&base, "+101", "100-byte"],
    );
    is_invalid(
        to_host(&*s, &mut host[..2], mem.addr() + 99),
        &["+2", "runs past"],
    );
    is_invalid(
        to_host(&*s, &mut host[..1], mem.addr() + 100),
        &["not in a live allocation"],
    );
    is_invalid(
        to_device(&*s, other.addr(), &host[..1]),
        &["device 1", "not memory of device 0"],
    );
    // Host side: null, or device memory used as host memory.
    // SAFETY: refused at enqueue, so nothing is read or written.
    unsafe {
        is_invalid(
            s.copy_to_device(mem.addr(), std::ptr::null(), 4),
            &["null host pointer"],
        );
        is_invalid(
            s.copy_to_host(other.addr() as *mut u8, mem.addr(), 4),
            &["overlaps emulated device memory"],
        );
        // The page padding after a 100-byte allocation is device memory too.
        is_invalid(
            s.copy_to_host((mem.addr() + 200) as *mut u8, mem.addr(), 4),
            &["overlaps emulated device memory"],
        );
    }
    // A freed allocation is unknown.
    let freed = mem.addr();
    drop(mem);
    is_invalid(
        to_host(&*s, &mut host[..1], freed),
        &["not in a live allocation"],
    );
    // Nothing was enqueued, and the stream is not failed.
    s.synchronize(T).unwrap();
}

/// Freeing memory that a pending copy targets: the copy fails when it runs (it does not
/// touch the unmapped memory), the stream is sticky-failed.
#[test]
fn free_before_copy_runs_is_a_sticky_error() {
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 1 << 20).unwrap();
    let data = pattern(1 << 20, 3);
    let before = s.record().unwrap();
    d.delay_next_copy(0, Duration::from_millis(200)).unwrap();
    to_device(&*s, mem.addr(), &data).unwrap();
    let after = s.record().unwrap();
    drop(mem);
    // A new allocation may reuse the address: the pending copy must not write into it.
    let reuse = d.alloc_device(0, 1 << 20).unwrap();
    let err = s.synchronize(T).unwrap_err();
    match &err {
        Error::System(m) => {
            assert!(m.contains("was freed before the copy ran"), "{m}");
            assert!(m.contains("emulated stream"), "{m}");
        }
        other => panic!("expected a System error, got {other:?}"),
    }
    before.synchronize(T).unwrap();
    assert_eq!(after.synchronize(T).unwrap_err(), err);
    assert_eq!(after.query().unwrap_err(), err);
    // Sticky: every later call on the stream says the same.
    assert_eq!(s.synchronize(T).unwrap_err(), err);
    assert_eq!(s.record().map(|_| ()).unwrap_err(), err);
    assert_eq!(to_device(&*s, reuse.addr(), &data[..1]).unwrap_err(), err);
    // The reused allocation is untouched and usable on another stream.
    let s2 = d.create_stream(0).unwrap();
    let mut back = vec![1u8; 64];
    to_host(&*s2, &mut back, reuse.addr()).unwrap();
    s2.synchronize(T).unwrap();
    assert!(back.iter().all(|&b| b == 0));
}

#[test]
fn injected_copy_failure_is_sticky() {
    let d = EmuDriver::new(2);
    is_invalid(d.fail_next_copy(2), &["ordinal 2"]);
    let s = d.create_stream(1).unwrap();
    let other = d.create_stream(1).unwrap();
    let mem = d.alloc_device(1, 16).unwrap();
    let data = [7u8; 16];
    to_device(&*s, mem.addr(), &data).unwrap();
    let ok = s.record().unwrap();
    d.fail_next_copy(1).unwrap();
    to_device(&*s, mem.addr(), &data).unwrap();
    let failed = s.record().unwrap();
    let err = failed.synchronize(T).unwrap_err();
    assert!(err.to_string().contains("injected fault"), "{err}");
    assert!(err.to_string().contains("emulated stream"), "{err}");
    ok.synchronize(T).unwrap();
    assert_eq!(s.synchronize(T).unwrap_err(), err);
    // A stream waiting on the failed event fails too; others are unaffected.
    let third = d.create_stream(1).unwrap();
    third.wait_event(&*failed).unwrap();
    let e3 = third.synchronize(T).unwrap_err().to_string();
    assert!(
        e3.contains("which failed") && e3.contains("injected fault"),
        "{e3}"
    );
    to_device(&*other, mem.addr(), &data).unwrap();
    other.synchronize(T).unwrap();
}

#[test]
fn borrow_stream_rules() {
    let d = EmuDriver::new(2);
    let created = d.create_stream(1).unwrap();
    assert!(!created.raw().is_null());
    let second = d.create_stream(1).unwrap();
    assert_ne!(created.raw(), second.raw());
    // SAFETY: (all borrows below) the handles are null or live streams of this driver, or
    // refused.
    unsafe {
        // Null: the device's legacy default stream, with a null handle.
        let def = d.borrow_stream(0, std::ptr::null_mut()).unwrap();
        assert!(def.raw().is_null());
        assert_eq!(def.ordinal(), 0);
        let mem = d.alloc_device(0, 32).unwrap();
        let data = pattern(32, 1);
        let mut back = vec![0u8; 32];
        d.delay_next_copy(0, Duration::from_millis(100)).unwrap();
        to_device(&*def, mem.addr(), &data).unwrap();
        // A second borrow of the default stream is the same FIFO.
        let def2 = d.borrow_stream(0, std::ptr::null_mut()).unwrap();
        to_host(&*def2, &mut back, mem.addr()).unwrap();
        def2.synchronize(T).unwrap();
        assert_eq!(back, data);
        // A created stream's handle borrows it: the same FIFO, and dropping the borrow
        // leaves the stream working.
        let borrowed = d.borrow_stream(1, created.raw()).unwrap();
        assert_eq!(borrowed.raw(), created.raw());
        let mem1 = d.alloc_device(1, 32).unwrap();
        d.delay_next_copy(1, Duration::from_millis(100)).unwrap();
        to_device(&*created, mem1.addr(), &data).unwrap();
        let mut back1 = vec![0u8; 32];
        to_host(&*borrowed, &mut back1, mem1.addr()).unwrap();
        borrowed.synchronize(T).unwrap();
        assert_eq!(back1, data);
        drop(borrowed);
        created.synchronize(T).unwrap();
        created.record().unwrap().synchronize(T).unwrap();
        // Wrong device, unknown handle, another driver's handle, a dropped stream's.
        is_invalid(
            d.borrow_stream(0, created.raw()).map(|_| ()),
            &["not a stream of device 0"],
        );
        let bogus = std::ptr::without_provenance_mut(0x1234_5678);
        is_invalid(
            d.borrow_stream(1, bogus).map(|_| ()),
            &["0x12345678", "not a stream of the emulated driver"],
        );
        let other = EmuDriver::new(2);
        let foreign = other.create_stream(1).unwrap();
        is_invalid(
            d.borrow_stream(1, foreign.raw()).map(|_| ()),
            &["not a stream of the emulated driver"],
        );
        is_invalid(
            d.borrow_stream(2, std::ptr::null_mut()).map(|_| ()),
            &["ordinal 2"],
        );
        let gone = second.raw();
        // A borrow outliving its stream (the caller's bug) gets errors, not a hang.
        let dangling = d.borrow_stream(1, gone).unwrap();
        drop(second);
        is_invalid(
            d.borrow_stream(1, gone).map(|_| ()),
            &["not a stream of the emulated driver"],
        );
        is_invalid(dangling.record().map(|_| ()), &["was destroyed"]);
    }
}

/// Dropping a stream with work queued waits for it (the copy happens).
#[test]
fn drop_drains_the_stream() {
    let d = EmuDriver::new(1);
    let mem = d.alloc_device(0, 64).unwrap();
    let data = pattern(64, 5);
    let s = d.create_stream(0).unwrap();
    d.delay_next_copy(0, Duration::from_millis(100)).unwrap();
    to_device(&*s, mem.addr(), &data).unwrap();
    let e = s.record().unwrap();
    drop(s);
    assert!(
        e.query().unwrap(),
        "the drop returned before the stream's work ran"
    );
    let s = d.create_stream(0).unwrap();
    let mut back = vec![0u8; 64];
    to_host(&*s, &mut back, mem.addr()).unwrap();
    s.synchronize(T).unwrap();
    assert_eq!(back, data);
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Streams' workers (created, borrowed, default) are joined when their owner is dropped.
/// Counted in a child process, where no other test starts threads meanwhile.
#[test]
fn drop_joins_threads() {
    const NAME: &str = "gpu::emu::tests::drop_joins_threads";
    if !in_child(NAME) {
        let out = run_child(NAME);
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("EMU ok"),
            "child: {out:?}"
        );
        return;
    }
    let start = threads();
    {
        let d = EmuDriver::new(2);
        let streams: Vec<_> = (0..6).map(|i| d.create_stream(i % 2).unwrap()).collect();
        assert_eq!(threads(), start + 6);
        // SAFETY: null: the legacy default stream, owned by the driver.
        let def = unsafe { d.borrow_stream(1, std::ptr::null_mut()).unwrap() };
        // SAFETY: a live stream of this driver, dropped before it.
        let borrowed = unsafe { d.borrow_stream(0, streams[0].raw()).unwrap() };
        assert_eq!(threads(), start + 7);
        drop(borrowed);
        drop(def);
        assert_eq!(threads(), start + 7, "borrows own no thread");
        drop(streams);
        assert_eq!(
            threads(),
            start + 1,
            "created streams' workers joined on drop"
        );
    }
    assert_eq!(
        threads(),
        start,
        "the default stream's worker joined with the driver"
    );
    println!("EMU ok");
}

/// A host read through a device pointer faults, as on a real GPU: the child dies of SIGSEGV.
#[test]
fn device_pointer_is_not_host_memory() {
    use std::os::unix::process::ExitStatusExt;
    const NAME: &str = "gpu::emu::tests::device_pointer_is_not_host_memory";
    if !in_child(NAME) {
        let out = run_child(NAME);
        assert_eq!(out.status.signal(), Some(libc::SIGSEGV), "child: {out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains("EMU reading"));
        return;
    }
    let d = EmuDriver::new(1);
    let mem = d.alloc_device(0, 4096).unwrap();
    println!("EMU reading");
    // SAFETY: not safe: this read must fault; the child process dies of it, on purpose.
    let v = unsafe { std::ptr::read_volatile(mem.addr() as *const u8) };
    println!("EMU read {v}: device memory was host-readable");
}

/// `wait_word`: work behind it waits until the host stores the value; the caller does not
/// block; a misaligned word is refused.
#[test]
fn a_stream_waits_for_a_word() {
    use std::sync::atomic::Ordering;
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 4096).unwrap();
    let gate = Gate::hold(&d, &*s, 2);
    let word = gate.word();
    let data = pattern(4096, 3);
    // Page-locked: a copy from pageable memory behind the word would return only once the
    // word is stored (`pageable_copies_behind_a_held_stream_wait_for_it`).
    let staged = d.alloc_pinned(4096).unwrap();
    // SAFETY: `staged` holds 4096 bytes, ours alone until the copy is enqueued.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), staged.ptr(), 4096) };
    // SAFETY: `staged` lives until the synchronize below.
    unsafe { s.copy_to_device(mem.addr(), staged.ptr(), 4096) }.unwrap();
    let done = s.record().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.query().unwrap(), "ran before the word was stored");
    word.store(1, Ordering::Release);
    std::thread::sleep(Duration::from_millis(50));
    assert!(!done.query().unwrap(), "ran below the value");
    word.store(2, Ordering::Release);
    done.synchronize(T).unwrap();
    let mut back = vec![0u8; 4096];
    to_host(&*s, &mut back, mem.addr()).unwrap();
    s.synchronize(T).unwrap();
    assert_eq!(back, data);
    // SAFETY: never dereferenced: refused first.
    let r = unsafe { s.wait_word(gate.mem.ptr().add(1) as *const u32, 1) };
    is_invalid(r, &["aligned"]);
}

/// An allocation synchronises implicitly, as CUDA's do: work enqueued after it on another
/// stream waits for a stream held at a word, work enqueued before it does not.
#[test]
fn allocations_order_later_work_behind_every_stream() {
    use std::sync::atomic::Ordering;
    let d = EmuDriver::new(1);
    let (held, other) = (d.create_stream(0).unwrap(), d.create_stream(0).unwrap());
    let mem = d.alloc_device(0, 4096).unwrap();
    let gate = Gate::hold(&d, &*held, 1);
    let word = gate.word();
    let data = pattern(4096, 5);
    to_device(&*other, mem.addr(), &data).unwrap();
    let before = other.record().unwrap();
    before.synchronize(T).unwrap();
    for alloc in [true, false] {
        // Page-locked memory, then device memory: both hold the other stream's later work.
        let _m: Box<dyn std::any::Any> = if alloc {
            Box::new(d.alloc_pinned(64).unwrap())
        } else {
            Box::new(d.alloc_device(0, 64).unwrap())
        };
        to_device(&*other, mem.addr(), &data).unwrap();
        let after = other.record().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !after.query().unwrap(),
            "ran past an allocation before the held stream"
        );
    }
    word.store(1, Ordering::Release);
    other.synchronize(T).unwrap();
    held.synchronize(T).unwrap();
}

/// A page-locked range answers for its own bytes; its end is only "just past" it, since the
/// next mapping (device memory, say) may start at that address.
#[test]
fn pinned_ranges_do_not_claim_the_address_after_them() {
    let table = Arc::new(PinnedTable::default());
    let pinned = EmuPinned::new(4096, &table).unwrap();
    let p = pinned.ptr() as u64;
    assert!(table.contains(p) && table.contains(p + 4095));
    assert!(!table.contains(p + 4096) && !table.contains(p - 1));
    assert!(table.ends_at(p + 4096));
    assert!(!table.ends_at(p + 4095) && !table.ends_at(p));
    drop(pinned);
    assert!(!table.contains(p) && !table.ends_at(p + 4096));
}

/// A copy with pageable host memory on a stream held at a word returns only once the word is
/// stored and the copy ran, as CUDA's; one with page-locked memory returns at once.
#[test]
fn pageable_copies_behind_a_held_stream_wait_for_it() {
    use std::sync::atomic::Ordering;
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    let mem = d.alloc_device(0, 4096).unwrap();
    let gate = Gate::hold(&d, &*s, 1);
    let word = gate.word();
    let staged = d.alloc_pinned(4096).unwrap();
    // SAFETY: `staged` holds 4096 bytes and lives until the synchronize below.
    unsafe { s.copy_to_device(mem.addr(), staged.ptr(), 4096) }.unwrap();
    assert!(!s.record().unwrap().query().unwrap(), "held");
    let data = pattern(4096, 9);
    let t = std::time::Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            word.store(1, Ordering::Release);
        });
        to_device(&*s, mem.addr(), &data).unwrap();
    });
    assert!(
        t.elapsed() >= Duration::from_millis(100),
        "returned while held"
    );
    let mut back = vec![0u8; 4096];
    to_host(&*s, &mut back, mem.addr()).unwrap();
    s.synchronize(T).unwrap();
    assert_eq!(back, data);
}

/// CUDA IPC: a child process maps an allocation of this one through its handle, reads what
/// this process wrote and writes back what this one then reads; a handle of the process
/// itself, a handle of no allocation and one whose allocation was freed are refused, as is
/// exporting a mapping again.
#[test]
fn ipc_handles_map_another_process_memory() {
    const NAME: &str = "gpu::emu::tests::ipc_handles_map_another_process_memory";
    const LEN: usize = 10_007;
    let d = EmuDriver::new(1);
    let s = d.create_stream(0).unwrap();
    if in_child(NAME) {
        let hex = std::env::var("QCCL_GPU_EMU_IPC_HANDLE").unwrap();
        let mut h = [0u8; 64];
        for (i, b) in h.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
        }
        let opened = d.ipc_open(0, &IpcHandle(h), LEN);
        if std::env::var("QCCL_GPU_EMU_IPC_GONE").is_ok() {
            let e = opened.err().expect("a freed allocation's handle opened");
            assert!(e.to_string().contains("is gone"), "{e}");
            return;
        }
        let m = opened.unwrap();
        assert_eq!(d.locate(m.addr()).unwrap(), Memory::Device { ordinal: 0 });
        let mut got = vec![0u8; LEN];
        to_host(&*s, &mut got, m.addr()).unwrap();
        s.synchronize(T).unwrap();
        assert!(got == pattern(LEN, 7), "the exporter's bytes");
        let mine = pattern(LEN, 9);
        to_device(&*s, m.addr(), &mine).unwrap();
        s.synchronize(T).unwrap();
        let e = m.ipc_handle().unwrap_err();
        assert!(e.to_string().contains("not exported again"), "{e}");
        // Past the exporter's allocation.
        assert!(d.ipc_open(0, &IpcHandle(h), LEN + 1).is_err());
        return;
    }
    let m = d.alloc_device(0, LEN).unwrap();
    let mine = pattern(LEN, 7);
    to_device(&*s, m.addr(), &mine).unwrap();
    s.synchronize(T).unwrap();
    let h = m.ipc_handle().unwrap();
    let e = d.ipc_open(0, &h, LEN).err().expect("opened its own handle");
    assert!(e.to_string().contains("this very process"), "{e}");
    let e = d
        .ipc_open(0, &IpcHandle([7; 64]), LEN)
        .err()
        .expect("opened garbage");
    assert!(e.to_string().contains("not a CUDA IPC handle"), "{e}");
    let hex: String = h.0.iter().map(|b| format!("{b:02x}")).collect();
    let child = |gone: bool| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, NAME)
            .env("QCCL_GPU_EMU_IPC_HANDLE", &hex);
        if gone {
            cmd.env("QCCL_GPU_EMU_IPC_GONE", "1");
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    child(false);
    let mut got = vec![0u8; LEN];
    to_host(&*s, &mut got, m.addr()).unwrap();
    s.synchronize(T).unwrap();
    assert!(got == pattern(LEN, 9), "the child's bytes");
    drop(m);
    child(true);
}
