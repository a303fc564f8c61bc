//! Unmaps run on a worker thread, off the allocating one (`unmap_worker:true`).
//!
//! A page move of `unmap_free_pages` takes the physical page under an idle
//! free block and maps it where the block being allocated lies. The driver
//! lets one physical allocation be mapped at two addresses, so the new
//! mapping need not wait for the old one to go: the allocating thread maps
//! and sets access (about 30 µs a page on an H100), and the unmap (about
//! 20 µs more) is queued here and done by a worker
//! (`benchmarks/vmm_cost/move_overlap.cu`: 50 µs a moved 4 MiB page on the
//! caller, 32 µs with the unmap on the worker, no contention between them).
//! Beside PyTorch's host-bound steps on an H100 the two threads' driver
//! calls did slow each other (GPT-2 generation: more time in moves on the
//! allocating thread, a longer mean step), so the worker is off by default.
//!
//! What is queued is an address range whose memory nothing uses any more
//! (idle, or detached and done). Until its unmap has run, the range is
//! *pending*: mapping it again, or freeing the reservation it lies in,
//! first waits for the queue ([`DeferredUnmaps::settle`]). A driver error
//! met by the worker is kept and returned by the next `settle` (or
//! [`DeferredUnmaps::take_error`]), so none is lost.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::error::CudaError;
use crate::lock::lock_consistent;

/// The driver call a worker makes: unmap `[addr, addr + size)`.
pub(crate) type UnmapFn = Arc<dyn Fn(u64, u64) -> Result<(), CudaError> + Send + Sync>;

/// What the worker reports back: how many jobs it finished, the first
/// error it met.
#[derive(Default)]
struct Progress {
    done: u64,
    error: Option<CudaError>,
}

/// The worker thread and what it shares with the caller.
struct Worker {
    jobs: Option<Sender<(u64, u64)>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn spawn(unmap: UnmapFn) -> std::io::Result<Worker> {
        let (jobs, queue) = channel::<(u64, u64)>();
        let progress = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
        let shared = Arc::clone(&progress);
        let thread = std::thread::Builder::new()
            .name("gpu-alloc-unmap".into())
            .spawn(move || {
                for (addr, size) in queue {
                    // A panic counts as a failed job: the worker lives on and
                    // a settle waiting for the job returns.
                    let result = panic::catch_unwind(AssertUnwindSafe(|| unmap(addr, size)))
                        .unwrap_or(Err(CudaError::Unsupported(
                            "an unmap on the unmap worker thread panicked",
                        )));
                    let (lock, cv) = &*shared;
                    let mut p = lock_consistent(lock);
                    p.done += 1;
                    if let Err(e) = result {
                        p.error.get_or_insert(e);
                    }
                    cv.notify_all();
                }
            })?;
        Ok(Worker {
            jobs: Some(jobs),
            progress,
            thread: Some(thread),
        })
    }

    fn done(&self) -> u64 {
        lock_consistent(&self.progress.0).done
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the worker once the queue is empty, so
        // nothing queued is left mapped (an error then has no caller left).
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Unmaps queued to a worker thread (started at the first one), with the
/// ranges not yet unmapped. Without an [`UnmapFn`] (no device to bind on
/// another thread) nothing is deferred: [`DeferredUnmaps::unmap`] runs the
/// call it is given on the caller.
#[derive(Default)]
pub(crate) struct DeferredUnmaps {
    unmap: Option<UnmapFn>,
    worker: Option<Worker>,
    /// Jobs handed to the worker so far.
    sent: u64,
    /// Pending ranges: start -> (size, job number).
    pending: BTreeMap<u64, (u64, u64)>,
    /// Job numbers in order, with their start, to drop finished ones.
    order: VecDeque<(u64, u64)>,
}

impl fmt::Debug for DeferredUnmaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeferredUnmaps")
            .field("deferred", &self.unmap.is_some())
            .field("sent", &self.sent)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl DeferredUnmaps {
    /// Unmaps deferred to a worker that calls `unmap`.
    pub(crate) fn new(unmap: UnmapFn) -> Self {
        DeferredUnmaps {
            unmap: Some(unmap),
            ..DeferredUnmaps::default()
        }
    }

    /// Unmaps `[addr, addr + size)`, whose memory nothing uses any more: on
    /// the worker, or with `inline` on the caller when nothing is deferred
    /// (or the worker thread cannot start).
    pub(crate) fn unmap(
        &mut self,
        addr: u64,
        size: u64,
        inline: impl FnOnce(u64, u64) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let Some(unmap) = &self.unmap else {
            return inline(addr, size);
        };
        if self.worker.is_none() {
            match Worker::spawn(Arc::clone(unmap)) {
                Ok(w) => self.worker = Some(w),
                Err(_) => return inline(addr, size),
            }
        }
        let worker = self.worker.as_ref().expect("worker started");
        let sent = worker.jobs.as_ref().map(|jobs| jobs.send((addr, size)));
        if !matches!(sent, Some(Ok(()))) {
            return inline(addr, size); // the worker is gone
        }
        self.sent += 1;
        self.pending.insert(addr, (size, self.sent));
        self.order.push_back((self.sent, addr));
        self.forget_finished();
        Ok(())
    }

    /// Whether part of `[addr, addr + size)` may still be mapped by a
    /// queued unmap.
    pub(crate) fn pending_in(&mut self, addr: u64, size: u64) -> bool {
        self.forget_finished();
        // Ranges do not overlap: the last one starting before the span's
        // end meets the span if and only if any does.
        self.pending
            .range(..addr.saturating_add(size))
            .next_back()
            .is_some_and(|(&start, &(len, _))| start.saturating_add(len) > addr)
    }

    /// [`DeferredUnmaps::settle`] when part of `[addr, addr + size)` may
    /// still be mapped by a queued unmap: before that span is mapped again
    /// or its reservation freed.
    pub(crate) fn settle_over(&mut self, addr: u64, size: u64) -> Result<(), CudaError> {
        if self.pending_in(addr, size) {
            self.settle()?;
        }
        Ok(())
    }

    /// Waits until every queued unmap has run; returns the first error the
    /// worker met since the last call.
    pub(crate) fn settle(&mut self) -> Result<(), CudaError> {
        if let Some(w) = &self.worker {
            let (lock, cv) = &*w.progress;
            let mut p = lock_consistent(lock);
            while p.done < self.sent {
                p = cv.wait(p).unwrap_or_else(PoisonError::into_inner);
            }
        }
        self.pending.clear();
        self.order.clear();
        self.take_error()
    }

    /// The first error a queued unmap met, if any (without waiting).
    pub(crate) fn take_error(&mut self) -> Result<(), CudaError> {
        let Some(w) = &self.worker else {
            return Ok(());
        };
        let mut p = lock_consistent(&w.progress.0);
        p.error.take().map_or(Ok(()), Err)
    }

    /// Drops the pending ranges whose unmap has run.
    fn forget_finished(&mut self) {
        let Some(w) = &self.worker else { return };
        let done = w.done();
        while let Some(&(job, addr)) = self.order.front() {
            if job > done {
                break;
            }
            self.order.pop_front();
            if self.pending.get(&addr).is_some_and(|&(_, j)| j == job) {
                self.pending.remove(&addr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::Receiver;

    /// The ranges the worker unmapped, in order.
    type Seen = Arc<Mutex<Vec<(u64, u64)>>>;

    /// A range whose unmap panics on the worker.
    const PANICS_AT: u64 = 0xdead;

    /// Deferred unmaps whose worker records each range and, for ranges
    /// starting at `fail_at`, fails; `gate` holds the worker until a value
    /// is sent on it.
    fn recording(fail_at: u64) -> (DeferredUnmaps, Seen, Sender<()>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (open, gate) = channel::<()>();
        let gate: Arc<Mutex<Receiver<()>>> = Arc::new(Mutex::new(gate));
        let log = Arc::clone(&seen);
        let unmap: UnmapFn = Arc::new(move |addr, size| {
            let _ = gate.lock().unwrap().recv();
            log.lock().unwrap().push((addr, size));
            match addr {
                a if a == fail_at => Err(CudaError::Unsupported("unmap refused")),
                PANICS_AT => panic!("unmap of {addr:#x}"),
                _ => Ok(()),
            }
        });
        (DeferredUnmaps::new(unmap), seen, open)
    }

    #[test]
    fn queued_ranges_are_pending_until_their_unmap_ran() {
        let (mut d, seen, open) = recording(u64::MAX);
        d.unmap(100, 10, |_, _| panic!("deferred")).unwrap();
        d.unmap(200, 10, |_, _| panic!("deferred")).unwrap();
        assert!(d.pending_in(105, 1));
        assert!(d.pending_in(90, 11), "a span reaching into the range");
        assert!(d.pending_in(0, 1000));
        assert!(!d.pending_in(110, 90), "the gap between the ranges");
        assert!(!d.pending_in(90, 10));
        open.send(()).unwrap();
        open.send(()).unwrap();
        d.settle().unwrap();
        assert!(!d.pending_in(0, 1000));
        assert_eq!(*seen.lock().unwrap(), vec![(100, 10), (200, 10)]);
    }

    #[test]
    fn finished_unmaps_stop_being_pending_without_a_settle() {
        let (mut d, _seen, open) = recording(u64::MAX);
        d.unmap(100, 10, |_, _| panic!("deferred")).unwrap();
        open.send(()).unwrap();
        // The worker runs on its own: wait for it through its progress.
        while d.pending_in(100, 10) {
            std::thread::yield_now();
        }
        assert!(d.order.is_empty());
    }

    #[test]
    fn a_worker_error_reaches_the_next_settle_once() {
        let (mut d, _seen, open) = recording(300);
        d.unmap(300, 10, |_, _| panic!("deferred")).unwrap();
        open.send(()).unwrap();
        assert!(matches!(d.settle(), Err(CudaError::Unsupported(_))));
        assert!(d.settle().is_ok(), "reported once");
    }

    #[test]
    fn a_panicking_unmap_is_an_error_and_the_worker_goes_on() {
        let (mut d, seen, open) = recording(u64::MAX);
        d.unmap(PANICS_AT, 10, |_, _| panic!("deferred")).unwrap();
        d.unmap(400, 10, |_, _| panic!("deferred")).unwrap();
        open.send(()).unwrap();
        open.send(()).unwrap();
        assert!(matches!(d.settle(), Err(CudaError::Unsupported(_))));
        assert_eq!(seen.lock().unwrap().last(), Some(&(400, 10)));
        assert!(!d.pending_in(0, 1000));
    }

    #[test]
    fn without_a_worker_function_the_caller_unmaps() {
        let mut d = DeferredUnmaps::default();
        let mut called = None;
        d.unmap(7, 3, |a, s| {
            called = Some((a, s));
            Ok(())
        })
        .unwrap();
        assert_eq!(called, Some((7, 3)));
        assert!(!d.pending_in(0, 100));
        assert!(d.settle().is_ok());
    }

    #[test]
    fn dropping_waits_for_the_queue() {
        let (mut d, seen, open) = recording(u64::MAX);
        for i in 0..3 {
            d.unmap(i * 100, 10, |_, _| panic!("deferred")).unwrap();
            open.send(()).unwrap();
        }
        drop(d);
        assert_eq!(seen.lock().unwrap().len(), 3);
    }
}
