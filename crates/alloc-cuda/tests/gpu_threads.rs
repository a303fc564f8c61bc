//! GPU tests of one allocator used from many threads: blocks freed on
//! another thread than the one that allocated them, and sixteen threads in
//! every configuration, each on its own stream or all on one, handing
//! blocks to each other to be used on the receiver's stream and freed
//! there, each byte checked. `#[ignore]`d
//! like the rest of the GPU suite: `cargo xtask test-gpu` runs them
//! (`--ignored --test-threads=1`).

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use alloc_core::{human_bytes, AllocatorConfig, Policy, GIB, KIB, MIB};
use alloc_cuda::cudarc::driver::CudaStream;
use alloc_cuda::{CudaAllocator, DeviceBuffer};
use alloc_policy::{policy_names, AnyPolicy};
use common::{allocator, assert_drained, new_stream, under_sanitizer};

/// A buffer and the byte every element of it must hold.
type Filled = (DeviceBuffer<u8>, u8);

/// Reads `buf` back (on its stream) and checks every byte is `value`.
fn check(buf: &DeviceBuffer<u8>, value: u8, what: &str) {
    assert_bytes(&buf.copy_to_host().unwrap(), buf, value, what);
}

/// Checks every byte of `back`, read back from `buf`, is `value`.
fn assert_bytes(back: &[u8], buf: &DeviceBuffer<u8>, value: u8, what: &str) {
    if let Some(i) = back.iter().position(|&b| b != value) {
        panic!(
            "{what}: byte {i} of {} at {:#x} is {:#x}, expected {value:#x}",
            back.len(),
            buf.device_address(),
            back[i]
        );
    }
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn blocks_freed_on_another_thread_go_back_to_the_cache() {
    const BLOCKS: usize = 64;
    let size = |i: usize| 4 * KIB as usize * (1 + i % 16) + 100 * i;
    let alloc = allocator("");
    let stream = new_stream(&alloc);
    let (buffers, received) = mpsc::channel::<Filled>();
    let (pointers, pointers_received) = mpsc::channel::<u64>();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for i in 0..BLOCKS {
                let mut buf = alloc.alloc::<u8>(size(i), &stream).unwrap();
                buf.fill_bytes(i as u8 + 1).unwrap();
                buffers.send((buf, i as u8 + 1)).unwrap();
                pointers
                    .send(alloc.malloc(size(i) as u64, &stream).unwrap())
                    .unwrap();
            }
            drop((buffers, pointers));
        });
        scope.spawn(|| {
            for (buf, value) in received {
                check(&buf, value, "a buffer received from another thread");
                drop(buf); // freed here, allocated there
            }
            for p in pointers_received {
                alloc.free(p).unwrap();
            }
        });
    });
    assert_eq!(alloc.allocated_bytes().unwrap(), 0);
    let stats = alloc.stats().unwrap();
    assert_eq!(stats.num_alloc_retries, 0);
    // The blocks went back to the cache: the same requests on a third
    // thread are served from it, no new segment.
    let segments = stats.num_device_alloc;
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for i in 0..BLOCKS {
                let mut buf = alloc.alloc::<u8>(size(i), &stream).unwrap();
                buf.fill_bytes(0xEE).unwrap();
                check(&buf, 0xEE, "a block reused on a third thread");
            }
        });
    });
    println!(
        "{BLOCKS} buffers and {BLOCKS} raw blocks freed on another thread; \
         {segments} segment(s), none added on reuse from a third thread"
    );
    assert_eq!(alloc.stats().unwrap().num_device_alloc, segments);
    assert_drained(&alloc);
}

/// A xorshift generator: each thread's sequence of sizes and choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// 1 B .. 2 MiB log-uniform, one request in 16 of 4 .. 16 MiB.
    fn size(&mut self) -> usize {
        if self.below(16) == 0 {
            return (4 * MIB + self.below(12 * MIB)) as usize;
        }
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (u * (2.0 * MIB as f64).ln()).exp().max(1.0) as usize
    }
}

/// The configurations the stress runs: every compiled-in policy alone,
/// with stream-wait reuse, and with garbage collection under a memory
/// fraction; for policies that grow segments also expandable segments,
/// with `unmap_free_pages`, with `max_split_size_mb`, and the setting
/// recommended for FSDP (stream-wait reuse, expandable segments, unmapped
/// free pages). Each with whether a memory fraction applies.
fn stress_configs() -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for name in policy_names() {
        let base = format!("policy:{name}");
        let cfg = AllocatorConfig::parse(&base).unwrap();
        let grows = AnyPolicy::from_config(&cfg)
            .unwrap()
            .capabilities()
            .supports_growth;
        out.push((base.clone(), false));
        out.push((format!("{base},stream_wait_reuse:True"), false));
        out.push((format!("{base},garbage_collection_threshold:0.1"), true));
        if grows {
            out.push((format!("{base},expandable_segments:True"), false));
            out.push((
                format!("{base},expandable_segments:True,unmap_free_pages:True,unmap_page_mb:2"),
                false,
            ));
            out.push((
                format!("{base},expandable_segments:True,max_split_size_mb:64"),
                false,
            ));
            out.push((
                format!(
                    "{base},stream_wait_reuse:True,expandable_segments:True,unmap_free_pages:True"
                ),
                false,
            ));
        }
    }
    out
}

/// How the stress spreads its threads over streams.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Each thread its own stream.
    OwnStreams,
    /// Every thread on one stream.
    OneStream,
}

/// Threads of the stress.
const THREADS: usize = 16;

/// What the threads of one configuration share.
struct Shared<'a> {
    config: &'a str,
    layout: Layout,
    alloc: &'a CudaAllocator,
    /// One stream per thread, or one for all.
    streams: &'a [Arc<CudaStream>],
    /// Buffers any thread may take, check and free.
    mailbox: Mutex<Vec<Filled>>,
    /// Buffers handed to another thread, which used them on its stream.
    handed: AtomicUsize,
}

/// Most buffers in the mailbox at once.
const MAILBOX: usize = 16;

/// Orders later work on `stream` after the work queued so far on `other`.
fn after(stream: &Arc<CudaStream>, other: &Arc<CudaStream>) {
    if !Arc::ptr_eq(stream, other) {
        stream.join(other).unwrap();
    }
}

/// Reads `buf` back on `stream` (ordered after its own by the caller) and
/// checks every byte is `value`.
fn check_on(stream: &Arc<CudaStream>, buf: &DeviceBuffer<u8>, value: u8, what: &str) {
    let back = stream.clone_dtoh(buf).unwrap();
    stream.synchronize().unwrap();
    assert_bytes(&back, buf, value, what);
}

/// One thread's buffers waiting to be checked.
#[derive(Default)]
struct Held {
    /// Its own buffers, checked (on their stream) and freed in turn.
    live: VecDeque<Filled>,
    /// Copies it made on its stream of buffers freed at once, checked later.
    copies: VecDeque<Filled>,
}

impl Held {
    /// Keeps a copy, checking the oldest once there are more than a few.
    fn copied(&mut self, copy: Filled, what: &dyn Fn(&str) -> String) {
        self.copies.push_back(copy);
        if self.copies.len() > 4 {
            let (c, v) = self.copies.pop_front().unwrap();
            check(&c, v, &what("a copy made on another stream"));
        }
    }

    /// Checks everything still held.
    fn finish(self, what: &dyn Fn(&str) -> String) {
        for (b, v) in self.live {
            check(&b, v, &what("its own buffer at the end"));
        }
        for (c, v) in self.copies {
            check(&c, v, &what("a copy at the end"));
        }
    }
}

/// A buffer another thread filled (on its own stream) and handed over:
/// used on `mine` (`record_stream`) and freed here, in one of two ways:
/// copied on `mine` then overwritten there and freed at once, while both
/// may still run (the copy checked later: the block must not be reused
/// before `mine` is done with it); or read back on `mine`, checked and
/// freed.
fn use_handed(
    (mut buf, value): Filled,
    mine: &Arc<CudaStream>,
    alloc: &CudaAllocator,
    copy_now: bool,
    held: &mut Held,
    what: &dyn Fn(&str) -> String,
) {
    after(mine, buf.stream()); // the fill comes first
    buf.record_stream(mine).unwrap();
    if copy_now {
        let mut copy = alloc.alloc::<u8>(buf.len(), mine).unwrap();
        mine.memcpy_dtod(&buf, &mut copy).unwrap();
        mine.memset_zeros(&mut buf).unwrap();
        drop(buf); // allocated on another thread's stream, freed here
        held.copied((copy, value), what);
    } else {
        check_on(
            mine,
            &buf,
            value,
            &what("a buffer handed over by another thread"),
        );
    }
}

/// One thread of the stress: allocates on its stream, fills each buffer
/// with its own byte, and frees it in one of five ways: after reading it
/// back itself; after another thread took it from the mailbox and read it;
/// at once while another stream still copies it (`record_stream`, the copy
/// checked later); by a thread it is handed to ([`use_handed`]); or at the
/// end. `hand` sends a buffer to thread `i` (not `t`) and `inbox` receives
/// those handed to `t`.
fn stress_thread(
    t: usize,
    iters: usize,
    shared: &Shared<'_>,
    hand: Vec<mpsc::Sender<Filled>>,
    inbox: mpsc::Receiver<Filled>,
) {
    let (config, alloc) = (shared.config, shared.alloc);
    let n = shared.streams.len();
    let mine = &shared.streams[t % n];
    let other = &shared.streams[(t + 1) % n];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) << 32) ^ config.len() as u64);
    let mut held = Held::default();
    let layout = shared.layout;
    let what = |how: &str| format!("[{config}, {layout:?}] thread {t}: {how}");
    let mut received = 0;
    for i in 0..iters {
        let size = rng.size();
        let value = ((t * 37 + i) % 251) as u8 + 1;
        let mut buf = match alloc.alloc::<u8>(size, mine) {
            Ok(b) => b,
            Err(e) => panic!("{}", what(&format!("allocating {size} B: {e}"))),
        };
        buf.fill_bytes(value).unwrap();
        match rng.below(8) {
            0 => {
                // Another stream copies the buffer, which is freed at once:
                // its block must not be reused before the copy has run.
                after(other, mine); // the copy comes after the fill
                buf.record_stream(other).unwrap();
                let mut copy = alloc.alloc::<u8>(size, other).unwrap();
                other.memcpy_dtod(&buf, &mut copy).unwrap();
                drop(buf);
                held.copied((copy, value), &what);
            }
            1 => {
                let mut mailbox = shared.mailbox.lock().unwrap();
                if mailbox.len() < MAILBOX {
                    mailbox.push((buf, value));
                } else {
                    drop(mailbox);
                    held.live.push_back((buf, value));
                }
            }
            2 => {
                held.live.push_back((buf, value));
                let taken = shared.mailbox.lock().unwrap().pop();
                if let Some((b, v)) = taken {
                    check(&b, v, &what("a buffer from the mailbox"));
                    drop(b); // perhaps allocated by another thread
                }
            }
            3 | 4 => {
                let to = (t + 1 + rng.below(THREADS as u64 - 1) as usize) % THREADS;
                if let Err(mpsc::SendError(kept)) = hand[to].send((buf, value)) {
                    held.live.push_back(kept); // that thread failed already
                }
            }
            _ => held.live.push_back((buf, value)),
        }
        while let Ok(h) = inbox.try_recv() {
            use_handed(h, mine, alloc, rng.below(2) == 0, &mut held, &what);
            received += 1;
        }
        if held.live.len() > 8 {
            let (b, v) = held.live.pop_front().unwrap();
            check(&b, v, &what("its own buffer"));
        }
    }
    drop(hand);
    // The rest once every other thread is done handing over.
    for h in inbox {
        use_handed(h, mine, alloc, rng.below(2) == 0, &mut held, &what);
        received += 1;
    }
    shared.handed.fetch_add(received, Ordering::Relaxed);
    held.finish(&what);
}

/// [`THREADS`] threads of one allocator in configuration `config`, on
/// streams as `layout` says; every byte read back as written; everything
/// released at the end.
fn stress(config: &str, memory_fraction: bool, layout: Layout) {
    let iters = match (cfg!(debug_assertions), under_sanitizer()) {
        (true, _) => 20,
        (false, true) => 32,
        (false, false) => 100,
    };
    let alloc = allocator(config);
    if memory_fraction {
        // A 4 GiB limit: garbage collection starts at 10% of it.
        let (_, total) = alloc.diagnostics().mem_get_info().unwrap();
        alloc
            .set_memory_fraction((4.0 * GIB as f64 / total as f64).min(1.0))
            .unwrap();
    }
    let n_streams = match layout {
        Layout::OwnStreams => THREADS,
        Layout::OneStream => 1,
    };
    let streams: Vec<Arc<CudaStream>> = (0..n_streams).map(|_| new_stream(&alloc)).collect();
    let shared = Shared {
        config,
        layout,
        alloc: &alloc,
        streams: &streams,
        mailbox: Mutex::new(Vec::new()),
        handed: AtomicUsize::new(0),
    };
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel()).unzip();
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        for (t, inbox) in inboxes.into_iter().enumerate() {
            let (shared, hand) = (&shared, senders.clone());
            scope.spawn(move || stress_thread(t, iters, shared, hand, inbox));
        }
        drop(senders); // each inbox ends once every thread is done
    });
    for (b, v) in shared.mailbox.into_inner().unwrap() {
        check(
            &b,
            v,
            &format!("[{config}, {layout:?}] a buffer left in the mailbox"),
        );
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    alloc.diagnostics().validate().unwrap().unwrap();
    let handed = shared.handed.into_inner();
    let stats = alloc.stats().unwrap();
    println!(
        "[{config}, {layout:?}] {THREADS} threads x {iters} in {:.2} s, {handed} handed to \
         another thread: peak allocated {}, peak reserved {}, {} device allocs, {} device frees, \
         {} OOM retries, {} pages unmapped, events {:?}",
        t0.elapsed().as_secs_f64(),
        human_bytes(stats.allocated_bytes.all.peak as u64),
        human_bytes(stats.reserved_bytes.all.peak as u64),
        stats.num_device_alloc,
        stats.num_device_free,
        stats.num_alloc_retries,
        stats.page_moves.pages_unmapped,
        alloc.diagnostics().event_stats().unwrap(),
    );
    assert!(handed > 0, "no buffer was handed to another thread");
    assert_drained(&alloc);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn sixteen_threads_free_each_others_blocks_in_every_configuration() {
    let configs = stress_configs();
    println!("{} configurations, two stream layouts each", configs.len());
    for (config, memory_fraction) in &configs {
        for layout in [Layout::OwnStreams, Layout::OneStream] {
            stress(config, *memory_fraction, layout);
        }
    }
}
