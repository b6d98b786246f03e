//! The maintenance lock on Oracle: a `DBMS_LOCK` user lock held by a dedicated session.
//!
//! `DBMS_LOCK.ALLOCATE_UNIQUE` turns `idem:` + the lock name + `@` + the current schema
//! into a lock handle (user locks are instance-wide; the schema keeps one runner per
//! lock name and schema), and `DBMS_LOCK.REQUEST` takes it in exclusive mode without
//! waiting (`timeout => 0`) and keeps it across commits (`release_on_commit => FALSE`).
//! The session holds it until `DBMS_LOCK.RELEASE` or until the session ends, and the
//! server ends a session whose client died when its connection closes (with dead
//! connection detection, `SQLNET.EXPIRE_TIME`, for clients that vanished without
//! closing it). The check requests the lock again: `4` ("already own") means this
//! session still holds it. `ALLOCATE_UNIQUE` commits, so the session is used for nothing
//! else. The schema needs `EXECUTE` on `SYS.DBMS_LOCK` (not granted to `PUBLIC` by
//! default).
//!
//! **Not verified live here** (no Oracle Database on the project's machines): the
//! statements and the reading of `DBMS_LOCK`'s return codes are tested offline only.

use idem_core::maintain::{LeaderLock, check_lock_name};
use idem_core::{DbError, ErrorKind};
use oracle::Connection;
use oracle::sql_type::OracleType;

use crate::options::ConnectOptions;
use crate::{ENGINE, OracleBackend, db_error, open_connection};

/// Allocates the handle and requests the lock: binds `:1` the lock name (in), `:2` the
/// request's return code, `:3` the handle, `:4` the session ID (out).
pub(crate) const TRY_LOCK: &str = "DECLARE h VARCHAR2(128); BEGIN \
     DBMS_LOCK.ALLOCATE_UNIQUE(SUBSTR('idem:' || :1 || '@' || SYS_CONTEXT('USERENV', 'CURRENT_SCHEMA'), 1, 128), h); \
     :2 := DBMS_LOCK.REQUEST(h, DBMS_LOCK.X_MODE, 0, FALSE); \
     :3 := h; \
     :4 := TO_NUMBER(SYS_CONTEXT('USERENV', 'SID')); END;";

/// Requests the held lock again: `:1` the return code (out), `:2` the handle (in);
/// `4` means this session already owns it.
pub(crate) const HOLDS_LOCK: &str =
    "BEGIN :1 := DBMS_LOCK.REQUEST(:2, DBMS_LOCK.X_MODE, 0, FALSE); END;";

/// Releases the lock: `:1` the return code (out), `:2` the handle (in).
pub(crate) const UNLOCK: &str = "BEGIN :1 := DBMS_LOCK.RELEASE(:2); END;";

/// Every statement of this module, for the snapshot test.
#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("leader_try_lock", TRY_LOCK),
    ("leader_holds_lock", HOLDS_LOCK),
    ("leader_unlock", UNLOCK),
];

/// What `DBMS_LOCK.REQUEST`'s return code means for a first request: `Ok(true)` granted
/// (0 success, 4 already owned by this session), `Ok(false)` not granted now (1 timed
/// out: another session holds it; 2 deadlock), an error for 3 (parameter error), 5
/// (illegal lock handle) and anything undocumented.
pub(crate) fn granted(code: i64) -> Result<bool, DbError> {
    match code {
        0 | 4 => Ok(true),
        1 | 2 => Ok(false),
        other => Err(DbError::new(
            ENGINE,
            ErrorKind::Other,
            format!(
                "DBMS_LOCK.REQUEST answered {other}: the maintenance lock could not be requested"
            ),
        )
        .with_code(other.to_string())),
    }
}

/// Whether a repeated request's code says the lock was still held: only 4 ("already
/// own"). A 0 means the session had lost it and just took it again, which another
/// session may have held in between: that counts as lost.
pub(crate) fn still_owned(code: i64) -> bool {
    code == 4
}

/// The maintenance lock of an Oracle schema (see the module documentation).
#[derive(Debug, Clone)]
pub struct OracleLeaderLock {
    options: ConnectOptions,
    name: String,
}

/// A held Oracle maintenance lock: its dedicated session and the lock handle. Dropping
/// it closes the connection, which ends the session and its lock.
pub struct OracleHeld {
    conn: Option<Connection>,
    handle: String,
    session: i64,
}

impl std::fmt::Debug for OracleHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OracleHeld")
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl OracleHeld {
    /// The holding session's ID (`SYS_CONTEXT('USERENV', 'SID')`).
    pub fn session(&self) -> i64 {
        self.session
    }
}

impl OracleBackend {
    /// This schema's maintenance lock named `name` (see
    /// [`idem_core::maintain::check_lock_name`]), on a session opened with this
    /// backend's options (for [`idem_core::maintain::Maintainer`]).
    pub fn leader_lock(&self, name: &str) -> Result<OracleLeaderLock, DbError> {
        check_lock_name(name)
            .map_err(|e| DbError::new(ENGINE, ErrorKind::Configuration, e.to_string()))?;
        Ok(OracleLeaderLock {
            options: self.options().clone(),
            name: name.to_owned(),
        })
    }
}

fn joined<T>(r: Result<Result<T, DbError>, tokio::task::JoinError>) -> Result<T, DbError> {
    r.map_err(|e| DbError::new(ENGINE, ErrorKind::Other, e.to_string()))?
}

fn try_lock(options: &ConnectOptions, name: &str) -> Result<Option<OracleHeld>, DbError> {
    let conn = open_connection(options)?;
    let stmt = conn
        .execute(
            TRY_LOCK,
            &[
                &name,
                &OracleType::Number(0, 0),
                &OracleType::Varchar2(128),
                &OracleType::Number(0, 0),
            ],
        )
        .map_err(db_error)?;
    let code: i64 = stmt.bind_value(2).map_err(db_error)?;
    let handle: String = stmt.bind_value(3).map_err(db_error)?;
    let session: i64 = stmt.bind_value(4).map_err(db_error)?;
    drop(stmt);
    if granted(code)? {
        Ok(Some(OracleHeld {
            conn: Some(conn),
            handle,
            session,
        }))
    } else {
        let _ = conn.close();
        Ok(None)
    }
}

fn request_again(conn: &Connection, handle: &str) -> Result<i64, DbError> {
    let stmt = conn
        .execute(HOLDS_LOCK, &[&OracleType::Number(0, 0), &handle])
        .map_err(db_error)?;
    stmt.bind_value(1).map_err(db_error)
}

impl LeaderLock for OracleLeaderLock {
    type Held = OracleHeld;

    async fn try_acquire(&self) -> Result<Option<OracleHeld>, DbError> {
        let (options, name) = (self.options.clone(), self.name.clone());
        joined(tokio::task::spawn_blocking(move || try_lock(&options, &name)).await)
    }

    async fn is_held(&self, held: &mut OracleHeld) -> Result<bool, DbError> {
        let Some(conn) = held.conn.take() else {
            return Ok(false);
        };
        let handle = held.handle.clone();
        let (conn, code) = tokio::task::spawn_blocking(move || {
            let code = request_again(&conn, &handle);
            (conn, code)
        })
        .await
        .map_err(|e| DbError::new(ENGINE, ErrorKind::Other, e.to_string()))?;
        held.conn = Some(conn);
        Ok(still_owned(code?))
    }

    async fn release(&self, mut held: OracleHeld) -> Result<(), DbError> {
        let Some(conn) = held.conn.take() else {
            return Ok(());
        };
        let handle = held.handle.clone();
        joined(
            tokio::task::spawn_blocking(move || {
                let released = conn
                    .execute(UNLOCK, &[&OracleType::Number(0, 0), &handle])
                    .map(drop)
                    .map_err(db_error);
                let closed = conn.close().map_err(db_error);
                released.and(closed)
            })
            .await,
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn statements_snapshot() {
        let text: String = ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql}\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    #[test]
    fn dbms_lock_codes_are_read_as_documented() {
        assert!(granted(0).unwrap());
        assert!(granted(4).unwrap());
        assert!(!granted(1).unwrap());
        assert!(!granted(2).unwrap());
        for bad in [3, 5, 9] {
            assert_eq!(
                granted(bad).unwrap_err().code(),
                Some(bad.to_string().as_str())
            );
        }
        assert!(still_owned(4));
        assert!(!still_owned(0), "lost, then taken again: counts as lost");
        assert!(!still_owned(1));
    }

    #[test]
    fn the_lock_never_waits_and_survives_commits() {
        assert!(TRY_LOCK.contains("DBMS_LOCK.X_MODE, 0, FALSE"));
        assert!(HOLDS_LOCK.contains("DBMS_LOCK.X_MODE, 0, FALSE"));
    }
}
