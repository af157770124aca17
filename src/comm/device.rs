//! Calls whose buffers may be device memory (the C ABI's and Python's way in): where every
//! buffer lives is found before any byte moves, and device buffers go through the comm's
//! staging (`gpu::staging`) on the device of its first such call, as an NCCL comm belongs to
//! one device.

use super::Comm;
use crate::error::{Error, Result};
use crate::gpu::staging::{self, CallBuf, Staging};
use std::ffi::c_void;

impl Comm {
    /// As `on_buffers` on a caller's stream (not null), returning once the work is enqueued
    /// (NCCL's semantics): `run` runs later on the comm's worker with the engine and the
    /// staged addresses; the caller's stream waits for it. Its failure fails the comm
    /// (`async_error`) and still releases the stream; on a failed comm the call is refused
    /// with the comm's error before anything is enqueued. A call with host buffers waits as
    /// `on_buffers` does (the caller may change them once it returns), and so does every
    /// call of a comm with another rank in this process. `coded`: how many compressed
    /// calls `run` makes, when the caller knows (a compressed all-reduce with the codecs on
    /// the GPU made after it then need not wait for it to end: `Queue::submit_declared`).
    ///
    /// # Safety
    /// Each buffer must stay valid until the caller's stream passes the call, and `stream`
    /// be a live stream of the buffers' device.
    #[doc(hidden)]
    pub unsafe fn on_stream(
        &self,
        bufs: &[CallBuf],
        stream: *mut c_void,
        coded: Option<u64>,
        run: impl FnOnce(&mut crate::coll::Engine, &[*mut u8]) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        let (driver, place) = match crate::gpu::select::driver() {
            Ok(d) => {
                let place = staging::locate(&*d, bufs)?;
                (d, place)
            }
            // Refused by `on_buffers`, saying why.
            Err(_) => return unsafe { self.on_buffers(bufs, stream, |_| Ok(())) },
        };
        let host = bufs
            .iter()
            .zip(&place.device)
            .any(|(b, d)| b.len > 0 && d.is_none());
        let ordinal = match place.ordinal()? {
            Some(o) if !host => o,
            // Host memory the caller may change once this returns: the call waits.
            // SAFETY: the caller's promise, passed on.
            _ => {
                return unsafe {
                    self.on_buffers(bufs, stream, |hosts| self.execute(|e| run(e, hosts)))
                }
            }
        };
        if self.place.process_peers {
            // A rank of this comm in this process may have to enqueue work or allocate
            // memory before joining the call: behind this rank's held stream that would wait
            // forever (CUDA's implicit synchronisation, a copy from pageable memory), so the
            // stream is never held; the call waits (NCCL allows one rank per device).
            // SAFETY: the caller's promise, passed on.
            return unsafe {
                self.on_buffers(bufs, stream, |hosts| self.execute(|e| run(e, hosts)))
            };
        }
        self.refuse_if_failed()?;
        let finish = {
            let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            let st = self.staging_on(&mut guard, driver, ordinal)?;
            // SAFETY: the caller's promise, passed on.
            unsafe { st.start(bufs, &place, stream)? }
        };
        // The request is not kept: the stream and `async_error` report the outcome. `finish`
        // releases the stream when dropped, after a failure is recorded.
        let _ = self
            .queue
            .submit_holding(finish, coded, move |e, f| f.run(|hosts| run(e, hosts)))?;
        Ok(())
    }

    /// An error unless `ordinal` is the comm's device (set here by its first device call).
    pub(super) fn check_device(&self, ordinal: usize) -> Result<()> {
        let mine = *self.device.get_or_init(|| ordinal);
        if mine != ordinal {
            return Err(Error::invalid(format!(
                "buffers on device {ordinal}, but this comm's device is {mine} (the device of \
                 its first call on device memory)"
            )));
        }
        Ok(())
    }

    /// The comm's staging in `guard` on device `ordinal`, made on first use; an error when
    /// the comm's device is another.
    pub(super) fn staging_on<'a>(
        &self,
        guard: &'a mut Option<Staging>,
        driver: std::sync::Arc<dyn crate::gpu::driver::Driver>,
        ordinal: usize,
    ) -> Result<&'a mut Staging> {
        self.check_device(ordinal)?;
        if guard.is_none() {
            *guard = Some(self.new_staging(driver, ordinal)?);
        }
        Ok(guard.as_mut().expect("set above"))
    }

    pub(super) fn new_staging(
        &self,
        driver: std::sync::Arc<dyn crate::gpu::driver::Driver>,
        ordinal: usize,
    ) -> Result<Staging> {
        crate::qlog!(
            Info,
            "rank {}: device buffers on {} device {ordinal} ({}), staged through page-locked \
             memory",
            self.rank,
            driver.kind(),
            driver.device(ordinal).map(|d| d.name).unwrap_or_default()
        );
        Staging::new(
            driver,
            ordinal,
            self.config.timeout,
            self.pinned_pool.clone(),
        )
    }

    /// What the page-locked pool of this comm's calls on callers' streams holds and did so
    /// far (readable while a call waits for room in it).
    #[doc(hidden)]
    pub fn staging_stats(&self) -> staging::PoolStats {
        self.pinned_pool.stats()
    }

    /// As `on_buffers` with the legacy default stream, but queued behind the comm's earlier
    /// operations and returning at once (the C ABI's non-blocking and grouped calls): where
    /// each buffer lives is found now, the copies in, `run` and the copies out happen in the
    /// comm's turn, and the request ends once the results are on the device. `coded`: how
    /// many compressed calls `run` makes, when the caller knows (as `on_stream`'s).
    ///
    /// # Safety
    /// Each buffer must be valid for its reads and writes until the request has ended.
    #[doc(hidden)]
    pub unsafe fn submit_on_buffers(
        &self,
        bufs: Vec<CallBuf>,
        coded: Option<u64>,
        run: impl FnOnce(&mut crate::coll::Engine, &[*mut u8]) -> Result<()> + Send + 'static,
    ) -> Result<crate::Request<()>> {
        let found = match crate::gpu::select::driver() {
            Ok(driver) => {
                let place = staging::locate(&*driver, &bufs)?;
                place.ordinal()?.map(|o| (driver, place, o))
            }
            Err(_) => None,
        };
        let (driver, place, ordinal) = match found {
            Some(f) => f,
            None => {
                let hosts: Vec<usize> = bufs.iter().map(|b| b.addr as usize).collect();
                return self.queue.submit_holding((), coded, move |e, _| {
                    let hosts: Vec<*mut u8> = hosts.into_iter().map(|a| a as *mut u8).collect();
                    run(e, &hosts)
                });
            }
        };
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit_staged(driver, ordinal, bufs, place, coded, run) }
    }

    /// Queues `run` on the staged `bufs` (placed as `place` says, on device `ordinal`) as
    /// `submit_on_buffers` does; with no buffer it only orders the call after the work on the
    /// legacy default stream (the GPU codecs' queued form).
    ///
    /// # Safety
    /// As `submit_on_buffers`.
    pub(super) unsafe fn submit_staged(
        &self,
        driver: std::sync::Arc<dyn crate::gpu::driver::Driver>,
        ordinal: usize,
        bufs: Vec<CallBuf>,
        place: staging::Placement,
        coded: Option<u64>,
        run: impl FnOnce(&mut crate::coll::Engine, &[*mut u8]) -> Result<()> + Send + 'static,
    ) -> Result<crate::Request<()>> {
        self.submit_with_staging(driver, ordinal, coded, move |e, st| {
            // SAFETY: the caller's promise, passed on; the legacy default stream.
            unsafe { st.run(&bufs, &place, std::ptr::null_mut(), |hosts| run(e, hosts)) }
        })
    }

    /// Queues `run` with the staging of this comm's queued calls (made now, on device
    /// `ordinal`, by the first such call), in the comm's turn.
    pub(super) fn submit_with_staging(
        &self,
        driver: std::sync::Arc<dyn crate::gpu::driver::Driver>,
        ordinal: usize,
        coded: Option<u64>,
        run: impl FnOnce(&mut crate::coll::Engine, &mut Staging) -> Result<()> + Send + 'static,
    ) -> Result<crate::Request<()>> {
        self.check_device(ordinal)?;
        let staging = self.queued_staging.clone();
        let first = if staging.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            Some(self.new_staging(driver, ordinal)?)
        } else {
            None
        };
        self.queue.submit_holding((), coded, move |e, _| {
            let mut guard = staging.lock().unwrap_or_else(|p| p.into_inner());
            if guard.is_none() {
                *guard = first;
            }
            let st = guard.as_mut().expect("made before the call was queued");
            run(e, st)
        })
    }

    /// True when any of `bufs` is device memory (false without a usable driver).
    #[doc(hidden)]
    pub fn device_buffers(&self, bufs: &[CallBuf]) -> Result<bool> {
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(false);
        };
        Ok(staging::locate(&*driver, bufs)?.ordinal()?.is_some())
    }

    /// Runs a call on `bufs`: `run` gets an address standing for each (itself when it is
    /// host memory, a page-locked copy when it is device memory: copied in when the call
    /// reads it, after the work enqueued on `stream` so far, and out when it writes it,
    /// before this returns). `stream` is a `CUstream` of the buffers' device or null (the
    /// legacy default stream); without a usable driver every buffer is host memory and
    /// `stream` must be null.
    ///
    /// # Safety
    /// Each buffer must be valid for the reads and writes it declares (host or device memory
    /// of `len` bytes) until this returns, and `stream` null or a live stream of that device.
    #[doc(hidden)]
    pub unsafe fn on_buffers<R>(
        &self,
        bufs: &[CallBuf],
        stream: *mut c_void,
        run: impl FnOnce(&[*mut u8]) -> Result<R>,
    ) -> Result<R> {
        let driver = match crate::gpu::select::driver() {
            Ok(d) => d,
            Err(_) if stream.is_null() => return run(&as_given(bufs)),
            Err(e) => {
                return Err(Error::Unsupported(format!(
                    "stream {stream:p}: no device buffers here ({e}); pass NULL (host memory, \
                     the call completes before returning)"
                )))
            }
        };
        let place = staging::locate(&*driver, bufs)?;
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let ordinal = match (place.ordinal()?, guard.as_ref()) {
            (None, _) if stream.is_null() => return run(&as_given(bufs)),
            (Some(o), _) => o,
            // Host buffers with a stream: they wait for its earlier work on the comm's device.
            (None, Some(s)) => s.ordinal(),
            (None, None) => 0,
        };
        let st = self.staging_on(&mut guard, driver, ordinal)?;
        // SAFETY: the caller's promise, passed on.
        unsafe { st.run(bufs, &place, stream, run) }
    }
}

/// The buffers' own addresses, standing for themselves (host memory).
pub(super) fn as_given(bufs: &[CallBuf]) -> Vec<*mut u8> {
    bufs.iter().map(|b| b.addr as *mut u8).collect()
}

/// A call's buffers as the device path sees them, from its send buffer (None: in place) and
/// receive buffer, each (address, bytes): send read, then recv written (and read when in
/// place).
pub(super) fn send_recv(send: Option<(u64, usize)>, recv: (u64, usize)) -> Vec<CallBuf> {
    let buf = |(addr, len), reads, writes| CallBuf {
        addr,
        len,
        reads,
        writes,
    };
    let mut bufs: Vec<CallBuf> = send.map(|s| buf(s, true, false)).into_iter().collect();
    bufs.push(buf(recv, send.is_none(), true));
    bufs
}
