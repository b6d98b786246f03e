//! Phased runs and the transactional outbox on SQL Server: statements and transactions
//! only (the protocol is idem-core's [`idem_core::Run`] and [`idem_core::Idem::relay`]).
//! Written from the documentation; verified offline only (SQL snapshots), and live where
//! `IDEM_MSSQL_URL` is set (`tests/mssql_runs.rs`).
//!
//! - **Transactions** open like a claim's (`@@TRANCOUNT` must be 0, `XACT_ABORT OFF` so
//!   a duplicate key ends only its statement), always at **READ COMMITTED** whatever the
//!   claim's configured level: the run's row is read with `UPDLOCK, HOLDLOCK, ROWLOCK`,
//!   the relay's oldest unsent messages with `UPDLOCK, READPAST, ROWLOCK` (rows other
//!   relays hold are skipped), and the relay's list of unsent ids is a plain read (a
//!   shared lock is compatible with the other relays' update locks). They commit with
//!   the claim's checked commit (`IF @@TRANCOUNT = 1 COMMIT`).
//! - **Bounded waits**: with a wait bound the first batch sets `SET LOCK_TIMEOUT <ms>`
//!   (whole milliseconds, rounded up, at least 1) after reading the session's own
//!   `@@LOCK_TIMEOUT`, which is set back at `COMMIT` or `ROLLBACK`. A lock wait that
//!   runs out is error 1222, [`ErrorKind::LockTimeout`].
//! - **A new run** is a plain `INSERT`; 2627/2601 answers `false`.
//! - **Row counts** are the rows the `WHERE` matched (SQL Server counts matched rows);
//!   counted statements start with `SET NOCOUNT OFF`.

use std::time::Duration;

use idem_core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxRow, OutboxStats, RunGuard, RunProbe, RunRow,
    RunWrite, StalledRow,
};
use idem_core::{DbError, ErrorKind, Key, OutboxStore, Outgoing, RunStore, Scope, Status};
use tiberius::{Row, ToSql};

use crate::error_codes::{self, db_error_in};
use crate::{
    Isolation, MssqlBackend, MssqlTx, begin_batch, cutoff_parts, expired, read_error, sql, text,
};

/// The first batch of a run transaction: the session's `@@TRANCOUNT` and
/// `@@LOCK_TIMEOUT`, the lock wait bound when there is one, READ COMMITTED and `BEGIN`.
pub(crate) fn runs_begin_batch(wait: Option<Duration>) -> String {
    match wait {
        Some(wait) => begin_batch(Isolation::ReadCommitted, wait),
        None => format!("{}; {}", sql::CLAIM_STATE, sql::BEGIN_READ_COMMITTED),
    }
}

/// A text column that must not be NULL.
fn required(row: &Row, idx: usize, what: &str) -> Result<String, DbError> {
    text(row, idx)?.ok_or_else(|| read_error(&format!("NULL {what}")))
}

/// A `varbinary` column holding UTF-8 text (identities, owner tokens).
fn bytes_text(row: &Row, idx: usize, what: &str) -> Result<String, DbError> {
    let bytes = row
        .try_get::<&[u8], _>(idx)
        .map_err(|e| db_error_in("reading a stored run", e))?
        .ok_or_else(|| read_error(&format!("NULL {what}")))?;
    String::from_utf8(bytes.to_vec()).map_err(|_| read_error(&format!("non-UTF-8 {what}")))
}

fn bigint(row: &Row, idx: usize, what: &str) -> Result<i64, DbError> {
    row.try_get::<i64, _>(idx)
        .map_err(|e| db_error_in("reading a stored run", e))?
        .ok_or_else(|| read_error(&format!("NULL {what}")))
}

fn run_row(row: &Row) -> Result<RunRow, DbError> {
    let status = row
        .try_get::<u8, _>(5)
        .map_err(|e| db_error_in("reading a stored run", e))?;
    Ok(RunRow {
        request: required(row, 0, "request")?,
        owner: bytes_text(row, 1, "owner")?,
        fence: bigint(row, 2, "fence")?,
        point: required(row, 3, "point")?,
        state: text(row, 4)?,
        status: status
            .map(|code| Status::from_code(i64::from(code)))
            .transpose()?,
        response: text(row, 6)?,
        lease_over: expired(row, 7)?,
        expired: expired(row, 8)?,
    })
}

fn due_row(row: &Row) -> Result<DueRow, DbError> {
    Ok(DueRow {
        row: OutboxRow {
            id: bigint(row, 0, "id")?,
            destination: bytes_text(row, 1, "destination")?,
            message_id: bytes_text(row, 2, "message_id")?,
            payload: required(row, 3, "payload")?,
        },
        attempts: bigint(row, 4, "attempts")?,
    })
}

fn int(row: &Row, idx: usize, what: &str) -> Result<i32, DbError> {
    row.try_get::<i32, _>(idx)
        .map_err(|e| db_error_in("reading outbox messages", e))?
        .ok_or_else(|| read_error(&format!("NULL {what}")))
}

fn optional_bigint(row: &Row, idx: usize) -> Result<Option<i64>, DbError> {
    row.try_get::<i64, _>(idx)
        .map_err(|e| db_error_in("reading outbox messages", e))
}

fn entry(row: &Row) -> Result<OutboxEntry, DbError> {
    Ok(OutboxEntry {
        id: bigint(row, 0, "id")?,
        destination: bytes_text(row, 1, "destination")?,
        message_id: bytes_text(row, 2, "message_id")?,
        attempts: bigint(row, 3, "attempts")?,
        dead: int(row, 4, "dead")? == 1,
        last_error: text(row, 5)?,
        age: duration_of(bigint(row, 6, "age")?),
        next_attempt_in: optional_bigint(row, 7)?.map(duration_of),
        claimed: int(row, 8, "claimed")? == 1,
    })
}

/// A span of microseconds from the database clock; a negative one is zero.
fn duration_of(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

impl RunStore for MssqlBackend {
    async fn begin_runs(&self, wait: Option<Duration>) -> Result<MssqlTx, DbError> {
        let (lease, session_lock_timeout) = self.open_transaction(&runs_begin_batch(wait)).await?;
        Ok(MssqlTx {
            lease,
            restore_lock_timeout: wait.map(|_| session_lock_timeout),
        })
    }

    async fn commit_runs(&self, tx: MssqlTx) -> Result<(), DbError> {
        let batch = match tx.restore_lock_timeout {
            Some(ms) => format!("{}{ms}; {}", sql::SET_LOCK_TIMEOUT, sql::CHECKED_COMMIT),
            None => sql::CHECKED_COMMIT.to_owned(),
        };
        self.checked_commit(tx.lease, &batch, "a phase's effect")
            .await
    }

    async fn rollback_runs(&self, mut tx: MssqlTx) -> Result<(), DbError> {
        let ended = tx.lease.rollback().await;
        let reset = match tx.restore_lock_timeout {
            Some(ms) => tx
                .lease
                .batch(&format!("{}{ms}", sql::SET_LOCK_TIMEOUT))
                .await
                .map(drop),
            None => Ok(()),
        };
        if ended.is_err() || reset.is_err() {
            tx.lease.discard();
        }
        ended.map_err(|e| db_error_in("rolling back", e))
    }

    async fn insert_run(
        &self,
        tx: &mut MssqlTx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        let (principal, operation, key) = (
            scope.principal.as_str().as_bytes(),
            scope.operation.as_str().as_bytes(),
            key.as_str().as_bytes(),
        );
        let owner = run.owner.as_bytes();
        let (ld, ls, lm) = cutoff_parts(run.lease);
        let (rd, rs, rm) = cutoff_parts(run.retention);
        let params: [&dyn ToSql; 13] = [
            &principal,
            &operation,
            &key,
            &run.request,
            &owner,
            &run.fence,
            &run.point,
            &ld,
            &ls,
            &lm,
            &rd,
            &rs,
            &rm,
        ];
        match tx.lease.execute(sql::INSERT_RUN, &params).await {
            Ok(_) => Ok(true),
            Err(e) if error_codes::classify(&e) == ErrorKind::UniqueViolation => Ok(false),
            Err(e) => Err(db_error_in("inserting the run", e)),
        }
    }

    async fn read_run(
        &self,
        tx: &mut MssqlTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        let (principal, operation, key) = (
            scope.principal.as_str().as_bytes(),
            scope.operation.as_str().as_bytes(),
            key.as_str().as_bytes(),
        );
        let row = tx
            .lease
            .query_row(sql::SELECT_RUN, &[&principal, &operation, &key])
            .await
            .map_err(|e| db_error_in("reading the run", e))?;
        row.as_ref().map(run_row).transpose()
    }

    async fn write_run(
        &self,
        tx: &mut MssqlTx,
        scope: &Scope,
        key: &Key,
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        let (principal, operation, key) = (
            scope.principal.as_str().as_bytes(),
            scope.operation.as_str().as_bytes(),
            key.as_str().as_bytes(),
        );
        let (expected_owner, owner) = (expected.owner.as_bytes(), write.owner.as_bytes());
        let status = write.status.map(Status::code);
        let (ld, ls, lm) = cutoff_parts(write.lease);
        let params: [&dyn ToSql; 15] = [
            &principal,
            &operation,
            &key,
            &expected_owner,
            &owner,
            &write.fence,
            &write.point,
            &write.state,
            &status,
            &write.response,
            &ld,
            &ls,
            &lm,
            &expected.fence,
            &expected.point,
        ];
        let n = tx
            .lease
            .execute(sql::WRITE_RUN, &params)
            .await
            .map_err(|e| db_error_in("writing the run", e))?;
        Ok(n == 1)
    }

    async fn renew_lease(
        &self,
        tx: &mut MssqlTx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        let (principal, operation, key) = (
            scope.principal.as_str().as_bytes(),
            scope.operation.as_str().as_bytes(),
            key.as_str().as_bytes(),
        );
        let owner = owner.as_bytes();
        let (ld, ls, lm) = cutoff_parts(lease);
        let params: [&dyn ToSql; 8] = [&principal, &operation, &key, &owner, &fence, &ld, &ls, &lm];
        let n = tx
            .lease
            .execute(sql::RENEW_LEASE, &params)
            .await
            .map_err(|e| db_error_in("renewing the run's lease", e))?;
        Ok(n == 1)
    }

    async fn probe_run(
        &self,
        tx: &mut MssqlTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<RunProbe, DbError> {
        let (principal, operation, key) = (
            scope.principal.as_str().as_bytes(),
            scope.operation.as_str().as_bytes(),
            key.as_str().as_bytes(),
        );
        let free = tx
            .lease
            .query_row(sql::PROBE_RUN_LOCK, &[&principal, &operation, &key])
            .await
            .map_err(|e| db_error_in("probing the run", e))?;
        if free.is_some() {
            return Ok(RunProbe::Free);
        }
        let exists = tx
            .lease
            .query_row(sql::PROBE_RUN_EXISTS, &[&principal, &operation, &key])
            .await
            .map_err(|e| db_error_in("probing the run", e))?;
        Ok(if exists.is_some() {
            RunProbe::Held
        } else {
            RunProbe::Free
        })
    }

    async fn delete_run(
        &self,
        tx: &mut MssqlTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        let (principal, operation, key) = (
            scope.principal.as_str().as_bytes(),
            scope.operation.as_str().as_bytes(),
            key.as_str().as_bytes(),
        );
        let expected = expected.as_bytes();
        let n = tx
            .lease
            .execute(sql::DELETE_RUN, &[&principal, &operation, &key, &expected])
            .await
            .map_err(|e| db_error_in("deleting the run", e))?;
        Ok(n == 1)
    }

    async fn stalled_runs(&self, limit: u32) -> Result<Vec<StalledRow>, DbError> {
        let mut lease = self.pool.acquire().await?;
        let rows = lease
            .query_all(sql::STALLED_RUNS, &[&i64::from(limit)])
            .await
            .map_err(|e| db_error_in("listing stalled runs", e))?;
        drop(lease);
        rows.iter()
            .map(|row| {
                Ok(StalledRow {
                    principal: bytes_text(row, 0, "principal")?,
                    operation: bytes_text(row, 1, "operation")?,
                    key: bytes_text(row, 2, "request_key")?,
                    point: required(row, 3, "point")?,
                })
            })
            .collect()
    }
}

impl OutboxStore for MssqlBackend {
    async fn enqueue(&self, tx: &mut MssqlTx, message: &Outgoing) -> Result<(), DbError> {
        let (destination, message_id, payload) = (
            message.destination().as_bytes(),
            message.message_id().as_bytes(),
            message.payload(),
        );
        tx.lease
            .execute(sql::ENQUEUE, &[&destination, &message_id, &payload])
            .await
            .map(drop)
            .map_err(|e| db_error_in("storing an outbox message", e))
    }

    async fn lock_due(&self, tx: &mut MssqlTx, limit: u32) -> Result<Vec<DueRow>, DbError> {
        let rows = tx
            .lease
            .query_all(sql::LOCK_DUE, &[&i64::from(limit)])
            .await
            .map_err(|e| db_error_in("locking due outbox messages", e))?;
        rows.iter().map(due_row).collect()
    }

    async fn pending_ids(
        &self,
        tx: &mut MssqlTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        let destination = destination.as_bytes();
        let rows = tx
            .lease
            .query_all(sql::PENDING_IDS, &[&destination, &up_to])
            .await
            .map_err(|e| db_error_in("reading pending outbox ids", e))?;
        rows.iter().map(|row| bigint(row, 0, "id")).collect()
    }

    async fn claim_due(
        &self,
        tx: &mut MssqlTx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        let token = token.as_bytes();
        let (ld, ls, lm) = cutoff_parts(lease);
        let mut params: Vec<&dyn ToSql> = vec![&token, &ld, &ls, &lm];
        params.extend(ids.iter().map(|id| id as &dyn ToSql));
        tx.lease
            .execute(&sql::claim_due(ids.len()), &params)
            .await
            .map(drop)
            .map_err(|e| db_error_in("claiming outbox messages", e))
    }

    async fn release(&self, tx: &mut MssqlTx, ids: &[i64], token: &str) -> Result<(), DbError> {
        let token = token.as_bytes();
        let mut params: Vec<&dyn ToSql> = vec![&token];
        params.extend(ids.iter().map(|id| id as &dyn ToSql));
        tx.lease
            .execute(&sql::release(ids.len()), &params)
            .await
            .map(drop)
            .map_err(|e| db_error_in("giving back outbox messages", e))
    }

    async fn mark_sent(&self, tx: &mut MssqlTx, ids: &[i64], token: &str) -> Result<u64, DbError> {
        let token = token.as_bytes();
        let mut params: Vec<&dyn ToSql> = vec![&token];
        params.extend(ids.iter().map(|id| id as &dyn ToSql));
        tx.lease
            .execute(&sql::mark_sent(ids.len()), &params)
            .await
            .map_err(|e| db_error_in("marking outbox messages sent", e))
    }

    async fn record_failure(
        &self,
        tx: &mut MssqlTx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> Result<bool, DbError> {
        let token = token.as_bytes();
        let n = match retry_in {
            Some(delay) => {
                let (dd, ds, dm) = cutoff_parts(delay);
                let params: [&dyn ToSql; 6] = [&error, &dd, &ds, &dm, &id, &token];
                tx.lease.execute(sql::RETRY_LATER, &params).await
            }
            None => {
                let params: [&dyn ToSql; 3] = [&error, &id, &token];
                tx.lease.execute(sql::BURY, &params).await
            }
        }
        .map_err(|e| db_error_in("recording a failed outbox attempt", e))?;
        Ok(n == 1)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        let mut lease = self.pool.acquire().await?;
        let row = lease
            .query_row(sql::OUTBOX_STATS, &[])
            .await
            .map_err(|e| db_error_in("counting the outbox", e))?;
        drop(lease);
        let Some(row) = row else {
            return Ok(OutboxStats::default());
        };
        Ok(OutboxStats {
            pending: u64::try_from(bigint(&row, 0, "pending")?).unwrap_or(0),
            dead: u64::try_from(bigint(&row, 1, "dead")?).unwrap_or(0),
            oldest_pending_age: optional_bigint(&row, 2)?.map(duration_of),
        })
    }

    async fn list_outbox(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        let state = filter.state.code();
        let destination = filter.destination.as_deref().map(str::as_bytes);
        let limit = i64::from(filter.limit);
        let params: [&dyn ToSql; 4] = [&state, &destination, &filter.after_id, &limit];
        let mut lease = self.pool.acquire().await?;
        let rows = lease
            .query_all(sql::LIST_OUTBOX, &params)
            .await
            .map_err(|e| db_error_in("listing outbox messages", e))?;
        drop(lease);
        rows.iter().map(entry).collect()
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

impl MssqlBackend {
    /// One autocommit statement of an operator: over `ids`, or over every dead message
    /// (of `destination`).
    async fn operator_write(
        &self,
        ids: &[i64],
        destination: Option<&str>,
        by_ids: fn(usize) -> String,
        dead: &str,
    ) -> Result<u64, DbError> {
        let mut lease = self.pool.acquire().await?;
        let n = if ids.is_empty() {
            let d = destination.map(str::as_bytes);
            lease.execute(dead, &[&d]).await
        } else {
            let params: Vec<&dyn ToSql> = ids.iter().map(|id| id as &dyn ToSql).collect();
            lease.execute(&by_ids(ids.len()), &params).await
        }
        .map_err(|e| db_error_in("changing outbox messages", e))?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_transactions_begin_at_read_committed_with_an_optional_bound() {
        let text = [
            None,
            Some(Duration::from_millis(50)),
            Some(Duration::from_micros(1500)),
        ]
        .map(|wait| format!("-- {wait:?}\n{}\n", runs_begin_batch(wait)))
        .join("\n");
        insta::assert_snapshot!(text);
        assert!(runs_begin_batch(None).ends_with("READ COMMITTED; BEGIN TRANSACTION"));
        assert!(!runs_begin_batch(None).contains("SET LOCK_TIMEOUT"));
    }
}
