//! The maintenance lock on SQL Server: an application lock owned by a dedicated session.
//!
//! `sp_getapplock` with `@LockOwner = 'Session'`, `@LockMode = 'Exclusive'` and
//! `@LockTimeout = 0` takes the lock named after the lock name without waiting (an
//! application lock's resource belongs to the current database, so each database elects
//! on its own). The session holds it until `sp_releaseapplock` or until the session
//! ends, and the server ends a session whose client process died as soon as its socket
//! closes. The check asks `APPLOCK_MODE` whether this session still holds it
//! exclusively.
//!
//! **Not verified live here** (no SQL Server on the project's machines): the statements
//! and the reading of `sp_getapplock`'s return codes are tested offline only.

use idem_core::maintain::{LeaderLock, check_lock_name};
use idem_core::{DbError, ErrorKind};

use crate::error_codes::db_error;
use crate::options::MssqlOptions;
use crate::pool::{MssqlClient, open};
use crate::{ENGINE, MssqlBackend};

/// Tries the lock: `(sp_getapplock's return code, @@SPID)`.
pub(crate) const TRY_LOCK: &str = "DECLARE @r int; \
     EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', \
     @LockOwner = 'Session', @LockTimeout = 0, @DbPrincipal = 'public'; \
     SELECT @r, CAST(@@SPID AS int)";

/// This session's mode on the lock: `Exclusive` while it holds it, `NoLock` otherwise.
pub(crate) const HOLDS_LOCK: &str = "SELECT APPLOCK_MODE('public', @P1, 'Session')";

/// Releases the lock: `sp_releaseapplock`'s return code (0 released, -999 not held).
pub(crate) const UNLOCK: &str = "DECLARE @r int; \
     EXEC @r = sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', \
     @DbPrincipal = 'public'; SELECT @r";

/// Every statement of this module, for the snapshot test.
#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("leader_try_lock", TRY_LOCK),
    ("leader_holds_lock", HOLDS_LOCK),
    ("leader_unlock", UNLOCK),
];

/// What `sp_getapplock`'s return code means: `Ok(true)` granted (0, or 1 after a wait),
/// `Ok(false)` not granted now (-1 timed out: another session holds it; -2 cancelled;
/// -3 chosen as deadlock victim), an error for -999 (invalid parameters or a call
/// error) and anything undocumented.
pub(crate) fn granted(code: i32) -> Result<bool, DbError> {
    match code {
        0 | 1 => Ok(true),
        -3..=-1 => Ok(false),
        other => Err(DbError::new(
            ENGINE,
            ErrorKind::Other,
            format!("sp_getapplock answered {other}: the maintenance lock could not be requested"),
        )
        .with_code(other.to_string())),
    }
}

/// The maintenance lock of a SQL Server database (see the module documentation).
#[derive(Debug, Clone)]
pub struct MssqlLeaderLock {
    options: MssqlOptions,
    name: String,
}

/// A held SQL Server maintenance lock: its dedicated session. Dropping it closes the
/// connection, which ends the session and its lock.
pub struct MssqlHeld {
    client: MssqlClient,
    session: i32,
}

impl std::fmt::Debug for MssqlHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MssqlHeld")
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl MssqlHeld {
    /// The holding session's ID (`@@SPID`, what `KILL` takes).
    pub fn session(&self) -> i32 {
        self.session
    }
}

impl MssqlBackend {
    /// This database's maintenance lock named `name` (see
    /// [`idem_core::maintain::check_lock_name`]), on a session opened with this
    /// backend's options (for [`idem_core::maintain::Maintainer`]).
    pub fn leader_lock(&self, name: &str) -> Result<MssqlLeaderLock, DbError> {
        check_lock_name(name)
            .map_err(|e| DbError::new(ENGINE, ErrorKind::Configuration, e.to_string()))?;
        Ok(MssqlLeaderLock {
            options: self.options().clone(),
            name: name.to_owned(),
        })
    }
}

async fn first_row(
    client: &mut MssqlClient,
    sql: &str,
    name: &str,
) -> Result<Option<tiberius::Row>, DbError> {
    let stream = client.query(sql, &[&name]).await.map_err(db_error)?;
    stream.into_row().await.map_err(db_error)
}

impl LeaderLock for MssqlLeaderLock {
    type Held = MssqlHeld;

    async fn try_acquire(&self) -> Result<Option<MssqlHeld>, DbError> {
        let mut client = open(&self.options).await?;
        let row = first_row(&mut client, TRY_LOCK, &self.name).await?;
        let (code, session) = match &row {
            Some(row) => (
                row.try_get::<i32, _>(0).map_err(db_error)?,
                row.try_get::<i32, _>(1).map_err(db_error)?,
            ),
            None => (None, None),
        };
        let code = code.ok_or_else(|| {
            DbError::new(ENGINE, ErrorKind::Other, "sp_getapplock returned no code")
        })?;
        if granted(code)? {
            Ok(Some(MssqlHeld {
                client,
                session: session.unwrap_or(0),
            }))
        } else {
            let _ = client.close().await;
            Ok(None)
        }
    }

    async fn is_held(&self, held: &mut MssqlHeld) -> Result<bool, DbError> {
        let row = first_row(&mut held.client, HOLDS_LOCK, &self.name).await?;
        let mode = match &row {
            Some(row) => row
                .try_get::<&str, _>(0)
                .map_err(db_error)?
                .map(str::to_owned),
            None => None,
        };
        Ok(mode.as_deref() == Some("Exclusive"))
    }

    async fn release(&self, mut held: MssqlHeld) -> Result<(), DbError> {
        let released = first_row(&mut held.client, UNLOCK, &self.name).await;
        let closed = held.client.close().await.map_err(db_error);
        released?;
        closed
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
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    #[test]
    fn applock_codes_are_read_as_documented() {
        assert!(granted(0).unwrap());
        assert!(granted(1).unwrap());
        for taken in [-1, -2, -3] {
            assert!(!granted(taken).unwrap(), "{taken}");
        }
        let e = granted(-999).unwrap_err();
        assert_eq!(e.code(), Some("-999"));
        assert!(granted(7).is_err());
    }

    #[test]
    fn the_lock_is_session_owned_and_never_waits() {
        assert!(TRY_LOCK.contains("@LockOwner = 'Session'"));
        assert!(TRY_LOCK.contains("@LockTimeout = 0"));
        assert!(UNLOCK.contains("@LockOwner = 'Session'"));
        assert!(HOLDS_LOCK.contains("'Session'"));
    }
}
