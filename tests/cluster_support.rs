//! Shared by the cluster test targets: a backend wrapper that counts the retryable
//! conflicts idem retried (Galera certification failures at `COMMIT`, deadlocks in
//! statements), and the classification of a failed call.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem::core::{Backend, Claim, Claimed, DbError, Error, ErrorKind, Finish, Stored};
use idem_conformance::BankError;

/// Retryable conflicts seen by one or more backends.
#[derive(Debug, Default)]
pub struct Stats {
    /// Retryable errors returned by `COMMIT` (Galera: certification failures, 1213).
    pub commit_conflicts: AtomicU64,
    /// Retryable errors returned while claiming (deadlocks, brute-force aborts).
    pub claim_conflicts: AtomicU64,
    /// Retryable engine errors inside effects (counted by the test's effect).
    pub effect_conflicts: AtomicU64,
}

impl Stats {
    /// All retried conflicts.
    pub fn total(&self) -> u64 {
        self.commit_conflicts.load(Ordering::SeqCst)
            + self.claim_conflicts.load(Ordering::SeqCst)
            + self.effect_conflicts.load(Ordering::SeqCst)
    }

    /// One line for the test output.
    pub fn line(&self) -> String {
        format!(
            "conflicts retried with the same key: {} at COMMIT (certification failures), {} while claiming, {} inside effects",
            self.commit_conflicts.load(Ordering::SeqCst),
            self.claim_conflicts.load(Ordering::SeqCst),
            self.effect_conflicts.load(Ordering::SeqCst)
        )
    }
}

/// A backend that counts the retryable errors of the wrapped one, and changes nothing.
#[derive(Debug, Clone)]
pub struct Counted<B> {
    /// The real backend.
    pub inner: B,
    /// Where the counts go.
    pub stats: Arc<Stats>,
}

fn retryable(e: &DbError) -> bool {
    e.kind().is_retryable()
}

impl<B: Backend> Backend for Counted<B> {
    type Tx = B::Tx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        self.inner.lookup(claim).await
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<B::Tx>, DbError> {
        let r = self.inner.claim(claim).await;
        if let Err(e) = &r
            && retryable(e)
        {
            self.stats.claim_conflicts.fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    async fn finish(&self, tx: B::Tx, claim: &Claim<'_>, end: Finish<'_>) -> Result<(), DbError> {
        let commit = matches!(end, Finish::Commit { .. });
        let r = self.inner.finish(tx, claim, end).await;
        if let Err(e) = &r
            && commit
            && retryable(e)
        {
            self.stats.commit_conflicts.fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        self.inner.classify(error)
    }
}

/// Counts a retryable engine error an effect returns.
pub fn count_effect_error(stats: &Stats, e: &BankError) {
    if let BankError::Db(d) = e
        && retryable(d)
    {
        stats.effect_conflicts.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether a failed call lost its server (the outcome is unknown: retry the same key,
/// elsewhere if the server is gone).
pub fn lost_server(e: &Error<BankError>) -> bool {
    match e {
        Error::Effect(BankError::Db(d)) => d.kind() == ErrorKind::Connection,
        other => other
            .db_error()
            .is_some_and(|d| d.kind() == ErrorKind::Connection),
    }
}

/// Runs `f` under a hang guard: a stuck cluster fails the test instead of hanging CI.
pub fn guarded<T>(
    rt: &tokio::runtime::Runtime,
    what: &str,
    secs: u64,
    f: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    rt.block_on(async {
        tokio::time::timeout(std::time::Duration::from_secs(secs), f)
            .await
            .unwrap_or_else(|_| Err(format!("{what}: still running after {secs} s (hang guard)")))
    })
}
