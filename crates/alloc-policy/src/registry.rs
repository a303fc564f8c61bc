//! The registry of base policies: one entry per policy, the one place that
//! names it. From the entries [`policies!`] writes [`BasePolicy`] (one
//! variant per compiled-in policy), its `dispatch!` (a `match` over the
//! variants for [`forward_policy!`](alloc_core::forward_policy)), the name
//! tables ([`ALL_BASE_POLICIES`], [`BASE_POLICIES`]), the constructor by
//! name, and the build error without a base policy. A test checks that every entry is a cargo feature of this crate
//! and every feature a policy entry, an adaptor or a test switch;
//! `.ci/features.sh` takes its matrix from the features.
//!
//! What a policy can do is not an entry: it comes from the policy itself
//! ([`Policy::capabilities`](alloc_core::Policy::capabilities)), because it
//! depends on the settings (`pytorch-bfc`'s oversize threshold is
//! `max_split_size_mb`).

use alloc_core::AllocatorConfig;

#[cfg(feature = "pytorch-bfc")]
use crate::{BfcSettings, PytorchBfc};
#[cfg(feature = "buddy")]
use crate::{Buddy, BuddySettings};
#[cfg(feature = "size-class")]
use crate::{SizeClass, SizeClassSettings};

/// Writes the registry's items from its entries, each
/// `Variant(Type) = "name", new: constructor;` with its documentation. The
/// name is also the cargo feature that compiles the policy in. `$d` is a
/// `$` token, for the `dispatch!` macro written inside.
macro_rules! policies {
    ($d:tt $(
        $(#[doc = $doc:literal])*
        $variant:ident($ty:ty) = $name:literal, new: $new:expr;
    )+) => {
        #[cfg(not(any($(feature = $name),+)))]
        compile_error!(concat!(
            "alloc-policy needs a base policy: enable one of its cargo features",
            $(" `", $name, "`",)+
            " (`gc-age` alone is not enough: it adds a collector to a base policy)"
        ));

        /// Writes its items only when at least one base policy is compiled
        /// in (without one, the build stops at the error above alone).
        macro_rules! with_a_base {
            ($d($d item:item)*) => {
                $d(#[cfg(any($(feature = $name),+))] $d item)*
            };
        }

        /// One of the compiled-in base policies, chosen at run time.
        #[cfg(any($(feature = $name),+))]
        #[derive(Debug)]
        // An explicit tag byte: read with one load. Without it the variant
        // is decoded from a niche in the first policy's fields, a few
        // instructions on every dispatched call.
        #[repr(u8)]
        // Held once per engine, inline: a box would put a pointer between
        // every call and the policy's state (one more line to fetch), to
        // save bytes no one counts.
        #[allow(clippy::large_enum_variant)]
        pub enum BasePolicy {
            $(
                $(#[doc = $doc])*
                #[cfg(feature = $name)]
                $variant($ty),
            )+
        }

        /// Every base policy of this crate, compiled in or not, in the
        /// registry's order; each is also the name of the cargo feature that
        /// compiles it in.
        pub const ALL_BASE_POLICIES: &[&str] = &[$($name),+];

        /// Base policy names compiled into this build, the default first.
        pub const BASE_POLICIES: &[&str] = &[$(#[cfg(feature = $name)] $name,)+];

        #[cfg(any($(feature = $name),+))]
        impl BasePolicy {
            /// The compiled-in base policy called `name`, built from `cfg`;
            /// `None` for any other name.
            pub fn from_name(name: &str, cfg: &AllocatorConfig) -> Option<BasePolicy> {
                match name {
                    $(#[cfg(feature = $name)] $name => Some(BasePolicy::$variant(($new)(cfg))),)+
                    _ => None,
                }
            }

            /// The policy's registry name.
            pub fn registry_name(&self) -> &'static str {
                match self {
                    $(#[cfg(feature = $name)] BasePolicy::$variant(_) => $name,)+
                }
            }

            /// The name of the policy with the age-based collector,
            /// `<name>+gc-age`.
            pub fn name_with_gc_age(&self) -> &'static str {
                match self {
                    $(
                        #[cfg(feature = $name)]
                        BasePolicy::$variant(_) => concat!($name, "+", "gc-age"),
                    )+
                }
            }
        }

        /// Reaches whichever policy is inside a [`BasePolicy`], for
        /// [`forward_policy!`](alloc_core::forward_policy) (`ref` and `mut`
        /// calls alike: the match borrows as the policy is borrowed).
        macro_rules! dispatch {
            ($d mode:ident $d base:expr, $d p:ident => $d call:expr) => {
                match $d base {
                    $(#[cfg(feature = $name)] BasePolicy::$variant($d p) => $d call,)+
                }
            };
        }
    };
}

policies! {$
    /// PyTorch's best fit with coalescing.
    PytorchBfc(PytorchBfc) = "pytorch-bfc", new: |cfg| PytorchBfc::new(BfcSettings::from(cfg));
    /// Binary buddy.
    Buddy(Buddy) = "buddy", new: |cfg| Buddy::new(BuddySettings::from(cfg));
    /// Size-class free lists.
    SizeClass(SizeClass) = "size-class", new: |cfg| SizeClass::new(SizeClassSettings::from(cfg));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[features]` table of this crate's Cargo.toml: each feature's
    /// name.
    fn cargo_features() -> Vec<String> {
        let toml = include_str!("../Cargo.toml");
        let table = toml
            .split("\n[features]\n")
            .nth(1)
            .expect("a [features] table");
        table
            .lines()
            .take_while(|l| !l.starts_with('['))
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim().to_string()))
            .collect()
    }

    #[test]
    fn every_entry_is_a_feature_and_every_feature_an_entry() {
        let features = cargo_features();
        for name in ALL_BASE_POLICIES {
            assert!(
                features.iter().any(|f| f == name),
                "policy `{name}` has no cargo feature"
            );
        }
        let others = ["default", crate::GC_AGE, "testing", "arbitrary"];
        for f in &features {
            assert!(
                ALL_BASE_POLICIES.contains(&f.as_str()) || others.contains(&f.as_str()),
                "cargo feature `{f}` is neither a registry entry nor {others:?}"
            );
        }
    }

    #[test]
    fn names_build_their_policy() {
        let cfg = AllocatorConfig::default();
        for name in BASE_POLICIES {
            let p = BasePolicy::from_name(name, &cfg).unwrap();
            assert_eq!(p.registry_name(), *name);
            assert_eq!(p.name_with_gc_age(), format!("{name}+gc-age"));
            assert_eq!(alloc_core::Policy::name(&p), *name);
        }
        assert!(BasePolicy::from_name("first-fit", &cfg).is_none());
        for name in ALL_BASE_POLICIES
            .iter()
            .filter(|n| !BASE_POLICIES.contains(n))
        {
            assert!(BasePolicy::from_name(name, &cfg).is_none());
        }
    }
}
