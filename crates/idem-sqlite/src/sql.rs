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
/// When the record's own window (from the claim) already ended while the effect ran,
/// its `expires_at` is the text `'ended'`, which the `STRICT` table refuses for an
/// `INTEGER` column (`SQLITE_CONSTRAINT_DATATYPE`, which no other value bound here can
/// raise: [`crate::error_codes::is_window_guard`]): nothing is written. A single-row `VALUES`
/// (not `INSERT … SELECT … WHERE`, which opens a statement journal and copies the pages
/// it changes into it). Params: principal, operation, key, request, response, status,
/// claimed at (µs), expires at (µs).
pub(crate) const UPSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) ",
    "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, CASE WHEN ?8 > ",
    now_us!(),
    " THEN ?8 ELSE 'ended' END) ON CONFLICT (principal, operation, request_key) DO UPDATE SET ",
    "request = excluded.request, response = excluded.response, status = excluded.status, ",
    "created_at = excluded.created_at, expires_at = excluded.expires_at"
);

/// Like [`UPSERT_REQUEST`]. Params: subscriber, message ID, fingerprint, claimed at (µs),
/// expires at (µs).
pub(crate) const UPSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at, expires_at) ",
    "VALUES (?1, ?2, ?3, ?4, CASE WHEN ?5 > ",
    now_us!(),
    " THEN ?5 ELSE 'ended' END) ON CONFLICT (subscriber, message_id) DO UPDATE SET ",
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
/// The guarded write, a compare-and-set: only while the row holds the expected owner,
/// fence and point and has no final answer. Params: principal, operation, key, expected
/// owner, owner, fence, point, state, status, response, lease (µs), expected fence,
/// expected point.
pub(crate) const WRITE_RUN: &str = concat!(
    "UPDATE idem_run SET owner = ?5, fence = ?6, point = ?7, state = ?8, status = ?9, ",
    "response = ?10, lease_until = ",
    now_us!(),
    " + ?11, updated_at = ",
    now_us!(),
    " WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 AND owner = ?4 ",
    "AND fence = ?12 AND point = ?13 AND status IS NULL"
);
/// The lease alone (heartbeat, release): never the point or the state. Params:
/// principal, operation, key, owner, fence, lease (µs).
pub(crate) const RENEW_LEASE: &str = concat!(
    "UPDATE idem_run SET lease_until = ",
    now_us!(),
    " + ?6 WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 AND owner = ?4 ",
    "AND fence = ?5 AND status IS NULL"
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
/// The oldest due messages: unsent, not dead, their next attempt's time passed, no
/// unexpired claim, and no older pending message of their destination that is not due
/// or is claimed. No locking clause: `BEGIN IMMEDIATE` makes the relay the only writer.
/// Params: limit.
pub(crate) const LOCK_DUE: &str = concat!(
    "SELECT o.id, o.destination, o.message_id, o.payload, o.attempts FROM idem_outbox AS o ",
    "WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= ",
    now_us!(),
    ") AND (o.claimed_until IS NULL OR o.claimed_until <= ",
    now_us!(),
    ") AND NOT EXISTS (SELECT 1 FROM idem_outbox AS b WHERE b.destination = o.destination ",
    "AND b.id < o.id AND b.sent_at IS NULL AND b.dead_at IS NULL AND (b.next_attempt_at > ",
    now_us!(),
    " OR b.claimed_until > ",
    now_us!(),
    ")) ORDER BY o.id LIMIT ?1"
);
/// Every pending (unsent, not dead) message of a destination up to an id. Params:
/// destination, up to.
pub(crate) const PENDING_IDS: &str = "SELECT id FROM idem_outbox \
    WHERE destination = ?1 AND sent_at IS NULL AND dead_at IS NULL AND id <= ?2 ORDER BY id";
/// Claims messages for a pass (one more attempt each). Params: token, lease (µs), the
/// ids as a JSON array (`[3,4,7]`).
pub(crate) const CLAIM_DUE: &str = concat!(
    "UPDATE idem_outbox SET claim_token = ?1, claimed_until = ",
    now_us!(),
    " + ?2, attempts = attempts + 1 WHERE sent_at IS NULL AND id IN (SELECT value FROM json_each(?3))"
);
/// Gives back claimed messages the pass did not try (the attempt uncounted). Params:
/// token, the ids as a JSON array.
pub(crate) const RELEASE: &str = "UPDATE idem_outbox SET claim_token = NULL, claimed_until = NULL, \
    attempts = max(attempts - 1, 0) WHERE sent_at IS NULL AND claim_token = ?1 \
    AND id IN (SELECT value FROM json_each(?2))";
/// Marks the pass's published messages sent. Params: token, the ids as a JSON array.
pub(crate) const MARK_SENT: &str = concat!(
    "UPDATE idem_outbox SET sent_at = ",
    now_us!(),
    ", claim_token = NULL, claimed_until = NULL WHERE sent_at IS NULL AND claim_token = ?1 ",
    "AND id IN (SELECT value FROM json_each(?2))"
);
/// A failed attempt with attempts left: tried again after the delay. Only the pass's own
/// claim, or no unexpired claim. Params: error, delay (µs), id, token.
pub(crate) const RETRY_LATER: &str = concat!(
    "UPDATE idem_outbox SET last_error = ?1, next_attempt_at = ",
    now_us!(),
    " + ?2, claim_token = NULL, claimed_until = NULL WHERE id = ?3 AND sent_at IS NULL ",
    "AND (claim_token = ?4 OR claimed_until IS NULL OR claimed_until <= ",
    now_us!(),
    ")"
);
/// A failed attempt with none left: dead. Params: error, id, token (as
/// [`RETRY_LATER`]).
pub(crate) const BURY: &str = concat!(
    "UPDATE idem_outbox SET last_error = ?1, dead_at = ",
    now_us!(),
    ", claim_token = NULL, claimed_until = NULL WHERE id = ?2 AND sent_at IS NULL ",
    "AND (claim_token = ?3 OR claimed_until IS NULL OR claimed_until <= ",
    now_us!(),
    ")"
);
/// The backlog: pending messages, dead ones, the oldest pending one's age (µs).
pub(crate) const OUTBOX_STATS: &str = concat!(
    "SELECT coalesce(sum(dead_at IS NULL), 0), count(dead_at), max(CASE WHEN dead_at IS NULL THEN ",
    now_us!(),
    " - created_at END) FROM idem_outbox WHERE sent_at IS NULL"
);
/// Unsent messages for an operator. Params: state (0 unsent, 1 pending, 2 dead),
/// destination or NULL, after id, limit.
pub(crate) const LIST_OUTBOX: &str = concat!(
    "SELECT id, destination, message_id, attempts, dead_at IS NOT NULL, last_error, ",
    now_us!(),
    " - created_at, CASE WHEN next_attempt_at > ",
    now_us!(),
    " THEN next_attempt_at - ",
    now_us!(),
    " END, coalesce(claimed_until > ",
    now_us!(),
    ", 0) FROM idem_outbox WHERE sent_at IS NULL ",
    "AND (?1 = 0 OR (?1 = 1 AND dead_at IS NULL) OR (?1 = 2 AND dead_at IS NOT NULL)) ",
    "AND (?2 IS NULL OR destination = ?2) AND id > ?3 ORDER BY id LIMIT ?4"
);
/// Back to pending, due now, attempts reset. Params: the ids as a JSON array.
pub(crate) const RETRY_IDS: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
    attempts = 0 WHERE sent_at IS NULL AND id IN (SELECT value FROM json_each(?1))";
/// Every dead message back to pending. Params: destination or NULL.
pub(crate) const RETRY_DEAD: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
    attempts = 0 WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (?1 IS NULL OR destination = ?1)";
/// Deletes unsent messages. Params: the ids as a JSON array.
pub(crate) const DROP_IDS: &str = "DELETE FROM idem_outbox \
    WHERE sent_at IS NULL AND id IN (SELECT value FROM json_each(?1))";
/// Deletes every dead message. Params: destination or NULL.
pub(crate) const DROP_DEAD: &str = "DELETE FROM idem_outbox \
    WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (?1 IS NULL OR destination = ?1)";

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
    ("renew_lease", RENEW_LEASE),
    ("delete_run", DELETE_RUN),
    ("stalled_runs", STALLED_RUNS),
    ("enqueue", ENQUEUE),
    ("lock_due", LOCK_DUE),
    ("pending_ids", PENDING_IDS),
    ("claim_due", CLAIM_DUE),
    ("release", RELEASE),
    ("mark_sent", MARK_SENT),
    ("retry_later", RETRY_LATER),
    ("bury", BURY),
    ("outbox_stats", OUTBOX_STATS),
    ("list_outbox", LIST_OUTBOX),
    ("retry_ids", RETRY_IDS),
    ("retry_dead", RETRY_DEAD),
    ("drop_ids", DROP_IDS),
    ("drop_dead", DROP_DEAD),
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
