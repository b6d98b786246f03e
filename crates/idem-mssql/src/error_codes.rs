//! SQL Server error numbers idem classifies, by number (messages are localized).
//!
//! The numbers and their meaning come from Microsoft's "Database engine events and
//! errors" reference; none was observed live on this project's machines.

use idem_core::{DbError, ErrorKind};
use tiberius::error::{Error, TokenError};

use crate::ENGINE;

/// `Violation of PRIMARY KEY / UNIQUE constraint`: the claim lost the race.
pub const UNIQUE_CONSTRAINT_VIOLATION: u32 = 2627;
/// `Cannot insert duplicate key row … with unique index`.
pub const DUPLICATE_KEY_ROW: u32 = 2601;
/// `Transaction … was deadlocked … and has been chosen as the deadlock victim`. The
/// server has already rolled the transaction back.
pub const DEADLOCK_VICTIM: u32 = 1205;
/// `Lock request time out period exceeded` (`SET LOCK_TIMEOUT`). Only the statement
/// is ended; idem rolls the transaction back and retries it.
pub const LOCK_REQUEST_TIMEOUT: u32 = 1222;
/// `Snapshot isolation transaction aborted due to update conflict`.
pub const SNAPSHOT_UPDATE_CONFLICT: u32 = 3960;
/// `Snapshot isolation transaction failed … because the object accessed by the
/// statement has been modified by a DDL statement in another concurrent transaction`.
pub const SNAPSHOT_DDL_CONFLICT: u32 = 3961;
/// `Snapshot isolation transaction failed accessing database … because snapshot
/// isolation is not allowed in this database` (`ALLOW_SNAPSHOT_ISOLATION` is OFF).
pub const SNAPSHOT_NOT_ALLOWED: u32 = 3952;
/// In-Memory OLTP: `The current transaction attempted to update a record that has been
/// updated since this transaction started`.
pub const XTP_UPDATE_CONFLICT: u32 = 41302;
/// In-Memory OLTP: repeatable-read validation failure.
pub const XTP_REPEATABLE_READ_VALIDATION: u32 = 41305;
/// In-Memory OLTP: serializable validation failure.
pub const XTP_SERIALIZABLE_VALIDATION: u32 = 41325;
/// In-Memory OLTP: a dependency of this transaction failed to commit.
pub const XTP_DEPENDENCY_FAILURE: u32 = 41301;
/// Azure SQL: `The service is currently busy`.
pub const SERVICE_BUSY: u32 = 40501;
/// Azure SQL: `Database … on server … is not currently available`.
pub const DATABASE_UNAVAILABLE: u32 = 40613;
/// Azure SQL: `The service has encountered an error processing your request`
/// (the connection is closed; the outcome of a COMMIT in flight is unknown).
pub const SERVICE_ERROR: u32 = 40197;
/// `Login failed for user …`.
pub const LOGIN_FAILED: u32 = 18456;
/// `Cannot open database … requested by the login`.
pub const CANNOT_OPEN_DATABASE: u32 = 4060;
/// `The COMMIT TRANSACTION request has no corresponding BEGIN TRANSACTION`: the
/// transaction ended earlier (an effect committed, rolled back, or hit an error that
/// aborts transactions).
pub const NO_TRANSACTION_TO_COMMIT: u32 = 3902;
/// `The ROLLBACK TRANSACTION request has no corresponding BEGIN TRANSACTION`.
pub const NO_TRANSACTION_TO_ROLL_BACK: u32 = 3903;
/// `Violation of … constraint`: a CHECK constraint refused a row (not a duplicate).
pub const CHECK_CONSTRAINT_VIOLATION: u32 = 547;
/// "Invalid object name": a table the statement names does not exist, or the login
/// cannot see it (idem's migrations have not run in this database).
pub const INVALID_OBJECT_NAME: u32 = 208;
/// "Invalid column name": a column the statement names does not exist (a migration has
/// not run).
pub const INVALID_COLUMN_NAME: u32 = 207;

/// What an error number means for the protocol.
pub fn kind_of(number: u32) -> ErrorKind {
    match number {
        UNIQUE_CONSTRAINT_VIOLATION | DUPLICATE_KEY_ROW => ErrorKind::UniqueViolation,
        DEADLOCK_VICTIM => ErrorKind::Deadlock,
        LOCK_REQUEST_TIMEOUT => ErrorKind::LockTimeout,
        SNAPSHOT_UPDATE_CONFLICT
        | SNAPSHOT_DDL_CONFLICT
        | XTP_UPDATE_CONFLICT
        | XTP_REPEATABLE_READ_VALIDATION
        | XTP_SERIALIZABLE_VALIDATION
        | XTP_DEPENDENCY_FAILURE => ErrorKind::SerializationFailure,
        SERVICE_BUSY => ErrorKind::Busy,
        DATABASE_UNAVAILABLE | SERVICE_ERROR => ErrorKind::Connection,
        LOGIN_FAILED => ErrorKind::Authentication,
        CANNOT_OPEN_DATABASE => ErrorKind::MissingDatabase,
        INVALID_OBJECT_NAME | INVALID_COLUMN_NAME => ErrorKind::MissingTable,
        SNAPSHOT_NOT_ALLOWED => ErrorKind::Configuration,
        _ => ErrorKind::Other,
    }
}

/// Classifies a tiberius error: server errors by number, transport failures as
/// [`ErrorKind::Connection`].
pub fn classify(e: &Error) -> ErrorKind {
    match e {
        Error::Server(token) => kind_of(token.code()),
        // The stream is broken or out of sync: the connection is unusable and the
        // outcome of a statement in flight is unknown.
        Error::Io { .. } | Error::Tls(_) | Error::Routing { .. } | Error::Protocol(_) => {
            ErrorKind::Connection
        }
        _ => ErrorKind::Other,
    }
}

/// Classifies an error found in an effect's error chain: a tiberius error, or a bare
/// server error token.
pub fn classify_dyn(e: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    if let Some(e) = e.downcast_ref::<Error>() {
        return Some(classify(e));
    }
    e.downcast_ref::<TokenError>().map(|t| kind_of(t.code()))
}

/// Wraps a tiberius error, keeping the server's error number as the code.
pub fn db_error(e: Error) -> DbError {
    let kind = classify(&e);
    let err = DbError::new(ENGINE, kind, e.to_string());
    match e.code() {
        Some(number) => err.with_code(number.to_string()),
        None => err,
    }
    .with_source(e)
}

/// Wraps a tiberius error with what idem was doing.
pub(crate) fn db_error_in(context: &str, e: Error) -> DbError {
    let kind = classify(&e);
    let err = DbError::new(ENGINE, kind, format!("{context}: {e}"));
    match e.code() {
        Some(number) => err.with_code(number.to_string()),
        None => err,
    }
    .with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_numbers_classify() {
        assert_eq!(kind_of(2627), ErrorKind::UniqueViolation);
        assert_eq!(kind_of(2601), ErrorKind::UniqueViolation);
        assert_eq!(kind_of(1205), ErrorKind::Deadlock);
        assert_eq!(kind_of(1222), ErrorKind::LockTimeout);
        assert_eq!(kind_of(3960), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(3961), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(41302), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(41305), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(41325), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(41301), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(40501), ErrorKind::Busy);
        assert_eq!(kind_of(40613), ErrorKind::Connection);
        assert_eq!(kind_of(18456), ErrorKind::Authentication);
        assert_eq!(kind_of(4060), ErrorKind::MissingDatabase);
        assert_eq!(kind_of(208), ErrorKind::MissingTable);
        assert_eq!(kind_of(207), ErrorKind::MissingTable);
        assert_eq!(kind_of(3952), ErrorKind::Configuration);
        assert_eq!(
            kind_of(547),
            ErrorKind::Other,
            "a CHECK or foreign-key violation is not a duplicate"
        );
        assert_eq!(kind_of(3902), ErrorKind::Other);
        assert_eq!(kind_of(8152), ErrorKind::Other, "truncation is not retried");
        assert_eq!(kind_of(0), ErrorKind::Other);
    }

    #[test]
    fn retryable_numbers_are_exactly_the_documented_ones() {
        let retryable: Vec<u32> = (0..60_000).filter(|n| kind_of(*n).is_retryable()).collect();
        assert_eq!(
            retryable,
            vec![1205, 1222, 3960, 3961, 40501, 41301, 41302, 41305, 41325]
        );
        assert!(
            !kind_of(2627).is_retryable(),
            "a duplicate is resolved by the re-read"
        );
    }

    #[test]
    fn transport_errors_are_connection_errors() {
        let io: Error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset").into();
        assert_eq!(classify(&io), ErrorKind::Connection);
        assert_eq!(
            classify(&Error::Tls("handshake".into())),
            ErrorKind::Connection
        );
        assert_eq!(
            classify(&Error::Routing {
                host: "h".into(),
                port: 1433
            }),
            ErrorKind::Connection
        );
        assert_eq!(
            classify(&Error::Protocol("desync".into())),
            ErrorKind::Connection
        );
        assert_eq!(classify(&Error::Conversion("bad".into())), ErrorKind::Other);
        assert_eq!(classify(&Error::Utf16), ErrorKind::Other);
    }

    #[test]
    fn db_error_keeps_the_source_and_no_code_for_transport_errors() {
        let e = db_error(Error::Io {
            kind: std::io::ErrorKind::TimedOut,
            message: "timed out".into(),
        });
        assert_eq!(e.kind(), ErrorKind::Connection);
        assert_eq!(e.engine(), "mssql");
        assert_eq!(e.code(), None);
        assert!(std::error::Error::source(&e).is_some());
        let dynamic: &(dyn std::error::Error + 'static) = &Error::Tls("x".into());
        assert_eq!(classify_dyn(dynamic), Some(ErrorKind::Connection));
        let unrelated = std::io::Error::other("not a driver error");
        assert_eq!(classify_dyn(&unrelated), None);
    }
}
