//! An invalid `GPUALLOC_CONF` makes every allocation fail with its message and
//! is reported on stderr exactly once. The test re-runs its own executable
//! with the variable set, so that the variable is there from the start of
//! the process, and inspects the child's stderr.

use std::process::Command;
use std::ptr::null_mut;

use alloc_ffi::api::*;
use alloc_ffi::*;

mod common;
use common::last_error;

const NAME: &str = "bad_gpualloc_conf_fails_every_allocation_and_is_reported_once";

fn child() {
    if std::env::var("GPUALLOC_TEST_CHILD").as_deref() == Ok("named") {
        return named_child();
    }
    for _ in 0..3 {
        assert!(gpualloc_malloc(4096, 0, null_mut()).is_null());
        let e = last_error();
        assert!(e.contains("invalid GPUALLOC_CONF"), "{e}");
        assert!(e.contains("max_split_size_mb"), "{e}");
    }
    assert_eq!(gpualloc_set_memory_fraction(0.5, 0), GPUALLOC_ERR_INVALID);
    assert!(last_error().contains("GPUALLOC_CONF"));
    let c = c"policy:pytorch-bfc";
    // SAFETY: a valid C string.
    assert_eq!(
        unsafe { gpualloc_configure(c.as_ptr()) },
        GPUALLOC_ERR_TOO_LATE
    );
    println!("child ok");
}

#[test]
fn bad_gpualloc_conf_fails_every_allocation_and_is_reported_once() {
    if std::env::var_os("GPUALLOC_TEST_CHILD").is_some() {
        child();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env("GPUALLOC_TEST_CHILD", "1")
        .env("GPUALLOC_CONF", "max_split_size_mb:1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("child ok"), "{stdout}");
    let reports = stderr.matches("GPUALLOC_CONF").count();
    assert_eq!(reports, 1, "stderr:\n{stderr}");
    assert!(stderr.contains("every allocation will fail"), "{stderr}");
}

const NAMED: &str = "gpualloc_conf_takes_names_and_quotes_a_long_one_in_part";

/// With `GPUALLOC_CONF=bound,...` an allocation fails for want of a driver
/// (here), never for the configuration.
fn named_child() {
    let p = gpualloc_malloc(4096, 0, null_mut());
    if p.is_null() {
        let e = last_error();
        assert!(!e.contains("GPUALLOC_CONF"), "{e}");
    } else {
        gpualloc_free(p, 4096, 0, null_mut());
    }
    println!("child ok");
}

fn run_child(test: &str, kind: &str, conf: &str) -> (String, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("GPUALLOC_TEST_CHILD", kind)
        .env("GPUALLOC_CONF", conf)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("child ok"), "{stdout}");
    (stdout, stderr)
}

#[test]
fn gpualloc_conf_takes_names_and_quotes_a_long_one_in_part() {
    if std::env::var_os("GPUALLOC_TEST_CHILD").is_some() {
        child();
        return;
    }
    run_child(NAMED, "named", "bound,max_split_size_mb:64");
    // An environment string is at most 128 KiB on Linux.
    let long = format!("max_split_size_mb:{}", "x".repeat(100_000));
    let (_, stderr) = run_child(NAME, "1", &long);
    assert_eq!(stderr.matches("GPUALLOC_CONF").count(), 1, "{stderr}");
    assert!(stderr.len() < 2000, "{} bytes on stderr", stderr.len());
    assert!(stderr.contains("(100018 bytes)"), "{stderr}");
}
