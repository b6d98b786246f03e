//! MySQL and MariaDB backend for idem, on [mysql_async](https://docs.rs/mysql_async)
//! (InnoDB; written for MySQL 8.4 and MariaDB 10.11, tested live on MariaDB 10.11).
//!
//! # The claim: a plain `INSERT`, classified by error 1062
//!
//! Inside the effect's transaction, the claim inserts a placeholder record (response
//! `NULL`) with a plain `INSERT`:
//!
//! - it succeeds: this transaction owns the identity; the effect runs and the
//!   placeholder is completed with the response just before `COMMIT`, so no other
//!   session ever sees it unfinished;
//! - another transaction holds an uncommitted row with the same primary key: InnoDB makes
//!   the `INSERT` wait for it. If it rolls back, the `INSERT` succeeds (takeover); if it
//!   commits, the `INSERT` fails with **1062** (`ER_DUP_ENTRY`), which rolls back only
//!   that statement, not the transaction;
//! - after 1062 the record is re-read with a **locking read** (`LOCK IN SHARE MODE`,
//!   valid on MariaDB 10.11 and MySQL 8.4). Under the default REPEATABLE READ a plain
//!   `SELECT` is a consistent read that may return an older snapshot; a locking read
//!   returns the latest committed version. It is a *shared* lock because the failed
//!   `INSERT` already holds one on that row: several losers asking for an exclusive lock
//!   (`FOR UPDATE`) at once would deadlock each other.
//! - a record whose `expires_at` has passed (by `UTC_TIMESTAMP(6)`, the database
//!   clock) is taken over in place by an `UPDATE … WHERE expires_at <= UTC_TIMESTAMP(6)`
//!   and never returned.
//!
//! # Bounded waits
//!
//! The claim's statements run with `innodb_lock_wait_timeout` set to [`Claim::wait`] in
//! whole seconds (rounded up, at least 1: the server's unit and minimum), and the effect
//! and the pooled session keep their own value. On MariaDB (its `@@version`, read once
//! per backend) each claim statement carries its bound, `SET STATEMENT
//! innodb_lock_wait_timeout = N FOR INSERT …`: no round trip of its own, nothing to
//! restore. MySQL 8.4 has no `SET STATEMENT … FOR`: there the session's value is saved
//! and bounded after `START TRANSACTION` and restored right after the claim (`SET
//! SESSION`, two round trips). A claim still waiting for a concurrent holder of the same
//! identity gets **1205**; the backend rolls back and answers [`Claimed::InFlight`]
//! (idem's `Error::InProgress`, not retried). A 1205 inside the effect is still a
//! retried lock timeout.
//!
//! # Merged messages on MariaDB
//!
//! On a single MariaDB server (MySQL 8, TiDB and MariaDB Galera nodes keep separate
//! statements: on Galera a replicated write set can abort a transaction between two
//! statements of one message, see `Server::galera`) a new request costs one round trip
//! more than its bare effect, none without the replay read:
//!
//! - **`START TRANSACTION` and the claim travel in one text message**,
//!   `START TRANSACTION; SET STATEMENT innodb_lock_wait_timeout = N FOR INSERT …`
//!   (mysql_async sets `CLIENT_MULTI_STATEMENTS`; the server runs them in order and
//!   stops at the first error). A 1062 or 1205 fails only the `INSERT`: the transaction
//!   stays open for the claim's re-read, or is rolled back. A message claim's savepoint
//!   travels in the same message.
//! - **The completion and `COMMIT` travel in one text message**, `SET STATEMENT
//!   sql_mode = 'STRICT_ALL_TABLES' FOR UPDATE … SET status = IF(<guard>, N, NULL), …;
//!   COMMIT`. The guard holds while the server is still inside idem's transaction
//!   (`@@in_transaction`) and the row is the unfinished, unexpired placeholder; when it
//!   does not, `status` (`NOT NULL`) becomes `NULL` and the `UPDATE` fails (error 1048),
//!   so the `COMMIT` after it never runs. A message's completion releases the claim's
//!   savepoint (error 1305 when it is gone) and guards `processed_at` the same way. On
//!   that failure one more read tells the errors of the separate checks apart ("expired",
//!   "transaction lost") and idem rolls back. A lost reply of this message is an unknown
//!   outcome, like a lost `COMMIT` reply. (A first version sent a `BEGIN NOT ATOMIC`
//!   compound statement; the server compiles one per call, which cost more than the
//!   round trip it saved.)
//!
//! A text message cannot bind values, so every user value in these messages is a hex
//! literal with a charset introducer (`_utf8mb4 X'…'` for the `utf8mb4_bin` text
//! columns, `_binary X'…'` for the `VARBINARY` keys, whose primary-key index is still
//! used): only `[0-9A-F]` of user data ever reaches the SQL text, nothing is quoted or
//! escaped, and integers are formatted by idem. The hex form is twice the payload's size:
//! a request or response whose hex does not fit `max_allowed_packet` is refused before
//! any SQL.
//!
//! # Retention in the row
//!
//! Each record's `expires_at` is set at the claim (`UTC_TIMESTAMP(6)` + the operation's
//! retention, the same reading as `created_at`). Lookups and claims read it;
//! `purge_batch(table, older_than, limit)` deletes records that are expired **and**
//! claimed at least `older_than` ago, so one purge is safe for every operation. The
//! completion refuses a record that expired while its effect ran (`AND expires_at >
//! UTC_TIMESTAMP(6)`, and the same check for messages): idem rolls back and returns a
//! non-retried error saying the retention is shorter than the effect. Migration 0002
//! adds the column and backfills existing rows as `created_at + 24 hours`.
//!
//! # Fast-path reads and large payloads
//!
//! A session whose default is READ UNCOMMITTED must never see, let alone replay, an
//! uncommitted winner. On MariaDB the replay lookup is one plain autocommit read (no
//! lock, never waits: under READ COMMITTED and stricter it sees committed versions only)
//! whose last column says whether the session reads uncommitted rows
//! (`@@SESSION.tx_isolation`); a row read so is no replay, and the claim decides. On MySQL it
//! runs after `SET TRANSACTION ISOLATION LEVEL READ COMMITTED` (which applies to the
//! next transaction: the lookup's autocommit read), a round trip of its own.
//! A request or response that does not fit the server's `max_allowed_packet` (read once
//! per backend; 1 KiB is kept for the rest of the statement) is refused before any SQL
//! with a non-retried error naming the setting: the server would drop the connection,
//! which looks like a lost connection. Error 1153 and the driver's own packet-size
//! error are classified as input errors ([`ErrorKind::Other`]), never retried.
//!
//! Why not `INSERT IGNORE`: it turns *every* error it can (truncation, `NULL` into
//! `NOT NULL`, foreign keys, `CHECK`) into a warning and zero affected rows, so "0 rows"
//! would not prove "duplicate" without a strict check that no other warning occurred.
//! Error 1062 says exactly "this primary key is taken" and is the same number on both
//! servers and in every `lc_messages` language. No `RETURNING` (MariaDB only) and no
//! `ON DUPLICATE KEY UPDATE` (it would write to the winner's row) are used.
//!
//! # Deadlocks and lock waits are retried
//!
//! InnoDB's duplicate-key check takes shared locks, and so does a foreign-key check on
//! the parent row: two transactions that both hold a shared lock and then want to
//! update the row deadlock. The victim gets **1213** (`ER_LOCK_DEADLOCK`, its whole
//! transaction rolled back); a wait longer than `innodb_lock_wait_timeout` gets
//! **1205**. Both are classified by number ([`error_codes`]) as
//! [`ErrorKind::Deadlock`] / [`ErrorKind::LockTimeout`], from idem's own statements and
//! from a `mysql_async::Error` found in an effect's error chain, and idem retries the
//! whole transaction with the same key (bounded, jittered). When the winner of a key rolls
//! back, its waiting losers can deadlock among themselves in the same way (the InnoDB
//! manual's three-`INSERT` example); the retry resolves that too.
//!
//! # Columns
//!
//! Scope and key columns are `VARBINARY(255)`, compared byte for byte (`k`, `K` and `k `
//! are three keys; `utf8mb4_bin` would pad spaces, and MariaDB has no
//! `utf8mb4_0900_bin`). Requests and responses are `LONGTEXT` (`utf8mb4_bin`), stored
//! verbatim and compared as JSON values in Rust (MySQL's binary `JSON` reorders keys).
//! Times are `DATETIME(6)` in UTC; retention arithmetic is done in SQL in microseconds.
//!
//! # Connections, migrations, purge
//!
//! [`MysqlBackend::connect`] opens a `mysql_async::Pool` of up to
//! [`DEFAULT_MAX_CONNECTIONS`] connections unless the URL sets `pool_min`/`pool_max`;
//! each idem call holds one connection for its transaction. Claim transactions keep the
//! session's isolation level (InnoDB's default REPEATABLE READ); the claim is equally
//! correct under READ COMMITTED, since its re-read is a locking read. Phased-run and
//! outbox transactions run at READ COMMITTED (see below). `migrate` takes a
//! named lock per database (`GET_LOCK`), so concurrent migrators apply each version
//! once; DDL commits implicitly in MySQL, so every statement is `IF NOT EXISTS` and the
//! version is recorded after its statements. `purge_batch` is one
//! `DELETE … ORDER BY expires_at LIMIT n`.
//!
//! # Phased runs and the outbox
//!
//! [`MysqlBackend`] implements [`idem_core::RunStore`] and [`idem_core::OutboxStore`]
//! (migration 0003: `idem_run`, `idem_outbox`). Their transactions run at **READ
//! COMMITTED** (set for that transaction only): the relay's plain read of unsent ids then
//! sees the latest committed rows, and its `FOR UPDATE SKIP LOCKED` (MariaDB 10.6+,
//! MySQL 8.0+) takes no gap locks that would hold up producers' inserts; a phase's
//! effect runs under it too. `Idem::start` bounds its lock waits with
//! `innodb_lock_wait_timeout` (saved, then restored before `COMMIT`/`ROLLBACK`, like the
//! claim); 1205 is [`ErrorKind::LockTimeout`]. A run's guarded write always moves
//! `updated_at` forward, so the affected-row count (changed rows) is the matched rows.
//! Before that write and before `COMMIT`, the server's "in transaction" flag is checked,
//! so a phase whose effect swallowed a deadlock is refused rather than recorded.
//!
//! # Effects
//!
//! Effects receive a [`MysqlTx`]: a pooled [`mysql_async::Conn`] on which idem opened
//! the transaction itself (not a `mysql_async::Transaction`, which always sends its own
//! `START TRANSACTION` and `COMMIT`). It dereferences to the connection ([`MysqlTx::conn`]
//! names it); run SQL on it with
//! [`mysql_async::prelude::Queryable`]: `tx.exec_drop("UPDATE …", (amount, id)).await`.
//! A `MysqlTx` dropped with its transaction open (a cancelled call) never goes back to
//! the pool inside it: the pool resets the session (`COM_RESET_CONNECTION`, which rolls
//! back) before reusing the connection, or discards it.
//! Return driver errors (or errors whose `source()` chain holds them) instead of
//! swallowing them: after a 1213 the server has already rolled the whole transaction
//! back, record included, and what the effect runs afterwards is no longer in it
//! (MariaDB 10.11 autocommits it, as `tests/live.rs` observes; MySQL's manual describes
//! a new implicit transaction). Do not run `COMMIT`, `ROLLBACK` or DDL (an implicit
//! commit) in an effect either. Before committing, idem checks that its transaction is
//! still the open one (the request placeholder is still there and unfinished, the
//! message claim's savepoint `idem_claimed` still exists, and the server reports
//! `SERVER_STATUS_IN_TRANS`); if not, it rolls back what is left, stores nothing and
//! returns an [`ErrorKind::Other`] error instead of a success. It cannot undo statements
//! that already autocommitted.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Idem, Key, Operation, Principal, Request, Scope};
//! use idem_mysql::MysqlBackend;
//! use idem_mysql::mysql_async::prelude::Queryable;
//!
//! let idem = Idem::new(MysqlBackend::connect("mariadb://app:secret@db:3306/shop").await?);
//! idem.migrate().await?;
//! let scope = Scope::new(Principal::new("user-7")?, Operation::new("debit", 1)?);
//! let request = Request::new(serde_json::json!({"amount": 100}));
//! let outcome = idem
//!     .execute(&scope, &Key::new("checkout-42")?, &request, |tx| {
//!         Box::pin(async move {
//!             tx.exec_drop(
//!                 "UPDATE account SET balance = balance - ? WHERE id = ? AND balance >= ?",
//!                 (100, 1, 100),
//!             )
//!             .await?;
//!             Ok::<_, idem_mysql::mysql_async::Error>(serde_json::json!({"ok": true}))
//!         })
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

pub mod error_codes;
pub mod galera;
pub mod leader;
mod runs;
mod sql;

use std::error::Error as StdError;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OnceCell;

use idem_core::claim::{self, Begun, ClaimSteps, Existing};
use idem_core::{
    Backend, Claim, Claimed, DEFAULT_ACQUIRE_TIMEOUT, DbError, ErrorKind, Finish, Identity,
    Maintenance, Migration, PoolChecks, PoolOptions, Status, Stored, Table,
};
pub use mysql_async;
use mysql_async::consts::StatusFlags;
use mysql_async::prelude::{FromValue, Queryable};
use mysql_async::{DEFAULT_POOL_CONSTRAINTS, Opts, OptsBuilder, Pool, PoolConstraints, Row, Value};

pub use error_codes::db_error;
pub use leader::{MysqlHeld, MysqlLeaderLock};

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

/// The pool's size when the URL sets neither `pool_min` nor `pool_max`: room for 32
/// concurrent transactions plus replay reads, and several pools under MariaDB's default
/// `max_connections` (151).
pub const DEFAULT_MAX_CONNECTIONS: usize = 40;

/// How long `migrate` waits for another migrator of the same database, in seconds.
const MIGRATION_LOCK_TIMEOUT_SECS: u32 = 60;

/// Retention windows are capped at 500 years, so that `UTC_TIMESTAMP(6) - INTERVAL`
/// stays inside `DATETIME`'s range (a longer window would compute `NULL`).
const MAX_WINDOW: Duration = Duration::from_secs(500 * 365 * 24 * 60 * 60);

const ENGINE: &str = "mysql";

/// The open transaction handed to effects: the idem record and the effect's SQL commit
/// or roll back together.
///
/// A pooled [`mysql_async::Conn`] on which idem itself opened the transaction (it sends
/// its own `START TRANSACTION` and `COMMIT`, merged with its own statements on MariaDB;
/// see the crate documentation). It dereferences to the connection, so every
/// [`Queryable`] method works on it directly (`tx.exec_drop(…)`, `tx.exec_first(…)`).
/// Never commit or roll it back yourself, and return driver errors instead of
/// swallowing them (see the crate documentation).
///
/// Dropped while its transaction is still open (a cancelled `execute`, a panicking
/// effect, a failed `ROLLBACK`), the connection is never handed out again inside that
/// transaction: it is marked so that the pool resets its session
/// (`COM_RESET_CONNECTION`, which rolls the transaction back) before anyone reuses it,
/// and discards it when the reset fails.
#[derive(Debug)]
pub struct MysqlTx {
    conn: mysql_async::Conn,
    /// idem opened a transaction on `conn` (or sent the statement that opens it) and
    /// has not ended it.
    open: bool,
    /// `begin_runs` bounded the session's `innodb_lock_wait_timeout`: give it back
    /// before the transaction ends.
    restore_lock_wait: bool,
}

impl MysqlTx {
    /// A connection with no transaction of idem's yet.
    fn new(conn: mysql_async::Conn) -> Self {
        Self {
            conn,
            open: false,
            restore_lock_wait: false,
        }
    }

    /// The connection the transaction runs on, for code that wants it by name.
    pub fn conn(&mut self) -> &mut mysql_async::Conn {
        &mut self.conn
    }

    /// Sends `statement`, which opens idem's transaction (`START TRANSACTION`, alone or
    /// first in a message). The transaction counts as open from here, whatever the
    /// answer: a `ROLLBACK` where none is open is harmless, the reverse is not.
    async fn start(&mut self, statement: &str) -> Result<(), mysql_async::Error> {
        self.open = true;
        self.conn.query_drop(statement).await
    }

    /// Sends `statement`, which ends idem's transaction (`COMMIT`, or a merged
    /// completion ending in `COMMIT`); on success nothing is left open. On an error the
    /// transaction is rolled back here (a statement error leaves it open), and, if that
    /// fails too, the drop hands the connection to the pool for a reset.
    async fn end_with(mut self, statement: &str) -> Result<(), mysql_async::Error> {
        match self.conn.query_drop(statement).await {
            Ok(()) => {
                self.open = false;
                Ok(())
            }
            Err(e) => {
                // The first error is the one to report.
                let _ = self.rollback().await;
                Err(e)
            }
        }
    }

    /// Commits idem's transaction.
    async fn commit(self) -> Result<(), DbError> {
        self.end_with(sql::COMMIT).await.map_err(db_error)
    }

    /// Rolls idem's transaction back (nothing to do if none was opened). A failed
    /// `ROLLBACK` leaves the connection marked open: its drop sends it to be reset or
    /// discarded, never reused as it is.
    async fn rollback(mut self) -> Result<(), DbError> {
        if !self.open {
            return Ok(());
        }
        self.conn
            .query_drop(sql::ROLLBACK)
            .await
            .map_err(db_error)?;
        self.open = false;
        Ok(())
    }
}

impl Drop for MysqlTx {
    fn drop(&mut self) {
        if self.open {
            // The pool's recycler resets the session (COM_RESET_CONNECTION rolls back an
            // open transaction) before the connection is reused, and discards it if the
            // reset fails; it needs no runtime here, and nothing else is sent.
            self.conn.reset_connection(true);
        }
    }
}

impl Deref for MysqlTx {
    type Target = mysql_async::Conn;

    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl DerefMut for MysqlTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.conn
    }
}

/// An idem backend on a MySQL or MariaDB connection pool.
#[derive(Debug, Clone)]
pub struct MysqlBackend {
    pool: Pool,
    /// How long a call waits for a pooled connection.
    acquire_timeout: Duration,
    /// The server's `max_allowed_packet`, read once.
    server: Arc<OnceCell<Server>>,
}

fn config(message: impl Into<String>) -> DbError {
    DbError::new(ENGINE, ErrorKind::Configuration, message)
}

fn corrupt(message: impl Into<String>) -> DbError {
    DbError::new(ENGINE, ErrorKind::CorruptRecord, message)
}

fn has_query_param(rest: &str, name: &str) -> bool {
    rest.split_once('?').is_some_and(|(_, query)| {
        query
            .split('&')
            .any(|pair| pair.split('=').next() == Some(name))
    })
}

/// Parses a `mysql://` or `mariadb://` URL (`mariadb://` is rewritten to `mysql://` for
/// the driver; schemes are case-insensitive). Without `pool_min`/`pool_max` in the URL,
/// the pool holds up to [`DEFAULT_MAX_CONNECTIONS`] connections. Other query parameters
/// are the driver's (`?reset_connection=true`, `?stmt_cache_size=64`, …).
///
/// Unless the URL sets `reset_connection`, connections are not reset
/// (`COM_RESET_CONNECTION`, one round trip) each time they return to the pool:
/// mysql_async still drops any unread result and rolls back an open transaction before
/// a returned connection is reused, and discards it if that fails. Session state an
/// effect changes on purpose (`SET SESSION …`, user variables, temporary tables, named
/// locks) does carry over to the next checkout then; add `?reset_connection=true` if
/// your effects do that.
pub fn parse_url(url: &str) -> Result<Opts, DbError> {
    let url = url.trim();
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(config(
            "a MySQL URL looks like mysql://user:password@host:3306/database (or mariadb://…)",
        ));
    };
    if !scheme.eq_ignore_ascii_case("mysql") && !scheme.eq_ignore_ascii_case("mariadb") {
        return Err(config(format!(
            "unsupported scheme {scheme:?}: expected mysql:// or mariadb://"
        )));
    }
    let opts = Opts::from_url(&format!("mysql://{rest}"))
        .map_err(|e| config(format!("invalid MySQL URL: {e}")).with_source(e))?;
    let mut pool_opts = opts.pool_opts().clone();
    if !has_query_param(rest, "reset_connection") {
        pool_opts = pool_opts.with_reset_connection(false);
    }
    if !has_query_param(rest, "pool_min") && !has_query_param(rest, "pool_max") {
        let min = DEFAULT_POOL_CONSTRAINTS.min().min(DEFAULT_MAX_CONNECTIONS);
        if let Some(constraints) = PoolConstraints::new(min, DEFAULT_MAX_CONNECTIONS) {
            pool_opts = pool_opts.with_constraints(constraints);
        }
    }
    Ok(OptsBuilder::from_opts(opts).pool_opts(pool_opts).into())
}

impl MysqlBackend {
    /// Connects by URL (`mysql://user:password@host:3306/database`, or `mariadb://…`)
    /// and checks that the server answers.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        Self::connect_with(parse_url(url)?).await
    }

    /// Connects with explicit options (for example another database or pool size) and
    /// checks that the server answers.
    pub async fn connect_with(opts: impl Into<Opts>) -> Result<Self, DbError> {
        let pool = Pool::new(opts.into());
        match pool.get_conn().await {
            Ok(conn) => drop(conn),
            Err(e) => {
                // The pool never connected; its disconnect cannot fail in a way that matters.
                let _ = pool.disconnect().await;
                return Err(db_error(e));
            }
        }
        Ok(Self::from_pool(pool))
    }

    /// Uses an existing pool. It needs room for as many connections as concurrent
    /// idem calls (each holds one for its transaction).
    pub fn from_pool(pool: Pool) -> Self {
        Self {
            pool,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            server: Arc::default(),
        }
    }

    /// Connects with explicit options and the pool settings every idem engine takes
    /// under the same names: `max_connections` (the pool's maximum; its minimum is
    /// lowered to fit), `acquire_timeout` (how long a call waits for a free
    /// connection before it fails with a connection error; 30 s otherwise) and
    /// `checks`: [`PoolChecks::On`] resets the session of every returned connection
    /// (`COM_RESET_CONNECTION`, mysql_async's own default: one round trip per call, and
    /// every statement prepared again after it), [`PoolChecks::Off`] does not, and the
    /// default keeps what the options say ([`parse_url`]: off unless the URL sets
    /// `reset_connection`).
    pub async fn connect_pooled(opts: impl Into<Opts>, pool: PoolOptions) -> Result<Self, DbError> {
        let opts: Opts = opts.into();
        let max = pool.max_connections.max(1);
        let min = opts.pool_opts().constraints().min().min(max);
        let constraints = PoolConstraints::new(min, max)
            .ok_or_else(|| config(format!("invalid pool size {min}..={max}")))?;
        let mut pool_opts = opts.pool_opts().clone().with_constraints(constraints);
        match pool.checks {
            PoolChecks::On => pool_opts = pool_opts.with_reset_connection(true),
            PoolChecks::Off => pool_opts = pool_opts.with_reset_connection(false),
            // `parse_url`'s choice (off unless the URL says `reset_connection`).
            _ => {}
        }
        let opts: Opts = OptsBuilder::from_opts(opts).pool_opts(pool_opts).into();
        let mut backend = Self::connect_with(opts).await?;
        backend.acquire_timeout = pool.acquire_timeout;
        Ok(backend)
    }

    /// A pooled connection, waited for at most the acquire timeout.
    async fn conn(&self) -> Result<mysql_async::Conn, DbError> {
        match tokio::time::timeout(self.acquire_timeout, self.pool.get_conn()).await {
            Ok(conn) => conn.map_err(db_error),
            Err(_) => Err(self.acquire_timed_out()),
        }
    }

    fn acquire_timed_out(&self) -> DbError {
        DbError::new(
            ENGINE,
            ErrorKind::Connection,
            format!(
                "no pooled connection became free within {:?} (the acquire timeout); raise \
                 max_connections or acquire_timeout",
                self.acquire_timeout
            ),
        )
    }

    /// The pool, for your own queries.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Closes the pool once every connection taken from it (by any clone) is back.
    pub async fn disconnect(self) -> Result<(), DbError> {
        self.pool.disconnect().await.map_err(db_error)
    }
}

/// A retention window in microseconds, for `INTERVAL ? MICROSECOND`.
fn window_micros(d: Duration) -> i64 {
    i64::try_from(d.min(MAX_WINDOW).as_micros()).unwrap_or(i64::MAX)
}

/// The statements and key values of one identity.
struct Target<'a> {
    insert: &'static str,
    select: &'static str,
    replace: &'static str,
    lookup: &'static str,
    lookup_committed: &'static str,
    expired: &'static str,
    /// The key columns' bytes: the first `key_len` (three for a request, two for a
    /// message).
    key_bytes: [&'a [u8]; 3],
    key_len: usize,
    request: Option<&'a str>,
    is_request: bool,
}

impl<'a> Target<'a> {
    fn of(claim: &Claim<'a>) -> Self {
        match claim.id {
            Identity::Request { scope, key } => Self {
                insert: sql::INSERT_REQUEST,
                select: sql::SELECT_REQUEST,
                replace: sql::REPLACE_EXPIRED_REQUEST,
                lookup: sql::LOOKUP_REQUEST,
                lookup_committed: sql::LOOKUP_REQUEST_COMMITTED,
                expired: sql::EXPIRED_REQUEST,
                key_bytes: [
                    scope.principal.as_str().as_bytes(),
                    scope.operation.as_str().as_bytes(),
                    key.as_str().as_bytes(),
                ],
                key_len: 3,
                request: claim.request,
                is_request: true,
            },
            Identity::Message {
                subscriber,
                message_id,
            } => Self {
                insert: sql::INSERT_MESSAGE,
                select: sql::SELECT_MESSAGE,
                replace: sql::REPLACE_EXPIRED_MESSAGE,
                lookup: sql::LOOKUP_MESSAGE,
                lookup_committed: sql::LOOKUP_MESSAGE_COMMITTED,
                expired: sql::EXPIRED_MESSAGE,
                key_bytes: [
                    subscriber.as_str().as_bytes(),
                    message_id.as_str().as_bytes(),
                    &[],
                ],
                key_len: 2,
                request: claim.request,
                is_request: false,
            },
        }
    }

    /// The key columns' bytes.
    fn key(&self) -> &[&'a [u8]] {
        &self.key_bytes[..self.key_len]
    }

    /// `first`, then the key, then `last`.
    fn params(&self, first: Vec<Value>, last: Vec<Value>) -> Vec<Value> {
        let mut params = Vec::with_capacity(first.len() + self.key_len + last.len());
        params.extend(first);
        params.extend(self.key().iter().map(|b| Value::Bytes(b.to_vec())));
        params.extend(last);
        params
    }

    fn request_value(&self) -> Value {
        self.request.into()
    }

    /// The key columns as `_binary` hex literals, for statements sent as text.
    fn key_literals(&self) -> Vec<sql::Lit<'_>> {
        self.key().iter().map(|b| sql::Lit::Bytes(b)).collect()
    }

    /// Reads `(request, response, status)` or `(fingerprint)`, then `expired` when
    /// `with_expired`.
    fn read(&self, mut row: Row, with_expired: bool) -> Result<(Stored, bool), DbError> {
        let (stored, expired_at) = if self.is_request {
            let request: Option<String> = take(&mut row, 0, "request")?;
            let response: Option<String> = take(&mut row, 1, "response")?;
            let status: i64 = take(&mut row, 2, "status")?;
            let stored = Stored {
                request,
                response,
                status: Status::from_code(status)?,
            };
            (stored, 3)
        } else {
            let fingerprint: Option<String> = take(&mut row, 0, "fingerprint")?;
            let stored = Stored {
                request: fingerprint,
                response: None,
                status: Status::Succeeded,
            };
            (stored, 1)
        };
        let expired = if with_expired {
            let e: Option<i64> = take(&mut row, expired_at, "expired")?;
            e.unwrap_or(0) != 0
        } else {
            false
        };
        Ok((stored, expired))
    }
}

fn take<T: FromValue>(row: &mut Row, index: usize, what: &str) -> Result<T, DbError> {
    match row.take_opt::<T, usize>(index) {
        Some(Ok(v)) => Ok(v),
        Some(Err(e)) => Err(corrupt(format!("column {what} cannot be read: {e}"))),
        None => Err(corrupt(format!("column {what} is missing from the row"))),
    }
}

fn is_duplicate(e: &mysql_async::Error) -> bool {
    error_codes::server_code(e).map(error_codes::kind_of) == Some(ErrorKind::UniqueViolation)
}

/// Whether the server still reports an open transaction on this session (from the last
/// OK packet's status flags).
fn in_transaction(conn: &mysql_async::Conn) -> bool {
    conn.last_ok_packet().is_some_and(|ok| {
        ok.status_flags()
            .contains(StatusFlags::SERVER_STATUS_IN_TRANS)
    })
}

/// The error when the claiming transaction ended inside the effect.
fn lost_transaction() -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        "the idem transaction ended inside the effect (a deadlock 1213 the effect swallowed, \
         or COMMIT, ROLLBACK or DDL run by the effect); idem rolled back what was left and \
         stored no record",
    )
}

/// [`lost_transaction`] on a Galera node, where a replicated write set can also abort
/// the transaction between two statements without the server reporting it.
fn lost_transaction_on_galera() -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        "the idem transaction ended inside the effect (on Galera, a replicated write set \
         that aborted it between two statements, a brute-force abort; or a deadlock 1213 \
         the effect swallowed, or COMMIT, ROLLBACK or DDL run by the effect); idem rolled \
         back what was left and stored no record; after a brute-force abort nothing of the \
         call committed: retry with the same key",
    )
}

/// Rolls back after a failure and returns the failure.
async fn abort(tx: MysqlTx, e: DbError) -> DbError {
    // The first error is the one that matters; a connection whose ROLLBACK failed is
    // reset or discarded by the pool, never reused inside the transaction.
    let _ = tx.rollback().await;
    e
}

/// A statement the backend failed to build (a placeholder count that does not match its
/// values): a bug, reported instead of sent.
fn unbuildable(what: &str) -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        format!(
            "idem could not build the {what} statement (a bug in idem-mysql; nothing was sent)"
        ),
    )
}

/// What the backend reads from the server once.
#[derive(Debug, Clone, Copy)]
struct Server {
    /// `max_allowed_packet`.
    max_packet: u64,
    /// MariaDB (`@@version` says so): claims bound each statement with `SET STATEMENT`.
    mariadb: bool,
    /// A MariaDB Galera node (`@@global.wsrep_on`): `START TRANSACTION` and `COMMIT`
    /// travel alone, not in the merged messages. On Galera a replicated write set can
    /// abort a local transaction between two statements of one text message (a
    /// "brute-force abort"), and the cluster test then saw a merged completion answer
    /// `Executed` for a transaction the cluster had rolled back; with `COMMIT` alone the
    /// abort is that statement's error 1213, which idem retries.
    galera: bool,
}

impl Server {
    /// Whether the claim and the completion travel with `START TRANSACTION` and
    /// `COMMIT` (MariaDB, not Galera).
    fn merged(self) -> bool {
        self.mariadb && !self.galera
    }
}

/// The claim's `innodb_lock_wait_timeout`: whole seconds, rounded up, at least 1 (the
/// server's minimum), at most its maximum (1073741824).
fn lock_wait_secs(wait: Duration) -> u64 {
    wait.as_nanos()
        .div_ceil(1_000_000_000)
        .clamp(1, 1_073_741_824)
        .try_into()
        .unwrap_or(1_073_741_824)
}

/// A claim's open transaction (its `innodb_lock_wait_timeout` bounded by the wait).
#[derive(Debug)]
pub struct MysqlOpen {
    tx: MysqlTx,
    /// MariaDB: `SET STATEMENT innodb_lock_wait_timeout = N FOR ` before each claim
    /// statement (the session is never changed). MySQL: empty, the session's value was
    /// saved and bounded at `begin` and is restored by `ready`/`rollback`.
    bound: String,
    /// MariaDB: `START TRANSACTION` has not been sent yet; it travels with the first
    /// `INSERT`, in the same message.
    start_pending: bool,
    /// MariaDB, messages: the claim's savepoint travelled with the winning `INSERT`.
    savepoint_set: bool,
}

impl MysqlOpen {
    /// `statement`, bounded on MariaDB.
    fn bounded(&self, statement: &str) -> String {
        format!("{}{statement}", self.bound)
    }

    /// MariaDB (the claim's statements are text with their values inlined).
    fn mariadb(&self) -> bool {
        !self.bound.is_empty()
    }
}

/// The claim's steps; the decision tree is [`idem_core::claim::run`]'s. A conflict is
/// error 1062 on a plain `INSERT`, and the re-read is a locking read.
impl ClaimSteps for MysqlBackend {
    type Open = MysqlOpen;
    type Won = MysqlTx;

    async fn begin(&self, claim: &Claim<'_>) -> Result<Begun<MysqlOpen>, DbError> {
        let server = self.server().await?;
        let mariadb = server.mariadb;
        self.check_packet("request", claim.request, mariadb).await?;
        let mut tx = MysqlTx::new(self.conn().await?);
        let secs = lock_wait_secs(claim.wait);
        if mariadb && server.galera {
            // Galera: START TRANSACTION alone; the claim's statements still carry their
            // bound.
            if let Err(e) = tx.start(sql::START_TRANSACTION).await {
                return Err(abort(tx, db_error(e)).await);
            }
            return Ok(Begun::Open(MysqlOpen {
                tx,
                bound: format!("{}{secs} FOR ", sql::SET_STATEMENT_LOCK_WAIT),
                start_pending: false,
                savepoint_set: false,
            }));
        }
        if mariadb {
            // Nothing sent yet: START TRANSACTION goes with the INSERT.
            return Ok(Begun::Open(MysqlOpen {
                tx,
                bound: format!("{}{secs} FOR ", sql::SET_STATEMENT_LOCK_WAIT),
                start_pending: true,
                savepoint_set: false,
            }));
        }
        if let Err(e) = tx.start(sql::START_TRANSACTION).await {
            return Err(abort(tx, db_error(e)).await);
        }
        let mut open = MysqlOpen {
            tx,
            bound: String::new(),
            start_pending: false,
            savepoint_set: false,
        };
        let bound = format!("{}{secs}", sql::SET_LOCK_WAIT);
        match open.tx.query_drop(bound).await {
            Ok(()) => Ok(Begun::Open(open)),
            Err(e) => {
                let _ = self.rollback(open).await;
                Err(db_error(e))
            }
        }
    }

    async fn insert(&self, open: &mut MysqlOpen, claim: &Claim<'_>) -> Result<bool, DbError> {
        let target = Target::of(claim);
        let micros = window_micros(claim.retention);
        let sent = if open.mariadb() {
            // One text message: START TRANSACTION (the first time), the bounded INSERT
            // with its values inlined as hex literals, and for a message the savepoint
            // the completion checks (it runs only if the INSERT succeeded).
            let mut values = target.key_literals();
            values.push(target.request.map_or(sql::Lit::Null, sql::Lit::Text));
            values.push(sql::Lit::Int(micros));
            let insert = sql::inline(target.insert, &values).ok_or_else(|| unbuildable("claim"))?;
            let mut message = open.bounded(&insert);
            if !target.is_request {
                message = format!("{message}; {}", sql::SAVEPOINT_CLAIMED);
            }
            if open.start_pending {
                open.start_pending = false;
                open.tx
                    .start(&format!("{}{message}", sql::START_TRANSACTION_THEN))
                    .await
            } else {
                open.tx.query_drop(message).await
            }
        } else {
            let params = target.params(vec![], vec![target.request_value(), micros.into()]);
            open.tx.exec_drop(target.insert, params).await
        };
        match sent {
            Ok(()) => {
                open.savepoint_set = open.mariadb() && !target.is_request;
                Ok(true)
            }
            Err(e) if is_duplicate(&e) => Ok(false),
            Err(e) => Err(db_error(e)),
        }
    }

    async fn reread(&self, open: &mut MysqlOpen, claim: &Claim<'_>) -> Result<Existing, DbError> {
        let target = Target::of(claim);
        let statement = open.bounded(target.select);
        let row: Option<Row> = open
            .tx
            .exec_first(statement, target.params(vec![], vec![]))
            .await
            .map_err(db_error)?;
        let Some(row) = row else {
            return Ok(Existing::Vanished);
        };
        Ok(match target.read(row, true)? {
            (_, true) => Existing::Expired,
            (stored, false) => Existing::Live(stored),
        })
    }

    async fn replace_expired(
        &self,
        open: &mut MysqlOpen,
        claim: &Claim<'_>,
    ) -> Result<bool, DbError> {
        let target = Target::of(claim);
        let micros = window_micros(claim.retention);
        let params = target.params(vec![target.request_value(), micros.into()], vec![]);
        let statement = open.bounded(target.replace);
        open.tx
            .exec_drop(statement, params)
            .await
            .map_err(db_error)?;
        Ok(open.tx.affected_rows() == 1)
    }

    async fn ready(&self, open: &mut MysqlOpen, claim: &Claim<'_>) -> Result<(), DbError> {
        // The effect (and the pooled session) keep their own lock-wait timeout (on
        // MariaDB it was never changed).
        if !open.mariadb() {
            open.tx
                .query_drop(sql::RESTORE_LOCK_WAIT)
                .await
                .map_err(db_error)?;
        }
        if Target::of(claim).is_request || open.savepoint_set {
            return Ok(());
        }
        // The savepoint the completion checks: the message claim is still in this
        // transaction.
        open.tx
            .query_drop(sql::SAVEPOINT_CLAIMED)
            .await
            .map_err(db_error)
    }

    fn won(&self, open: MysqlOpen, _claim: &Claim<'_>) -> MysqlTx {
        open.tx
    }

    async fn rollback(&self, open: MysqlOpen) -> Result<(), DbError> {
        let mut tx = open.tx;
        let restored = if tx.open && open.bound.is_empty() {
            tx.query_drop(sql::RESTORE_LOCK_WAIT)
                .await
                .map_err(db_error)
        } else {
            Ok(())
        };
        // A connection whose ROLLBACK failed is reset or discarded by the pool.
        let ended = tx.rollback().await;
        restored.and(ended)
    }

    fn waited_too_long(&self, error: &DbError) -> bool {
        // A concurrent holder kept the identity past the wait bound.
        error.code() == Some("1205")
    }
}

/// The error of a completion whose record expired while the effect ran.
fn expired_during_effect() -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        "the record expired before the effect finished; the retention is shorter than the \
         effect (idem rolled back and stored nothing)",
    )
}

/// MariaDB: the completion (guarded) and `COMMIT` in one message
/// ([`sql::complete_and_commit_request`], [`sql::complete_and_commit_message`]). A guard
/// that fails (error 1048) stops the message before its `COMMIT`: one more read on that
/// path tells the same errors apart as the separate statements did ("expired",
/// "transaction lost"), then idem rolls back. A request whose placeholder was gone
/// (its transaction ended and took it) changed no row: the `COMMIT` had nothing of the
/// claim's to commit, and that is reported from the `UPDATE`'s count.
async fn complete_and_commit(
    mut tx: MysqlTx,
    target: &Target<'_>,
    response: Option<&str>,
    status: Status,
) -> Result<(), DbError> {
    let key = target.key_literals();
    let message = if target.is_request {
        let mut values = vec![
            sql::Lit::Int(i64::from(status.code())),
            response.map_or(sql::Lit::Null, sql::Lit::Text),
        ];
        values.extend(key.iter().copied());
        sql::inline(sql::COMPLETE_REQUEST_GUARDED, &values)
            .map(|c| sql::complete_and_commit_request(&c))
    } else {
        sql::inline(sql::CHECK_MESSAGE_GUARDED, &key).map(|c| sql::complete_and_commit_message(&c))
    };
    let Some(message) = message else {
        return Err(abort(tx, unbuildable("completion")).await);
    };
    let sent = async {
        let result = tx.conn.query_iter(message.as_str()).await?;
        // The first result is the completing `UPDATE`'s (or the message's `RELEASE`).
        let changed = result.affected_rows();
        result.drop_result().await?;
        Ok::<_, mysql_async::Error>(changed)
    }
    .await;
    match sent {
        Ok(changed) => {
            tx.open = false;
            if target.is_request && changed != 1 {
                return Err(lost_transaction());
            }
            Ok(())
        }
        Err(e) if error_codes::server_code(&e) == Some(error_codes::ER_BAD_NULL_ERROR) => {
            // Built only on this path: the read that tells why the guard failed.
            let Some(expired) = sql::inline(target.expired, &key) else {
                return Err(abort(tx, unbuildable("completion")).await);
            };
            let why: Result<Option<(i64, Option<i64>)>, _> =
                tx.conn.query_first(sql::why_not_completed(&expired)).await;
            let error = match why {
                Ok(Some((1, Some(1)))) => expired_during_effect(),
                Ok(_) => lost_transaction(),
                Err(e) => db_error(e),
            };
            Err(abort(tx, error).await)
        }
        // The claim's savepoint is gone: so is the claiming transaction.
        Err(e) if error_codes::server_code(&e) == Some(error_codes::ER_SP_DOES_NOT_EXIST) => {
            Err(abort(tx, lost_transaction()).await)
        }
        Err(e) => Err(abort(tx, db_error(e)).await),
    }
}

/// Room kept in a packet for everything but the payload (command, keys, lengths).
const PACKET_OVERHEAD: u64 = 1024;
/// Room kept in a merged MariaDB message for everything but the payload's hex: the
/// statements (a completion's compound statement is under 1 KiB) and the key columns'
/// hex literals (3 × 255 bytes, two characters each).
const HEX_PACKET_OVERHEAD: u64 = 4096;

impl MysqlBackend {
    /// The server's `max_allowed_packet` and whether it is MariaDB (read on first use,
    /// then kept).
    async fn server(&self) -> Result<Server, DbError> {
        self.server
            .get_or_try_init(|| async {
                let mut conn = self.conn().await?;
                let row: Option<(Option<u64>, String)> = conn
                    .query_first(sql::MAX_ALLOWED_PACKET)
                    .await
                    .map_err(db_error)?;
                let (max, version) = row.unwrap_or((None, String::new()));
                let mariadb = version.contains("MariaDB");
                // A server built without Galera support has no such variable: not Galera.
                let galera = mariadb
                    && matches!(conn.query_first::<i64, _>(sql::WSREP_ON).await, Ok(Some(1)));
                Ok(Server {
                    max_packet: max.unwrap_or(u64::MAX),
                    mariadb,
                    galera,
                })
            })
            .await
            .copied()
    }

    async fn max_packet(&self) -> Result<u64, DbError> {
        Ok(self.server().await?.max_packet)
    }

    /// Refuses, before any SQL, a payload the server would refuse: above
    /// `max_allowed_packet` the server drops the connection (the client then sees a
    /// broken or out-of-sync stream, which would look like a lost connection and be
    /// retried). Not retried; the error names the setting. `hex`: the payload travels
    /// as a hex literal in the statement's text (MariaDB's merged messages), two bytes
    /// per byte.
    async fn check_packet(
        &self,
        what: &str,
        payload: Option<&str>,
        hex: bool,
    ) -> Result<(), DbError> {
        let Some(payload) = payload else {
            return Ok(());
        };
        let len = u64::try_from(payload.len()).unwrap_or(u64::MAX);
        let (size, overhead, form) = if hex {
            (
                len.saturating_mul(2),
                HEX_PACKET_OVERHEAD,
                " (sent as hex: twice that)",
            )
        } else {
            (len, PACKET_OVERHEAD, "")
        };
        let max = self.max_packet().await?;
        if size.saturating_add(overhead) <= max {
            return Ok(());
        }
        Err(DbError::new(
            ENGINE,
            ErrorKind::Other,
            format!(
                "the {what} ({len} bytes of JSON{form}) does not fit the server's \
                 max_allowed_packet ({max} bytes, less {overhead} bytes for the statement); \
                 raise max_allowed_packet or send a smaller payload (not retried)"
            ),
        )
        .with_code(error_codes::ER_NET_PACKET_TOO_LARGE.to_string()))
    }
}

impl Backend for MysqlBackend {
    type Tx = MysqlTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let target = Target::of(claim);
        let mariadb = self.server().await?.mariadb;
        let mut conn = self.conn().await?;
        let lookup = if mariadb {
            // A plain read that says whether the session reads uncommitted rows.
            target.lookup_committed
        } else {
            // Pinned: a session at READ UNCOMMITTED would otherwise see (and replay) an
            // uncommitted winner's placeholder.
            conn.query_drop(sql::READ_COMMITTED)
                .await
                .map_err(db_error)?;
            target.lookup
        };
        let mut row: Option<Row> = conn
            .exec_first(lookup, target.params(vec![], vec![]))
            .await
            .map_err(db_error)?;
        if mariadb {
            // Read at READ UNCOMMITTED, the row may be a winner's unfinished one: no replay
            // from the fast path, the claim decides.
            let flag = if target.is_request { 3 } else { 1 };
            if let Some(r) = row.as_mut() {
                let dirty: Option<i64> = take(r, flag, "dirty")?;
                if dirty.unwrap_or(0) != 0 {
                    row = None;
                }
            }
        }
        drop(conn);
        row.map(|row| target.read(row, false).map(|(stored, _)| stored))
            .transpose()
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<MysqlTx>, DbError> {
        claim::run(self, claim).await
    }

    async fn finish(&self, tx: MysqlTx, claim: &Claim<'_>, end: Finish<'_>) -> Result<(), DbError> {
        let (response, status) = match end {
            Finish::Rollback => return tx.rollback().await,
            Finish::Commit { response, status } => (response, status),
        };
        let server = match self.server().await {
            Ok(server) => server,
            Err(e) => return Err(abort(tx, e).await),
        };
        if let Err(e) = self
            .check_packet("response", response, server.merged())
            .await
        {
            return Err(abort(tx, e).await);
        }
        let target = Target::of(claim);
        if server.merged() {
            return complete_and_commit(tx, &target, response, status).await;
        }
        let mut tx = tx;
        let intact = if target.is_request {
            // The placeholder must still be there, unfinished and unexpired, in this open
            // transaction.
            let params = target.params(vec![response.into(), status.code().into()], vec![]);
            match tx.exec_drop(sql::COMPLETE_REQUEST, params).await {
                Ok(()) => tx.affected_rows() == 1,
                Err(e) => return Err(abort(tx, db_error(e)).await),
            }
        } else {
            // The savepoint set by the claim must still exist.
            match tx.query_drop(sql::RELEASE_CLAIMED).await {
                Ok(()) => true,
                Err(e)
                    if error_codes::server_code(&e) == Some(error_codes::ER_SP_DOES_NOT_EXIST) =>
                {
                    false
                }
                Err(e) => return Err(abort(tx, db_error(e)).await),
            }
        };
        let lost = if server.galera {
            lost_transaction_on_galera
        } else {
            lost_transaction
        };
        if !in_transaction(&tx) {
            return Err(abort(tx, lost()).await);
        }
        // Whether the record expired while the effect ran (then nothing may commit: a
        // waiting loser would take the committed record over and run the effect again).
        let expired: Option<i64> = if target.is_request && intact {
            // The completion's `expires_at > UTC_TIMESTAMP(6)` already proved it live.
            Some(0)
        } else {
            match tx
                .exec_first(target.expired, target.params(vec![], vec![]))
                .await
            {
                Ok(v) => v,
                Err(e) => return Err(abort(tx, db_error(e)).await),
            }
        };
        if expired == Some(1) {
            return Err(abort(tx, expired_during_effect()).await);
        }
        if !intact || expired.is_none() {
            return Err(abort(tx, lost()).await);
        }
        tx.commit().await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        if let Some(e) = error.downcast_ref::<mysql_async::Error>() {
            return Some(error_codes::classify(e));
        }
        error
            .downcast_ref::<mysql_async::ServerError>()
            .map(|e| error_codes::kind_of(e.code))
    }
}

impl Maintenance for MysqlBackend {
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        let mut conn = self.conn().await?;
        let locked: Option<Row> = conn
            .exec_first(sql::MIGRATION_LOCK, (MIGRATION_LOCK_TIMEOUT_SECS,))
            .await
            .map_err(db_error)?;
        let locked: Option<i64> = match locked {
            Some(mut row) => take(&mut row, 0, "GET_LOCK")?,
            None => None,
        };
        if locked != Some(1) {
            return Err(DbError::new(
                ENGINE,
                ErrorKind::LockTimeout,
                format!(
                    "another migrator held the migration lock for {MIGRATION_LOCK_TIMEOUT_SECS} s \
                     (or no database is selected)"
                ),
            ));
        }
        let applied = apply_migrations(&mut conn).await;
        let released = conn.query_drop(sql::MIGRATION_UNLOCK).await;
        let applied = applied?;
        released.map_err(db_error)?;
        Ok(applied)
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
        let mut conn = self.conn().await?;
        conn.exec_drop(statement, (window_micros(older_than), limit))
            .await
            .map_err(db_error)?;
        Ok(conn.affected_rows())
    }
}

/// Applies the missing migrations while holding the migration lock. DDL commits
/// implicitly in MySQL, so every statement is written to be re-runnable
/// (`IF NOT EXISTS`); the version is recorded after its statements.
async fn apply_migrations(conn: &mut mysql_async::Conn) -> Result<Vec<u32>, DbError> {
    conn.query_drop(sql::CREATE_MIGRATIONS)
        .await
        .map_err(db_error)?;
    let rows: Vec<Row> = conn
        .exec(sql::SELECT_MIGRATIONS, ())
        .await
        .map_err(db_error)?;
    let mut done = Vec::with_capacity(rows.len());
    for mut row in rows {
        done.push(take::<u32>(&mut row, 0, "version")?);
    }
    let mut applied = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        for statement in m.statements() {
            match conn.query_drop(statement.as_str()).await {
                Ok(()) => {}
                // The index is already gone: an interrupted earlier run dropped it
                // (every DDL statement commits on its own).
                Err(e)
                    if statement.trim_start().starts_with("DROP INDEX")
                        && error_codes::server_code(&e)
                            == Some(error_codes::ER_CANT_DROP_FIELD_OR_KEY) => {}
                Err(e) => return Err(db_error(e)),
            }
        }
        conn.exec_drop(sql::INSERT_MIGRATION, (m.version, m.name))
            .await
            .map_err(db_error)?;
        applied.push(m.version);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        let opts = parse_url("mysql://root@127.0.0.1:3306/test").expect("mysql://");
        assert_eq!(opts.user(), Some("root"));
        assert_eq!(opts.db_name(), Some("test"));
        assert_eq!(opts.tcp_port(), 3306);
        assert_eq!(
            opts.pool_opts().constraints().max(),
            DEFAULT_MAX_CONNECTIONS
        );

        let opts = parse_url("mariadb://app:s3cret@db.example:3307/shop").expect("mariadb://");
        assert_eq!(opts.user(), Some("app"));
        assert_eq!(opts.pass(), Some("s3cret"));
        assert_eq!(opts.ip_or_hostname(), "db.example");
        assert_eq!(opts.tcp_port(), 3307);
        assert_eq!(opts.db_name(), Some("shop"));

        let opts = parse_url(" MariaDB://root@h/test ").expect("case-insensitive scheme");
        assert_eq!(opts.tcp_port(), 3306, "the default port");

        let opts = parse_url("mysql://root@h/test?pool_min=0&pool_max=7").expect("pool_max");
        assert_eq!(opts.pool_opts().constraints().max(), 7);
        let opts = parse_url("mysql://root@h/test?pool_min=1&pool_max=100").expect("pool");
        assert_eq!(opts.pool_opts().constraints().max(), 100);
    }

    #[test]
    fn bad_urls_are_configuration_errors_without_secrets() {
        for bad in [
            "",
            "mysql",
            "postgres://u:pw@h/db",
            "sqlite::memory:",
            "mysql://",
            "mysql://root@h/test?pool_max=lots",
            "mysql://root@h/test?pool_min=9&pool_max=1",
            "mysql://root:hunter2@h/test?no_such_option=1",
        ] {
            match parse_url(bad) {
                Ok(_) => panic!("{bad:?} was accepted"),
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::Configuration, "{bad:?}: {e}");
                    assert!(!e.to_string().contains("hunter2"), "{e}");
                }
            }
        }
    }

    #[test]
    fn pools_skip_the_reset_per_return_unless_the_url_asks_for_it() {
        let reset = |url: &str| parse_url(url).expect("url").pool_opts().reset_connection();
        assert!(!reset("mysql://u@h/db"));
        assert!(!reset("mariadb://u@h/db?pool_min=1&pool_max=4"));
        assert!(reset("mysql://u@h/db?reset_connection=true"));
        assert!(!reset("mysql://u@h/db?reset_connection=false"));
        let opts = parse_url("mysql://u@h/db?pool_min=1&pool_max=4").expect("url");
        assert_eq!(opts.pool_opts().constraints().max(), 4);
        let opts = parse_url("mysql://u@h/db").expect("url");
        assert_eq!(
            opts.pool_opts().constraints().max(),
            DEFAULT_MAX_CONNECTIONS
        );
    }

    #[test]
    fn windows_stay_in_datetime_range() {
        assert_eq!(window_micros(Duration::from_millis(400)), 400_000);
        assert_eq!(window_micros(Duration::ZERO), 0);
        assert_eq!(
            window_micros(Duration::from_secs(24 * 60 * 60)),
            86_400_000_000
        );
        assert_eq!(window_micros(Duration::MAX), window_micros(MAX_WINDOW));
    }

    #[test]
    fn backend_classifies_driver_errors_in_chains() {
        // `classify` needs no connection: build a backend around a pool that never connects.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let backend = MysqlBackend::from_pool(Pool::new(
                parse_url("mysql://u@127.0.0.1:1/x").expect("url"),
            ));
            let deadlock = mysql_async::Error::Server(mysql_async::ServerError {
                code: 1213,
                message: String::new(),
                state: "40001".into(),
            });
            assert_eq!(backend.classify(&deadlock), Some(ErrorKind::Deadlock));
            let timeout = mysql_async::ServerError {
                code: 1205,
                message: String::new(),
                state: "HY000".into(),
            };
            assert_eq!(backend.classify(&timeout), Some(ErrorKind::LockTimeout));
            let unrelated = std::io::Error::other("not a driver error");
            assert_eq!(backend.classify(&unrelated), None);
            let _ = backend.disconnect().await;
        });
    }

    /// MySQL 8's and TiDB's path (separate statements, bound values, the session's lock
    /// wait saved and restored) on the new transaction type, run live on the MariaDB at
    /// `IDEM_MYSQL_URL` (default the local server) with the backend told it is not
    /// MariaDB: every statement of that path is valid there too.
    #[tokio::test]
    async fn the_separate_statements_path_runs_on_the_new_transaction_type() {
        use idem_core::{
            Consumed, Error, Idem, Key, MessageId, Operation, Outcome, Principal, Request, Scope,
            Subscriber,
        };
        let url = std::env::var("IDEM_MYSQL_URL")
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned());
        let base = parse_url(&url).expect("IDEM_MYSQL_URL");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!("idem_separate_{}_{nanos}", std::process::id());
        let admin = Pool::new(base.clone());
        let mut conn = admin
            .get_conn()
            .await
            .expect("the server at IDEM_MYSQL_URL");
        conn.query_drop(format!("CREATE DATABASE {name}"))
            .await
            .expect("create");
        let opts = OptsBuilder::from_opts(base).db_name(Some(&name));
        let backend = MysqlBackend::connect_with(opts).await.expect("connect");
        let real = backend.server().await.expect("server");
        // The same pool, with what the server said, but told it is not MariaDB.
        let backend = MysqlBackend {
            server: Arc::new(OnceCell::new_with(Some(Server {
                mariadb: false,
                galera: false,
                ..real
            }))),
            ..backend
        };
        backend.migrate().await.expect("migrate");
        let idem = Idem::new(backend.clone());
        let scope = Scope::new(
            Principal::new("p").expect("principal"),
            Operation::new("op", 1).expect("operation"),
        );
        let request = Request::new(serde_json::json!({"it's": "a \\ test"}));
        for (i, expected) in [(1, Outcome::Executed(1)), (2, Outcome::Replayed(1))] {
            let out = idem
                .execute(&scope, &Key::new("k").expect("key"), &request, move |tx| {
                    Box::pin(async move {
                        // The separate path saved the session's lock wait in this variable
                        // (MariaDB's merged path never sets it).
                        let saved: Option<Option<i64>> =
                            tx.query_first("SELECT @idem_lock_wait").await?;
                        assert!(saved.flatten().is_some(), "not the separate path");
                        Ok::<_, mysql_async::Error>(i)
                    })
                })
                .await
                .expect("execute");
            assert_eq!(out, expected);
        }
        let lost = idem
            .execute(&scope, &Key::new("lost").expect("key"), &request, |tx| {
                Box::pin(async move {
                    tx.query_drop("ROLLBACK").await?;
                    Ok::<_, mysql_async::Error>(1)
                })
            })
            .await;
        match lost {
            Err(Error::Backend(e)) => {
                assert!(e.to_string().contains("ended inside the effect"), "{e}")
            }
            other => panic!("expected the lost-transaction error, got {other:?}"),
        }
        let sub = Subscriber::new("s").expect("subscriber");
        let id = MessageId::new("m").expect("message id");
        for expected in [Consumed::Applied(()), Consumed::Duplicate] {
            let out = idem
                .consume(&sub, &id, None, |_tx| {
                    Box::pin(async { Ok::<_, mysql_async::Error>(()) })
                })
                .await
                .expect("consume");
            assert_eq!(out, expected);
        }
        let records: Option<(i64, i64, i64)> = conn
            .query_first(format!(
                "SELECT (SELECT COUNT(*) FROM {name}.idem_request_result), \
                 (SELECT COUNT(*) FROM {name}.idem_request_result WHERE response IS NULL), \
                 (SELECT COUNT(*) FROM {name}.idem_processed_message)"
            ))
            .await
            .expect("count");
        assert_eq!(records, Some((1, 0, 1)));
        drop(idem);
        backend.disconnect().await.expect("disconnect");
        conn.query_drop(format!("DROP DATABASE {name}"))
            .await
            .expect("drop");
        drop(conn);
        admin.disconnect().await.expect("disconnect");
    }

    #[test]
    fn migration_is_embedded() {
        assert_eq!(MIGRATIONS.len(), 5);
        assert_eq!(MIGRATIONS[0].version, 1);
        assert_eq!(MIGRATIONS[1].version, 2);
        assert_eq!(MIGRATIONS[2].version, 3);
        assert!(
            MIGRATIONS[2]
                .sql
                .contains("CREATE TABLE IF NOT EXISTS idem_run (")
        );
        assert!(
            MIGRATIONS[2]
                .sql
                .contains("CREATE TABLE IF NOT EXISTS idem_outbox (")
        );
        assert!(MIGRATIONS[1].sql.contains("expires_at"));
        assert!(MIGRATIONS[0].sql.contains("idem_request_result"));
        assert!(MIGRATIONS[0].sql.contains("idem_processed_message"));
    }
}
