//! A host process whose stderr cannot be written (`python train.py 2>&1 |
//! head` once `head` exits, a full disk) keeps running: failed frees and a
//! bad `GPUALLOC_CONF` are reported on a best-effort basis, never by a panic
//! at the C boundary (an abort), and a bad configuration is still enforced.
//! The test re-runs its own executable with stderr a pipe whose reading end
//! is already closed.

use std::io::Read;
use std::process::{Command, Stdio};
use std::ptr::null_mut;

use alloc_ffi::*;

mod common;
use common::last_error;

const NAME: &str = "failures_with_a_closed_stderr_neither_abort_nor_unseal";

fn child() {
    // Wait until the parent has closed the pipe's reading end.
    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest).unwrap();
    let garbage = 0x7f00_dead_0000_usize as *mut std::ffi::c_void;
    gpualloc_free(garbage, 0, 0, null_mut());
    assert!(last_error().contains("not allocated by gpualloc"));
    for _ in 0..12 {
        gpualloc_free(garbage, 0, 0, null_mut()); // past the report limit too
    }
    assert!(gpualloc_malloc(4096, 0, null_mut()).is_null());
    let e = last_error();
    assert!(
        e.contains("invalid GPUALLOC_CONF"),
        "the bad config still holds: {e}"
    );
    println!("child ok");
}

#[test]
fn failures_with_a_closed_stderr_neither_abort_nor_unseal() {
    if std::env::var_os("GPUALLOC_TEST_CHILD").is_some() {
        child();
        return;
    }
    let mut proc = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env("GPUALLOC_TEST_CHILD", "1")
        .env("GPUALLOC_CONF", "max_split_size_mb:1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(proc.stderr.take()); // every write to stderr now fails (EPIPE)
    drop(proc.stdin.take()); // let the child go on
    let mut stdout = String::new();
    proc.stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let status = proc.wait().unwrap();
    assert!(status.success(), "child died ({status}):\n{stdout}");
    assert!(stdout.contains("child ok"), "{stdout}");
}
