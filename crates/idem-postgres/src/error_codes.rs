//! PostgreSQL SQLSTATE codes idem classifies.

use idem_core::{DbError, ErrorKind};

/// `feature_not_supported`: among others, what Citus answers to a statement it cannot
/// run on distributed tables (a row lock over several shards, a VOLATILE function in a
/// modification); a [`crate::PurgeStyle::SkipLocked`] purge then retries without row
/// locks.
pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
/// `invalid_sql_statement_name`: an `EXECUTE` of a prepared statement the session no
/// longer has (`DEALLOCATE`).
pub const INVALID_SQL_STATEMENT_NAME: &str = "26000";
/// `unique_violation`.
pub const UNIQUE_VIOLATION: &str = "23505";
/// `not_null_violation`: what a failed guard of the key-lock completion raises on
/// purpose (its column names the guard), so that the `COMMIT` sent after it never runs.
pub const NOT_NULL_VIOLATION: &str = "23502";
/// `serialization_failure`: the loser under REPEATABLE READ / SERIALIZABLE.
pub const SERIALIZATION_FAILURE: &str = "40001";
/// `deadlock_detected`.
pub const DEADLOCK_DETECTED: &str = "40P01";
/// `lock_not_available` (`lock_timeout`, `NOWAIT`).
pub const LOCK_NOT_AVAILABLE: &str = "55P03";
/// `in_failed_sql_transaction`: a statement after an error in the same transaction.
pub const IN_FAILED_SQL_TRANSACTION: &str = "25P02";
/// `invalid_password`: the server refused the password.
pub const INVALID_PASSWORD: &str = "28P01";
/// `invalid_authorization_specification`: an unknown role, or no `pg_hba.conf` entry.
pub const INVALID_AUTHORIZATION_SPECIFICATION: &str = "28000";
/// `invalid_catalog_name`: the database named in the URL does not exist.
pub const INVALID_CATALOG_NAME: &str = "3D000";
/// `undefined_table`: a table the statement names does not exist (idem's migrations
/// have not run, or its schema is not on the session's `search_path`).
pub const UNDEFINED_TABLE: &str = "42P01";
/// `undefined_column`: a column the statement names does not exist (a migration has not
/// run).
pub const UNDEFINED_COLUMN: &str = "42703";
/// `invalid_parameter_value`: what a server-side function raises for a reused key.
pub const INVALID_PARAMETER_VALUE: &str = "22023";
/// `admin_shutdown`: the server ended this session (`pg_terminate_backend`, a fast or
/// immediate shutdown); the connection is gone.
pub const ADMIN_SHUTDOWN: &str = "57P01";
/// `crash_shutdown`: another backend crashed and the server is resetting every
/// session; the connection is gone.
pub const CRASH_SHUTDOWN: &str = "57P02";
/// `cannot_connect_now`: the server is starting up, shutting down or in recovery and
/// refuses new connections.
pub const CANNOT_CONNECT_NOW: &str = "57P03";
/// `idle_session_timeout`: the server closed a session idle longer than
/// `idle_session_timeout`; the connection is gone.
pub const IDLE_SESSION_TIMEOUT: &str = "57P05";

/// What a SQLSTATE means for the protocol.
pub fn kind_of(sqlstate: &str) -> ErrorKind {
    match sqlstate {
        UNIQUE_VIOLATION => ErrorKind::UniqueViolation,
        SERIALIZATION_FAILURE => ErrorKind::SerializationFailure,
        DEADLOCK_DETECTED => ErrorKind::Deadlock,
        LOCK_NOT_AVAILABLE => ErrorKind::LockTimeout,
        INVALID_PASSWORD | INVALID_AUTHORIZATION_SPECIFICATION => ErrorKind::Authentication,
        INVALID_CATALOG_NAME => ErrorKind::MissingDatabase,
        UNDEFINED_TABLE | UNDEFINED_COLUMN => ErrorKind::MissingTable,
        ADMIN_SHUTDOWN | CRASH_SHUTDOWN | CANNOT_CONNECT_NOW | IDLE_SESSION_TIMEOUT => {
            ErrorKind::Connection
        }
        s if s.starts_with("08") => ErrorKind::Connection,
        _ => ErrorKind::Other,
    }
}

/// Classifies an sqlx error.
pub fn classify(e: &sqlx::Error) -> ErrorKind {
    match e {
        sqlx::Error::Database(d) => d.code().map_or(ErrorKind::Other, |c| kind_of(&c)),
        // `Protocol`: the server answered with something that is not PostgreSQL's wire
        // protocol (another engine's port, say).
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed => ErrorKind::Connection,
        sqlx::Error::Configuration(_) => ErrorKind::Configuration,
        _ => ErrorKind::Other,
    }
}

/// Wraps an sqlx error, keeping its SQLSTATE.
pub fn db_error(e: sqlx::Error) -> DbError {
    let kind = classify(&e);
    let code = match &e {
        sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()),
        _ => None,
    };
    let err = DbError::new("postgres", kind, message(&e));
    match code {
        Some(code) => err.with_code(code),
        None => err,
    }
    .with_source(e)
}

/// The server's own words for a database error (message, then detail and hint), without
/// sqlx's Display additions: the server's source line ("at line 948") means nothing to a
/// user. Other errors keep sqlx's text.
fn message(e: &sqlx::Error) -> String {
    let sqlx::Error::Database(d) = e else {
        return e.to_string();
    };
    let mut text = d.message().to_owned();
    if let Some(pg) = d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        if let Some(detail) = pg.detail() {
            text.push_str(&format!(": {detail}"));
        }
        if let Some(hint) = pg.hint() {
            text.push_str(&format!(" (hint: {hint})"));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_classify() {
        assert_eq!(kind_of("23505"), ErrorKind::UniqueViolation);
        assert_eq!(kind_of(NOT_NULL_VIOLATION), ErrorKind::Other);
        assert_eq!(kind_of("40001"), ErrorKind::SerializationFailure);
        assert_eq!(kind_of("40P01"), ErrorKind::Deadlock);
        assert_eq!(kind_of("55P03"), ErrorKind::LockTimeout);
        assert_eq!(kind_of("08006"), ErrorKind::Connection);
        assert_eq!(kind_of("28P01"), ErrorKind::Authentication);
        assert_eq!(kind_of("28000"), ErrorKind::Authentication);
        assert_eq!(kind_of("3D000"), ErrorKind::MissingDatabase);
        assert_eq!(kind_of("42P01"), ErrorKind::MissingTable);
        assert_eq!(kind_of("42703"), ErrorKind::MissingTable);
        assert_eq!(
            classify(&sqlx::Error::Protocol("unexpected message".into())),
            ErrorKind::Connection
        );
        assert_eq!(
            kind_of("23503"),
            ErrorKind::Other,
            "a foreign-key violation is not a duplicate"
        );
        assert_eq!(kind_of("25P02"), ErrorKind::Other);
        assert!(
            kind_of("40001").is_retryable()
                && kind_of("40P01").is_retryable()
                && !kind_of("23505").is_retryable()
        );
    }

    /// A session the server ended (57P01 `pg_terminate_backend` or a shutdown, 57P02
    /// a crash reset, 57P05 the idle-session timeout) or a server refusing connections
    /// for now (57P03) is a lost connection (the CLI's exit 7), not another database
    /// error, and not retried with the same key on a dead session.
    #[test]
    fn a_session_the_server_ended_is_a_connection_error() {
        for code in ["57P01", "57P02", "57P03", "57P05"] {
            assert_eq!(kind_of(code), ErrorKind::Connection, "{code}");
            assert!(!kind_of(code).is_retryable(), "{code}");
        }
        assert_eq!(
            kind_of("57014"),
            ErrorKind::Other,
            "a cancelled statement (statement_timeout) keeps its session"
        );
    }

    /// A statement Citus cannot run on distributed tables is neither retried nor taken
    /// for a lost connection: only the purge reacts to it, by dropping its row locks.
    #[test]
    fn feature_not_supported_is_a_plain_error() {
        assert_eq!(FEATURE_NOT_SUPPORTED, "0A000");
        assert_eq!(kind_of(FEATURE_NOT_SUPPORTED), ErrorKind::Other);
        assert!(!kind_of(FEATURE_NOT_SUPPORTED).is_retryable());
    }
}
