//! `graph_capture_record_stream_reuse`: during a CUDA graph capture, a block
//! freed while other streams used it is reused on its stream once the
//! capture's graph joins those streams into it, never before; with the
//! option off such a block waits for the capture's end. The scenarios are
//! PyTorch's `TestMemPool.test_graph_capture_reclaim_2_streams` and
//! `_4_streams` on the simulated streams' captures.

mod common;

use alloc_core::{AllocatorConfig, PoolId, StreamId};
use common::SimEngine;

const GRAPH: PoolId = (1, 0);
/// `torch.empty(8)` of float32: 32 bytes.
const TENSOR: u64 = 32;

fn engine(reuse: bool) -> SimEngine {
    let config = format!("graph_capture_record_stream_reuse:{reuse}");
    common::engine(&config, 8 << 30)
}

/// An allocation during the capture, into the graph's pool.
fn empty(e: &mut SimEngine, stream: StreamId) -> u64 {
    e.malloc_in(TENSOR, stream, Some(GRAPH)).unwrap().addr
}

fn begin_capture(e: &mut SimEngine, stream: StreamId) {
    e.begin_allocate_to_pool(GRAPH);
    e.streams_mut().capture().begin(stream);
}

fn end_capture(e: &mut SimEngine, stream: StreamId) {
    e.streams_mut().capture().end(stream);
    e.end_allocate_to_pool(GRAPH).unwrap();
    e.assert_valid();
}

/// PyTorch's two-stream test; returns (data1, data2, data3) and leaves the
/// engine after the capture.
fn two_streams(e: &mut SimEngine) -> (u64, u64, u64) {
    let [s1, s2] = [1, 2].map(StreamId);
    begin_capture(e, s1);
    let _sink1 = empty(e, s1);
    let data1 = empty(e, s1);
    // Fork: s2 reads data1 into a buffer of its own.
    e.streams_mut().capture().wait_stream(s2, s1);
    let _buf2 = empty(e, s2);
    e.streams_mut().capture().launch(s2);
    e.record_stream(data1, s2).unwrap();
    e.free(data1).unwrap();
    // Before the join: s2 may still read data1.
    let data2 = empty(e, s1);
    // Join s2 into s1, and a kernel on s1 (sink1.fill_).
    e.streams_mut().capture().wait_stream(s1, s2);
    e.streams_mut().capture().launch(s1);
    let data3 = empty(e, s1);
    end_capture(e, s1);
    (data1, data2, data3)
}

#[test]
fn two_streams_reuse_after_the_join_never_before() {
    let mut e = engine(true);
    let (data1, data2, data3) = two_streams(&mut e);
    assert_ne!(data2, data1, "reused before the join");
    assert_eq!(data3, data1, "not reused after the join");
    assert_eq!(
        e.streams().outstanding,
        0,
        "no event for a block the graph freed"
    );
    assert_eq!(e.awaiting_events(), 0);
}

#[test]
fn two_streams_with_the_option_off_wait_for_the_end_of_the_capture() {
    let mut e = engine(false);
    let (data1, data2, data3) = two_streams(&mut e);
    assert_ne!(data2, data1);
    assert_ne!(
        data3, data1,
        "reused during the capture with the option off"
    );
    // At the capture's end the free records its event on s2.
    assert_eq!(e.awaiting_events(), 1);
    e.streams_mut().complete_all();
    e.process_events().unwrap();
    assert_eq!(e.awaiting_events(), 0);
    e.assert_valid();
}

#[test]
fn four_streams_reuse_only_after_every_stream_joined() {
    let mut e = engine(true);
    let [s1, s2, s3, s4] = [1, 2, 3, 4].map(StreamId);
    begin_capture(&mut e, s1);
    let data1 = empty(&mut e, s1);
    e.streams_mut().capture().launch(s1); // torch.ones: a fill kernel
    let _sink1 = empty(&mut e, s1);
    let sink3 = empty(&mut e, s1);
    for s in [s2, s3, s4] {
        e.streams_mut().capture().wait_stream(s, s1);
        let _buf = empty(&mut e, s);
        e.streams_mut().capture().launch(s);
        e.record_stream(data1, s).unwrap();
    }
    e.free(data1).unwrap();
    // Partial joins: s2 into s1, s4 into s3.
    e.streams_mut().capture().wait_stream(s1, s2);
    e.streams_mut().capture().launch(s1);
    e.streams_mut().capture().wait_stream(s3, s4);
    e.streams_mut().capture().launch(s3);
    e.record_stream(sink3, s3).unwrap();
    let data2 = empty(&mut e, s1);
    assert_ne!(data2, data1, "reused before s3 and s4 joined s1");
    // The final join: s3 (and through it s4) into s1.
    e.streams_mut().capture().wait_stream(s1, s3);
    e.streams_mut().capture().launch(s1);
    let data3 = empty(&mut e, s1);
    assert_eq!(data3, data1, "not reused after every stream joined");
    end_capture(&mut e, s1);
}

/// The graph orders nothing before the capture began: a block another
/// stream used then waits for the capture's end and its events.
#[test]
fn a_use_recorded_before_the_capture_keeps_the_block_until_its_end() {
    let mut e = engine(true);
    let [s1, s2] = [1, 2].map(StreamId);
    let early = e.malloc(TENSOR, s1).unwrap().addr;
    e.record_stream(early, s2).unwrap(); // eager work on s2
    begin_capture(&mut e, s1);
    e.streams_mut().capture().wait_stream(s2, s1);
    e.streams_mut().capture().launch(s2);
    e.record_stream(early, s2).unwrap(); // and captured work
    let inside = empty(&mut e, s1);
    e.record_stream(inside, s2).unwrap();
    e.free(early).unwrap();
    e.free(inside).unwrap();
    e.streams_mut().capture().wait_stream(s1, s2);
    e.streams_mut().capture().launch(s1);
    assert_eq!(
        empty(&mut e, s1),
        inside,
        "the block of the capture is reused"
    );
    // Outside the graph's pool, on the early block's stream: not reused.
    let eager = e.malloc(TENSOR, s1).unwrap().addr;
    assert_ne!(eager, early);
    e.free(eager).unwrap();
    end_capture(&mut e, s1);
    assert_eq!(
        e.awaiting_events(),
        1,
        "the early block waits for s2's event"
    );
}

/// A stream that recorded its use but is not capturing at the free (it
/// never joined the capture) gives no markers: the block waits.
#[test]
fn a_stream_outside_the_capture_at_the_free_defers_to_its_end() {
    let mut e = engine(true);
    let [s1, s2, s3] = [1, 2, 3].map(StreamId);
    begin_capture(&mut e, s1);
    e.streams_mut().capture().wait_stream(s2, s1);
    let block = empty(&mut e, s1);
    e.streams_mut().capture().launch(s2);
    e.record_stream(block, s2).unwrap();
    e.record_stream(block, s3).unwrap(); // s3 never joins
    e.free(block).unwrap();
    e.streams_mut().capture().wait_stream(s1, s2);
    e.streams_mut().capture().launch(s1);
    assert_ne!(empty(&mut e, s1), block);
    end_capture(&mut e, s1);
    assert_eq!(e.awaiting_events(), 1);
}

/// PyTorch's tests turn the option on and off with
/// `_set_allocator_settings`: it applies from the next allocation.
#[test]
fn the_option_changes_at_run_time() {
    let mut e = engine(false);
    let on = AllocatorConfig::parse("graph_capture_record_stream_reuse:True").unwrap();
    e.reconfigure(&on).unwrap();
    let (data1, data2, data3) = two_streams(&mut e);
    assert_ne!(data2, data1);
    assert_eq!(data3, data1);
    let off = on
        .with_settings("graph_capture_record_stream_reuse:False")
        .unwrap();
    e.reconfigure(&off).unwrap();
    let (data1, _, data3) = two_streams(&mut e);
    assert_ne!(data3, data1);
}
