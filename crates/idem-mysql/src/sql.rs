//! Every statement the MySQL/MariaDB backend sends.
//!
//! Portable between MySQL 8.4 and MariaDB 10.11: no `RETURNING`, no `FOR SHARE`
//! (MariaDB spells it `LOCK IN SHARE MODE`, which MySQL 8.4 still accepts), no
//! MySQL-only collations. Parameters are `?`, in the order the comment of each
//! statement lists.

/// The cutoff of a retention window: the database's UTC clock minus `?` microseconds.
macro_rules! cutoff {
    () => {
        "UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
    };
}
/// The end of a retention window that starts now: `?` microseconds after the database's
/// UTC clock.
macro_rules! expiry {
    () => {
        "UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND"
    };
}
macro_rules! request_pk {
    () => {
        "principal = ? AND operation = ? AND request_key = ?"
    };
}
macro_rules! message_pk {
    () => {
        "subscriber = ? AND message_id = ?"
    };
}

/// The claim: a plain INSERT of the placeholder. A conflicting uncommitted row makes it
/// wait for that transaction (bounded by `innodb_lock_wait_timeout`); a committed one
/// fails it with 1062 (only this statement is rolled back). `UTC_TIMESTAMP(6)` is read
/// once per statement, so `created_at` and `expires_at` start at the same moment.
/// Params: principal, operation, key, request, retention (µs).
pub(crate) const INSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result \
     (principal, operation, request_key, request, response, status, created_at, expires_at) \
     VALUES (?, ?, ?, ?, NULL, 0, UTC_TIMESTAMP(6), ",
    expiry!(),
    ")"
);
/// The re-read after 1062: a **locking** read, which reads the latest committed version
/// (a plain REPEATABLE READ select may read an older snapshot). A shared lock, because
/// the failed INSERT already holds one on the row: asking for an exclusive lock
/// (`FOR UPDATE`) from several losers at once would deadlock them.
/// Params: principal, operation, key.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status, expires_at <= UTC_TIMESTAMP(6) AS expired FROM idem_request_result WHERE ",
    request_pk!(),
    " LOCK IN SHARE MODE"
);
/// Takes over an expired record as a fresh placeholder.
/// Params: request, retention (µs), principal, operation, key.
pub(crate) const REPLACE_EXPIRED_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET request = ?, response = NULL, status = 0, created_at = UTC_TIMESTAMP(6), expires_at = ",
    expiry!(),
    " WHERE ",
    request_pk!(),
    " AND expires_at <= UTC_TIMESTAMP(6)"
);
/// Completes the placeholder just before `COMMIT`; no row when the record expired while
/// the effect ran (a loser could otherwise take the committed record over).
/// Params: response, status, principal, operation, key.
pub(crate) const COMPLETE_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET response = ?, status = ? WHERE ",
    request_pk!(),
    " AND response IS NULL AND expires_at > UTC_TIMESTAMP(6)"
);
/// Why a completion changed no row: 1 when the record expired. Params: principal,
/// operation, key.
pub(crate) const EXPIRED_REQUEST: &str = concat!(
    "SELECT expires_at <= UTC_TIMESTAMP(6) FROM idem_request_result WHERE ",
    request_pk!()
);
/// The replay fast path: a plain read outside any write transaction, after
/// [`READ_COMMITTED`] (so a session at READ UNCOMMITTED never replays an uncommitted
/// placeholder). Params: principal, operation, key.
pub(crate) const LOOKUP_REQUEST: &str = concat!(
    "SELECT request, response, status FROM idem_request_result WHERE ",
    request_pk!(),
    " AND expires_at > UTC_TIMESTAMP(6)"
);
/// Pins the next transaction (the lookup's autocommit read) to READ COMMITTED.
pub(crate) const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// Params: subscriber, message ID, fingerprint, retention (µs).
pub(crate) const INSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message \
     (subscriber, message_id, fingerprint, processed_at, expires_at) VALUES (?, ?, ?, UTC_TIMESTAMP(6), ",
    expiry!(),
    ")"
);
/// Params: subscriber, message ID.
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint, expires_at <= UTC_TIMESTAMP(6) AS expired FROM idem_processed_message WHERE ",
    message_pk!(),
    " LOCK IN SHARE MODE"
);
/// Params: fingerprint, retention (µs), subscriber, message ID.
pub(crate) const REPLACE_EXPIRED_MESSAGE: &str = concat!(
    "UPDATE idem_processed_message SET fingerprint = ?, processed_at = UTC_TIMESTAMP(6), expires_at = ",
    expiry!(),
    " WHERE ",
    message_pk!(),
    " AND expires_at <= UTC_TIMESTAMP(6)"
);
/// Before a message's commit: 1 when the claimed record expired while the effect ran.
/// Params: subscriber, message ID.
pub(crate) const EXPIRED_MESSAGE: &str = concat!(
    "SELECT expires_at <= UTC_TIMESTAMP(6) FROM idem_processed_message WHERE ",
    message_pk!()
);
/// Params: subscriber, message ID.
pub(crate) const LOOKUP_MESSAGE: &str = concat!(
    "SELECT fingerprint FROM idem_processed_message WHERE ",
    message_pk!(),
    " AND expires_at > UTC_TIMESTAMP(6)"
);

/// Saves the session's `innodb_lock_wait_timeout` and bounds the claim's lock waits
/// (whole seconds, appended by the backend: an integer, never user text).
pub(crate) const SET_LOCK_WAIT: &str = "SET @idem_lock_wait = @@SESSION.innodb_lock_wait_timeout, \
     SESSION innodb_lock_wait_timeout = ";
/// Gives the session (and the effect) its own `innodb_lock_wait_timeout` back.
pub(crate) const RESTORE_LOCK_WAIT: &str = "SET SESSION innodb_lock_wait_timeout = @idem_lock_wait";
/// The server's `max_allowed_packet`, named in the error for a payload above it.
pub(crate) const MAX_ALLOWED_PACKET: &str = "SELECT @@max_allowed_packet";

/// Set when a message claim wins: a message record has no placeholder to complete, so
/// this savepoint is what proves at commit time that the claiming transaction is still
/// the one open (a deadlock rollback, `COMMIT`, `ROLLBACK` or DDL deletes it).
pub(crate) const SAVEPOINT_CLAIMED: &str = "SAVEPOINT idem_claimed";
/// Before a message's commit: fails with 1305 when the savepoint is gone.
pub(crate) const RELEASE_CLAIMED: &str = "RELEASE SAVEPOINT idem_claimed";

/// Records that are expired **and** were claimed at least `?` µs ago, oldest expiry
/// first. Params: older than (µs), limit.
pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE expires_at <= UTC_TIMESTAMP(6) AND created_at <= ",
    cutoff!(),
    " ORDER BY expires_at LIMIT ?"
);
/// Like [`PURGE_REQUESTS`], for messages. Params: older than (µs), limit.
pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE expires_at <= UTC_TIMESTAMP(6) AND processed_at <= ",
    cutoff!(),
    " ORDER BY expires_at LIMIT ?"
);

macro_rules! migration_lock_name {
    () => {
        "CONCAT('idem_migrate:', MD5(COALESCE(DATABASE(), '')))"
    };
}
/// Serializes concurrent migrators of one database: a named lock (server-wide names, so
/// the database's name is part of it, hashed to stay under MySQL's 64 characters).
/// Returns 1 when taken, 0 after the timeout. Params: timeout (s).
pub(crate) const MIGRATION_LOCK: &str = concat!("SELECT GET_LOCK(", migration_lock_name!(), ", ?)");
/// Releases the migrators' lock.
pub(crate) const MIGRATION_UNLOCK: &str =
    concat!("SELECT RELEASE_LOCK(", migration_lock_name!(), ")");
pub(crate) const CREATE_MIGRATIONS: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
     version INT UNSIGNED NOT NULL PRIMARY KEY, \
     name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
     applied_at DATETIME(6) NOT NULL) ENGINE = InnoDB";
pub(crate) const SELECT_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations";
/// Params: version, name.
pub(crate) const INSERT_MIGRATION: &str = "INSERT INTO idem_schema_migrations (version, name, applied_at) \
     VALUES (?, ?, UTC_TIMESTAMP(6))";

#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("insert_request", INSERT_REQUEST),
    ("select_request", SELECT_REQUEST),
    ("replace_expired_request", REPLACE_EXPIRED_REQUEST),
    ("complete_request", COMPLETE_REQUEST),
    ("expired_request", EXPIRED_REQUEST),
    ("lookup_request", LOOKUP_REQUEST),
    ("read_committed", READ_COMMITTED),
    ("insert_message", INSERT_MESSAGE),
    ("select_message", SELECT_MESSAGE),
    ("replace_expired_message", REPLACE_EXPIRED_MESSAGE),
    ("expired_message", EXPIRED_MESSAGE),
    ("lookup_message", LOOKUP_MESSAGE),
    ("set_lock_wait", SET_LOCK_WAIT),
    ("restore_lock_wait", RESTORE_LOCK_WAIT),
    ("max_allowed_packet", MAX_ALLOWED_PACKET),
    ("savepoint_claimed", SAVEPOINT_CLAIMED),
    ("release_claimed", RELEASE_CLAIMED),
    ("purge_requests", PURGE_REQUESTS),
    ("purge_messages", PURGE_MESSAGES),
    ("migration_lock", MIGRATION_LOCK),
    ("migration_unlock", MIGRATION_UNLOCK),
    ("create_migrations", CREATE_MIGRATIONS),
    ("select_migrations", SELECT_MIGRATIONS),
    ("insert_migration", INSERT_MIGRATION),
];

#[cfg(test)]
mod tests {
    use super::ALL;

    #[test]
    fn statements_snapshot() {
        let text: String = ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    #[test]
    fn statements_are_portable() {
        for (name, sql) in ALL {
            let upper = sql.to_ascii_uppercase();
            // MariaDB-only syntax, MySQL-only syntax and collations.
            for banned in [
                "RETURNING",
                "FOR SHARE",
                "0900",
                "INSERT IGNORE",
                "ON DUPLICATE",
            ] {
                assert!(!upper.contains(banned), "{name} uses {banned}: {sql}");
            }
            assert!(!sql.contains('$'), "{name} uses PostgreSQL placeholders");
        }
    }

    #[test]
    fn rereads_after_a_duplicate_are_locking_reads() {
        for sql in [super::SELECT_REQUEST, super::SELECT_MESSAGE] {
            assert!(sql.ends_with(" LOCK IN SHARE MODE"), "{sql}");
        }
    }

    #[test]
    fn migrations_are_portable() {
        for m in crate::MIGRATIONS {
            let statements = m.statements();
            assert!(!statements.is_empty());
            for sql in statements {
                let upper = sql.to_ascii_uppercase();
                for banned in ["RETURNING", "0900", " JSON", "UTF8MB4_GENERAL", "VARCHAR"] {
                    assert!(!upper.contains(banned), "{} uses {banned}: {sql}", m.name);
                }
                if upper.starts_with("CREATE TABLE") {
                    assert!(upper.contains("ENGINE = INNODB"), "{sql}");
                }
            }
        }
    }
}
