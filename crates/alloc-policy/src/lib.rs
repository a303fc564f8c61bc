//! # alloc-policy
//!
//! Allocation policies for the `alloc-core` engine, each behind a cargo
//! feature (all on by default):
//!
//! - `pytorch-bfc` ([`PytorchBfc`]): PyTorch 2.x's best fit with coalescing.
//! - `buddy` ([`Buddy`]): a binary buddy system.
//! - `size-class` ([`SizeClass`]): per-class free lists carved from slabs.
//! - `gc-age` ([`GcAge`]): garbage collection by age, over any policy.
//!
//! [`AnyPolicy`] chooses among the compiled-in policies at run time from the
//! `policy:` key of the configuration string.

#![warn(missing_docs)]

#[cfg(feature = "buddy")]
pub mod buddy;
pub mod free_index;
#[cfg(feature = "gc-age")]
pub mod gc_age;
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

#[cfg(not(any(feature = "pytorch-bfc", feature = "buddy", feature = "size-class")))]
compile_error!(
    "alloc-policy needs a base policy: enable cargo feature `pytorch-bfc`, `buddy` or \
     `size-class` (`gc-age` alone is not enough: it wraps one of those three)"
);

#[cfg(any(feature = "pytorch-bfc", feature = "buddy", feature = "size-class"))]
mod any;
#[cfg(any(feature = "pytorch-bfc", feature = "buddy", feature = "size-class"))]
pub use any::AnyPolicy;

/// Every base policy of this crate, compiled in or not; each is also the
/// name of the cargo feature that compiles it in.
pub const ALL_BASE_POLICIES: [&str; 3] = ["pytorch-bfc", "buddy", "size-class"];

/// The adaptor that adds garbage collection by age to a base policy
/// (`<base>+gc-age`); also the name of its cargo feature.
pub const GC_AGE: &str = "gc-age";

/// Base policy names compiled into this build, the default first.
pub const BASE_POLICIES: &[&str] = &[
    #[cfg(feature = "pytorch-bfc")]
    "pytorch-bfc",
    #[cfg(feature = "buddy")]
    "buddy",
    #[cfg(feature = "size-class")]
    "size-class",
];

/// Every policy name accepted by [`AnyPolicy::from_config`] in this build:
/// each base policy, and with `gc-age` each base policy with `+gc-age`.
pub fn policy_names() -> Vec<String> {
    let mut names: Vec<String> = BASE_POLICIES.iter().map(|s| s.to_string()).collect();
    if cfg!(feature = "gc-age") {
        names.extend(BASE_POLICIES.iter().map(|s| format!("{s}+gc-age")));
    }
    names
}
