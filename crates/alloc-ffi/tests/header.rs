//! The C header, the API table and the exported Rust functions agree.
//!
//! - `include/gpualloc.h` (which the Python package's ctypes declarations
//!   and C++ bridge read too: the wheel carries this file) must equal the
//!   text generated from `api::API` (regenerate it:
//!   `GPUALLOC_BLESS=1 cargo test -p alloc-ffi --test header`);
//! - every `#[no_mangle] extern "C" fn` in `src/` must appear in the
//!   table with the same parameter and return types (mapped to C), and the
//!   table must list nothing else;
//! - with a C compiler present, a C and a C++ program include the header,
//!   link against the built `liballoc_ffi.so` and call it, and the structs
//!   have the layout of their Rust definitions.

use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;

use alloc_ffi::api::{header_text, API, STRUCTS};
use alloc_ffi::CudaStream;

mod common;

const HEADER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/include/gpualloc.h");
const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// Every Rust source file of the crate, concatenated.
fn crate_source() -> String {
    let mut files: Vec<PathBuf> = std::fs::read_dir(SRC)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect()
}

/// Fails unless the file at `path` holds `want` (after writing it there
/// with `GPUALLOC_BLESS` set).
fn check_generated(path: &str, want: &str) {
    if std::env::var_os("GPUALLOC_BLESS").is_some() {
        std::fs::write(path, want).expect("write header");
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .map_or(have.lines().count().min(want.lines().count()), |i| i);
        panic!(
            "{path} differs from the API table in src/api.rs (first at line {}); \
             regenerate it with GPUALLOC_BLESS=1 cargo test -p alloc-ffi --test header",
            line + 1
        );
    }
}

#[test]
fn header_file_matches_the_api_table() {
    check_generated(HEADER, &header_text());
}

/// A Rust FFI type as its C spelling.
fn c_type(rust: &str) -> String {
    match rust.trim() {
        "isize" => "ssize_t",
        "c_int" => "int",
        "f64" => "double",
        "u64" => "uint64_t",
        "usize" => "size_t",
        "SegmentCallback" => "gpualloc_segment_callback",
        "PoolAllocFn" => "gpualloc_pool_alloc_fn",
        "PoolFreeFn" => "gpualloc_pool_free_fn",
        "*mut u64" => "uint64_t*",
        "*const u64" => "const uint64_t*",
        "*mut *mut u64" => "uint64_t**",
        "*mut usize" => "size_t*",
        "*mut c_int" => "int*",
        "*mut GpuallocDeviceStats" => "GpuallocDeviceStats*",
        "CudaStream" => "cudaStream_t",
        "*mut c_void" => "void*",
        "*const c_void" => "const void*",
        "*const c_char" => "const char*",
        "*mut c_char" => "char*",
        "" => "void",
        other => panic!("no C mapping for Rust type `{other}`: extend c_type()"),
    }
    .to_string()
}

/// `(name, [C param types], C return type)` of every exported function in
/// the source.
fn exported_functions(src: &str) -> Vec<(String, Vec<String>, String)> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("#[no_mangle]") {
        rest = &rest[i + "#[no_mangle]".len()..];
        let f = rest.find("fn ").expect("fn after #[no_mangle]");
        let decl = &rest[f + 3..];
        let open = decl.find('(').unwrap();
        let name = decl[..open].trim().to_string();
        let close = decl.find(')').unwrap();
        let params: Vec<String> = decl[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| c_type(p.split_once(':').expect("name: type").1))
            .collect();
        let body = decl.find('{').unwrap();
        let ret = decl[close + 1..body].trim();
        let ret = c_type(ret.strip_prefix("->").unwrap_or(ret));
        out.push((name, params, ret));
    }
    out
}

#[test]
fn exported_functions_match_the_api_table() {
    let found = exported_functions(&crate_source());
    assert_eq!(found.len(), API.len(), "exported: {found:?}");
    for (name, params, ret) in &found {
        let f = API
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("{name} is exported but not in api::API"));
        let table: Vec<String> = f.params.iter().map(|(t, _)| t.to_string()).collect();
        assert_eq!(&table, params, "{name}: parameter types");
        assert_eq!(f.ret, ret, "{name}: return type");
    }
}

/// The two signatures PyTorch's CUDAPluggableAllocator calls, checked by the
/// compiler.
#[test]
fn pytorch_signatures() {
    let _malloc: extern "C" fn(isize, c_int, CudaStream) -> *mut c_void =
        alloc_ffi::gpualloc_malloc;
    let _free: extern "C" fn(*mut c_void, isize, c_int, CudaStream) = alloc_ffi::gpualloc_free;
}

/// The directory of the `liballoc_ffi.so` that cargo built with this test
/// (`target/<profile>/deps/`, beside the test executable; the copy one level
/// up is refreshed only by `cargo build`).
fn built_library() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?.to_path_buf();
    let up = deps.parent()?.to_path_buf();
    [deps, up]
        .into_iter()
        .find(|d| d.join("liballoc_ffi.so").exists())
}

/// C assertions that every struct of the header has the size and field
/// offsets of its Rust definition.
fn layout_checks() -> String {
    // static_assert: a keyword in C++, a macro of <assert.h> in C11.
    let mut c = String::from("#include <assert.h>\n#include <stddef.h>\n");
    for s in STRUCTS {
        c.push_str(&format!(
            "static_assert(sizeof({0}) == {1}, \"size of {0}\");\n",
            s.name, s.size
        ));
        for f in s.fields {
            c.push_str(&format!(
                "static_assert(offsetof({0}, {1}) == {2}, \"offset of {0}.{1}\");\n",
                s.name, f.name, f.offset
            ));
        }
    }
    c
}

fn compile_and_run(compiler: &str, source: &str, ext: &str, libdir: &Path) {
    let tmp = std::env::temp_dir().join(format!("gpualloc_header_{}_{ext}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let src = tmp.join(format!("main.{ext}"));
    std::fs::write(&src, format!("{source}\n{}", layout_checks())).unwrap();
    let exe = tmp.join("main");
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let out = Command::new(compiler)
        .args(["-Wall", "-Wextra", "-Werror", "-I", include])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(libdir)
        .arg("-lalloc_ffi")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .output()
        .expect("run compiler");
    assert!(
        out.status.success(),
        "{compiler} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("ok"), "{stdout}");
    let _ = std::fs::remove_dir_all(&tmp);
}

const C_PROGRAM: &str = r#"
#include <gpualloc.h>
#include <stdio.h>
#include <string.h>

/* The exact types PyTorch's CUDAPluggableAllocator casts the symbols to. */
typedef void* (*alloc_fn)(ssize_t, int, cudaStream_t);
typedef void (*free_fn)(void*, ssize_t, int, cudaStream_t);

int main(void) {
  alloc_fn a = gpualloc_malloc;
  free_fn f = gpualloc_free;
  if (a(0, 0, 0) != NULL) return 1;           /* size 0: NULL, no error */
  if (gpualloc_last_error() != NULL) return 2;
  f(NULL, 0, 0, 0);                           /* NULL: no-op */
  if (gpualloc_check_config("policy:pytorch-bfc,max_split_size_mb:64") != GPUALLOC_OK) return 3;
  if (gpualloc_check_config("bogus:1") != GPUALLOC_ERR_INVALID) return 4;
  if (strstr(gpualloc_last_error(), "bogus") == NULL) return 5;
  char* s = gpualloc_memory_stats_json(0);
  if (s == NULL || strstr(s, "\"reserved_bytes.all.peak\":0") == NULL) return 6;
  gpualloc_string_free(s);
  GpuallocDeviceStats stats;
  memset(&stats, 0xff, sizeof stats);
  stats.size = sizeof stats;
  if (gpualloc_device_stats(3, &stats) != GPUALLOC_OK) return 7;
  if (stats.size != sizeof stats || stats.max_split_size != -1) return 8;
  if (stats.reserved_bytes[0].peak != 0 || stats.num_device_free != 0) return 9;
  stats.size = 0;
  if (gpualloc_device_stats(3, &stats) != GPUALLOC_ERR_INVALID) return 10;
  printf("ok %s\n", gpualloc_version());
  return 0;
}
"#;

fn have(compiler: &str) -> bool {
    Command::new(compiler)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn header_compiles_and_links_from_c_and_cpp() {
    let Some(libdir) = built_library() else {
        common::missing_tool("liballoc_ffi.so not built next to the test executable");
        return;
    };
    let mut ran = false;
    if have("cc") {
        compile_and_run("cc", C_PROGRAM, "c", &libdir);
        ran = true;
    }
    if have("c++") {
        compile_and_run("c++", C_PROGRAM, "cpp", &libdir);
        ran = true;
    }
    if !ran {
        common::missing_tool("no C or C++ compiler (cc, c++) on PATH");
    }
}
