//! Oracle error numbers idem classifies: `ORA-nnnnn` from the database or Oracle Net,
//! and `DPI-nnnn` from ODPI-C, the C layer the `oracle` crate is built on.
//!
//! Errors are classified by these numbers only, never by message text (Oracle's
//! messages follow `NLS_LANGUAGE`). `oracle::Error::oci_code` gives the ORA number;
//! `oracle::Error::dpi_code` gives the number ODPI-C puts in front of its own
//! (untranslated) messages.

use idem_core::{DbError, ErrorKind};

const ENGINE: &str = "oracle";

/// ORA-00001: unique constraint violated (the claim's duplicate).
pub const UNIQUE_VIOLATED: i32 = 1;
/// ORA-08177: can't serialize access for this transaction (SERIALIZABLE isolation).
pub const CANNOT_SERIALIZE: i32 = 8177;
/// ORA-00060: deadlock detected while waiting for resource. Only the statement is
/// rolled back; idem rolls back the whole transaction and retries it.
pub const DEADLOCK: i32 = 60;
/// ORA-00054: resource busy and acquire with NOWAIT specified or timeout expired.
pub const RESOURCE_BUSY: i32 = 54;
/// ORA-30006: resource busy; acquire with WAIT timeout expired.
pub const WAIT_TIMEOUT: i32 = 30006;
/// ORA-04021: timeout occurred while waiting to lock object (DDL or library cache).
pub const OBJECT_LOCK_TIMEOUT: i32 = 4021;
/// ORA-00955: name is already used by an existing object (tolerated by migrations).
pub const NAME_IN_USE: i32 = 955;
/// ORA-01408: such column list already indexed (tolerated by migrations).
pub const COLUMNS_ALREADY_INDEXED: i32 = 1408;
/// ORA-01430: column being added already exists in table (a re-run migration).
pub const COLUMN_ALREADY_EXISTS: i32 = 1430;
/// ORA-01418: specified index does not exist (a re-run migration that drops one).
pub const INDEX_DOES_NOT_EXIST: i32 = 1418;
/// ORA-01400: cannot insert NULL (an empty string or RAW is NULL in Oracle).
pub const CANNOT_INSERT_NULL: i32 = 1400;
/// ORA-01017: invalid username/password; logon denied.
pub const INVALID_LOGON: i32 = 1017;
/// ORA-12154: could not resolve the connect identifier specified.
pub const UNRESOLVED_CONNECT_IDENTIFIER: i32 = 12154;
/// ORA-03113: end-of-file on communication channel.
pub const END_OF_FILE_ON_CHANNEL: i32 = 3113;
/// ORA-03114: not connected to ORACLE.
pub const NOT_CONNECTED: i32 = 3114;
/// ORA-03135: connection lost contact.
pub const CONNECTION_LOST_CONTACT: i32 = 3135;
/// ORA-12541: no listener (nothing listens on the host and port).
pub const NO_LISTENER: i32 = 12541;
/// ORA-12514: the listener does not know the service named in the URL (the database
/// is missing, or not registered yet).
pub const UNKNOWN_SERVICE: i32 = 12514;
/// ORA-12505: the listener does not know the SID named in the URL.
pub const UNKNOWN_SID: i32 = 12505;
/// ORA-00942: table or view does not exist, or the user has no privilege on it (idem's
/// migrations have not run for this schema, or its grants are missing).
pub const TABLE_DOES_NOT_EXIST: i32 = 942;
/// ORA-00904: invalid identifier, such as a column a migration has not added yet.
pub const INVALID_IDENTIFIER: i32 = 904;

/// ORA numbers that mean the connection could not be made or is gone. After one of
/// these during a commit the outcome is unknown: retry with the same key to learn it.
/// The session-lost numbers are the ones ODPI-C itself treats as a dead session.
pub const CONNECTION_CODES: &[i32] = &[
    22,   // invalid session ID; access denied
    28,   // your session has been killed
    31,   // your session has been marked for kill
    45,   // your session has been terminated with no replay
    603,  // ORACLE server session terminated by fatal error
    1012, // not logged on
    1033, // ORACLE initialization or shutdown in progress
    1034, // ORACLE not available
    1089, // immediate shutdown or close in progress
    1092, // ORACLE instance terminated. Disconnection forced
    2396, // exceeded maximum idle time, please connect again
    END_OF_FILE_ON_CHANNEL,
    NOT_CONNECTED,
    CONNECTION_LOST_CONTACT,
    3136,  // inbound connection timed out
    3156,  // OCI call timed out
    12153, // TNS:not connected
    12170, // TNS:Connect timeout occurred
    12516, // TNS:listener could not find available handler
    12518, // TNS:listener could not hand off client connection
    12520, // TNS:listener could not find available handler for requested type of server
    12528, // TNS:listener: all appropriate instances are blocking new connections
    12537, // TNS:connection closed
    NO_LISTENER,
    12543, // TNS:destination host unreachable
    12545, // Connect failed because target host or object does not exist
    12547, // TNS:lost contact
    12560, // TNS:protocol adapter error
    12570, // TNS:packet reader failure
    12571, // TNS:packet writer failure
    12583, // TNS:no reader
    28511, // lost RPC connection to heterogeneous remote agent
];

/// DPI-1047: Cannot locate a 64-bit Oracle Client library (Oracle Client is not
/// installed or not on the loader's path).
pub const DPI_CLIENT_LIBRARY_MISSING: i32 = 1047;
/// DPI-1050: Oracle Client library is at version x but version y or higher is needed.
pub const DPI_CLIENT_TOO_OLD: i32 = 1050;
/// DPI-1072: the Oracle Client library version is unsupported.
pub const DPI_CLIENT_UNSUPPORTED: i32 = 1072;
/// DPI-1079: Oracle Client library is at version x but either version y (or later
/// DBRU) or version z (or higher) is needed.
pub const DPI_CLIENT_TOO_OLD_MULTI: i32 = 1079;
/// DPI-1010: not connected.
pub const DPI_NOT_CONNECTED: i32 = 1010;
/// DPI-1067: call timeout of N ms exceeded with ORA-nnnnn.
pub const DPI_CALL_TIMEOUT: i32 = 1067;
/// DPI-1080: connection was closed by ORA-nnnnn (ODPI-C's wrapper for every
/// dead-session error, such as ORA-03113).
pub const DPI_CONNECTION_CLOSED: i32 = 1080;

/// What to install when the Oracle Client library is missing.
pub const CLIENT_INSTALL_HINT: &str = "the `oracle` crate loads the Oracle Client library \
     (libclntsh) at run time and none was found: install Oracle Instant Client Basic or \
     Basic Light (64-bit, 19c or later) and make it findable, on Linux by adding its \
     directory to LD_LIBRARY_PATH or registering it with ldconfig \
     (`echo /opt/oracle/instantclient_23_9 > /etc/ld.so.conf.d/oracle-instantclient.conf && ldconfig`), \
     on macOS by putting it in ~/lib or /usr/local/lib, on Windows by adding it to PATH";

/// What an ORA number means for the protocol.
pub fn kind_of(ora: i32) -> ErrorKind {
    match ora {
        UNIQUE_VIOLATED => ErrorKind::UniqueViolation,
        CANNOT_SERIALIZE => ErrorKind::SerializationFailure,
        DEADLOCK => ErrorKind::Deadlock,
        RESOURCE_BUSY | WAIT_TIMEOUT | OBJECT_LOCK_TIMEOUT => ErrorKind::LockTimeout,
        INVALID_LOGON => ErrorKind::Authentication,
        UNKNOWN_SERVICE | UNKNOWN_SID => ErrorKind::MissingDatabase,
        TABLE_DOES_NOT_EXIST | INVALID_IDENTIFIER => ErrorKind::MissingTable,
        UNRESOLVED_CONNECT_IDENTIFIER => ErrorKind::Configuration,
        c if CONNECTION_CODES.contains(&c) => ErrorKind::Connection,
        _ => ErrorKind::Other,
    }
}

/// What a DPI number (ODPI-C's own errors) means for the protocol.
pub fn kind_of_dpi(dpi: i32) -> ErrorKind {
    match dpi {
        DPI_CLIENT_LIBRARY_MISSING
        | DPI_CLIENT_TOO_OLD
        | DPI_CLIENT_UNSUPPORTED
        | DPI_CLIENT_TOO_OLD_MULTI => ErrorKind::ClientLibraryMissing,
        DPI_NOT_CONNECTED | DPI_CALL_TIMEOUT | DPI_CONNECTION_CLOSED => ErrorKind::Connection,
        _ => ErrorKind::Other,
    }
}

/// The ORA number of an error from the database or Oracle Net, if it is one.
pub fn ora_code(e: &oracle::Error) -> Option<i32> {
    match e.kind() {
        oracle::ErrorKind::OciError => e.oci_code(),
        _ => None,
    }
}

/// The DPI number of an error raised by ODPI-C itself, if it is one.
pub fn dpi_code(e: &oracle::Error) -> Option<i32> {
    match e.kind() {
        oracle::ErrorKind::DpiError => e.dpi_code(),
        _ => None,
    }
}

/// Classifies an `oracle` crate error by its ORA or DPI number.
pub fn classify(e: &oracle::Error) -> ErrorKind {
    if let Some(ora) = ora_code(e) {
        return kind_of(ora);
    }
    if let Some(dpi) = dpi_code(e) {
        return kind_of_dpi(dpi);
    }
    ErrorKind::Other
}

/// The code as Oracle prints it: `ORA-00001`, `DPI-1047`.
pub fn code_text(e: &oracle::Error) -> Option<String> {
    ora_code(e)
        .map(|c| format!("ORA-{c:05}"))
        .or_else(|| dpi_code(e).map(|c| format!("DPI-{c:04}")))
}

/// Wraps an `oracle` crate error, keeping its code (`ORA-00001`, `DPI-1047`). A missing
/// Oracle Client library gets a message that says what to install.
pub fn db_error(e: oracle::Error) -> DbError {
    let kind = classify(&e);
    let message = if kind == ErrorKind::ClientLibraryMissing {
        format!("{CLIENT_INSTALL_HINT} (driver: {e})")
    } else {
        e.to_string()
    };
    let err = DbError::new(ENGINE, kind, message);
    match code_text(&e) {
        Some(code) => err.with_code(code),
        None => err,
    }
    .with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error as the `oracle` crate builds it from ODPI-C's error info: `DPI-`
    /// messages become `DpiError`, everything else `OciError`.
    #[allow(deprecated)]
    fn driver_error(code: i32, message: &str) -> oracle::Error {
        let db = oracle::DbError::new(code, 0, message, "dpiStmt_execute", "execute");
        if message.starts_with("DPI") {
            oracle::Error::DpiError(db)
        } else {
            oracle::Error::OciError(db)
        }
    }

    #[test]
    fn ora_numbers_classify() {
        assert_eq!(kind_of(1), ErrorKind::UniqueViolation);
        assert_eq!(kind_of(8177), ErrorKind::SerializationFailure);
        assert_eq!(kind_of(60), ErrorKind::Deadlock);
        assert_eq!(kind_of(54), ErrorKind::LockTimeout);
        assert_eq!(kind_of(30006), ErrorKind::LockTimeout);
        for c in [3113, 3114, 3135, 12541, 12170, 28, 1012, 1089, 1092] {
            assert_eq!(kind_of(c), ErrorKind::Connection, "ORA-{c:05}");
        }
        assert_eq!(kind_of(1017), ErrorKind::Authentication);
        assert_eq!(kind_of(12514), ErrorKind::MissingDatabase);
        assert_eq!(kind_of(12505), ErrorKind::MissingDatabase);
        assert_eq!(kind_of(942), ErrorKind::MissingTable);
        assert_eq!(kind_of(904), ErrorKind::MissingTable);
        assert_eq!(
            kind_of(2291),
            ErrorKind::Other,
            "a foreign-key violation is not a duplicate"
        );
        assert_eq!(kind_of(1400), ErrorKind::Other, "NULL is not a duplicate");
        assert_eq!(kind_of(955), ErrorKind::Other);
        assert!(kind_of(8177).is_retryable() && kind_of(60).is_retryable());
        assert!(kind_of(54).is_retryable() && kind_of(30006).is_retryable());
        assert!(!kind_of(1).is_retryable() && !kind_of(3113).is_retryable());
    }

    #[test]
    fn dpi_numbers_classify() {
        assert_eq!(kind_of_dpi(1047), ErrorKind::ClientLibraryMissing);
        assert_eq!(kind_of_dpi(1072), ErrorKind::ClientLibraryMissing);
        assert_eq!(kind_of_dpi(1080), ErrorKind::Connection);
        assert_eq!(kind_of_dpi(1010), ErrorKind::Connection);
        assert_eq!(kind_of_dpi(1067), ErrorKind::Connection);
        assert_eq!(kind_of_dpi(1059), ErrorKind::Other);
    }

    #[test]
    fn driver_errors_keep_their_code() {
        let dup = driver_error(
            1,
            "ORA-00001: unique constraint (APP.IDEM_REQUEST_RESULT_PK) violated",
        );
        assert_eq!(classify(&dup), ErrorKind::UniqueViolation);
        let e = db_error(dup);
        assert_eq!(
            (e.kind(), e.engine(), e.code()),
            (ErrorKind::UniqueViolation, "oracle", Some("ORA-00001"))
        );
        assert!(std::error::Error::source(&e).is_some());

        let e = db_error(driver_error(
            8177,
            "ORA-08177: can't serialize access for this transaction",
        ));
        assert_eq!(
            (e.kind(), e.code()),
            (ErrorKind::SerializationFailure, Some("ORA-08177"))
        );
        let e = db_error(driver_error(
            60,
            "ORA-00060: deadlock detected while waiting for resource",
        ));
        assert_eq!(
            (e.kind(), e.code()),
            (ErrorKind::Deadlock, Some("ORA-00060"))
        );

        // ODPI-C clears the ORA number when it wraps a dead session as DPI-1080.
        let e = db_error(driver_error(
            0,
            "DPI-1080: connection was closed by ORA-03113\nORA-03113: end-of-file on communication channel",
        ));
        assert_eq!(
            (e.kind(), e.code()),
            (ErrorKind::Connection, Some("DPI-1080"))
        );

        let missing = driver_error(
            0,
            "DPI-1047: Cannot locate a 64-bit Oracle Client library: \"libclntsh.so: cannot open shared object file: No such file or directory\". See https://oracle.github.io/odpi/doc/installation.html#linux for help",
        );
        let e = db_error(missing);
        assert_eq!(
            (e.kind(), e.code()),
            (ErrorKind::ClientLibraryMissing, Some("DPI-1047"))
        );
        assert!(e.message().contains("Instant Client Basic or Basic Light"));
        assert!(e.message().contains("LD_LIBRARY_PATH"));
    }

    #[test]
    fn the_code_not_the_text_decides() {
        // A localized message with the duplicate's number is still a duplicate…
        let german = driver_error(1, "ORA-00001: Unique Constraint (X.PK) verletzt");
        assert_eq!(classify(&german), ErrorKind::UniqueViolation);
        // …and English words about deadlocks under another number are not a deadlock.
        let other = driver_error(20001, "ORA-20001: deadlock detected (user text)");
        assert_eq!(classify(&other), ErrorKind::Other);
        // Errors of the crate itself carry no number.
        let conversion = oracle::Error::new(oracle::ErrorKind::NullValue, "NULL value found");
        assert_eq!(classify(&conversion), ErrorKind::Other);
        assert_eq!(db_error(conversion).code(), None);
    }
}
