//! Phased runs and the transactional outbox on MySQL/MariaDB: statements and
//! transactions only (the protocol is idem-core's [`idem_core::Run`] and
//! [`idem_core::Idem::relay`]).
//!
//! - **Isolation: READ COMMITTED.** [`RunStore::begin_runs`] starts its transaction with
//!   `SET TRANSACTION ISOLATION LEVEL READ COMMITTED` (the next transaction only; the
//!   claim keeps the session's level). Two reasons: the relay's plain read of unsent ids
//!   must see the rows committed *by then* (under REPEATABLE READ it would read the
//!   snapshot of the transaction's first plain read), and READ COMMITTED locking reads
//!   take no gap locks, so a relay's `FOR UPDATE SKIP LOCKED` never makes producers'
//!   `INSERT`s into the outbox wait. A phase's effect runs under it too. (With
//!   `binlog_format=STATEMENT` the server refuses READ COMMITTED writes, error 1665: use
//!   ROW or MIXED, the defaults.)
//! - **Bounded waits.** With a wait bound the session's `innodb_lock_wait_timeout` is
//!   saved and set to it (whole seconds, rounded up, at least 1: the server's unit and
//!   minimum), and restored just before `COMMIT` or `ROLLBACK`. A lock wait that runs
//!   out is error 1205, [`ErrorKind::LockTimeout`].
//! - **A new run** is a plain `INSERT`; a committed duplicate is error 1062, answered as
//!   `false` (the claim's rule).
//! - **The guarded write counts matched rows**: the server reports changed rows (no
//!   `CLIENT_FOUND_ROWS`), so the write always moves `updated_at` forward.
//! - **A transaction lost inside a phase** (a deadlock 1213 the effect swallowed: the
//!   server rolled everything back and runs later statements in autocommit) is refused
//!   before the run's guarded write and before `COMMIT`, from the server's
//!   "in transaction" status flag.

use std::time::Duration;

use idem_core::runs::{NewRun, OutboxRow, RunRow, RunWrite, StalledRow};
use idem_core::{DbError, ErrorKind, Key, OutboxStore, Outgoing, RunStore, Scope, Status};
use mysql_async::prelude::Queryable;
use mysql_async::{IsolationLevel, Row, Transaction, TxOpts, Value};

use crate::{
    ENGINE, MysqlBackend, MysqlTx, db_error, in_transaction, is_duplicate, lock_wait_secs, sql,
    take, window_micros,
};

/// The run's key columns, as bytes.
fn key_values(scope: &Scope, key: &Key) -> [Value; 3] {
    [
        scope.principal.as_str().as_bytes().into(),
        scope.operation.as_str().as_bytes().into(),
        key.as_str().as_bytes().into(),
    ]
}

/// The error when a run's transaction ended under it (see the module documentation).
fn lost_run_transaction() -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Other,
        "the run's transaction ended before its write (a deadlock 1213 the phase's effect \
         swallowed, or COMMIT, ROLLBACK or DDL run by the effect); nothing of the phase is \
         recorded, and what the effect wrote after the rollback may have autocommitted",
    )
}

/// Fails unless the session is still inside the transaction. The last OK packet's
/// status flags answer without a round trip; after an error (which carries no flags)
/// the server is asked with a no-op.
async fn still_open(tx: &mut Transaction<'static>) -> Result<(), DbError> {
    if in_transaction(tx) {
        return Ok(());
    }
    tx.query_drop(sql::STATUS_PROBE).await.map_err(db_error)?;
    if in_transaction(tx) {
        Ok(())
    } else {
        Err(lost_run_transaction())
    }
}

/// Gives the session its own `innodb_lock_wait_timeout` back, if `begin_runs` bounded
/// it.
async fn restore(tx: &mut MysqlTx) -> Result<(), DbError> {
    if !tx.restore_lock_wait {
        return Ok(());
    }
    tx.tx
        .query_drop(sql::RESTORE_LOCK_WAIT)
        .await
        .map_err(db_error)?;
    tx.restore_lock_wait = false;
    Ok(())
}

fn run_row(mut row: Row) -> Result<RunRow, DbError> {
    let status: Option<i64> = take(&mut row, 5, "status")?;
    let lease_over: i64 = take(&mut row, 7, "lease_over")?;
    let expired: i64 = take(&mut row, 8, "expired")?;
    Ok(RunRow {
        request: take(&mut row, 0, "request")?,
        owner: take(&mut row, 1, "owner")?,
        fence: take(&mut row, 2, "fence")?,
        point: take(&mut row, 3, "point")?,
        state: take(&mut row, 4, "state")?,
        status: status.map(Status::from_code).transpose()?,
        response: take(&mut row, 6, "response")?,
        lease_over: lease_over != 0,
        expired: expired != 0,
    })
}

impl RunStore for MysqlBackend {
    async fn begin_runs(&self, wait: Option<Duration>) -> Result<MysqlTx, DbError> {
        let mut opts = TxOpts::new();
        opts.with_isolation_level(IsolationLevel::ReadCommitted);
        let tx = tokio::time::timeout(self.acquire_timeout, self.pool.start_transaction(opts))
            .await
            .map_err(|_| self.acquire_timed_out())?
            .map_err(db_error)?;
        let mut tx = MysqlTx {
            tx,
            restore_lock_wait: false,
        };
        if let Some(wait) = wait {
            let bound = format!("{}{}", sql::SET_LOCK_WAIT, lock_wait_secs(wait));
            if let Err(e) = tx.tx.query_drop(bound).await {
                // A failed ROLLBACK drops the connection.
                let _ = tx.tx.rollback().await;
                return Err(db_error(e));
            }
            tx.restore_lock_wait = true;
        }
        Ok(tx)
    }

    async fn commit_runs(&self, mut tx: MysqlTx) -> Result<(), DbError> {
        let ready = match restore(&mut tx).await {
            Ok(()) => still_open(&mut tx.tx).await,
            Err(e) => Err(e),
        };
        if let Err(e) = ready {
            let _ = tx.tx.rollback().await;
            return Err(e);
        }
        tx.tx.commit().await.map_err(db_error)
    }

    async fn rollback_runs(&self, mut tx: MysqlTx) -> Result<(), DbError> {
        let restored = restore(&mut tx).await;
        // A failed ROLLBACK drops the connection.
        let ended = tx.tx.rollback().await.map_err(db_error);
        restored.and(ended)
    }

    async fn insert_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        self.check_packet("request", Some(run.request)).await?;
        let mut params: Vec<Value> = key_values(scope, key).into();
        params.extend([
            run.request.into(),
            run.owner.into(),
            run.fence.into(),
            run.point.into(),
            window_micros(run.lease).into(),
            window_micros(run.retention).into(),
        ]);
        match tx.tx.exec_drop(sql::INSERT_RUN, params).await {
            Ok(()) => Ok(true),
            Err(e) if is_duplicate(&e) => Ok(false),
            Err(e) => Err(db_error(e)),
        }
    }

    async fn read_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        let row: Option<Row> = tx
            .tx
            .exec_first(sql::SELECT_RUN, key_values(scope, key).to_vec())
            .await
            .map_err(db_error)?;
        row.map(run_row).transpose()
    }

    async fn write_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        self.check_packet("state", write.state).await?;
        self.check_packet("response", write.response).await?;
        still_open(&mut tx.tx).await?;
        let mut params: Vec<Value> = vec![
            write.owner.into(),
            write.fence.into(),
            write.point.into(),
            write.state.into(),
            write.status.map(Status::code).into(),
            write.response.into(),
            window_micros(write.lease).into(),
        ];
        params.extend(key_values(scope, key));
        params.push(expected.into());
        tx.tx
            .exec_drop(sql::WRITE_RUN, params)
            .await
            .map_err(db_error)?;
        Ok(tx.tx.affected_rows() == 1)
    }

    async fn delete_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        let mut params: Vec<Value> = key_values(scope, key).into();
        params.push(expected.into());
        tx.tx
            .exec_drop(sql::DELETE_RUN, params)
            .await
            .map_err(db_error)?;
        Ok(tx.tx.affected_rows() == 1)
    }

    async fn stalled_runs(&self, limit: u32) -> Result<Vec<StalledRow>, DbError> {
        let mut conn = self.conn().await?;
        // Pinned like the replay lookup: never list a run another transaction has not
        // committed yet.
        conn.query_drop(sql::READ_COMMITTED)
            .await
            .map_err(db_error)?;
        let rows: Vec<Row> = conn
            .exec(sql::STALLED_RUNS, (limit,))
            .await
            .map_err(db_error)?;
        drop(conn);
        rows.into_iter()
            .map(|mut row| {
                Ok(StalledRow {
                    principal: take(&mut row, 0, "principal")?,
                    operation: take(&mut row, 1, "operation")?,
                    key: take(&mut row, 2, "request_key")?,
                    point: take(&mut row, 3, "point")?,
                })
            })
            .collect()
    }
}

impl OutboxStore for MysqlBackend {
    async fn enqueue(&self, tx: &mut MysqlTx, message: &Outgoing) -> Result<(), DbError> {
        self.check_packet("outbox payload", Some(message.payload()))
            .await?;
        let params: Vec<Value> = vec![
            message.destination().as_bytes().into(),
            message.message_id().as_bytes().into(),
            message.payload().into(),
        ];
        tx.tx
            .exec_drop(sql::ENQUEUE, params)
            .await
            .map_err(db_error)
    }

    async fn lock_unsent(&self, tx: &mut MysqlTx, limit: u32) -> Result<Vec<OutboxRow>, DbError> {
        let rows: Vec<Row> = tx
            .tx
            .exec(sql::LOCK_UNSENT, (limit,))
            .await
            .map_err(db_error)?;
        rows.into_iter()
            .map(|mut row| {
                Ok(OutboxRow {
                    id: take(&mut row, 0, "id")?,
                    destination: take(&mut row, 1, "destination")?,
                    message_id: take(&mut row, 2, "message_id")?,
                    payload: take(&mut row, 3, "payload")?,
                })
            })
            .collect()
    }

    async fn unsent_ids(
        &self,
        tx: &mut MysqlTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        tx.tx
            .exec(sql::UNSENT_IDS, (destination.as_bytes(), up_to))
            .await
            .map_err(db_error)
    }

    async fn mark_sent(&self, tx: &mut MysqlTx, ids: &[i64]) -> Result<(), DbError> {
        if ids.is_empty() {
            return Ok(());
        }
        let params: Vec<Value> = ids.iter().map(|&id| id.into()).collect();
        tx.tx
            .exec_drop(sql::mark_sent(ids.len()), params)
            .await
            .map_err(db_error)
    }
}
