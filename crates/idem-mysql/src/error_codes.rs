//! MySQL/MariaDB server error numbers idem classifies, and the mapping of
//! [`mysql_async::Error`] to [`ErrorKind`].
//!
//! Classification is by number only (never by message text, which the server localizes
//! with `lc_messages`). The numbers below have the same meaning on MySQL 8.4 and
//! MariaDB 10.11 unless noted.

use idem_core::{DbError, ErrorKind};
use mysql_async::{DriverError, Error};

/// `ER_DUP_ENTRY`: a unique or primary key refused the row (SQLSTATE 23000). The claim's
/// signal that the identity is taken.
pub const ER_DUP_ENTRY: u16 = 1062;
/// `ER_DUP_ENTRY_WITH_KEY_NAME`: the same, with the key's name.
pub const ER_DUP_ENTRY_WITH_KEY_NAME: u16 = 1586;
/// `ER_LOCK_WAIT_TIMEOUT`: `innodb_lock_wait_timeout` elapsed (only the statement is
/// rolled back unless `innodb_rollback_on_timeout`; idem rolls back the transaction and
/// retries it).
pub const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// `ER_LOCK_DEADLOCK`: this transaction was chosen as a deadlock victim and rolled back
/// (also Galera's certification failure at `COMMIT`, see [`crate::galera`]).
pub const ER_LOCK_DEADLOCK: u16 = 1213;
/// `ER_LOCK_NOWAIT` (MySQL 8): a `NOWAIT` locking read found the row locked.
pub const ER_LOCK_NOWAIT: u16 = 3572;
/// `ER_SP_DOES_NOT_EXIST`: a savepoint (or routine) does not exist; for idem, the
/// transaction that claimed a message is no longer open.
pub const ER_SP_DOES_NOT_EXIST: u16 = 1305;
/// `ER_BAD_NULL_ERROR`: `NULL` into a `NOT NULL` column (strict mode). A merged MariaDB
/// completion raises it on purpose when its guard fails, to stop its `COMMIT`.
pub const ER_BAD_NULL_ERROR: u16 = 1048;
/// `ER_CANT_DROP_FIELD_OR_KEY`: `DROP INDEX` of an index that is not there; a migration
/// re-run after an interruption tolerates it (MySQL 8 has no `DROP INDEX IF EXISTS`).
pub const ER_CANT_DROP_FIELD_OR_KEY: u16 = 1091;
/// `ER_SIGNAL_EXCEPTION`: a `SIGNAL SQLSTATE '45000'` without its own number (a stored
/// program's or trigger's).
pub const ER_SIGNAL_EXCEPTION: u16 = 1644;
/// `ER_NET_PACKET_TOO_LARGE`: a packet (a request or response sent as a parameter) is
/// larger than the server's `max_allowed_packet`. An input error: not retried.
pub const ER_NET_PACKET_TOO_LARGE: u16 = 1153;
/// `ER_CON_COUNT_ERROR`: `max_connections` reached.
pub const ER_CON_COUNT_ERROR: u16 = 1040;
/// `ER_DBACCESS_DENIED_ERROR`: the user may not use the database named in the URL.
pub const ER_DBACCESS_DENIED_ERROR: u16 = 1044;
/// `ER_ACCESS_DENIED_ERROR`: bad user or password.
pub const ER_ACCESS_DENIED_ERROR: u16 = 1045;
/// `ER_ACCESS_DENIED_NO_PASSWORD_ERROR`: the user needs a password and gave none.
pub const ER_ACCESS_DENIED_NO_PASSWORD_ERROR: u16 = 1698;
/// `ER_BAD_DB_ERROR`: unknown database.
pub const ER_BAD_DB_ERROR: u16 = 1049;
/// `ER_SERVER_SHUTDOWN`: the server is shutting down.
pub const ER_SERVER_SHUTDOWN: u16 = 1053;
/// `ER_NO_SUCH_TABLE`: a table is missing (run the migrations).
pub const ER_NO_SUCH_TABLE: u16 = 1146;
/// `ER_BAD_FIELD_ERROR`: an unknown column (a migration has not run).
pub const ER_BAD_FIELD_ERROR: u16 = 1054;
/// `ER_UNKNOWN_COM_ERROR`: on a Galera node, "WSREP has not yet prepared node for
/// application use": the node is not in the cluster's primary component (cut off, or
/// still joining). Classified as a connection error: send the same key to another node.
pub const ER_UNKNOWN_COM_ERROR: u16 = 1047;
/// `ER_CONNECTION_KILLED` (MariaDB): the connection was killed.
pub const ER_CONNECTION_KILLED: u16 = 1927;
/// `ER_CLIENT_INTERACTION_TIMEOUT` (MySQL 8): disconnected after `wait_timeout`.
pub const ER_CLIENT_INTERACTION_TIMEOUT: u16 = 4031;
/// `ER_NO_REFERENCED_ROW_2`: a foreign key refused the row (not a duplicate).
pub const ER_NO_REFERENCED_ROW_2: u16 = 1452;
/// `ER_CHECK_CONSTRAINT_VIOLATED` (MySQL 8.0.16+).
pub const ER_CHECK_CONSTRAINT_VIOLATED: u16 = 3819;
/// `ER_CONSTRAINT_FAILED` (MariaDB): a `CHECK` constraint refused the row.
pub const ER_CONSTRAINT_FAILED: u16 = 4025;

/// What a server error number means for the protocol.
pub fn kind_of(code: u16) -> ErrorKind {
    match code {
        ER_DUP_ENTRY | ER_DUP_ENTRY_WITH_KEY_NAME => ErrorKind::UniqueViolation,
        ER_LOCK_DEADLOCK => ErrorKind::Deadlock,
        ER_LOCK_WAIT_TIMEOUT | ER_LOCK_NOWAIT => ErrorKind::LockTimeout,
        ER_CON_COUNT_ERROR
        | ER_SERVER_SHUTDOWN
        | ER_CONNECTION_KILLED
        | ER_CLIENT_INTERACTION_TIMEOUT
        | ER_UNKNOWN_COM_ERROR => ErrorKind::Connection,
        ER_ACCESS_DENIED_ERROR | ER_DBACCESS_DENIED_ERROR | ER_ACCESS_DENIED_NO_PASSWORD_ERROR => {
            ErrorKind::Authentication
        }
        ER_BAD_DB_ERROR => ErrorKind::MissingDatabase,
        ER_NO_SUCH_TABLE | ER_BAD_FIELD_ERROR => ErrorKind::MissingTable,
        _ => ErrorKind::Other,
    }
}

/// Whether `e` says a payload exceeded `max_allowed_packet` (the server's 1153, or the
/// driver's own check).
pub fn is_packet_too_large(e: &Error) -> bool {
    match e {
        Error::Server(s) => s.code == ER_NET_PACKET_TOO_LARGE,
        Error::Driver(DriverError::PacketTooLarge) => true,
        _ => false,
    }
}

/// The server's error number, when the error came from the server.
pub fn server_code(e: &Error) -> Option<u16> {
    match e {
        Error::Server(s) => Some(s.code),
        _ => None,
    }
}

/// Classifies a `mysql_async` error: server errors by number, I/O and protocol
/// failures as [`ErrorKind::Connection`], URL and authentication setup as
/// [`ErrorKind::Configuration`].
pub fn classify(e: &Error) -> ErrorKind {
    match e {
        Error::Server(s) => kind_of(s.code),
        Error::Io(_) => ErrorKind::Connection,
        Error::Url(_) => ErrorKind::Configuration,
        Error::Driver(d) => match d {
            DriverError::ConnectionClosed
            | DriverError::PoolDisconnected
            | DriverError::PacketOutOfOrder
            | DriverError::UnexpectedPacket { .. }
            | DriverError::BadCompressedPacketHeader => ErrorKind::Connection,
            // An input error (the payload is above `max_allowed_packet`), never a lost
            // connection to retry.
            DriverError::PacketTooLarge => ErrorKind::Other,
            DriverError::UnknownAuthPlugin { .. }
            | DriverError::MysqlOldPasswordDisabled
            | DriverError::CleartextPluginDisabled
            | DriverError::NoClientSslFlagFromServer
            | DriverError::NoKeyFound
            | DriverError::NamedPipesDisabled => ErrorKind::Configuration,
            _ => ErrorKind::Other,
        },
        Error::Other(_) => ErrorKind::Other,
    }
}

/// Wraps a `mysql_async` error, keeping the server's error number as the code
/// (`"1062"`).
pub fn db_error(e: Error) -> DbError {
    let kind = classify(&e);
    // A server error in the server's own words; the number is the code beside it.
    let message = match &e {
        Error::Server(s) => s.message.clone(),
        other => other.to_string(),
    };
    let err = DbError::new("mysql", kind, message);
    match server_code(&e) {
        Some(code) => err.with_code(code.to_string()),
        None => err,
    }
    .with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mysql_async::{ServerError, UrlError};

    fn server(code: u16, state: &str) -> Error {
        Error::Server(ServerError {
            code,
            message: "localized text idem never reads".into(),
            state: state.into(),
        })
    }

    #[test]
    fn packets_above_max_allowed_packet_are_input_errors() {
        for e in [
            server(ER_NET_PACKET_TOO_LARGE, "08S01"),
            Error::Driver(DriverError::PacketTooLarge),
        ] {
            assert!(is_packet_too_large(&e), "{e}");
            let kind = classify(&e);
            assert_eq!(kind, ErrorKind::Other, "{e}");
            assert!(!kind.is_retryable(), "{e} must not be retried");
        }
        assert!(!is_packet_too_large(&server(1213, "40001")));
    }

    #[test]
    fn codes_classify() {
        assert_eq!(kind_of(1062), ErrorKind::UniqueViolation);
        assert_eq!(kind_of(1586), ErrorKind::UniqueViolation);
        assert_eq!(kind_of(1213), ErrorKind::Deadlock);
        assert_eq!(kind_of(1205), ErrorKind::LockTimeout);
        assert_eq!(kind_of(3572), ErrorKind::LockTimeout);
        assert_eq!(kind_of(1040), ErrorKind::Connection);
        assert_eq!(kind_of(1927), ErrorKind::Connection);
        assert_eq!(
            kind_of(1047),
            ErrorKind::Connection,
            "a Galera node outside the primary component"
        );
        assert_eq!(kind_of(1146), ErrorKind::MissingTable);
        assert_eq!(kind_of(1054), ErrorKind::MissingTable);
        assert_eq!(kind_of(1045), ErrorKind::Authentication);
        assert_eq!(kind_of(1044), ErrorKind::Authentication);
        assert_eq!(kind_of(1698), ErrorKind::Authentication);
        assert_eq!(kind_of(1049), ErrorKind::MissingDatabase);
        assert_eq!(
            kind_of(1452),
            ErrorKind::Other,
            "a foreign-key violation is not a duplicate"
        );
        assert_eq!(kind_of(4025), ErrorKind::Other);
        assert_eq!(kind_of(3819), ErrorKind::Other);
        assert_eq!(kind_of(0), ErrorKind::Other);
        assert_eq!(kind_of(u16::MAX), ErrorKind::Other);
        assert!(kind_of(1213).is_retryable());
        assert!(kind_of(1205).is_retryable());
        assert!(!kind_of(1062).is_retryable());
        assert!(!kind_of(1452).is_retryable());
    }

    #[test]
    fn driver_errors_classify_and_keep_the_code() {
        let e = db_error(server(1213, "40001"));
        assert_eq!(e.kind(), ErrorKind::Deadlock);
        assert_eq!(e.code(), Some("1213"));
        assert_eq!(e.engine(), "mysql");
        let source = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Error>());
        assert!(matches!(source, Some(Error::Server(s)) if s.code == 1213));

        let e = db_error(server(1062, "23000"));
        assert_eq!(e.kind(), ErrorKind::UniqueViolation);
        assert_eq!(e.code(), Some("1062"));

        // The message is ignored: a "deadlock" text under another number is not one.
        let e = Error::Server(ServerError {
            code: 1105,
            message: "Deadlock found when trying to get lock".into(),
            state: "HY000".into(),
        });
        assert_eq!(classify(&e), ErrorKind::Other);

        let io = Error::Io(mysql_async::IoError::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert_eq!(classify(&io), ErrorKind::Connection);
        assert_eq!(db_error(io).code(), None);
        assert_eq!(
            classify(&Error::Driver(DriverError::ConnectionClosed)),
            ErrorKind::Connection
        );
        assert_eq!(
            classify(&Error::Url(UrlError::Invalid)),
            ErrorKind::Configuration
        );
        assert_eq!(
            classify(&Error::Driver(DriverError::MixedParams)),
            ErrorKind::Other
        );
    }
}
