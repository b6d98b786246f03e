//! [`PgTx`]: the transaction idem opens on a pooled connection and hands to effects.

use std::fmt;
use std::ops::{Deref, DerefMut};

use idem_core::DbError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgTransactionManager};
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use crate::db_error;

/// A connection from `pool`, for a call of idem's. sqlx's checkout future is about 8.5
/// KiB in a release build of sqlx 0.9 (it holds the pool's whole connect path): awaited
/// in place, it would carry that size into every future above it (`Idem::execute`'s was
/// 19.4 KiB; `crates/idem/tests/future_sizes.rs` guards it). So it is boxed, and built in
/// the box (`Box::write` into an uninitialized one), since `Box::pin` would build it on the
/// stack and copy it to the heap on every checkout (docs/performance.md, thirteenth and
/// fourteenth rounds).
pub(crate) async fn checkout(pool: &sqlx::PgPool) -> Result<PoolConnection<Postgres>, DbError> {
    Box::into_pin(Box::write(Box::new_uninit(), pool.acquire()))
        .await
        .map_err(db_error)
}

/// The transaction handed to effects (and to the phases of a run): the idem record and
/// the effect's SQL commit or roll back together.
///
/// It dereferences to the pooled [`PgConnection`], so effects run their SQL on it as on a
/// `sqlx::Transaction`: `sqlx::query("UPDATE …").execute(&mut **tx)`. Never commit or
/// roll it back yourself. A savepoint is `sqlx::Connection::begin(&mut **tx)`: sqlx
/// counts idem's transaction, so a nested `begin` is a `SAVEPOINT`, as on its own
/// transactions.
///
/// idem owns the connection rather than a `sqlx::Transaction` so that the statements that
/// open and end the transaction can travel with its own (see the crate documentation's
/// round trips), while the transaction is still counted by sqlx's own bookkeeping
/// (`TransactionManager`). Dropped while open (a cancelled call, a panicking effect), it
/// does what a dropped `sqlx::Transaction` does: a `ROLLBACK` is queued and sent with
/// the pool's check of the returned connection, which is closed if that fails; `Drop`
/// itself sends nothing.
pub struct PgTx {
    conn: PoolConnection<Postgres>,
    /// A key-lock claim's times and whether it replaces an expired record: what its
    /// completion writes.
    pub(crate) key_lock: Option<(crate::sql::ClaimTimes, bool)>,
}

impl PgTx {
    /// Opens a transaction on `conn` with `BEGIN`, or with `statement`: one simple-query
    /// message whose first statement is `BEGIN` (a wait bound, a key lock). When such a
    /// message fails after its `BEGIN` ran (a lock that did not come within
    /// `lock_timeout`), the server is left inside an aborted transaction that sqlx does
    /// not count: it is rolled back here (one more round trip, on that path only), and a
    /// connection that cannot be rolled back is closed, never reused.
    pub(crate) async fn open(
        mut conn: PoolConnection<Postgres>,
        statement: Option<String>,
    ) -> Result<Self, DbError> {
        let custom = statement.is_some();
        let statement = statement.map(|s| AssertSqlSafe(s).into_sql_str());
        match PgTransactionManager::begin(&mut conn, statement).await {
            Ok(()) => Ok(Self {
                conn,
                key_lock: None,
            }),
            Err(e) => {
                if custom {
                    let server_error = matches!(e, sqlx::Error::Database(_));
                    if !server_error || sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.is_err()
                    {
                        conn.close_on_drop();
                    }
                }
                Err(db_error(e))
            }
        }
    }

    /// Opens a transaction of your own on a connection from `pool`, outside idem (no
    /// record, no claim): to run an effect written for idem (`async fn debit(tx: &mut
    /// PgTx, …)`) in a migration, an admin tool or a test. End it with [`commit`] or
    /// [`rollback`]; dropped while open, it rolls back. The transactions idem hands to
    /// effects come as `&mut PgTx`, which neither can end.
    ///
    /// [`commit`]: PgTx::commit
    /// [`rollback`]: PgTx::rollback
    pub async fn begin(pool: &sqlx::PgPool) -> Result<Self, DbError> {
        let conn = checkout(pool).await?;
        Self::open(conn, None).await
    }

    /// Commits (`COMMIT`, one round trip).
    pub async fn commit(mut self) -> Result<(), DbError> {
        PgTransactionManager::commit(&mut self.conn)
            .await
            .map_err(db_error)
    }

    /// Rolls back (`ROLLBACK`, one round trip). If that fails the drop queues another
    /// and the pool closes the connection when its check fails.
    pub async fn rollback(mut self) -> Result<(), DbError> {
        PgTransactionManager::rollback(&mut self.conn)
            .await
            .map_err(db_error)
    }

    /// Rolls back, then runs `statement` on the connection outside any transaction.
    pub(crate) async fn rollback_then(mut self, statement: &'static str) -> Result<(), DbError> {
        PgTransactionManager::rollback(&mut self.conn)
            .await
            .map_err(db_error)?;
        sqlx::raw_sql(statement)
            .execute(&mut *self.conn)
            .await
            .map(drop)
            .map_err(db_error)
    }

    /// Sends `message`, one simple query that ends idem's transaction with `COMMIT` and
    /// then opens an empty one (`…; COMMIT; BEGIN`). sqlx still counts one transaction on
    /// the connection, and only its own queued `ROLLBACK` brings that count back to zero
    /// without a round trip: it ends the empty transaction, sent with the pool's check of
    /// the returned connection. On an error the transaction comes back, still open (and
    /// counted), for the caller to roll back.
    pub(crate) async fn commit_with(mut self, message: String) -> Result<(), (Self, sqlx::Error)> {
        match sqlx::raw_sql(AssertSqlSafe(message))
            .execute(&mut *self.conn)
            .await
        {
            Ok(_) => {
                PgTransactionManager::start_rollback(&mut self.conn);
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        // Queued, not sent: sqlx sends it with the returned connection's check (a failed
        // one closes the connection). One level per call: a savepoint an effect left
        // open, then idem's transaction.
        while PgTransactionManager::get_transaction_depth(&self.conn) > 0 {
            PgTransactionManager::start_rollback(&mut self.conn);
        }
    }
}

impl Deref for PgTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl AsMut<PgConnection> for PgTx {
    fn as_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTx")
            .field(
                "depth",
                &PgTransactionManager::get_transaction_depth(&self.conn),
            )
            .finish_non_exhaustive()
    }
}
