//! SQLite backend for [idem](https://docs.rs/idem): idempotency records in the same
//! SQLite transaction as your effect.
//!
//! - Every attempt runs in `BEGIN IMMEDIATE`: SQLite has one writer at a time, and an
//!   immediate transaction takes the write lock before it reads, so a DEFERRED
//!   transaction's `SQLITE_BUSY_SNAPSHOT` cannot happen. While it holds the lock, the
//!   claim reads the key; the record is then written **once**, with its final response,
//!   just before `COMMIT` (no placeholder is ever written).
//! - Waiting writers use a busy timeout (5 s by default) and the protocol's bounded,
//!   jittered retry on `SQLITE_BUSY`.
//! - **Bounded waits.** SQLite has one writer at a time, so a claim waits for the write
//!   lock whatever key holds it. The claim's busy wait (and its wait for a pooled
//!   connection) is bounded by [`Claim::wait`] (at most the busy timeout). When it
//!   elapses, the claim answers [`Claimed::InFlight`] (idem's `Error::InProgress`, not
//!   retried) only when this backend (or a clone of it) knows the same identity is
//!   claimed by one of its open transactions (an in-process set of claimed
//!   identities); otherwise the writer is busy with other keys, or another process holds
//!   the lock, and the error stays the retryable `Busy`.
//! - **Retention in the row.** The claim reads the database clock once (after `BEGIN
//!   IMMEDIATE`); the record is written with `created_at` = that moment and
//!   `expires_at` = that moment + the operation's retention (migration 0002; before it,
//!   the window started at completion). Lookups and claims read `expires_at`;
//!   `purge_batch(table, older_than, limit)` deletes records that are expired **and**
//!   claimed at least `older_than` ago. A record whose window ended while its effect ran
//!   is not written: the transaction rolls back with a non-retried error saying the
//!   retention is shorter than the effect.
//! - **Durability.** `synchronous=FULL` by default: an acknowledged commit survives a
//!   power loss. [`Synchronous::Normal`] (faster in WAL mode, may lose the last commits
//!   on power loss) only through [`SqliteOptions::synchronous`].
//! - **In-memory databases** (`sqlite::memory:`) have one connection. A cancelled call
//!   (a timeout, a dropped handler) or a panicking effect rolls that connection's
//!   transaction back and keeps it: the database is never wiped. Inside an effect, run
//!   SQL with [`SqliteTx::run`]: [`SqliteBackend::interact`] (or a nested idem call)
//!   from the effect's own task is refused at once with a
//!   [`ErrorKind::Configuration`] error, and from any other task it waits at most the
//!   busy timeout, then fails with `Busy` (never a deadlock).
//! - **Phased runs and the outbox** ([`idem_core::RunStore`], [`idem_core::OutboxStore`]
//!   on migration 0003's `idem_run` and `idem_outbox`): a run transaction is
//!   `BEGIN IMMEDIATE` too, so the run's row and the outbox need no row locks (one
//!   writer at a time: a second relay waits for the first rather than skipping its
//!   rows). A start's wait for the write lock is bounded by its wait bound; when it
//!   elapses the error is the retryable `Busy`, and idem decides "in progress" from the
//!   run's lease. Phases get a [`SqliteTx`] like effects do.
//! - rusqlite is blocking: every call runs on tokio's blocking pool
//!   ([`tokio::task::spawn_blocking`]), never on the async worker threads. Effects get
//!   a [`SqliteTx`] and run their SQL with [`SqliteTx::run`]. A new request through
//!   `execute` takes three trips there (the claim — the fast path's read, `BEGIN
//!   IMMEDIATE` and the claim's read together —, the effect, the completion); an effect
//!   that is plain synchronous code can use [`ExecuteBlocking::execute_blocking`]
//!   instead: the same protocol, the whole call in one trip.
//! - Files use WAL, so replays (plain reads) never wait for the writer. `sqlite::memory:`
//!   databases have one connection, so concurrent calls queue for it.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Idem, Key, Operation, Principal, Request, Scope};
//! use idem_sqlite::SqliteBackend;
//!
//! let idem = Idem::new(SqliteBackend::connect("sqlite://app.db").await?);
//! idem.migrate().await?;
//! let scope = Scope::new(Principal::new("user-7")?, Operation::new("debit", 1)?);
//! let outcome = idem
//!     .execute(&scope, &Key::new("checkout-42")?, &Request::new(serde_json::json!({"amount": 100})), |tx| {
//!         Box::pin(async move {
//!             tx.run(|c| c.execute("UPDATE account SET balance = balance - 100 WHERE id = 1", []))
//!                 .await
//!                 .map(|_| serde_json::json!({"ok": true}))
//!         })
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

pub mod error_codes;
pub mod leader;
mod runs;
mod sql;
mod sync_effect;

use std::collections::HashSet;
use std::error::Error as StdError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::blocking::{BlockingPool, DEFAULT_ACQUIRE_TIMEOUT, Lease, Manager, PoolOptions};
use idem_core::claim::{self, Begun, Capabilities, ClaimSteps, Existing};
use idem_core::{
    Backend, Claim, Claimed, DbError, ErrorKind, Finish, Identity, Maintenance, Migration, Status,
    Stored, Table,
};
pub use rusqlite;
use rusqlite::{Connection, OptionalExtension, params};

pub use error_codes::db_error;
pub use leader::{SqliteHeld, SqliteLeaderLock};
pub use sync_effect::ExecuteBlocking;

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

const ENGINE: &str = "sqlite";

/// Where the database lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A database file (created if missing).
    File(PathBuf),
    /// A private in-memory database, gone when the backend is dropped.
    Memory,
}

impl Location {
    /// Parses the URL forms sqlx accepts: `sqlite::memory:`, `sqlite://idem.db`
    /// (relative), `sqlite:///abs/path.db`, `sqlite:idem.db`. Query parameters other
    /// than `mode=rwc` are refused rather than ignored.
    pub fn parse(url: &str) -> Result<Self, DbError> {
        let bad = |why: &str| {
            DbError::new(
                ENGINE,
                ErrorKind::Configuration,
                format!("invalid SQLite URL {:?}: {why}", idem_core::redact(url)),
            )
        };
        let rest = url
            .strip_prefix("sqlite:")
            .ok_or_else(|| bad("it must start with sqlite:"))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        for param in query.split('&').filter(|p| !p.is_empty()) {
            if param != "mode=rwc" {
                return Err(bad(&format!("unsupported parameter {param:?}")));
            }
        }
        if path == ":memory:" || path == "//:memory:" {
            return Ok(Self::Memory);
        }
        let path = path.strip_prefix("//").unwrap_or(path);
        if path.is_empty() {
            return Err(bad("no file path"));
        }
        Ok(Self::File(PathBuf::from(path)))
    }
}

/// SQLite's `synchronous` setting: how hard a commit waits for the disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous=FULL` (the default): a commit is on disk before it is acknowledged,
    /// also in WAL mode, so an acknowledged effect survives a power loss.
    #[default]
    Full,
    /// `synchronous=NORMAL`: faster in WAL mode, but the last commits before a power
    /// loss (not a process crash) can be lost, and with them acknowledged effects and
    /// their records. Opt in only when that is acceptable.
    Normal,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

/// How [`SqliteBackend::open_with_options`] opens a database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqliteOptions {
    max_connections: usize,
    acquire_timeout: Duration,
    busy_timeout: Duration,
    synchronous: Synchronous,
}

impl Default for SqliteOptions {
    /// 16 connections (1 in memory), waited for at most 30 s, a 5 s busy timeout,
    /// `synchronous=FULL`.
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Full,
        }
    }
}

impl SqliteOptions {
    /// At most this many connections (forced to 1 for an in-memory database).
    #[must_use]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a free pooled connection before it fails with a
    /// connection error naming the acquire timeout (default 30 s). The same option name
    /// on every engine.
    #[must_use]
    pub fn acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// How long a statement waits for another connection's lock (`busy_timeout`). A
    /// claim waits at most the smaller of this and the call's wait bound.
    #[must_use]
    pub fn busy_timeout(mut self, d: Duration) -> Self {
        self.busy_timeout = d;
        self
    }

    /// The `synchronous` setting (default [`Synchronous::Full`]).
    #[must_use]
    pub fn synchronous(mut self, s: Synchronous) -> Self {
        self.synchronous = s;
        self
    }
}

/// What the pool needs to open connections, and SQLite's hooks for it.
struct Sqlite {
    location: Location,
    busy_timeout: Duration,
    synchronous: Synchronous,
}

impl Manager for Sqlite {
    type Connection = Connection;
    const ENGINE: &'static str = ENGINE;

    fn open(&self) -> Result<Connection, DbError> {
        open_connection(&self.location, self.busy_timeout, self.synchronous)
    }

    fn in_transaction(&self, conn: &Connection) -> bool {
        !conn.is_autocommit()
    }

    /// A connection left inside a transaction (a cancelled call, a panicking effect) is
    /// rolled back and kept: closing it would wipe an in-memory database, whose only
    /// connection it is.
    fn reset(&self, conn: &Connection) -> bool {
        conn.execute_batch(sql::ROLLBACK).is_ok() && conn.is_autocommit()
    }
}

/// The identities this backend's open transactions have claimed (shared by clones).
type InFlight = Arc<Mutex<HashSet<IdOwned>>>;

/// The tokio task whose open idem transaction holds an in-memory database's only
/// connection (shared by clones).
type Holder = Arc<Mutex<Option<tokio::task::Id>>>;

/// Removes a won identity from the in-flight set (and clears the holder) when its
/// transaction ends. A run transaction claims no identity (`id` is `None`).
struct InFlightGuard {
    in_flight: InFlight,
    id: Option<IdOwned>,
    holder: Holder,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if let Some(id) = &self.id {
            lock(&self.in_flight).remove(id);
        }
        *self
            .holder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

fn lock(set: &InFlight) -> std::sync::MutexGuard<'_, HashSet<IdOwned>> {
    // The set holds plain data: a panic while it was locked cannot break it.
    set.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An idem backend on one SQLite database, with a small pool of connections.
#[derive(Clone)]
pub struct SqliteBackend {
    pool: BlockingPool<Sqlite>,
    in_flight: InFlight,
    holder: Holder,
}

impl fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let manager = self.pool.manager();
        f.debug_struct("SqliteBackend")
            .field("location", &manager.location)
            .field("busy_timeout", &manager.busy_timeout)
            .field("synchronous", &manager.synchronous)
            .finish_non_exhaustive()
    }
}

impl SqliteBackend {
    /// Connects by URL (see [`Location::parse`]).
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        Self::open(Location::parse(url)?).await
    }

    /// Opens a database with [`SqliteOptions::default`]: up to 16 connections (one for
    /// `Memory`), a 5 s busy timeout and `synchronous=FULL`.
    pub async fn open(location: Location) -> Result<Self, DbError> {
        Self::open_with_options(location, SqliteOptions::default()).await
    }

    /// Opens a database with `max_connections` (forced to 1 in memory) and a busy timeout.
    pub async fn open_with(
        location: Location,
        max_connections: usize,
        busy_timeout: Duration,
    ) -> Result<Self, DbError> {
        let options = SqliteOptions::default()
            .max_connections(max_connections)
            .busy_timeout(busy_timeout);
        Self::open_with_options(location, options).await
    }

    /// Opens a database with explicit options (for example [`Synchronous::Normal`]).
    pub async fn open_with_options(
        location: Location,
        options: SqliteOptions,
    ) -> Result<Self, DbError> {
        let max = if location == Location::Memory {
            1
        } else {
            options.max_connections.max(1)
        };
        let manager = Sqlite {
            location,
            busy_timeout: options.busy_timeout,
            synchronous: options.synchronous,
        };
        let backend = Self {
            pool: BlockingPool::new(
                manager,
                PoolOptions::new(max).acquire_timeout(options.acquire_timeout),
            )?,
            in_flight: InFlight::default(),
            holder: Holder::default(),
        };
        // Open one connection now so a bad path fails here, not on first use.
        backend.interact(|_| Ok(())).await?;
        Ok(backend)
    }

    /// The database's location.
    pub fn location(&self) -> &Location {
        &self.pool.manager().location
    }

    /// Runs `f` on a pooled connection, outside any idem transaction, on the blocking pool.
    ///
    /// Inside an effect, use [`SqliteTx::run`] instead: an in-memory database has one
    /// connection, which the effect's transaction holds, so `interact` there cannot get
    /// one. It then waits at most the busy timeout and fails with an error that says so
    /// (never a deadlock).
    pub async fn interact<T, F>(&self, f: F) -> Result<T, DbError>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let mut lease = self.lease().await?;
        lease.run(move |c| f(c).map_err(db_error)).await
    }

    /// A connection. An in-memory database's only connection may be held by an open
    /// idem transaction: the wait is then bounded by the busy timeout.
    async fn lease(&self) -> Result<Lease<Sqlite>, DbError> {
        let manager = self.pool.manager();
        if manager.location != Location::Memory {
            return self.pool.lease().await;
        }
        self.refuse_nested()?;
        let wait = manager.busy_timeout;
        match tokio::time::timeout(wait, self.pool.lease()).await {
            Ok(lease) => lease,
            Err(_) => Err(DbError::new(
                ENGINE,
                ErrorKind::Busy,
                format!(
                    "the in-memory database's only connection stayed in use for {wait:?} (the \
                     busy timeout); an idem transaction holds it until its effect ends. Inside \
                     an effect, run SQL with SqliteTx::run, not SqliteBackend::interact"
                ),
            )),
        }
    }

    /// Refuses a call that would wait for an in-memory database's only connection while
    /// the calling task's own idem transaction holds it: the wait would never end.
    fn refuse_nested(&self) -> Result<(), DbError> {
        if self.pool.manager().location != Location::Memory {
            return Ok(());
        }
        let current = tokio::task::try_id();
        let held_by = *self
            .holder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.is_some() && current == held_by {
            return Err(DbError::new(
                ENGINE,
                ErrorKind::Configuration,
                "SqliteBackend::interact (or another idem call) was used inside an effect on an \
                 in-memory database: its only connection is the effect's own transaction. Run \
                 the effect's SQL with SqliteTx::run",
            ));
        }
        Ok(())
    }

    /// A connection for a claim, waited for at most `wait`; `Ok(None)` when it did not
    /// come in time. A nested call on an in-memory database is refused at once.
    async fn lease_within(&self, wait: Duration) -> Result<Option<Lease<Sqlite>>, DbError> {
        self.refuse_nested()?;
        match tokio::time::timeout(wait, self.pool.lease()).await {
            Ok(lease) => lease.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// The transaction handed out on `lease` (inside `BEGIN IMMEDIATE`): a won claim's
    /// (with its identity, already in the in-flight set) or a run transaction's. An
    /// in-memory database notes the task that holds its only connection.
    fn open_tx(&self, lease: Lease<Sqlite>, claimed_at: i64, id: Option<IdOwned>) -> SqliteTx {
        if self.pool.manager().location == Location::Memory {
            *self
                .holder
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = tokio::task::try_id();
        }
        SqliteTx {
            lease,
            claimed_at,
            _claimed: InFlightGuard {
                in_flight: Arc::clone(&self.in_flight),
                id,
                holder: Arc::clone(&self.holder),
            },
        }
    }

    fn is_in_flight(&self, id: &IdOwned) -> bool {
        lock(&self.in_flight).contains(id)
    }

    /// The answer when a claim could not start in time: [`Claimed::InFlight`] when this
    /// backend knows the same identity is claimed by an open transaction, else the
    /// retryable busy error (another key holds the write lock).
    fn not_in_time(&self, id: &IdOwned, busy: DbError) -> Result<Begun<SqliteOpen>, DbError> {
        if self.is_in_flight(id) {
            Ok(Begun::InFlight)
        } else {
            Err(busy)
        }
    }
}

fn open_connection(
    location: &Location,
    busy_timeout: Duration,
    synchronous: Synchronous,
) -> Result<Connection, DbError> {
    let conn = match location {
        Location::File(path) => Connection::open(path),
        Location::Memory => Connection::open_in_memory(),
    }
    .map_err(|e| {
        let where_ = match location {
            Location::File(p) => p.display().to_string(),
            Location::Memory => ":memory:".into(),
        };
        DbError::new(
            ENGINE,
            ErrorKind::Connection,
            format!("cannot open {where_}: {e}"),
        )
        .with_source(e)
    })?;
    conn.busy_timeout(busy_timeout).map_err(db_error)?;
    if matches!(location, Location::File(_)) {
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(db_error)?;
    }
    conn.pragma_update(None, "synchronous", synchronous.pragma())
        .map_err(db_error)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(db_error)?;
    Ok(conn)
}

/// The open `BEGIN IMMEDIATE` transaction handed to effects (and to a phased run's
/// phases, and the outbox relay, through [`idem_core::RunStore::begin_runs`]).
pub struct SqliteTx {
    lease: Lease<Sqlite>,
    /// The database clock at the claim (µs): the record's `created_at` (0 in a run
    /// transaction, which completes no record).
    claimed_at: i64,
    _claimed: InFlightGuard,
}

impl fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTx").finish_non_exhaustive()
    }
}

impl SqliteTx {
    /// Runs `f` on the transaction's connection, on tokio's blocking pool. Everything
    /// `f` writes commits or rolls back with the idempotency record.
    ///
    /// # Panics
    ///
    /// Re-raises a panic of `f`. The connection survives it: the transaction is rolled
    /// back when this `SqliteTx` is dropped, and the connection (an in-memory database's
    /// only one) goes back to the pool.
    pub async fn run<T, F>(&mut self, f: F) -> T
    where
        F: FnOnce(&Connection) -> T + Send + 'static,
        T: Send + 'static,
    {
        let caught = self
            .lease
            .run(move |c| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c))))
            .await;
        match caught {
            Ok(out) => out,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// The error of a completion whose record's window ended while the effect ran.
fn expired_during_effect() -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        "the record expired before the effect finished; the retention is shorter than the \
         effect (idem rolled back and stored nothing)",
    )
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Runs one of the claim's fixed statements (`BEGIN IMMEDIATE`, `COMMIT`) from the
/// connection's statement cache, like [`read_clock`].
fn run_cached(conn: &Connection, statement: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(statement)?.execute([]).map(drop)
}

/// The database clock ([`sql::NOW`]), from the connection's statement cache: parsed once
/// per connection, not on every claim (a new request's claim reads it once).
fn read_clock(conn: &Connection) -> rusqlite::Result<i64> {
    conn.prepare_cached(sql::NOW)?
        .query_row([], |r| r.get::<_, i64>(0))
}

fn read_record(conn: &Connection, claim: &ClaimOwned) -> Result<Option<Stored>, DbError> {
    match &claim.id {
        IdOwned::Request {
            principal,
            operation,
            key,
        } => conn
            .prepare_cached(sql::SELECT_REQUEST)
            .map_err(db_error)?
            .query_row(params![principal, operation, key], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })
            .optional()
            .map_err(db_error)?
            .map(|(request, response, status)| {
                Ok(Stored {
                    request: Some(request),
                    response: Some(response),
                    status: Status::from_code(status)?,
                })
            })
            .transpose(),
        IdOwned::Message {
            subscriber,
            message_id,
        } => conn
            .prepare_cached(sql::SELECT_MESSAGE)
            .map_err(db_error)?
            .query_row(params![subscriber, message_id], |r| {
                r.get::<_, Option<String>>(0)
            })
            .optional()
            .map(|row| {
                row.map(|fingerprint| Stored {
                    request: fingerprint,
                    response: None,
                    status: Status::Succeeded,
                })
            })
            .map_err(db_error),
    }
}

/// An owned copy of a claim, to move onto the blocking pool.
#[derive(Clone)]
struct ClaimOwned {
    id: IdOwned,
    request: Option<String>,
    retention: Duration,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum IdOwned {
    Request {
        principal: String,
        operation: String,
        key: String,
    },
    Message {
        subscriber: String,
        message_id: String,
    },
}

impl From<&Claim<'_>> for ClaimOwned {
    fn from(c: &Claim<'_>) -> Self {
        let id = match c.id {
            Identity::Request { scope, key } => IdOwned::Request {
                principal: scope.principal.as_str().to_owned(),
                operation: scope.operation.as_str().to_owned(),
                key: key.as_str().to_owned(),
            },
            Identity::Message {
                subscriber,
                message_id,
            } => IdOwned::Message {
                subscriber: subscriber.as_str().to_owned(),
                message_id: message_id.as_str().to_owned(),
            },
        };
        Self {
            id,
            request: c.request.map(str::to_owned),
            retention: c.retention,
        }
    }
}

/// A claim's open `BEGIN IMMEDIATE` transaction (the write lock is held), with the
/// claim's owned copy for the blocking pool, and what the trip that began it read: the
/// record (if any) and the database clock. When the replay fast path found a live record
/// in that same trip, no transaction was begun (`in_tx` is false) and the claim ends on
/// it without another trip.
pub struct SqliteOpen {
    lease: Lease<Sqlite>,
    claim: Arc<ClaimOwned>,
    in_tx: bool,
    /// The record read in the trip that began the transaction, until `reread` takes it.
    first_read: Option<Option<Stored>>,
    /// The database clock (µs) read in that trip: the record's `created_at`.
    claimed_at: Option<i64>,
}

impl fmt::Debug for SqliteOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteOpen").finish_non_exhaustive()
    }
}

/// The error of a placeholder step, which SQLite's read-first claim never takes.
fn read_first_only() -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        "internal: SQLite's claim is read-first (Capabilities::read_first); it writes no \
         placeholder",
    )
}

/// What the claim's one trip to the blocking pool found.
enum Opened {
    /// The fast path's read (outside any transaction) found a live record.
    Found(Stored),
    /// `BEGIN IMMEDIATE` holds the write lock; the record read inside it, and the clock.
    Begun(Option<Stored>, i64),
}

/// One claim: the steps [`idem_core::claim::run`] walks. With `lookup_first` (the
/// replay fast path, [`Backend::lookup_or_claim`]) the trip that begins the transaction
/// first reads the record outside any transaction, and begins nothing when it is live.
struct SqliteClaim<'a> {
    backend: &'a SqliteBackend,
    lookup_first: bool,
}

/// The claim's steps; the decision tree is [`idem_core::claim::run`]'s. SQLite declares
/// [`Capabilities::read_first`]: `BEGIN IMMEDIATE` takes the database's write lock (its
/// wait bounded by the claim's wait), so no other writer can claim anything until this
/// transaction ends; the claim is one read of a live record, and the record is written
/// once, with its response, by the completion. The read and the clock reading the
/// record needs travel with `BEGIN IMMEDIATE`: a new request's claim is one trip to the
/// blocking pool (with the fast path's read too).
impl ClaimSteps for SqliteClaim<'_> {
    type Open = SqliteOpen;
    type Won = SqliteTx;

    fn engine(&self) -> &'static str {
        ENGINE
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().read_first(true)
    }

    async fn begin(&self, claim: &Claim<'_>) -> Result<Begun<SqliteOpen>, DbError> {
        let backend = self.backend;
        let wait = claim.wait;
        let claim = Arc::new(ClaimOwned::from(claim));
        let busy = || {
            DbError::new(
                ENGINE,
                ErrorKind::Busy,
                format!("the database stayed locked for the claim's wait bound ({wait:?})"),
            )
        };
        let Some(mut lease) = backend.lease_within(wait).await? else {
            return backend.not_in_time(&claim.id, busy());
        };
        // An open transaction of this backend claimed it: no committed, live record
        // exists; the claim waits (bounded) for that transaction.
        let lookup_first = self.lookup_first && !backend.is_in_flight(&claim.id);
        let busy_timeout = backend.pool.manager().busy_timeout.min(wait);
        let configured = backend.pool.manager().busy_timeout;
        let owned = Arc::clone(&claim);
        let opened = lease
            .run(move |c| -> Result<Opened, DbError> {
                if lookup_first && let Some(stored) = read_record(c, &owned)? {
                    return Ok(Opened::Found(stored));
                }
                // The wait for the write lock is bounded by the claim's wait.
                c.busy_timeout(busy_timeout).map_err(db_error)?;
                let begun = run_cached(c, sql::BEGIN_IMMEDIATE);
                c.busy_timeout(configured).map_err(db_error)?;
                begun.map_err(db_error)?;
                let read = read_record(c, &owned)
                    .and_then(|found| Ok(Opened::Begun(found, read_clock(c).map_err(db_error)?)));
                if read.is_err() {
                    let _ = c.execute_batch(sql::ROLLBACK);
                }
                read
            })
            .await;
        match opened {
            Ok(Opened::Found(stored)) => Ok(Begun::Open(SqliteOpen {
                lease,
                claim,
                in_tx: false,
                first_read: Some(Some(stored)),
                claimed_at: None,
            })),
            Ok(Opened::Begun(found, now)) => Ok(Begun::Open(SqliteOpen {
                lease,
                claim,
                in_tx: true,
                first_read: Some(found),
                claimed_at: Some(now),
            })),
            Err(e) if e.kind() == ErrorKind::Busy => backend.not_in_time(&claim.id, e),
            Err(e) => Err(e),
        }
    }

    async fn insert(&self, _: &mut SqliteOpen, _: &Claim<'_>) -> Result<bool, DbError> {
        Err(read_first_only())
    }

    async fn reread(&self, open: &mut SqliteOpen, _claim: &Claim<'_>) -> Result<Existing, DbError> {
        let found = match open.first_read.take() {
            Some(found) => found,
            None => {
                let claim = Arc::clone(&open.claim);
                open.lease.run(move |c| read_record(c, &claim)).await?
            }
        };
        // The read sees live records only: an expired one is overwritten at completion.
        Ok(found.map_or(Existing::Vanished, Existing::Live))
    }

    async fn replace_expired(&self, _: &mut SqliteOpen, _: &Claim<'_>) -> Result<bool, DbError> {
        Err(read_first_only())
    }

    async fn ready(&self, open: &mut SqliteOpen, _claim: &Claim<'_>) -> Result<(), DbError> {
        if open.claimed_at.is_none() {
            let now = open.lease.run(read_clock).await.map_err(db_error)?;
            open.claimed_at = Some(now);
        }
        Ok(())
    }

    fn won(&self, open: SqliteOpen, _claim: &Claim<'_>) -> SqliteTx {
        let id = open.claim.id.clone();
        lock(&self.backend.in_flight).insert(id.clone());
        self.backend
            .open_tx(open.lease, open.claimed_at.unwrap_or(0), Some(id))
    }

    async fn rollback(&self, mut open: SqliteOpen) -> Result<(), DbError> {
        if !open.in_tx {
            // The fast path's read began nothing.
            return Ok(());
        }
        // A connection still inside the transaction is rolled back by the pool before
        // reuse.
        open.lease
            .run(|c| c.execute_batch(sql::ROLLBACK))
            .await
            .map_err(db_error)
    }

    fn waited_too_long(&self, _error: &DbError) -> bool {
        // The only bounded wait is `begin`'s, which answers in-flight itself.
        false
    }
}

impl Backend for SqliteBackend {
    type Tx = SqliteTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let claim = ClaimOwned::from(claim);
        if self.is_in_flight(&claim.id) {
            // An open transaction of this backend claimed it: no committed, live record
            // exists. The claim waits (bounded) for that transaction.
            return Ok(None);
        }
        let mut lease = self.lease().await?;
        lease.run(move |c| read_record(c, &claim)).await
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<SqliteTx>, DbError> {
        let steps = SqliteClaim {
            backend: self,
            lookup_first: false,
        };
        claim::run(&steps, claim).await
    }

    /// The fast path's read and, when it finds nothing, `BEGIN IMMEDIATE` with the
    /// claim's read: one trip to the blocking pool, on one connection.
    async fn lookup_or_claim(&self, claim: &Claim<'_>) -> Result<Claimed<SqliteTx>, DbError> {
        let steps = SqliteClaim {
            backend: self,
            lookup_first: true,
        };
        claim::run(&steps, claim).await
    }

    async fn finish(
        &self,
        mut tx: SqliteTx,
        claim: &Claim<'_>,
        end: Finish<'_>,
    ) -> Result<(), DbError> {
        let claim = ClaimOwned::from(claim);
        let end = match end {
            Finish::Commit { response, status } => {
                Some((response.map(str::to_owned), status.code()))
            }
            Finish::Rollback => None,
        };
        let claimed_at = tx.claimed_at;
        let expires_at = claimed_at.saturating_add(micros(claim.retention));
        tx.lease
            .run(move |c| -> Result<(), DbError> {
                let Some((response, status)) = end else {
                    return c.execute_batch(sql::ROLLBACK).map_err(db_error);
                };
                let written = match &claim.id {
                    IdOwned::Request {
                        principal,
                        operation,
                        key,
                    } => c.prepare_cached(sql::UPSERT_REQUEST).and_then(|mut s| {
                        s.execute(params![
                            principal,
                            operation,
                            key,
                            claim.request,
                            response,
                            status,
                            claimed_at,
                            expires_at
                        ])
                    }),
                    IdOwned::Message {
                        subscriber,
                        message_id,
                    } => c.prepare_cached(sql::UPSERT_MESSAGE).and_then(|mut s| {
                        s.execute(params![
                            subscriber,
                            message_id,
                            claim.request,
                            claimed_at,
                            expires_at
                        ])
                    }),
                };
                let committed = match written {
                    Ok(1) => run_cached(c, sql::COMMIT).map_err(db_error),
                    // A single-row upsert with no condition on its update writes one row.
                    Ok(n) => Err(DbError::new(
                        ENGINE,
                        ErrorKind::Other,
                        format!("internal: the completion wrote {n} rows instead of one"),
                    )),
                    Err(e) if error_codes::is_window_guard(&e) => Err(expired_during_effect()),
                    Err(e) => Err(db_error(e)),
                };
                if committed.is_err() && !c.is_autocommit() {
                    let _ = c.execute_batch(sql::ROLLBACK);
                }
                committed
            })
            .await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        if let Some(e) = error.downcast_ref::<rusqlite::Error>() {
            return Some(error_codes::classify(e));
        }
        // What a `transparent` wrapper of rusqlite's error exposes as its source.
        error
            .downcast_ref::<rusqlite::ffi::Error>()
            .map(|e| error_codes::kind_of(e.extended_code))
    }
}

impl Maintenance for SqliteBackend {
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        self.interact(|c| {
            c.execute_batch(sql::BEGIN_IMMEDIATE)?;
            let applied = (|| {
                c.execute_batch(sql::CREATE_MIGRATIONS)?;
                let done: Vec<u32> = c
                    .prepare(sql::SELECT_MIGRATIONS)?
                    .query_map([], |r| r.get::<_, u32>(0))?
                    .collect::<Result<_, _>>()?;
                let mut applied = Vec::new();
                for m in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
                    c.execute_batch(m.sql)?;
                    c.execute(sql::INSERT_MIGRATION, params![m.version, m.name])?;
                    applied.push(m.version);
                }
                Ok(applied)
            })();
            match applied {
                Ok(v) => c.execute_batch(sql::COMMIT).map(|()| v),
                Err(e) => {
                    let _ = c.execute_batch(sql::ROLLBACK);
                    Err(e)
                }
            }
        })
        .await
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
        let older = micros(older_than);
        self.interact(move |c| {
            c.execute(statement, params![older, limit])
                .map(|n| n as u64)
        })
        .await
    }
}

/// A path's URL, for messages and tests.
pub fn url_for(path: &Path) -> String {
    format!("sqlite://{}", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_like_sqlx() {
        let file = |p: &str| Ok::<_, String>(Location::File(PathBuf::from(p)));
        let parse = |u: &str| Location::parse(u).map_err(|e| e.to_string());
        assert_eq!(parse("sqlite::memory:"), Ok(Location::Memory));
        assert_eq!(parse("sqlite://idem.db"), file("idem.db"));
        assert_eq!(parse("sqlite:///abs/path.db"), file("/abs/path.db"));
        assert_eq!(parse("sqlite:idem.db"), file("idem.db"));
        assert_eq!(parse("sqlite://idem.db?mode=rwc"), file("idem.db"));
        assert!(
            parse("sqlite://idem.db?mode=ro")
                .unwrap_err()
                .contains("unsupported parameter")
        );
        assert!(
            parse("postgres://x")
                .unwrap_err()
                .contains("must start with sqlite:")
        );
        assert!(parse("sqlite://").unwrap_err().contains("no file path"));
    }
}
