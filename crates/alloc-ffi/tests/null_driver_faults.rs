//! The C entry points when a driver call fails, over the null driver
//! (`crates/alloc-cuda/null-driver`), which can make any of its functions
//! fail at a chosen call: every call of every such function that a
//! sequence of C calls makes is failed in turn, and each time the sequence
//! must end in errors (never a caught panic, `GPUALLOC_ERR_INTERNAL`), and
//! the next calls must all work on state that passes its invariant check.
//!
//! `#[ignore]`d: they need the null driver on the library path, as
//! `bash crates/alloc-cuda/null-driver/run.sh --tests` (CI) sets it. Run
//! alone there, they fail rather than skip when the null driver is missing.

mod common;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::null_mut;
use std::sync::Mutex;

use alloc_cuda::CudaAllocator;
use alloc_ffi::api::*;
use alloc_ffi::*;

/// The tests share the process-wide allocator and the driver's one armed
/// failure: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const MIB: isize = 1 << 20;
const POOL: (u64, u64) = (77, 1);
/// `CUDA_ERROR_OUT_OF_MEMORY` and `CUDA_ERROR_UNKNOWN`.
const CU_OUT_OF_MEMORY: c_int = 2;
const CU_UNKNOWN: c_int = 999;

/// The null driver's failure-injection entry points.
struct NullDriver {
    fail_at: unsafe extern "C" fn(*const c_char, i64, c_int) -> c_int,
    calls: unsafe extern "C" fn(*const c_char) -> i64,
    armed: unsafe extern "C" fn() -> c_int,
    function: unsafe extern "C" fn(c_int) -> *const c_char,
}

impl NullDriver {
    /// The loaded driver's, if it is the null driver; else the test fails
    /// when `GPUALLOC_NULL_DRIVER` says it should be there, or skips.
    fn load() -> Option<NullDriver> {
        let found = alloc_cuda::driver_available().then(|| {
            // SAFETY: the driver library is present (checked above); cudarc
            // loads it once and keeps it for the process. The symbols, when
            // there, are the null driver's functions of these signatures.
            unsafe {
                let lib = alloc_cuda::cudarc::driver::sys::culib();
                Some(NullDriver {
                    fail_at: *lib.get(b"null_cuda_fail_at").ok()?,
                    calls: *lib.get(b"null_cuda_calls").ok()?,
                    armed: *lib.get(b"null_cuda_armed").ok()?,
                    function: *lib.get(b"null_cuda_function").ok()?,
                })
            }
        });
        let nd = found.flatten();
        if nd.is_none() {
            let why = "the null driver is not the loaded libcuda";
            assert!(std::env::var_os("GPUALLOC_NULL_DRIVER").is_none(), "{why}");
            common::missing_tool(why);
        }
        nd
    }

    /// Every function the null driver can fail.
    fn functions(&self) -> Vec<String> {
        (0..)
            // SAFETY: the null driver's function; NULL past the last name.
            .map(|i| unsafe { (self.function)(i) })
            .take_while(|p| !p.is_null())
            // SAFETY: a static NUL-terminated name.
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .collect()
    }

    /// Makes the `nth` call of `name` from now fail with `code`.
    fn fail(&self, name: &str, nth: i64, code: c_int) {
        let c = CString::new(name).unwrap();
        // SAFETY: a NUL-terminated name valid for the call.
        assert_eq!(
            unsafe { (self.fail_at)(c.as_ptr(), nth, code) },
            0,
            "{name}"
        );
    }

    /// No failure armed (and calls counted from now on).
    fn disarm(&self) {
        // SAFETY: NULL disarms.
        unsafe { (self.fail_at)(std::ptr::null(), 0, 0) };
    }

    /// Calls of `name` counted so far.
    fn calls(&self, name: &str) -> i64 {
        let c = CString::new(name).unwrap();
        // SAFETY: a NUL-terminated name valid for the call.
        unsafe { (self.calls)(c.as_ptr()) }
    }

    /// Whether the armed failure has not happened yet.
    fn armed(&self) -> bool {
        // SAFETY: no arguments.
        unsafe { (self.armed)() != 0 }
    }
}

/// A stream handle for the null driver, which never dereferences one.
fn side_stream() -> *mut c_void {
    static STORAGE: [u64; 2] = [0; 2];
    STORAGE.as_ptr() as *mut c_void
}

fn last_code() -> c_int {
    gpualloc_last_error_code()
}

/// What one run of [`sequence`] saw: the failed steps and their codes, and
/// the blocks it handed out.
#[derive(Default)]
struct Run {
    failures: Vec<(&'static str, c_int, String)>,
    blocks: Vec<*mut c_void>,
}

impl Run {
    fn failed(&mut self, step: &'static str, code: c_int) {
        let p = gpualloc_last_error();
        let msg = match p.is_null() {
            true => String::new(),
            // SAFETY: a NUL-terminated message valid until the next call.
            false => unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned(),
        };
        self.failures.push((step, code, msg));
    }

    fn int(&mut self, step: &'static str, code: c_int) {
        if code != GPUALLOC_OK {
            self.failed(step, code);
        }
    }

    fn ptr<T>(&mut self, step: &'static str, p: *mut T) -> *mut T {
        if p.is_null() {
            self.failed(step, last_code());
        }
        p
    }

    fn string(&mut self, step: &'static str, p: *mut c_char) {
        if self.ptr(step, p).is_null() {
            return;
        }
        // SAFETY: a string of the library, freed once.
        unsafe { gpualloc_string_free(p) };
    }

    fn malloc(&mut self, step: &'static str, size: isize, stream: *mut c_void) -> *mut c_void {
        let p = self.ptr(step, gpualloc_malloc(size, 0, stream));
        if !p.is_null() {
            self.blocks.push(p);
        }
        p
    }

    fn free(&mut self, p: *mut c_void) {
        if !p.is_null() {
            gpualloc_free(p, 0, 0, null_mut());
        }
    }
}

/// Device blocks on two streams, one used by the other stream; a private
/// pool created, used and released; the cache emptied; pinned host memory
/// used by a stream, freed, reused, unpinned; statistics and a snapshot.
fn sequence() -> Run {
    let mut r = Run::default();
    let (s0, s1) = (null_mut(), side_stream());
    let a = r.malloc("malloc a", MIB, s0);
    let b = r.malloc("malloc b", 40 * MIB, s1);
    if !a.is_null() {
        r.int("record_stream", gpualloc_record_stream(a, 0, s1));
    }
    r.free(a);
    r.free(b);
    let c = r.malloc("malloc c", MIB, s0);
    r.int("retain_pool", gpualloc_retain_pool(0, POOL.0, POOL.1));
    let in_pool = gpualloc_malloc_in_pool(2 * MIB, 0, s0, POOL.0, POOL.1);
    if !r.ptr("malloc_in_pool", in_pool).is_null() {
        r.blocks.push(in_pool);
    }
    r.free(in_pool);
    r.int("release_pool", gpualloc_release_pool(0, POOL.0, POOL.1));
    r.free(c);
    r.int("empty_cache", gpualloc_empty_cache(0));

    let h = r.ptr("host_alloc", gpualloc_host_alloc(3 << 20));
    if !h.is_null() {
        r.int("host_record_stream", gpualloc_host_record_stream(h, s1));
        r.int("host_free", gpualloc_host_free(h));
    }
    let h = r.ptr("host_alloc again", gpualloc_host_alloc(3 << 20));
    if !h.is_null() {
        r.int("host_free again", gpualloc_host_free(h));
    }
    r.int("host_empty_cache", gpualloc_host_empty_cache());
    register_and_unregister(&mut r);
    r.string("host_stats_json", gpualloc_host_stats_json());
    r.string("memory_stats_json", gpualloc_memory_stats_json(0));
    r.string("snapshot_text", gpualloc_snapshot_text(0));
    r
}

/// Memory of the caller's pinned in place and unpinned. A range whose
/// unregister failed stays registered: its memory is leaked, so that no
/// later buffer can have its address.
fn register_and_unregister(r: &mut Run) {
    let mut buf = vec![0u8; 3 << 20];
    let ptr = buf.as_mut_ptr().cast::<c_void>();
    // SAFETY: `buf` lives until the unregister below, or for good.
    let code = unsafe { gpualloc_host_register(ptr, buf.len(), GPUALLOC_HOST_REGISTER_MAPPED) };
    r.int("host_register", code);
    if code != GPUALLOC_OK {
        return;
    }
    // SAFETY: registered above; nothing uses it.
    let code = unsafe { gpualloc_host_unregister(ptr) };
    r.int("host_unregister", code);
    if code != GPUALLOC_OK {
        std::mem::forget(buf);
    }
}

/// The pinned host counters (`gpualloc_host_stats_json`).
fn host_stats() -> serde_json::Map<String, serde_json::Value> {
    let p = gpualloc_host_stats_json();
    assert!(!p.is_null(), "{}", common::last_error());
    // SAFETY: a string of the library, read then freed once.
    let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned();
    unsafe { gpualloc_string_free(p) };
    serde_json::from_str(&text).unwrap()
}

/// The process-wide allocator the C entry points use.
fn allocator() -> CudaAllocator {
    CudaAllocator::global(0).expect("the allocator of device 0")
}

/// After a run with a failure: every block still live is freed, a clean run
/// succeeds in every step, nothing is left allocated, the invariants hold.
fn check_recovered(after: &str, run: Run) {
    let after = format!("{after} (failed: {:?})", run.failures);
    let alloc = allocator();
    for p in run.blocks {
        if alloc.diagnostics().allocation(p as u64).unwrap().is_some() {
            gpualloc_free(p, 0, 0, null_mut());
        }
    }
    let clean = sequence();
    assert!(
        clean.failures.is_empty(),
        "after {after}, the next calls failed: {:?}",
        clean.failures
    );
    assert_eq!(
        alloc.diagnostics().validate().unwrap(),
        Ok(()),
        "after {after}"
    );
    assert_eq!(
        alloc.diagnostics().awaiting_events().unwrap(),
        0,
        "after {after}"
    );
    let stats = alloc.stats().unwrap();
    assert_eq!(stats.allocated_bytes.all.current, 0, "after {after}");
    assert_eq!(stats.reserved_bytes.all.current, 0, "after {after}");
}

#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn every_driver_call_failing_in_turn_leaves_the_next_calls_working() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(nd) = NullDriver::load() else { return };
    nd.disarm();
    let config = alloc_core::AllocatorConfig::default();
    let mut failed_calls = 0;
    // An allocator's creation (what the first C call on a device does):
    // each driver call it makes failing is an error, and the next creation
    // works.
    for f in nd.functions() {
        for nth in 1.. {
            nd.fail(&f, nth, CU_UNKNOWN);
            let made = CudaAllocator::new(0, &config);
            let spent = !nd.armed();
            nd.disarm();
            if !spent {
                break;
            }
            failed_calls += 1;
            drop(made);
            CudaAllocator::new(0, &config)
                .unwrap_or_else(|e| panic!("after call {nth} of {f} failing: {e}"));
        }
    }
    let in_creation = failed_calls;
    for f in nd.functions() {
        let before = nd.calls(&f);
        check_recovered("a clean run", sequence());
        // A clean sequence and its check: more calls than one sequence makes.
        let made = nd.calls(&f) - before;
        let code = match f.as_str() {
            "cuMemAlloc_v2" | "cuMemHostAlloc" => CU_OUT_OF_MEMORY,
            _ => CU_UNKNOWN,
        };
        for nth in 1..=made {
            nd.fail(&f, nth, code);
            let run = sequence();
            let spent = !nd.armed();
            nd.disarm();
            let at = format!("call {nth} of {f} failing");
            let panics: Vec<_> = run
                .failures
                .iter()
                .filter(|(_, c, _)| *c == GPUALLOC_ERR_INTERNAL)
                .collect();
            assert!(panics.is_empty(), "{at}: {panics:?}");
            if !spent {
                break; // the sequence makes fewer calls of f than that
            }
            failed_calls += 1;
            check_recovered(&at, run);
        }
    }
    eprintln!(
        "{failed_calls} driver calls failed in turn ({in_creation} in creation), \
         each recovered from"
    );
    assert!(failed_calls >= 20, "only {failed_calls} calls were failed");
}

/// The issue this guards against: a capture's allocation needs
/// `cuThreadExchangeStreamCaptureMode`, which the null driver lacks (as an
/// old driver lacks newer functions); cudarc panics on a missing symbol,
/// which once left the device's allocator poisoned for good.
#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn a_function_the_driver_lacks_is_an_error_not_a_poisoned_allocator() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if NullDriver::load().is_none() {
        return;
    }
    let pool = (78, 2);
    assert_eq!(
        gpualloc_begin_allocate_to_pool(0, pool.0, pool.1),
        GPUALLOC_OK
    );
    for _ in 0..2 {
        let p = gpualloc_malloc_in_pool(MIB, 0, null_mut(), pool.0, pool.1);
        assert!(p.is_null());
        assert_eq!(last_code(), GPUALLOC_ERR_CUDA);
        let e = common::last_error();
        assert!(
            e.contains("has no cuThreadExchangeStreamCaptureMode"),
            "{e}"
        );
    }
    assert_eq!(
        gpualloc_end_allocate_to_pool(0, pool.0, pool.1),
        GPUALLOC_OK
    );
    assert_eq!(gpualloc_release_pool(0, pool.0, pool.1), GPUALLOC_OK);
    check_recovered("a missing driver function", Run::default());
}

/// A panic with the allocator's lock held (a bug) fails that call only:
/// the engine passes its check, the poison is cleared, the C entry points
/// go on working.
#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn a_panic_under_the_allocator_lock_does_not_disable_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if NullDriver::load().is_none() {
        return;
    }
    let p = gpualloc_malloc(MIB, 0, null_mut());
    assert!(!p.is_null());
    let alloc = allocator();
    let caught = std::panic::catch_unwind(|| {
        // SAFETY: frees nothing; it only panics with the lock held.
        unsafe {
            alloc
                .diagnostics()
                .with_engine(|_| panic!("a bug under the lock"))
        }
    });
    assert!(caught.is_err());
    let stats = gpualloc_memory_stats_json(0);
    assert!(!stats.is_null(), "stats after the panic");
    // SAFETY: a string of the library, freed once.
    unsafe { gpualloc_string_free(stats) };
    gpualloc_free(p, 0, 0, null_mut());
    check_recovered("a panic under the lock", Run::default());
}

/// Allocations into a pool nobody created, or whose last holder released
/// it, fail with their own code; the pool is not created by them.
#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn unknown_pools_are_refused_with_their_own_code() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if NullDriver::load().is_none() {
        return;
    }
    let pool = (79, 3);
    assert!(gpualloc_malloc_in_pool(MIB, 0, null_mut(), pool.0, pool.1).is_null());
    assert_eq!(last_code(), GPUALLOC_ERR_UNKNOWN_POOL);
    assert!(common::last_error().contains("unknown private pool (79, 3)"));
    assert_eq!(gpualloc_pool_use_count(0, pool.0, pool.1), 0, "not created");
    assert_eq!(
        gpualloc_release_pool(0, pool.0, pool.1),
        GPUALLOC_ERR_UNKNOWN_POOL
    );
    assert_eq!(gpualloc_retain_pool(0, pool.0, pool.1), GPUALLOC_OK);
    let p = gpualloc_malloc_in_pool(MIB, 0, null_mut(), pool.0, pool.1);
    assert!(!p.is_null());
    assert_eq!(gpualloc_release_pool(0, pool.0, pool.1), GPUALLOC_OK);
    assert!(gpualloc_malloc_in_pool(MIB, 0, null_mut(), pool.0, pool.1).is_null());
    assert_eq!(last_code(), GPUALLOC_ERR_UNKNOWN_POOL, "released");
    gpualloc_free(p, 0, 0, null_mut());
    check_recovered("unknown pools", Run::default());
    // 200,000 pools through the C entry points leave the tables as small.
    for i in 0..200_000u64 {
        let pool = (1000 + i, 4);
        assert_eq!(gpualloc_retain_pool(0, pool.0, pool.1), GPUALLOC_OK);
        let p = gpualloc_malloc_in_pool(MIB, 0, null_mut(), pool.0, pool.1);
        assert!(!p.is_null());
        gpualloc_free(p, 0, 0, null_mut());
        assert_eq!(gpualloc_release_pool(0, pool.0, pool.1), GPUALLOC_OK);
    }
    let tables = allocator()
        .diagnostics()
        .inspect(|e| e.pool_table_len())
        .unwrap();
    assert!(tables <= 3, "{tables} entries for 200,000 pools released");
    check_recovered("200,000 pools", Run::default());
}

/// The `stream_ops.*` counters of the statistics count what the driver was
/// asked: an event recorded for a block freed while another stream used it,
/// and the queries that poll it before the block is reused.
#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn stream_op_counters_match_the_driver_calls() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(nd) = NullDriver::load() else {
        return;
    };
    let read = || -> std::collections::BTreeMap<String, i64> {
        let json = gpualloc_memory_stats_json(0);
        assert!(!json.is_null(), "memory_stats_json");
        // SAFETY: a NUL-terminated string of the library, read and freed once.
        let text = unsafe { CStr::from_ptr(json) }.to_str().unwrap().to_owned();
        // SAFETY: as above.
        unsafe { gpualloc_string_free(json) };
        serde_json::from_str(&text).unwrap()
    };
    let p = gpualloc_malloc(MIB, 0, null_mut());
    assert!(!p.is_null());
    let before = read();
    let (records, queries) = (nd.calls("cuEventRecord"), nd.calls("cuEventQuery"));
    assert_eq!(gpualloc_record_stream(p, 0, side_stream()), 0);
    gpualloc_free(p, 0, 0, null_mut());
    let q = gpualloc_malloc(MIB, 0, null_mut()); // polls the freed block's event
    assert!(!q.is_null());
    let after = read();
    let delta = |key: &str| after[key] - before[key];
    assert_eq!(
        delta("stream_ops.recorded"),
        nd.calls("cuEventRecord") - records
    );
    assert_eq!(
        delta("stream_ops.queried"),
        nd.calls("cuEventQuery") - queries
    );
    assert!(
        delta("stream_ops.recorded") >= 1,
        "the cross-stream free recorded an event"
    );
    assert!(
        delta("stream_ops.queried") >= 1,
        "the next malloc polled it"
    );
    assert_eq!(delta("stream_ops.host_waits"), 0);
    assert_eq!(delta("stream_ops.stream_waits"), 0);
    gpualloc_free(q, 0, 0, null_mut());
}

/// Memory pinned in place is counted in the host statistics until it is
/// unpinned; an overlapping range and an address that starts no range are
/// refused without a driver call.
#[test]
#[ignore = "needs the null driver: bash crates/alloc-cuda/null-driver/run.sh --tests"]
fn memory_pinned_in_place_is_counted_and_overlaps_are_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(nd) = NullDriver::load() else { return };
    nd.disarm();
    let count = |s: &serde_json::Map<String, serde_json::Value>, key: &str| {
        s[key].as_u64().unwrap_or_else(|| panic!("{key} in {s:?}"))
    };
    let before = host_stats();
    let mut buf = vec![0u8; 4 << 20];
    let ptr = buf.as_mut_ptr().cast::<c_void>();
    let registers = nd.calls("cuMemHostRegister_v2");
    // SAFETY: `buf` outlives its registration (unregistered below).
    unsafe {
        assert_eq!(gpualloc_host_register(ptr, buf.len(), 0), GPUALLOC_OK);
        let s = host_stats();
        assert_eq!(
            count(&s, "registered_bytes"),
            count(&before, "registered_bytes") + (4 << 20)
        );
        assert_eq!(
            count(&s, "registered_ranges"),
            count(&before, "registered_ranges") + 1
        );
        assert_eq!(
            count(&s, "host_registers"),
            count(&before, "host_registers") + 1
        );
        assert!(count(&s, "peak_registered_bytes") >= 4 << 20);
        // The pool's counters are still there beside them.
        assert!(s.contains_key("reserved_bytes") && s.contains_key("host_allocs"));

        let inside = ptr.cast::<u8>().add(4096).cast::<c_void>();
        assert_eq!(
            gpualloc_host_register(inside, 4096, 0),
            GPUALLOC_ERR_INVALID
        );
        assert!(common::last_error().contains("registered already"));
        assert_eq!(
            nd.calls("cuMemHostRegister_v2"),
            registers + 1,
            "refused first"
        );
        let unregisters = nd.calls("cuMemHostUnregister");
        assert_eq!(gpualloc_host_unregister(inside), GPUALLOC_ERR_INVALID);
        assert!(common::last_error().contains("not the start of a range"));
        assert_eq!(
            nd.calls("cuMemHostUnregister"),
            unregisters,
            "refused first"
        );

        assert_eq!(gpualloc_host_unregister(ptr), GPUALLOC_OK);
        assert_eq!(nd.calls("cuMemHostUnregister"), unregisters + 1);
        assert_eq!(gpualloc_host_unregister(ptr), GPUALLOC_ERR_INVALID, "twice");
        assert_eq!(nd.calls("cuMemHostUnregister"), unregisters + 1);
    }
    let after = host_stats();
    for key in ["registered_bytes", "registered_ranges"] {
        assert_eq!(count(&after, key), count(&before, key), "{key}");
    }
    assert_eq!(
        count(&after, "host_unregisters"),
        count(&before, "host_unregisters") + 1
    );
    drop(buf);
}
