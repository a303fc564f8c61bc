//! Segment events: every driver allocation, free, mapping and unmapping of
//! an allocator's memory, reported to an observer as it happens (PyTorch's
//! `segment_alloc`, `segment_free`, `segment_map` and `segment_unmap` trace
//! actions; NCCL registers and deregisters memory on them).

use std::sync::{Arc, RwLock};

/// What happened to a range of device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SegmentAction {
    /// A segment was allocated (`cuMemAlloc`).
    Alloc,
    /// A segment was freed (`cuMemFree`).
    Free,
    /// Physical pages were mapped into a growable range (expandable segments).
    Map,
    /// Pages of a growable range were unmapped.
    Unmap,
}

/// One segment event of device `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentEvent {
    /// The device ordinal.
    pub device: usize,
    /// What happened.
    pub action: SegmentAction,
    /// First byte of the range.
    pub addr: u64,
    /// Bytes in the range.
    pub size: u64,
}

/// Called for every [`SegmentEvent`], with the allocator's lock held: it
/// must not call back into the same allocator.
pub type SegmentObserver = Arc<dyn Fn(SegmentEvent) + Send + Sync>;

/// The observer of one allocator, shared by the allocator (which sets it)
/// and its memory backend (which reports to it).
#[derive(Clone, Default)]
pub(crate) struct ObserverSlot(Arc<RwLock<Option<SegmentObserver>>>);

impl std::fmt::Debug for ObserverSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.0.read().map(|o| o.is_some()).unwrap_or(false);
        f.debug_tuple("ObserverSlot").field(&set).finish()
    }
}

impl ObserverSlot {
    /// Replaces the observer (`None` removes it).
    pub(crate) fn set(&self, observer: Option<SegmentObserver>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = observer;
    }

    /// Reports one event to the observer, if any.
    pub(crate) fn notify(&self, event: SegmentEvent) {
        let guard = self.0.read().unwrap_or_else(|p| p.into_inner());
        if let Some(observer) = guard.as_ref() {
            observer(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn events_reach_the_observer_until_it_is_removed() {
        let slot = ObserverSlot::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let event = SegmentEvent {
            device: 1,
            action: SegmentAction::Map,
            addr: 0x1000,
            size: 2 << 20,
        };
        slot.notify(event); // nobody listens: nothing happens
        let sink = seen.clone();
        slot.set(Some(Arc::new(move |e| sink.lock().unwrap().push(e))));
        slot.clone().notify(event); // clones share the observer
        slot.set(None);
        slot.notify(event);
        assert_eq!(*seen.lock().unwrap(), vec![event]);
        assert_eq!(format!("{slot:?}"), "ObserverSlot(false)");
    }
}
