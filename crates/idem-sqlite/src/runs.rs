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
use idem_core::runs::{NewRun, OutboxRow, RunRow, RunWrite, StalledRow};
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
        expected: &str,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        let (p, o, k) = pk(scope, key);
        let (expected, owner, point) = (
            expected.to_owned(),
            write.owner.to_owned(),
            write.point.to_owned(),
        );
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
                    p, o, k, expected, owner, fence, point, state, status, response, lease
                ])
            })
            .await
            .map(|n| n == 1)
            .map_err(db_error)
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

    async fn lock_unsent(&self, tx: &mut SqliteTx, limit: u32) -> Result<Vec<OutboxRow>, DbError> {
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::LOCK_UNSENT)?
                    .query_map([limit], |r| {
                        Ok(OutboxRow {
                            id: r.get(0)?,
                            destination: r.get(1)?,
                            message_id: r.get(2)?,
                            payload: r.get(3)?,
                        })
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .await
            .map_err(db_error)
    }

    async fn unsent_ids(
        &self,
        tx: &mut SqliteTx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        let destination = destination.to_owned();
        tx.lease
            .run(move |c| {
                c.prepare_cached(sql::UNSENT_IDS)?
                    .query_map(params![destination, up_to], |r| r.get(0))?
                    .collect::<rusqlite::Result<Vec<i64>>>()
            })
            .await
            .map_err(db_error)
    }

    async fn mark_sent(&self, tx: &mut SqliteTx, ids: &[i64]) -> Result<(), DbError> {
        if ids.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = ids.iter().map(i64::to_string).collect();
        let json = format!("[{}]", list.join(","));
        tx.lease
            .run(move |c| c.prepare_cached(sql::MARK_SENT)?.execute([json]))
            .await
            .map(drop)
            .map_err(db_error)
    }
}
