//! Phased runs and the transactional outbox on Oracle: statements and transactions only
//! (the protocol is idem-core's [`idem_core::Run`] and [`idem_core::Idem::relay`]).
//! Written from the documentation; verified offline only (SQL snapshots), and live where
//! `IDEM_ORACLE_URL` is set (`tests/oracle_runs.rs`).
//!
//! - **Transactions** are a leased connection with no transaction open (Oracle starts one
//!   at the first write or `FOR UPDATE`), at Oracle's READ COMMITTED: a run's row is read
//!   `FOR UPDATE`, the relay's oldest unsent messages `FOR UPDATE SKIP LOCKED`, and the
//!   relay's list of unsent ids is a plain query (committed data, never waiting).
//! - **Bounded waits** (chosen: the call timeout, like the claim's): with a wait bound
//!   the connection's call timeout is set to it (whole milliseconds, at least 1) and set
//!   back at `COMMIT` or `ROLLBACK`. A call cut by it (DPI-1067, ORA-03156) is reported
//!   as [`ErrorKind::LockTimeout`] (its code kept, the driver's error as the source):
//!   the only call of such a transaction that can take that long is one waiting for a
//!   row lock (the `INSERT` of a run another transaction is inserting, or its
//!   `FOR UPDATE`). If ODPI-C could not clean the connection up, the rollback fails and
//!   the pool closes it.
//! - **`SKIP LOCKED` locks a row when it is fetched**, so the relay's claim read fetches and
//!   prefetches at most its limit (at most [`LOCK_UNSENT_MAX`] rows per call), never
//!   more: rows it would not use stay free for other relays.

use std::time::Duration;

use idem_core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxRow, OutboxStats, RunGuard, RunProbe, RunRow,
    RunWrite, StalledRow,
};
use idem_core::{DbError, ErrorKind, Key, OutboxStore, Outgoing, RunStore, Scope, Status};
use oracle::Connection;
use oracle::sql_type::ToSql;

use crate::{
    ENGINE, OracleBackend, OracleTx, call_timeout_for, clob, db_error, first_row, ident_bytes,
    interval_micros, is_call_timeout, is_unique_violation, rollback_after, sql,
};

/// The most messages one `lock_due` call locks (its fetch array and prefetch size).
pub(crate) const LOCK_UNSENT_MAX: u32 = 1000;

/// A run's identity, owned, to move onto the blocking pool.
struct RunKey {
    principal: Vec<u8>,
    operation: Vec<u8>,
    key: Vec<u8>,
}

impl RunKey {
    fn new(scope: &Scope, key: &Key) -> Result<Self, DbError> {
        Ok(Self {
            principal: ident_bytes("principal", scope.principal.as_str())?,
            operation: ident_bytes("operation", scope.operation.as_str())?,
            key: ident_bytes("idempotency key", key.as_str())?,
        })
    }
}

/// A RAW column holding UTF-8 text (identities, owner tokens).
fn raw_text(row: &oracle::Row, idx: usize, what: &str) -> Result<String, DbError> {
    let bytes: Vec<u8> = row.get(idx).map_err(db_error)?;
    String::from_utf8(bytes).map_err(|_| {
        DbError::new(
            ENGINE,
            ErrorKind::CorruptRecord,
            format!("a stored {what} is not UTF-8"),
        )
    })
}

fn run_row(row: &oracle::Row) -> Result<RunRow, DbError> {
    let status: Option<i64> = row.get(5).map_err(db_error)?;
    let lease_over: i64 = row.get(7).map_err(db_error)?;
    let expired: i64 = row.get(8).map_err(db_error)?;
    Ok(RunRow {
        request: row.get(0).map_err(db_error)?,
        owner: raw_text(row, 1, "owner")?,
        fence: row.get(2).map_err(db_error)?,
        point: row.get(3).map_err(db_error)?,
        state: row.get(4).map_err(db_error)?,
        status: status.map(Status::from_code).transpose()?,
        response: row.get(6).map_err(db_error)?,
        lease_over: lease_over == 1,
        expired: expired == 1,
    })
}

fn due_row(row: &oracle::Row) -> Result<DueRow, DbError> {
    Ok(DueRow {
        row: OutboxRow {
            id: row.get(0).map_err(db_error)?,
            destination: raw_text(row, 1, "destination")?,
            message_id: raw_text(row, 2, "message_id")?,
            payload: row.get(3).map_err(db_error)?,
        },
        attempts: row.get(4).map_err(db_error)?,
    })
}

fn entry(row: &oracle::Row) -> Result<OutboxEntry, DbError> {
    let dead: i64 = row.get(4).map_err(db_error)?;
    let age: i64 = row.get(6).map_err(db_error)?;
    let next: Option<i64> = row.get(7).map_err(db_error)?;
    let claimed: i64 = row.get(8).map_err(db_error)?;
    Ok(OutboxEntry {
        id: row.get(0).map_err(db_error)?,
        destination: raw_text(row, 1, "destination")?,
        message_id: raw_text(row, 2, "message_id")?,
        attempts: row.get(3).map_err(db_error)?,
        dead: dead == 1,
        last_error: row.get(5).map_err(db_error)?,
        age: duration_of(age),
        next_attempt_in: next.map(duration_of),
        claimed: claimed == 1,
    })
}

/// A span of microseconds from the database clock; a negative one is zero.
fn duration_of(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// A call cut by the transaction's wait bound, as the lock timeout it is.
fn wait_ran_out(e: DbError, wait: Duration) -> DbError {
    if !is_call_timeout(&e) {
        return e;
    }
    let code = e.code().unwrap_or_default().to_owned();
    let message = format!(
        "a lock wait ran past the bound of {wait:?} (the connection's call timeout cut it): {}",
        e.message()
    );
    DbError::new(ENGINE, ErrorKind::LockTimeout, message)
        .with_code(code)
        .with_source(e)
}

impl OracleTx {
    /// Runs `f` on the transaction's connection; with a wait bound, a call it cut is a
    /// lock timeout.
    async fn call<T, F>(&mut self, f: F) -> Result<T, DbError>
    where
        F: FnOnce(&Connection) -> Result<T, DbError> + Send + 'static,
        T: Send + 'static,
    {
        let bound = self.bound.map(|(wait, _)| wait);
        let out = self.lease.run(f).await;
        match bound {
            Some(wait) => out.map_err(|e| wait_ran_out(e, wait)),
            None => out,
        }
    }

    /// The connection's own call timeout, if `begin_runs` changed it.
    fn restore(&self) -> Option<Option<Duration>> {
        self.bound.map(|(_, previous)| previous)
    }
}

impl RunStore for OracleBackend {
    async fn begin_runs(&self, wait: Option<Duration>) -> Result<OracleTx, DbError> {
        let mut lease = self.lease().await?;
        let bound = match wait {
            None => None,
            Some(wait) => {
                let timeout = call_timeout_for(wait);
                let previous = lease
                    .run(move |c| {
                        let previous = c.call_timeout().map_err(db_error)?;
                        c.set_call_timeout(Some(timeout)).map_err(db_error)?;
                        Ok::<_, DbError>(previous)
                    })
                    .await?;
                Some((wait, previous))
            }
        };
        Ok(OracleTx { lease, bound })
    }

    async fn commit_runs(&self, mut tx: OracleTx) -> Result<(), DbError> {
        let restore = tx.restore();
        tx.lease
            .run(move |c| {
                if let Some(previous) = restore
                    && let Err(e) = c.set_call_timeout(previous)
                {
                    return Err(rollback_after(c, db_error(e)));
                }
                c.commit().map_err(|e| rollback_after(c, db_error(e)))
            })
            .await
    }

    async fn rollback_runs(&self, mut tx: OracleTx) -> Result<(), DbError> {
        let restore = tx.restore();
        // A failed rollback leaves the transaction open: the lease then closes the
        // connection, which rolls back on the server.
        tx.lease
            .run(move |c| {
                let restored = match restore {
                    Some(previous) => c.set_call_timeout(previous).map_err(db_error),
                    None => Ok(()),
                };
                let ended = c.rollback().map_err(db_error);
                restored.and(ended)
            })
            .await
    }

    async fn insert_run(
        &self,
        tx: &mut OracleTx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        let k = RunKey::new(scope, key)?;
        let request = Some(run.request.to_owned());
        let (owner, point) = (run.owner.as_bytes().to_vec(), run.point.to_owned());
        let (fence, lease, retention) = (
            run.fence,
            interval_micros(run.lease),
            interval_micros(run.retention),
        );
        tx.call(move |c| {
            let inserted = c.execute(
                sql::INSERT_RUN,
                &[
                    &k.principal,
                    &k.operation,
                    &k.key,
                    &clob(&request),
                    &owner,
                    &fence,
                    &point,
                    &lease,
                    &retention,
                ],
            );
            match inserted {
                Ok(_) => Ok(true),
                Err(e) if is_unique_violation(&e) => Ok(false),
                Err(e) => Err(db_error(e)),
            }
        })
        .await
    }

    async fn read_run(
        &self,
        tx: &mut OracleTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        let k = RunKey::new(scope, key)?;
        tx.call(move |c| {
            first_row(c, sql::SELECT_RUN, &[&k.principal, &k.operation, &k.key])
                .map_err(db_error)?
                .as_ref()
                .map(run_row)
                .transpose()
        })
        .await
    }

    async fn write_run(
        &self,
        tx: &mut OracleTx,
        scope: &Scope,
        key: &Key,
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        let k = RunKey::new(scope, key)?;
        let (owner, expected_owner) = (
            write.owner.as_bytes().to_vec(),
            expected.owner.as_bytes().to_vec(),
        );
        let (expected_fence, expected_point) = (expected.fence, expected.point.to_owned());
        let point = write.point.to_owned();
        let state = write.state.map(str::to_owned);
        let response = write.response.map(str::to_owned);
        let status = write.status.map(|s| i64::from(s.code()));
        let (fence, lease) = (write.fence, interval_micros(write.lease));
        tx.call(move |c| {
            let params: [&dyn ToSql; 13] = [
                &owner,
                &fence,
                &point,
                &clob(&state),
                &status,
                &clob(&response),
                &lease,
                &k.principal,
                &k.operation,
                &k.key,
                &expected_owner,
                &expected_fence,
                &expected_point,
            ];
            let rows = c
                .execute(sql::WRITE_RUN, &params)
                .and_then(|s| s.row_count())
                .map_err(db_error)?;
            Ok(rows == 1)
        })
        .await
    }

    async fn renew_lease(
        &self,
        tx: &mut OracleTx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        let k = RunKey::new(scope, key)?;
        let owner = owner.as_bytes().to_vec();
        let lease = interval_micros(lease);
        tx.call(move |c| {
            let params: [&dyn ToSql; 6] =
                [&lease, &k.principal, &k.operation, &k.key, &owner, &fence];
            let rows = c
                .execute(sql::RENEW_LEASE, &params)
                .and_then(|s| s.row_count())
                .map_err(db_error)?;
            Ok(rows == 1)
        })
        .await
    }

    async fn probe_run(
        &self,
        tx: &mut OracleTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<RunProbe, DbError> {
        let k = RunKey::new(scope, key)?;
        tx.call(move |c| {
            let params: [&dyn ToSql; 3] = [&k.principal, &k.operation, &k.key];
            if first_row(c, sql::PROBE_RUN_LOCK, &params)
                .map_err(db_error)?
                .is_some()
            {
                return Ok(RunProbe::Free);
            }
            let exists = first_row(c, sql::PROBE_RUN_EXISTS, &params).map_err(db_error)?;
            Ok(if exists.is_some() {
                RunProbe::Held
            } else {
                RunProbe::Free
            })
        })
        .await
    }

    async fn delete_run(
        &self,
        tx: &mut OracleTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        let k = RunKey::new(scope, key)?;
        let expected = expected.as_bytes().to_vec();
        tx.call(move |c| {
            let rows = c
                .execute(
                    sql::DELETE_RUN,
                    &[&k.principal, &k.operation, &k.key, &expected],
                )
                .and_then(|s| s.row_count())
                .map_err(db_error)?;
            Ok(rows == 1)
        })
        .await
    }

    async fn stalled_runs(&self, limit: u32) -> Result<Vec<StalledRow>, DbError> {
        let mut lease = self.lease().await?;
        let limit = i64::from(limit);
        lease
            .run(move |c| {
                let rows = c.query(sql::STALLED_RUNS, &[&limit]).map_err(db_error)?;
                rows.map(|row| {
                    let row = row.map_err(db_error)?;
                    Ok(StalledRow {
                        principal: raw_text(&row, 0, "principal")?,
                        operation: raw_text(&row, 1, "operation")?,
                        key: raw_text(&row, 2, "request_key")?,
                        point: row.get(3).map_err(db_error)?,
                    })
                })
                .collect()
            })
            .await
    }
}

impl OutboxStore for OracleBackend {
    async fn enqueue(&self, tx: &mut OracleTx, message: &Outgoing) -> Result<(), DbError> {
        let destination = ident_bytes("outbox destination", message.destination())?;
        let message_id = ident_bytes("outbox message id", message.message_id())?;
        let payload = Some(message.payload().to_owned());
        tx.call(move |c| {
            c.execute(sql::ENQUEUE, &[&destination, &message_id, &clob(&payload)])
                .map(drop)
                .map_err(db_error)
        })
        .await
    }

    async fn lock_due(&self, tx: &mut OracleTx, limit: u32) -> Result<Vec<DueRow>, DbError> {
        let n = limit.clamp(1, LOCK_UNSENT_MAX);
        tx.call(move |c| {
            let mut stmt = c
                .statement(sql::LOCK_DUE)
                .fetch_array_size(n)
                .prefetch_rows(n)
                .build()
                .map_err(db_error)?;
            let rows = stmt.query(&[]).map_err(db_error)?;
            rows.take(usize::try_from(n).unwrap_or(usize::MAX))
                .map(|row| due_row(&row.map_err(db_error)?))
                .collect()
        })
        .await
    }

    async fn pending_ids(
        &self,
        tx: &mut OracleTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        let destination = ident_bytes("outbox destination", destination)?;
        tx.call(move |c| {
            c.query_as::<i64>(sql::PENDING_IDS, &[&destination, &up_to])
                .and_then(|rows| rows.collect::<oracle::Result<Vec<i64>>>())
                .map_err(db_error)
        })
        .await
    }

    async fn claim_due(
        &self,
        tx: &mut OracleTx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        let (ids, token, lease) = (
            ids.to_vec(),
            token.as_bytes().to_vec(),
            interval_micros(lease),
        );
        tx.call(move |c| {
            let mut params: Vec<&dyn ToSql> = vec![&token, &lease];
            params.extend(ids.iter().map(|id| id as &dyn ToSql));
            c.execute(&sql::claim_due(ids.len()), &params)
                .map(drop)
                .map_err(db_error)
        })
        .await
    }

    async fn release(&self, tx: &mut OracleTx, ids: &[i64], token: &str) -> Result<(), DbError> {
        let (ids, token) = (ids.to_vec(), token.as_bytes().to_vec());
        tx.call(move |c| {
            let mut params: Vec<&dyn ToSql> = vec![&token];
            params.extend(ids.iter().map(|id| id as &dyn ToSql));
            c.execute(&sql::release(ids.len()), &params)
                .map(drop)
                .map_err(db_error)
        })
        .await
    }

    async fn mark_sent(&self, tx: &mut OracleTx, ids: &[i64], token: &str) -> Result<u64, DbError> {
        let (ids, token) = (ids.to_vec(), token.as_bytes().to_vec());
        tx.call(move |c| {
            let mut params: Vec<&dyn ToSql> = vec![&token];
            params.extend(ids.iter().map(|id| id as &dyn ToSql));
            c.execute(&sql::mark_sent(ids.len()), &params)
                .and_then(|s| s.row_count())
                .map_err(db_error)
        })
        .await
    }

    async fn record_failure(
        &self,
        tx: &mut OracleTx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> Result<bool, DbError> {
        let (token, error) = (token.as_bytes().to_vec(), Some(error.to_owned()));
        let delay = retry_in.map(interval_micros);
        tx.call(move |c| {
            let done = match delay {
                Some(delay) => {
                    let params: [&dyn ToSql; 4] = [&clob(&error), &delay, &id, &token];
                    c.execute(sql::RETRY_LATER, &params)
                }
                None => {
                    let params: [&dyn ToSql; 3] = [&clob(&error), &id, &token];
                    c.execute(sql::BURY, &params)
                }
            };
            let rows = done.and_then(|s| s.row_count()).map_err(db_error)?;
            Ok(rows == 1)
        })
        .await
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        let mut lease = self.lease().await?;
        lease
            .run(|c| {
                let row = first_row(c, sql::OUTBOX_STATS, &[]).map_err(db_error)?;
                let Some(row) = row else {
                    return Ok(OutboxStats::default());
                };
                let pending: i64 = row.get(0).map_err(db_error)?;
                let dead: i64 = row.get(1).map_err(db_error)?;
                let oldest: Option<i64> = row.get(2).map_err(db_error)?;
                Ok(OutboxStats {
                    pending: u64::try_from(pending).unwrap_or(0),
                    dead: u64::try_from(dead).unwrap_or(0),
                    oldest_pending_age: oldest.map(duration_of),
                })
            })
            .await
    }

    async fn list_outbox(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        let state = filter.state.code();
        let destination = filter
            .destination
            .as_deref()
            .map(|d| ident_bytes("outbox destination", d))
            .transpose()?;
        let (after, limit) = (filter.after_id, i64::from(filter.limit));
        let mut lease = self.lease().await?;
        lease
            .run(move |c| {
                let params: [&dyn ToSql; 7] = [
                    &state,
                    &state,
                    &state,
                    &destination,
                    &destination,
                    &after,
                    &limit,
                ];
                let rows = c.query(sql::LIST_OUTBOX, &params).map_err(db_error)?;
                rows.map(|row| entry(&row.map_err(db_error)?)).collect()
            })
            .await
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

impl OracleBackend {
    /// One statement of an operator, committed: over `ids`, or over every dead message
    /// (of `destination`).
    async fn operator_write(
        &self,
        ids: &[i64],
        destination: Option<&str>,
        by_ids: fn(usize) -> String,
        dead: &'static str,
    ) -> Result<u64, DbError> {
        let destination = destination
            .map(|d| ident_bytes("outbox destination", d))
            .transpose()?;
        let ids = ids.to_vec();
        let mut lease = self.lease().await?;
        lease
            .run(move |c| {
                let done = if ids.is_empty() {
                    let params: [&dyn ToSql; 2] = [&destination, &destination];
                    c.execute(dead, &params)
                } else {
                    let params: Vec<&dyn ToSql> = ids.iter().map(|id| id as &dyn ToSql).collect();
                    c.execute(&by_ids(ids.len()), &params)
                };
                match done.and_then(|s| s.row_count()) {
                    Ok(n) => c
                        .commit()
                        .map(|()| n)
                        .map_err(|e| rollback_after(c, db_error(e))),
                    Err(e) => Err(rollback_after(c, db_error(e))),
                }
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_call_in_a_bounded_transaction_is_a_lock_timeout() {
        let cut = DbError::new(
            ENGINE,
            ErrorKind::Connection,
            "DPI-1067: call timeout of 50 ms",
        )
        .with_code("DPI-1067");
        let e = wait_ran_out(cut, Duration::from_millis(50));
        assert_eq!(e.kind(), ErrorKind::LockTimeout, "{e}");
        assert_eq!(e.code(), Some("DPI-1067"));
        assert!(e.kind().is_retryable());
        let source = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<DbError>());
        assert_eq!(source.map(DbError::kind), Some(ErrorKind::Connection));

        let server = DbError::new(ENGINE, ErrorKind::Connection, "cut").with_code("ORA-03156");
        assert_eq!(
            wait_ran_out(server, Duration::from_secs(1)).kind(),
            ErrorKind::LockTimeout
        );
        // Anything else keeps its own classification.
        let dead = DbError::new(ENGINE, ErrorKind::Connection, "eof").with_code("ORA-03113");
        assert_eq!(
            wait_ran_out(dead, Duration::from_secs(1)).kind(),
            ErrorKind::Connection
        );
    }
}
