//! Locks that one panic does not disable.
//!
//! A panic while a `std::sync::Mutex` is held poisons it: every later
//! `lock()` returns `Err`. The C library catches panics at its boundary, so
//! the process goes on, and a lock that stayed poisoned would turn every
//! later call of that subsystem into an error for the rest of the process.
//! Every mutex of this crate and of the C library is therefore taken
//! through this module (the segment observer's `RwLock` holds one value
//! replaced whole, and is read as it is after a panic):
//!
//! - [`lock_consistent`] for state that every step leaves consistent (a
//!   configuration replaced whole, a map of owned buffers): a poisoned lock
//!   is taken as it is and its poison cleared.
//! - [`lock_checked`] for state that a panic could leave half-changed (an
//!   engine, a cache with counters): on a poisoned lock the state checks
//!   and, where it can, repairs itself; when it passes, the poison is
//!   cleared ([`Mutex::clear_poison`]) and the call goes on as if nothing
//!   happened. State that fails its check is refused with
//!   [`CudaError::Damaged`] naming what is wrong, never served: handing out
//!   memory from a broken heap would be worse than failing.
//!
//! Panics are not how failures travel here: driver calls return typed
//! errors (a function the loaded driver lacks included), so a failing
//! driver leaves the state untouched. This module is the backstop for a
//! panic that is a bug.
//!
//! An allocator's engine is behind a [`SpinParkMutex`] instead: every
//! allocation and free of a device takes it for about 100 ns, so with
//! several threads on one device it is nearly always contended, and a
//! waiter that goes to sleep at once (a futex wait, then a wake-up system
//! call in the holder's unlock) costs tens of critical sections. A
//! `SpinParkMutex` keeps the same promise as [`lock_checked`] (its own
//! poison flag, checked and cleared the same way).

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::error::CudaError;

/// Locks `mutex`; a poisoned one is taken as it is and its poison cleared.
/// Only for state that a panic cannot leave inconsistent.
pub fn lock_consistent<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| {
        mutex.clear_poison();
        poisoned.into_inner()
    })
}

/// Locks `mutex`; a poisoned one is handed to `recover`, which checks (and
/// may repair) the state: `Ok` clears the poison and returns the lock,
/// `Err(description)` is [`CudaError::Damaged`] and leaves the poison for
/// the next call to check again.
pub fn lock_checked<T>(
    mutex: &Mutex<T>,
    recover: impl FnOnce(&mut T) -> Result<(), String>,
) -> Result<MutexGuard<'_, T>, CudaError> {
    match mutex.lock() {
        Ok(guard) => Ok(guard),
        Err(poisoned) => recovered(mutex, poisoned, recover),
    }
}

#[cold]
fn recovered<'a, T>(
    mutex: &'a Mutex<T>,
    poisoned: PoisonError<MutexGuard<'a, T>>,
    recover: impl FnOnce(&mut T) -> Result<(), String>,
) -> Result<MutexGuard<'a, T>, CudaError> {
    let mut guard = poisoned.into_inner();
    recover(&mut guard).map_err(CudaError::Damaged)?;
    mutex.clear_poison();
    Ok(guard)
}

/// How long a waiter of a [`SpinParkMutex`] waits before it parks, unless
/// [`SPIN_LIMIT_ENV`] says otherwise: the order of a futex sleep and
/// wake-up, so that with no more threads than cores a waiter queued behind
/// a few ~100 ns critical sections does not sleep. Past [`PURE_SPIN`] it
/// yields its core between reads of the lock word, so that a holder that
/// was preempted (more threads than cores) gets to run.
pub const SPIN_LIMIT: Duration = Duration::from_micros(20);

/// How long a waiter spins without yielding its core.
pub const PURE_SPIN: Duration = Duration::from_micros(2);

/// The environment variable that replaces [`SPIN_LIMIT`] for the process
/// (whole microseconds, read at the first contended lock; `0`: park after
/// parking_lot's own brief spin). For measuring the lock on a given host.
pub const SPIN_LIMIT_ENV: &str = "GPUALLOC_LOCK_SPIN_US";

/// [`SPIN_LIMIT`], or the one [`SPIN_LIMIT_ENV`] gives.
pub fn spin_limit() -> Duration {
    static LIMIT: OnceLock<Duration> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var(SPIN_LIMIT_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map_or(SPIN_LIMIT, Duration::from_micros)
    })
}

/// Waits of the spin loop between two reads of the clock.
const SPINS_PER_CLOCK_READ: u32 = 16;

/// Most pause instructions a waiter adds after losing a race for the lock.
const MAX_BACKOFF: u32 = 64;

/// The protected value and its poison flag, on cache lines of their own:
/// waiters spinning on the lock word (before this) do not pull the lines
/// the holder is writing away from it. 128 bytes: the two lines that
/// x86's adjacent-line prefetch moves together.
#[repr(align(128))]
struct Slot<T> {
    /// Set by a guard dropped while its thread panics; read and cleared
    /// with the lock held only.
    poisoned: bool,
    value: T,
}

/// A mutex for state that many threads take briefly (an allocator's
/// engine): a waiter spins, reading the lock word, for up to
/// [`spin_limit`] (yielding its core between reads past [`PURE_SPIN`]),
/// and only then parks (parking_lot's mutex, whose
/// `unlock` is one atomic operation while nobody is parked). A panic with
/// the lock held poisons it as it would a `std::sync::Mutex`, and
/// [`SpinParkMutex::lock_checked`] treats that as [`lock_checked`] does.
pub struct SpinParkMutex<T> {
    inner: parking_lot::Mutex<Slot<T>>,
}

/// The lock of a [`SpinParkMutex`]; dropped during a panic that began
/// after it was taken, it poisons the mutex.
pub struct SpinParkGuard<'a, T> {
    guard: parking_lot::MutexGuard<'a, Slot<T>>,
    /// Whether the thread was already panicking when it took the lock (a
    /// drop handler's lock is not a panic with the lock held).
    panicking: bool,
}

impl<T> SpinParkMutex<T> {
    /// A new, unlocked mutex holding `value`.
    pub const fn new(value: T) -> Self {
        SpinParkMutex {
            inner: parking_lot::const_mutex(Slot {
                poisoned: false,
                value,
            }),
        }
    }

    /// Locks; when a panic left the lock poisoned, the value is first
    /// handed to `recover`, exactly as [`lock_checked`] does.
    #[inline(always)]
    pub fn lock_checked(
        &self,
        recover: impl FnOnce(&mut T) -> Result<(), String>,
    ) -> Result<SpinParkGuard<'_, T>, CudaError> {
        let mut guard = self.acquire();
        if guard.poisoned {
            recover_slot(&mut guard, recover)?;
        }
        Ok(SpinParkGuard {
            guard,
            panicking: std::thread::panicking(),
        })
    }

    /// The value, through exclusive access (no locking; a poison is
    /// ignored).
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner.get_mut().value
    }

    /// Whether a panic left the lock poisoned (waits for the lock).
    pub fn is_poisoned(&self) -> bool {
        self.acquire().poisoned
    }

    #[inline(always)]
    fn acquire(&self) -> parking_lot::MutexGuard<'_, Slot<T>> {
        match self.inner.try_lock() {
            Some(guard) => guard,
            None => self.acquire_contended(),
        }
    }

    /// Spins for up to [`spin_limit`] (reading the lock word, which costs
    /// the holder nothing until it writes it; yielding past [`PURE_SPIN`]),
    /// then parks.
    #[cold]
    #[inline(never)]
    fn acquire_contended(&self) -> parking_lot::MutexGuard<'_, Slot<T>> {
        let limit = spin_limit();
        if limit.is_zero() {
            return self.inner.lock();
        }
        let start = Instant::now();
        let mut backoff = 1;
        loop {
            for _ in 0..SPINS_PER_CLOCK_READ {
                if !self.inner.is_locked() {
                    if let Some(guard) = self.inner.try_lock() {
                        return guard;
                    }
                    // Another waiter won: let its hand-over settle before
                    // this one competes for the line again.
                    for _ in 0..backoff {
                        std::hint::spin_loop();
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                std::hint::spin_loop();
            }
            let waited = start.elapsed();
            if waited >= limit {
                return self.inner.lock();
            }
            if waited >= PURE_SPIN {
                std::thread::yield_now();
            }
        }
    }
}

// A panic with the lock held is seen by the next locker (the poison flag),
// as with `std::sync::Mutex`, which is unwind-safe for the same reason.
impl<T> std::panic::UnwindSafe for SpinParkMutex<T> {}
impl<T> std::panic::RefUnwindSafe for SpinParkMutex<T> {}

impl<T: Default> Default for SpinParkMutex<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T> std::fmt::Debug for SpinParkMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinParkMutex").finish_non_exhaustive()
    }
}

#[cold]
fn recover_slot<T>(
    slot: &mut Slot<T>,
    recover: impl FnOnce(&mut T) -> Result<(), String>,
) -> Result<(), CudaError> {
    recover(&mut slot.value).map_err(CudaError::Damaged)?;
    slot.poisoned = false;
    Ok(())
}

impl<T> Deref for SpinParkGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.guard.value
    }
}

impl<T> DerefMut for SpinParkGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard.value
    }
}

impl<T> Drop for SpinParkGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // Before the lock is released (the field drops after this body).
        if !self.panicking && std::thread::panicking() {
            self.guard.poisoned = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poison<T: Send>(mutex: &Mutex<T>, change: impl FnOnce(&mut T) + Send) {
        std::thread::scope(|s| {
            let _ = s
                .spawn(|| {
                    let mut guard = mutex.lock().unwrap();
                    change(&mut guard);
                    panic!("a panic with the lock held");
                })
                .join();
        });
        assert!(mutex.is_poisoned());
    }

    #[test]
    fn consistent_state_is_taken_and_the_poison_cleared() {
        let m = Mutex::new(1);
        poison(&m, |v| *v = 2);
        assert_eq!(*lock_consistent(&m), 2);
        assert!(!m.is_poisoned());
        assert_eq!(*m.lock().unwrap(), 2, "plain locks work again");
    }

    #[test]
    fn checked_state_is_repaired_or_refused() {
        // (value, counter that must equal it)
        let m = Mutex::new((5, 5));
        poison(&m, |v| v.0 = 7); // left half-changed
        let refuse = |v: &mut (i32, i32)| match v.0 == v.1 {
            true => Ok(()),
            false => Err(format!("{} != {}", v.0, v.1)),
        };
        let e = lock_checked(&m, refuse).unwrap_err();
        assert!(matches!(&e, CudaError::Damaged(d) if d == "7 != 5"), "{e}");
        assert!(m.is_poisoned(), "refused state stays poisoned");
        let repaired = lock_checked(&m, |v| {
            v.1 = v.0;
            Ok(())
        });
        assert_eq!(*repaired.unwrap(), (7, 7));
        assert!(!m.is_poisoned());
        assert_eq!(*lock_checked(&m, refuse).unwrap(), (7, 7));
    }

    fn refuse(v: &mut (i32, i32)) -> Result<(), String> {
        match v.0 == v.1 {
            true => Ok(()),
            false => Err(format!("{} != {}", v.0, v.1)),
        }
    }

    fn poison_spin_park<T: Send>(mutex: &SpinParkMutex<T>, change: impl FnOnce(&mut T) + Send) {
        std::thread::scope(|s| {
            let _ = s
                .spawn(|| {
                    let mut guard = mutex.lock_checked(|_| Ok(())).unwrap();
                    change(&mut guard);
                    panic!("a panic with the lock held");
                })
                .join();
        });
        assert!(mutex.is_poisoned());
    }

    #[test]
    fn spin_park_state_is_repaired_or_refused_after_a_panic() {
        let m = SpinParkMutex::new((5, 5));
        assert!(!m.is_poisoned());
        poison_spin_park(&m, |v| v.0 = 7);
        let e = m.lock_checked(refuse).err().unwrap();
        assert!(matches!(&e, CudaError::Damaged(d) if d == "7 != 5"), "{e}");
        assert!(m.is_poisoned(), "refused state stays poisoned");
        let repaired = m.lock_checked(|v| {
            v.1 = v.0;
            Ok(())
        });
        assert_eq!(*repaired.unwrap(), (7, 7));
        assert!(!m.is_poisoned());
        // A check that would refuse is not run on an unpoisoned lock.
        m.lock_checked(|_| Err("not called".into())).unwrap().0 = 8;
        assert_eq!(m.lock_checked(|_| Ok(())).unwrap().0, 8);
    }

    #[test]
    fn a_lock_taken_while_unwinding_does_not_poison() {
        struct LocksOnDrop<'a>(&'a SpinParkMutex<u32>);
        impl Drop for LocksOnDrop<'_> {
            fn drop(&mut self) {
                *self.0.lock_checked(|_| Ok(())).unwrap() += 1;
            }
        }
        let m = SpinParkMutex::new(0);
        std::thread::scope(|s| {
            let _ = s
                .spawn(|| {
                    let _d = LocksOnDrop(&m);
                    panic!("unwinds through a drop that locks");
                })
                .join();
        });
        assert!(!m.is_poisoned());
        assert_eq!(*m.lock_checked(|_| Ok(())).unwrap(), 1);
    }

    #[test]
    fn spin_park_excludes_under_contention() {
        // Each increment reads and writes in two steps: any overlap of two
        // holders loses counts. Threads beyond the cores make waiters both
        // spin and park.
        const THREADS: u64 = 8;
        const ROUNDS: u64 = 20_000;
        let m = SpinParkMutex::new((0u64, 0u64));
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                s.spawn(|| {
                    for _ in 0..ROUNDS {
                        let mut g = m.lock_checked(|_| Ok(())).unwrap();
                        let seen = g.0;
                        std::hint::black_box(&mut *g);
                        g.0 = seen + 1;
                        g.1 += 1;
                    }
                });
            }
        });
        let mut m = m;
        assert_eq!(*m.get_mut(), (THREADS * ROUNDS, THREADS * ROUNDS));
    }
}
