//! Phased runs and the transactional outbox: statements and transactions only (the
//! protocol is idem-core's).
//!
//! A run transaction is `BEGIN IMMEDIATE` on a pooled connection: it holds the
//! database's write lock, so the run's row and the outbox need no row locks (one writer
//! at a time; a second relay waits for the first instead of skipping its rows). With a
//! wait bound, the wait for a connection and for the write lock (the busy timeout) are
//! bounded by it; when it elapses the error is the retryable [`ErrorKind::Busy`], and
//! idem decides "in progress" from the run's lease, not from the lock.

use std::time::Duration;

use idem_core::outbox::Outgoing;
use idem_core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxRow, OutboxStats, RunGuard, RunProbe, RunRow,
    RunWrite, StalledRow,
};
use idem_core::{DbError, ErrorKind, Key, OutboxStore, RunStore, Scope, Status};
use rusqlite::{OptionalExtension, params};

use crate::{ENGINE, SqliteBackend, SqliteTx, db_error, micros, sql};

/// A lease or retention in µs, clamped to 1000 years so `now + span` cannot overflow
/// SQLite's 64-bit integers (which would turn it into a REAL a STRICT table refuses).
fn span(d: Duration) -> i64 {
    const MAX_MICROS: i64 = 1000 * 366 * 86_400 * 1_000_000;
    micros(d).min(MAX_MICROS)
}

/// The run's key columns, owned for the blocking pool.
fn pk(scope: &Scope, key: &Key) -> (String, String, String) {
    (
        scope.principal.as_str().to_owned(),
        scope.operation.as_str().to_owned(),
        key.as_str().to_owned(),
    )
}

fn busy(wait: Duration) -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Busy,
        format!(
            "no connection, or the database's write lock, within the run's wait bound ({wait:?})"
        ),
    )
}

impl RunStore for SqliteBackend {
    async fn begin_runs(&self, wait: Option<Duration>) -> Result<SqliteTx, DbError> {
        let configured = self.pool.manager().busy_timeout;
        let (mut lease, busy_timeout) = match wait {
            Some(wait) => match tokio::time::timeout(wait, self.lease()).await {
                Ok(lease) => (lease?, configured.min(wait)),
                Err(_) => return Err(busy(wait)),
            },
            None => (self.lease().await?, configured),
        };
        lease
            .run(move |c| -> Result<(), DbError> {
                if busy_timeout == configured {
                    return c.execute_batch(sql::BEGIN_IMMEDIATE).map_err(db_error);
                }
                c.busy_timeout(busy_timeout).map_err(db_error)?;
                let begun = c.execute_batch(sql::BEGIN_IMMEDIATE);
                c.busy_timeout(configured).map_err(db_error)?;
                begun.map_err(db_error)
            })
            .await?;
        Ok(self.open_tx(lease, 0, None))
    }

    async fn commit_runs(&self, mut tx: SqliteTx) -> Result<(), DbError> {
        tx.lease
            .run(|c| {
                let committed = c.execute_batch(sql::COMMIT).map_err(db_error);
                if committed.is_err() && !c.is_autocommit() {
                    let _ = c.execute_batch(sql::ROLLBACK);
                }
                committed
            })
            .await
    }

    async fn rollback_runs(&self, mut tx: SqliteTx) -> Result<(), DbError> {
        // A connection still inside the transaction is rolled back by the pool before
        // reuse, or closed.
        tx.lease
            .run(|c| c.execute_batch(sql::ROLLBACK))
            .await
            .map_err(db_error)
    }

    async fn insert_run(
        &self,
        tx: &mut SqliteTx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        let (p, o, k) = pk(scope, key);
        let (request, owner, point) = (
            run.request.to_owned(),
            run.owner.to_owned(),
            run.point.to_owned(),
        );
        let (fence, lease, retention) = (run.fence, span(run.lease), span(run.retention));
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::INSERT_RUN)?.execute(params![
                    p, o, k, request, owner, fence, point, lease, retention
                ])
            })
            .await
            .map(|n| n == 1)
            .map_err(db_error)
    }

    async fn read_run(
        &self,
        tx: &mut SqliteTx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        let (p, o, k) = pk(scope, key);
        let row = tx
            .lease
            .run(move |c| {
                c.prepare_cached(sql::SELECT_RUN)?
                    .query_row(params![p, o, k], |r| {
                        Ok((
                            RunRow {
                                request: r.get(0)?,
                                owner: r.get(1)?,
                                fence: r.get(2)?,
                                point: r.get(3)?,
                                state: r.get(4)?,
                                status: None,
                                response: r.get(6)?,
                                lease_over: r.get(7)?,
                                expired: r.get(8)?,
                            },
                            r.get::<_, Option<i64>>(5)?,
                        ))
                    })
                    .optional()
            })
            .await
            .map_err(db_error)?;
        row.map(|(row, status)| {
            Ok(RunRow {
                status: status.map(Status::from_code).transpose()?,
                ..row
            })
        })
        .transpose()
    }

    async fn write_run(
        &self,
        tx: &mut SqliteTx,
        scope: &Scope,
        key: &Key,
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        let (p, o, k) = pk(scope, key);
        let (expected_owner, expected_fence, expected_point) = (
            expected.owner.to_owned(),
            expected.fence,
            expected.point.to_owned(),
        );
        let (owner, point) = (write.owner.to_owned(), write.point.to_owned());
        let (state, response) = (
            write.state.map(str::to_owned),
            write.response.map(str::to_owned),
        );
        let (fence, status, lease) = (
            write.fence,
            write.status.map(Status::code),
            span(write.lease),
        );
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::WRITE_RUN)?.execute(params![
                    p,
                    o,
                    k,
                    expected_owner,
                    owner,
                    fence,
                    point,
                    state,
                    status,
                    response,
                    lease,
                    expected_fence,
                    expected_point
                ])
            })
            .await
            .map(|n| n == 1)
            .map_err(db_error)
    }

    async fn renew_lease(
        &self,
        tx: &mut SqliteTx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        let (p, o, k) = pk(scope, key);
        let (owner, lease) = (owner.to_owned(), span(lease));
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::RENEW_LEASE)?
                    .execute(params![p, o, k, owner, fence, lease])
            })
            .await
            .map(|n| n == 1)
            .map_err(db_error)
    }

    /// SQLite has no row locks: a start waits for the database's write lock, never for
    /// a run's row, so whatever held it was not this run.
    async fn probe_run(
        &self,
        _tx: &mut SqliteTx,
        _scope: &Scope,
        _key: &Key,
    ) -> Result<RunProbe, DbError> {
        Ok(RunProbe::Free)
    }

    async fn delete_run(
        &self,
        tx: &mut SqliteTx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        let (p, o, k) = pk(scope, key);
        let expected = expected.to_owned();
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::DELETE_RUN)?
                    .execute(params![p, o, k, expected])
            })
            .await
            .map(|n| n == 1)
            .map_err(db_error)
    }

    async fn stalled_runs(&self, limit: u32) -> Result<Vec<StalledRow>, DbError> {
        self.interact(move |c| {
            c.prepare_cached(sql::STALLED_RUNS)?
                .query_map([limit], |r| {
                    Ok(StalledRow {
                        principal: r.get(0)?,
                        operation: r.get(1)?,
                        key: r.get(2)?,
                        point: r.get(3)?,
                    })
                })?
                .collect()
        })
        .await
    }
}

impl OutboxStore for SqliteBackend {
    async fn enqueue(&self, tx: &mut SqliteTx, message: &Outgoing) -> Result<(), DbError> {
        let (destination, message_id, payload) = (
            message.destination().to_owned(),
            message.message_id().to_owned(),
            message.payload().to_owned(),
        );
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::ENQUEUE)?
                    .execute(params![destination, message_id, payload])
            })
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn lock_due(&self, tx: &mut SqliteTx, limit: u32) -> Result<Vec<DueRow>, DbError> {
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::LOCK_DUE)?
                    .query_map([limit], |r| {
                        Ok(DueRow {
                            row: OutboxRow {
                                id: r.get(0)?,
                                destination: r.get(1)?,
                                message_id: r.get(2)?,
                                payload: r.get(3)?,
                            },
                            attempts: r.get(4)?,
                        })
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .await
            .map_err(db_error)
    }

    async fn pending_ids(
        &self,
        tx: &mut SqliteTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        let destination = destination.to_owned();
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::PENDING_IDS)?
                    .query_map(params![destination, up_to], |r| r.get(0))?
                    .collect::<rusqlite::Result<Vec<i64>>>()
            })
            .await
            .map_err(db_error)
    }

    async fn claim_due(
        &self,
        tx: &mut SqliteTx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        let (json, token, lease) = (json_ids(ids), token.to_owned(), span(lease));
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::CLAIM_DUE)?
                    .execute(params![token, lease, json])
            })
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn release(&self, tx: &mut SqliteTx, ids: &[i64], token: &str) -> Result<(), DbError> {
        let (json, token) = (json_ids(ids), token.to_owned());
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::RELEASE)?
                    .execute(params![token, json])
            })
            .await
            .map(drop)
            .map_err(db_error)
    }

    async fn mark_sent(&self, tx: &mut SqliteTx, ids: &[i64], token: &str) -> Result<u64, DbError> {
        let (json, token) = (json_ids(ids), token.to_owned());
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::MARK_SENT)?
                    .execute(params![token, json])
            })
            .await
            .map(|n| n as u64)
            .map_err(db_error)
    }

    async fn record_failure(
        &self,
        tx: &mut SqliteTx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> Result<bool, DbError> {
        let (token, error) = (token.to_owned(), error.to_owned());
        let delay = retry_in.map(span);
        tx.lease
            .run(move |c| match delay {
                Some(delay) => c
                    .prepare_cached(sql::RETRY_LATER)?
                    .execute(params![error, delay, id, token]),
                None => c
                    .prepare_cached(sql::BURY)?
                    .execute(params![error, id, token]),
            })
            .await
            .map(|n| n == 1)
            .map_err(db_error)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        let (pending, dead, oldest): (i64, i64, Option<i64>) = self
            .interact(|c| {
                c.prepare_cached(sql::OUTBOX_STATS)?
                    .query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            })
            .await?;
        Ok(OutboxStats {
            pending: u64::try_from(pending).unwrap_or(0),
            dead: u64::try_from(dead).unwrap_or(0),
            oldest_pending_age: oldest.map(duration_of),
        })
    }

    async fn list_outbox(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        let (state, destination, after, limit) = (
            filter.state.code(),
            filter.destination.clone(),
            filter.after_id,
            filter.limit,
        );
        self.interact(move |c| {
            c.prepare_cached(sql::LIST_OUTBOX)?
                .query_map(params![state, destination, after, limit], |r| {
                    Ok(OutboxEntry {
                        id: r.get(0)?,
                        destination: r.get(1)?,
                        message_id: r.get(2)?,
                        attempts: r.get(3)?,
                        dead: r.get(4)?,
                        last_error: r.get(5)?,
                        age: duration_of(r.get(6)?),
                        next_attempt_in: r.get::<_, Option<i64>>(7)?.map(duration_of),
                        claimed: r.get(8)?,
                    })
                })?
                .collect()
        })
        .await
    }

    async fn retry_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        let (json, destination) = (json_ids(ids), destination.map(str::to_owned));
        let by_ids = !ids.is_empty();
        self.interact(move |c| {
            if by_ids {
                c.prepare_cached(sql::RETRY_IDS)?.execute([json])
            } else {
                c.prepare_cached(sql::RETRY_DEAD)?.execute([destination])
            }
        })
        .await
        .map(|n| n as u64)
    }

    async fn drop_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        let (json, destination) = (json_ids(ids), destination.map(str::to_owned));
        let by_ids = !ids.is_empty();
        self.interact(move |c| {
            if by_ids {
                c.prepare_cached(sql::DROP_IDS)?.execute([json])
            } else {
                c.prepare_cached(sql::DROP_DEAD)?.execute([destination])
            }
        })
        .await
        .map(|n| n as u64)
    }
}

/// Ids as one JSON array parameter (`[3,4,7]`), read with `json_each`.
fn json_ids(ids: &[i64]) -> String {
    let list: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("[{}]", list.join(","))
}

/// A span of microseconds from the database clock; a negative one (clock skew) is zero.
fn duration_of(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}
