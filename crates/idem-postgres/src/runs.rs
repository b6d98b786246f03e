//! Phased runs and the transactional outbox: statements and transactions only (the
//! protocol is idem-core's).
//!
//! A run transaction is a plain READ COMMITTED transaction from the pool (the session's
//! isolation, as the claim uses). With a wait bound, `lock_timeout` is set for this
//! transaction only (`set_config('lock_timeout', …, true)`), so a row lock held longer
//! than the bound fails with SQLSTATE 55P03 ([`ErrorKind::LockTimeout`]) and the
//! session keeps its own value afterwards. The outbox drain reads with
//! `FOR UPDATE SKIP LOCKED`; `unsent_ids` is a plain read that sees every unsent row.

use std::time::Duration;

use idem_core::outbox::Outgoing;
use idem_core::runs::{NewRun, OutboxRow, RunRow, RunWrite, StalledRow};
use idem_core::{DbError, Key, OutboxStore, RunStore, Scope, Status};

use crate::{PgBackend, PgTx, db_error, lock_timeout, secs, sql};

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
        let mut tx = self.pool().begin().await.map_err(db_error)?;
        if let Some(wait) = wait {
            let bound = sqlx::query(sql::BOUND_LOCK_TIMEOUT)
                .bind(lock_timeout(wait))
                .execute(&mut *tx)
                .await;
            if let Err(e) = bound {
                let _ = tx.rollback().await;
                return Err(db_error(e));
            }
        }
        Ok(tx)
    }

    async fn commit_runs(&self, tx: PgTx) -> Result<(), DbError> {
        tx.commit().await.map_err(db_error)
    }

    async fn rollback_runs(&self, tx: PgTx) -> Result<(), DbError> {
        // A failed rollback closes the connection, which rolls back on the server.
        tx.rollback().await.map_err(db_error)
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
        expected: &str,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        let written = sqlx::query(sql::WRITE_RUN)
            .bind(scope.principal.as_str())
            .bind(scope.operation.as_str())
            .bind(key.as_str())
            .bind(expected)
            .bind(write.owner)
            .bind(write.fence)
            .bind(write.point)
            .bind(write.state)
            .bind(write.status.map(Status::code))
            .bind(write.response)
            .bind(secs(write.lease))
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(written.rows_affected() == 1)
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

    async fn lock_unsent(&self, tx: &mut PgTx, limit: u32) -> Result<Vec<OutboxRow>, DbError> {
        let rows: Vec<(i64, String, String, String)> = sqlx::query_as(sql::LOCK_UNSENT)
            .bind(i64::from(limit))
            .fetch_all(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(rows
            .into_iter()
            .map(|(id, destination, message_id, payload)| OutboxRow {
                id,
                destination,
                message_id,
                payload,
            })
            .collect())
    }

    async fn unsent_ids(
        &self,
        tx: &mut PgTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        sqlx::query_scalar(sql::UNSENT_IDS)
            .bind(destination)
            .bind(up_to)
            .fetch_all(&mut **tx)
            .await
            .map_err(db_error)
    }

    async fn mark_sent(&self, tx: &mut PgTx, ids: &[i64]) -> Result<(), DbError> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(sql::MARK_SENT)
            .bind(ids)
            .execute(&mut **tx)
            .await
            .map(drop)
            .map_err(db_error)
    }
}
