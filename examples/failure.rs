//! The error type of the examples' `main` (crates/*/examples include this
//! file with `#[path]`): `fn main() -> Result<(), Failure>` prints
//! `Error: ` and the error's message, its `Display` form (what went wrong,
//! what to do), and exits with status 1, where a boxed error would print
//! its `Debug` form (`Error: DriverNotFound`).

use std::error::Error;
use std::fmt;

/// Any error, shown by its message when `main` returns it.
pub struct Failure(Box<dyn Error>);

impl<E: Into<Box<dyn Error>>> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure(error.into())
    }
}

impl fmt::Debug for Failure {
    // `main`'s caller prints the error with `{:?}`: give it the message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
