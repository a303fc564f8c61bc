//! Prints where the allocator places every block of a trace: one line per
//! event, `a ADDR SIZE REQUESTED` for an allocation (the block's address and
//! size, the bytes asked for) and `f ADDR SIZE` for a free, replayed on the
//! simulated device under a configuration string (frees that completed later,
//! after other streams' use, complete at once here). The page-move analyses of
//! `benchmarks/page_moves` read these lines.
//!
//! ```sh
//! cargo run --release -p alloc-replay --example placements -- \
//!     traces/gpt2_train.trace.gz expandable_segments:True > gpt2_train.placements
//! ```

use std::io::{BufWriter, Write};
use std::path::Path;

use alloc_core::{AllocError, AllocatorConfig, SimStreams, StreamId};
use alloc_policy::AnyPolicy;
use alloc_replay::replay::DEFAULT_CAPACITY;
use alloc_replay::{device_for, load_trace, TraceEvent};
use rustc_hash::FxHashMap;

#[path = "../../../examples/failure.rs"]
mod failure;
use failure::Failure;

fn main() -> Result<(), Failure> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, config] = &args[..] else {
        return Err("usage: placements TRACE CONFIG".into());
    };
    let trace = load_trace(Path::new(path))?;
    // The device `cargo xtask replay` gives the trace (its recorded segment
    // addresses where it has them).
    let device = device_for(&trace, DEFAULT_CAPACITY);
    let mut engine =
        AnyPolicy::engine(&AllocatorConfig::parse(config)?, device, SimStreams::new())?;
    let mut live: FxHashMap<u64, (u64, u64)> = FxHashMap::default();
    let mut out = BufWriter::new(std::io::stdout().lock());
    for event in &trace.events {
        match *event {
            TraceEvent::Alloc { id, size, stream } => {
                match engine.malloc(size.max(1), StreamId(stream)) {
                    Ok(a) => {
                        live.insert(id, (a.addr, a.size));
                        writeln!(out, "a {} {} {}", a.addr, a.size, size)?;
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            TraceEvent::Free { id, .. } => {
                if let Some((addr, size)) = live.remove(&id) {
                    engine.free(addr)?;
                    writeln!(out, "f {addr} {size}")?;
                }
            }
            TraceEvent::FreeCompleted { .. } => {}
        }
    }
    out.flush()?;
    Ok(())
}
