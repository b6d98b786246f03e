//! SQLite result codes idem classifies (primary and extended codes).

use idem_core::{DbError, ErrorKind};

/// The database file is locked by another connection.
pub const SQLITE_BUSY: i32 = 5;
/// A table is locked (shared cache).
pub const SQLITE_LOCKED: i32 = 6;
/// The database file cannot be opened (a missing directory, no permission).
pub const SQLITE_CANTOPEN: i32 = 14;
/// A constraint failed.
pub const SQLITE_CONSTRAINT: i32 = 19;
/// A DEFERRED transaction's read snapshot went stale before it could write.
pub const SQLITE_BUSY_SNAPSHOT: i32 = 517;
/// A value of the wrong type for a `STRICT` table's column.
pub const SQLITE_CONSTRAINT_DATATYPE: i32 = 3091;
/// A PRIMARY KEY constraint failed.
pub const SQLITE_CONSTRAINT_PRIMARYKEY: i32 = 1555;
/// A UNIQUE constraint failed.
pub const SQLITE_CONSTRAINT_UNIQUE: i32 = 2067;

/// What an extended result code means for the protocol.
pub fn kind_of(extended_code: i32) -> ErrorKind {
    match extended_code {
        SQLITE_CONSTRAINT_PRIMARYKEY | SQLITE_CONSTRAINT_UNIQUE => ErrorKind::UniqueViolation,
        c if c & 0xff == SQLITE_CANTOPEN => ErrorKind::MissingDatabase,
        c if c & 0xff == SQLITE_BUSY || c & 0xff == SQLITE_LOCKED => ErrorKind::Busy,
        _ => ErrorKind::Other,
    }
}

/// The generic error: among others, a statement that names a missing table or column.
pub const SQLITE_ERROR: i32 = 1;

/// The failure SQLite reported, with its message: an error from a statement's execution
/// (`SqliteFailure`) or from its preparation (`SqlInputError`, which also carries the
/// statement).
fn failure(e: &rusqlite::Error) -> Option<(&rusqlite::ffi::Error, Option<&str>)> {
    match e {
        rusqlite::Error::SqliteFailure(f, msg) => Some((f, msg.as_deref())),
        rusqlite::Error::SqlInputError { error, msg, .. } => Some((error, Some(msg.as_str()))),
        _ => None,
    }
}

/// Whether a generic `SQLITE_ERROR` says a table or column is missing. SQLite has no
/// result code of its own for it, so this one test reads the message: SQLite's messages
/// are fixed English text, never localized (a unit test holds the bundled SQLite to
/// these two prefixes).
fn is_missing_table(f: &rusqlite::ffi::Error, msg: Option<&str>) -> bool {
    f.extended_code == SQLITE_ERROR
        && msg.is_some_and(|m| m.starts_with("no such table:") || m.starts_with("no such column:"))
}

/// Classifies a rusqlite error by its result code (and a missing table or column by
/// the message of the generic `SQLITE_ERROR`, see [`ErrorKind::MissingTable`]).
pub fn classify(e: &rusqlite::Error) -> ErrorKind {
    match failure(e) {
        Some((f, msg)) if is_missing_table(f, msg) => ErrorKind::MissingTable,
        Some((f, _)) => kind_of(f.extended_code),
        None => ErrorKind::Other,
    }
}

/// The completion's window guard: the record's `expires_at` was the text `'ended'`
/// because its window ended while the effect ran (`UPSERT_REQUEST`, `UPSERT_MESSAGE`).
/// By code alone: every other value those statements bind has its column's type (Rust
/// strings for `TEXT`, integers for `INTEGER`, or NULL), so in them only the guard can
/// raise `SQLITE_CONSTRAINT_DATATYPE`.
pub fn is_window_guard(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.extended_code == SQLITE_CONSTRAINT_DATATYPE)
}

/// Wraps a rusqlite error, keeping its extended result code.
pub fn db_error(e: rusqlite::Error) -> DbError {
    let kind = classify(&e);
    let code = failure(&e).map(|(f, _)| f.extended_code.to_string());
    let err = DbError::new("sqlite", kind, e.to_string());
    let err = match code {
        Some(code) => err.with_code(code),
        None => err,
    };
    err.with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_classify() {
        assert_eq!(
            kind_of(SQLITE_CONSTRAINT_PRIMARYKEY),
            ErrorKind::UniqueViolation
        );
        assert_eq!(
            kind_of(SQLITE_CONSTRAINT_UNIQUE),
            ErrorKind::UniqueViolation
        );
        assert_eq!(kind_of(SQLITE_BUSY), ErrorKind::Busy);
        assert_eq!(kind_of(SQLITE_BUSY_SNAPSHOT), ErrorKind::Busy);
        assert_eq!(kind_of(SQLITE_LOCKED), ErrorKind::Busy);
        assert_eq!(kind_of(SQLITE_CANTOPEN), ErrorKind::MissingDatabase);
        assert_eq!(
            kind_of(SQLITE_CONSTRAINT),
            ErrorKind::Other,
            "NOT NULL/CHECK are not duplicates"
        );
        assert_eq!(kind_of(275), ErrorKind::Other, "SQLITE_CONSTRAINT_CHECK");
    }

    #[test]
    fn missing_tables_and_columns_classify() {
        let conn = rusqlite::Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch("CREATE TABLE t (k TEXT PRIMARY KEY)")
            .unwrap_or_else(|e| panic!("{e}"));
        for sql in [
            "SELECT k FROM idem_request_result",
            "DELETE FROM idem_outbox",
            "SELECT missing FROM t",
            "UPDATE t SET missing = 1",
        ] {
            let prepared = conn.prepare(sql).map(drop).unwrap_err();
            let executed = conn.execute_batch(sql).unwrap_err();
            for e in [prepared, executed] {
                let err = db_error(e);
                assert_eq!(
                    (err.kind(), err.code()),
                    (ErrorKind::MissingTable, Some("1")),
                    "{sql}: {err}"
                );
            }
        }
        // Other generic errors stay unclassified.
        let syntax = conn.prepare("SELEC 1").map(drop).unwrap_err();
        assert_eq!(db_error(syntax).kind(), ErrorKind::Other);
    }

    #[test]
    fn real_errors_classify() {
        let conn = rusqlite::Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        conn.execute_batch("CREATE TABLE t (k TEXT PRIMARY KEY, v INTEGER CHECK (v > 0)); INSERT INTO t VALUES ('k', 1);")
            .unwrap_or_else(|e| panic!("{e}"));
        let dup = conn
            .execute("INSERT INTO t VALUES ('k', 2)", [])
            .unwrap_err();
        let err = db_error(dup);
        assert_eq!(
            (err.kind(), err.code()),
            (ErrorKind::UniqueViolation, Some("1555"))
        );
        let check = conn
            .execute("INSERT INTO t VALUES ('j', 0)", [])
            .unwrap_err();
        assert_eq!(classify(&check), ErrorKind::Other);
    }

    /// The completion's window guard is told apart from every other failure of the same
    /// statements: run for real against the migrated tables.
    #[test]
    fn window_guard_is_the_expired_completion_only() {
        let conn = rusqlite::Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        for m in crate::MIGRATIONS {
            conn.execute_batch(m.sql).unwrap_or_else(|e| panic!("{e}"));
        }
        let now: i64 = conn
            .query_row(crate::sql::NOW, [], |r| r.get(0))
            .unwrap_or_else(|e| panic!("{e}"));
        let request = |expires_at: i64, response: Option<&str>| {
            conn.execute(
                crate::sql::UPSERT_REQUEST,
                rusqlite::params!["p", "op:v1", "k", "{}", response, 0, now, expires_at],
            )
        };
        let ended = request(now - 1, Some("{}")).unwrap_err();
        assert!(is_window_guard(&ended), "{ended}");
        let other = request(now + 60_000_000, None).unwrap_err();
        assert!(!is_window_guard(&other), "{other}");
        assert_eq!(request(now + 60_000_000, Some("{}")).ok(), Some(1));
        let message = |expires_at: i64| {
            conn.execute(
                crate::sql::UPSERT_MESSAGE,
                rusqlite::params!["s", "m", None::<String>, now, expires_at],
            )
        };
        let ended = message(now - 1).unwrap_err();
        assert!(is_window_guard(&ended), "{ended}");
        assert_eq!(message(now + 60_000_000).ok(), Some(1));
    }
}
