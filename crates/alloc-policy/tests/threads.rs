//! Frees on a thread other than the allocating one, as PyTorch's callers
//! make them (a tensor made on one thread, dropped on another): several
//! threads (4, 8 and 16) share one engine behind a mutex, as `alloc-cuda`
//! holds it, each allocating on its own stream and handing its blocks to
//! the next thread, which uses them on its stream (`record_stream`) and
//! frees them. A variant puts every thread on one stream, so that the free
//! of a block races with the other threads' mallocs on the stream that may
//! take it back at once. The shadow (`alloc_policy::testing::shadow`)
//! watches every block handed out and freed, under every compiled-in
//! policy and setting.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Barrier, Mutex};
use std::thread;

use alloc_core::{Allocation, SimStreams, StreamId};
use alloc_policy::testing::ops::log_size;
use alloc_policy::testing::shadow::Shadow;
use alloc_policy::testing::{configs, engine_with, xorshift, SimEngine};

/// How one run spreads its threads over streams.
#[derive(Debug, Clone, Copy)]
struct Layout {
    threads: u64,
    /// Blocks each thread allocates.
    blocks: u64,
    /// Every thread allocates on one stream (the receiving thread uses a
    /// block it was handed on a second one) instead of each on its own.
    one_stream: bool,
}

impl Layout {
    /// The stream thread `t` allocates on.
    fn alloc_stream(&self, t: u64) -> StreamId {
        StreamId(if self.one_stream { 1 } else { t + 1 })
    }

    /// The stream thread `t` uses the blocks it is handed on.
    fn use_stream(&self, t: u64) -> StreamId {
        StreamId(if self.one_stream { 2 } else { t + 1 })
    }

    /// How many streams the run uses (ids 1 ..= this).
    fn streams(&self) -> u64 {
        if self.one_stream {
            2
        } else {
            self.threads
        }
    }
}

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

/// Thread `t`: allocates `layout.blocks` blocks, sending each to the next
/// thread, and frees what the previous one sends it, then, once that
/// thread is done, the rest. Every thread starts at once (`start`), so
/// that their operations interleave from the first.
fn worker(
    shared: &Mutex<Shared>,
    layout: Layout,
    t: u64,
    start: &Barrier,
    to_next: Sender<u64>,
    inbox: Receiver<u64>,
) -> Result<(), String> {
    let (stream, use_stream) = (layout.alloc_stream(t), layout.use_stream(t));
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15 ^ (t + 1));
    let lock = || shared.lock().expect("no thread panics holding the engine");
    start.wait();
    for _ in 0..layout.blocks {
        let size = log_size((next() % 24_000) as f64 / 1000.0);
        let a = lock().malloc(size, stream)?;
        to_next
            .send(a.addr)
            .map_err(|_| "the next thread stopped early".to_string())?;
        if let Ok(addr) = inbox.try_recv() {
            lock().use_and_free(addr, use_stream, next().is_multiple_of(3))?;
        }
        if next().is_multiple_of(16) {
            lock().complete(StreamId(1 + next() % layout.streams()))?;
        }
    }
    drop(to_next);
    for addr in inbox {
        lock().use_and_free(addr, use_stream, next().is_multiple_of(3))?;
    }
    Ok(())
}

/// Runs the threads of `layout` over one engine for `config`, then checks
/// that every block came back and all memory went back to the device.
fn run_threads(config: &str, layout: Layout) -> Result<(), String> {
    let e = engine_with(config, 64 << 30, SimStreams::new())?;
    let shared = Mutex::new(Shared {
        e,
        shadow: Shadow::default(),
        since_check: 0,
    });
    let n = layout.threads as usize;
    let start = Barrier::new(n);
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..n).map(|_| channel::<u64>()).unzip();
    thread::scope(|s| {
        let mut senders: Vec<Option<Sender<u64>>> = senders.into_iter().map(Some).collect();
        let handles: Vec<_> = inboxes
            .into_iter()
            .enumerate()
            .map(|(t, inbox)| {
                // Thread t sends to thread t + 1.
                let to_next = senders[(t + 1) % n].take().expect("one sender each");
                let (shared, start) = (&shared, &start);
                s.spawn(move || worker(shared, layout, t as u64, start, to_next, inbox))
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

/// Runs `layout` under every compiled-in policy and setting.
fn run_every_config(layout: Layout) {
    for config in configs() {
        run_threads(&config, layout).unwrap_or_else(|msg| panic!("{config}, {layout:?}: {msg}"));
    }
}

// About 400 to 500 blocks per run at every thread count: each run walks
// the heap every few operations, so the block count sets the test's time.

#[test]
fn four_threads_free_each_others_blocks_under_every_policy() {
    run_every_config(Layout {
        threads: 4,
        blocks: 120,
        one_stream: false,
    });
}

#[test]
fn eight_threads_free_each_others_blocks_under_every_policy() {
    run_every_config(Layout {
        threads: 8,
        blocks: 55,
        one_stream: false,
    });
}

#[test]
fn sixteen_threads_free_each_others_blocks_under_every_policy() {
    run_every_config(Layout {
        threads: 16,
        blocks: 28,
        one_stream: false,
    });
}

#[test]
fn frees_race_with_mallocs_of_sixteen_threads_on_one_stream() {
    run_every_config(Layout {
        threads: 16,
        blocks: 28,
        one_stream: true,
    });
}
