//! Phased runs and the transactional outbox: statements and transactions only (the
//! protocol is idem-core's).
//!
//! A run transaction is a plain READ COMMITTED transaction from the pool (the session's
//! isolation, as the claim uses). With a wait bound, `lock_timeout` is set for this
//! transaction only (`SET LOCAL lock_timeout`, sent with `BEGIN` in one message; on
//! Citus a message of its own, passed on to the workers), so a row lock held longer
//! than the bound fails with SQLSTATE 55P03 ([`ErrorKind::LockTimeout`]) and the
//! session keeps its own value afterwards. The relay's claim reads with
//! `FOR UPDATE SKIP LOCKED`; `pending_ids` is a plain read that sees every pending row.
//! The database clock of these statements is `statement_timestamp()` (STABLE), so they
//! stay valid on Citus (see `sql.rs`).

use std::time::Duration;

use idem_core::outbox::Outgoing;
use idem_core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxRow, OutboxStats, RunGuard, RunProbe, RunRow,
    RunWrite, StalledRow,
};
use idem_core::{DbError, Key, OutboxStore, RunStore, Scope, Status};

use crate::{PgBackend, PgTx, db_error, secs, sql, tx};

type RunColumns = (
    String,
    String,
    i64,
    String,
    Option<String>,
    Option<i16>,
    Option<String>,
    bool,
    bool,
);

impl RunStore for PgBackend {
    async fn begin_runs(&self, wait: Option<Duration>) -> Result<PgTx, DbError> {
        match wait {
            Some(wait) => {
                let conn = tx::checkout(self.pool()).await?;
                self.begin_bounded_on(conn, wait, sql::begin_bounded).await
            }
            None => {
                let conn = tx::checkout(self.pool()).await?;
                PgTx::open(conn, None).await
            }
        }
    }

    async fn commit_runs(&self, tx: PgTx) -> Result<(), DbError> {
        tx.commit().await
    }

    async fn rollback_runs(&self, tx: PgTx) -> Result<(), DbError> {
        // A failed rollback closes the connection, which rolls back on the server.
        tx.rollback().await
    }

    async fn insert_run(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        let inserted = sqlx::query(sql::INSERT_RUN)
            .bind(scope.principal.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .bind(run.request)
            .bind(run.owner)
            .bind(run.fence)
            .bind(run.point)
            .bind(secs(run.lease))
            .bind(secs(run.retention))
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(inserted.rows_affected() == 1)
    }

    async fn read_run(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        let row: Option<RunColumns> = sqlx::query_as(sql::SELECT_RUN)
            .bind(scope.principal.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
        let Some((request, owner, fence, point, state, status, response, lease_over, expired)) =
            row
        else {
            return Ok(None);
        };
        Ok(Some(RunRow {
            request,
            owner,
            fence,
            point,
            state,
            status: status
                .map(|code| Status::from_code(i64::from(code)))
                .transpose()?,
            response,
            lease_over,
            expired,
        }))
    }

    async fn write_run(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        key: &Key,
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        let written = sqlx::query(sql::WRITE_RUN)
            .bind(scope.principal.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .bind(expected.owner)
            .bind(write.owner)
            .bind(write.fence)
            .bind(write.point)
            .bind(write.state)
            .bind(write.status.map(Status::code))
            .bind(write.response)
            .bind(secs(write.lease))
            .bind(expected.fence)
            .bind(expected.point)
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(written.rows_affected() == 1)
    }

    async fn renew_lease(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        let renewed = sqlx::query(sql::RENEW_LEASE)
            .bind(scope.principal.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .bind(owner)
            .bind(fence)
            .bind(secs(lease))
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(renewed.rows_affected() == 1)
    }

    async fn probe_run(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<RunProbe, DbError> {
        let run = |q| {
            sqlx::query_scalar::<_, i32>(q)
                .bind(scope.principal.as_str())
                .bind(scope.operation.as_str())
                .bind(key.as_str())
        };
        let free = run(sql::PROBE_RUN_LOCK)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
        if free.is_some() {
            return Ok(RunProbe::Free);
        }
        let exists = run(sql::PROBE_RUN_EXISTS)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(if exists.is_some() {
            RunProbe::Held
        } else {
            RunProbe::Free
        })
    }

    async fn delete_run(
        &self,
        tx: &mut PgTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        let deleted = sqlx::query(sql::DELETE_RUN)
            .bind(scope.principal.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .bind(expected)
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(deleted.rows_affected() == 1)
    }

    async fn stalled_runs(&self, limit: u32) -> Result<Vec<StalledRow>, DbError> {
        let rows: Vec<(String, String, String, String)> = sqlx::query_as(sql::STALLED_RUNS)
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await
            .map_err(db_error)?;
        Ok(rows
            .into_iter()
            .map(|(principal, operation, key, point)| StalledRow {
                principal,
                operation,
                key,
                point,
            })
            .collect())
    }
}

impl OutboxStore for PgBackend {
    async fn enqueue(&self, tx: &mut PgTx, message: &Outgoing) -> Result<(), DbError> {
        sqlx::query(sql::ENQUEUE)
            .bind(message.destination())
            .bind(message.message_id())
            .bind(message.payload())
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn lock_due(&self, tx: &mut PgTx, limit: u32) -> Result<Vec<DueRow>, DbError> {
        let rows: Vec<(i64, String, String, String, i64)> = sqlx::query_as(sql::LOCK_DUE)
            .bind(i64::from(limit))
            .fetch_all(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(rows
            .into_iter()
            .map(|(id, destination, message_id, payload, attempts)| DueRow {
                row: OutboxRow {
                    id,
                    destination,
                    message_id,
                    payload,
                },
                attempts,
            })
            .collect())
    }

    async fn pending_ids(
        &self,
        tx: &mut PgTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        sqlx::query_scalar(sql::PENDING_IDS)
            .bind(destination)
            .bind(up_to)
            .fetch_all(&mut **tx)
            .await
            .map_err(db_error)
    }

    async fn claim_due(
        &self,
        tx: &mut PgTx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        sqlx::query(sql::CLAIM_DUE)
            .bind(token)
            .bind(secs(lease))
            .bind(ids)
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn release(&self, tx: &mut PgTx, ids: &[i64], token: &str) -> Result<(), DbError> {
        sqlx::query(sql::RELEASE)
            .bind(token)
            .bind(ids)
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn mark_sent(&self, tx: &mut PgTx, ids: &[i64], token: &str) -> Result<u64, DbError> {
        sqlx::query(sql::MARK_SENT)
            .bind(token)
            .bind(ids)
            .execute(&mut **tx)
            .await
            .map(|r| r.rows_affected())
            .map_err(db_error)
    }

    async fn record_failure(
        &self,
        tx: &mut PgTx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> Result<bool, DbError> {
        let done = match retry_in {
            Some(delay) => {
                sqlx::query(sql::RETRY_LATER)
                    .bind(error)
                    .bind(secs(delay))
                    .bind(id)
                    .bind(token)
                    .execute(&mut **tx)
                    .await
            }
            None => {
                sqlx::query(sql::BURY)
                    .bind(error)
                    .bind(id)
                    .bind(token)
                    .execute(&mut **tx)
                    .await
            }
        };
        done.map(|r| r.rows_affected() == 1).map_err(db_error)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        let (pending, dead, oldest): (i64, i64, Option<i64>) = sqlx::query_as(sql::OUTBOX_STATS)
            .fetch_one(self.pool())
            .await
            .map_err(db_error)?;
        Ok(OutboxStats {
            pending: u64::try_from(pending).unwrap_or(0),
            dead: u64::try_from(dead).unwrap_or(0),
            oldest_pending_age: oldest.map(duration_of),
        })
    }

    async fn list_outbox(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        type Columns = (
            i64,
            String,
            String,
            i64,
            bool,
            Option<String>,
            i64,
            Option<i64>,
            bool,
        );
        let rows: Vec<Columns> = sqlx::query_as(sql::LIST_OUTBOX)
            .bind(filter.state.code())
            .bind(filter.destination.as_deref())
            .bind(filter.after_id)
            .bind(i64::from(filter.limit))
            .fetch_all(self.pool())
            .await
            .map_err(db_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(id, destination, message_id, attempts, dead, last_error, age, next, claimed)| {
                    OutboxEntry {
                        id,
                        destination,
                        message_id,
                        attempts,
                        dead,
                        last_error,
                        age: duration_of(age),
                        next_attempt_in: next.map(duration_of),
                        claimed,
                    }
                },
            )
            .collect())
    }

    async fn retry_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        let done = if ids.is_empty() {
            sqlx::query(sql::RETRY_DEAD)
                .bind(destination)
                .execute(self.pool())
                .await
        } else {
            sqlx::query(sql::RETRY_IDS)
                .bind(ids)
                .execute(self.pool())
                .await
        };
        done.map(|r| r.rows_affected()).map_err(db_error)
    }

    async fn drop_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        let done = if ids.is_empty() {
            sqlx::query(sql::DROP_DEAD)
                .bind(destination)
                .execute(self.pool())
                .await
        } else {
            sqlx::query(sql::DROP_IDS)
                .bind(ids)
                .execute(self.pool())
                .await
        };
        done.map(|r| r.rows_affected()).map_err(db_error)
    }
}

/// A span of microseconds from the database clock; a negative one is zero.
fn duration_of(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}
