//! The maintenance lock on MySQL and MariaDB: a named lock (`GET_LOCK`) on a dedicated
//! connection.
//!
//! The lock's name is `idem:` and 40 hex digits of SHA-256 over the lock name, `@` and
//! the current database, computed by the server (named locks are server-wide; this keeps
//! one runner per lock name and database, and within the 64-character limit).
//! `GET_LOCK(name, 0)` takes it without waiting; the session holds it until
//! `RELEASE_LOCK` or until the session ends, and the server ends a session whose client
//! process died as soon as its socket closes. The check asks `IS_USED_LOCK(name)` whether
//! the holder is still this connection.
//!
//! The connection is opened with the pool's options but is not part of the pool (a
//! pooled session may be reset, which releases named locks). **Galera:** named locks are
//! local to one node (seen on MariaDB 10.11.19 with Galera 4: a second node grants the
//! same name while the first holds it), so instances connected to different nodes of a
//! cluster each elect a runner of their own; point every maintenance loop at the same
//! node (or accept one runner per node: every task is safe to run twice at once). Some
//! MariaDB releases refuse `GET_LOCK` while `wsrep_on` is set (error 1235, MDEV-30473);
//! the lock's session then turns `wsrep_on` off for itself (it writes nothing, so nothing
//! of it needs replicating; that takes the privilege to set `wsrep_on`) and tries again.
//! A runner cut off by the network keeps its lock until the server notices the dead
//! connection (`wait_timeout`, TCP keepalive): until then no other instance runs.

use idem_core::maintain::{LeaderLock, check_lock_name};
use idem_core::{DbError, ErrorKind};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Pool};

use crate::{ENGINE, MysqlBackend, db_error};

/// Tries the lock: `(name, granted, connection id)`; `granted` is 1, 0 (taken) or NULL.
pub(crate) const TRY_LOCK: &str = "SELECT n, GET_LOCK(n, 0), CONNECTION_ID() \
     FROM (SELECT CONCAT('idem:', LEFT(SHA2(CONCAT(?, '@', COALESCE(DATABASE(), '')), 256), 40)) AS n) AS s";

/// Whether this session holds the named lock `?`.
pub(crate) const HOLDS_LOCK: &str = "SELECT COALESCE(IS_USED_LOCK(?) = CONNECTION_ID(), 0)";

/// Releases the named lock `?`.
pub(crate) const UNLOCK: &str = "SELECT RELEASE_LOCK(?)";

/// For a Galera node that refuses named locks while replicating the session: this
/// session's writes (it makes none) are not replicated.
pub(crate) const LOCAL_SESSION: &str = "SET SESSION wsrep_on = OFF";

/// `ER_NOT_SUPPORTED_YET`: what a MariaDB Galera node that refuses `GET_LOCK` in a
/// cluster answers.
pub(crate) const NOT_SUPPORTED_YET: u16 = 1235;

/// Every statement of this module, for the snapshot test.
#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("leader_try_lock", TRY_LOCK),
    ("leader_holds_lock", HOLDS_LOCK),
    ("leader_unlock", UNLOCK),
    ("leader_local_session", LOCAL_SESSION),
];

/// The maintenance lock of a MySQL or MariaDB database (see the module documentation).
#[derive(Debug, Clone)]
pub struct MysqlLeaderLock {
    pool: Pool,
    name: String,
}

/// A held MySQL/MariaDB maintenance lock: its dedicated session and the lock's name.
/// Dropping it closes the connection, which ends the session and its lock.
#[derive(Debug)]
pub struct MysqlHeld {
    conn: Conn,
    lock: String,
    session: u32,
}

impl MysqlHeld {
    /// The holding session's connection ID (`CONNECTION_ID()`, what `KILL` takes).
    pub fn session(&self) -> u32 {
        self.session
    }
}

impl MysqlBackend {
    /// This database's maintenance lock named `name` (see
    /// [`idem_core::maintain::check_lock_name`]), on a session opened with the pool's
    /// options (for [`idem_core::maintain::Maintainer`]).
    pub fn leader_lock(&self, name: &str) -> Result<MysqlLeaderLock, DbError> {
        check_lock_name(name)
            .map_err(|e| DbError::new(ENGINE, ErrorKind::Configuration, e.to_string()))?;
        Ok(MysqlLeaderLock {
            pool: self.pool().clone(),
            name: name.to_owned(),
        })
    }
}

impl LeaderLock for MysqlLeaderLock {
    type Held = MysqlHeld;

    async fn try_acquire(&self) -> Result<Option<MysqlHeld>, DbError> {
        // The pool's options (address, user, database), for a session of our own.
        let opts = {
            let pooled = self.pool.get_conn().await.map_err(db_error)?;
            pooled.opts().clone()
        };
        let mut conn = Conn::new(opts).await.map_err(db_error)?;
        let tried: Result<Option<(String, Option<i64>, u32)>, _> =
            conn.exec_first(TRY_LOCK, (self.name.as_str(),)).await;
        let row = match tried {
            Err(e) if crate::error_codes::server_code(&e) == Some(NOT_SUPPORTED_YET) => {
                conn.query_drop(LOCAL_SESSION).await.map_err(|e| {
                    DbError::new(
                        ENGINE,
                        ErrorKind::Configuration,
                        format!(
                            "this Galera node refuses GET_LOCK while the session is replicated, \
                             and the maintenance lock's session could not turn wsrep_on off \
                             (it needs the privilege to set it): {e}"
                        ),
                    )
                })?;
                conn.exec_first(TRY_LOCK, (self.name.as_str(),))
                    .await
                    .map_err(db_error)?
            }
            other => other.map_err(db_error)?,
        };
        match row {
            Some((lock, Some(1), session)) => Ok(Some(MysqlHeld {
                conn,
                lock,
                session,
            })),
            _ => {
                let _ = conn.disconnect().await;
                Ok(None)
            }
        }
    }

    async fn is_held(&self, held: &mut MysqlHeld) -> Result<bool, DbError> {
        let mine: Option<i64> = held
            .conn
            .exec_first(HOLDS_LOCK, (held.lock.as_str(),))
            .await
            .map_err(db_error)?;
        Ok(mine == Some(1))
    }

    async fn release(&self, mut held: MysqlHeld) -> Result<(), DbError> {
        let released: Result<Option<Option<i64>>, _> =
            held.conn.exec_first(UNLOCK, (held.lock.as_str(),)).await;
        let closed = held.conn.disconnect().await.map_err(db_error);
        released.map_err(db_error)?;
        closed
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
}
