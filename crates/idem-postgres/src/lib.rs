//! PostgreSQL backend for idem, on [sqlx](https://docs.rs/sqlx).
//!
//! The claim is the seed's: `INSERT … ON CONFLICT DO NOTHING` inside the effect's
//! transaction, then a **separate** `SELECT` when nothing was inserted. A conflicting
//! insert waits for the other transaction; under READ COMMITTED the row it committed may
//! be invisible to the INSERT's snapshot, but the next statement sees it. The winner's
//! placeholder (response `NULL`) exists only inside its transaction; it is completed
//! with the response just before `COMMIT`.
//!
//! Under REPEATABLE READ or SERIALIZABLE the waiting loser gets SQLSTATE 40001 instead;
//! idem retries the whole transaction with the same key (40001 and 40P01, bounded,
//! jittered). CockroachDB and YugabyteDB speak this protocol and are serializable by
//! default, so they take that path (not tested here).
//!
//! Effects receive a [`PgTx`] (`sqlx::Transaction`) and run their SQL on it:
//! `sqlx::query("UPDATE …").execute(&mut **tx)`.

pub mod error_codes;
mod sql;

use std::error::Error as StdError;
use std::str::FromStr;
use std::time::Duration;

use idem_core::{
    Backend, Claim, Claimed, DbError, ErrorKind, Finish, Identity, Maintenance, Migration, Status,
    Stored, Table,
};
pub use sqlx;
use sqlx::postgres::PgConnection;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, Postgres, Row};

pub use error_codes::db_error;

/// The transaction handed to effects.
pub type PgTx = sqlx::Transaction<'static, Postgres>;

/// The migrations embedded from `migrations/postgres/`.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_idempotency_records.sql",
    sql: include_str!("../../../migrations/postgres/0001_idempotency_records.sql"),
}];

/// How often a claim re-tries inside one transaction when the conflicting record
/// vanished (purged) or was replaced under it.
const CLAIM_ROUNDS: usize = 3;

/// An idem backend on a PostgreSQL pool.
#[derive(Debug, Clone)]
pub struct PgBackend {
    pool: PgPool,
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
    /// trip per call. A pool built with `PgPoolOptions::test_before_acquire(false)` and
    /// passed to [`PgBackend::from_pool`] saves it (measured in `docs/performance.md`);
    /// sqlx still pings every returned connection, which sends the `ROLLBACK` a dropped
    /// transaction queued, and closes the connection if that fails.
    pub async fn connect_with(
        options: PgConnectOptions,
        max_connections: u32,
    ) -> Result<Self, DbError> {
        let probe = PgConnection::connect_with(&options)
            .await
            .map_err(db_error)?;
        probe.close().await.map_err(db_error)?;
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map(Self::from_pool)
            .map_err(db_error)
    }

    /// Uses an existing pool.
    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
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

impl Backend for PgBackend {
    type Tx = PgTx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        let retention = secs(claim.retention);
        match claim.id {
            Identity::Request { scope, key } => {
                let row = sqlx::query(sql::LOOKUP_REQUEST)
                    .bind(scope.principal.as_str())
                    .bind(scope.operation.as_str())
                    .bind(key.as_str())
                    .bind(retention)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(db_error)?;
                row.as_ref().map(stored_request).transpose()
            }
            Identity::Message {
                subscriber,
                message_id,
            } => {
                let row = sqlx::query(sql::LOOKUP_MESSAGE)
                    .bind(subscriber.as_str())
                    .bind(message_id.as_str())
                    .bind(retention)
                    .fetch_optional(&self.pool)
                    .await
                    .map_err(db_error)?;
                row.map(|r| {
                    Ok(Stored {
                        request: r.try_get(0).map_err(db_error)?,
                        response: None,
                        status: Status::Succeeded,
                    })
                })
                .transpose()
            }
        }
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<PgTx>, DbError> {
        let mut tx = self.pool.begin().await.map_err(db_error)?;
        let retention = secs(claim.retention);
        for _ in 0..CLAIM_ROUNDS {
            let (inserted, found) = match claim.id {
                Identity::Request { scope, key } => {
                    let (p, o, k) = (
                        scope.principal.as_str(),
                        scope.operation.as_str(),
                        key.as_str(),
                    );
                    let inserted = sqlx::query(sql::INSERT_REQUEST)
                        .bind(p)
                        .bind(o)
                        .bind(k)
                        .bind(claim.request)
                        .execute(&mut *tx)
                        .await
                        .map_err(db_error)?
                        .rows_affected();
                    if inserted == 1 {
                        return Ok(Claimed::Won(tx));
                    }
                    let row = sqlx::query(sql::SELECT_REQUEST)
                        .bind(p)
                        .bind(o)
                        .bind(k)
                        .bind(retention)
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(db_error)?;
                    let found = match row {
                        None => None,
                        Some(row) => Some((
                            row.try_get::<bool, _>(3).map_err(db_error)?,
                            stored_request(&row)?,
                        )),
                    };
                    if let Some((true, _)) = found {
                        let replaced = sqlx::query(sql::REPLACE_EXPIRED_REQUEST)
                            .bind(p)
                            .bind(o)
                            .bind(k)
                            .bind(claim.request)
                            .bind(retention)
                            .execute(&mut *tx)
                            .await
                            .map_err(db_error)?
                            .rows_affected();
                        (replaced, None)
                    } else {
                        (0, found.map(|(_, s)| s))
                    }
                }
                Identity::Message {
                    subscriber,
                    message_id,
                } => {
                    let (s, m) = (subscriber.as_str(), message_id.as_str());
                    let inserted = sqlx::query(sql::INSERT_MESSAGE)
                        .bind(s)
                        .bind(m)
                        .bind(claim.request)
                        .execute(&mut *tx)
                        .await
                        .map_err(db_error)?
                        .rows_affected();
                    if inserted == 1 {
                        return Ok(Claimed::Won(tx));
                    }
                    let row = sqlx::query(sql::SELECT_MESSAGE)
                        .bind(s)
                        .bind(m)
                        .bind(retention)
                        .fetch_optional(&mut *tx)
                        .await
                        .map_err(db_error)?;
                    match row {
                        Some(row) if row.try_get::<bool, _>(1).map_err(db_error)? => {
                            let replaced = sqlx::query(sql::REPLACE_EXPIRED_MESSAGE)
                                .bind(s)
                                .bind(m)
                                .bind(claim.request)
                                .bind(retention)
                                .execute(&mut *tx)
                                .await
                                .map_err(db_error)?
                                .rows_affected();
                            (replaced, None)
                        }
                        Some(row) => (
                            0,
                            Some(Stored {
                                request: row.try_get(0).map_err(db_error)?,
                                response: None,
                                status: Status::Succeeded,
                            }),
                        ),
                        None => (0, None),
                    }
                }
            };
            if inserted == 1 {
                return Ok(Claimed::Won(tx));
            }
            if let Some(stored) = found {
                tx.rollback().await.map_err(db_error)?;
                return Ok(Claimed::Found(stored));
            }
            // The conflicting record vanished or was replaced between statements: claim again.
        }
        tx.rollback().await.map_err(db_error)?;
        Err(DbError::new(
            "postgres",
            ErrorKind::Transient,
            "the conflicting record kept changing during the claim",
        ))
    }

    async fn finish(
        &self,
        mut tx: PgTx,
        claim: &Claim<'_>,
        end: Finish<'_>,
    ) -> Result<(), DbError> {
        match end {
            Finish::Rollback => tx.rollback().await.map_err(db_error),
            Finish::Commit { response, status } => {
                if let Identity::Request { scope, key } = claim.id {
                    sqlx::query(sql::COMPLETE_REQUEST)
                        .bind(scope.principal.as_str())
                        .bind(scope.operation.as_str())
                        .bind(key.as_str())
                        .bind(response)
                        .bind(status.code())
                        .execute(&mut *tx)
                        .await
                        .map_err(db_error)?;
                }
                tx.commit().await.map_err(db_error)
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
            sqlx::raw_sql(m.sql)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
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
        let statement = match table {
            Table::Requests => sql::PURGE_REQUESTS,
            Table::Messages => sql::PURGE_MESSAGES,
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
