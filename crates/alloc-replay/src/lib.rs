#![doc = include_str!("../README.md")]
//!
//! ## Modules
//!
//! * [`trace`]: the allocation-trace model ([`Trace`], [`TraceEvent`]) and readers for the
//!   text format and PyTorch memory snapshot pickles.
//! * [`replay`](mod@replay): runs a trace through the engine on the simulated device ([`replay()`]).
//! * [`plot`]: dependency-free SVG line charts of memory over time.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod plot;
pub mod replay;
pub mod trace;

pub use replay::{
    device_for, replay, sim_engine, ReplayError, ReplayOptions, ReplayReport, ReplayRun,
};
pub use trace::{
    load_trace, load_trace_of, parse_bytes, parse_pickle, parse_pickle_device, parse_text,
    trace_name, Trace, TraceError, TraceEvent,
};
