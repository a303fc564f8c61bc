//! Messages on stderr said once per process, however often their cause
//! recurs (as PyTorch's `TORCH_WARN_ONCE`).

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// A message said at most once.
pub(crate) struct OnceNotice {
    said: AtomicBool,
    message: &'static str,
}

impl OnceNotice {
    /// A notice not said yet.
    pub(crate) const fn new(message: &'static str) -> Self {
        OnceNotice {
            said: AtomicBool::new(false),
            message,
        }
    }

    /// Writes the message to stderr unless it was written before; whether
    /// this call wrote it.
    pub(crate) fn say(&self) -> bool {
        if self.said.swap(true, Ordering::Relaxed) {
            return false;
        }
        let _ = writeln!(std::io::stderr(), "gpualloc: {}", self.message);
        true
    }
}

/// Expandable segments asked for on a device without virtual memory
/// management: ordinary segments serve instead.
pub(crate) static NO_VIRTUAL_MEMORY: OnceNotice = OnceNotice::new(
    "expandable_segments:True is not supported on this device (no virtual memory \
     management): ordinary segments are used instead, as PyTorch does",
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_is_said_once() {
        let n = OnceNotice::new("test notice");
        assert!(n.say());
        assert!(!n.say());
        assert!(!n.say());
    }
}
