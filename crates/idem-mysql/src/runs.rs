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
//! - **Bounded waits.** With a wait bound the session's `innodb_lock_wait_timeout` (row
//!   locks) and `lock_wait_timeout` (table locks: `LOCK TABLES`, DDL) are saved and set
//!   to it (whole seconds, rounded up, at least 1: the server's unit and minimum), and
//!   restored just before `COMMIT` or `ROLLBACK`. A lock wait that runs out is error
//!   1205, [`ErrorKind::LockTimeout`].
//! - **A new run** is an `INSERT … ON DUPLICATE KEY UPDATE owner = owner`: inserted
//!   (1 row) or the existing row locked exclusively and left as it is (0 rows). A plain
//!   INSERT's 1062 leaves a *shared* lock on the duplicate row, and concurrent starts of
//!   one existing run then all asked `FOR UPDATE`: a certain deadlock (1213). With the
//!   exclusive lock they queue instead.
//! - **The guarded write counts matched rows**: the server reports changed rows (no
//!   `CLIENT_FOUND_ROWS`), so the write always moves `updated_at` forward.
//! - **A transaction lost inside a phase** (a deadlock 1213 the effect swallowed: the
//!   server rolled everything back and runs later statements in autocommit) is refused
//!   before the run's guarded write and before `COMMIT`, from the server's
//!   "in transaction" status flag.

use std::time::Duration;

use idem_core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxRow, OutboxStats, RunGuard, RunProbe, RunRow,
    RunWrite, StalledRow,
};
use idem_core::{DbError, ErrorKind, Key, OutboxStore, Outgoing, RunStore, Scope, Status};
use mysql_async::prelude::Queryable;
use mysql_async::{Row, Value};

use crate::{
    ENGINE, MysqlBackend, MysqlTx, abort, db_error, in_transaction, lock_wait_secs, sql, take,
    window_micros,
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
async fn still_open(tx: &mut mysql_async::Conn) -> Result<(), DbError> {
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
    tx.conn
        .query_drop(sql::RESTORE_RUN_LOCK_WAIT)
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
        let mut tx = MysqlTx::new(self.conn().await?);
        // The next transaction only; the pooled session keeps its own level.
        if let Err(e) = tx.query_drop(sql::READ_COMMITTED).await {
            return Err(db_error(e));
        }
        if let Err(e) = tx.start(sql::START_TRANSACTION).await {
            return Err(abort(tx, db_error(e)).await);
        }
        if let Some(wait) = wait {
            let secs = lock_wait_secs(wait);
            let bound = format!(
                "{}{secs}, SESSION lock_wait_timeout = {secs}",
                sql::SET_RUN_LOCK_WAIT
            );
            if let Err(e) = tx.query_drop(bound).await {
                return Err(abort(tx, db_error(e)).await);
            }
            tx.restore_lock_wait = true;
        }
        Ok(tx)
    }

    async fn commit_runs(&self, mut tx: MysqlTx) -> Result<(), DbError> {
        let ready = match restore(&mut tx).await {
            Ok(()) => still_open(&mut tx.conn).await,
            Err(e) => Err(e),
        };
        if let Err(e) = ready {
            return Err(abort(tx, e).await);
        }
        tx.commit().await
    }

    async fn rollback_runs(&self, mut tx: MysqlTx) -> Result<(), DbError> {
        let restored = restore(&mut tx).await;
        // A connection whose ROLLBACK failed is reset or discarded by the pool.
        let ended = tx.rollback().await;
        restored.and(ended)
    }

    async fn insert_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        self.check_packet("request", Some(run.request), false)
            .await?;
        let mut params: Vec<Value> = key_values(scope, key).into();
        params.extend([
            run.request.into(),
            run.owner.into(),
            run.fence.into(),
            run.point.into(),
            window_micros(run.lease).into(),
            window_micros(run.retention).into(),
        ]);
        tx.conn
            .exec_drop(sql::INSERT_RUN, params)
            .await
            .map_err(db_error)?;
        Ok(tx.conn.affected_rows() == 1)
    }

    async fn read_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        let row: Option<Row> = tx
            .conn
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
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        self.check_packet("state", write.state, false).await?;
        self.check_packet("response", write.response, false).await?;
        still_open(&mut tx.conn).await?;
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
        params.extend([
            expected.owner.into(),
            expected.fence.into(),
            expected.point.into(),
        ]);
        tx.conn
            .exec_drop(sql::WRITE_RUN, params)
            .await
            .map_err(db_error)?;
        Ok(tx.conn.affected_rows() == 1)
    }

    async fn renew_lease(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        still_open(&mut tx.conn).await?;
        let mut params: Vec<Value> = vec![window_micros(lease).into()];
        params.extend(key_values(scope, key));
        params.extend([owner.into(), fence.into()]);
        tx.conn
            .exec_drop(sql::RENEW_LEASE, params)
            .await
            .map_err(db_error)?;
        Ok(tx.conn.affected_rows() == 1)
    }

    async fn probe_run(
        &self,
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<RunProbe, DbError> {
        let free: Option<i64> = tx
            .conn
            .exec_first(sql::PROBE_RUN_LOCK, key_values(scope, key).to_vec())
            .await
            .map_err(db_error)?;
        if free.is_some() {
            return Ok(RunProbe::Free);
        }
        let exists: Option<i64> = tx
            .conn
            .exec_first(sql::PROBE_RUN_EXISTS, key_values(scope, key).to_vec())
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
        tx: &mut MysqlTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        let mut params: Vec<Value> = key_values(scope, key).into();
        params.push(expected.into());
        tx.conn
            .exec_drop(sql::DELETE_RUN, params)
            .await
            .map_err(db_error)?;
        Ok(tx.conn.affected_rows() == 1)
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
        self.check_packet("outbox payload", Some(message.payload()), false)
            .await?;
        let params: Vec<Value> = vec![
            message.destination().as_bytes().into(),
            message.message_id().as_bytes().into(),
            message.payload().into(),
        ];
        tx.conn
            .exec_drop(sql::ENQUEUE, params)
            .await
            .map_err(db_error)
    }

    async fn lock_due(&self, tx: &mut MysqlTx, limit: u32) -> Result<Vec<DueRow>, DbError> {
        let rows: Vec<Row> = tx
            .conn
            .exec(sql::LOCK_DUE, (limit,))
            .await
            .map_err(db_error)?;
        rows.into_iter()
            .map(|mut row| {
                Ok(DueRow {
                    row: OutboxRow {
                        id: take(&mut row, 0, "id")?,
                        destination: take(&mut row, 1, "destination")?,
                        message_id: take(&mut row, 2, "message_id")?,
                        payload: take(&mut row, 3, "payload")?,
                    },
                    attempts: take(&mut row, 4, "attempts")?,
                })
            })
            .collect()
    }

    async fn pending_ids(
        &self,
        tx: &mut MysqlTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        tx.conn
            .exec(sql::PENDING_IDS, (destination.as_bytes(), up_to))
            .await
            .map_err(db_error)
    }

    async fn claim_due(
        &self,
        tx: &mut MysqlTx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        let mut params: Vec<Value> = vec![token.as_bytes().into(), window_micros(lease).into()];
        params.extend(ids.iter().map(|&id| Value::from(id)));
        tx.conn
            .exec_drop(sql::claim_due(ids.len()), params)
            .await
            .map_err(db_error)
    }

    async fn release(&self, tx: &mut MysqlTx, ids: &[i64], token: &str) -> Result<(), DbError> {
        let mut params: Vec<Value> = vec![token.as_bytes().into()];
        params.extend(ids.iter().map(|&id| Value::from(id)));
        tx.conn
            .exec_drop(sql::release(ids.len()), params)
            .await
            .map_err(db_error)
    }

    async fn mark_sent(&self, tx: &mut MysqlTx, ids: &[i64], token: &str) -> Result<u64, DbError> {
        let mut params: Vec<Value> = vec![token.as_bytes().into()];
        params.extend(ids.iter().map(|&id| Value::from(id)));
        tx.conn
            .exec_drop(sql::mark_sent(ids.len()), params)
            .await
            .map_err(db_error)?;
        Ok(tx.conn.affected_rows())
    }

    async fn record_failure(
        &self,
        tx: &mut MysqlTx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> Result<bool, DbError> {
        let token = token.as_bytes();
        let done = match retry_in {
            Some(delay) => {
                tx.conn
                    .exec_drop(sql::RETRY_LATER, (error, window_micros(delay), id, token))
                    .await
            }
            None => tx.conn.exec_drop(sql::BURY, (error, id, token)).await,
        };
        done.map_err(db_error)?;
        Ok(tx.conn.affected_rows() == 1)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        let mut conn = self.conn().await?;
        let row: Option<Row> = conn
            .exec_first(sql::OUTBOX_STATS, ())
            .await
            .map_err(db_error)?;
        drop(conn);
        let Some(mut row) = row else {
            return Ok(OutboxStats::default());
        };
        let pending: i64 = take(&mut row, 0, "pending")?;
        let dead: i64 = take(&mut row, 1, "dead")?;
        let oldest: Option<i64> = take(&mut row, 2, "oldest")?;
        Ok(OutboxStats {
            pending: u64::try_from(pending).unwrap_or(0),
            dead: u64::try_from(dead).unwrap_or(0),
            oldest_pending_age: oldest.map(duration_of),
        })
    }

    async fn list_outbox(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        let state = filter.state.code();
        let destination: Value = filter.destination.as_deref().map(str::as_bytes).into();
        let params: Vec<Value> = vec![
            state.into(),
            state.into(),
            state.into(),
            destination.clone(),
            destination,
            filter.after_id.into(),
            filter.limit.into(),
        ];
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = conn
            .exec(sql::LIST_OUTBOX, params)
            .await
            .map_err(db_error)?;
        drop(conn);
        rows.into_iter()
            .map(|mut row| {
                let dead: i64 = take(&mut row, 4, "dead")?;
                let claimed: i64 = take(&mut row, 8, "claimed")?;
                let next: Option<i64> = take(&mut row, 7, "next_attempt_in")?;
                Ok(OutboxEntry {
                    id: take(&mut row, 0, "id")?,
                    destination: take(&mut row, 1, "destination")?,
                    message_id: take(&mut row, 2, "message_id")?,
                    attempts: take(&mut row, 3, "attempts")?,
                    dead: dead != 0,
                    last_error: take(&mut row, 5, "last_error")?,
                    age: duration_of(take(&mut row, 6, "age")?),
                    next_attempt_in: next.map(duration_of),
                    claimed: claimed != 0,
                })
            })
            .collect()
    }

    async fn retry_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        self.operator_write(ids, destination, sql::retry_ids, sql::RETRY_DEAD)
            .await
    }

    async fn drop_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        self.operator_write(ids, destination, sql::drop_ids, sql::DROP_DEAD)
            .await
    }
}

impl MysqlBackend {
    /// One autocommit statement of an operator: over `ids`, or over every dead message
    /// (of `destination`).
    async fn operator_write(
        &self,
        ids: &[i64],
        destination: Option<&str>,
        by_ids: fn(usize) -> String,
        dead: &str,
    ) -> Result<u64, DbError> {
        let mut conn = self.conn().await?;
        if ids.is_empty() {
            let d: Value = destination.map(str::as_bytes).into();
            conn.exec_drop(dead, vec![d.clone(), d])
                .await
                .map_err(db_error)?;
        } else {
            let params: Vec<Value> = ids.iter().map(|&id| Value::from(id)).collect();
            conn.exec_drop(by_ids(ids.len()), params)
                .await
                .map_err(db_error)?;
        }
        Ok(conn.affected_rows())
    }
}

/// A span of microseconds from the database clock; a negative one is zero.
fn duration_of(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}
