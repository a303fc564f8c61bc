//! The engine's operations under every policy and setting, checked after each.
//!
//! The input decodes (with `arbitrary`) to a configuration, a simulated
//! device, a GPU lag and a sequence of operations of
//! `alloc_policy::testing::ops`, the model the property tests use; each
//! operation is checked as they check it (`validate()`, the shadow of what
//! was handed out, the outcome it must have), and a violation panics with
//! its description.
#![no_main]

use alloc_core::{AllocatorConfig, SimStreams, GIB, MIB};
use alloc_policy::testing::configs;
use alloc_policy::testing::ops::{Op, Run};
use alloc_policy::AnyPolicy;
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Case {
    setting: Setting,
    device: Device,
    /// Events complete this many host operations after their recording
    /// (`Op::Tick`); none: only when an operation completes them.
    gpu_lag: Option<u8>,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
enum Setting {
    /// One of the configurations of the property tests.
    Named(u8),
    /// Any policy with any combination of the engine's settings.
    Composed {
        policy: Base,
        gc_age: bool,
        growth: Growth,
        max_split: Option<MaxSplit>,
        stream_wait_reuse: bool,
        gc_threshold: Option<Threshold>,
        divisions: Option<Divisions>,
        idle_slab_limit: Option<IdleSlabs>,
    },
}

#[derive(Debug, Arbitrary)]
enum Base {
    PytorchBfc,
    Buddy,
    SizeClass,
}

#[derive(Debug, Arbitrary)]
enum Growth {
    Segments,
    Expandable,
    /// `unmap_free_pages`, with the default page or one of `unmap_page_mb`.
    UnmapFreePages(Option<Page>),
}

#[derive(Debug, Arbitrary)]
enum Page {
    Mb2,
    Mb8,
    Mb16,
    Mb64,
}

#[derive(Debug, Arbitrary)]
enum MaxSplit {
    Mb20,
    Mb64,
    Mb200,
}

#[derive(Debug, Arbitrary)]
enum Threshold {
    Low,
    Mid,
    High,
}

#[derive(Debug, Arbitrary)]
enum Divisions {
    Four,
    PerInterval,
}

#[derive(Debug, Arbitrary)]
enum IdleSlabs {
    None,
    Mb64,
}

#[derive(Debug, Arbitrary)]
enum Device {
    /// Out-of-memory paths on almost every large request.
    Small,
    Mid,
    /// Out of memory only when a fraction limits it.
    Roomy,
}

impl Setting {
    /// Whether the parser takes this setting: a named one always; a
    /// composed one unless it gives its policy an option of another's
    /// (growable segments to buddy or size classes, a slab limit to any
    /// policy but size classes), which the parser refuses, naming both.
    fn parses(&self) -> bool {
        match self {
            Setting::Named(_) => true,
            Setting::Composed {
                policy,
                growth,
                idle_slab_limit,
                ..
            } => {
                let grows = !matches!(growth, Growth::Segments);
                let bfc = matches!(policy, Base::PytorchBfc);
                let slabs = matches!(policy, Base::SizeClass);
                (bfc || !grows) && (slabs || idle_slab_limit.is_none())
            }
        }
    }

    fn config(&self) -> String {
        match self {
            Setting::Named(i) => {
                let all = configs();
                all[usize::from(*i) % all.len()].clone()
            }
            Setting::Composed {
                policy,
                gc_age,
                growth,
                max_split,
                stream_wait_reuse,
                gc_threshold,
                divisions,
                idle_slab_limit,
            } => {
                let base = match policy {
                    Base::PytorchBfc => "pytorch-bfc",
                    Base::Buddy => "buddy",
                    Base::SizeClass => "size-class",
                };
                let mut keys = vec![format!(
                    "policy:{base}{}",
                    if *gc_age { "+gc-age" } else { "" }
                )];
                match growth {
                    Growth::Segments => {}
                    Growth::Expandable => keys.push("expandable_segments:true".into()),
                    Growth::UnmapFreePages(page) => {
                        keys.push("expandable_segments:true,unmap_free_pages:true".into());
                        if let Some(page) = page {
                            let mb = match page {
                                Page::Mb2 => 2,
                                Page::Mb8 => 8,
                                Page::Mb16 => 16,
                                Page::Mb64 => 64,
                            };
                            keys.push(format!("unmap_page_mb:{mb}"));
                        }
                    }
                }
                if let Some(split) = max_split {
                    let mb = match split {
                        MaxSplit::Mb20 => 20,
                        MaxSplit::Mb64 => 64,
                        MaxSplit::Mb200 => 200,
                    };
                    keys.push(format!("max_split_size_mb:{mb}"));
                }
                if *stream_wait_reuse {
                    keys.push("stream_wait_reuse:true".into());
                }
                if let Some(t) = gc_threshold {
                    let t = match t {
                        Threshold::Low => "0.3",
                        Threshold::Mid => "0.6",
                        Threshold::High => "0.9",
                    };
                    keys.push(format!("garbage_collection_threshold:{t}"));
                }
                match divisions {
                    None => {}
                    Some(Divisions::Four) => keys.push("roundup_power2_divisions:4".into()),
                    Some(Divisions::PerInterval) => {
                        keys.push("roundup_power2_divisions:[256:1,512:2,>:4]".into())
                    }
                }
                match idle_slab_limit {
                    None => {}
                    Some(IdleSlabs::None) => keys.push("idle_slab_limit_mb:0".into()),
                    Some(IdleSlabs::Mb64) => keys.push("idle_slab_limit_mb:64".into()),
                }
                keys.join(",")
            }
        }
    }
}

fuzz_target!(|case: Case| {
    let config = case.setting.config();
    let capacity = match case.device {
        Device::Small => 600 * MIB,
        Device::Mid => 8 * GIB,
        Device::Roomy => 64 * GIB,
    };
    let streams = case
        .gpu_lag
        .map_or_else(SimStreams::new, |lag| SimStreams::with_gpu_lag(lag.into()));
    let parsed = AllocatorConfig::parse(&config);
    if !case.setting.parses() {
        assert!(
            parsed.is_err(),
            "{config}: a policy given another policy's option was accepted"
        );
        return;
    }
    let cfg = parsed.unwrap_or_else(|e| panic!("{config}: {e}"));
    // Whatever else a policy refuses when it is built: nothing to run.
    if AnyPolicy::from_config(&cfg).is_err() {
        return;
    }
    let mut run = Run::new(&config, capacity, streams).unwrap_or_else(|e| panic!("{e}"));
    for op in &case.ops {
        if let Err(msg) = run.step(op) {
            panic!("{msg}");
        }
    }
    if let Err(msg) = run.finish() {
        panic!("{msg}");
    }
});
