//! Ordered execution: every operation of a comm takes a ticket and runs when its turn comes,
//! so blocking calls (run inline, on the caller's thread) and async ones (run by the worker)
//! execute in submission order, as all ranks must see the same sequence.

use crate::coll::Engine;
use crate::error::{Error, Result};
use crossbeam_channel::{bounded, Receiver, Sender};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A queued operation; runs with its queue and its ticket.
pub type Job = Box<dyn FnOnce(&Queue, u64) + Send>;

struct Turns {
    next: u64,
    serving: u64,
    failed: Option<Error>,
    /// Threads waiting on `turn_changed`: with none, a finished turn skips the notify, which
    /// is a futex syscall every time (most calls find their turn already there).
    waiting: usize,
    /// The engine's `coded_calls` when its last operation ended.
    coded_done: u64,
    /// Of the operations submitted and not ended: the compressed calls of those that declared
    /// how many they run (`submit_declared`, `submit_holding` with a count), and how many
    /// others there are, which may run any number.
    declared: u64,
    undeclared: u64,
}

/// The op queue of one comm: tickets, the engine, and the failure state.
pub struct Queue {
    turns: Mutex<Turns>,
    turn_changed: Condvar,
    engine: Mutex<Engine>,
    jobs: Mutex<Option<Sender<(u64, Job)>>>,
    /// Set by `abort`; transports poll it.
    pub abort: Arc<AtomicBool>,
    rank: usize,
}

impl Queue {
    /// A queue running on `engine`; returns it and the receiving end for the worker.
    pub fn new(engine: Engine, abort: Arc<AtomicBool>) -> (Arc<Queue>, Receiver<(u64, Job)>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let q = Arc::new(Queue {
            turns: Mutex::new(Turns {
                next: 0,
                serving: 0,
                failed: None,
                waiting: 0,
                coded_done: 0,
                declared: 0,
                undeclared: 0,
            }),
            turn_changed: Condvar::new(),
            rank: engine.rank,
            engine: Mutex::new(engine),
            jobs: Mutex::new(Some(tx)),
            abort,
        });
        (q, rx)
    }

    fn lock_turns(&self) -> std::sync::MutexGuard<'_, Turns> {
        self.turns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the caller's thread, after every earlier operation.
    pub fn run<R>(&self, f: impl FnOnce(&mut Engine) -> Result<R>) -> Result<R> {
        self.run_counted(None, f)
    }

    /// As `run`, for an `f` that runs `coded` compressed calls: running another number fails
    /// the comm, as for `submit_holding`'s declarations, which the same calls made
    /// asynchronously use (so every test of the blocking calls checks the counts too).
    pub fn run_declared<R>(
        &self,
        coded: u64,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        self.run_counted(Some(coded), f)
    }

    fn run_counted<R>(
        &self,
        coded: Option<u64>,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        let ticket = {
            let mut t = self.lock_turns();
            t.next += 1;
            match coded {
                Some(n) => t.declared += n,
                None => t.undeclared += 1,
            }
            t.next - 1
        };
        self.execute(ticket, coded, f)
    }

    /// Queues `f` for the worker; the returned request yields its result.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> Result<R> + Send + 'static,
    ) -> Result<Request<R>> {
        self.submit_holding((), None, move |e, _| f(e))
    }

    /// As `submit`, with `hold` lent to `f` and dropped only once the outcome is recorded
    /// (a failure fails the comm first), or with the job if it never runs: a stream released
    /// by `hold`'s drop then finds the comm's error in place. `coded`: how many compressed
    /// calls `f` runs, when known now (a later `submit_declared` then need not wait for it
    /// to end); running another number fails the comm.
    pub fn submit_holding<R: Send + 'static, H: Send + 'static>(
        &self,
        mut hold: H,
        coded: Option<u64>,
        f: impl FnOnce(&mut Engine, &mut H) -> Result<R> + Send + 'static,
    ) -> Result<Request<R>> {
        let (tx, rx) = bounded(1);
        let job: Job = Box::new(move |q: &Queue, ticket: u64| {
            let r = q.execute(ticket, coded, |e| f(e, &mut hold));
            drop(hold);
            let _ = tx.send(r);
        });
        let mut t = self.lock_turns();
        self.send_job(&mut t, job)?;
        match coded {
            Some(n) => t.declared += n,
            None => t.undeclared += 1,
        }
        Ok(Request { rx, done: None })
    }

    /// Queues one compressed call whose step (the engine's `coded_calls` when it runs) is
    /// known now: `f` gets the engine, that step and what the caller sends on the returned
    /// channel (its device work, enqueued after this returns; the job waits for it at most
    /// `timeout`, and a dropped sender fails it). An earlier operation still running that
    /// did not declare its compressed calls (a C fusion group, an async call of the core
    /// that does not say, as `submit`'s) may run some: this first waits for it to end, at
    /// most `timeout`; None after that.
    pub fn submit_declared<H: Send + 'static>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&mut Engine, u64, H) -> Result<()> + Send + 'static,
    ) -> Result<Option<(u64, Sender<Result<H>>)>> {
        let mut t = self.lock_turns();
        let deadline = Instant::now().checked_add(timeout);
        while t.undeclared > 0 {
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => Duration::from_secs(3600),
            };
            if left.is_zero() {
                return Ok(None);
            }
            t.waiting += 1;
            t = self
                .turn_changed
                .wait_timeout(t, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            t.waiting -= 1;
        }
        let step = t.coded_done + t.declared;
        let (tx, rx) = bounded::<Result<H>>(1);
        let job: Job = Box::new(move |q: &Queue, ticket: u64| {
            let _ = q.execute(ticket, Some(1), |e| {
                let h = rx.recv_timeout(timeout).unwrap_or_else(|_| {
                    Err(Error::Timeout(format!(
                        "a compressed call's device work was not enqueued after {timeout:?}"
                    )))
                })?;
                f(e, step, h)
            });
        });
        self.send_job(&mut t, job)?;
        t.declared += 1;
        Ok(Some((step, tx)))
    }

    /// Hands `job` to the worker with the next ticket (`t` held, so tickets reach the
    /// worker in order).
    fn send_job(&self, t: &mut Turns, job: Job) -> Result<()> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let sender = jobs
            .as_ref()
            .ok_or_else(|| Error::InvalidUsage("the comm is being destroyed".into()))?;
        sender
            .send((t.next, job))
            .map_err(|_| Error::Internal("the comm's worker thread is gone".into()))?;
        t.next += 1;
        Ok(())
    }

    /// Worker side: runs one queued job with the ticket it was given at submission.
    pub fn run_job(&self, ticket: u64, job: Job) {
        job(self, ticket);
    }

    /// Runs `f` in turn `ticket`; `declared`: the compressed calls it said it runs.
    fn execute<R>(
        &self,
        ticket: u64,
        declared: Option<u64>,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        let mut t = self.lock_turns();
        while t.serving != ticket {
            t.waiting += 1;
            t = self.turn_changed.wait(t).unwrap_or_else(|e| e.into_inner());
            t.waiting -= 1;
        }
        let failed = t.failed.clone();
        drop(t);
        let mut coded = None;
        let result = match failed {
            Some(e) => Err(e),
            None => {
                let mut engine = self.engine.lock().unwrap_or_else(|e| e.into_inner());
                // A panic must not keep the turn forever (every later call would hang): it
                // fails the comm like any error. The engine is not used again after that.
                let before = engine.coded_calls;
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut engine)))
                    .unwrap_or_else(|p| {
                        let what = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "unknown panic".into());
                        Err(Error::Internal(format!("panic in a collective: {what}")))
                    });
                // Later calls' steps counted on this operation's declaration: one that ran
                // another number would give them steps no other rank uses.
                let ran = engine.coded_calls - before;
                let r = match declared {
                    Some(n) if r.is_ok() && ran != n => Err(Error::Internal(format!(
                        "an operation declared {n} compressed calls and ran {ran}"
                    ))),
                    _ => r,
                };
                if let Err(e) = &r {
                    // A failed collective leaves peers out of step: the comm is dead. Tell the
                    // peers why, so they fail fast with the reason instead of timing out.
                    crate::qlog!(Warn, "rank {}: {e}; the comm is now failed", self.rank);
                    engine.t.abort(&abort_reason(self.rank, e));
                    self.lock_turns().failed.get_or_insert_with(|| e.clone());
                }
                coded = Some(engine.coded_calls);
                r
            }
        };
        let mut t = self.lock_turns();
        if let Some(c) = coded {
            t.coded_done = c;
        }
        match declared {
            Some(n) => t.declared -= n,
            None => t.undeclared -= 1,
        }
        t.serving += 1;
        if t.waiting > 0 {
            self.turn_changed.notify_all();
        }
        result
    }

    /// The error that failed the comm, if any.
    pub fn failed(&self) -> Option<Error> {
        self.lock_turns().failed.clone()
    }

    /// Aborts: running and later operations fail; peers are told. Returns within ~1 s.
    pub fn abort(&self) {
        self.abort_because("abort() was called on this comm", "called abort()");
    }

    /// Aborts with `why` as this comm's error (if it had none) and `told` as what the peers
    /// hear ("rank r <told>").
    pub fn abort_because(&self, why: &str, told: &str) {
        self.abort.store(true, Ordering::SeqCst);
        self.lock_turns()
            .failed
            .get_or_insert_with(|| Error::Aborted(why.into()));
        // The running operation sees the flag within 100 ms and releases the engine.
        let deadline = Instant::now() + Duration::from_millis(900);
        loop {
            if let Ok(mut engine) = self.engine.try_lock() {
                engine.t.abort(&format!("rank {} {told}", self.rank));
                break;
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops accepting jobs; the worker exits after the queued ones.
    pub fn close(&self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// An operation in flight. It owns its buffers until `wait` hands them back.
#[must_use = "a request must be waited on to get its buffers and result"]
pub struct Request<R> {
    rx: Receiver<Result<R>>,
    done: Option<Result<R>>,
}

impl<R> Request<R> {
    /// Blocks until the operation finished; returns its buffers or its error.
    pub fn wait(mut self) -> Result<R> {
        if let Some(r) = self.done.take() {
            return r;
        }
        self.rx
            .recv()
            .unwrap_or_else(|_| Err(Error::Internal("the comm's worker thread exited".into())))
    }

    /// True when the operation has finished (`wait` then returns at once).
    pub fn test(&mut self) -> bool {
        if self.done.is_none() {
            self.done = self.rx.try_recv().ok();
        }
        self.done.is_some()
    }
}

/// What a failed rank tells its peers. A failure that came from a peer's abort passes that
/// abort's reason on unchanged: it names the rank that really failed (and the stalled rank a
/// timeout found), and does not grow by a line per hop until the end (the part naming the
/// culprit) is cut off.
fn abort_reason(rank: usize, e: &Error) -> String {
    match e {
        Error::Remote { msg, .. } => match msg.strip_prefix(crate::transport::PEER_ABORTED) {
            Some(reason) => reason.to_string(),
            None => format!("rank {rank} failed: {e}"),
        },
        _ => format!("rank {rank} failed: {e}"),
    }
}
