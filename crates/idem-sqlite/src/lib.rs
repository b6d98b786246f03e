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
//! - rusqlite is blocking: every call runs on tokio's blocking pool
//!   ([`tokio::task::spawn_blocking`]), never on the async worker threads. Effects get
//!   a [`SqliteTx`] and run their SQL with [`SqliteTx::run`].
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
mod sql;

use std::error::Error as StdError;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idem_core::blocking::{BlockingPool, Lease, Manager};
use idem_core::{
    Backend, Claim, Claimed, DbError, ErrorKind, Finish, Identity, Maintenance, Migration, Status,
    Stored, Table,
};
pub use rusqlite;
use rusqlite::{Connection, OptionalExtension, params};

pub use error_codes::db_error;

/// The migrations embedded from `migrations/sqlite/`.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_idempotency_records.sql",
    sql: include_str!("../../../migrations/sqlite/0001_idempotency_records.sql"),
}];

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
                format!("invalid SQLite URL {url:?}: {why}"),
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

/// What the pool needs to open connections, and SQLite's hooks for it.
struct Sqlite {
    location: Location,
    busy_timeout: Duration,
}

impl Manager for Sqlite {
    type Connection = Connection;
    const ENGINE: &'static str = ENGINE;

    fn open(&self) -> Result<Connection, DbError> {
        open_connection(&self.location, self.busy_timeout)
    }

    fn in_transaction(&self, conn: &Connection) -> bool {
        !conn.is_autocommit()
    }

    // `reset` keeps its default: a connection left inside a transaction (a cancelled
    // future) is closed, which rolls it back, instead of going back to the pool.
}

/// An idem backend on one SQLite database, with a small pool of connections.
#[derive(Clone)]
pub struct SqliteBackend {
    pool: BlockingPool<Sqlite>,
}

impl fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let manager = self.pool.manager();
        f.debug_struct("SqliteBackend")
            .field("location", &manager.location)
            .field("busy_timeout", &manager.busy_timeout)
            .finish_non_exhaustive()
    }
}

impl SqliteBackend {
    /// Connects by URL (see [`Location::parse`]).
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        Self::open(Location::parse(url)?).await
    }

    /// Opens a database with up to 16 connections (one for `Memory`) and a 5 s busy
    /// timeout.
    pub async fn open(location: Location) -> Result<Self, DbError> {
        Self::open_with(location, 16, Duration::from_secs(5)).await
    }

    /// Opens a database with `max_connections` (forced to 1 in memory) and a busy timeout.
    pub async fn open_with(
        location: Location,
        max_connections: usize,
        busy_timeout: Duration,
    ) -> Result<Self, DbError> {
        let max = if location == Location::Memory {
            1
        } else {
            max_connections.max(1)
        };
        let manager = Sqlite {
            location,
            busy_timeout,
        };
        let backend = Self {
            pool: BlockingPool::new(manager, max),
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
    pub async fn interact<T, F>(&self, f: F) -> Result<T, DbError>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let mut lease = self.lease().await?;
        lease.run(move |c| f(c).map_err(db_error)).await
    }

    async fn lease(&self) -> Result<Lease<Sqlite>, DbError> {
        self.pool.lease().await
    }
}

fn open_connection(location: &Location, busy_timeout: Duration) -> Result<Connection, DbError> {
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
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(db_error)?;
    }
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(db_error)?;
    Ok(conn)
}

/// The open `BEGIN IMMEDIATE` transaction handed to effects.
pub struct SqliteTx {
    lease: Lease<Sqlite>,
}

impl fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTx").finish_non_exhaustive()
    }
}

impl SqliteTx {
    /// Runs `f` on the transaction's connection, on tokio's blocking pool. Everything
    /// `f` writes commits or rolls back with the idempotency record.
    pub async fn run<T, F>(&mut self, f: F) -> T
    where
        F: FnOnce(&Connection) -> T + Send + 'static,
        T: Send + 'static,
    {
        self.lease.run(f).await
    }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn read_record(conn: &Connection, claim: &ClaimOwned) -> Result<Option<Stored>, DbError> {
    let retention = micros(claim.retention);
    match &claim.id {
        IdOwned::Request {
            principal,
            operation,
            key,
        } => conn
            .prepare_cached(sql::SELECT_REQUEST)
            .map_err(db_error)?
            .query_row(params![principal, operation, key, retention], |r| {
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
            .query_row(params![subscriber, message_id, retention], |r| {
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

#[derive(Clone)]
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

impl Backend for SqliteBackend {
    type Tx = SqliteTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let claim = ClaimOwned::from(claim);
        let mut lease = self.lease().await?;
        lease.run(move |c| read_record(c, &claim)).await
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<SqliteTx>, DbError> {
        let claim = ClaimOwned::from(claim);
        let mut lease = self.lease().await?;
        let found = lease
            .run(move |c| -> Result<Option<Stored>, DbError> {
                c.execute_batch(sql::BEGIN_IMMEDIATE).map_err(db_error)?;
                match read_record(c, &claim) {
                    Ok(None) => Ok(None),
                    Ok(Some(stored)) => {
                        c.execute_batch(sql::ROLLBACK).map_err(db_error)?;
                        Ok(Some(stored))
                    }
                    Err(e) => {
                        let _ = c.execute_batch(sql::ROLLBACK);
                        Err(e)
                    }
                }
            })
            .await?;
        Ok(match found {
            Some(stored) => Claimed::Found(stored),
            None => Claimed::Won(SqliteTx { lease }),
        })
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
                            status
                        ])
                    }),
                    IdOwned::Message {
                        subscriber,
                        message_id,
                    } => c.prepare_cached(sql::UPSERT_MESSAGE).and_then(|mut s| {
                        s.execute(params![subscriber, message_id, claim.request])
                    }),
                };
                match written.and_then(|_| c.execute_batch(sql::COMMIT)) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        if !c.is_autocommit() {
                            let _ = c.execute_batch(sql::ROLLBACK);
                        }
                        Err(db_error(e))
                    }
                }
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
