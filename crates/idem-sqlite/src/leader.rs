//! The maintenance lock on SQLite: an exclusive transaction on a sidecar database file.
//!
//! `BEGIN EXCLUSIVE` on `<database file>.<lock name>.lock` (an empty SQLite database
//! created on first use) takes SQLite's own exclusive lock on that file: an OS advisory
//! lock (`fcntl` on Unix, `LockFileEx` on Windows) that the operating system drops when
//! the process ends, however it ends. Another process's `BEGIN EXCLUSIVE` on the same
//! file fails at once with `SQLITE_BUSY` (busy timeout zero): the lock is taken. The
//! sidecar keeps the lock apart from the database itself, so holding it never blocks a
//! writer or a reader of idem's tables.
//!
//! The lock is held as long as the transaction is open on its connection and the sidecar
//! path still names the same file (a sidecar deleted or replaced while held would let
//! another process lock the new file: the check sees it and gives the lock up).
//!
//! An in-memory database (`sqlite::memory:`) exists in one process only: its lock is
//! always granted, and two maintenance loops over one in-memory database in one process
//! both run.

use std::path::{Path, PathBuf};

use idem_core::maintain::{LeaderLock, check_lock_name};
use idem_core::{DbError, ErrorKind};
use rusqlite::{Connection, ErrorCode, OpenFlags};

use crate::{ENGINE, Location, SqliteBackend, db_error};

/// The maintenance lock of a SQLite database (see the module documentation).
#[derive(Debug, Clone)]
pub struct SqliteLeaderLock {
    /// The sidecar file; `None` for an in-memory database.
    sidecar: Option<PathBuf>,
}

/// A held SQLite maintenance lock: the sidecar's connection inside `BEGIN EXCLUSIVE`.
/// Dropping it closes the connection, which releases the lock.
#[derive(Debug)]
pub struct SqliteHeld {
    conn: Option<Connection>,
    /// The sidecar's identity (device, inode) when the lock was taken.
    file: Option<(u64, u64)>,
}

/// The sidecar of `database` for the lock `name`: `<database file name>.<name>.lock`
/// in the same directory.
pub fn sidecar_path(database: &Path, name: &str) -> PathBuf {
    let mut file = database
        .file_name()
        .map(|f| f.to_os_string())
        .unwrap_or_default();
    file.push(format!(".{name}.lock"));
    database.with_file_name(file)
}

#[cfg(unix)]
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|_| (0, 0))
}

fn busy(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::SqliteFailure(f, _)
            if matches!(f.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

/// Opens the sidecar and tries `BEGIN EXCLUSIVE` without waiting.
fn try_lock(path: &Path) -> Result<Option<SqliteHeld>, DbError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| {
        DbError::new(
            ENGINE,
            ErrorKind::MissingDatabase,
            format!(
                "cannot open the maintenance lock file {}: {e}",
                path.display()
            ),
        )
        .with_source(e)
    })?;
    conn.busy_timeout(std::time::Duration::ZERO)
        .map_err(db_error)?;
    match conn.execute_batch("BEGIN EXCLUSIVE") {
        Ok(()) => Ok(Some(SqliteHeld {
            file: identity(path),
            conn: Some(conn),
        })),
        Err(e) if busy(&e) => Ok(None),
        Err(e) => Err(db_error(e)),
    }
}

impl SqliteLeaderLock {
    /// The lock named `name` (see [`idem_core::maintain::check_lock_name`]) for the
    /// database at `location`.
    pub fn new(location: &Location, name: &str) -> Result<Self, DbError> {
        check_lock_name(name)
            .map_err(|e| DbError::new(ENGINE, ErrorKind::Configuration, e.to_string()))?;
        Ok(Self {
            sidecar: match location {
                Location::File(path) => Some(sidecar_path(path, name)),
                Location::Memory => None,
            },
        })
    }

    /// The sidecar file, or `None` for an in-memory database.
    pub fn sidecar(&self) -> Option<&Path> {
        self.sidecar.as_deref()
    }
}

impl SqliteBackend {
    /// This database's maintenance lock named `name` (for
    /// [`idem_core::maintain::Maintainer`]).
    pub fn leader_lock(&self, name: &str) -> Result<SqliteLeaderLock, DbError> {
        SqliteLeaderLock::new(self.location(), name)
    }
}

impl LeaderLock for SqliteLeaderLock {
    type Held = SqliteHeld;

    async fn try_acquire(&self) -> Result<Option<SqliteHeld>, DbError> {
        let Some(path) = self.sidecar.clone() else {
            return Ok(Some(SqliteHeld {
                conn: None,
                file: None,
            }));
        };
        tokio::task::spawn_blocking(move || try_lock(&path))
            .await
            .map_err(|e| DbError::new(ENGINE, ErrorKind::Other, e.to_string()))?
    }

    async fn is_held(&self, held: &mut SqliteHeld) -> Result<bool, DbError> {
        let (Some(path), Some(conn)) = (self.sidecar.as_deref(), held.conn.as_ref()) else {
            return Ok(self.sidecar.is_none());
        };
        // Both checks are local: a flag of the connection and one stat of the file.
        Ok(!conn.is_autocommit() && held.file.is_some() && identity(path) == held.file)
    }

    async fn release(&self, mut held: SqliteHeld) -> Result<(), DbError> {
        let Some(conn) = held.conn.take() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || {
            let rolled = conn.execute_batch("ROLLBACK");
            let closed = conn.close().map_err(|(_, e)| e);
            rolled.and(closed).map_err(db_error)
        })
        .await
        .map_err(|e| DbError::new(ENGINE, ErrorKind::Other, e.to_string()))?
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_sidecar_sits_beside_the_database() {
        assert_eq!(
            sidecar_path(Path::new("/data/idem.db"), "idem-maintain"),
            PathBuf::from("/data/idem.db.idem-maintain.lock")
        );
        assert_eq!(
            sidecar_path(Path::new("idem.db"), "x"),
            PathBuf::from("idem.db.x.lock")
        );
        assert!(SqliteLeaderLock::new(&Location::Memory, "a/b").is_err());
    }

    #[tokio::test]
    async fn one_holder_at_a_time_and_released_on_drop() {
        let dir = std::env::temp_dir().join(format!("idem-leader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let location = Location::File(dir.join("t.db"));
        let a = SqliteLeaderLock::new(&location, "test").unwrap();
        let b = SqliteLeaderLock::new(&location, "test").unwrap();
        let other = SqliteLeaderLock::new(&location, "other").unwrap();
        let mut held = a.try_acquire().await.unwrap().expect("free at first");
        assert!(a.is_held(&mut held).await.unwrap());
        assert!(b.try_acquire().await.unwrap().is_none(), "taken");
        let other_held = other.try_acquire().await.unwrap();
        assert!(other_held.is_some(), "another name is another lock");
        // A sidecar replaced while held: the holder gives up.
        std::fs::remove_file(a.sidecar().unwrap()).unwrap();
        assert!(!a.is_held(&mut held).await.unwrap());
        drop(held);
        let mut again = b.try_acquire().await.unwrap().expect("free after drop");
        assert!(b.is_held(&mut again).await.unwrap());
        b.release(again).await.unwrap();
        assert!(
            a.try_acquire().await.unwrap().is_some(),
            "free after release"
        );
        let memory = SqliteLeaderLock::new(&Location::Memory, "test").unwrap();
        let mut m = memory.try_acquire().await.unwrap().unwrap();
        assert!(memory.is_held(&mut m).await.unwrap());
        drop(other_held);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
