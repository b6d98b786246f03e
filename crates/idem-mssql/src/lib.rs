//! SQL Server backend for idem, on [tiberius](https://docs.rs/tiberius) 0.13 (tokio).
//!
//! **Status: written from SQL Server's documentation (2019–2025) and verified offline
//! only** (SQL text snapshots, error-number classification, URL parsing, connection
//! failure). The shared conformance suite runs against a live server whenever
//! `IDEM_MSSQL_URL` is set; it has not been run live on this project's machines.
//!
//! # The claim: a plain `INSERT`, duplicate classified by 2627/2601, then a re-read
//!
//! Each attempt opens a transaction (`SET XACT_ABORT OFF; SET TRANSACTION ISOLATION
//! LEVEL READ COMMITTED; BEGIN TRANSACTION`) and inserts a placeholder record (response
//! `NULL`) keyed by the primary key `(principal, operation, request_key)`:
//!
//! - no conflicting row: the INSERT succeeds and holds an exclusive key lock until the
//!   transaction ends. This caller won; the effect runs in the same transaction, and
//!   the response is written into the record just before `COMMIT`.
//! - a conflicting row whose transaction is still open: the INSERT's uniqueness check
//!   **waits** for that transaction's exclusive key lock. If it commits, the INSERT
//!   fails with 2627 (2601 for a unique index); if it rolls back, the INSERT succeeds
//!   and this caller takes the key over.
//! - after 2627 a **separate** `SELECT` re-reads the row. Under READ COMMITTED a new
//!   statement sees the committed winner (locking reads wait for any transaction that
//!   holds the row; with `READ_COMMITTED_SNAPSHOT ON` the statement's snapshot starts
//!   after the INSERT's wait ended). A live row is returned as
//!   [`Claimed::Found`] after a rollback; an expired row (`expires_at` passed, by
//!   `SYSUTCDATETIME()`) is taken over by an `UPDATE … WHERE expires_at <= now`, whose
//!   predicate is re-checked on the row's current version once its lock is granted, so
//!   two takers cannot both win (the second updates no row and claims again).
//!
//! 2627 is a *statement*-terminating error: with `XACT_ABORT OFF` (set by every claim)
//! the transaction stays open and usable for the re-read. This is why idem sets it.
//!
//! **Why not the alternatives.** `INSERT … SELECT … WHERE NOT EXISTS (… WITH (UPDLOCK,
//! HOLDLOCK))` is correct too, but `HOLDLOCK` takes a key-*range* lock that is held until
//! `COMMIT`, i.e. for the whole effect: a claim of any *other* new key falling in the
//! same range (for example every key appended after the highest one) waits for that
//! effect. The plain INSERT locks only its own key, so distinct keys never wait for each
//! other. Bare `MERGE` without `HOLDLOCK` is documented to race (two sessions both see
//! "not matched"); `IGNORE_DUP_KEY` turns the duplicate into a warning and silently
//! drops the row. Neither is used.
//!
//! # Bounded waits and `@@TRANCOUNT`
//!
//! The claim's first batch reads `@@TRANCOUNT` and the session's `@@LOCK_TIMEOUT`, then
//! sets `SET LOCK_TIMEOUT <ms>` ([`Claim::wait`], whole milliseconds rounded up, at
//! least 1), the isolation level and `BEGIN TRANSACTION`. A claim still waiting for a
//! concurrent holder of the same identity when the bound elapses gets **1222**; the
//! backend rolls back, sets the session's own lock timeout back and answers
//! [`Claimed::InFlight`] (idem's `Error::InProgress`, not retried). A won claim sets it
//! back before the effect runs, so the effect's own statements are not bounded by it.
//!
//! `@@TRANCOUNT` must be 0 before `BEGIN`: a pooled session left inside a transaction
//! (by `interact`, `SET IMPLICIT_TRANSACTIONS ON`, or a procedure that leaves an extra
//! `BEGIN`) would turn idem's `COMMIT` into a mere decrement. Such a session is rolled
//! back and discarded, and the call fails (non-retried) before anything runs. The commit
//! is `IF @@TRANCOUNT = 1 COMMIT`: any other count (0: the effect ended the transaction;
//! 2+: it left a nested `BEGIN` open) commits nothing, rolls back, discards the session
//! and fails instead of reporting `Executed`.
//!
//! # Retention in the row
//!
//! Each record's `expires_at` is set at the claim (`SYSUTCDATETIME()` + the operation's
//! retention, the same reading as `created_at`); lookups and claims read it, and
//! `purge_batch(table, older_than, limit)` deletes records that are expired **and**
//! claimed at least `older_than` ago. The completion (and, for messages, a check before
//! `COMMIT`) refuses a record that expired while the effect ran: rolled back, with a
//! non-retried error saying the retention is shorter than the effect. Migration 0002
//! adds the column (backfilled as `created_at + 24 hours`). Replay lookups run
//! `SET LOCK_TIMEOUT <wait>; SET TRANSACTION ISOLATION LEVEL READ COMMITTED` in their own
//! `sp_executesql` call (both revert when the call ends), so a session at READ
//! UNCOMMITTED never replays an uncommitted winner, and a locking read that waits for
//! one ends after the bound (1222: no record yet; the claim then answers). JSON stays
//! `nvarchar(max)`, which keeps the text verbatim (UTF-16, no normalization).
//!
//! # Isolation levels
//!
//! READ COMMITTED is the default and the documented choice ([`Isolation`]). REPEATABLE
//! READ and SERIALIZABLE also see the winner (their reads lock). **SNAPSHOT**: the
//! INSERT still waits and fails with 2627, but the re-read reads the transaction's
//! snapshot, which may predate the winner's commit, and finds nothing. The claim then
//! rolls back and returns [`ErrorKind::Transient`]; idem retries with a new transaction,
//! whose snapshot (taken at its first statement) contains the winner. Replacing an
//! expired row that changed after the snapshot began fails with 3960, also retried.
//!
//! # Retries and errors
//!
//! Errors are classified by number ([`error_codes`]), never by message: 1205 deadlock
//! victim → [`ErrorKind::Deadlock`], 1222 lock timeout → [`ErrorKind::LockTimeout`],
//! 3960/3961 snapshot conflicts → [`ErrorKind::SerializationFailure`]; idem retries the
//! whole transaction with the same key. The same applies when such an error comes out
//! of your effect (the protocol finds a `tiberius::error::Error` in the error chain).
//!
//! # Keys, JSON, time
//!
//! Scope and key columns are `varbinary(255)` bound as bytes: string comparison pads
//! trailing spaces even under `_BIN2` collations (`'k' = 'k '`), bytes do not.
//! `varbinary` comparison ignores trailing `0x00`, so idem refuses NUL (every control
//! character) before any SQL. JSON is `nvarchar(max)` and compared as values in Rust.
//! Expiry uses `SYSUTCDATETIME()` and `DATEADD` with the retention split into days,
//! seconds and microseconds (`DATEADD` takes an `int`).
//!
//! # Effects
//!
//! An effect receives a [`MssqlTx`], a connection inside the open transaction, and runs
//! its SQL on [`MssqlTx::client`]:
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::serde_json::json;
//! use idem_core::{Idem, Key, Operation, Principal, Request, Scope};
//! use idem_mssql::{MssqlBackend, db_error};
//!
//! let idem = Idem::new(MssqlBackend::connect("mssql://app:secret@db:1433/app?trust_server_certificate=true").await?);
//! idem.migrate().await?;
//! let scope = Scope::new(Principal::new("user-7")?, Operation::new("debit", 1)?);
//! let request = Request::new(json!({"amount": 100}));
//! let outcome = idem
//!     .execute(&scope, &Key::new("checkout-42")?, &request, |tx| {
//!         Box::pin(async move {
//!             tx.client()
//!                 .execute("UPDATE account SET balance = balance - 100 WHERE id = 1", &[])
//!                 .await
//!                 .map_err(db_error)?;
//!             Ok::<_, idem_core::DbError>(json!({"ok": true}))
//!         })
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Phased runs and the outbox
//!
//! [`MssqlBackend`] implements [`idem_core::RunStore`] and [`idem_core::OutboxStore`]
//! (migration 0003: `idem_run`, `idem_outbox`; not verified live). Their transactions
//! open like a claim's and always run at READ COMMITTED: a run's row is read
//! `WITH (UPDLOCK, HOLDLOCK, ROWLOCK)`, the relay locks the oldest unsent messages
//! `WITH (UPDLOCK, READPAST, ROWLOCK)` and reads a destination's unsent ids with a plain
//! read. `Idem::start` bounds its lock waits with `SET LOCK_TIMEOUT` (the session's own
//! value is set back at `COMMIT`/`ROLLBACK`); 1222 is [`ErrorKind::LockTimeout`].
//!
//! An effect must not `COMMIT` or `ROLLBACK` itself, nor enable `XACT_ABORT` and then
//! swallow an error: completing a record whose transaction already ended fails instead
//! of committing (the record is missing), so nothing is stored as done.
//!
//! # Connections
//!
//! [`MssqlBackend::connect`] takes `mssql://user:password@host:port/database?…`
//! (`sqlserver://` too) or an ADO.NET string; see [`MssqlOptions::parse`]. Encryption
//! is required by default and certificates are validated against the system trust
//! store; use `trust_server_certificate=true` (ADO.NET `TrustServerCertificate=true`)
//! for a development server's self-signed certificate. Connections come from a small
//! pool ([`MssqlOptions::max_connections`], default 16). A connection returns to the
//! pool only when it is outside any transaction and in sync; otherwise (a cancelled
//! call, a transport error) it is closed and the server rolls back.

pub mod error_codes;
pub mod leader;
mod options;
mod pool;
mod runs;
mod sql;

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::claim::{self, Begun, Capabilities, ClaimSteps, Existing};
use idem_core::{
    Backend, BoxFuture, Claim, Claimed, DbError, ErrorKind, Finish, Identity, Maintenance,
    Migration, Status, Stored, Table,
};
pub use tiberius;
use tiberius::Row;
use tiberius::error::Error as TdsError;

pub use error_codes::db_error;
use error_codes::db_error_in;
pub use leader::{MssqlHeld, MssqlLeaderLock};
pub use options::{
    DEFAULT_ACQUIRE_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_CONNECTIONS, Isolation,
    MssqlOptions, redact_url,
};
pub use pool::MssqlClient;
use pool::{Lease, Pool};

/// The engine's name in errors.
pub(crate) const ENGINE: &str = "mssql";

/// The migrations embedded from this crate's `migrations/` directory.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_idempotency_records.sql",
        sql: include_str!("../migrations/0001_idempotency_records.sql"),
    },
    Migration {
        version: 2,
        name: "0002_expiry.sql",
        sql: include_str!("../migrations/0002_expiry.sql"),
    },
    Migration {
        version: 3,
        name: "0003_runs_and_outbox.sql",
        sql: include_str!("../migrations/0003_runs_and_outbox.sql"),
    },
    Migration {
        version: 4,
        name: "0004_outbox_retries.sql",
        sql: include_str!("../migrations/0004_outbox_retries.sql"),
    },
    Migration {
        version: 5,
        name: "0005_drop_claim_time_indexes.sql",
        sql: include_str!("../migrations/0005_drop_claim_time_indexes.sql"),
    },
];

/// The longest retention expressed exactly: 700,000 days (about 1,916 years). Longer
/// ones are treated as this, which keeps `DATEADD` inside `datetime2`'s range.
const MAX_RETENTION_DAYS: u64 = 700_000;

/// An idem backend on a pool of SQL Server connections.
#[derive(Clone)]
pub struct MssqlBackend {
    pool: Arc<Pool>,
}

impl fmt::Debug for MssqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MssqlBackend")
            .field("pool", &self.pool)
            .finish()
    }
}

/// The open transaction handed to effects: a pooled connection inside
/// `BEGIN TRANSACTION`. Run the effect's SQL on [`MssqlTx::client`]; it commits or
/// rolls back with the idempotency record.
pub struct MssqlTx {
    lease: Lease,
    /// The session's own `LOCK_TIMEOUT` (-1: no limit), when `begin_runs` bounded it:
    /// set back when the transaction ends.
    restore_lock_timeout: Option<i32>,
}

impl fmt::Debug for MssqlTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MssqlTx").finish_non_exhaustive()
    }
}

impl MssqlTx {
    /// The connection, inside the open transaction.
    pub fn client(&mut self) -> &mut MssqlClient {
        self.lease.client()
    }
}

/// `(days, seconds, microseconds)` of a retention, each within `DATEADD`'s `int`.
pub(crate) fn cutoff_parts(retention: Duration) -> (i32, i32, i32) {
    let secs = retention.as_secs();
    let days = secs / 86_400;
    if days > MAX_RETENTION_DAYS {
        return (i32::try_from(MAX_RETENTION_DAYS).unwrap_or(i32::MAX), 0, 0);
    }
    (
        i32::try_from(days).unwrap_or(i32::MAX),
        i32::try_from(secs % 86_400).unwrap_or(0),
        i32::try_from(retention.subsec_micros()).unwrap_or(0),
    )
}

fn read_error(what: &str) -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::CorruptRecord,
        format!("unexpected {what} in a stored record"),
    )
}

fn text(row: &Row, idx: usize) -> Result<Option<String>, DbError> {
    row.try_get::<&str, _>(idx)
        .map(|v| v.map(str::to_owned))
        .map_err(|e| db_error_in("reading a stored record", e))
}

fn stored_request(row: &Row) -> Result<Stored, DbError> {
    let status: u8 = row
        .try_get::<u8, _>(2)
        .map_err(|e| db_error_in("reading a stored record", e))?
        .ok_or_else(|| read_error("NULL status"))?;
    Ok(Stored {
        request: text(row, 0)?,
        response: text(row, 1)?,
        status: Status::from_code(i64::from(status))?,
    })
}

fn stored_message(row: &Row) -> Result<Stored, DbError> {
    Ok(Stored {
        request: text(row, 0)?,
        response: None,
        status: Status::Succeeded,
    })
}

fn expired(row: &Row, idx: usize) -> Result<bool, DbError> {
    row.try_get::<i32, _>(idx)
        .map(|v| v == Some(1))
        .map_err(|e| db_error_in("reading a stored record", e))
}

/// The bound identity: byte strings for the primary key columns.
enum Ids<'a> {
    Request {
        principal: &'a [u8],
        operation: &'a [u8],
        key: &'a [u8],
    },
    Message {
        subscriber: &'a [u8],
        message_id: &'a [u8],
    },
}

impl<'a> Ids<'a> {
    fn of(claim: &Claim<'a>) -> Self {
        match claim.id {
            Identity::Request { scope, key } => Self::Request {
                principal: scope.principal.as_str().as_bytes(),
                operation: scope.operation.as_str().as_bytes(),
                key: key.as_str().as_bytes(),
            },
            Identity::Message {
                subscriber,
                message_id,
            } => Self::Message {
                subscriber: subscriber.as_str().as_bytes(),
                message_id: message_id.as_str().as_bytes(),
            },
        }
    }
}

/// The claim's first batch: `LOCK_TIMEOUT` bounded by the wait (whole milliseconds,
/// rounded up, at least 1: 0 would mean "never wait"), then the isolation level and
/// `BEGIN`, returning `@@TRANCOUNT` from before `BEGIN`.
pub(crate) fn begin_batch(isolation: Isolation, wait: Duration) -> String {
    format!(
        "{}; {}{}; {}",
        sql::CLAIM_STATE,
        sql::SET_LOCK_TIMEOUT,
        lock_timeout_ms(wait),
        isolation.begin_sql()
    )
}

/// A wait bound as `SET LOCK_TIMEOUT` takes it: whole milliseconds, rounded up, at
/// least 1 (0 would mean "never wait"), at most `i32::MAX`.
pub(crate) fn lock_timeout_ms(wait: Duration) -> u128 {
    wait.as_nanos()
        .div_ceil(1_000_000)
        .clamp(1, i32::MAX as u128)
}

/// The error of a completion that found no unfinished, unexpired record.
fn not_completed(expired: Option<i32>) -> DbError {
    if expired == Some(1) {
        DbError::new(
            ENGINE,
            ErrorKind::Other,
            "the record expired before the effect finished; the retention is shorter than the \
             effect (idem rolled back and stored nothing)",
        )
    } else {
        DbError::new(
            ENGINE,
            ErrorKind::Other,
            "the record is gone from idem's transaction: the transaction ended inside the effect \
             (did it COMMIT, ROLLBACK, or hit an error with XACT_ABORT ON?); nothing was stored",
        )
    }
}

impl MssqlBackend {
    /// Connects by URL or ADO.NET connection string (see [`MssqlOptions::parse`]) and
    /// opens one connection now, so a wrong address or login fails here.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        Self::connect_with(MssqlOptions::parse(url)?).await
    }

    /// Connects with explicit options.
    pub async fn connect_with(options: MssqlOptions) -> Result<Self, DbError> {
        let backend = Self::connect_lazy(options)?;
        // Open one connection now; it stays in the pool.
        let lease = backend.pool.acquire().await?;
        drop(lease);
        Ok(backend)
    }

    /// Builds the backend without opening a connection; the first call opens one. A wrong
    /// address or login then fails that call, where [`MssqlBackend::connect_with`] fails
    /// at once. For a service that may start before its database.
    pub fn connect_lazy(options: MssqlOptions) -> Result<Self, DbError> {
        Ok(Self {
            pool: Arc::new(Pool::new(options)?),
        })
    }

    /// The options this backend connects with.
    pub fn options(&self) -> &MssqlOptions {
        &self.pool.options
    }

    /// Runs `f` on a pooled connection, outside any idem transaction. Leave no
    /// transaction open: the connection goes back to the pool after `f` succeeds (or
    /// fails with a server error).
    pub async fn interact<T, F>(&self, f: F) -> Result<T, DbError>
    where
        T: Send,
        F: for<'c> FnOnce(&'c mut MssqlClient) -> BoxFuture<'c, Result<T, TdsError>>,
    {
        let mut lease = self.pool.acquire().await?;
        lease.set_in_tx(true);
        let result = f(lease.client()).await;
        match &result {
            Ok(_) | Err(TdsError::Server(_)) => lease.set_in_tx(false),
            Err(_) => {}
        }
        result.map_err(db_error)
    }

    /// Closes the idle connections and refuses new work. Connections in use close when
    /// they are returned.
    pub async fn close(&self) {
        self.pool.close();
    }

    /// Opens a transaction on a pooled session with `begin` (a batch that starts with
    /// [`sql::CLAIM_STATE`] and ends with `BEGIN TRANSACTION`): returns the lease and
    /// the session's `LOCK_TIMEOUT` from before the batch (-1: no limit). A session that
    /// was already inside a transaction is discarded, and the call fails before
    /// anything runs.
    pub(crate) async fn open_transaction(&self, begin: &str) -> Result<(Lease, i32), DbError> {
        let mut lease = self.pool.acquire().await?;
        let row = match lease.begin(begin).await {
            Ok(row) => row,
            Err(e) => {
                let e = db_error_in("beginning the transaction", e);
                return Err(self.rollback_after(lease, e).await);
            }
        };
        let before = row
            .as_ref()
            .and_then(|r| r.try_get::<i32, _>(0).ok().flatten());
        if before != Some(0) {
            // Never reuse a session whose transaction state is not idem's.
            lease.discard();
            let e = DbError::new(
                ENGINE,
                ErrorKind::Other,
                format!(
                    "the pooled session was already inside a transaction \
                     (@@TRANCOUNT = {before:?} before BEGIN; left open by interact, \
                     SET IMPLICIT_TRANSACTIONS ON or a procedure); the connection was \
                     discarded and nothing ran"
                ),
            );
            return Err(self.rollback_after(lease, e).await);
        }
        let session_lock_timeout = row
            .as_ref()
            .and_then(|r| r.try_get::<i32, _>(1).ok().flatten())
            .unwrap_or(-1);
        Ok((lease, session_lock_timeout))
    }

    /// Runs `batch` (ending in [`sql::CHECKED_COMMIT`]): commits only when
    /// `@@TRANCOUNT` is exactly 1, otherwise rolls every level back and discards the
    /// session. `what` names the code that may have ended the transaction.
    pub(crate) async fn checked_commit(
        &self,
        mut lease: Lease,
        batch: &str,
        what: &str,
    ) -> Result<(), DbError> {
        match lease.batch(batch).await {
            Ok(row) => {
                let found = row.and_then(|r| r.try_get::<i32, _>(0).ok().flatten());
                if found == Some(1) {
                    lease.mark_committed();
                    return Ok(());
                }
                // Not idem's transaction alone: roll back every level, never reuse it.
                lease.discard();
                let e = DbError::new(
                    ENGINE,
                    ErrorKind::Other,
                    format!(
                        "@@TRANCOUNT was {found:?} at commit instead of 1 ({what} ended the \
                         transaction, or left a nested BEGIN open); nothing was committed, \
                         the session was rolled back and discarded"
                    ),
                );
                Err(self.rollback_after(lease, e).await)
            }
            Err(e) => {
                let e = db_error_in("committing", e);
                Err(self.rollback_after(lease, e).await)
            }
        }
    }

    async fn rollback_after(&self, mut lease: Lease, error: DbError) -> DbError {
        // Best effort: if the rollback fails the lease is closed, which rolls back too.
        let _ = lease.rollback().await;
        error
    }
}

/// A claim's open transaction on a pooled session, with the session's own
/// `LOCK_TIMEOUT` to give back (-1: no limit).
pub struct MssqlOpen {
    lease: Lease,
    session_lock_timeout: i32,
}

impl fmt::Debug for MssqlOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MssqlOpen").finish_non_exhaustive()
    }
}

/// The claim's steps; the decision tree is [`idem_core::claim::run`]'s. A conflict is
/// error 2627/2601 on a plain `INSERT`; under `SNAPSHOT` the re-read may miss the winner,
/// so a round that finds nothing ends the transaction and the retry starts a new one.
impl ClaimSteps for MssqlBackend {
    type Open = MssqlOpen;
    type Won = MssqlTx;

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
            .reread_may_miss_winner(self.pool.options.isolation == Isolation::Snapshot)
    }

    async fn begin(&self, claim: &Claim<'_>) -> Result<Begun<MssqlOpen>, DbError> {
        let begin = begin_batch(self.pool.options.isolation, claim.wait);
        let (lease, session_lock_timeout) = self.open_transaction(&begin).await?;
        Ok(Begun::Open(MssqlOpen {
            lease,
            session_lock_timeout,
        }))
    }

    async fn insert(&self, open: &mut MssqlOpen, claim: &Claim<'_>) -> Result<bool, DbError> {
        let inserted = claim_write(
            &mut open.lease,
            claim,
            sql::INSERT_REQUEST,
            sql::INSERT_MESSAGE,
        )
        .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(e) if error_codes::classify(&e) == ErrorKind::UniqueViolation => Ok(false),
            Err(e) => Err(db_error_in("claiming the key", e)),
        }
    }

    async fn reread(&self, open: &mut MssqlOpen, claim: &Claim<'_>) -> Result<Existing, DbError> {
        let reread = |e| db_error_in("re-reading the conflicting record", e);
        let (row, expired_column) = match Ids::of(claim) {
            Ids::Request {
                principal,
                operation,
                key,
            } => (
                open.lease
                    .query_row(sql::SELECT_REQUEST, &[&principal, &operation, &key])
                    .await
                    .map_err(reread)?,
                3,
            ),
            Ids::Message {
                subscriber,
                message_id,
            } => (
                open.lease
                    .query_row(sql::SELECT_MESSAGE, &[&subscriber, &message_id])
                    .await
                    .map_err(reread)?,
                1,
            ),
        };
        let Some(row) = row else {
            return Ok(Existing::Vanished);
        };
        if expired(&row, expired_column)? {
            return Ok(Existing::Expired);
        }
        match Ids::of(claim) {
            Ids::Request { .. } => stored_request(&row).map(Existing::Live),
            Ids::Message { .. } => stored_message(&row).map(Existing::Live),
        }
    }

    async fn replace_expired(
        &self,
        open: &mut MssqlOpen,
        claim: &Claim<'_>,
    ) -> Result<bool, DbError> {
        let n = claim_write(
            &mut open.lease,
            claim,
            sql::REPLACE_EXPIRED_REQUEST,
            sql::REPLACE_EXPIRED_MESSAGE,
        )
        .await
        .map_err(|e| db_error_in("replacing an expired record", e))?;
        Ok(n == 1)
    }

    async fn ready(&self, open: &mut MssqlOpen, _claim: &Claim<'_>) -> Result<(), DbError> {
        // Won: the effect runs with the session's default lock timeout.
        let restore = format!("{}{}", sql::SET_LOCK_TIMEOUT, open.session_lock_timeout);
        open.lease
            .batch(&restore)
            .await
            .map(drop)
            .map_err(|e| db_error_in("resetting LOCK_TIMEOUT", e))
    }

    fn won(&self, open: MssqlOpen, _claim: &Claim<'_>) -> MssqlTx {
        MssqlTx {
            lease: open.lease,
            restore_lock_timeout: None,
        }
    }

    async fn rollback(&self, open: MssqlOpen) -> Result<(), DbError> {
        let mut lease = open.lease;
        let restore = format!("{}{}", sql::SET_LOCK_TIMEOUT, open.session_lock_timeout);
        let ended = lease.rollback().await;
        let reset = lease.batch(&restore).await;
        if ended.is_err() || reset.is_err() {
            lease.discard();
        }
        ended.map_err(|e| db_error_in("ending the claim's transaction", e))
    }

    fn waited_too_long(&self, error: &DbError) -> bool {
        // A concurrent holder kept the identity past the wait bound.
        error.code() == Some("1222")
    }
}

/// One of the claim's writes (the placeholder `INSERT`, or the guarded takeover of an
/// expired record): both bind the key, the request and the retention's parts.
async fn claim_write(
    lease: &mut Lease,
    claim: &Claim<'_>,
    request_sql: &str,
    message_sql: &str,
) -> Result<u64, TdsError> {
    let (days, secs, micros) = cutoff_parts(claim.retention);
    let request = claim.request;
    match Ids::of(claim) {
        Ids::Request {
            principal,
            operation,
            key,
        } => {
            lease
                .execute(
                    request_sql,
                    &[
                        &principal,
                        &operation,
                        &key,
                        &request.unwrap_or_default(),
                        &days,
                        &secs,
                        &micros,
                    ],
                )
                .await
        }
        Ids::Message {
            subscriber,
            message_id,
        } => {
            lease
                .execute(
                    message_sql,
                    &[&subscriber, &message_id, &request, &days, &secs, &micros],
                )
                .await
        }
    }
}

impl Backend for MssqlBackend {
    type Tx = MssqlTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let mut lease = self.pool.acquire().await?;
        let bound = format!("{}{}; ", sql::SET_LOCK_TIMEOUT, lock_timeout_ms(claim.wait));
        let row = match Ids::of(claim) {
            Ids::Request {
                principal,
                operation,
                key,
            } => {
                let statement = format!("{bound}{}", sql::LOOKUP_REQUEST);
                lease
                    .query_row(&statement, &[&principal, &operation, &key])
                    .await
                    .map(|row| row.as_ref().map(stored_request).transpose())
            }
            Ids::Message {
                subscriber,
                message_id,
            } => {
                let statement = format!("{bound}{}", sql::LOOKUP_MESSAGE);
                lease
                    .query_row(&statement, &[&subscriber, &message_id])
                    .await
                    .map(|row| row.as_ref().map(stored_message).transpose())
            }
        };
        match row {
            Ok(stored) => stored,
            // A locking read (no READ_COMMITTED_SNAPSHOT) still waiting for an
            // uncommitted winner past the bound: nothing committed to replay yet; the
            // claim answers instead, bounded too.
            Err(e) if e.code() == Some(1222) => Ok(None),
            Err(e) => Err(db_error_in("looking up the record", e)),
        }
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<MssqlTx>, DbError> {
        claim::run(self, claim).await
    }

    async fn finish(
        &self,
        mut tx: MssqlTx,
        claim: &Claim<'_>,
        end: Finish<'_>,
    ) -> Result<(), DbError> {
        let (response, status) = match end {
            Finish::Rollback => {
                return tx
                    .lease
                    .rollback()
                    .await
                    .map_err(|e| db_error_in("rolling back", e));
            }
            Finish::Commit { response, status } => (response, status),
        };
        if let Ids::Request {
            principal,
            operation,
            key,
        } = Ids::of(claim)
        {
            let completed = tx
                .lease
                .execute(
                    sql::COMPLETE_REQUEST,
                    &[&principal, &operation, &key, &response, &status.code()],
                )
                .await;
            match completed {
                Ok(1) => {}
                Ok(_) => {
                    let expired = tx
                        .lease
                        .query_row(sql::EXPIRED_REQUEST, &[&principal, &operation, &key])
                        .await
                        .ok()
                        .flatten()
                        .and_then(|r| r.try_get::<i32, _>(0).ok().flatten());
                    let e = not_completed(expired);
                    return Err(self.rollback_after(tx.lease, e).await);
                }
                Err(e) => {
                    let e = db_error_in("completing the record", e);
                    return Err(self.rollback_after(tx.lease, e).await);
                }
            }
        }
        if let Ids::Message {
            subscriber,
            message_id,
        } = Ids::of(claim)
        {
            let row = tx
                .lease
                .query_row(sql::EXPIRED_MESSAGE, &[&subscriber, &message_id])
                .await;
            let expired = match row {
                Ok(row) => row.and_then(|r| r.try_get::<i32, _>(0).ok().flatten()),
                Err(e) => {
                    let e = db_error_in("checking the record before commit", e);
                    return Err(self.rollback_after(tx.lease, e).await);
                }
            };
            if expired != Some(0) {
                let e = not_completed(expired);
                return Err(self.rollback_after(tx.lease, e).await);
            }
        }
        self.checked_commit(tx.lease, sql::CHECKED_COMMIT, "the effect")
            .await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        error_codes::classify_dyn(error)
    }
}

impl Maintenance for MssqlBackend {
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        let mut lease = self.pool.acquire().await?;
        if let Err(e) = lease.begin(sql::BEGIN_READ_COMMITTED).await {
            let e = db_error_in("beginning the migration", e);
            return Err(self.rollback_after(lease, e).await);
        }
        match migrate_in(&mut lease).await {
            Ok(applied) => {
                lease
                    .commit()
                    .await
                    .map_err(|e| db_error_in("committing the migration", e))?;
                Ok(applied)
            }
            Err(e) => Err(self.rollback_after(lease, e).await),
        }
    }

    async fn purge_batch(
        &self,
        table: Table,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, DbError> {
        let statement = match table {
            Table::Requests => sql::PURGE_REQUESTS,
            Table::Messages => sql::PURGE_MESSAGES,
            Table::Runs => sql::PURGE_RUNS,
            Table::Outbox => sql::PURGE_OUTBOX,
        };
        let (days, secs, micros) = cutoff_parts(older_than);
        let mut lease = self.pool.acquire().await?;
        lease
            .execute(statement, &[&days, &secs, &micros, &i64::from(limit)])
            .await
            .map_err(|e| db_error_in("purging", e))
    }
}

async fn migrate_in(lease: &mut Lease) -> Result<Vec<u32>, DbError> {
    let status = lease
        .batch(sql::MIGRATION_LOCK)
        .await
        .map_err(|e| db_error_in("taking the migration lock", e))?
        .and_then(|row| row.try_get::<i32, _>(0).ok().flatten());
    match status {
        Some(0 | 1) => {}
        Some(-1) => {
            return Err(DbError::new(
                ENGINE,
                ErrorKind::LockTimeout,
                "another migrator held the migration lock (sp_getapplock) for 60 s",
            ));
        }
        Some(-3) => {
            return Err(DbError::new(
                ENGINE,
                ErrorKind::Deadlock,
                "the migration lock request (sp_getapplock) was chosen as a deadlock victim",
            ));
        }
        other => {
            return Err(DbError::new(
                ENGINE,
                ErrorKind::Other,
                format!("sp_getapplock refused the migration lock (status {other:?})"),
            ));
        }
    }
    lease
        .batch(sql::CREATE_MIGRATIONS)
        .await
        .map_err(|e| db_error_in("creating idem_schema_migrations", e))?;
    let done: Vec<i32> = lease
        .query_all(sql::SELECT_MIGRATIONS, &[])
        .await
        .map_err(|e| db_error_in("reading idem_schema_migrations", e))?
        .iter()
        .filter_map(|row| row.try_get::<i32, _>(0).ok().flatten())
        .collect();
    let mut applied = Vec::new();
    for m in MIGRATIONS {
        let version = i32::try_from(m.version).unwrap_or(i32::MAX);
        if done.contains(&version) {
            continue;
        }
        for (i, statement) in m.statements().iter().enumerate() {
            lease.batch(statement).await.map_err(|e| {
                db_error_in(&format!("migration {} statement {}", m.name, i + 1), e)
            })?;
        }
        lease
            .execute(sql::INSERT_MIGRATION, &[&version, &m.name])
            .await
            .map_err(|e| db_error_in("recording the migration", e))?;
        applied.push(m.version);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {

    use super::*;

    #[tokio::test]
    async fn a_lazy_backend_connects_on_its_first_call() {
        let options = MssqlOptions::parse("mssql://sa:unused@127.0.0.1:1/master").unwrap();
        let backend = MssqlBackend::connect_lazy(options).unwrap();
        // Nothing listens on port 1: the first call is the one that fails.
        let err = backend.migrate().await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    }

    /// deadpool's checkout future holds tiberius's connect path (about 55 KiB); awaited in
    /// place it made every future above it at least as large, `Idem::execute`'s included.
    /// `Pool::acquire` boxes it. No server: nothing here is polled.
    #[tokio::test]
    async fn checkout_future_is_boxed() {
        let options = MssqlOptions::parse("mssql://sa:unused@127.0.0.1:1/master").unwrap();
        let pool = Pool::new(options).unwrap();
        let checkout = std::mem::size_of_val(&pool.acquire());
        assert!(checkout <= 64, "Pool::acquire's future is {checkout} bytes");
    }

    #[test]
    fn retention_splits_into_dateadd_ints() {
        assert_eq!(cutoff_parts(Duration::from_millis(400)), (0, 0, 400_000));
        assert_eq!(cutoff_parts(Duration::from_secs(24 * 3600)), (1, 0, 0));
        assert_eq!(
            cutoff_parts(Duration::from_secs(90_061) + Duration::from_micros(500_000)),
            (1, 3661, 500_000)
        );
        // 100 years: one int of seconds would overflow.
        assert_eq!(
            cutoff_parts(Duration::from_secs(100 * 365 * 86_400)),
            (36_500, 0, 0)
        );
        assert_eq!(cutoff_parts(Duration::MAX), (700_000, 0, 0));
        assert_eq!(cutoff_parts(Duration::from_nanos(999)), (0, 0, 0));
    }

    #[test]
    fn claims_bound_their_lock_waits_and_check_trancount() {
        let batch = begin_batch(Isolation::ReadCommitted, Duration::from_millis(500));
        insta::assert_snapshot!(batch, @"SELECT @@TRANCOUNT AS trancount, @@LOCK_TIMEOUT AS lock_timeout; SET LOCK_TIMEOUT 500; SET XACT_ABORT OFF; SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN TRANSACTION");
        // 0 would mean "do not wait at all"; partial milliseconds round up.
        assert!(
            begin_batch(Isolation::ReadCommitted, Duration::ZERO).contains("SET LOCK_TIMEOUT 1;")
        );
        assert!(
            begin_batch(Isolation::Snapshot, Duration::from_micros(1500))
                .contains("SET LOCK_TIMEOUT 2;")
        );
        assert!(
            begin_batch(Isolation::Serializable, Duration::MAX)
                .contains(&format!("SET LOCK_TIMEOUT {};", i32::MAX))
        );
        assert!(sql::CHECKED_COMMIT.contains("IF @trancount = 1 COMMIT TRANSACTION"));
    }

    #[test]
    fn migration_0002_adds_expires_at() {
        let statements = MIGRATIONS[1].statements();
        assert_eq!(statements.len(), 6);
        assert!(
            statements[0]
                .starts_with("IF COL_LENGTH(N'idem_request_result', N'expires_at') IS NULL")
        );
        assert!(statements[1].contains("DATEADD(hour, 24, created_at)"));
        assert!(statements[4].contains("DATEADD(hour, 24, processed_at)"));
    }

    #[test]
    fn migration_0003_creates_runs_and_the_outbox_guarded() {
        assert_eq!(MIGRATIONS.len(), 5);
        assert_eq!(MIGRATIONS[2].version, 3);
        let statements = MIGRATIONS[2].statements();
        assert_eq!(statements.len(), 6, "{statements:#?}");
        for s in &statements {
            assert!(s.starts_with("IF "), "every statement is guarded: {s}");
            assert!(!s.trim_end().ends_with(';'), "{s}");
        }
        assert!(statements[0].contains("CREATE TABLE idem_run"));
        assert!(statements[3].contains("CREATE TABLE idem_outbox"));
        let all = statements
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for column in [
            "principal",
            "operation",
            "request_key",
            "destination",
            "message_id",
        ] {
            assert!(
                all.contains(&format!("{column} varbinary(255) NOT NULL")),
                "{column} is not varbinary(255)"
            );
        }
        assert!(all.contains("id bigint IDENTITY(1, 1) NOT NULL"));
        assert!(all.contains("CREATE INDEX idem_outbox_unsent ON idem_outbox (destination, id)"));
    }

    #[test]
    fn migration_0005_drops_the_claim_time_indexes_guarded() {
        assert_eq!(MIGRATIONS[4].version, 5);
        let statements = MIGRATIONS[4].statements();
        assert_eq!(statements.len(), 2, "{statements:#?}");
        for (s, index) in statements.iter().zip([
            "idem_request_result_created_at",
            "idem_processed_message_processed_at",
        ]) {
            assert!(
                s.starts_with(&format!(
                    "IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'{index}'"
                )),
                "{s}"
            );
            assert!(s.contains(&format!("DROP INDEX {index} ON ")), "{s}");
            assert!(!s.trim_end().ends_with(';'), "{s}");
        }
    }

    #[test]
    fn migration_splits_into_guarded_statements() {
        let statements = MIGRATIONS[0].statements();
        assert_eq!(statements.len(), 4);
        assert!(statements[0].starts_with("IF OBJECT_ID(N'idem_request_result', N'U') IS NULL"));
        assert!(statements[1].contains("CREATE INDEX idem_request_result_created_at"));
        assert!(statements[2].contains("CREATE TABLE idem_processed_message"));
        assert!(statements[3].contains("CREATE INDEX idem_processed_message_processed_at"));
        for s in &statements {
            assert!(!s.trim_end().ends_with(';'), "{s}");
            assert!(!s.contains("GO\n"), "no client-side batch separators");
        }
        let all = statements
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for column in [
            "principal",
            "operation",
            "request_key",
            "subscriber",
            "message_id",
        ] {
            assert!(
                all.contains(&format!("{column} varbinary(255) NOT NULL")),
                "{column} is not varbinary(255)"
            );
        }
        assert!(all.contains("SYSUTCDATETIME()"));
        assert!(all.contains("nvarchar(max)"));
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("tokio: {e}"))
    }

    /// Nothing listens on 127.0.0.1:1: the connection is refused (no server answers).
    #[test]
    fn connecting_where_nothing_listens_fails_fast() {
        let rt = runtime();
        for url in [
            "mssql://sa:Sup3r-S3cret@127.0.0.1:1/master?connect_timeout=3",
            "Server=tcp:127.0.0.1,1;Database=master;User Id=sa;Password=Sup3r-S3cret;TrustServerCertificate=true",
        ] {
            let err = match rt.block_on(MssqlBackend::connect(url)) {
                Ok(b) => panic!("connected to {b:?}"),
                Err(e) => e,
            };
            // Refused at once: a connection error naming the address, not a hang.
            assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
            let text = err.to_string();
            assert!(text.contains("127.0.0.1:1"), "{text}");
            assert!(!text.contains("Sup3r-S3cret"), "{text}");
        }
    }

    /// A listener that accepts and never answers: the connect timeout bounds the login.
    /// (No TDS byte is ever sent back, so no server "answers".)
    /// A listener that accepts connections and never answers; returns its port and the
    /// task holding the sockets.
    async fn silent_listener() -> (u16, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("addr: {e}"))
            .port();
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        (port, hold)
    }

    #[test]
    fn acquisition_is_bounded_by_the_acquire_timeout() {
        let rt = runtime();
        rt.block_on(async {
            let (port, hold) = silent_listener().await;
            // One slot, taken by a login that hangs (a silent listener) for up to 30 s:
            // a second call gives up after the acquire timeout, with a clear error.
            let url = format!(
                "mssql://sa:Sup3r-S3cret@127.0.0.1:{port}/master?connect_timeout=30&max_connections=1"
            );
            let options = MssqlOptions::parse(&url)
                .unwrap_or_else(|e| panic!("url: {e}"))
                .acquire_timeout(Duration::from_millis(200));
            let pool = Arc::new(Pool::new(options).unwrap_or_else(|e| panic!("pool: {e}")));
            let first = tokio::spawn({
                let pool = Arc::clone(&pool);
                async move { pool.acquire().await.map(drop) }
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            let err = match tokio::time::timeout(Duration::from_secs(20), pool.acquire()).await {
                Ok(Ok(_)) => panic!("a second connection while the only slot is taken"),
                Ok(Err(e)) => e,
                Err(_) => panic!("the acquire timeout did not bound the wait"),
            };
            assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
            assert!(
                err.to_string()
                    .contains("(the acquire timeout; max_connections 1)"),
                "{err}"
            );
            assert!(!err.to_string().contains("Sup3r-S3cret"), "{err}");
            first.abort();
            pool.close();
            let closed = pool.acquire().await.map(drop);
            assert!(
                closed.is_err_and(|e| e.to_string().contains("pool is closed")),
                "a closed pool refuses leases"
            );
            hold.abort();
        });
    }

    #[test]
    fn a_silent_listener_hits_the_connect_timeout() {
        let rt = runtime();
        rt.block_on(async {
            let (port, hold) = silent_listener().await;
            let url = format!("mssql://sa:Sup3r-S3cret@127.0.0.1:{port}/master?connect_timeout=1");
            // Without the connect timeout this login would wait forever; the generous
            // guard only turns such a hang into a failure.
            let err =
                match tokio::time::timeout(Duration::from_secs(60), MssqlBackend::connect(&url))
                    .await
                {
                    Ok(Ok(b)) => panic!("connected to {b:?}"),
                    Ok(Err(e)) => e,
                    Err(_) => panic!("connect_timeout did not bound the login"),
                };
            assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
            assert!(
                err.to_string().contains(&format!("127.0.0.1:{port}")),
                "{err}"
            );
            assert!(!err.to_string().contains("Sup3r-S3cret"));
            hold.abort();
        });
    }

    #[test]
    fn bad_urls_fail_before_any_connection() {
        let rt = runtime();
        let err = match rt.block_on(MssqlBackend::connect("mssql://sa:Sup3r-S3cret@h:x/db")) {
            Ok(b) => panic!("connected to {b:?}"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), ErrorKind::Configuration);
        assert!(!err.to_string().contains("Sup3r-S3cret"));
    }
}
