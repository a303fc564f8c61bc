//! The allocator's two host paths over one engine, in one process and
//! interleaved: the Rust API (`CudaAllocator::malloc` / `free`, with a
//! cudarc stream and with a raw `StreamHandle`) and the C library
//! (`gpualloc_malloc` / `gpualloc_free` of `liballoc_ffi.so`, loaded with
//! `dlopen` and called through function pointers, as the shared harness
//! `alloc_bench.cpp` calls it). Same configuration, same stream, same loops;
//! the order of the paths rotates from round to round.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use alloc_cuda::cudarc::driver::{CudaContext, CudaStream};
use alloc_cuda::{CudaAllocator, StreamHandle};
use libloading::Library;

use crate::{median, Backend, BoxResult, Ours, Workload};

type MallocFn = unsafe extern "C" fn(isize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, isize, c_int, *mut c_void);
type ConfigureFn = unsafe extern "C" fn(*const c_char) -> c_int;
type EmptyCacheFn = unsafe extern "C" fn(c_int) -> c_int;
type LastErrorFn = unsafe extern "C" fn() -> *const c_char;

/// The entry points of the C library that the comparison calls.
pub struct CLibrary {
    malloc: MallocFn,
    free: FreeFn,
    empty_cache: EmptyCacheFn,
    last_error: LastErrorFn,
    /// Keeps the entry points loaded.
    _lib: Library,
}

impl CLibrary {
    /// Loads the library at `path` and configures its allocators with
    /// `config` (before their first use, so that both paths run the same
    /// engine whatever `GPUALLOC_CONF` says).
    pub fn load(path: &Path, config: &str) -> BoxResult<Self> {
        // SAFETY: liballoc_ffi.so runs no initialisation code of its own
        // when loaded; the symbols are the C ABI of include/gpualloc.h,
        // whose signatures the types above spell out.
        let c = unsafe {
            let lib = Library::new(path)?;
            let configure: ConfigureFn = *lib.get(b"gpualloc_configure\0")?;
            CLibrary {
                malloc: *lib.get(b"gpualloc_malloc\0")?,
                free: *lib.get(b"gpualloc_free\0")?,
                empty_cache: *lib.get(b"gpualloc_empty_cache\0")?,
                last_error: *lib.get(b"gpualloc_last_error\0")?,
                _lib: lib,
            }
            .configured(configure, config)?
        };
        Ok(c)
    }

    /// `self` once `configure(config)` succeeded.
    fn configured(self, configure: ConfigureFn, config: &str) -> BoxResult<Self> {
        let text = CString::new(config)?;
        // SAFETY: a NUL-terminated string that outlives the call.
        if unsafe { configure(text.as_ptr()) } != 0 {
            return Err(format!("gpualloc_configure(\"{config}\"): {}", self.error()).into());
        }
        Ok(self)
    }

    /// One allocation and its free on `stream`: under `engine_per_stream`
    /// the stream gets an engine, and the device publishes from then on.
    pub fn use_stream_once(&self, stream: &Arc<CudaStream>) -> BoxResult<()> {
        let mut other = CPath {
            lib: self,
            stream: stream.cu_stream().cast(),
        };
        let p = other.alloc(512)?;
        other.release(p, 512)
    }

    /// The calling thread's last error message of the library.
    fn error(&self) -> String {
        // SAFETY: NULL or a NUL-terminated string valid until the next call
        // into the library on this thread; copied at once.
        let p = unsafe { (self.last_error)() };
        if p.is_null() {
            return "no message".into();
        }
        // SAFETY: as above.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Returns the cached segments of device 0 to the driver.
    pub fn empty_cache(&self) -> BoxResult<()> {
        // SAFETY: a plain call of the C ABI.
        match unsafe { (self.empty_cache)(0) } {
            0 => Ok(()),
            _ => Err(format!("gpualloc_empty_cache: {}", self.error()).into()),
        }
    }
}

/// Where `liballoc_ffi.so` is: `explicit` (`--so PATH`), else
/// `$GPUALLOC_SO`, else beside the executable (a cargo build puts both in
/// `target/release`), else in `../lib` from it (the GPU bundle's layout).
pub fn find_library(explicit: Option<&str>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("GPUALLOC_SO") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        dir.join("liballoc_ffi.so"),
        dir.join("../lib/liballoc_ffi.so"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

/// The C library on device 0 and one stream, as the harness calls it.
struct CPath<'a> {
    lib: &'a CLibrary,
    stream: *mut c_void,
}

impl Backend for CPath<'_> {
    #[inline]
    fn alloc(&mut self, size: usize) -> BoxResult<u64> {
        // SAFETY: `stream` is a live stream of device 0's primary context
        // that outlives the library's use of it (it is emptied below before
        // the stream goes).
        let p = unsafe { (self.lib.malloc)(size as isize, 0, self.stream) };
        if p.is_null() {
            return Err(format!("gpualloc_malloc({size}): {}", self.lib.error()).into());
        }
        Ok(p as u64)
    }
    #[inline]
    fn release(&mut self, ptr: u64, size: usize) -> BoxResult<()> {
        // SAFETY: `ptr` came from gpualloc_malloc and is freed once.
        unsafe { (self.lib.free)(ptr as *mut c_void, size as isize, 0, self.stream) };
        Ok(())
    }
}

/// The paths compared, in the order of the table's columns.
const PATHS: [&str; 3] = [
    "CudaAllocator, &Arc<CudaStream>",
    "CudaAllocator, StreamHandle::from_raw",
    "C library (gpualloc_malloc/free)",
];

/// The names `--only` takes, in the order of [`PATHS`].
pub const PATH_NAMES: [&str; 3] = ["cudarc", "raw", "c"];
/// The C library's place in [`PATHS`].
pub const C_PATH: usize = 2;

/// One workload's figures: ns per path (median of the rounds) and the
/// median over the rounds of each Rust path's time over the C path's.
struct Row {
    label: String,
    ns: [f64; 3],
    ratios: [f64; 2],
}

/// Measures every workload on the three paths, `rounds` rounds each with
/// the paths' order rotated, and prints a markdown table. With `only`
/// (an index into [`PATH_NAMES`]) one path runs and nothing is printed: a
/// profiler's counts are then that path's (`--only`).
#[allow(clippy::too_many_arguments)]
pub fn compare(
    only: Option<usize>,
    lib: &CLibrary,
    config: &str,
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    workloads: &[Workload],
    (pairs, mixed_ops): (u64, u64),
    rounds: usize,
) -> BoxResult<()> {
    // The Rust paths' allocator, unless the C library runs alone (its
    // configuration may be one CudaAllocator refuses: engine_per_stream).
    let alloc = match only {
        Some(C_PATH) => CudaAllocator::with_config_str(0, "")?,
        _ => CudaAllocator::with_config_str(0, config)?,
    };
    let mut cudarc = Ours {
        alloc: alloc.clone(),
        stream: stream.clone(),
    };
    let mut raw = Ours {
        alloc: alloc.clone(),
        // SAFETY: a stream of device 0's primary context, held alive by
        // `stream` until the allocator's cache is emptied below.
        stream: unsafe { StreamHandle::from_raw(stream.cu_stream()) },
    };
    let mut c = CPath {
        lib,
        stream: stream.cu_stream().cast(),
    };
    let mut rows = Vec::new();
    for w in workloads {
        let scale = w.pick(pairs, mixed_ops);
        let mut ns: [Vec<f64>; 3] = Default::default();
        for round in 0..rounds {
            for k in 0..PATHS.len() {
                let path = (round + k) % PATHS.len();
                if only.is_some_and(|o| o != path) {
                    continue;
                }
                let b: &mut dyn Backend = match path {
                    0 => &mut cudarc,
                    1 => &mut raw,
                    _ => &mut c,
                };
                ns[path].push(w.run(b, scale, round)?);
            }
            ctx.synchronize()?;
        }
        if only.is_some() {
            continue;
        }
        let ratio = |p: usize| median(ns[p].iter().zip(&ns[2]).map(|(r, c)| r / c).collect());
        rows.push(Row {
            label: w.label(),
            ratios: [ratio(0), ratio(1)],
            ns: ns.map(median),
        });
    }
    alloc.empty_cache()?;
    lib.empty_cache()?;
    if only.is_some() {
        return Ok(());
    }

    println!();
    println!(
        "Rust path and C library path over one engine (`{config}`), interleaved on one \
         stream: ns per alloc+free pair (mixed: per operation), median of {rounds} rounds of \
         {pairs} pairs / {mixed_ops} ops; ratios: median over the rounds of the round's \
         CudaAllocator time / C library time (<= 1.00: the Rust path is no slower)."
    );
    println!();
    println!(
        "| workload | {} | {} | {} | cudarc stream / C | raw handle / C |",
        PATHS[0], PATHS[1], PATHS[2]
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
            r.label, r.ns[0], r.ns[1], r.ns[2], r.ratios[0], r.ratios[1]
        );
    }
    let worst = rows.iter().map(|r| r.ratios[0]).fold(f64::MIN, f64::max);
    println!();
    println!("CudaAllocator (cudarc stream) / C library, worst workload: {worst:.2}");
    Ok(())
}
