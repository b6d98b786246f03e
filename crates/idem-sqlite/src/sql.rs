//! Every statement the SQLite backend sends.

/// The database clock, in microseconds since the Unix epoch.
macro_rules! now_us {
    () => {
        "CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
    };
}

pub(crate) const BEGIN_IMMEDIATE: &str = "BEGIN IMMEDIATE";
pub(crate) const COMMIT: &str = "COMMIT";
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// The database clock, read once by the claim: the record's `created_at`, and the
/// start of its retention window.
pub(crate) const NOW: &str = concat!("SELECT ", now_us!());

/// A live record (claim and fast path). Params: principal, operation, key.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status FROM idem_request_result ",
    "WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 AND expires_at > ",
    now_us!()
);

/// Params: subscriber, message ID.
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint FROM idem_processed_message ",
    "WHERE subscriber = ?1 AND message_id = ?2 AND expires_at > ",
    now_us!()
);

/// Written once, with the final response, while `BEGIN IMMEDIATE` holds the write
/// lock. The conflict branch replaces an expired record only: the claim saw no live one.
/// Nothing is written (0 rows) when the record's own window (from the claim) already
/// ended while the effect ran. Params: principal, operation, key, request, response,
/// status, claimed at (µs), expires at (µs).
pub(crate) const UPSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) ",
    "SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8 WHERE ?8 > ",
    now_us!(),
    " ON CONFLICT (principal, operation, request_key) DO UPDATE SET ",
    "request = excluded.request, response = excluded.response, status = excluded.status, ",
    "created_at = excluded.created_at, expires_at = excluded.expires_at"
);

/// Params: subscriber, message ID, fingerprint, claimed at (µs), expires at (µs).
pub(crate) const UPSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at, expires_at) ",
    "SELECT ?1, ?2, ?3, ?4, ?5 WHERE ?5 > ",
    now_us!(),
    " ON CONFLICT (subscriber, message_id) DO UPDATE SET ",
    "fingerprint = excluded.fingerprint, processed_at = excluded.processed_at, expires_at = excluded.expires_at"
);

/// Records that are expired **and** were claimed at least `?1` µs ago. Params: older
/// than (µs), limit.
pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE expires_at <= ",
    now_us!(),
    " AND created_at <= ",
    now_us!(),
    " - ?1 ORDER BY expires_at LIMIT ?2)"
);

/// Like [`PURGE_REQUESTS`], for messages.
pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE expires_at <= ",
    now_us!(),
    " AND processed_at <= ",
    now_us!(),
    " - ?1 ORDER BY expires_at LIMIT ?2)"
);

/// A new phased run, committed at its start: `created_at`, `updated_at`, `lease_until`
/// and `expires_at` come from one reading of the database clock (one statement); an
/// existing run of the identity inserts nothing. `WHERE true` keeps `ON CONFLICT` from
/// being parsed as a join's `ON`. Params: principal, operation, key, request, owner,
/// fence, point, lease (µs), retention (µs).
pub(crate) const INSERT_RUN: &str = concat!(
    "INSERT INTO idem_run (principal, operation, request_key, request, owner, fence, point, ",
    "lease_until, created_at, updated_at, expires_at) ",
    "SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, now.t + ?8, now.t, now.t, now.t + ?9 FROM (SELECT ",
    now_us!(),
    " AS t) AS now WHERE true ON CONFLICT (principal, operation, request_key) DO NOTHING"
);
/// A run, with its lease and retention read against the database clock. No locking
/// clause: the run transaction's `BEGIN IMMEDIATE` already excludes every other writer.
/// Params: principal, operation, key.
pub(crate) const SELECT_RUN: &str = concat!(
    "SELECT request, owner, fence, point, state, status, response, lease_until <= ",
    now_us!(),
    ", expires_at <= ",
    now_us!(),
    " FROM idem_run WHERE principal = ?1 AND operation = ?2 AND request_key = ?3"
);
/// The guarded write: only while the owner is still the expected one and the run has no
/// final answer. Params: principal, operation, key, expected owner, owner, fence,
/// point, state, status, response, lease (µs).
pub(crate) const WRITE_RUN: &str = concat!(
    "UPDATE idem_run SET owner = ?5, fence = ?6, point = ?7, state = ?8, status = ?9, ",
    "response = ?10, lease_until = ",
    now_us!(),
    " + ?11, updated_at = ",
    now_us!(),
    " WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 AND owner = ?4 AND status IS NULL"
);
/// Params: principal, operation, key, expected owner.
pub(crate) const DELETE_RUN: &str = "DELETE FROM idem_run \
    WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 AND owner = ?4";
/// Unexpired runs without a final answer whose lease ended, the longest-stalled first.
/// Params: limit.
pub(crate) const STALLED_RUNS: &str = concat!(
    "SELECT principal, operation, request_key, point FROM idem_run WHERE status IS NULL AND lease_until <= ",
    now_us!(),
    " AND expires_at > ",
    now_us!(),
    " ORDER BY lease_until LIMIT ?1"
);

/// Params: destination, message ID, payload.
pub(crate) const ENQUEUE: &str = concat!(
    "INSERT INTO idem_outbox (destination, message_id, payload, created_at) VALUES (?1, ?2, ?3, ",
    now_us!(),
    ")"
);
/// The oldest unsent messages. No locking clause: `BEGIN IMMEDIATE` makes the relay the
/// only writer. Params: limit.
pub(crate) const LOCK_UNSENT: &str = "SELECT id, destination, message_id, payload FROM idem_outbox \
    WHERE sent_at IS NULL ORDER BY id LIMIT ?1";
/// Every unsent message of a destination up to an id. Params: destination, up to.
pub(crate) const UNSENT_IDS: &str = "SELECT id FROM idem_outbox \
    WHERE destination = ?1 AND sent_at IS NULL AND id <= ?2 ORDER BY id";
/// One statement for every id. Params: the ids as a JSON array (`[3,4,7]`).
pub(crate) const MARK_SENT: &str = concat!(
    "UPDATE idem_outbox SET sent_at = ",
    now_us!(),
    " WHERE sent_at IS NULL AND id IN (SELECT value FROM json_each(?1))"
);

/// Runs that are expired **and** were started at least `?1` µs ago. Params: older than
/// (µs), limit.
pub(crate) const PURGE_RUNS: &str = concat!(
    "DELETE FROM idem_run WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_run WHERE expires_at <= ",
    now_us!(),
    " AND created_at <= ",
    now_us!(),
    " - ?1 ORDER BY expires_at LIMIT ?2)"
);
/// Outbox messages sent at least `?1` µs ago; unsent messages are never purged. Params:
/// older than (µs), limit.
pub(crate) const PURGE_OUTBOX: &str = concat!(
    "DELETE FROM idem_outbox WHERE id IN (",
    "SELECT id FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at <= ",
    now_us!(),
    " - ?1 ORDER BY id LIMIT ?2)"
);

pub(crate) const CREATE_MIGRATIONS: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
    version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL) STRICT";
pub(crate) const SELECT_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations";
pub(crate) const INSERT_MIGRATION: &str = concat!(
    "INSERT INTO idem_schema_migrations (version, name, applied_at) VALUES (?1, ?2, ",
    now_us!(),
    ")"
);

/// All statements, for the snapshot test.
#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("begin", BEGIN_IMMEDIATE),
    ("commit", COMMIT),
    ("rollback", ROLLBACK),
    ("now", NOW),
    ("select_request", SELECT_REQUEST),
    ("select_message", SELECT_MESSAGE),
    ("upsert_request", UPSERT_REQUEST),
    ("upsert_message", UPSERT_MESSAGE),
    ("purge_requests", PURGE_REQUESTS),
    ("purge_messages", PURGE_MESSAGES),
    ("insert_run", INSERT_RUN),
    ("select_run", SELECT_RUN),
    ("write_run", WRITE_RUN),
    ("delete_run", DELETE_RUN),
    ("stalled_runs", STALLED_RUNS),
    ("enqueue", ENQUEUE),
    ("lock_unsent", LOCK_UNSENT),
    ("unsent_ids", UNSENT_IDS),
    ("mark_sent", MARK_SENT),
    ("purge_runs", PURGE_RUNS),
    ("purge_outbox", PURGE_OUTBOX),
    ("create_migrations", CREATE_MIGRATIONS),
    ("select_migrations", SELECT_MIGRATIONS),
    ("insert_migration", INSERT_MIGRATION),
];

#[cfg(test)]
mod tests {
    #[test]
    fn statements_snapshot() {
        let text: String = super::ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    #[test]
    fn statements_prepare() {
        let conn = rusqlite::Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        for m in crate::MIGRATIONS {
            conn.execute_batch(m.sql)
                .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        }
        conn.execute_batch(super::CREATE_MIGRATIONS)
            .unwrap_or_else(|e| panic!("{e}"));
        for (name, sql) in super::ALL {
            if !matches!(*name, "begin" | "commit" | "rollback") {
                conn.prepare(sql).unwrap_or_else(|e| panic!("{name}: {e}"));
            }
        }
    }
}
