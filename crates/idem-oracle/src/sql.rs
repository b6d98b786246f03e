//! Every statement the Oracle backend sends.
//!
//! - No trailing `;`: OCI takes one statement per call, and a `;` is a syntax error.
//! - Placeholders are positional, numbered `:1 … :n` in the order they appear, each
//!   used once: in SQL (not PL/SQL) OCI binds by position of occurrence, so a repeated
//!   placeholder would need a second bind anyway.
//! - Scope and key columns are `RAW` and bound as bytes: comparisons are binary whatever
//!   the session's `NLS_COMP` / `NLS_SORT` (those apply to character types only).
//! - Ages come from the database clock: `SYS_EXTRACT_UTC(SYSTIMESTAMP)` is the
//!   server's time in UTC (no session time zone or DST involved); intervals are bound
//!   as whole microseconds and turned into `INTERVAL DAY TO SECOND` with
//!   `NUMTODSINTERVAL`.

/// The database clock, in UTC.
macro_rules! now {
    () => {
        "SYS_EXTRACT_UTC(SYSTIMESTAMP)"
    };
}
/// `now - :n microseconds`.
macro_rules! cutoff {
    ($n:literal) => {
        concat!(now!(), " - NUMTODSINTERVAL(:", $n, " / 1000000, 'SECOND')")
    };
}
/// `now + :n microseconds`: the end of a retention window that starts now.
macro_rules! expiry {
    ($n:literal) => {
        concat!(now!(), " + NUMTODSINTERVAL(:", $n, " / 1000000, 'SECOND')")
    };
}
macro_rules! request_pk {
    ($a:literal, $b:literal, $c:literal) => {
        concat!(
            "principal = :",
            $a,
            " AND operation = :",
            $b,
            " AND request_key = :",
            $c
        )
    };
}
macro_rules! message_pk {
    ($a:literal, $b:literal) => {
        concat!("subscriber = :", $a, " AND message_id = :", $b)
    };
}

/// The claim: a plain INSERT of the placeholder. A conflicting uncommitted row makes
/// it wait for that transaction (bounded by the connection's call timeout); ORA-00001
/// once it commits, success if it rolls back. Binds: principal, operation, key, request,
/// retention (µs).
pub(crate) const INSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) ",
    "VALUES (:1, :2, :3, :4, NULL, 0, ",
    now!(),
    ", ",
    expiry!(5),
    ")"
);
/// The re-read after ORA-00001: under READ COMMITTED each statement reads the data
/// committed before it started, so it sees the row whose commit raised ORA-00001.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status, CASE WHEN expires_at <= ",
    now!(),
    " THEN 1 ELSE 0 END AS expired FROM idem_request_result WHERE ",
    request_pk!(1, 2, 3)
);
/// Takes over an expired record. The expiry test is repeated: if another session
/// changed the row meanwhile, Oracle restarts the UPDATE on the new version and it
/// matches nothing. Binds: request, retention (µs), principal, operation, key.
pub(crate) const REPLACE_EXPIRED_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET request = :1, response = NULL, status = 0, created_at = ",
    now!(),
    ", expires_at = ",
    expiry!(2),
    " WHERE ",
    request_pk!(3, 4, 5),
    " AND expires_at <= ",
    now!()
);
/// Stores the response just before COMMIT; no row when the record expired while the
/// effect ran.
pub(crate) const COMPLETE_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET response = :1, status = :2 WHERE ",
    request_pk!(3, 4, 5),
    " AND response IS NULL AND expires_at > ",
    now!()
);
/// Why a completion changed no row: 1 when the record expired.
pub(crate) const EXPIRED_REQUEST: &str = concat!(
    "SELECT CASE WHEN expires_at <= ",
    now!(),
    " THEN 1 ELSE 0 END FROM idem_request_result WHERE ",
    request_pk!(1, 2, 3)
);
/// The read-only replay fast path: live records only.
pub(crate) const LOOKUP_REQUEST: &str = concat!(
    "SELECT request, response, status FROM idem_request_result WHERE ",
    request_pk!(1, 2, 3),
    " AND expires_at > ",
    now!()
);

/// Binds: subscriber, message ID, fingerprint, retention (µs).
pub(crate) const INSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at, expires_at) ",
    "VALUES (:1, :2, :3, ",
    now!(),
    ", ",
    expiry!(4),
    ")"
);
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint, CASE WHEN expires_at <= ",
    now!(),
    " THEN 1 ELSE 0 END AS expired FROM idem_processed_message WHERE ",
    message_pk!(1, 2)
);
/// Binds: fingerprint, retention (µs), subscriber, message ID.
pub(crate) const REPLACE_EXPIRED_MESSAGE: &str = concat!(
    "UPDATE idem_processed_message SET fingerprint = :1, processed_at = ",
    now!(),
    ", expires_at = ",
    expiry!(2),
    " WHERE ",
    message_pk!(3, 4),
    " AND expires_at <= ",
    now!()
);
/// Before a message's commit: 1 when the claimed record expired while the effect ran.
pub(crate) const EXPIRED_MESSAGE: &str = concat!(
    "SELECT CASE WHEN expires_at <= ",
    now!(),
    " THEN 1 ELSE 0 END FROM idem_processed_message WHERE ",
    message_pk!(1, 2)
);
pub(crate) const LOOKUP_MESSAGE: &str = concat!(
    "SELECT fingerprint FROM idem_processed_message WHERE ",
    message_pk!(1, 2),
    " AND expires_at > ",
    now!()
);

/// One bounded purge batch of records that are expired **and** were claimed at least
/// `:1` µs ago: `ROWNUM` stops the DELETE after `:2` rows. The expiry test is on the
/// DELETE itself, so a row another session is replacing (locked) is re-checked after
/// that session commits and kept if it is live again.
pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE expires_at <= ",
    now!(),
    " AND created_at <= ",
    cutoff!(1),
    " AND ROWNUM <= :2"
);
pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE expires_at <= ",
    now!(),
    " AND processed_at <= ",
    cutoff!(1),
    " AND ROWNUM <= :2"
);

// Phased runs and the outbox (migrations 0003 and 0004). Run statements run inside the
// transaction `begin_runs` opened (Oracle's READ COMMITTED: each statement reads the
// data committed before it began); `STALLED_RUNS` runs on its own.

/// A new run. A conflicting uncommitted row makes it wait for that transaction (bounded
/// by the call timeout when the transaction has a wait bound); ORA-00001 once it
/// commits. Binds: principal, operation, key, request, owner, fence, point, lease (µs),
/// retention (µs).
pub(crate) const INSERT_RUN: &str = concat!(
    "INSERT INTO idem_run (principal, operation, request_key, request, owner, fence, point, ",
    "lease_until, created_at, updated_at, expires_at) ",
    "VALUES (:1, :2, :3, :4, :5, :6, :7, ",
    expiry!(8),
    ", ",
    now!(),
    ", ",
    now!(),
    ", ",
    expiry!(9),
    ")"
);
/// Reads a run and locks its row until the transaction ends (`FOR UPDATE` reads the
/// current committed version, waiting for a transaction that holds the row).
pub(crate) const SELECT_RUN: &str = concat!(
    "SELECT request, owner, fence, point, state, status, response, CASE WHEN lease_until <= ",
    now!(),
    " THEN 1 ELSE 0 END AS lease_over, CASE WHEN expires_at <= ",
    now!(),
    " THEN 1 ELSE 0 END AS expired FROM idem_run WHERE ",
    request_pk!(1, 2, 3),
    " FOR UPDATE"
);
/// The guarded write, a compare-and-set: changes the row only while it holds the
/// expected owner, fence and point and has no final answer; the row count is the rows
/// matched. Binds: owner, fence, point, state, status, response, lease (µs), principal,
/// operation, key, expected owner, expected fence, expected point.
pub(crate) const WRITE_RUN: &str = concat!(
    "UPDATE idem_run SET owner = :1, fence = :2, point = :3, state = :4, status = :5, ",
    "response = :6, lease_until = ",
    expiry!(7),
    ", updated_at = ",
    now!(),
    " WHERE ",
    request_pk!(8, 9, 10),
    " AND owner = :11 AND fence = :12 AND point = :13 AND status IS NULL"
);
/// The lease alone (heartbeat, release): never the point or the state. Binds: lease
/// (µs), principal, operation, key, owner, fence.
pub(crate) const RENEW_LEASE: &str = concat!(
    "UPDATE idem_run SET lease_until = ",
    expiry!(1),
    " WHERE ",
    request_pk!(2, 3, 4),
    " AND owner = :5 AND fence = :6 AND status IS NULL"
);
/// Deletes a run while its owner is the expected one (an expired run being replaced).
/// Binds: principal, operation, key, expected owner.
pub(crate) const DELETE_RUN: &str = concat!(
    "DELETE FROM idem_run WHERE ",
    request_pk!(1, 2, 3),
    " AND owner = :4"
);
/// After a start's lock wait ran out: the run's row, unless another transaction holds
/// it. Binds: principal, operation, key.
pub(crate) const PROBE_RUN_LOCK: &str = concat!(
    "SELECT 1 FROM idem_run WHERE ",
    request_pk!(1, 2, 3),
    " FOR UPDATE SKIP LOCKED"
);
/// Whether a committed row of the run exists (a plain query: never waits for locks).
/// Binds: principal, operation, key.
pub(crate) const PROBE_RUN_EXISTS: &str =
    concat!("SELECT 1 FROM idem_run WHERE ", request_pk!(1, 2, 3));
/// Unexpired runs without a final answer whose lease ended, the longest-stalled first
/// (a plain query: no transaction). Binds: limit.
pub(crate) const STALLED_RUNS: &str = concat!(
    "SELECT principal, operation, request_key, point FROM idem_run WHERE status IS NULL ",
    "AND lease_until <= ",
    now!(),
    " AND expires_at > ",
    now!(),
    " ORDER BY lease_until FETCH FIRST :1 ROWS ONLY"
);

/// Microseconds in the `INTERVAL DAY TO SECOND` `$d` (a difference of two timestamps).
macro_rules! micros_of {
    ($d:expr) => {
        concat!(
            "ROUND(EXTRACT(DAY FROM (",
            $d,
            ")) * 86400000000 + EXTRACT(HOUR FROM (",
            $d,
            ")) * 3600000000 + EXTRACT(MINUTE FROM (",
            $d,
            ")) * 60000000 + EXTRACT(SECOND FROM (",
            $d,
            ")) * 1000000)"
        )
    };
}

/// Stores a message in the caller's transaction (`id` and `created_at` are generated).
/// Binds: destination, message ID, payload.
pub(crate) const ENQUEUE: &str =
    "INSERT INTO idem_outbox (destination, message_id, payload) VALUES (:1, :2, :3)";
/// The oldest due messages, skipping rows other transactions hold. Due: unsent, not
/// dead, the next attempt's time passed, no unexpired claim, and no older pending
/// message of the destination that is not due or is claimed. `FETCH FIRST` cannot be
/// combined with `FOR UPDATE` (ORA-02014): with `SKIP LOCKED` a row is locked when it is
/// fetched, so the backend fetches (and prefetches) at most the limit.
pub(crate) const LOCK_DUE: &str = concat!(
    "SELECT o.id, o.destination, o.message_id, o.payload, o.attempts FROM idem_outbox o ",
    "WHERE o.sent_at IS NULL AND o.dead_at IS NULL AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= ",
    now!(),
    ") AND (o.claimed_until IS NULL OR o.claimed_until <= ",
    now!(),
    ") AND NOT EXISTS (SELECT 1 FROM idem_outbox b WHERE b.destination = o.destination ",
    "AND b.id < o.id AND b.sent_at IS NULL AND b.dead_at IS NULL AND (b.next_attempt_at > ",
    now!(),
    " OR b.claimed_until > ",
    now!(),
    ")) ORDER BY o.id FOR UPDATE OF o.id SKIP LOCKED"
);
/// Every pending message of a destination up to an id, rows other relays hold included
/// (a plain query reads committed data and never waits for locks). Binds: destination,
/// up to (id).
pub(crate) const PENDING_IDS: &str = "SELECT id FROM idem_outbox \
     WHERE destination = :1 AND sent_at IS NULL AND dead_at IS NULL AND id <= :2 ORDER BY id";
/// The start of [`claim_due`]'s statement. Binds: token, lease (µs), then the ids.
pub(crate) const CLAIM_DUE: &str = concat!(
    "UPDATE idem_outbox SET claim_token = :1, claimed_until = ",
    expiry!(2),
    ", attempts = attempts + 1 WHERE sent_at IS NULL AND id IN ("
);
/// The start of [`release`]'s statement. Binds: token, then the ids.
pub(crate) const RELEASE: &str = "UPDATE idem_outbox SET claim_token = NULL, claimed_until = NULL, \
     attempts = GREATEST(attempts - 1, 0) WHERE sent_at IS NULL AND claim_token = :1 AND id IN (";
/// The start of [`mark_sent`]'s statement. Binds: token, then the ids.
pub(crate) const MARK_SENT: &str = concat!(
    "UPDATE idem_outbox SET sent_at = ",
    now!(),
    ", claim_token = NULL, claimed_until = NULL WHERE sent_at IS NULL AND claim_token = :1 AND id IN ("
);
/// A failed attempt with attempts left: tried again after the delay. Only the pass's own
/// claim, or no unexpired claim. Binds: error, delay (µs), id, token.
pub(crate) const RETRY_LATER: &str = concat!(
    "UPDATE idem_outbox SET last_error = :1, next_attempt_at = ",
    expiry!(2),
    ", claim_token = NULL, claimed_until = NULL WHERE id = :3 AND sent_at IS NULL ",
    "AND (claim_token = :4 OR claimed_until IS NULL OR claimed_until <= ",
    now!(),
    ")"
);
/// A failed attempt with none left: dead. Binds: error, id, token.
pub(crate) const BURY: &str = concat!(
    "UPDATE idem_outbox SET last_error = :1, dead_at = ",
    now!(),
    ", claim_token = NULL, claimed_until = NULL WHERE id = :2 AND sent_at IS NULL ",
    "AND (claim_token = :3 OR claimed_until IS NULL OR claimed_until <= ",
    now!(),
    ")"
);
/// The backlog: pending messages, dead ones, the oldest pending one's age (µs).
pub(crate) const OUTBOX_STATS: &str = concat!(
    "SELECT COUNT(CASE WHEN dead_at IS NULL THEN 1 END), COUNT(dead_at), MAX(CASE WHEN dead_at IS NULL THEN ",
    micros_of!(concat!(now!(), " - created_at")),
    " END) FROM idem_outbox WHERE sent_at IS NULL"
);
/// Unsent messages for an operator. Binds: state, state, state (0 unsent, 1 pending,
/// 2 dead), destination or NULL, the same destination, after id, limit.
pub(crate) const LIST_OUTBOX: &str = concat!(
    "SELECT id, destination, message_id, attempts, CASE WHEN dead_at IS NULL THEN 0 ELSE 1 END, ",
    "last_error, ",
    micros_of!(concat!(now!(), " - created_at")),
    ", CASE WHEN next_attempt_at > ",
    now!(),
    " THEN ",
    micros_of!(concat!("next_attempt_at - ", now!())),
    " END, CASE WHEN claimed_until > ",
    now!(),
    " THEN 1 ELSE 0 END FROM idem_outbox WHERE sent_at IS NULL ",
    "AND (:1 = 0 OR (:2 = 1 AND dead_at IS NULL) OR (:3 = 2 AND dead_at IS NOT NULL)) ",
    "AND (:4 IS NULL OR destination = :5) AND id > :6 ORDER BY id FETCH FIRST :7 ROWS ONLY"
);
/// The start of [`retry_ids`]'s statement: back to pending, due now, attempts reset.
pub(crate) const RETRY_IDS: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
     attempts = 0 WHERE sent_at IS NULL AND id IN (";
/// Every dead message back to pending. Binds: destination or NULL, the same.
pub(crate) const RETRY_DEAD: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
     attempts = 0 WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (:1 IS NULL OR destination = :2)";
/// The start of [`drop_ids`]'s statement: deletes unsent messages.
pub(crate) const DROP_IDS: &str = "DELETE FROM idem_outbox WHERE sent_at IS NULL AND id IN (";
/// Deletes every dead message. Binds: destination or NULL, the same.
pub(crate) const DROP_DEAD: &str = "DELETE FROM idem_outbox \
     WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (:1 IS NULL OR destination = :2)";

/// `prefix` + `:{first}` … `:{first + n - 1}` + `)` (`n` ≥ 1).
fn with_ids(prefix: &str, n: usize, first: usize) -> String {
    idem_core::runs::in_list(prefix, n, |i| format!(":{}", i + first - 1))
}
/// Claims `n` messages: [`CLAIM_DUE`], the ids from `:3`.
pub(crate) fn claim_due(n: usize) -> String {
    with_ids(CLAIM_DUE, n, 3)
}
/// Gives back `n` messages: [`RELEASE`], the ids from `:2`.
pub(crate) fn release(n: usize) -> String {
    with_ids(RELEASE, n, 2)
}
/// Marks `n` messages sent: [`MARK_SENT`], the ids from `:2`.
pub(crate) fn mark_sent(n: usize) -> String {
    with_ids(MARK_SENT, n, 2)
}
/// Retries `n` messages: [`RETRY_IDS`], the ids from `:1`.
pub(crate) fn retry_ids(n: usize) -> String {
    with_ids(RETRY_IDS, n, 1)
}
/// Drops `n` messages: [`DROP_IDS`], the ids from `:1`.
pub(crate) fn drop_ids(n: usize) -> String {
    with_ids(DROP_IDS, n, 1)
}

/// One bounded purge batch of runs that are expired **and** were started at least `:1`
/// µs ago (like [`PURGE_REQUESTS`]).
pub(crate) const PURGE_RUNS: &str = concat!(
    "DELETE FROM idem_run WHERE expires_at <= ",
    now!(),
    " AND created_at <= ",
    cutoff!(1),
    " AND ROWNUM <= :2"
);
/// One bounded purge batch of messages sent at least `:1` µs ago; unsent ones are never
/// purged.
pub(crate) const PURGE_OUTBOX: &str = concat!(
    "DELETE FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at <= ",
    cutoff!(1),
    " AND ROWNUM <= :2"
);

/// Oracle has no `CREATE TABLE IF NOT EXISTS` before 23ai: ORA-00955 is tolerated.
pub(crate) const CREATE_MIGRATIONS: &str = concat!(
    "CREATE TABLE idem_schema_migrations (",
    "version NUMBER(10) NOT NULL, name VARCHAR2(255) NOT NULL, ",
    "applied_at TIMESTAMP(6) DEFAULT ",
    now!(),
    " NOT NULL, ",
    "CONSTRAINT idem_schema_migrations_pk PRIMARY KEY (version))"
);
pub(crate) const SELECT_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations";
/// ORA-00001 here means a concurrent migrator recorded the version first.
pub(crate) const INSERT_MIGRATION: &str =
    "INSERT INTO idem_schema_migrations (version, name) VALUES (:1, :2)";
/// The stored JSON is CLOB text: the database character set must be Unicode.
/// `NLS_CHARSET_ID('CHAR_CS')` is the database character set; no privilege is needed.
pub(crate) const DATABASE_CHARSET: &str =
    "SELECT NLS_CHARSET_NAME(NLS_CHARSET_ID('CHAR_CS')) FROM dual";

#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("insert_request", INSERT_REQUEST),
    ("select_request", SELECT_REQUEST),
    ("replace_expired_request", REPLACE_EXPIRED_REQUEST),
    ("complete_request", COMPLETE_REQUEST),
    ("expired_request", EXPIRED_REQUEST),
    ("lookup_request", LOOKUP_REQUEST),
    ("insert_message", INSERT_MESSAGE),
    ("select_message", SELECT_MESSAGE),
    ("replace_expired_message", REPLACE_EXPIRED_MESSAGE),
    ("expired_message", EXPIRED_MESSAGE),
    ("lookup_message", LOOKUP_MESSAGE),
    ("purge_requests", PURGE_REQUESTS),
    ("purge_messages", PURGE_MESSAGES),
    ("insert_run", INSERT_RUN),
    ("select_run", SELECT_RUN),
    ("write_run", WRITE_RUN),
    ("renew_lease", RENEW_LEASE),
    ("delete_run", DELETE_RUN),
    ("probe_run_lock", PROBE_RUN_LOCK),
    ("probe_run_exists", PROBE_RUN_EXISTS),
    ("stalled_runs", STALLED_RUNS),
    ("enqueue", ENQUEUE),
    ("lock_due", LOCK_DUE),
    ("pending_ids", PENDING_IDS),
    ("retry_later", RETRY_LATER),
    ("bury", BURY),
    ("outbox_stats", OUTBOX_STATS),
    ("list_outbox", LIST_OUTBOX),
    ("retry_dead", RETRY_DEAD),
    ("drop_dead", DROP_DEAD),
    ("purge_runs", PURGE_RUNS),
    ("purge_outbox", PURGE_OUTBOX),
    ("create_migrations", CREATE_MIGRATIONS),
    ("select_migrations", SELECT_MIGRATIONS),
    ("insert_migration", INSERT_MIGRATION),
    ("database_charset", DATABASE_CHARSET),
];

#[cfg(test)]
mod tests {
    use super::ALL;

    /// The placeholders of a statement, in order of appearance (`:1` → 1).
    fn placeholders(sql: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut in_quote = false;
        let bytes = sql.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match bytes[i] {
                b'\'' => in_quote = !in_quote,
                b':' if !in_quote => {
                    let digits: String = sql[i + 1..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    assert!(
                        !digits.is_empty(),
                        "only numbered placeholders are used: {sql}"
                    );
                    i += digits.len();
                    out.push(digits.parse().unwrap_or(0));
                }
                _ => {}
            }
            i += 1;
        }
        out
    }

    #[test]
    fn statements_snapshot() {
        let text: String = ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql}\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }

    /// A statement built for a number of ids.
    type Built = fn(usize) -> String;

    #[test]
    fn built_statements_snapshot() {
        let built: [(&str, Built); 5] = [
            ("claim_due", super::claim_due),
            ("release", super::release),
            ("mark_sent", super::mark_sent),
            ("retry_ids", super::retry_ids),
            ("drop_ids", super::drop_ids),
        ];
        let text = built
            .iter()
            .flat_map(|(name, f)| [1, 3].map(|n| format!("-- {name}({n})\n{}\n", f(n))))
            .collect::<Vec<_>>()
            .join("\n");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn id_lists_bind_one_placeholder_per_id_in_order() {
        for n in [1, 2, 10, idem_core::runs::MAX_RELAY_BATCH as usize] {
            for (sql, before) in [
                (super::claim_due(n), 2),
                (super::release(n), 1),
                (super::mark_sent(n), 1),
                (super::retry_ids(n), 0),
                (super::drop_ids(n), 0),
            ] {
                let want: Vec<u32> = (1..=u32::try_from(n + before).unwrap_or(0)).collect();
                assert_eq!(placeholders(&sql), want, "{sql}");
            }
        }
        // Never an empty `IN ()`, which is a syntax error.
        assert!(super::retry_ids(0).ends_with("(:1)"));
    }

    #[test]
    fn run_statements_lock_what_they_must() {
        assert!(super::SELECT_RUN.ends_with(" FOR UPDATE"));
        assert!(super::LOCK_DUE.ends_with(" SKIP LOCKED"));
        assert!(!super::LOCK_DUE.contains("FETCH FIRST"), "ORA-02014");
        assert!(super::PROBE_RUN_LOCK.ends_with(" FOR UPDATE SKIP LOCKED"));
        for plain in [
            super::PENDING_IDS,
            super::STALLED_RUNS,
            super::PROBE_RUN_EXISTS,
        ] {
            assert!(!plain.contains("FOR UPDATE"), "{plain}");
        }
    }

    #[test]
    fn placeholders_are_numbered_in_order_and_used_once() {
        for (name, sql) in ALL {
            let found = placeholders(sql);
            let want: Vec<u32> = (1..=u32::try_from(found.len()).unwrap_or(0)).collect();
            assert_eq!(found, want, "{name}: {sql}");
        }
    }

    #[test]
    fn no_statement_ends_with_a_semicolon_or_uses_postgres_syntax() {
        for (name, sql) in ALL {
            assert!(!sql.trim_end().ends_with(';'), "{name}");
            for foreign in ["$1", "?", "ON CONFLICT", "LIMIT ", "IF NOT EXISTS", "::"] {
                assert!(!sql.contains(foreign), "{name} contains {foreign:?}");
            }
            assert_eq!(
                sql.matches('(').count(),
                sql.matches(')').count(),
                "{name}: unbalanced parentheses"
            );
        }
    }

    #[test]
    fn every_age_comes_from_the_database_clock() {
        for (name, sql) in ALL {
            if sql.contains("created_at") || sql.contains("processed_at") {
                assert!(
                    sql.contains("SYS_EXTRACT_UTC(SYSTIMESTAMP)") || *name == "complete_request",
                    "{name}"
                );
                assert!(!sql.contains("SYSDATE") && !sql.contains("CURRENT_TIMESTAMP"));
            }
        }
    }
}
