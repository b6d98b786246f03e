//! Oracle backend for idem, on the [`oracle`] crate (ODPI-C over Oracle Client).
//!
//! # The claim
//!
//! A **plain `INSERT`** of the record, with its response still `NULL`, in the effect's
//! transaction. Oracle makes an insert whose primary key collides with another
//! session's *uncommitted* row wait for that transaction: if it commits, the insert
//! fails with ORA-00001; if it rolls back, the insert succeeds and this caller takes
//! the key over. A failed statement is rolled back on its own (statement-level
//! rollback), so the transaction stays usable after ORA-00001 — unlike PostgreSQL's
//! 25P02 there is nothing to recover from. After ORA-00001 a **separate `SELECT`**
//! reads the winner's record: under READ COMMITTED (Oracle's default) every statement
//! reads the data committed before *it* began, so the row whose commit raised
//! ORA-00001 is visible. If the record found is expired (its `expires_at` passed, by
//! the database clock) a guarded `UPDATE … WHERE expires_at <= now` takes it over; if
//! it vanished (purged) the claim inserts again.
//!
//! # Bounded waits (chosen: the call timeout)
//!
//! The INSERT that waits for a concurrent holder of the same key is not a locking
//! `SELECT`, so `WAIT n` / `NOWAIT` do not apply to it. The claim therefore runs under
//! the connection's **call timeout** (`Connection::set_call_timeout`, ODPI-C's
//! `dpiConn_setCallTimeout`) set to [`Claim::wait`] (whole milliseconds, at least 1)
//! and restored to the connection's previous value right after the claim, so the effect
//! is not bounded by it. A claim whose future is dropped before that (a caller's
//! timeout, a cancelled request) hands its connection back with the call timeout still
//! set: the pool clears it (and rolls back) before the connection's next use. A claim round trip still waiting when it elapses is cancelled
//! (DPI-1067, ORA-03156); the backend rolls back and answers [`Claimed::InFlight`]
//! (idem's `Error::InProgress`, not retried). If ODPI-C could not clean the connection
//! up, the rollback fails and the pool closes the connection. Not verified live.
//!
//! # Retention in the row
//!
//! Each record's `expires_at` is set at the claim (`SYS_EXTRACT_UTC(SYSTIMESTAMP)` + the
//! operation's retention, one reading per statement, like `created_at`); lookups and
//! claims read it, and `purge_batch(table, older_than, limit)` deletes records that are
//! expired **and** claimed at least `older_than` ago. The completion (and a check before
//! a message's `COMMIT`) refuses a record that expired while the effect ran, with a
//! non-retried error saying the retention is shorter than the effect. Migration 0002
//! adds the column (backfilled as `created_at + 24 hours`). JSON stays CLOB text in
//! AL32UTF8, kept verbatim.
//!
//! The placeholder exists only inside the winner's transaction: READ COMMITTED never
//! shows uncommitted rows to other sessions, and the response is stored just before
//! `COMMIT`. There is no `MERGE` (two concurrent MERGEs can both take the "not
//! matched" branch and one fails with ORA-00001 anyway).
//!
//! Under SERIALIZABLE isolation Oracle raises ORA-08177 where READ COMMITTED would
//! wait and read; idem retries the whole transaction with the same key (ORA-08177,
//! ORA-00060 deadlocks, ORA-00054/ORA-30006 lock timeouts; bounded and jittered), also
//! when the error comes from an effect ([`Backend::classify`]). ORA-00060 rolls back
//! only the failed statement; idem rolls back the rest before retrying.
//!
//! # Phased runs and the outbox
//!
//! [`OracleBackend`] implements [`idem_core::RunStore`] and [`idem_core::OutboxStore`]
//! (migration 0003: `idem_run`, `idem_outbox`; not verified live). A run's row is read
//! `FOR UPDATE`; the relay locks the oldest unsent messages `FOR UPDATE SKIP LOCKED`,
//! fetching (and so locking) at most its limit, and reads a destination's unsent ids
//! with a plain query. `Idem::start` bounds its lock waits with the connection's call
//! timeout, like the claim (restored at `COMMIT`/`ROLLBACK`); a call it cuts (DPI-1067,
//! ORA-03156) is reported as [`ErrorKind::LockTimeout`] there.
//!
//! # Storage
//!
//! Scope and key columns are `RAW(255)` and bound as bytes, so comparisons are binary
//! whatever the session's `NLS_COMP`/`NLS_SORT` (`LINGUISTIC` sessions compare
//! *character* types by their linguistic rules; RAW is never affected). Oracle stores
//! `''` — and an empty RAW — as NULL: idem-core refuses empty keys, and this backend
//! refuses an empty identifier again before binding. JSON is `CLOB` text (bound
//! through Oracle's LOB data interface as LONG data, any size, one round trip); the
//! database character set must be Unicode (`AL32UTF8`, the default since 12.2), which
//! [`Maintenance::migrate`] checks. Ages use `SYS_EXTRACT_UTC(SYSTIMESTAMP)`, the
//! database server's clock in UTC.
//!
//! # Connections
//!
//! The `oracle` crate is blocking, so every call runs on tokio's blocking pool
//! ([`tokio::task::spawn_blocking`]) with a connection moved there and back. The
//! backend keeps its own small pool (32 connections by default): standalone
//! connections, opened lazily, reused when idle, closed when a session is dead, and
//! rolled back before reuse if a transaction was left open. Effects get an
//! [`OracleTx`] and run their SQL with [`OracleTx::run`].
//!
//! The `oracle` crate loads the Oracle Client library at run time. Without one,
//! [`OracleBackend::connect`] fails at once with
//! [`ErrorKind::ClientLibraryMissing`] (DPI-1047) and says what to install.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{serde_json, Idem, Key, Operation, Principal, Request, Scope};
//! use idem_oracle::OracleBackend;
//!
//! let idem = Idem::new(OracleBackend::connect("oracle://app:secret@localhost:1521/FREEPDB1").await?);
//! idem.migrate().await?;
//! let scope = Scope::new(Principal::new("user-7")?, Operation::new("debit", 1)?);
//! let outcome = idem
//!     .execute(&scope, &Key::new("checkout-42")?, &Request::new(serde_json::json!({"amount": 100})), |tx| {
//!         Box::pin(async move {
//!             tx.run(|c| c.execute("UPDATE account SET balance = balance - 100 WHERE id = 1", &[]).map(drop))
//!                 .await
//!                 .map(|()| serde_json::json!({"ok": true}))
//!                 .map_err(idem_oracle::db_error)
//!         })
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

pub mod error_codes;
pub mod leader;
mod options;
mod runs;
mod sql;

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::blocking::{BlockingPool, Lease, Manager};
use idem_core::claim::{self, Begun, ClaimSteps, Existing};
use idem_core::{
    Backend, Claim, Claimed, DbError, ErrorKind, Finish, Identity, Maintenance, Migration, Status,
    Stored, Table,
};
pub use oracle;
use oracle::sql_type::OracleType;
use oracle::{Connection, Connector};

pub use error_codes::db_error;
pub use leader::{OracleHeld, OracleLeaderLock};
pub use options::{ConnectOptions, DEFAULT_MAX_CONNECTIONS, DEFAULT_PORT, MAX_CONNECTIONS_LIMIT};

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

const ENGINE: &str = "oracle";

/// The longest interval bound, in microseconds (1000 years). Longer retentions mean
/// "never expires" and are clamped, so the cutoff stays inside Oracle's date range.
const MAX_INTERVAL_MICROS: i64 = 1000 * 31_557_600 * 1_000_000;

/// The character sets in which CLOB text holds every Unicode character.
const UNICODE_CHARSETS: &[&str] = &["AL32UTF8", "UTF8"];

/// ORA numbers a migration statement may raise when its object already exists, or an
/// object it drops is already gone (a concurrent or interrupted earlier run): Oracle DDL
/// has no `IF [NOT] EXISTS` before 23ai, and every DDL statement commits on its own.
const ALREADY_EXISTS: &[i32] = &[
    error_codes::NAME_IN_USE,
    error_codes::COLUMNS_ALREADY_INDEXED,
    error_codes::COLUMN_ALREADY_EXISTS,
    error_codes::INDEX_DOES_NOT_EXIST,
];

/// What the pool needs to open connections, and Oracle's checks for it: a connection is
/// reused as it is when it has no open transaction (the `TransactionInProgress`
/// attribute, no round trip) and no call timeout; when it has either (a claim or
/// `Idem::start` whose future was dropped before it restored the call timeout it set),
/// its call timeout is cleared and its transaction rolled back on the blocking pool at
/// its next checkout; it is thrown away (closed, which rolls back) when its session is
/// dead or that reset fails. Connections are opened without a call timeout, so a pooled
/// connection is always handed out without one.
struct Oracle {
    options: ConnectOptions,
}

impl Manager for Oracle {
    type Connection = Connection;
    const ENGINE: &'static str = ENGINE;

    fn open(&self) -> Result<Connection, DbError> {
        open_connection(&self.options)
    }

    fn in_transaction(&self, conn: &Connection) -> bool {
        has_transaction(conn)
    }

    fn reusable(&self, conn: &Connection) -> bool {
        is_healthy(conn)
    }

    fn altered(&self, conn: &Connection) -> bool {
        call_timeout_left(conn.call_timeout())
    }

    fn reset(&self, conn: &Connection) -> bool {
        // Clearing the call timeout is client-side (no round trip); the rollback is one.
        conn.set_call_timeout(None).is_ok() && (!has_transaction(conn) || conn.rollback().is_ok())
    }
}

/// Whether a connection's call timeout (as `Connection::call_timeout` reads it, client
/// side) is other than the none it was opened with; unknown counts as set, so the pool
/// clears it.
fn call_timeout_left(timeout: oracle::Result<Option<Duration>>) -> bool {
    !matches!(timeout, Ok(None))
}

/// An idem backend on an Oracle database, with a small pool of connections.
#[derive(Clone)]
pub struct OracleBackend {
    pool: BlockingPool<Oracle>,
}

impl fmt::Debug for OracleBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OracleBackend")
            .field("options", &self.pool.manager().options)
            .finish_non_exhaustive()
    }
}

impl OracleBackend {
    /// Connects by URL: `oracle://user:password@host[:port]/service_name`, user and
    /// password percent-encoded, port 1521 by default, optional `?max_connections=N`
    /// (see [`ConnectOptions::from_url`]). One connection is opened now, so a missing
    /// Oracle Client library, a bad address or bad credentials fail here.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        Self::connect_with(ConnectOptions::from_url(url)?).await
    }

    /// Connects with explicit options (any connect string Oracle Client accepts).
    pub async fn connect_with(options: ConnectOptions) -> Result<Self, DbError> {
        let backend = Self::unconnected(options)?;
        drop(backend.lease().await?);
        Ok(backend)
    }

    /// A backend that opens its first connection on first use.
    fn unconnected(options: ConnectOptions) -> Result<Self, DbError> {
        let pool_options = options.pool_options();
        Ok(Self {
            pool: BlockingPool::new(Oracle { options }, pool_options)?,
        })
    }

    /// The options this backend connects with.
    pub fn options(&self) -> &ConnectOptions {
        &self.pool.manager().options
    }

    /// Closes the pool: waits until every leased connection has come back (an open
    /// [`OracleTx`] included), then closes the idle connections on the blocking pool.
    /// Later calls on this backend or its clones fail with "connection pool closed".
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Runs `f` on a pooled connection, outside any idem transaction, on the blocking
    /// pool. Commit what `f` writes inside `f`: a transaction left open is rolled back
    /// before the connection is reused.
    pub async fn interact<T, F>(&self, f: F) -> Result<T, DbError>
    where
        F: FnOnce(&Connection) -> oracle::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let mut lease = self.lease().await?;
        lease.run(move |c| f(c).map_err(db_error)).await
    }

    async fn lease(&self) -> Result<Lease<Oracle>, DbError> {
        self.pool.lease().await
    }
}

/// Opens one standalone connection. Errors name the address and user, never the
/// password; a missing client library says what to install.
fn open_connection(options: &ConnectOptions) -> Result<Connection, DbError> {
    Connector::new(options.user(), options.password(), options.connect_string())
        .connect()
        .map_err(|e| {
            let kind = error_codes::classify(&e);
            let message = if kind == ErrorKind::ClientLibraryMissing {
                format!(
                    "cannot load Oracle Client: {} (driver: {e})",
                    error_codes::CLIENT_INSTALL_HINT
                )
            } else {
                format!(
                    "cannot connect to {} as {}: {e}",
                    options.connect_string(),
                    options.user()
                )
            };
            let err = DbError::new(ENGINE, kind, message);
            match error_codes::code_text(&e) {
                Some(code) => err.with_code(code),
                None => err,
            }
            .with_source(e)
        })
}

/// Whether the session still works, as far as the client knows without a round trip.
fn is_healthy(conn: &Connection) -> bool {
    matches!(conn.status(), Ok(oracle::ConnStatus::Normal))
}

/// Whether the session has an open transaction (a client-side attribute: no round
/// trip). Unknown counts as open, so the connection is rolled back before reuse.
fn has_transaction(conn: &Connection) -> bool {
    conn.oci_attr::<oracle::oci_attr::TransactionInProgress>()
        .unwrap_or(true)
}

/// The open transaction handed to effects.
pub struct OracleTx {
    lease: Lease<Oracle>,
    /// `begin_runs` bounded the session's calls: the bound, and the connection's own
    /// call timeout to give back when the transaction ends.
    bound: Option<(Duration, Option<Duration>)>,
}

impl fmt::Debug for OracleTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OracleTx").finish_non_exhaustive()
    }
}

impl OracleTx {
    /// Runs `f` on the transaction's connection, on tokio's blocking pool. Everything
    /// `f` writes commits or rolls back with the idempotency record. Do not call
    /// `commit` or `rollback` yourself, and do not run DDL (Oracle DDL commits).
    ///
    /// # Panics
    ///
    /// Re-raises a panic of `f`, after which the transaction is gone.
    pub async fn run<T, F>(&mut self, f: F) -> T
    where
        F: FnOnce(&Connection) -> T + Send + 'static,
        T: Send + 'static,
    {
        self.lease.run(f).await
    }
}

/// Microseconds for `NUMTODSINTERVAL(:n / 1000000, 'SECOND')`, clamped to 1000 years.
fn interval_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros())
        .unwrap_or(i64::MAX)
        .min(MAX_INTERVAL_MICROS)
}

/// A stored identifier's bytes. Oracle stores an empty RAW as NULL, so an empty one is
/// refused here, before binding (idem-core has refused it already).
fn ident_bytes(what: &str, value: &str) -> Result<Vec<u8>, DbError> {
    if value.is_empty() {
        return Err(DbError::new(
            ENGINE,
            ErrorKind::Other,
            format!("refusing an empty {what}: Oracle stores an empty value as NULL"),
        ));
    }
    Ok(value.as_bytes().to_vec())
}

/// An owned copy of a claim, to move onto the blocking pool.
#[derive(Clone)]
struct ClaimOwned {
    id: IdOwned,
    request: Option<String>,
    retention: i64,
    /// The claim's call timeout: [`Claim::wait`] in whole milliseconds, at least 1.
    wait: Duration,
}

#[derive(Clone)]
enum IdOwned {
    Request {
        principal: Vec<u8>,
        operation: Vec<u8>,
        key: Vec<u8>,
    },
    Message {
        subscriber: Vec<u8>,
        message_id: Vec<u8>,
    },
}

impl ClaimOwned {
    fn new(c: &Claim<'_>) -> Result<Self, DbError> {
        let id = match c.id {
            Identity::Request { scope, key } => IdOwned::Request {
                principal: ident_bytes("principal", scope.principal.as_str())?,
                operation: ident_bytes("operation", scope.operation.as_str())?,
                key: ident_bytes("idempotency key", key.as_str())?,
            },
            Identity::Message {
                subscriber,
                message_id,
            } => IdOwned::Message {
                subscriber: ident_bytes("subscriber", subscriber.as_str())?,
                message_id: ident_bytes("message ID", message_id.as_str())?,
            },
        };
        Ok(Self {
            id,
            request: c.request.map(str::to_owned),
            retention: interval_micros(c.retention),
            wait: call_timeout_for(c.wait),
        })
    }
}

/// A wait bound as a call timeout: whole milliseconds, rounded up, at least 1 (ODPI-C
/// takes a `u32` of milliseconds; 0 would mean "no timeout").
fn call_timeout_for(wait: Duration) -> Duration {
    Duration::from_millis(
        u64::try_from(wait.as_nanos().div_ceil(1_000_000))
            .unwrap_or(u64::MAX)
            .clamp(1, u64::from(u32::MAX)),
    )
}

/// Whether an error is a call cut by the connection's call timeout (DPI-1067, or
/// ORA-03156 when the server reports it): a wait bound running out.
fn is_call_timeout(error: &DbError) -> bool {
    matches!(error.code(), Some("DPI-1067" | "ORA-03156"))
}

/// JSON text bound to a CLOB column as LONG data (Oracle's data interface for LOBs:
/// any length in INSERT and UPDATE, no temporary LOB). `None` binds NULL.
fn clob(text: &Option<String>) -> (&Option<String>, &'static OracleType) {
    (text, &OracleType::Long)
}

fn first_row(
    conn: &Connection,
    sql: &str,
    params: &[&dyn oracle::sql_type::ToSql],
) -> oracle::Result<Option<oracle::Row>> {
    conn.query(sql, params)?.next().transpose()
}

fn request_row(row: &oracle::Row) -> Result<Stored, DbError> {
    let status: i64 = row.get(2).map_err(db_error)?;
    Ok(Stored {
        request: row.get(0).map_err(db_error)?,
        response: row.get(1).map_err(db_error)?,
        status: Status::from_code(status)?,
    })
}

fn message_row(row: &oracle::Row) -> Result<Stored, DbError> {
    Ok(Stored {
        request: row.get(0).map_err(db_error)?,
        response: None,
        status: Status::Succeeded,
    })
}

/// The fast path's read: a live record, or nothing.
fn lookup_blocking(conn: &Connection, claim: &ClaimOwned) -> Result<Option<Stored>, DbError> {
    match &claim.id {
        IdOwned::Request {
            principal,
            operation,
            key,
        } => first_row(conn, sql::LOOKUP_REQUEST, &[principal, operation, key])
            .map_err(db_error)?
            .as_ref()
            .map(request_row)
            .transpose(),
        IdOwned::Message {
            subscriber,
            message_id,
        } => first_row(conn, sql::LOOKUP_MESSAGE, &[subscriber, message_id])
            .map_err(db_error)?
            .as_ref()
            .map(message_row)
            .transpose(),
    }
}

fn is_unique_violation(e: &oracle::Error) -> bool {
    error_codes::ora_code(e) == Some(error_codes::UNIQUE_VIOLATED)
}

/// Inserts the placeholder; `false` on ORA-00001 (after waiting for the other session).
fn insert_blocking(conn: &Connection, claim: &ClaimOwned) -> Result<bool, DbError> {
    let inserted = match &claim.id {
        IdOwned::Request {
            principal,
            operation,
            key,
        } => conn.execute(
            sql::INSERT_REQUEST,
            &[
                principal,
                operation,
                key,
                &clob(&claim.request),
                &claim.retention,
            ],
        ),
        IdOwned::Message {
            subscriber,
            message_id,
        } => conn.execute(
            sql::INSERT_MESSAGE,
            &[
                subscriber,
                message_id,
                &clob(&claim.request),
                &claim.retention,
            ],
        ),
    };
    match inserted {
        Ok(_) => Ok(true),
        Err(e) if is_unique_violation(&e) => Ok(false),
        Err(e) => Err(db_error(e)),
    }
}

type RowReader = fn(&oracle::Row) -> Result<Stored, DbError>;

fn reread_blocking(conn: &Connection, claim: &ClaimOwned) -> Result<Existing, DbError> {
    let (row, read): (_, RowReader) = match &claim.id {
        IdOwned::Request {
            principal,
            operation,
            key,
        } => (
            first_row(conn, sql::SELECT_REQUEST, &[principal, operation, key]),
            request_row,
        ),
        IdOwned::Message {
            subscriber,
            message_id,
        } => (
            first_row(conn, sql::SELECT_MESSAGE, &[subscriber, message_id]),
            message_row,
        ),
    };
    let Some(row) = row.map_err(db_error)? else {
        return Ok(Existing::Vanished);
    };
    let expired_column = match claim.id {
        IdOwned::Request { .. } => 3,
        IdOwned::Message { .. } => 1,
    };
    let expired: i64 = row.get(expired_column).map_err(db_error)?;
    if expired == 1 {
        Ok(Existing::Expired)
    } else {
        read(&row).map(Existing::Live)
    }
}

/// Takes over an expired record; `false` if another session changed it first.
fn replace_expired_blocking(conn: &Connection, claim: &ClaimOwned) -> Result<bool, DbError> {
    let statement = match &claim.id {
        IdOwned::Request {
            principal,
            operation,
            key,
        } => conn.execute(
            sql::REPLACE_EXPIRED_REQUEST,
            &[
                &clob(&claim.request),
                &claim.retention,
                principal,
                operation,
                key,
            ],
        ),
        IdOwned::Message {
            subscriber,
            message_id,
        } => conn.execute(
            sql::REPLACE_EXPIRED_MESSAGE,
            &[
                &clob(&claim.request),
                &claim.retention,
                subscriber,
                message_id,
            ],
        ),
    };
    let rows = statement.and_then(|s| s.row_count()).map_err(db_error)?;
    Ok(rows == 1)
}

/// Stores the response (requests) and commits.
fn complete_blocking(
    conn: &Connection,
    claim: &ClaimOwned,
    response: &Option<String>,
    status: Status,
) -> Result<(), DbError> {
    if let IdOwned::Request {
        principal,
        operation,
        key,
    } = &claim.id
    {
        let code = i64::from(status.code());
        let rows = conn
            .execute(
                sql::COMPLETE_REQUEST,
                &[&clob(response), &code, principal, operation, key],
            )
            .and_then(|s| s.row_count())
            .map_err(db_error)?;
        if rows != 1 {
            if expired_blocking(conn, sql::EXPIRED_REQUEST, &[principal, operation, key])? {
                return Err(expired_during_effect());
            }
            // The claim's own row is locked by this transaction; if it is not there,
            // start over in a fresh transaction (the effect is rolled back too).
            return Err(DbError::new(
                ENGINE,
                ErrorKind::Transient,
                format!("completing the claimed record updated {rows} rows"),
            ));
        }
    }
    if let IdOwned::Message {
        subscriber,
        message_id,
    } = &claim.id
        && expired_blocking(conn, sql::EXPIRED_MESSAGE, &[subscriber, message_id])?
    {
        return Err(expired_during_effect());
    }
    conn.commit().map_err(db_error)
}

/// Whether the claimed record's window ended while the effect ran.
fn expired_blocking(
    conn: &Connection,
    statement: &str,
    params: &[&dyn oracle::sql_type::ToSql],
) -> Result<bool, DbError> {
    let row = first_row(conn, statement, params).map_err(db_error)?;
    let expired: Option<i64> = row.map(|r| r.get(0)).transpose().map_err(db_error)?;
    Ok(expired == Some(1))
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

/// A claim's open transaction: the leased session (its call timeout bounded by the
/// wait), the claim's owned copy for the blocking pool, and the session's own call
/// timeout to give back.
pub struct OracleOpen {
    lease: Lease<Oracle>,
    claim: Arc<ClaimOwned>,
    previous: Option<Duration>,
}

impl fmt::Debug for OracleOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OracleOpen").finish_non_exhaustive()
    }
}

/// The claim's steps, each one call on the blocking pool; the decision tree is
/// [`idem_core::claim::run`]'s. A conflict is ORA-00001 on a plain `INSERT`. The whole
/// claim runs under a call timeout of [`Claim::wait`]: an `INSERT` still waiting for a
/// concurrent holder when it elapses is cancelled (DPI-1067), and the claim answers
/// in-flight. The connection's own call timeout is restored afterwards (the effect is
/// not bounded by it).
impl ClaimSteps for OracleBackend {
    type Open = OracleOpen;
    type Won = OracleTx;

    async fn begin(&self, claim: &Claim<'_>) -> Result<Begun<OracleOpen>, DbError> {
        let claim = Arc::new(ClaimOwned::new(claim)?);
        let mut lease = self.lease().await?;
        let wait = claim.wait;
        let previous = lease
            .run(move |c| {
                let previous = c.call_timeout().map_err(db_error)?;
                c.set_call_timeout(Some(wait)).map_err(db_error)?;
                Ok::<_, DbError>(previous)
            })
            .await?;
        Ok(Begun::Open(OracleOpen {
            lease,
            claim,
            previous,
        }))
    }

    async fn insert(&self, open: &mut OracleOpen, _claim: &Claim<'_>) -> Result<bool, DbError> {
        let claim = Arc::clone(&open.claim);
        open.lease.run(move |c| insert_blocking(c, &claim)).await
    }

    async fn reread(&self, open: &mut OracleOpen, _claim: &Claim<'_>) -> Result<Existing, DbError> {
        let claim = Arc::clone(&open.claim);
        open.lease.run(move |c| reread_blocking(c, &claim)).await
    }

    async fn replace_expired(
        &self,
        open: &mut OracleOpen,
        _claim: &Claim<'_>,
    ) -> Result<bool, DbError> {
        let claim = Arc::clone(&open.claim);
        open.lease
            .run(move |c| replace_expired_blocking(c, &claim))
            .await
    }

    async fn ready(&self, open: &mut OracleOpen, _claim: &Claim<'_>) -> Result<(), DbError> {
        let previous = open.previous;
        open.lease
            .run(move |c| c.set_call_timeout(previous).map_err(db_error))
            .await
    }

    fn won(&self, open: OracleOpen, _claim: &Claim<'_>) -> OracleTx {
        OracleTx {
            lease: open.lease,
            bound: None,
        }
    }

    async fn rollback(&self, open: OracleOpen) -> Result<(), DbError> {
        let OracleOpen {
            mut lease,
            previous,
            ..
        } = open;
        // A failed rollback leaves the transaction open: the lease then closes the
        // connection, which rolls back on the server.
        lease
            .run(move |c| {
                let restored = c.set_call_timeout(previous).map_err(db_error);
                let ended = c.rollback().map_err(db_error);
                restored.and(ended)
            })
            .await
    }

    fn waited_too_long(&self, error: &DbError) -> bool {
        is_call_timeout(error)
    }
}

/// Rolls back after a failure, keeping the failure (a failed rollback leaves the
/// transaction open, and the lease then closes the connection).
fn rollback_after(conn: &Connection, e: DbError) -> DbError {
    let _ = conn.rollback();
    e
}

impl Backend for OracleBackend {
    type Tx = OracleTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let claim = ClaimOwned::new(claim)?;
        let mut lease = self.lease().await?;
        lease.run(move |c| lookup_blocking(c, &claim)).await
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<OracleTx>, DbError> {
        claim::run(self, claim).await
    }

    async fn finish(
        &self,
        mut tx: OracleTx,
        claim: &Claim<'_>,
        end: Finish<'_>,
    ) -> Result<(), DbError> {
        let claim = ClaimOwned::new(claim)?;
        let end = match end {
            Finish::Commit { response, status } => Some((response.map(str::to_owned), status)),
            Finish::Rollback => None,
        };
        tx.lease
            .run(move |c| match end {
                None => c.rollback().map_err(db_error),
                Some((response, status)) => complete_blocking(c, &claim, &response, status)
                    .map_err(|e| rollback_after(c, e)),
            })
            .await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        error
            .downcast_ref::<oracle::Error>()
            .map(error_codes::classify)
    }
}

/// Runs one migration statement, tolerating "already exists" (see [`ALREADY_EXISTS`]).
fn execute_ddl(conn: &Connection, statement: &str) -> Result<(), DbError> {
    match conn.execute(statement, &[]) {
        Ok(_) => Ok(()),
        Err(e) if error_codes::ora_code(&e).is_some_and(|c| ALREADY_EXISTS.contains(&c)) => Ok(()),
        Err(e) => Err(db_error(e)),
    }
}

fn check_charset(conn: &Connection) -> Result<(), DbError> {
    let charset: Option<String> = first_row(conn, sql::DATABASE_CHARSET, &[])
        .and_then(|row| row.map(|r| r.get(0)).transpose())
        .map_err(db_error)?;
    match charset {
        Some(cs) if !UNICODE_CHARSETS.contains(&cs.as_str()) => Err(DbError::new(
            ENGINE,
            ErrorKind::Configuration,
            format!(
                "the database character set is {cs}: idem stores JSON as CLOB text, which \
                 needs a Unicode character set (AL32UTF8) to replay every response exactly"
            ),
        )),
        _ => Ok(()),
    }
}

fn migrate_blocking(conn: &Connection) -> Result<Vec<u32>, DbError> {
    check_charset(conn)?;
    execute_ddl(conn, sql::CREATE_MIGRATIONS)?;
    let done: Vec<u32> = conn
        .query_as::<u32>(sql::SELECT_MIGRATIONS, &[])
        .and_then(|rows| rows.collect::<oracle::Result<Vec<u32>>>())
        .map_err(db_error)?;
    let mut applied = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        for statement in m.statements() {
            execute_ddl(conn, &statement)?;
        }
        let name = m.name.to_owned();
        match conn.execute(
            sql::INSERT_MIGRATION,
            &[&m.version, &(&name, &OracleType::Varchar2(255))],
        ) {
            Ok(_) => {
                conn.commit().map_err(db_error)?;
                applied.push(m.version);
            }
            // A concurrent migrator applied and recorded it first.
            Err(e) if is_unique_violation(&e) => conn.rollback().map_err(db_error)?,
            Err(e) => return Err(db_error(e)),
        }
    }
    Ok(applied)
}

impl Maintenance for OracleBackend {
    /// Applies pending migrations, one statement per call. Oracle DDL commits on its
    /// own, so instead of one transaction each statement tolerates "already exists"
    /// (ORA-00955, ORA-01408) and the version row tolerates ORA-00001: concurrent or
    /// interrupted runs converge. Refuses a non-Unicode database character set.
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        let mut lease = self.lease().await?;
        lease
            .run(|c| migrate_blocking(c).map_err(|e| rollback_after(c, e)))
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
        let older = interval_micros(older_than);
        let mut lease = self.lease().await?;
        lease
            .run(move |c| {
                let purged = c
                    .execute(statement, &[&older, &limit])
                    .and_then(|s| s.row_count())
                    .and_then(|n| c.commit().map(|()| n));
                purged.map_err(|e| rollback_after(c, db_error(e)))
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_are_clamped_to_the_date_range() {
        assert_eq!(interval_micros(Duration::from_millis(400)), 400_000);
        assert_eq!(
            interval_micros(Duration::from_secs(24 * 3600)),
            86_400_000_000
        );
        assert_eq!(interval_micros(Duration::MAX), MAX_INTERVAL_MICROS);
        assert_eq!(
            interval_micros(Duration::from_secs(2000 * 31_557_600)),
            MAX_INTERVAL_MICROS
        );
    }

    #[test]
    fn empty_identifiers_are_refused_before_binding() {
        let e = ident_bytes("idempotency key", "").err();
        assert!(
            e.is_some_and(|e| e.message().contains("empty idempotency key")),
            "an empty key must never reach Oracle, where it would be NULL"
        );
        assert_eq!(
            ident_bytes("idempotency key", "k ").ok(),
            Some(b"k ".to_vec())
        );
    }

    #[test]
    fn migration_splits_into_single_statements() {
        let statements = MIGRATIONS[0].statements();
        assert_eq!(statements.len(), 4, "{statements:#?}");
        for s in &statements {
            assert!(!s.trim_end().ends_with(';'), "{s}");
            assert!(
                s.starts_with("CREATE TABLE") || s.starts_with("CREATE INDEX"),
                "{s}"
            );
        }
        let tables = statements.join("\n");
        for column in [
            "principal",
            "operation",
            "request_key",
            "subscriber",
            "message_id",
        ] {
            let line = tables
                .lines()
                .find(|l| l.split_whitespace().next() == Some(column))
                .unwrap_or_else(|| panic!("no column {column}"));
            assert!(line.contains("RAW(255) NOT NULL"), "{line}");
        }
        assert!(!tables.contains("VARCHAR2"), "no character key columns");
        assert!(tables.contains("DEFAULT SYS_EXTRACT_UTC(SYSTIMESTAMP)"));
    }

    /// The pool's check after every call: a call timeout left set (a claim or
    /// `Idem::start` cancelled before restoring it), or one it cannot read, makes the
    /// connection reset (cleared, rolled back) before its next use; the none a connection
    /// is opened with does not. Offline: no Oracle server here, not verified live.
    #[test]
    fn a_call_timeout_left_on_a_connection_is_reset_by_the_pool() {
        assert!(!call_timeout_left(Ok(None)));
        assert!(call_timeout_left(Ok(Some(Duration::from_millis(1)))));
        assert!(call_timeout_left(Ok(Some(call_timeout_for(
            Duration::from_secs(5)
        )))));
        let unreadable = oracle::Error::new(oracle::ErrorKind::InternalError, "no handle");
        assert!(call_timeout_left(Err(unreadable)));
    }

    #[test]
    fn wait_bounds_become_whole_millisecond_call_timeouts() {
        assert_eq!(call_timeout_for(Duration::ZERO), Duration::from_millis(1));
        assert_eq!(
            call_timeout_for(Duration::from_micros(1500)),
            Duration::from_millis(2)
        );
        assert_eq!(
            call_timeout_for(Duration::from_millis(50)),
            Duration::from_millis(50)
        );
        assert_eq!(
            call_timeout_for(Duration::MAX),
            Duration::from_millis(u64::from(u32::MAX))
        );
        let timeout = DbError::new(ENGINE, ErrorKind::Connection, "t").with_code("DPI-1067");
        assert!(is_call_timeout(&timeout));
        let cut = DbError::new(ENGINE, ErrorKind::Connection, "t").with_code("ORA-03156");
        assert!(is_call_timeout(&cut));
        let other = DbError::new(ENGINE, ErrorKind::Connection, "t").with_code("ORA-03113");
        assert!(!is_call_timeout(&other));
    }

    #[test]
    fn migration_0005_drops_the_claim_time_indexes_and_tolerates_a_rerun() {
        assert_eq!(MIGRATIONS[4].version, 5);
        let statements = MIGRATIONS[4].statements();
        assert_eq!(
            statements,
            [
                "DROP INDEX idem_request_result_created_at",
                "DROP INDEX idem_processed_message_at"
            ]
        );
        // The names 0001 created.
        for name in [
            "idem_request_result_created_at",
            "idem_processed_message_at",
        ] {
            assert!(
                MIGRATIONS[0]
                    .sql
                    .contains(&format!("CREATE INDEX {name} ON")),
                "{name}"
            );
        }
        assert!(ALREADY_EXISTS.contains(&error_codes::INDEX_DOES_NOT_EXIST));
    }

    #[test]
    fn migration_0003_creates_runs_and_the_outbox() {
        assert_eq!(MIGRATIONS.len(), 5);
        assert_eq!(MIGRATIONS[2].version, 3);
        let statements = MIGRATIONS[2].statements();
        assert_eq!(statements.len(), 6, "{statements:#?}");
        for s in &statements {
            assert!(!s.trim_end().ends_with(';'), "{s}");
            assert!(
                s.starts_with("CREATE TABLE") || s.starts_with("CREATE INDEX"),
                "{s}"
            );
            for line in s.lines() {
                // Oracle names before 12.2 are at most 30 bytes.
                if let Some(name) = line.trim().strip_prefix("CONSTRAINT ") {
                    let name = name.split_whitespace().next().unwrap_or("");
                    assert!(name.len() <= 30, "{name}");
                }
            }
        }
        let tables = statements.join("\n");
        for column in [
            "principal",
            "operation",
            "request_key",
            "destination",
            "message_id",
        ] {
            let line = tables
                .lines()
                .find(|l| l.split_whitespace().next() == Some(column))
                .unwrap_or_else(|| panic!("no column {column}"));
            assert!(line.contains("RAW(255) NOT NULL"), "{line}");
        }
        assert!(tables.contains("GENERATED ALWAYS AS IDENTITY"));
    }

    /// No Oracle Client library on this machine: `connect` fails at once, classified,
    /// with the install hint. On a machine with a client, nothing listens on port 1, so
    /// it fails with a classified connection error instead. Neither pretends that a
    /// server answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_without_a_server_fails_fast_and_classified() {
        let out = tokio::time::timeout(
            Duration::from_secs(60),
            OracleBackend::connect("oracle://u:s3cret-pw@127.0.0.1:1/FREEPDB1"),
        )
        .await;
        let err = match out {
            Ok(Err(e)) => e,
            Ok(Ok(b)) => panic!("a server answered on 127.0.0.1:1: {b:?}"),
            Err(_) => panic!("connect did not fail within 60 s"),
        };
        let text = err.to_string();
        assert!(!text.contains("s3cret-pw"), "the password leaked: {text}");
        assert_eq!(err.engine(), "oracle");
        match err.kind() {
            ErrorKind::ClientLibraryMissing => {
                assert_eq!(err.code(), Some("DPI-1047"), "{text}");
                assert!(
                    text.contains("Instant Client Basic or Basic Light"),
                    "{text}"
                );
                assert!(
                    text.contains("LD_LIBRARY_PATH") && text.contains("ldconfig"),
                    "{text}"
                );
                let source = StdError::source(&err)
                    .and_then(|s| s.downcast_ref::<oracle::Error>())
                    .map(error_codes::classify);
                assert_eq!(source, Some(ErrorKind::ClientLibraryMissing));
                eprintln!("no Oracle Client here, as expected: {text}");
            }
            ErrorKind::Connection => {
                assert!(err.code().is_some_and(|c| c.starts_with("ORA-")), "{text}");
                assert!(text.contains("127.0.0.1:1/FREEPDB1"), "{text}");
                eprintln!("an Oracle Client exists here; no listener, as expected: {text}");
            }
            other => panic!("expected ClientLibraryMissing or Connection, got {other}: {text}"),
        }
    }

    /// `Backend::classify` finds a driver error inside an effect's error chain.
    #[test]
    #[allow(deprecated)]
    fn classify_downcasts_driver_errors() {
        #[derive(Debug)]
        struct Wrapper(oracle::Error);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "effect failed")
            }
        }
        impl StdError for Wrapper {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let deadlock = oracle::Error::OciError(oracle::DbError::new(
            60,
            0,
            "ORA-00060: deadlock detected while waiting for resource",
            "dpiStmt_execute",
            "execute",
        ));
        // No connection is opened: classification needs none.
        let backend =
            OracleBackend::unconnected(ConnectOptions::new("u", "p", "h:1/svc")).expect("pool");
        let wrapped = Wrapper(deadlock);
        let err: &(dyn StdError + 'static) = &wrapped;
        let kinds: Vec<Option<ErrorKind>> = std::iter::successors(Some(err), |e| (*e).source())
            .map(|e| backend.classify(e))
            .collect();
        assert_eq!(kinds, vec![None, Some(ErrorKind::Deadlock)]);
        let serialization = oracle::Error::OciError(oracle::DbError::new(
            8177,
            0,
            "ORA-08177: can't serialize access for this transaction",
            "dpiStmt_execute",
            "execute",
        ));
        assert_eq!(
            backend.classify(&serialization),
            Some(ErrorKind::SerializationFailure)
        );
        let not_oracle = std::io::Error::other("x");
        assert_eq!(backend.classify(&not_oracle), None);
    }
}
