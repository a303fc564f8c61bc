//! `plan_layout`: learns the layout of a repeating step and places each
//! block of later steps where the plan puts it, so that the same addresses
//! serve the same requests every step.
//!
//! With `unmap_free_pages`, a best fit places a step's blocks a little
//! differently each time, and every difference moves pages: with 2 MiB pages
//! GPT-2 training moved over 1,000 pages a step. A layout planned from one
//! step ([`pack()`]) is the same every step, so once it is followed the
//! pages it covers stay mapped; what still moves comes from a plan spanning
//! more than the peak (docs/policies.md, "Planned layout").
//!
//! How (for the large pool of the first stream that asks for it; private
//! pools and other streams keep the best fit):
//! 1. Detect: the sizes of the requests, in order, go to a
//!    [`PeriodDetector`] until a period is confirmed.
//! 2. Learn: record one period of requests (size, and how many requests
//!    later each block is freed), and the next period's frees.
//! 3. Plan, at the period's quietest place (fewest bytes alive across it):
//!    [`pack()`] the recorded blocks freed within a period around the
//!    blocks that stay (weights, optimizer state), from the start of the
//!    stream's growable segment. Blocks of the last period still allocated
//!    are planned afresh too: kept where best fit put them, they would cut
//!    the plan's space every period.
//! 4. Follow: each request whose size is the plan's for its place in the
//!    period gets its planned address if that range is free, else (in the
//!    first period, where the last unplanned one's blocks still lie) an
//!    address above the plan, as does one that outlives a period; a request
//!    of another size gets best fit. Requests that depart from the plan
//!    beyond a few per period, or planned places still taken after the
//!    first period, drop the plan and go back to 1; a period found inside a
//!    step (repeated layers) fails that way and is not proposed again.

#[cfg(feature = "pytorch-bfc")]
mod follow;
pub mod pack;
pub mod period;

#[cfg(feature = "pytorch-bfc")]
pub use follow::LayoutPlan;
pub use pack::{pack, Life, Order, ORDERS};
pub use period::PeriodDetector;

/// What the layout plan did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Plans made.
    pub plans: u64,
    /// Plans dropped because requests departed from them.
    pub dropped: u64,
    /// Requests placed at their planned address.
    pub placed: u64,
    /// Requests whose planned range was not free: placed by best fit.
    pub conflicts: u64,
    /// Requests whose size was not the plan's.
    pub mismatches: u64,
    /// The period of the plan being followed, in requests (0: none).
    pub period: u64,
}

impl PlanStats {
    /// The counters as `(name, value)` pairs, named `plan_layout.<field>`.
    pub fn named(&self) -> [(&'static str, u64); 6] {
        [
            ("plan_layout.plans", self.plans),
            ("plan_layout.dropped", self.dropped),
            ("plan_layout.placed", self.placed),
            ("plan_layout.conflicts", self.conflicts),
            ("plan_layout.mismatches", self.mismatches),
            ("plan_layout.period", self.period),
        ]
    }
}
