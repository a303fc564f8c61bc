#![doc = include_str!("../README.md")]
//!
//! ## Modules
//!
//! * [`trace`]: the allocation-trace model ([`Trace`], [`TraceEvent`]) and readers for the
//!   text format and PyTorch memory snapshot pickles.
//! * [`replay`](mod@replay): runs a trace through the engine on the simulated device ([`replay()`]).
//! * [`steps`]: how many steps a trace holds, from its repetition ([`estimate_steps`]).
//! * [`settings`]: the settings worth choosing between ([`SETTINGS`]).
//! * [`advise`](mod@advise): which of them for a trace, and the rule that picks it ([`advise()`]).

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod advise;
pub mod peak_resets;
pub mod replay;
pub mod settings;
pub mod steps;
pub mod trace;

pub use advise::{advise, advise_at, parse_budget, Advice, Outcome};
pub use peak_resets::{PeakResets, Peaks};
pub use replay::{
    device_for, replay, sim_engine, ReplayError, ReplayOptions, ReplayReport, ReplayRun,
};
pub use settings::{enable_call_of, settings_for, Setting, SETTINGS};
pub use steps::{estimate_steps, StepEstimate};
pub use trace::{
    load_trace, load_trace_of, parse_bytes, parse_bytes_of, parse_pickle, parse_pickle_device,
    parse_text, trace_name, Trace, TraceError, TraceEvent,
};
