//! `gpualloc_advise` on inputs made to cost the most memory per byte (runs
//! of `MARK`, raw and gzip'd): refused with GPUALLOC_ERR_INVALID and a
//! message, within `alloc_replay::trace::read_memory_bound` of their size
//! (the heap counted by this binary's allocator). Before, the 2 KB file
//! took 8.4 GB, and aborted the caller under a 4 GB address-space limit.
#![cfg(feature = "advise")]

#[path = "../../alloc-replay/tests/peak/mod.rs"]
mod peak;

mod common;

use std::ffi::c_int;

use alloc_ffi::api::GPUALLOC_ERR_INVALID;
use alloc_ffi::{gpualloc_advise, gpualloc_last_error_code};
use alloc_replay::trace::read_memory_bound;

/// 2 MiB and 16 MiB of MARKs gzip'd (`fuzz/seeds/make_seeds.py`).
const MARKS_2_MIB_GZ: &[u8] = include_bytes!("../../../fuzz/seeds/trace/marks_2_mib.pickle.gz");
const MARKS_16_MIB_GZ: &[u8] = include_bytes!("../../../fuzz/seeds/trace/marks_16_mib.pickle.gz");
const MARKS_64_KIB_GZ: &[u8] = include_bytes!("../../../fuzz/seeds/trace/marks_64_kib.pickle.gz");

/// The error code and message of a refused input, and the peak heap of
/// the call.
fn refused(bytes: &[u8]) -> (c_int, String, u64) {
    let (p, peak) = peak::peak_of(|| {
        // SAFETY: `bytes` is readable for its length; the name is a C literal.
        unsafe { gpualloc_advise(bytes.as_ptr().cast(), bytes.len(), -1, c"marks".as_ptr()) }
    });
    assert!(p.is_null(), "advice on {} bytes of MARKs", bytes.len());
    (gpualloc_last_error_code(), common::last_error(), peak)
}

#[test]
fn runs_of_marks_are_invalid_within_the_bound() {
    let raw = [&[0x80, 4][..], &vec![b'('; 100 << 10], b"."].concat();
    let cases: [(&str, &[u8], bool, &str); 4] = [
        ("2 MiB gzip'd", MARKS_2_MIB_GZ, true, "decompression bomb"),
        ("16 MiB gzip'd", MARKS_16_MIB_GZ, true, "decompression bomb"),
        (
            "64 KiB gzip'd",
            MARKS_64_KIB_GZ,
            true,
            "would build more than",
        ),
        ("100 KiB raw", &raw, false, "would build more than"),
    ];
    for (what, bytes, gzipped, reason) in cases {
        let (code, message, peak) = refused(bytes);
        let bound = read_memory_bound(bytes.len(), gzipped);
        println!(
            "{what}: {} bytes, peak {peak}, bound {bound}: {message}",
            bytes.len()
        );
        assert_eq!(code, GPUALLOC_ERR_INVALID, "{what}: {message}");
        assert!(message.starts_with("marks: "), "{what}: {message}");
        assert!(message.contains(reason), "{what}: {message}");
        assert!(peak <= bound, "{what}: {peak} bytes, above {bound}");
    }
}
