#![doc = include_str!("../README.md")]
//!
//! ## Items
//!
//! [`AnyPolicy`] holds one of [`PytorchBfc`], [`Buddy`], [`SizeClass`]
//! (a [`BasePolicy`], from the registry in `registry.rs`), each optionally
//! with the collector [`GcAge`]; [`AnyPolicy::from_config`] builds it from a
//! configuration and [`AnyPolicy::engine`] an engine around it.
//! [`policy_names`] lists the names this build accepts.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

// First: its `with_a_base!` is used below.
#[macro_use]
mod registry;
pub use registry::{ALL_BASE_POLICIES, BASE_POLICIES};

#[cfg(feature = "buddy")]
pub mod buddy;
pub mod free_index;
#[cfg(feature = "gc-age")]
pub mod gc_age;
pub mod idle;
pub mod layout_plan;
pub mod per_key;
#[cfg(feature = "pytorch-bfc")]
pub mod pytorch_bfc;
#[cfg(feature = "size-class")]
pub mod size_class;

#[cfg(feature = "buddy")]
pub use buddy::{Buddy, BuddySettings};
#[cfg(feature = "gc-age")]
pub use gc_age::{GcAge, GcAgeSettings};
#[cfg(feature = "pytorch-bfc")]
pub use pytorch_bfc::{BfcSettings, PytorchBfc};
#[cfg(feature = "size-class")]
pub use size_class::{SizeClass, SizeClassSettings};

with_a_base! {
    mod any;
    pub use any::AnyPolicy;
    pub use registry::BasePolicy;
    #[cfg(feature = "testing")]
    pub mod testing;
}

/// The collector that adds garbage collection by age to a base policy
/// (`<base>+gc-age`); also the name of its cargo feature.
pub const GC_AGE: &str = "gc-age";

/// Every policy name accepted by [`AnyPolicy::from_config`] in this build:
/// each base policy, and with `gc-age` each base policy with `+gc-age`.
pub fn policy_names() -> Vec<String> {
    let mut names: Vec<String> = BASE_POLICIES.iter().map(|s| s.to_string()).collect();
    if cfg!(feature = "gc-age") {
        names.extend(BASE_POLICIES.iter().map(|s| format!("{s}+gc-age")));
    }
    names
}
