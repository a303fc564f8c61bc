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

use std::sync::{Mutex, MutexGuard, PoisonError};

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
}
