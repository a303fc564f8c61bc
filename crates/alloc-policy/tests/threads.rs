//! Frees on a thread other than the allocating one, as PyTorch's callers
//! make them (a tensor made on one thread, dropped on another): several
//! threads share one engine behind a mutex, as `alloc-cuda` holds it, each
//! allocating on its own stream and handing its blocks to the next thread,
//! which uses them on its stream (`record_stream`) and frees them. The
//! shadow (`alloc_policy::testing::shadow`) watches every block handed out
//! and freed, under every compiled-in policy and setting.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;
use std::thread;

use alloc_core::{Allocation, SimStreams, StreamId};
use alloc_policy::testing::ops::log_size;
use alloc_policy::testing::shadow::Shadow;
use alloc_policy::testing::{configs, engine_with, xorshift, SimEngine};

const THREADS: u64 = 4;
/// Blocks each thread allocates.
const BLOCKS: u64 = 150;

/// The engine and its shadow, locked together: every change to one is
/// checked against the other before the lock is given up.
struct Shared {
    e: SimEngine,
    shadow: Shadow,
    /// Operations since the last full check.
    since_check: u32,
}

impl Shared {
    /// Checks the engine's invariants every few operations (each check
    /// walks the whole heap).
    fn check(&mut self) -> Result<(), String> {
        self.since_check += 1;
        if self.since_check >= 8 {
            self.since_check = 0;
            self.shadow.check_mapped(&self.e)?;
            self.e.validate()?;
        }
        Ok(())
    }

    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<Allocation, String> {
        let a = self
            .e
            .malloc(size, stream)
            .map_err(|err| format!("malloc({size}) on stream {stream}: {err}"))?;
        self.shadow.allocated(&mut self.e, a)?;
        self.check()?;
        Ok(a)
    }

    /// Uses `addr` on `stream` (sometimes), then frees it.
    fn use_and_free(&mut self, addr: u64, stream: StreamId, record: bool) -> Result<(), String> {
        if record {
            self.e
                .record_stream(addr, stream)
                .map_err(|err| format!("record_stream({addr:#x}): {err}"))?;
            self.shadow.recorded(&mut self.e, addr, stream);
        }
        self.shadow.freeing(&mut self.e, addr, false)?;
        self.e
            .free(addr)
            .map_err(|err| format!("free({addr:#x}) on another thread: {err}"))?;
        self.check()
    }

    /// The GPU finishes `stream`'s work and the engine polls its events.
    fn complete(&mut self, stream: StreamId) -> Result<(), String> {
        self.e.streams_mut().complete_stream(stream);
        self.e
            .process_events()
            .map_err(|err| format!("process_events: {err}"))?;
        self.check()
    }
}

/// Thread `t`: allocates [`BLOCKS`] blocks on its stream, sending each to
/// the next thread, and frees what the previous one sends it, then, once
/// that thread is done, the rest.
fn worker(
    shared: &Mutex<Shared>,
    t: u64,
    to_next: Sender<u64>,
    inbox: Receiver<u64>,
) -> Result<(), String> {
    let stream = StreamId(t + 1);
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15 ^ (t + 1));
    let lock = || shared.lock().expect("no thread panics holding the engine");
    for _ in 0..BLOCKS {
        let size = log_size((next() % 24_000) as f64 / 1000.0);
        let a = lock().malloc(size, stream)?;
        to_next
            .send(a.addr)
            .map_err(|_| "the next thread stopped early".to_string())?;
        if let Ok(addr) = inbox.try_recv() {
            lock().use_and_free(addr, stream, next().is_multiple_of(3))?;
        }
        if next().is_multiple_of(16) {
            lock().complete(StreamId(1 + next() % THREADS))?;
        }
    }
    drop(to_next);
    for addr in inbox {
        lock().use_and_free(addr, stream, next().is_multiple_of(3))?;
    }
    Ok(())
}

/// Runs the threads over one engine for `config`, then checks that every
/// block came back and all memory went back to the device.
fn run_threads(config: &str) -> Result<(), String> {
    let e = engine_with(config, 64 << 30, SimStreams::new())?;
    let shared = Mutex::new(Shared {
        e,
        shadow: Shadow::default(),
        since_check: 0,
    });
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| channel::<u64>()).unzip();
    thread::scope(|s| {
        let mut senders: Vec<Option<Sender<u64>>> = senders.into_iter().map(Some).collect();
        let handles: Vec<_> = inboxes
            .into_iter()
            .enumerate()
            .map(|(t, inbox)| {
                // Thread t sends to thread t + 1.
                let to_next = senders[(t + 1) % THREADS as usize]
                    .take()
                    .expect("one sender each");
                let shared = &shared;
                s.spawn(move || worker(shared, t as u64, to_next, inbox))
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "a thread panicked".to_string())?)
    })?;
    let Shared { mut e, .. } = shared.into_inner().map_err(|_| "poisoned")?;
    if e.stats().allocation.all.current != 0 {
        return Err(format!(
            "{} blocks never freed",
            e.stats().allocation.all.current
        ));
    }
    e.streams_mut().complete_all();
    e.empty_cache()
        .map_err(|err| format!("empty_cache: {err}"))?;
    if e.memory().used() != 0 {
        return Err(format!("{} bytes left on the device", e.memory().used()));
    }
    e.validate()
}

#[test]
fn blocks_freed_on_other_threads_under_every_policy() {
    for config in configs() {
        run_threads(&config).unwrap_or_else(|msg| panic!("{config}: {msg}"));
    }
}
