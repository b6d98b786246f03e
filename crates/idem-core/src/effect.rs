//! Which error types an effect may return, and how idem looks inside them.
//!
//! An effect's error is inspected for a driver error (a deadlock, a serialization
//! failure) so that the whole transaction is retried with the same key. That works for
//! every common shape of error type:
//!
//! - your own error type implementing [`std::error::Error`], whether it wraps the driver
//!   error with `#[error(transparent)]`, `#[from]` or `#[source]` (thiserror), or by hand;
//! - [`anyhow::Error`](https://docs.rs/anyhow), `eyre::Report` and other report types that
//!   give access to their error with `AsRef<dyn Error + Send + Sync>`;
//! - `Box<dyn Error + Send + Sync>`.
//!
//! The chain is walked from the outermost error through every `source()`, and each link
//! is offered to the engine's classifier, which recognizes both the driver's top-level
//! error and the database error inside it (what a `transparent` wrapper exposes).

use std::error::Error as StdError;
use std::fmt;

/// An error type an effect may return. Implemented for every
/// `std::error::Error + Send + Sync + 'static` type and for every report type that is
/// `AsRef<dyn Error + Send + Sync>` (anyhow, eyre, `Box<dyn Error + Send + Sync>`).
///
/// The type parameter `M` only tells those two families apart; it is inferred, so you
/// never name it.
pub trait EffectError<M>: fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// The error as a standard error, to walk its chain of sources.
    fn as_std_error(&self) -> &(dyn StdError + 'static);

    /// The error boxed as a standard error (kept as the source of a retried attempt).
    fn into_std_error(self) -> Box<dyn StdError + Send + Sync + 'static>
    where
        Self: Sized;
}

/// Marker for error types that implement [`std::error::Error`].
#[derive(Debug)]
pub enum StdErrorMarker {}

/// Marker for report types that are `AsRef<dyn Error + Send + Sync>`.
#[derive(Debug)]
pub enum ReportMarker {}

impl<T> EffectError<StdErrorMarker> for T
where
    T: StdError + Send + Sync + 'static,
{
    fn as_std_error(&self) -> &(dyn StdError + 'static) {
        self
    }

    fn into_std_error(self) -> Box<dyn StdError + Send + Sync + 'static> {
        Box::new(self)
    }
}

impl<T> EffectError<ReportMarker> for T
where
    T: AsRef<dyn StdError + Send + Sync + 'static>
        + Into<Box<dyn StdError + Send + Sync + 'static>>
        + fmt::Debug
        + fmt::Display
        + Send
        + Sync
        + 'static,
{
    fn as_std_error(&self) -> &(dyn StdError + 'static) {
        self.as_ref()
    }

    fn into_std_error(self) -> Box<dyn StdError + Send + Sync + 'static> {
        self.into()
    }
}

/// The first link of `error`'s chain (itself included) for which `classify` answers.
pub(crate) fn find_in_chain<T>(
    error: &(dyn StdError + 'static),
    mut classify: impl FnMut(&(dyn StdError + 'static)) -> Option<T>,
) -> Option<T> {
    let mut cur = Some(error);
    // A chain is finite in practice; the bound guards against a cyclic `source()`.
    for _ in 0..64 {
        let err = cur?;
        if let Some(found) = classify(err) {
            return Some(found);
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stands for the database error a driver error carries (sqlx's `PgDatabaseError`
    /// inside `sqlx::Error::Database`, mysql_async's `ServerError` inside
    /// `mysql_async::Error::Server`).
    #[derive(Debug, thiserror::Error)]
    #[error("deadlock detected")]
    struct Server;

    /// Stands for the driver's error type.
    #[derive(Debug, thiserror::Error)]
    #[error("driver: {0}")]
    struct Driver(#[source] Server);

    #[derive(Debug, thiserror::Error)]
    enum Transparent {
        #[error(transparent)]
        Db(#[from] Driver),
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Sourced(#[source] Driver);

    fn finds_server<M, E: EffectError<M>>(e: &E) -> bool {
        find_in_chain(e.as_std_error(), |err| {
            err.downcast_ref::<Server>().map(|_| ())
        })
        .is_some()
    }

    #[test]
    fn every_shape_exposes_the_database_error() {
        assert!(finds_server(&Driver(Server)));
        assert!(finds_server(&Sourced(Driver(Server))));
        // `transparent` skips the driver error itself but still reaches what it carries.
        assert!(finds_server(&Transparent::Db(Driver(Server))));
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(Driver(Server));
        assert!(finds_server(&boxed));
    }

    #[test]
    fn a_cyclic_or_empty_chain_ends() {
        #[derive(Debug, thiserror::Error)]
        #[error("plain")]
        struct Plain;
        assert!(!finds_server(&Plain));
    }
}
