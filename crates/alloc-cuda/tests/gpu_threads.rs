//! GPU tests of one allocator used from many threads: blocks freed on
//! another thread than the one that allocated them, and sixteen threads in
//! every configuration, each on its own stream or all on one, handing
//! blocks to each other to be used on the receiver's stream and freed
//! there, each byte checked; the same stress over `StreamEngines` (an
//! engine per stream, the C library's `engine_per_stream`). `#[ignore]`d
//! like the rest of the GPU suite: `cargo xtask test-gpu` runs them
//! (`--ignored --test-threads=1`).

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use alloc_core::{human_bytes, AllocatorConfig, Policy, Stats, GIB, KIB, MIB};
use alloc_cuda::cudarc::driver::{result, CudaStream};
use alloc_cuda::{CudaAllocator, DeviceBuffer, StreamEngines};
use alloc_policy::{policy_names, AnyPolicy};
use common::{allocator, assert_drained, new_stream, under_sanitizer};

/// Checks every byte of `back`, read back from the block at `address`, is
/// `value`.
fn assert_bytes(back: &[u8], address: u64, value: u8, what: &str) {
    if let Some(i) = back.iter().position(|&b| b != value) {
        panic!(
            "{what}: byte {i} of {} at {address:#x} is {:#x}, expected {value:#x}",
            back.len(),
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
    let (buffers, received) = mpsc::channel::<Filled<DeviceBuffer<u8>>>();
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
                check_block(&buf, value, "a buffer received from another thread");
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
                check_block(&buf, 0xEE, "a block reused on a third thread");
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
/// with `unmap_free_pages`, with `max_split_size_mb`, the peak rule for
/// FSDP (stream-wait reuse, expandable segments, unmapped free pages) and
/// the named settings that move pages at a level (`multi-stream`, past
/// 1.03x the allocated peak; `budget`, at the device's memory, and under a
/// memory fraction at it). Each with whether a memory fraction applies.
fn stress_configs() -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for name in policy_names() {
        let base = format!("policy:{name}");
        out.push((base.clone(), false));
        out.push((format!("{base},stream_wait_reuse:True"), false));
        out.push((format!("{base},garbage_collection_threshold:0.1"), true));
        if grows(&base) {
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
            out.push((format!("multi-stream,{base}"), false));
            out.push((format!("budget,{base}"), true));
        }
    }
    out
}

/// The configurations of the stress over `StreamEngines`: every compiled-in
/// policy alone and under a memory fraction (one limit for all the
/// engines), and for policies that grow segments also expandable segments
/// and `max_split_size_mb`; the settings whose decisions span streams are
/// refused there.
fn stream_engine_configs() -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for name in policy_names() {
        let base = format!("policy:{name}");
        out.push((base.clone(), false));
        out.push((base.clone(), true));
        if grows(&base) {
            out.push((format!("{base},expandable_segments:True"), false));
            out.push((
                format!("{base},expandable_segments:True,max_split_size_mb:64"),
                false,
            ));
        }
        // An engine for each stream and thread: the one-stream layout too
        // has an engine a thread.
        out.push((
            format!("{base},engine_per_stream:True,engine_per_thread:True"),
            false,
        ));
    }
    out
}

/// Whether the policy of `config` grows segments in place.
fn grows(config: &str) -> bool {
    let cfg = AllocatorConfig::parse(config).unwrap();
    AnyPolicy::from_config(&cfg)
        .unwrap()
        .capabilities()
        .supports_growth
}

/// A 4 GiB limit as a fraction of a device of `total` bytes: garbage
/// collection starts at 10% of it.
fn four_gib_of(total: u64) -> f64 {
    (4.0 * GIB as f64 / total as f64).min(1.0)
}

/// What the stress asks of an allocator: blocks for use on a stream.
trait Pool: Sync {
    /// A block of this allocator, freed when dropped.
    type Block: Block;

    /// A block of `len` bytes for use on `stream`.
    fn alloc(&self, len: usize, stream: &Arc<CudaStream>) -> Self::Block;
}

/// What the stress does with a block, all of it stream-ordered.
trait Block: Send + Sized {
    /// Its device address.
    fn address(&self) -> u64;
    /// Its size in bytes.
    fn len(&self) -> usize;
    /// The stream it was allocated on.
    fn stream(&self) -> &Arc<CudaStream>;
    /// Sets every byte to `value` on its stream.
    fn fill(&mut self, value: u8);
    /// Marks it as used on `stream` too (`record_stream`).
    fn record_stream(&mut self, stream: &Arc<CudaStream>);
    /// Copies it into `dst` on `on`.
    fn copy_into(&self, dst: &mut Self, on: &Arc<CudaStream>);
    /// Zeroes it on `on`.
    fn zero_on(&mut self, on: &Arc<CudaStream>);
    /// Reads it back on `on` and waits for `on`.
    fn read_on(&self, on: &Arc<CudaStream>) -> Vec<u8>;
}

impl Pool for CudaAllocator {
    type Block = DeviceBuffer<u8>;

    fn alloc(&self, len: usize, stream: &Arc<CudaStream>) -> DeviceBuffer<u8> {
        match CudaAllocator::alloc::<u8>(self, len, stream) {
            Ok(b) => b,
            Err(e) => panic!("allocating {len} B: {e}"),
        }
    }
}

impl Block for DeviceBuffer<u8> {
    fn address(&self) -> u64 {
        self.device_address()
    }
    fn len(&self) -> usize {
        DeviceBuffer::len(self)
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceBuffer::stream(self)
    }
    fn fill(&mut self, value: u8) {
        self.fill_bytes(value).unwrap();
    }
    fn record_stream(&mut self, stream: &Arc<CudaStream>) {
        DeviceBuffer::record_stream(self, stream).unwrap();
    }
    fn copy_into(&self, dst: &mut Self, on: &Arc<CudaStream>) {
        on.memcpy_dtod(self, dst).unwrap();
    }
    fn zero_on(&mut self, on: &Arc<CudaStream>) {
        on.memset_zeros(self).unwrap();
    }
    fn read_on(&self, on: &Arc<CudaStream>) -> Vec<u8> {
        let back = on.clone_dtoh(self).unwrap();
        on.synchronize().unwrap();
        back
    }
}

/// A block of [`StreamEngines`], given back to it when dropped.
struct EngineBlock<'a> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    engines: &'a StreamEngines,
}

/// [`StreamEngines`] borrowed for the stress: its blocks borrow it.
struct EngineRef<'a>(&'a StreamEngines);

impl<'a> Pool for EngineRef<'a> {
    type Block = EngineBlock<'a>;

    fn alloc(&self, len: usize, stream: &Arc<CudaStream>) -> EngineBlock<'a> {
        match self.0.malloc(len as u64, stream) {
            Ok(ptr) => EngineBlock {
                ptr,
                len,
                stream: stream.clone(),
                engines: self.0,
            },
            Err(e) => panic!("allocating {len} B: {e}"),
        }
    }
}

impl EngineBlock<'_> {
    /// Binds the device's context to this thread for the raw driver calls
    /// below (cudarc's stream methods bind it themselves).
    fn bind(&self) {
        self.engines.context().bind_to_thread().unwrap();
    }
}

impl Drop for EngineBlock<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.engines.free(self.ptr) {
            panic!("freeing {:#x}: {e}", self.ptr);
        }
    }
}

impl Block for EngineBlock<'_> {
    fn address(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn fill(&mut self, value: u8) {
        self.bind();
        // SAFETY: ptr..ptr+len is a live block of the engines (freed only
        // when self drops); the stream is of the same context.
        unsafe { result::memset_d8_async(self.ptr, value, self.len, self.stream.cu_stream()) }
            .unwrap();
    }
    fn record_stream(&mut self, stream: &Arc<CudaStream>) {
        self.engines.record_stream(self.ptr, stream).unwrap();
    }
    fn copy_into(&self, dst: &mut Self, on: &Arc<CudaStream>) {
        assert!(dst.len >= self.len);
        self.bind();
        // SAFETY: both blocks are live for len bytes (borrowed here), on
        // `on` of the same context; the caller ordered `on` after their
        // earlier work.
        unsafe { result::memcpy_dtod_async(dst.ptr, self.ptr, self.len, on.cu_stream()) }.unwrap();
    }
    fn zero_on(&mut self, on: &Arc<CudaStream>) {
        self.bind();
        // SAFETY: as in `fill`, on `on`.
        unsafe { result::memset_d8_async(self.ptr, 0, self.len, on.cu_stream()) }.unwrap();
    }
    fn read_on(&self, on: &Arc<CudaStream>) -> Vec<u8> {
        self.bind();
        let mut back = vec![0u8; self.len];
        // SAFETY: the block is live for len bytes; `back` is a host buffer
        // of len bytes that outlives the copy (the stream is waited for
        // before it is read or dropped).
        unsafe { result::memcpy_dtoh_async(&mut back, self.ptr, on.cu_stream()) }.unwrap();
        on.synchronize().unwrap();
        back
    }
}

/// Reads `block` back on `stream` (ordered after its own by the caller)
/// and checks every byte is `value`.
fn check_on<B: Block>(stream: &Arc<CudaStream>, block: &B, value: u8, what: &str) {
    assert_bytes(&block.read_on(stream), block.address(), value, what);
}

/// Reads `block` back on its own stream and checks every byte is `value`.
fn check_block<B: Block>(block: &B, value: u8, what: &str) {
    check_on(block.stream(), block, value, what);
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

/// A block and the byte every element of it must hold.
type Filled<B> = (B, u8);

/// What the threads of one configuration share.
struct Shared<'a, P: Pool> {
    config: &'a str,
    layout: Layout,
    alloc: &'a P,
    /// One stream per thread, or one for all.
    streams: &'a [Arc<CudaStream>],
    /// Blocks any thread may take, check and free.
    mailbox: Mutex<Vec<Filled<P::Block>>>,
    /// Blocks handed to another thread, which used them on its stream.
    handed: AtomicUsize,
    /// Threads that allocated on another thread's stream too (the copies
    /// of `record_stream`): under `engine_per_thread` each such thread has
    /// an engine on that stream as well.
    allocated_elsewhere: AtomicUsize,
}

/// Most blocks in the mailbox at once.
const MAILBOX: usize = 16;

/// Orders later work on `stream` after the work queued so far on `other`.
fn after(stream: &Arc<CudaStream>, other: &Arc<CudaStream>) {
    if !Arc::ptr_eq(stream, other) {
        stream.join(other).unwrap();
    }
}

/// One thread's blocks waiting to be checked.
struct Held<B> {
    /// Its own blocks, checked (on their stream) and freed in turn.
    live: VecDeque<Filled<B>>,
    /// Copies it made on its stream of blocks freed at once, checked later.
    copies: VecDeque<Filled<B>>,
}

impl<B: Block> Held<B> {
    fn new() -> Self {
        Held {
            live: VecDeque::new(),
            copies: VecDeque::new(),
        }
    }

    /// Keeps a copy, checking the oldest once there are more than a few.
    fn copied(&mut self, copy: Filled<B>, what: &dyn Fn(&str) -> String) {
        self.copies.push_back(copy);
        if self.copies.len() > 4 {
            let (c, v) = self.copies.pop_front().unwrap();
            check_block(&c, v, &what("a copy made on another stream"));
        }
    }

    /// Checks everything still held.
    fn finish(self, what: &dyn Fn(&str) -> String) {
        for (b, v) in self.live {
            check_block(&b, v, &what("its own block at the end"));
        }
        for (c, v) in self.copies {
            check_block(&c, v, &what("a copy at the end"));
        }
    }
}

/// A block another thread filled (on its own stream) and handed over:
/// used on `mine` (`record_stream`) and freed here, in one of two ways:
/// copied on `mine` then overwritten there and freed at once, while both
/// may still run (the copy checked later: the block must not be reused
/// before `mine` is done with it); or read back on `mine`, checked and
/// freed.
fn use_handed<P: Pool>(
    (mut block, value): Filled<P::Block>,
    mine: &Arc<CudaStream>,
    alloc: &P,
    copy_now: bool,
    held: &mut Held<P::Block>,
    what: &dyn Fn(&str) -> String,
) {
    after(mine, block.stream()); // the fill comes first
    block.record_stream(mine);
    if copy_now {
        let mut copy = alloc.alloc(block.len(), mine);
        block.copy_into(&mut copy, mine);
        block.zero_on(mine);
        drop(block); // allocated on another thread's stream, freed here
        held.copied((copy, value), what);
    } else {
        check_on(
            mine,
            &block,
            value,
            &what("a block handed over by another thread"),
        );
    }
}

/// One thread of the stress: allocates on its stream, fills each block
/// with its own byte, and frees it in one of five ways: after reading it
/// back itself; after another thread took it from the mailbox and read it;
/// at once while another stream still copies it (`record_stream`, the copy
/// checked later); by a thread it is handed to ([`use_handed`]); or at the
/// end. `hand` sends a block to thread `i` (not `t`) and `inbox` receives
/// those handed to `t`.
fn stress_thread<P: Pool>(
    t: usize,
    iters: usize,
    shared: &Shared<'_, P>,
    hand: Vec<mpsc::Sender<Filled<P::Block>>>,
    inbox: mpsc::Receiver<Filled<P::Block>>,
) {
    let (config, alloc) = (shared.config, shared.alloc);
    let n = shared.streams.len();
    let mine = &shared.streams[t % n];
    let other = &shared.streams[(t + 1) % n];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) << 32) ^ config.len() as u64);
    let mut held = Held::new();
    let layout = shared.layout;
    let what = |how: &str| format!("[{config}, {layout:?}] thread {t}: {how}");
    let mut received = 0;
    let mut elsewhere = false;
    for i in 0..iters {
        let size = rng.size();
        let value = ((t * 37 + i) % 251) as u8 + 1;
        let mut block = alloc.alloc(size, mine);
        block.fill(value);
        match rng.below(8) {
            0 => {
                // Another stream copies the block, which is freed at once:
                // its memory must not be reused before the copy has run.
                after(other, mine); // the copy comes after the fill
                block.record_stream(other);
                if !elsewhere && !Arc::ptr_eq(mine, other) {
                    elsewhere = true;
                    shared.allocated_elsewhere.fetch_add(1, Ordering::Relaxed);
                }
                let mut copy = alloc.alloc(size, other);
                block.copy_into(&mut copy, other);
                drop(block);
                held.copied((copy, value), &what);
            }
            1 => {
                let mut mailbox = shared.mailbox.lock().unwrap();
                if mailbox.len() < MAILBOX {
                    mailbox.push((block, value));
                } else {
                    drop(mailbox);
                    held.live.push_back((block, value));
                }
            }
            2 => {
                held.live.push_back((block, value));
                let taken = shared.mailbox.lock().unwrap().pop();
                if let Some((b, v)) = taken {
                    check_block(&b, v, &what("a block from the mailbox"));
                    drop(b); // perhaps allocated by another thread
                }
            }
            3 | 4 => {
                let to = (t + 1 + rng.below(THREADS as u64 - 1) as usize) % THREADS;
                if let Err(mpsc::SendError(kept)) = hand[to].send((block, value)) {
                    held.live.push_back(kept); // that thread failed already
                }
            }
            _ => held.live.push_back((block, value)),
        }
        while let Ok(h) = inbox.try_recv() {
            use_handed(h, mine, alloc, rng.below(2) == 0, &mut held, &what);
            received += 1;
        }
        if held.live.len() > 8 {
            let (b, v) = held.live.pop_front().unwrap();
            check_block(&b, v, &what("its own block"));
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

/// Allocations per thread of the stress.
fn stress_iters() -> usize {
    match (cfg!(debug_assertions), under_sanitizer()) {
        (true, _) => 20,
        (false, true) => 32,
        (false, false) => 100,
    }
}

/// [`THREADS`] threads of `alloc` in configuration `config` on `streams`,
/// every byte read back as written; returns what [`Ran`] holds. The caller
/// checks the allocator afterwards.
fn run_stress<P: Pool>(
    alloc: &P,
    config: &str,
    layout: Layout,
    streams: &[Arc<CudaStream>],
) -> Ran {
    let shared = Shared {
        config,
        layout,
        alloc,
        streams,
        mailbox: Mutex::new(Vec::new()),
        handed: AtomicUsize::new(0),
        allocated_elsewhere: AtomicUsize::new(0),
    };
    let (senders, inboxes): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel()).unzip();
    let t0 = Instant::now();
    let iters = stress_iters();
    std::thread::scope(|scope| {
        for (t, inbox) in inboxes.into_iter().enumerate() {
            let (shared, hand) = (&shared, senders.clone());
            scope.spawn(move || stress_thread(t, iters, shared, hand, inbox));
        }
        drop(senders); // each inbox ends once every thread is done
    });
    for (b, v) in shared.mailbox.into_inner().unwrap() {
        check_block(
            &b,
            v,
            &format!("[{config}, {layout:?}] a block left in the mailbox"),
        );
    }
    for s in streams {
        s.synchronize().unwrap();
    }
    let handed = shared.handed.into_inner();
    assert!(handed > 0, "no block was handed to another thread");
    Ran {
        secs: t0.elapsed().as_secs_f64(),
        handed,
        allocated_elsewhere: shared.allocated_elsewhere.into_inner(),
    }
}

/// What one run of the stress did.
struct Ran {
    /// Seconds it took.
    secs: f64,
    /// Blocks handed to another thread (at least one).
    handed: usize,
    /// Threads that allocated on another thread's stream as well as their own.
    allocated_elsewhere: usize,
}

/// How many streams `layout` asks for.
fn stream_count(layout: Layout) -> usize {
    match layout {
        Layout::OwnStreams => THREADS,
        Layout::OneStream => 1,
    }
}

/// The line the stress prints for a configuration.
fn report(config: &str, layout: Layout, ran: &Ran, stats: &Stats) -> String {
    let Ran { secs, handed, .. } = ran;
    format!(
        "[{config}, {layout:?}] {THREADS} threads x {} in {secs:.2} s, {handed} handed to \
         another thread: peak allocated {}, peak reserved {}, {} device allocs, {} device frees, \
         {} OOM retries, {} pages unmapped",
        stress_iters(),
        human_bytes(stats.allocated_bytes.all.peak as u64),
        human_bytes(stats.reserved_bytes.all.peak as u64),
        stats.num_device_alloc,
        stats.num_device_free,
        stats.num_alloc_retries,
        stats.page_moves.pages_unmapped,
    )
}

/// The stress over one [`CudaAllocator`] in configuration `config`;
/// invariants hold and everything is released at the end.
fn stress(config: &str, memory_fraction: bool, layout: Layout) {
    let alloc = allocator(config);
    if memory_fraction {
        let (_, total) = alloc.diagnostics().mem_get_info().unwrap();
        alloc.set_memory_fraction(four_gib_of(total)).unwrap();
    }
    let streams: Vec<Arc<CudaStream>> = (0..stream_count(layout))
        .map(|_| new_stream(&alloc))
        .collect();
    let ran = run_stress(&alloc, config, layout, &streams);
    alloc.diagnostics().validate().unwrap().unwrap();
    let stats = alloc.stats().unwrap();
    println!(
        "{}, events {:?}",
        report(config, layout, &ran, &stats),
        alloc.diagnostics().event_stats().unwrap(),
    );
    assert_drained(&alloc);
}

/// The stress over [`StreamEngines`] in configuration `config`: an engine
/// for each stream, blocks freed by threads of other streams' engines; the
/// device's statistics add up (every block freed, nothing reserved after
/// `empty_cache`, the peak at least what one thread held at once), and
/// under a memory fraction the engines together never reserved past it.
fn stress_stream_engines(config: &str, memory_fraction: bool, layout: Layout) {
    let engines = match StreamEngines::with_config_str(0, config) {
        Ok(e) => e,
        Err(e) => panic!("StreamEngines with `{config}`: {e}"),
    };
    if memory_fraction {
        let total = engines.context().total_mem().unwrap() as u64;
        engines.set_memory_fraction(four_gib_of(total)).unwrap();
    }
    let streams: Vec<Arc<CudaStream>> = (0..stream_count(layout))
        .map(|_| engines.context().new_stream().expect("cuStreamCreate"))
        .collect();
    let ran = run_stress(&EngineRef(&engines), config, layout, &streams);
    let stats = engines.stats().unwrap();
    println!(
        "{}, {} engines",
        report(config, layout, &ran, &stats),
        engines.engine_count()
    );
    assert_eq!(
        stats.allocated_bytes.all.current, 0,
        "blocks still allocated"
    );
    assert_eq!(stats.allocation.all.current, 0, "blocks still counted");
    assert!(stats.allocated_bytes.all.peak > 0);
    if let Some(limit) = engines.memory_limit() {
        assert!(
            stats.reserved_bytes.all.peak as u64 <= limit,
            "[{config}] the engines reserved {} together, past the limit {limit}",
            stats.reserved_bytes.all.peak
        );
    }
    // An engine a stream, or under engine_per_thread one for each stream a
    // thread allocated on: its own, and another's for the copies it made.
    let expected_engines = match (layout, engines.config().engine_per_thread) {
        (Layout::OneStream, false) => 1,
        (Layout::OwnStreams, false) | (Layout::OneStream, true) => THREADS,
        (Layout::OwnStreams, true) => THREADS + ran.allocated_elsewhere,
    };
    assert_eq!(engines.engine_count(), expected_engines);
    engines.empty_cache().unwrap();
    assert_eq!(
        engines.reserved_bytes().unwrap(),
        0,
        "segments still reserved"
    );
    assert_eq!(engines.stats().unwrap().segment.all.current, 0);
}

/// Runs `stress` for each configuration, in both stream layouts.
fn in_both_layouts(configs: &[(String, bool)], stress: fn(&str, bool, Layout)) {
    println!("{} configurations, two stream layouts each", configs.len());
    for (config, memory_fraction) in configs {
        for layout in [Layout::OwnStreams, Layout::OneStream] {
            stress(config, *memory_fraction, layout);
        }
    }
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn sixteen_threads_free_each_others_blocks_in_every_configuration() {
    in_both_layouts(&stress_configs(), stress);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test-gpu"]
fn sixteen_threads_over_an_engine_per_stream_free_each_others_blocks() {
    in_both_layouts(&stream_engine_configs(), stress_stream_engines);
}
