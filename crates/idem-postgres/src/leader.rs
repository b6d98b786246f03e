//! The maintenance lock on PostgreSQL: a session-level advisory lock on a dedicated
//! connection.
//!
//! The lock's key is `hashtextextended(name || '@' || current_schema(), 0)`, computed by
//! the server, so instances elect one runner per lock name and schema (advisory locks are
//! per database already). `pg_try_advisory_lock` takes it without waiting; the session
//! holds it until it unlocks it or ends, and the server ends a session whose client
//! process died as soon as its socket closes. The check reads `pg_locks` for this
//! session's own granted advisory lock on the key.
//!
//! The connection is opened with the pool's options but is not part of the pool. A
//! connection pooler in transaction mode (PgBouncer's `pool_mode = transaction`) hands
//! the session to other clients and breaks session locks: point the maintenance loop
//! at the server, or at a session-mode pool. A runner cut off by the network keeps its
//! lock on the server until the server notices the dead connection (its TCP keepalive
//! settings, `tcp_keepalives_idle` and friends): until then no other instance runs.

use idem_core::maintain::{LeaderLock, check_lock_name};
use idem_core::{DbError, ErrorKind};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};

use crate::{PgBackend, db_error};

/// Tries the lock: `(key, granted, the session's process ID)`.
pub(crate) const TRY_LOCK: &str = "SELECT k, pg_try_advisory_lock(k), pg_backend_pid() \
     FROM (SELECT hashtextextended($1 || '@' || coalesce(current_schema(), ''), 0) AS k) AS s";

/// Whether this session holds the advisory lock with key `$1` (a `bigint` key shows in
/// `pg_locks` as its high half in `classid`, its low half in `objid`, `objsubid` 1).
pub(crate) const HOLDS_LOCK: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks \
     WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted AND objsubid = 1 \
     AND ((classid::int8 << 32) | objid::int8) = $1)";

/// Releases the lock with key `$1`.
pub(crate) const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

/// Every statement of this module, for the snapshot test.
#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("leader_try_lock", TRY_LOCK),
    ("leader_holds_lock", HOLDS_LOCK),
    ("leader_unlock", UNLOCK),
];

/// The maintenance lock of a PostgreSQL database (see the module documentation).
#[derive(Debug, Clone)]
pub struct PgLeaderLock {
    options: PgConnectOptions,
    name: String,
}

/// A held PostgreSQL maintenance lock: its dedicated session and the lock's key.
/// Dropping it closes the connection, which ends the session and its lock.
#[derive(Debug)]
pub struct PgHeld {
    conn: PgConnection,
    key: i64,
    session: i32,
}

impl PgHeld {
    /// The holding session's process ID (`pg_backend_pid()`, what
    /// `pg_terminate_backend` takes).
    pub fn session(&self) -> i32 {
        self.session
    }
}

impl PgLeaderLock {
    /// The lock named `name` (see [`idem_core::maintain::check_lock_name`]), on
    /// sessions opened with `options`.
    pub fn new(options: PgConnectOptions, name: &str) -> Result<Self, DbError> {
        check_lock_name(name)
            .map_err(|e| DbError::new("postgres", ErrorKind::Configuration, e.to_string()))?;
        Ok(Self {
            options,
            name: name.to_owned(),
        })
    }
}

impl PgBackend {
    /// This database's maintenance lock named `name`, on sessions opened with the
    /// pool's connect options (for [`idem_core::maintain::Maintainer`]).
    pub fn leader_lock(&self, name: &str) -> Result<PgLeaderLock, DbError> {
        PgLeaderLock::new((*self.pool().connect_options()).clone(), name)
    }
}

impl LeaderLock for PgLeaderLock {
    type Held = PgHeld;

    async fn try_acquire(&self) -> Result<Option<PgHeld>, DbError> {
        let mut conn = PgConnection::connect_with(&self.options)
            .await
            .map_err(db_error)?;
        let row = sqlx::query(TRY_LOCK)
            .bind(&self.name)
            .fetch_one(&mut conn)
            .await
            .map_err(db_error)?;
        let key: i64 = row.try_get(0).map_err(db_error)?;
        let granted: bool = row.try_get(1).map_err(db_error)?;
        let session: i32 = row.try_get(2).map_err(db_error)?;
        if granted {
            Ok(Some(PgHeld { conn, key, session }))
        } else {
            // Not ours: this session holds nothing; close it.
            let _ = conn.close().await;
            Ok(None)
        }
    }

    async fn is_held(&self, held: &mut PgHeld) -> Result<bool, DbError> {
        sqlx::query_scalar(HOLDS_LOCK)
            .bind(held.key)
            .fetch_one(&mut held.conn)
            .await
            .map_err(db_error)
    }

    async fn release(&self, mut held: PgHeld) -> Result<(), DbError> {
        let unlocked = sqlx::query(UNLOCK)
            .bind(held.key)
            .execute(&mut held.conn)
            .await
            .map_err(db_error);
        let closed = held.conn.close().await.map_err(db_error);
        unlocked.and(closed)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn statements_snapshot() {
        let text: String = super::ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    /// The lock statements modify no table, so Citus's rules for modifications on
    /// distributed tables do not apply; they read only session-local state.
    #[test]
    fn lock_statements_touch_no_idem_table() {
        for (_, sql) in super::ALL {
            assert!(!sql.contains("idem_"), "{sql}");
            for verb in ["INSERT", "UPDATE", "DELETE", "FOR UPDATE"] {
                assert!(!sql.contains(verb), "{sql}");
            }
        }
    }
}
