//! PostgreSQL backend for idem, on [sqlx](https://docs.rs/sqlx).
//!
//! # Two claims, one protocol
//!
//! How a claim keeps concurrent calls with one key apart is a [`ClaimStyle`]; both run
//! idem-core's claim tree ([`idem_core::claim::run`]) and keep every promise of the
//! conformance suite (CI runs it with each).
//!
//! **The key lock** ([`ClaimStyle::KeyLock`], the default on a single server and its
//! streaming replicas). The claim's `BEGIN` message also tries
//! `pg_try_advisory_xact_lock` of the identity's 64-bit name
//! ([`idem_core::Identity::lock_key`], with the table's OID mixed in), which never
//! waits; only when another transaction holds the name does a second message wait for
//! it, bounded by the wait bound (the session's `lock_timeout` saved, set and restored
//! inside that one statement), so calls with the same key queue there. Then one
//! `SELECT` reads the record: a live one replays, none (or an expired one) and the
//! effect runs. There is no placeholder: the record is written **once, complete**, just
//! before `COMMIT`, by an `INSERT … ON CONFLICT (pk) DO UPDATE` that replaces an expired
//! record only; each session prepares that `INSERT` once (`PREPARE idem_cr_<n>`, the name
//! kept in the session setting `idem.complete_request`) and then sends `EXECUTE …;
//! COMMIT` in one message. The primary key still refuses a second record: a record
//! committed meanwhile by a session that takes no key lock (an earlier idem, SQL of the
//! application's own) makes the completion fail before its `COMMIT`, and the retry
//! replays that record. A new request costs two round trips more than its bare effect
//! with the replay fast path, one without it, and writes one row where a placeholder
//! costs a row and its update (`docs/performance.md`).
//!
//! The completion's guards fail **on purpose** with SQLSTATE 23502 (a `NOT NULL` column
//! set to `NULL`), which stops the message before its `COMMIT`; the error's column (a
//! structured field, never the message text) names the guard: the claiming transaction
//! ended inside the effect, the record's retention ran out while the effect ran, or a
//! live record was written without the lock. A simple query binds nothing, so the
//! completion's user values travel as escape-string constants (`E'…'`, each backslash
//! and quote doubled: the meaning does not depend on `standard_conforming_strings`); the
//! key lock's `BEGIN` carries integers only. A prepared completion another statement
//! deallocated (`DEALLOCATE ALL`, a pooler's reset) answers 26000: idem forgets the name,
//! rolls back and retries with the same key, preparing it again.
//!
//! Under REPEATABLE READ or SERIALIZABLE the snapshot is taken by the `BEGIN` message's
//! first `SELECT`, before the lock's wait: a claim that had to wait for the key and then
//! finds no live record answers a serialization failure itself (before any effect), and
//! idem retries it in a new transaction with the same key, as it retries 40001.
//!
//! **The placeholder** ([`ClaimStyle::Placeholder`]: Citus, CockroachDB, YugabyteDB, or
//! by choice) is the pattern's reference claim: `INSERT … ON CONFLICT DO NOTHING` inside
//! the effect's transaction, then a **separate** `SELECT` when nothing was inserted. A
//! conflicting insert waits for the other transaction; under READ COMMITTED the row it
//! committed may be invisible to the INSERT's snapshot, but the next statement sees it.
//! The winner's placeholder (response `NULL`) exists only inside its transaction; it is
//! completed with the response just before `COMMIT`. Under REPEATABLE READ or
//! SERIALIZABLE the waiting loser gets SQLSTATE 40001 instead; idem retries the whole
//! transaction with the same key (40001 and 40P01, bounded, jittered). CockroachDB and
//! YugabyteDB speak this protocol and are serializable by default, so they take that
//! path (not tested here).
//!
//! # Bounded waits
//!
//! The claim's `BEGIN` is one simple-query message that also keeps the session's own
//! `lock_timeout` in the transaction-local setting `idem.lock_timeout` and sets
//! `SET LOCAL lock_timeout` to [`Claim::wait`] (whole milliseconds, rounded up, at
//! least 1 ms, formatted by the backend: an integer, never user data). On Citus (found
//! once per backend in `pg_extension`) the bound is a message of its own after `BEGIN`,
//! `SET LOCAL citus.propagate_set_commands = 'local'; SET LOCAL lock_timeout = …`, so
//! that Citus passes it on to its workers (it re-runs that message's whole text there,
//! hence nothing else in it). A claim still waiting for
//! a concurrent holder of the same identity when it elapses gets SQLSTATE 55P03; the
//! backend rolls back and answers [`Claimed::InFlight`] (idem's `Error::InProgress`, not
//! retried). Once the claim is won the effect gets the session's own value back
//! (transaction-locally), so the bound never applies to the effect's own statements,
//! whatever set the session's value (configuration, role, startup options, or a `SET`
//! on the pooled connection). On a single node the claim's `INSERT` does that itself
//! when it inserted (`INSERT … ON CONFLICT DO NOTHING RETURNING set_config(…)`), so
//! the bound costs no round trip of its own (with the key lock, `lock_timeout` changes
//! only inside the one statement that waits for a key another transaction holds). On Citus a separate `SET
//! LOCAL lock_timeout TO DEFAULT` follows the claim, which reaches the workers: there
//! the effect gets the *default* back (the configuration's, role's or startup
//! options' value, not a plain `SET` made earlier on the pooled session; the workers
//! never had that one).
//!
//! With the replay fast path on, [`Idem::execute`](idem_core::Idem::execute) reads the
//! record and, when there is none, claims on the same pooled connection
//! ([`Backend::lookup_or_claim`]): sqlx pings a connection when the pool hands it out
//! (unless the pool was built with `test_before_acquire(false)`) and when it is
//! returned, so one checkout instead of two saves those round trips.
//!
//! # Retention in the row, exact JSON
//!
//! Every record carries `expires_at`, set by the database clock at the claim
//! (`clock_timestamp()` + the operation's retention, the same reading as `created_at`).
//! Lookups and claims treat a record as live while `expires_at > clock_timestamp()`;
//! `purge_batch(table, older_than, limit)` deletes records that are expired **and**
//! were claimed at least `older_than` ago, so one purge is safe for every operation
//! whatever its window. The completion `UPDATE` must change exactly one row that is
//! still unfinished and unexpired: a record that expired while its effect ran (the
//! retention is shorter than the effect), or an effect that ran its own `COMMIT` or
//! `ROLLBACK`, is rolled back with a non-retried error instead of a success. Migration
//! 0002 turns the JSON columns into `text` (kept byte for byte: `jsonb` would rewrite
//! `1e16`, reorder keys and refuse `"\u0000"`), adds `expires_at` and backfills it
//! as `created_at + 24 hours`.
//!
//! Effects receive a [`PgTx`] (idem's transaction on a pooled connection, counted by
//! sqlx as its own) and run their SQL on it, as on a `sqlx::Transaction`:
//! `sqlx::query("UPDATE …").execute(&mut **tx)`.
//!
//! # Phased runs and the outbox
//!
//! [`PgBackend`] implements [`idem_core::RunStore`] and [`idem_core::OutboxStore`] on
//! migration 0003's `idem_run` and `idem_outbox`. Run transactions are READ COMMITTED
//! transactions from the pool; a run's row is read `FOR UPDATE`, and a start's wait
//! for it is bounded by a transaction-local `lock_timeout` (SQLSTATE 55P03 is
//! [`ErrorKind::LockTimeout`]). The relay locks the oldest unsent messages with
//! `FOR UPDATE SKIP LOCKED` and marks them sent with `id = ANY($1)`. Phases get the
//! same [`PgTx`] as effects.
//!
//! # Citus
//!
//! [`PgBackend::distribute`] places idem's tables on a Citus coordinator
//! ([`citus`] says where and why); the statements stay valid there (no VOLATILE function
//! in a modification, row locks only by the full primary key), which an offline test
//! checks on every statement. Purges that Citus refuses with row locks switch to
//! [`PurgeStyle::Distributed`] by themselves.

pub mod citus;
#[cfg(test)]
mod citus_rules;
pub mod error_codes;
pub mod leader;
mod runs;
mod sql;
mod tx;

use std::error::Error as StdError;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use idem_core::claim::{self, Begun, Capabilities, ClaimSteps, Existing};
use idem_core::{
    Backend, Claim, Claimed, DbError, ErrorKind, Finish, Identity, Maintenance, Migration,
    PoolChecks, PoolOptions, Status, Stored, Table,
};
pub use sqlx;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, Postgres, Row};

pub use citus::{Placed, Placement};
pub use error_codes::db_error;
pub use leader::{PgHeld, PgLeaderLock};
pub use tx::PgTx;

/// The migrations embedded from this crate's `migrations/` directory.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_idempotency_records.sql",
        sql: include_str!("../migrations/0001_idempotency_records.sql"),
    },
    Migration {
        version: 2,
        name: "0002_exact_json_and_expiry.sql",
        sql: include_str!("../migrations/0002_exact_json_and_expiry.sql"),
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

/// An idem backend on a PostgreSQL pool.
#[derive(Debug, Clone)]
pub struct PgBackend {
    pool: PgPool,
    purge: PurgeStyle,
    /// Set once the server refused the row locks of a [`PurgeStyle::SkipLocked`] purge
    /// (SQLSTATE 0A000): later purges of this backend and its clones use
    /// [`PurgeStyle::Distributed`] at once.
    row_locks_refused: Arc<AtomicBool>,
    /// What runs behind the protocol (`FLAVOR_*`), read at the first claim.
    flavor: Arc<AtomicU8>,
    /// The OIDs of `idem_request_result` and `idem_processed_message`, read at the first
    /// key-lock claim after the migrations.
    table_oids: Arc<std::sync::OnceLock<[i64; 2]>>,
    claim_style: ClaimStyle,
}

/// How a claim keeps concurrent calls with the same key (or message ID) apart until
/// the first one ends. Either way the record's primary key is what finally refuses a
/// second record, and every promise of the conformance suite holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClaimStyle {
    /// [`ClaimStyle::KeyLock`] on a single PostgreSQL server, [`ClaimStyle::Placeholder`]
    /// on Citus, CockroachDB and YugabyteDB (found once per backend from
    /// `pg_extension` and `version()`).
    #[default]
    Auto,
    /// The claim takes a transaction-scoped advisory lock named by the identity
    /// ([`idem_core::Identity::lock_key`]) in its `BEGIN` message (a held name is waited
    /// for, bounded by the wait) and re-reads the record; the record is written once,
    /// complete, by the statement that inserts it just before `COMMIT`, and travels with
    /// the `COMMIT` in one message. A new request costs two round trips more than its
    /// bare effect with the replay fast path (one without), and one row written instead
    /// of a placeholder and its update (see `docs/performance.md`). Needs
    /// `pg_advisory_xact_lock` on the server that runs the transaction: a single server
    /// or a streaming primary. Not for Citus, whose advisory locks are local to each
    /// node: there the placeholder claim runs even when this style is chosen.
    KeyLock,
    /// The pattern's reference claim: `INSERT … ON CONFLICT DO NOTHING` of an unfinished
    /// placeholder, a separate re-read after a conflict, and the completion `UPDATE`
    /// before `COMMIT` (see the crate documentation). Works wherever the statements do,
    /// Citus included.
    Placeholder,
}

/// How `purge_batch` deletes a bounded batch of expired records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PurgeStyle {
    /// `DELETE … WHERE pk IN (SELECT … ORDER BY expires_at LIMIT n FOR UPDATE SKIP
    /// LOCKED)`: concurrent purgers skip each other's rows (single-node PostgreSQL and
    /// streaming replicas). A server that refuses these row locks with SQLSTATE 0A000
    /// (`feature_not_supported`: Citus does on a distributed table) gets the same
    /// batch in the [`PurgeStyle::Distributed`] style instead, from then on.
    #[default]
    SkipLocked,
    /// The same bounded batch without `FOR UPDATE SKIP LOCKED`, which Citus refuses on a
    /// table distributed over several shards (and which CockroachDB and YugabyteDB
    /// treat differently); the `DELETE` checks the expiry again on each row, so a key
    /// taken over by a new request meanwhile is kept. Concurrent purgers may wait for
    /// each other. Run live on Citus 13.2 (see `docs/scale-out.md`).
    Distributed,
}

impl PgBackend {
    /// Connects by URL (`postgres://user@host:5432/db`) with a pool of up to 40
    /// connections.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        let options = PgConnectOptions::from_str(url).map_err(db_error)?;
        Self::connect_with(options, 40).await
    }

    /// Connects with explicit options (for example a `search_path`). One direct connection
    /// is made first, so an unreachable server fails at once with the driver's own error
    /// instead of a pool timeout.
    ///
    /// The pool keeps sqlx's ping on every checkout (`test_before_acquire`), one round
    /// trip per call; [`PgBackend::connect_pooled`] with [`PoolChecks::Off`] saves it
    /// (measured in `docs/performance.md`). sqlx still pings every returned connection,
    /// which sends the `ROLLBACK` a dropped transaction queued, and closes the
    /// connection if that fails.
    pub async fn connect_with(
        options: PgConnectOptions,
        max_connections: u32,
    ) -> Result<Self, DbError> {
        let pool = PoolOptions::new(usize::try_from(max_connections).unwrap_or(usize::MAX))
            .acquire_timeout(Duration::from_secs(10));
        Self::connect_pooled(options, pool).await
    }

    /// Connects with explicit options and the pool settings every idem engine takes
    /// under the same names: `max_connections`, `acquire_timeout` (how long a call
    /// waits for a free connection before it fails with a connection error) and
    /// `checks`: [`PoolChecks::Off`] turns off sqlx's ping of every connection it hands
    /// out (`test_before_acquire`), one round trip per call (a dead connection is then
    /// found by the call, as a retried connection error); the default keeps it. sqlx
    /// pings every *returned* connection whatever this says.
    pub async fn connect_pooled(
        options: PgConnectOptions,
        pool: PoolOptions,
    ) -> Result<Self, DbError> {
        let probe = PgConnection::connect_with(&options)
            .await
            .map_err(db_error)?;
        probe.close().await.map_err(db_error)?;
        PgPoolOptions::new()
            .max_connections(u32::try_from(pool.max_connections.max(1)).unwrap_or(u32::MAX))
            .acquire_timeout(pool.acquire_timeout)
            .test_before_acquire(pool.checks != PoolChecks::Off)
            .connect_with(options)
            .await
            .map(Self::from_pool)
            .map_err(db_error)
    }

    /// Uses an existing pool.
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            purge: PurgeStyle::default(),
            row_locks_refused: Arc::new(AtomicBool::new(false)),
            flavor: Arc::new(AtomicU8::new(FLAVOR_UNKNOWN)),
            table_oids: Arc::new(std::sync::OnceLock::new()),
            claim_style: ClaimStyle::default(),
        }
    }

    /// Chooses how claims keep concurrent calls apart (see [`ClaimStyle`]; the default,
    /// [`ClaimStyle::Auto`], fits the server).
    pub fn with_claim_style(mut self, style: ClaimStyle) -> Self {
        self.claim_style = style;
        self
    }

    /// Chooses how purges delete (see [`PurgeStyle`]; [`PurgeStyle::Distributed`] for
    /// Citus).
    pub fn with_purge_style(mut self, purge: PurgeStyle) -> Self {
        self.purge = purge;
        self
    }

    /// The pool, for your own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Retention and purge ages as seconds for `make_interval`, clamped to 1000 years so an
/// absurd `Duration` cannot push `clock_timestamp() - interval` out of range.
fn secs(d: Duration) -> f64 {
    const MAX_SECS: f64 = 1000.0 * 365.25 * 86_400.0;
    d.as_secs_f64().min(MAX_SECS)
}

fn stored_request(row: &sqlx::postgres::PgRow) -> Result<Stored, DbError> {
    let status: i16 = row.try_get(2).map_err(db_error)?;
    Ok(Stored {
        request: row.try_get(0).map_err(db_error)?,
        response: row.try_get(1).map_err(db_error)?,
        status: Status::from_code(i64::from(status))?,
    })
}

/// The claim's `lock_timeout`, as PostgreSQL reads it: whole milliseconds, rounded up,
/// at least 1 (0 would mean "wait forever"), at most `i32::MAX`.
fn lock_timeout_ms(wait: Duration) -> u128 {
    wait.as_nanos()
        .div_ceil(1_000_000)
        .clamp(1, i32::MAX as u128)
}

/// Retention as whole microseconds for the key-lock completion, clamped like [`secs`].
fn micros(d: Duration) -> i64 {
    const MAX_MICROS: u128 = 1000 * 36_525 * 864_000_000;
    i64::try_from(d.as_micros().min(MAX_MICROS)).unwrap_or(i64::MAX)
}

/// What runs behind the protocol: not yet known, a single PostgreSQL server, Citus,
/// CockroachDB or YugabyteDB.
const FLAVOR_UNKNOWN: u8 = 0;
const FLAVOR_SINGLE: u8 = 1;
const FLAVOR_CITUS: u8 = 2;
const FLAVOR_OTHER: u8 = 3;

/// A claim's open transaction, and whether the effect already has the session's own
/// `lock_timeout` back (a key lock's `BEGIN` or a single-node claim write restores it in
/// the same message).
#[derive(Debug)]
pub struct PgOpen {
    tx: PgTx,
    restored: bool,
    /// The key lock's name, with [`ClaimStyle::KeyLock`].
    lock: Option<i64>,
}

/// One claim: the steps [`idem_core::claim::run`] walks, on the connection the fast
/// path already holds when there is one (no second checkout: sqlx pings a connection
/// when it hands it out and again when it is returned).
struct PgClaim<'a> {
    backend: &'a PgBackend,
    conn: std::sync::Mutex<Option<PoolConnection<Postgres>>>,
}

impl PgBackend {
    /// What runs behind the protocol (`FLAVOR_*`), asked once per backend (on `conn`).
    async fn flavor(&self, conn: &mut PgConnection) -> Result<u8, DbError> {
        match self.flavor.load(Ordering::Relaxed) {
            FLAVOR_UNKNOWN => {
                let (citus, version): (bool, String) = sqlx::query_as(sql::FLAVOR)
                    .fetch_one(conn)
                    .await
                    .map_err(db_error)?;
                let flavor = if citus {
                    FLAVOR_CITUS
                } else if version.contains("CockroachDB") || version.contains("-YB-") {
                    FLAVOR_OTHER
                } else {
                    FLAVOR_SINGLE
                };
                self.flavor.store(flavor, Ordering::Relaxed);
                Ok(flavor)
            }
            known => Ok(known),
        }
    }

    /// Whether this database runs Citus, asked once per backend (on `conn`).
    async fn on_citus(&self, conn: &mut PgConnection) -> Result<bool, DbError> {
        Ok(self.flavor(conn).await? == FLAVOR_CITUS)
    }

    /// The key lock's name for `id`: its [`Identity::lock_key`] with the OID of its
    /// record table (as this backend's sessions find it) mixed into the high half, so
    /// that idem's tables in two schemas of one database never share a lock. The OIDs
    /// are read once, after the migrations; before them (no tables) the name goes
    /// without, and the claim's re-read then says the table is missing.
    async fn lock_name(&self, conn: &mut PgConnection, id: &Identity<'_>) -> Result<i64, DbError> {
        let oids = match self.table_oids.get() {
            Some(oids) => *oids,
            None => {
                let (requests, messages): (Option<i64>, Option<i64>) =
                    sqlx::query_as(sql::TABLE_OIDS)
                        .fetch_one(conn)
                        .await
                        .map_err(db_error)?;
                match (requests, messages) {
                    (Some(r), Some(m)) => *self.table_oids.get_or_init(|| [r, m]),
                    _ => [0, 0],
                }
            }
        };
        let oid = match id {
            Identity::Request { .. } => oids[0],
            Identity::Message { .. } => oids[1],
        };
        Ok(i64::from_be_bytes(id.lock_key().to_be_bytes()) ^ (oid << 32))
    }

    /// Whether claims take the key lock ([`ClaimStyle`]), once the flavor is known.
    fn key_lock(&self) -> bool {
        let flavor = self.flavor.load(Ordering::Relaxed);
        match self.claim_style {
            ClaimStyle::Placeholder => false,
            ClaimStyle::KeyLock => flavor != FLAVOR_CITUS,
            ClaimStyle::Auto => flavor == FLAVOR_SINGLE,
        }
    }

    /// Runs one of the claim's writes (`INSERT … ON CONFLICT DO NOTHING` or the guarded
    /// takeover of an expired record); both take the key, the request and the retention.
    /// `restore` runs the statement's variant that gives the session its `lock_timeout`
    /// back when it wrote (one row back); the other reports the rows it wrote.
    async fn claim_write(
        open: &mut PgOpen,
        claim: &Claim<'_>,
        restore: bool,
        request_sql: [&'static str; 2],
        message_sql: [&'static str; 2],
    ) -> Result<bool, DbError> {
        let which = usize::from(restore);
        let query = match claim.id {
            Identity::Request { scope, key } => sqlx::query(request_sql[which])
                .bind(scope.principal.as_str())
                .bind(scope.operation.as_str())
                .bind(key.as_str()),
            Identity::Message {
                subscriber,
                message_id,
            } => sqlx::query(message_sql[which])
                .bind(subscriber.as_str())
                .bind(message_id.as_str()),
        };
        let query = query.bind(claim.request).bind(secs(claim.retention));
        let wrote = if restore {
            let restored = query
                .fetch_optional(&mut *open.tx)
                .await
                .map_err(db_error)?
                .is_some();
            open.restored = restored;
            restored
        } else {
            query
                .execute(&mut *open.tx)
                .await
                .map_err(db_error)?
                .rows_affected()
                == 1
        };
        Ok(wrote)
    }

    /// Begins a transaction on `conn` with its lock waits bounded by `wait`. On a single
    /// node `BEGIN` and the bound are one message (`single`); on Citus the bound is a
    /// message of its own after `BEGIN`, which Citus passes on to the workers. sqlx's
    /// own `Pool::begin_with` would check out a connection of its own.
    pub(crate) async fn begin_bounded_on(
        &self,
        mut conn: PoolConnection<Postgres>,
        wait: Duration,
        single: fn(u128) -> String,
    ) -> Result<PgTx, DbError> {
        let ms = lock_timeout_ms(wait);
        if !self.on_citus(&mut conn).await? {
            return PgTx::open(conn, Some(single(ms))).await;
        }
        let mut tx = PgTx::open(conn, None).await?;
        let bound = sqlx::raw_sql(sqlx::AssertSqlSafe(sql::bound_citus(ms)))
            .execute(&mut *tx)
            .await;
        match bound {
            Ok(_) => Ok(tx),
            Err(e) => {
                let _ = tx.rollback().await;
                Err(db_error(e))
            }
        }
    }

    /// Whether a claim write may restore `lock_timeout` itself (not on Citus).
    fn restores_in_write(&self) -> bool {
        self.flavor.load(Ordering::Relaxed) != FLAVOR_CITUS
    }
}

/// The claim's steps; the decision tree is [`idem_core::claim::run`]'s. With the key lock
/// the claim is read-first (the lock serializes the claims of one identity, as SQLite's
/// `BEGIN IMMEDIATE` serializes its writers): `BEGIN` takes the lock, the re-read
/// decides, and the record is written at completion. With a placeholder a conflict is an
/// `INSERT` that inserted nothing (no error), and the re-read is a separate statement.
impl ClaimSteps for PgClaim<'_> {
    type Open = PgOpen;
    type Won = PgTx;

    fn engine(&self) -> &'static str {
        "postgres"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().read_first(self.backend.key_lock())
    }

    async fn begin(&self, claim: &Claim<'_>) -> Result<Begun<PgOpen>, DbError> {
        let held = self.conn.lock().ok().and_then(|mut c| c.take());
        let mut conn = match held {
            Some(conn) => conn,
            None => tx::checkout(&self.backend.pool).await?,
        };
        self.backend.flavor(&mut conn).await?;
        if self.backend.key_lock() {
            let lock = self.backend.lock_name(&mut conn, &claim.id).await?;
            let tx = PgTx::open(conn, Some(sql::begin_key_lock(lock))).await?;
            return Ok(Begun::Open(PgOpen {
                tx,
                restored: true,
                lock: Some(lock),
            }));
        }
        let tx = self
            .backend
            .begin_bounded_on(conn, claim.wait, sql::begin_claim)
            .await?;
        Ok(Begun::Open(PgOpen {
            tx,
            restored: false,
            lock: None,
        }))
    }

    async fn insert(&self, open: &mut PgOpen, claim: &Claim<'_>) -> Result<bool, DbError> {
        PgBackend::claim_write(
            open,
            claim,
            self.backend.restores_in_write(),
            [sql::INSERT_REQUEST, sql::INSERT_REQUEST_RESTORE],
            [sql::INSERT_MESSAGE, sql::INSERT_MESSAGE_RESTORE],
        )
        .await
    }

    async fn reread(&self, open: &mut PgOpen, claim: &Claim<'_>) -> Result<Existing, DbError> {
        if self.backend.key_lock() {
            if let Some(existing) = reread_locked(open, claim).await? {
                return Ok(existing);
            }
            // Another transaction held the key when this one began: wait for it,
            // bounded (55P03 answers InFlight), then read again.
            let lock = open.lock.unwrap_or_default();
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql::wait_key_lock(
                lock_timeout_ms(claim.wait),
                lock,
            )))
            .execute(&mut *open.tx)
            .await
            .map_err(db_error)?;
            return reread_locked(open, claim).await?.ok_or_else(|| {
                DbError::new(
                    "postgres",
                    ErrorKind::Other,
                    "internal: the key lock was taken but the re-read does not see it held",
                )
            });
        }
        let (row, expired_column) = match claim.id {
            Identity::Request { scope, key } => (
                sqlx::query(sql::SELECT_REQUEST)
                    .bind(scope.principal.as_str())
                    .bind(scope.operation.as_str())
                    .bind(key.as_str())
                    .fetch_optional(&mut *open.tx)
                    .await,
                3,
            ),
            Identity::Message {
                subscriber,
                message_id,
            } => (
                sqlx::query(sql::SELECT_MESSAGE)
                    .bind(subscriber.as_str())
                    .bind(message_id.as_str())
                    .fetch_optional(&mut *open.tx)
                    .await,
                1,
            ),
        };
        let Some(row) = row.map_err(db_error)? else {
            return Ok(Existing::Vanished);
        };
        if row.try_get::<bool, _>(expired_column).map_err(db_error)? {
            return Ok(Existing::Expired);
        }
        live(&row, claim).map(Existing::Live)
    }

    async fn replace_expired(&self, open: &mut PgOpen, claim: &Claim<'_>) -> Result<bool, DbError> {
        PgBackend::claim_write(
            open,
            claim,
            self.backend.restores_in_write(),
            [
                sql::REPLACE_EXPIRED_REQUEST,
                sql::REPLACE_EXPIRED_REQUEST_RESTORE,
            ],
            [
                sql::REPLACE_EXPIRED_MESSAGE,
                sql::REPLACE_EXPIRED_MESSAGE_RESTORE,
            ],
        )
        .await
    }

    async fn ready(&self, open: &mut PgOpen, _claim: &Claim<'_>) -> Result<(), DbError> {
        // The effect runs with the session's own `lock_timeout`; the claim's write gave
        // it back already on a single node.
        if open.restored {
            return Ok(());
        }
        // On Citus: the write went alone (a `set_config` does not reach the workers).
        sqlx::raw_sql(sql::RESTORE_LOCK_TIMEOUT)
            .execute(&mut *open.tx)
            .await
            .map(drop)
            .map_err(db_error)
    }

    fn won(&self, open: PgOpen, _claim: &Claim<'_>) -> PgTx {
        open.tx
    }

    async fn rollback(&self, open: PgOpen) -> Result<(), DbError> {
        // Queued, as sqlx does for a dropped transaction: the `ROLLBACK` travels with the
        // pool's check of the returned connection (no round trip of its own), and a
        // connection whose check fails is closed, which rolls back on the server. `SET
        // LOCAL`, the key lock and `idem.claimed_at` end with the transaction.
        drop(open);
        Ok(())
    }

    fn waited_too_long(&self, error: &DbError) -> bool {
        error.code() == Some(error_codes::LOCK_NOT_AVAILABLE)
    }
}

/// A live record's columns (request: request, response, status; message: fingerprint).
fn live(row: &sqlx::postgres::PgRow, claim: &Claim<'_>) -> Result<Stored, DbError> {
    match claim.id {
        Identity::Request { .. } => stored_request(row),
        Identity::Message { .. } => Ok(Stored {
            request: row.try_get(0).map_err(db_error)?,
            response: None,
            status: Status::Succeeded,
        }),
    }
}

/// The key-lock claim's re-read ([`sql::SELECT_REQUEST_LOCKED`]): one row, whatever the
/// table holds; `None` while this transaction does not hold the key lock. A claim that
/// may decide on a snapshot older than the wait for its key is a serialization failure;
/// a won claim keeps its times for the completion.
async fn reread_locked(open: &mut PgOpen, claim: &Claim<'_>) -> Result<Option<Existing>, DbError> {
    let retention = micros(claim.retention);
    let (row, expired_column) = match claim.id {
        Identity::Request { scope, key } => (
            sqlx::query(sql::SELECT_REQUEST_LOCKED)
                .bind(scope.principal.as_str())
                .bind(scope.operation.as_str())
                .bind(key.as_str())
                .bind(retention)
                .fetch_one(&mut *open.tx)
                .await,
            3,
        ),
        Identity::Message {
            subscriber,
            message_id,
        } => (
            sqlx::query(sql::SELECT_MESSAGE_LOCKED)
                .bind(subscriber.as_str())
                .bind(message_id.as_str())
                .bind(retention)
                .fetch_one(&mut *open.tx)
                .await,
            1,
        ),
    };
    let row = row.map_err(db_error)?;
    // After `expired`: absent, stale, the three times, the prepared name, locked.
    let locked = row
        .try_get::<Option<bool>, _>(expired_column + 7)
        .map_err(db_error)?
        .unwrap_or(false);
    if !locked {
        return Ok(None);
    }
    let absent: bool = row.try_get(expired_column + 1).map_err(db_error)?;
    let stale = row
        .try_get::<Option<bool>, _>(expired_column + 2)
        .map_err(db_error)?
        .unwrap_or(false);
    let expired = !absent && row.try_get::<bool, _>(expired_column).map_err(db_error)?;
    if !absent && !expired {
        return live(&row, claim).map(|s| Some(Existing::Live(s)));
    }
    if stale {
        // A winner may have committed while this transaction waited for the key, after
        // its snapshot: decide in a new transaction, as the server's own 40001 makes
        // the placeholder claim do.
        return Err(DbError::new(
            "postgres",
            ErrorKind::SerializationFailure,
            "the key was held by another transaction while this one waited, and \
             REPEATABLE READ or SERIALIZABLE keeps the snapshot taken before the wait; \
             claiming again in a new transaction",
        ));
    }
    let time = |i: usize| {
        row.try_get::<i64, _>(expired_column + 3 + i)
            .map_err(db_error)
    };
    let times = sql::ClaimTimes {
        begun: time(0)?,
        claimed: time(1)?,
        expires: time(2)?,
        prepared: row
            .try_get::<Option<String>, _>(expired_column + 6)
            .map_err(db_error)?
            .filter(|name| sql::is_prepared_name(name)),
    };
    open.tx.key_lock = Some((times, expired));
    Ok(Some(if expired {
        Existing::Expired
    } else {
        Existing::Vanished
    }))
}

impl PgBackend {
    fn request_lookup<'q>(
        claim: &Claim<'q>,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        match claim.id {
            Identity::Request { scope, key } => sqlx::query(sql::LOOKUP_REQUEST)
                .bind(scope.principal.as_str())
                .bind(scope.operation.as_str())
                .bind(key.as_str()),
            Identity::Message {
                subscriber,
                message_id,
            } => sqlx::query(sql::LOOKUP_MESSAGE)
                .bind(subscriber.as_str())
                .bind(message_id.as_str()),
        }
    }

    /// The fast path's read on `conn`.
    async fn lookup_on(
        conn: &mut PgConnection,
        claim: &Claim<'_>,
    ) -> Result<Option<Stored>, DbError> {
        let row = Self::request_lookup(claim)
            .fetch_optional(conn)
            .await
            .map_err(db_error)?;
        match claim.id {
            Identity::Request { .. } => row.as_ref().map(stored_request).transpose(),
            Identity::Message { .. } => row
                .map(|r| {
                    Ok(Stored {
                        request: r.try_get(0).map_err(db_error)?,
                        response: None,
                        status: Status::Succeeded,
                    })
                })
                .transpose(),
        }
    }
}

/// The error of a key-lock completion whose message failed (its `COMMIT` did not run):
/// the guard's code and column (see `sql::complete_request_locked`) name the reason.
fn locked_completion_error(e: sqlx::Error) -> DbError {
    let (code, column) = match &e {
        sqlx::Error::Database(d) => (
            d.code().map(|c| c.into_owned()),
            d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .and_then(|p| p.column())
                .map(str::to_owned),
        ),
        _ => (None, None),
    };
    match (code.as_deref(), column.as_deref()) {
        (Some(error_codes::NOT_NULL_VIOLATION), Some("request_key" | "message_id")) => {
            not_completed(None)
        }
        (Some(error_codes::NOT_NULL_VIOLATION), Some("created_at" | "processed_at")) => {
            not_completed(Some(true))
        }
        (Some(error_codes::NOT_NULL_VIOLATION), Some("expires_at"))
        | (Some(error_codes::UNIQUE_VIOLATION), _) => DbError::new(
            "postgres",
            ErrorKind::Transient,
            "a live record of this key was committed by a session that does not take idem's \
             key lock (an earlier idem, or SQL of the application's own); nothing was \
             stored, and the retry replays that record",
        ),
        _ => db_error(e),
    }
}

/// The error of a completion that found no unfinished, unexpired record.
fn not_completed(expired: Option<bool>) -> DbError {
    if expired == Some(true) {
        DbError::new(
            "postgres",
            ErrorKind::Other,
            "the record expired before the effect finished; the retention is shorter than the \
             effect (idem rolled back and stored nothing)",
        )
    } else {
        DbError::new(
            "postgres",
            ErrorKind::Other,
            "the idem transaction ended inside the effect (COMMIT or ROLLBACK run by the \
             effect): the record is gone; idem stored nothing",
        )
    }
}

impl Backend for PgBackend {
    type Tx = PgTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let mut conn = tx::checkout(&self.pool).await?;
        Self::lookup_on(&mut conn, claim).await
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<PgTx>, DbError> {
        let steps = PgClaim {
            backend: self,
            conn: std::sync::Mutex::new(None),
        };
        claim::run(&steps, claim).await
    }

    /// The fast path's read and, when it finds nothing, the claim, on one connection.
    async fn lookup_or_claim(&self, claim: &Claim<'_>) -> Result<Claimed<PgTx>, DbError> {
        let mut conn = tx::checkout(&self.pool).await?;
        if let Some(stored) = Self::lookup_on(&mut conn, claim).await? {
            return Ok(Claimed::Found(stored));
        }
        let steps = PgClaim {
            backend: self,
            conn: std::sync::Mutex::new(Some(conn)),
        };
        claim::run(&steps, claim).await
    }

    async fn finish(
        &self,
        mut tx: PgTx,
        claim: &Claim<'_>,
        end: Finish<'_>,
    ) -> Result<(), DbError> {
        let (response, status) = match end {
            Finish::Rollback => return tx.rollback().await,
            Finish::Commit { response, status } => (response, status),
        };
        if self.key_lock() {
            // The record, complete, and the COMMIT in one message.
            let Some((times, replace)) = tx.key_lock.take() else {
                let _ = tx.rollback().await;
                return Err(DbError::new(
                    "postgres",
                    ErrorKind::Other,
                    "internal: a key-lock completion without its claim's times (a bug in \
                     idem-postgres; rolled back, nothing stored)",
                ));
            };
            let message = match claim.id {
                Identity::Request { scope, key } => sql::complete_request_locked(
                    [
                        scope.principal.as_str(),
                        scope.operation.as_str(),
                        key.as_str(),
                    ],
                    claim.request,
                    response,
                    status.code(),
                    &times,
                    replace,
                ),
                Identity::Message {
                    subscriber,
                    message_id,
                } => sql::complete_message_locked(
                    [subscriber.as_str(), message_id.as_str()],
                    claim.request,
                    &times,
                    replace,
                ),
            };
            return match tx.commit_with(message).await {
                Ok(()) => Ok(()),
                Err((tx, e)) => {
                    // A lost reply is an unknown outcome (the retry re-reads); any other
                    // error stopped the message before its COMMIT.
                    let code = e.as_database_error().and_then(|d| d.code());
                    if code.as_deref() == Some(error_codes::INVALID_SQL_STATEMENT_NAME) {
                        // The session lost its prepared completion (`DEALLOCATE`): forget
                        // its name, so that the retry prepares it again.
                        let _ = tx.rollback_then(sql::FORGET_PREPARED).await;
                        return Err(DbError::new(
                            "postgres",
                            ErrorKind::Transient,
                            "the session's prepared completion was deallocated; nothing \
                             was stored, and the retry prepares it again",
                        ));
                    }
                    let _ = tx.rollback().await;
                    Err(locked_completion_error(e))
                }
            };
        }
        let checked = match claim.id {
            Identity::Request { scope, key } => {
                let (p, o, k) = (
                    scope.principal.as_str(),
                    scope.operation.as_str(),
                    key.as_str(),
                );
                let completed = sqlx::query(sql::COMPLETE_REQUEST)
                    .bind(p)
                    .bind(o)
                    .bind(k)
                    .bind(response)
                    .bind(status.code())
                    .execute(&mut *tx)
                    .await
                    .map_err(db_error)?
                    .rows_affected();
                if completed == 1 {
                    Ok(())
                } else {
                    let expired: Option<bool> = sqlx::query_scalar(sql::EXPIRED_REQUEST)
                        .bind(p)
                        .bind(o)
                        .bind(k)
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(db_error)?;
                    Err(not_completed(expired))
                }
            }
            Identity::Message {
                subscriber,
                message_id,
            } => {
                let expired: Option<bool> = sqlx::query_scalar(sql::EXPIRED_MESSAGE)
                    .bind(subscriber.as_str())
                    .bind(message_id.as_str())
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(db_error)?;
                if expired == Some(false) {
                    Ok(())
                } else {
                    Err(not_completed(expired))
                }
            }
        };
        match checked {
            Ok(()) => tx.commit().await,
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        // The driver's error, or the database error inside it: an effect error that wraps
        // sqlx's with `#[error(transparent)]` exposes only the latter as its source.
        if let Some(e) = error.downcast_ref::<sqlx::Error>() {
            return Some(error_codes::classify(e));
        }
        // sqlx's `Error::Database` gives its boxed database error as its source.
        if let Some(e) = error.downcast_ref::<Box<dyn sqlx::error::DatabaseError>>() {
            return Some(
                e.code()
                    .map_or(ErrorKind::Other, |c| error_codes::kind_of(&c)),
            );
        }
        error
            .downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .map(|e| error_codes::kind_of(e.code()))
    }
}

impl Maintenance for PgBackend {
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        let mut tx = self.pool.begin().await.map_err(db_error)?;
        sqlx::query(sql::MIGRATION_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        sqlx::query(sql::CREATE_MIGRATIONS)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        let done: Vec<i32> = sqlx::query_scalar(sql::SELECT_MIGRATIONS)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_error)?;
        let mut applied = Vec::new();
        for m in MIGRATIONS
            .iter()
            .filter(|m| !done.contains(&i32::try_from(m.version).unwrap_or(i32::MAX)))
        {
            // One statement per message: Citus re-sends a DDL statement's text to its
            // shards, and refuses one that arrived with others in a single message
            // (42601, "cannot insert multiple commands into a prepared statement").
            for statement in citus::statements(m.sql) {
                sqlx::raw_sql(statement)
                    .execute(&mut *tx)
                    .await
                    .map_err(db_error)?;
            }
            sqlx::query(sql::INSERT_MIGRATION)
                .bind(i32::try_from(m.version).unwrap_or(i32::MAX))
                .bind(m.name)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            applied.push(m.version);
        }
        tx.commit().await.map_err(db_error)?;
        Ok(applied)
    }

    async fn purge_batch(
        &self,
        table: Table,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, DbError> {
        let style = if self.row_locks_refused.load(Ordering::Relaxed) {
            PurgeStyle::Distributed
        } else {
            self.purge
        };
        match self.purge_in_style(style, table, older_than, limit).await {
            Err(e)
                if style == PurgeStyle::SkipLocked
                    && e.code() == Some(error_codes::FEATURE_NOT_SUPPORTED) =>
            {
                // Citus: no `FOR UPDATE` over several shards. The statement changed
                // nothing; the same batch without row locks.
                self.row_locks_refused.store(true, Ordering::Relaxed);
                self.purge_in_style(PurgeStyle::Distributed, table, older_than, limit)
                    .await
            }
            other => other,
        }
    }
}

impl PgBackend {
    async fn purge_in_style(
        &self,
        style: PurgeStyle,
        table: Table,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, DbError> {
        let statement = match (table, style) {
            (Table::Requests, PurgeStyle::SkipLocked) => sql::PURGE_REQUESTS,
            (Table::Messages, PurgeStyle::SkipLocked) => sql::PURGE_MESSAGES,
            (Table::Runs, PurgeStyle::SkipLocked) => sql::PURGE_RUNS,
            (Table::Outbox, PurgeStyle::SkipLocked) => sql::PURGE_OUTBOX,
            (Table::Requests, PurgeStyle::Distributed) => sql::PURGE_REQUESTS_DISTRIBUTED,
            (Table::Messages, PurgeStyle::Distributed) => sql::PURGE_MESSAGES_DISTRIBUTED,
            (Table::Runs, PurgeStyle::Distributed) => sql::PURGE_RUNS_DISTRIBUTED,
            (Table::Outbox, PurgeStyle::Distributed) => sql::PURGE_OUTBOX_DISTRIBUTED,
        };
        sqlx::query(statement)
            .bind(secs(older_than))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected())
            .map_err(db_error)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ages_are_clamped() {
        assert_eq!(super::secs(std::time::Duration::from_millis(1500)), 1.5);
        assert!(super::secs(std::time::Duration::MAX) < 4e10);
    }
}
