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

// Phased runs and the outbox (migration 0003). Run statements run inside the
// transaction `begin_runs` opened (READ COMMITTED); `STALLED_RUNS` runs on its own.

/// A new run. A conflicting uncommitted row makes it wait for that transaction (bounded
/// by `innodb_lock_wait_timeout`); a committed one fails it with 1062 (only this
/// statement is rolled back). One `UTC_TIMESTAMP(6)` reading for every time column.
/// Params: principal, operation, key, request, owner, fence, point, lease (µs),
/// retention (µs).
pub(crate) const INSERT_RUN: &str = concat!(
    "INSERT INTO idem_run (principal, operation, request_key, request, owner, fence, point, \
     lease_until, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ",
    expiry!(),
    ", UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ",
    expiry!(),
    ")"
);
/// Reads a run and locks its row until the transaction ends (a locking read: the latest
/// committed version, whatever the isolation level). Params: principal, operation, key.
pub(crate) const SELECT_RUN: &str = concat!(
    "SELECT request, owner, fence, point, state, status, response, \
     lease_until <= UTC_TIMESTAMP(6) AS lease_over, expires_at <= UTC_TIMESTAMP(6) AS expired \
     FROM idem_run WHERE ",
    request_pk!(),
    " FOR UPDATE"
);
/// The guarded write: changes the row only while its owner is the expected one and it
/// has no final answer. Without `CLIENT_FOUND_ROWS` the server counts *changed* rows,
/// so `updated_at` moves forward by at least 1 µs on every write: a matched row is
/// always a changed row, and the count says "matched". Params: owner, fence, point,
/// state, status, response, lease (µs), principal, operation, key, expected owner.
pub(crate) const WRITE_RUN: &str = concat!(
    "UPDATE idem_run SET owner = ?, fence = ?, point = ?, state = ?, status = ?, response = ?, \
     lease_until = ",
    expiry!(),
    ", updated_at = GREATEST(UTC_TIMESTAMP(6), updated_at + INTERVAL 1 MICROSECOND) WHERE ",
    request_pk!(),
    " AND owner = ? AND status IS NULL"
);
/// Deletes a run while its owner is the expected one (an expired run being replaced).
/// Params: principal, operation, key, expected owner.
pub(crate) const DELETE_RUN: &str = concat!(
    "DELETE FROM idem_run WHERE ",
    request_pk!(),
    " AND owner = ?"
);
/// Unexpired runs without a final answer whose lease ended, the longest-stalled first
/// (an autocommit read after [`READ_COMMITTED`]). Params: limit.
pub(crate) const STALLED_RUNS: &str = "SELECT principal, operation, request_key, point FROM idem_run \
     WHERE status IS NULL AND lease_until <= UTC_TIMESTAMP(6) AND expires_at > UTC_TIMESTAMP(6) \
     ORDER BY lease_until LIMIT ?";
/// Asks the server for its status flags (a no-op whose OK packet says whether the
/// session is still inside a transaction): before a run's guarded write and its
/// `COMMIT`, when the last packet did not already say so.
pub(crate) const STATUS_PROBE: &str = "DO 0";

/// Stores a message in the caller's transaction. Params: destination, message ID,
/// payload.
pub(crate) const ENQUEUE: &str = "INSERT INTO idem_outbox (destination, message_id, payload, created_at) \
     VALUES (?, ?, ?, UTC_TIMESTAMP(6))";
/// Locks the oldest unsent messages, skipping rows another relay holds (MariaDB 10.6+,
/// MySQL 8.0+). Under READ COMMITTED the locking read takes no gap locks, so producers'
/// `INSERT`s never wait for a relay. Params: limit.
pub(crate) const LOCK_UNSENT: &str = "SELECT id, destination, message_id, payload FROM idem_outbox \
     WHERE sent_at IS NULL ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED";
/// Every unsent message of a destination up to an id, rows other relays hold included:
/// a plain (consistent, non-locking) read, which under READ COMMITTED sees the latest
/// committed rows. Params: destination, up to (id).
pub(crate) const UNSENT_IDS: &str = "SELECT id FROM idem_outbox \
     WHERE destination = ? AND sent_at IS NULL AND id <= ? ORDER BY id";
/// The start of [`mark_sent`]'s statement.
pub(crate) const MARK_SENT: &str =
    "UPDATE idem_outbox SET sent_at = UTC_TIMESTAMP(6) WHERE id IN (";
/// Marks `n` messages sent: [`MARK_SENT`] with `n` placeholders (`n` ≥ 1). Params: the
/// ids.
pub(crate) fn mark_sent(n: usize) -> String {
    idem_core::runs::in_list(MARK_SENT, n, |_| "?".to_owned())
}

/// Runs that are expired **and** were started at least `?` µs ago, oldest expiry first.
/// Params: older than (µs), limit.
pub(crate) const PURGE_RUNS: &str = concat!(
    "DELETE FROM idem_run WHERE expires_at <= UTC_TIMESTAMP(6) AND created_at <= ",
    cutoff!(),
    " ORDER BY expires_at LIMIT ?"
);
/// Messages sent at least `?` µs ago, oldest first; unsent ones are never purged.
/// Params: older than (µs), limit.
pub(crate) const PURGE_OUTBOX: &str = concat!(
    "DELETE FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at <= ",
    cutoff!(),
    " ORDER BY id LIMIT ?"
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
    ("insert_run", INSERT_RUN),
    ("select_run", SELECT_RUN),
    ("write_run", WRITE_RUN),
    ("delete_run", DELETE_RUN),
    ("stalled_runs", STALLED_RUNS),
    ("status_probe", STATUS_PROBE),
    ("enqueue", ENQUEUE),
    ("lock_unsent", LOCK_UNSENT),
    ("unsent_ids", UNSENT_IDS),
    ("purge_runs", PURGE_RUNS),
    ("purge_outbox", PURGE_OUTBOX),
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
    fn built_statements_snapshot() {
        let text = [1, 3]
            .map(|n| format!("-- mark_sent({n})\n{};\n", super::mark_sent(n)))
            .join("\n");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn mark_sent_binds_one_placeholder_per_id() {
        for n in [1, 2, 7, idem_core::runs::MAX_RELAY_BATCH as usize] {
            let sql = super::mark_sent(n);
            assert_eq!(sql.matches('?').count(), n, "{sql}");
            assert!(
                sql.starts_with(super::MARK_SENT) && sql.ends_with("?)"),
                "{sql}"
            );
        }
        // Never an empty `IN ()`, which is a syntax error.
        assert!(super::mark_sent(0).ends_with("(?)"));
    }

    #[test]
    fn run_statements_lock_what_they_must() {
        assert!(super::SELECT_RUN.ends_with(" FOR UPDATE"));
        assert!(super::LOCK_UNSENT.ends_with(" FOR UPDATE SKIP LOCKED"));
        for plain in [super::UNSENT_IDS, super::STALLED_RUNS] {
            assert!(
                !plain.contains("FOR UPDATE") && !plain.contains("LOCK IN"),
                "{plain}"
            );
        }
        // A write counts as matched only because it always changes `updated_at`.
        assert!(super::WRITE_RUN.contains("updated_at + INTERVAL 1 MICROSECOND"));
        assert!(super::WRITE_RUN.ends_with("AND owner = ? AND status IS NULL"));
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
