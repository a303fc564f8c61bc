//! Finding the period of a repeating sequence of request sizes, online: a
//! training loop asks for the same sizes in the same order every step.

use std::collections::HashMap;

/// Sizes per window hashed to propose a period: the last `WINDOW` sizes
/// seen again propose the distance to their last sighting.
const WINDOW: usize = 4;
/// The longest period looked for, in requests.
pub const MAX_PERIOD: usize = 1 << 15;
/// A period is confirmed after this many matching requests at least (and a
/// whole period of them).
const MIN_STREAK: usize = 16;

/// Proposes and confirms the period of a sequence fed one value at a time.
///
/// The candidate is the distance back to the last time the current window
/// of four values was seen; it is confirmed once every value for a whole
/// period (and at least sixteen) equals the value one period earlier.
/// A period found inside a step (a model's repeated layers) is confirmed
/// too, fails later when the step leaves the layers, and is then
/// [banned](PeriodDetector::ban): only windows met once a step (the loss,
/// the optimizer) then propose, and they propose the step.
///
/// ```
/// use alloc_policy::layout_plan::PeriodDetector;
///
/// let step = [3u64, 1, 4, 1, 5, 9, 2, 6];
/// let mut d = PeriodDetector::default();
/// let found = (0..10).flat_map(|_| step).find_map(|v| d.push(v));
/// assert_eq!(found, Some(8));
/// ```
#[derive(Debug, Clone, Default)]
pub struct PeriodDetector {
    /// The last [`MAX_PERIOD`] values, a ring indexed by position.
    history: Vec<u64>,
    /// Values pushed so far.
    len: usize,
    /// Window hash -> position of its last value, the last time it was seen.
    last_seen: HashMap<u64, usize>,
    candidate: usize,
    streak: usize,
    banned: Vec<usize>,
}

impl PeriodDetector {
    /// Feeds the next value; returns the period once confirmed (then starts
    /// over, so it is returned once).
    pub fn push(&mut self, value: u64) -> Option<usize> {
        let pos = self.len;
        if self.history.len() < MAX_PERIOD {
            self.history.push(value);
        } else {
            self.history[pos % MAX_PERIOD] = value;
        }
        self.len += 1;
        if self.candidate > 0 && self.value(pos - self.candidate) == value {
            self.streak += 1;
        } else {
            self.candidate = 0;
            self.streak = 0;
        }
        if pos + 1 >= WINDOW {
            let hash = self.window_hash(pos);
            if self.last_seen.len() >= 4 * MAX_PERIOD {
                self.last_seen.clear(); // bounded memory for sequences that never repeat
            }
            if let Some(seen) = self.last_seen.insert(hash, pos) {
                let distance = pos - seen;
                if self.candidate == 0 && distance < MAX_PERIOD && !self.banned.contains(&distance)
                {
                    // The window matched: its values already count.
                    self.candidate = distance;
                    self.streak = WINDOW;
                }
            }
        }
        if self.candidate > 0 && self.streak >= self.candidate.max(MIN_STREAK) {
            let period = self.candidate;
            self.reset();
            return Some(period);
        }
        None
    }

    /// Never proposes `period` again (a plan built on it failed).
    pub fn ban(&mut self, period: usize) {
        if !self.banned.contains(&period) {
            self.banned.push(period);
        }
    }

    /// Forgets the candidate, so that a new one must be confirmed from here.
    pub fn reset(&mut self) {
        self.candidate = 0;
        self.streak = 0;
    }

    /// The value pushed at `pos` (which must be within the last
    /// [`MAX_PERIOD`]).
    fn value(&self, pos: usize) -> u64 {
        self.history[pos % MAX_PERIOD]
    }

    /// A hash of the [`WINDOW`] values ending at `pos`.
    fn window_hash(&self, pos: usize) -> u64 {
        (pos + 1 - WINDOW..=pos).fold(0xcbf2_9ce4_8422_2325, |h, p| {
            (h ^ self.value(p)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first_period(d: &mut PeriodDetector, seq: impl IntoIterator<Item = u64>) -> Option<usize> {
        seq.into_iter().find_map(|v| d.push(v))
    }

    #[test]
    fn finds_a_plain_period() {
        let mut d = PeriodDetector::default();
        let step: Vec<u64> = (0..100u64)
            .map(|i| 512 * (i * 2_654_435_761 % 977 + 1))
            .collect();
        let seq = (0..4).flat_map(|_| step.clone());
        assert_eq!(first_period(&mut d, seq), Some(100));
    }

    #[test]
    fn a_constant_sequence_has_period_one() {
        let mut d = PeriodDetector::default();
        assert_eq!(first_period(&mut d, std::iter::repeat_n(4096, 40)), Some(1));
    }

    #[test]
    fn no_period_in_a_sequence_that_never_repeats() {
        let mut d = PeriodDetector::default();
        assert_eq!(first_period(&mut d, 0..10_000), None);
    }

    /// Layers repeat inside a step: their period is found first, and once
    /// banned the step's own is found.
    #[test]
    fn the_step_is_found_once_the_layer_period_is_banned() {
        let layer: Vec<u64> = (1..=20).collect();
        let mut step: Vec<u64> = Vec::new();
        for _ in 0..6 {
            step.extend(&layer);
        }
        step.extend([100, 200, 300, 400, 500, 600]); // loss and optimizer
        let seq: Vec<u64> = (0..6).flat_map(|_| step.clone()).collect();
        let mut d = PeriodDetector::default();
        let mut found = Vec::new();
        for v in seq {
            if let Some(p) = d.push(v) {
                found.push(p);
                if p != step.len() {
                    d.ban(p);
                }
            }
        }
        assert_eq!(found.first(), Some(&20), "{found:?}");
        assert!(found.contains(&step.len()), "{found:?}");
        assert!(
            found.iter().all(|&p| p == 20 || p == step.len()),
            "{found:?}"
        );
    }

    #[test]
    fn a_broken_streak_must_start_over() {
        let step: Vec<u64> = (1..=30).collect();
        let mut d = PeriodDetector::default();
        // One period and most of a second, then a change: nothing yet.
        let mut seq = step.clone();
        seq.extend(&step[..20]);
        seq.push(999);
        assert_eq!(first_period(&mut d, seq), None);
        // Then a clean run of the period confirms it.
        let clean = (0..3).flat_map(|_| step.clone());
        assert_eq!(first_period(&mut d, clean), Some(30));
    }
}
