//! The claim, written once: the decision tree every engine runs inside its open
//! transaction, over a handful of small steps the engine supplies ([`ClaimSteps`]).
//!
//! ```text
//!            begin ──(wait bound ran out)──────────────────────────────▶ InFlight
//!              │
//!              ▼
//!   ┌──▶ insert placeholder ──(inserted)──────────────────────────────▶ Won
//!   │          │ (conflict: the other holder ended)
//!   │          ▼
//!   │       re-read ──(Live)──────────────────────────────────────────▶ Found
//!   │          │ (Expired)                      │ (Vanished)
//!   │          ▼                                │
//!   │   replace under a guard ──(replaced)──────┼─────────────────────▶ Won
//!   │          │ (someone else replaced it)     │
//!   │          ▼                                ▼
//!   └──── next round (at most CLAIM_ROUNDS), or stop when the re-read may miss
//!         the winner, with a retryable Transient error (a new transaction)
//! ```
//!
//! An error from any step ends the transaction ([`ClaimSteps::rollback`]); an error the
//! engine recognises as its bounded wait running out ([`ClaimSteps::waited_too_long`])
//! becomes [`Claimed::InFlight`]. A won transaction is prepared for the effect
//! ([`ClaimSteps::ready`]) and handed over ([`ClaimSteps::won`]).
//!
//! An engine that serializes its writers when the transaction begins (SQLite's
//! `BEGIN IMMEDIATE`) declares [`Capabilities::read_first`]: the claim is then one
//! re-read (a live record is [`Claimed::Found`], anything else is won) and the record
//! is written once, at completion. The same steps, the same answers; only the order of
//! the tree differs, and it is the core that walks it.

use std::future::Future;

use crate::backend::{Claim, Claimed, Stored};
use crate::error::{DbError, ErrorKind};

/// How many times one transaction goes round the claim when the conflicting record
/// vanished (purged) or was replaced by someone else between two statements.
pub const CLAIM_ROUNDS: usize = 3;

/// What an engine's claim differs in, read by [`run`]. Build it with
/// [`Capabilities::new`] and the builder methods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The re-read inside the claiming transaction may not see a winner that committed
    /// after the transaction began (SQL Server under `SNAPSHOT` isolation): a round that
    /// finds nothing stops at once with a retryable [`ErrorKind::Transient`] error, so
    /// the retry starts a new transaction, instead of going round again in this one.
    pub reread_may_miss_winner: bool,
    /// Writers are serialized when the transaction begins (SQLite's `BEGIN IMMEDIATE`):
    /// the claim only re-reads, and the record is written once, by the completion. The
    /// engine's `insert` and `replace_expired` steps are never called.
    pub read_first: bool,
}

impl Capabilities {
    /// The default: insert first, and a re-read that sees every committed winner.
    pub const fn new() -> Self {
        Self {
            reread_may_miss_winner: false,
            read_first: false,
        }
    }

    /// Sets [`Capabilities::reread_may_miss_winner`].
    #[must_use]
    pub const fn reread_may_miss_winner(mut self, yes: bool) -> Self {
        self.reread_may_miss_winner = yes;
        self
    }

    /// Sets [`Capabilities::read_first`].
    #[must_use]
    pub const fn read_first(mut self, yes: bool) -> Self {
        self.read_first = yes;
        self
    }
}

/// What a re-read of the claimed identity found.
#[derive(Debug, Clone, PartialEq)]
pub enum Existing {
    /// No record: purged between two statements (or, under `SNAPSHOT`, committed after
    /// this transaction began).
    Vanished,
    /// A committed record that is still live.
    Live(Stored),
    /// A record whose `expires_at` has passed: the claim may replace it.
    Expired,
}

/// How [`ClaimSteps::begin`] started.
#[derive(Debug)]
pub enum Begun<T> {
    /// A transaction is open; the claim runs in it.
    Open(T),
    /// The engine already knows that a concurrent holder kept the identity past
    /// [`Claim::wait`] (SQLite: the write lock did not come in time while this backend
    /// holds the identity open); nothing is open.
    InFlight,
}

/// An engine's claim, as small steps over its open transaction. [`run`] walks them;
/// the engine never loops or decides itself.
///
/// Every step gets the same [`Claim`]. A step that fails leaves the transaction to
/// [`ClaimSteps::rollback`], which [`run`] always calls for a transaction that did not
/// win.
pub trait ClaimSteps: Send + Sync {
    /// The open transaction between steps (with whatever the engine must restore).
    type Open: Send;
    /// What a won claim hands to the effect ([`crate::Backend::Tx`]).
    type Won: Send;

    /// The engine's name in the errors [`run`] raises; by default, like
    /// [`crate::Backend::engine`], the implementing crate's name without `idem_`.
    fn engine(&self) -> &'static str {
        crate::backend::engine_of_type(std::any::type_name::<Self>())
    }

    /// What this engine's claim differs in; by default none ([`Capabilities::new`]).
    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
    }

    /// Opens the transaction, with its wait for concurrent holders bounded by
    /// [`Claim::wait`] (a lock timeout, a call timeout, a busy timeout).
    fn begin(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Begun<Self::Open>, DbError>> + Send;

    /// Inserts the unfinished placeholder; `false` when the identity is taken (after
    /// waiting for its holder to end).
    fn insert(
        &self,
        tx: &mut Self::Open,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Reads the record of the identity, seeing the latest committed version.
    fn reread(
        &self,
        tx: &mut Self::Open,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Existing, DbError>> + Send;

    /// Replaces an expired record by a new placeholder, guarded by "still expired";
    /// `false` when another claimant changed it first.
    fn replace_expired(
        &self,
        tx: &mut Self::Open,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Prepares a won transaction for the effect (restores the session's own wait
    /// bound, sets a savepoint, reads the claim time).
    fn ready(
        &self,
        tx: &mut Self::Open,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Hands a won, ready transaction to the effect.
    fn won(&self, tx: Self::Open, claim: &Claim<'_>) -> Self::Won;

    /// Ends a transaction that did not win (found a record, failed, or ran out of time),
    /// restoring what `begin` changed. A connection that cannot be rolled back is never
    /// reused.
    fn rollback(&self, tx: Self::Open) -> impl Future<Output = Result<(), DbError>> + Send;

    /// Whether a step's error is the engine's wait bound running out while a concurrent
    /// holder kept the identity (PostgreSQL 55P03, MySQL 1205, SQL Server 1222, Oracle
    /// DPI-1067): the claim answers [`Claimed::InFlight`].
    fn waited_too_long(&self, error: &DbError) -> bool;
}

/// Where the decision tree ended, before the transaction is handed over or ended.
#[derive(Debug)]
enum Decision {
    Won,
    Found(Stored),
}

/// Claims `claim` through `steps`: the only claim loop.
pub async fn run<S: ClaimSteps>(steps: &S, claim: &Claim<'_>) -> Result<Claimed<S::Won>, DbError> {
    let mut tx = match steps.begin(claim).await? {
        Begun::Open(tx) => tx,
        Begun::InFlight => {
            tracing::debug!(engine = steps.engine(), "claim: in flight at begin");
            return Ok(Claimed::InFlight);
        }
    };
    let found = match decide(steps, &mut tx, claim).await {
        Ok(Decision::Won) => match steps.ready(&mut tx, claim).await {
            Ok(()) => return Ok(Claimed::Won(steps.won(tx, claim))),
            Err(e) => Err(e),
        },
        Ok(Decision::Found(stored)) => Ok(stored),
        Err(e) => Err(e),
    };
    let ended = steps.rollback(tx).await;
    match found {
        Ok(stored) => {
            ended?;
            Ok(Claimed::Found(stored))
        }
        // The first error is the one to report; the engine discards a connection it
        // could not roll back.
        Err(e) if steps.waited_too_long(&e) => {
            tracing::debug!(engine = steps.engine(), "claim: wait bound ran out");
            Ok(Claimed::InFlight)
        }
        Err(e) => Err(e),
    }
}

/// The decision tree inside the open transaction.
async fn decide<S: ClaimSteps>(
    steps: &S,
    tx: &mut S::Open,
    claim: &Claim<'_>,
) -> Result<Decision, DbError> {
    let caps = steps.capabilities();
    if caps.read_first {
        return Ok(match steps.reread(tx, claim).await? {
            Existing::Live(stored) => Decision::Found(stored),
            Existing::Vanished | Existing::Expired => Decision::Won,
        });
    }
    for round in 1..=CLAIM_ROUNDS {
        if steps.insert(tx, claim).await? {
            return Ok(Decision::Won);
        }
        match steps.reread(tx, claim).await? {
            Existing::Live(stored) => return Ok(Decision::Found(stored)),
            Existing::Expired => {
                if steps.replace_expired(tx, claim).await? {
                    return Ok(Decision::Won);
                }
            }
            Existing::Vanished => {}
        }
        tracing::debug!(
            engine = steps.engine(),
            round,
            "claim: the record changed; again"
        );
        if caps.reread_may_miss_winner {
            return Err(DbError::new(
                steps.engine(),
                ErrorKind::Transient,
                "the conflicting record was not visible to this transaction (purged, replaced, \
                 or committed after a SNAPSHOT transaction began); claiming again in a new \
                 transaction",
            ));
        }
    }
    Err(DbError::new(
        steps.engine(),
        ErrorKind::Transient,
        "the conflicting record kept changing during the claim",
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::VecDeque;
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::backend::{Identity, Status};
    use crate::ident::{Key, Operation, Principal, Scope};

    /// A scripted engine: each step pops its next answer and is logged.
    #[derive(Default)]
    struct Fake {
        caps: Capabilities,
        begin_in_flight: bool,
        inserts: Mutex<VecDeque<Result<bool, DbError>>>,
        rereads: Mutex<VecDeque<Result<Existing, DbError>>>,
        replaces: Mutex<VecDeque<Result<bool, DbError>>>,
        ready_fails: bool,
        rollback_fails: bool,
        log: Mutex<Vec<&'static str>>,
    }

    fn timeout() -> DbError {
        DbError::new("fake", ErrorKind::LockTimeout, "waited").with_code("WAIT")
    }

    fn broken() -> DbError {
        DbError::new("fake", ErrorKind::Connection, "broken")
    }

    fn live() -> Existing {
        Existing::Live(Stored {
            request: Some("{}".into()),
            response: Some("1".into()),
            status: Status::Succeeded,
        })
    }

    impl Fake {
        fn note(&self, step: &'static str) {
            self.log.lock().unwrap().push(step);
        }
        fn log(&self) -> Vec<&'static str> {
            self.log.lock().unwrap().clone()
        }
        fn with_inserts(self, v: Vec<Result<bool, DbError>>) -> Self {
            *self.inserts.lock().unwrap() = v.into();
            self
        }
        fn with_rereads(self, v: Vec<Result<Existing, DbError>>) -> Self {
            *self.rereads.lock().unwrap() = v.into();
            self
        }
        fn with_replaces(self, v: Vec<Result<bool, DbError>>) -> Self {
            *self.replaces.lock().unwrap() = v.into();
            self
        }
    }

    impl ClaimSteps for Fake {
        type Open = ();
        type Won = &'static str;

        fn engine(&self) -> &'static str {
            "fake"
        }
        fn capabilities(&self) -> Capabilities {
            self.caps
        }
        async fn begin(&self, _: &Claim<'_>) -> Result<Begun<()>, DbError> {
            self.note("begin");
            Ok(if self.begin_in_flight {
                Begun::InFlight
            } else {
                Begun::Open(())
            })
        }
        async fn insert(&self, _: &mut (), _: &Claim<'_>) -> Result<bool, DbError> {
            self.note("insert");
            self.inserts
                .lock()
                .unwrap()
                .pop_front()
                .expect("scripted insert")
        }
        async fn reread(&self, _: &mut (), _: &Claim<'_>) -> Result<Existing, DbError> {
            self.note("reread");
            self.rereads
                .lock()
                .unwrap()
                .pop_front()
                .expect("scripted reread")
        }
        async fn replace_expired(&self, _: &mut (), _: &Claim<'_>) -> Result<bool, DbError> {
            self.note("replace");
            self.replaces
                .lock()
                .unwrap()
                .pop_front()
                .expect("scripted replace")
        }
        async fn ready(&self, _: &mut (), _: &Claim<'_>) -> Result<(), DbError> {
            self.note("ready");
            if self.ready_fails {
                Err(broken())
            } else {
                Ok(())
            }
        }
        fn won(&self, _: (), _: &Claim<'_>) -> &'static str {
            self.note("won");
            "tx"
        }
        async fn rollback(&self, _: ()) -> Result<(), DbError> {
            self.note("rollback");
            if self.rollback_fails {
                Err(broken())
            } else {
                Ok(())
            }
        }
        fn waited_too_long(&self, error: &DbError) -> bool {
            error.code() == Some("WAIT")
        }
    }

    async fn claim(fake: &Fake) -> Result<Claimed<&'static str>, DbError> {
        let scope = Scope::new(
            Principal::new("p").unwrap(),
            Operation::new("op", 1).unwrap(),
        );
        let key = Key::new("k").unwrap();
        let claim = Claim {
            id: Identity::Request {
                scope: &scope,
                key: &key,
            },
            request: Some("{}"),
            retention: Duration::from_secs(60),
            wait: Duration::from_secs(1),
        };
        run(fake, &claim).await
    }

    #[tokio::test]
    async fn an_insert_wins_and_is_readied() {
        let fake = Fake::default().with_inserts(vec![Ok(true)]);
        assert!(matches!(claim(&fake).await, Ok(Claimed::Won("tx"))));
        assert_eq!(fake.log(), ["begin", "insert", "ready", "won"]);
    }

    #[tokio::test]
    async fn a_live_record_is_found_and_the_transaction_ended() {
        let fake = Fake::default()
            .with_inserts(vec![Ok(false)])
            .with_rereads(vec![Ok(live())]);
        let Ok(Claimed::Found(stored)) = claim(&fake).await else {
            panic!("not found")
        };
        assert_eq!(stored.response.as_deref(), Some("1"));
        assert_eq!(fake.log(), ["begin", "insert", "reread", "rollback"]);
    }

    #[tokio::test]
    async fn a_failed_rollback_after_found_is_reported() {
        let mut fake = Fake::default()
            .with_inserts(vec![Ok(false)])
            .with_rereads(vec![Ok(live())]);
        fake.rollback_fails = true;
        let e = claim(&fake).await.expect_err("error");
        assert_eq!(e.kind(), ErrorKind::Connection);
    }

    #[tokio::test]
    async fn an_expired_record_is_replaced_under_its_guard() {
        let fake = Fake::default()
            .with_inserts(vec![Ok(false)])
            .with_rereads(vec![Ok(Existing::Expired)])
            .with_replaces(vec![Ok(true)]);
        assert!(matches!(claim(&fake).await, Ok(Claimed::Won(_))));
        assert_eq!(
            fake.log(),
            ["begin", "insert", "reread", "replace", "ready", "won"]
        );
    }

    #[tokio::test]
    async fn a_lost_replacement_or_a_vanished_record_goes_round_again() {
        let fake = Fake::default()
            .with_inserts(vec![Ok(false), Ok(false), Ok(true)])
            .with_rereads(vec![Ok(Existing::Expired), Ok(Existing::Vanished)])
            .with_replaces(vec![Ok(false)]);
        assert!(matches!(claim(&fake).await, Ok(Claimed::Won(_))));
        assert_eq!(
            fake.log(),
            [
                "begin", "insert", "reread", "replace", "insert", "reread", "insert", "ready",
                "won"
            ]
        );
    }

    #[tokio::test]
    async fn a_record_that_keeps_changing_is_a_transient_error_after_the_last_round() {
        let fake = Fake::default()
            .with_inserts((0..CLAIM_ROUNDS).map(|_| Ok(false)).collect())
            .with_rereads((0..CLAIM_ROUNDS).map(|_| Ok(Existing::Vanished)).collect());
        let e = claim(&fake).await.expect_err("error");
        assert_eq!(e.kind(), ErrorKind::Transient);
        assert!(e.to_string().contains("kept changing"), "{e}");
        let log = fake.log();
        assert_eq!(log.iter().filter(|s| **s == "insert").count(), CLAIM_ROUNDS);
        assert_eq!(log.last(), Some(&"rollback"));
    }

    #[tokio::test]
    async fn a_reread_that_may_miss_the_winner_stops_after_one_round() {
        let mut fake = Fake::default()
            .with_inserts(vec![Ok(false)])
            .with_rereads(vec![Ok(Existing::Vanished)]);
        fake.caps = Capabilities::new().reread_may_miss_winner(true);
        let e = claim(&fake).await.expect_err("error");
        assert_eq!(e.kind(), ErrorKind::Transient);
        assert!(e.to_string().contains("new transaction"), "{e}");
        assert_eq!(fake.log(), ["begin", "insert", "reread", "rollback"]);
    }

    #[tokio::test]
    async fn the_wait_bound_running_out_is_in_flight() {
        let fake = Fake::default().with_inserts(vec![Err(timeout())]);
        assert!(matches!(claim(&fake).await, Ok(Claimed::InFlight)));
        assert_eq!(fake.log(), ["begin", "insert", "rollback"]);
        let fake = Fake {
            begin_in_flight: true,
            ..Fake::default()
        };
        assert!(matches!(claim(&fake).await, Ok(Claimed::InFlight)));
        assert_eq!(fake.log(), ["begin"]);
    }

    #[tokio::test]
    async fn other_errors_end_the_transaction_and_are_returned() {
        let fake = Fake::default()
            .with_inserts(vec![Ok(false)])
            .with_rereads(vec![Err(broken())]);
        let e = claim(&fake).await.expect_err("error");
        assert_eq!(e.kind(), ErrorKind::Connection);
        assert_eq!(fake.log(), ["begin", "insert", "reread", "rollback"]);
        // A failure to get ready (restoring the session's bounds) loses the win.
        let mut fake = Fake::default().with_inserts(vec![Ok(true)]);
        fake.ready_fails = true;
        assert!(claim(&fake).await.is_err());
        assert_eq!(fake.log(), ["begin", "insert", "ready", "rollback"]);
    }

    #[tokio::test]
    async fn read_first_engines_only_reread() {
        let mut fake = Fake::default().with_rereads(vec![Ok(live())]);
        fake.caps = Capabilities::new().read_first(true);
        assert!(matches!(claim(&fake).await, Ok(Claimed::Found(_))));
        assert_eq!(fake.log(), ["begin", "reread", "rollback"]);
        for absent in [Existing::Vanished, Existing::Expired] {
            let mut fake = Fake::default().with_rereads(vec![Ok(absent)]);
            fake.caps = Capabilities::new().read_first(true);
            assert!(matches!(claim(&fake).await, Ok(Claimed::Won(_))));
            assert_eq!(fake.log(), ["begin", "reread", "ready", "won"]);
        }
    }
}
