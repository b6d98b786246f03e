//! Every statement the MySQL/MariaDB backend sends.
//!
//! Portable between MySQL 8.4 and MariaDB 10.11: no `RETURNING`, no `FOR SHARE`
//! (MariaDB spells it `LOCK IN SHARE MODE`, which MySQL 8.4 still accepts), no
//! MySQL-only collations. Parameters are `?`, in the order the comment of each
//! statement lists. The exceptions are MariaDB's merged messages (the claim after
//! [`START_TRANSACTION_THEN`], [`complete_and_commit_request`],
//! [`complete_and_commit_message`]): text queries, sent only to MariaDB, whose values
//! [`inline`] writes into the text as hex literals.

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
macro_rules! lookup_request {
    () => {
        concat!(
            "SELECT request, response, status FROM idem_request_result WHERE ",
            request_pk!(),
            " AND expires_at > UTC_TIMESTAMP(6)"
        )
    };
}
/// The replay fast path on MySQL: a plain read outside any write transaction, after
/// [`READ_COMMITTED`] (so a session at READ UNCOMMITTED never replays an uncommitted
/// placeholder). Params: principal, operation, key.
pub(crate) const LOOKUP_REQUEST: &str = lookup_request!();
/// The replay fast path on MariaDB, one plain read outside any write transaction (no
/// lock, no round trip of its own): under READ COMMITTED, REPEATABLE READ or
/// SERIALIZABLE an autocommit read sees committed versions only. Its last column says
/// whether the session reads uncommitted rows (`@@SESSION.tx_isolation`); a row read so
/// is no replay, and the claim decides. (A one-shot `SET TRANSACTION ISOLATION LEVEL READ
/// UNCOMMITTED` left pending on a pooled session by other code is not seen; idem's own
/// sessions never set one.) Params: principal, operation, key.
pub(crate) const LOOKUP_REQUEST_COMMITTED: &str = concat!(
    "SELECT request, response, status, @@SESSION.tx_isolation = 'READ-UNCOMMITTED' AS dirty FROM idem_request_result WHERE ",
    request_pk!(),
    " AND expires_at > UTC_TIMESTAMP(6)"
);
/// Pins the next transaction (the lookup's autocommit read) to READ COMMITTED.
pub(crate) const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// MariaDB: the claim's first message, `START TRANSACTION` and the bounded `INSERT` of
/// the placeholder in one text query (one round trip; the server runs them in order and
/// stops at the first error). Followed by [`SET_STATEMENT_LOCK_WAIT`] and the claim's
/// [`inline`]d `INSERT`. A 1062 or 1205 from the `INSERT` fails only that statement:
/// the transaction `START TRANSACTION` opened stays open for the re-read or the
/// rollback.
pub(crate) const START_TRANSACTION_THEN: &str = "START TRANSACTION; ";
/// `START TRANSACTION` alone (MySQL, and phased runs).
pub(crate) const START_TRANSACTION: &str = "START TRANSACTION";
/// Ends idem's transaction with its writes.
pub(crate) const COMMIT: &str = "COMMIT";
/// Ends idem's transaction without its writes.
pub(crate) const ROLLBACK: &str = "ROLLBACK";

/// The guard of a merged completion: `SET STATEMENT sql_mode = 'STRICT_ALL_TABLES' FOR`
/// before its `UPDATE`, so that setting a `NOT NULL` column to `NULL` fails the statement
/// (error 1048) whatever the session's `sql_mode` (without strict mode the server would
/// store the column's implicit default and only warn). The statement parses the same
/// under every mode (no quotes but `'`, no backslashes).
macro_rules! strict {
    () => {
        "SET STATEMENT sql_mode = 'STRICT_ALL_TABLES' FOR "
    };
}

/// MariaDB: a request's completion, guarded, with its values [`inline`]d; followed by
/// `; COMMIT` in one message ([`complete_and_commit`]). `status` is assigned first (a
/// MariaDB `UPDATE` assigns left to right, so the guard reads the old `response`): it
/// becomes `NULL`, and the statement fails with error 1048 before the `COMMIT` runs,
/// unless idem's transaction is still open (`@@in_transaction`: the effect may have
/// ended it: a swallowed deadlock, its own `COMMIT`, `ROLLBACK` or DDL) and the row is
/// the unfinished, unexpired placeholder. Params: status, response, principal,
/// operation, key.
pub(crate) const COMPLETE_REQUEST_GUARDED: &str = concat!(
    strict!(),
    "UPDATE idem_request_result SET status = IF(@@in_transaction = 1 AND response IS NULL AND \
     expires_at > UTC_TIMESTAMP(6), ?, NULL), response = ? WHERE ",
    request_pk!()
);

/// MariaDB: a message's check before its `COMMIT`, guarded like
/// [`COMPLETE_REQUEST_GUARDED`]: `processed_at` (`NOT NULL`) keeps its value while the
/// record is live and becomes `NULL` (error 1048) once it expired. Params: subscriber,
/// message ID.
pub(crate) const CHECK_MESSAGE_GUARDED: &str = concat!(
    strict!(),
    "UPDATE idem_processed_message SET processed_at = IF(expires_at > UTC_TIMESTAMP(6), \
     processed_at, NULL) WHERE ",
    message_pk!()
);

/// After a merged completion failed with error 1048: whether idem's transaction is
/// still open, and whether the record expired (`NULL`: no row). Params: the key's.
pub(crate) fn why_not_completed(expired: &str) -> String {
    format!("SELECT @@in_transaction, ({expired})")
}

/// MariaDB: a request's completion and `COMMIT` in one round trip: the [`inline`]d
/// [`COMPLETE_REQUEST_GUARDED`], then `COMMIT`. The server runs a multi-statement
/// message in order and stops at the first error, so a guard that fails (1048) leaves
/// the transaction open for idem to roll back; one that finds no row at all (the
/// transaction ended and took the placeholder with it) changes no row, and the backend
/// reports that from the `UPDATE`'s count. A lost reply is an unknown outcome exactly
/// like a lost `COMMIT` reply.
pub(crate) fn complete_and_commit_request(complete: &str) -> String {
    format!("{complete}; COMMIT")
}

/// MariaDB: a message's completion and `COMMIT` in one round trip: [`RELEASE_CLAIMED`]
/// (error 1305 when the claim's savepoint, so the claiming transaction, is gone), the
/// [`inline`]d [`CHECK_MESSAGE_GUARDED`] (1048 when the record expired), `COMMIT`.
pub(crate) fn complete_and_commit_message(check: &str) -> String {
    format!("{RELEASE_CLAIMED}; {check}; COMMIT")
}

/// A value [`inline`]d into a statement's text.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Lit<'a> {
    /// Text for a `utf8mb4` column: `_utf8mb4 X'…'`.
    Text(&'a str),
    /// Bytes for a `VARBINARY` column: `_binary X'…'`.
    Bytes(&'a [u8]),
    /// An integer idem computed, formatted in decimal.
    Int(i64),
    /// `NULL`.
    Null,
}

/// Appends the hex literal of `bytes` with a charset introducer (`_utf8mb4`, `_binary`)
/// to `out`: `_utf8mb4 X'C3A9'`, `_binary X''`. The only way a user value reaches the
/// text of a statement: whatever the value holds (quotes, backslashes, `*/`, NUL, any
/// Unicode), the text gets only `[0-9A-F]` from it, so nothing needs quoting or escaping
/// and nothing can be injected; the introducer makes the server read the bytes in that
/// character set (and so in a collation the column's is coercible from: `utf8mb4` text
/// into the `utf8mb4_bin` columns, `binary` bytes compared with the `VARBINARY` key
/// columns, whose primary-key index is used).
fn push_hex(out: &mut String, introducer: &str, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push_str(introducer);
    out.push_str(" X'");
    for b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0F)]));
    }
    out.push('\'');
}

/// The length of what [`push_hex`] appends.
fn hex_len(introducer: &str, bytes: &[u8]) -> usize {
    introducer.len() + 4 + 2 * bytes.len()
}

impl Lit<'_> {
    /// The rendered literal's length, or more (an integer's: its longest).
    fn max_len(&self) -> usize {
        match self {
            Self::Text(s) => hex_len("_utf8mb4", s.as_bytes()),
            Self::Bytes(b) => hex_len("_binary", b),
            Self::Int(_) => "-9223372036854775808".len(),
            Self::Null => "NULL".len(),
        }
    }

    /// Appends the literal to `out`.
    fn render_into(self, out: &mut String) {
        match self {
            Self::Text(s) => push_hex(out, "_utf8mb4", s.as_bytes()),
            Self::Bytes(b) => push_hex(out, "_binary", b),
            Self::Int(i) => {
                use std::fmt::Write;
                // Writing to a String cannot fail.
                let _ = write!(out, "{i}");
            }
            Self::Null => out.push_str("NULL"),
        }
    }
}

/// `statement` (one of this module's, whose only `?` are its placeholders) with its
/// placeholders replaced, in order, by `values` as literals: a text query that needs no
/// prepared statement, so it can travel with other statements in one message. `None`
/// when the counts differ (a bug in the caller, reported as an error). One pass over the
/// statement, into a string allocated once at its final size.
pub(crate) fn inline(statement: &str, values: &[Lit<'_>]) -> Option<String> {
    let mut out =
        String::with_capacity(statement.len() + values.iter().map(Lit::max_len).sum::<usize>());
    let mut parts = statement.split('?');
    out.push_str(parts.next()?);
    let mut values = values.iter();
    for part in parts {
        values.next()?.render_into(&mut out);
        out.push_str(part);
    }
    values.next().is_none().then_some(out)
}

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
macro_rules! lookup_message {
    () => {
        concat!(
            "SELECT fingerprint FROM idem_processed_message WHERE ",
            message_pk!(),
            " AND expires_at > UTC_TIMESTAMP(6)"
        )
    };
}
/// Params: subscriber, message ID.
pub(crate) const LOOKUP_MESSAGE: &str = lookup_message!();
/// [`LOOKUP_MESSAGE`] on MariaDB (see [`LOOKUP_REQUEST_COMMITTED`]).
pub(crate) const LOOKUP_MESSAGE_COMMITTED: &str = concat!(
    "SELECT fingerprint, @@SESSION.tx_isolation = 'READ-UNCOMMITTED' AS dirty FROM idem_processed_message WHERE ",
    message_pk!(),
    " AND expires_at > UTC_TIMESTAMP(6)"
);

/// Saves the session's `innodb_lock_wait_timeout` and bounds the claim's lock waits
/// (whole seconds, appended by the backend: an integer, never user text).
pub(crate) const SET_LOCK_WAIT: &str = "SET @idem_lock_wait = @@SESSION.innodb_lock_wait_timeout, \
     SESSION innodb_lock_wait_timeout = ";
/// Gives the session (and the effect) its own `innodb_lock_wait_timeout` back.
pub(crate) const RESTORE_LOCK_WAIT: &str = "SET SESSION innodb_lock_wait_timeout = @idem_lock_wait";
/// MariaDB: bounds one claim statement's lock waits without touching the session
/// (`SET STATEMENT … FOR`, MariaDB 10.1.2+; MySQL has no such clause), so there is
/// nothing to save or restore. Followed by whole seconds (an integer appended by the
/// backend, never user text), `FOR ` and the statement.
pub(crate) const SET_STATEMENT_LOCK_WAIT: &str = "SET STATEMENT innodb_lock_wait_timeout = ";
/// The server's `max_allowed_packet`, named in the error for a payload above it, and
/// its version (MariaDB's says so).
pub(crate) const MAX_ALLOWED_PACKET: &str = "SELECT @@max_allowed_packet, @@version";
/// Whether this MariaDB server is a Galera node (an error on a server built without
/// Galera support, which is not one).
pub(crate) const WSREP_ON: &str = "SELECT @@global.wsrep_on";

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

// Phased runs and the outbox (migrations 0003 and 0004). Run statements run inside the
// transaction `begin_runs` opened (READ COMMITTED); `STALLED_RUNS` runs on its own.

/// A new run, or an exclusive lock on the existing one. `ON DUPLICATE KEY UPDATE` with
/// a no-op assignment takes an **exclusive** lock on a duplicate row (a plain INSERT's
/// 1062 takes a shared one): concurrent starts of an existing run then queue for its row
/// instead of each holding a shared lock and asking for the exclusive one the takeover
/// needs (a certain deadlock, 1213). The server counts 1 for an inserted row, 0 for the
/// existing one left as it is. A conflicting uncommitted row makes it wait for that
/// transaction (bounded by `innodb_lock_wait_timeout`). One `UTC_TIMESTAMP(6)` reading
/// for every time column. Params: principal, operation, key, request, owner, fence,
/// point, lease (µs), retention (µs).
pub(crate) const INSERT_RUN: &str = concat!(
    "INSERT INTO idem_run (principal, operation, request_key, request, owner, fence, point, \
     lease_until, created_at, updated_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ",
    expiry!(),
    ", UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ",
    expiry!(),
    ") ON DUPLICATE KEY UPDATE owner = owner"
);
/// Reads a run and locks its row until the transaction ends (a locking read: the latest
/// committed version). Params: principal, operation, key.
pub(crate) const SELECT_RUN: &str = concat!(
    "SELECT request, owner, fence, point, state, status, response, \
     lease_until <= UTC_TIMESTAMP(6) AS lease_over, expires_at <= UTC_TIMESTAMP(6) AS expired \
     FROM idem_run WHERE ",
    request_pk!(),
    " FOR UPDATE"
);
/// The guarded write, a compare-and-set: changes the row only while it holds the
/// expected owner, fence and point and has no final answer. Without `CLIENT_FOUND_ROWS`
/// the server counts *changed* rows, so `updated_at` always moves forward (a row written
/// twice within one microsecond still changes). Params: owner, fence, point, state,
/// status, response, lease (µs), principal, operation, key, expected owner, expected
/// fence, expected point.
pub(crate) const WRITE_RUN: &str = concat!(
    "UPDATE idem_run SET owner = ?, fence = ?, point = ?, state = ?, status = ?, response = ?, \
     lease_until = ",
    expiry!(),
    ", updated_at = GREATEST(UTC_TIMESTAMP(6), updated_at + INTERVAL 1 MICROSECOND) WHERE ",
    request_pk!(),
    " AND owner = ? AND fence = ? AND point = ? AND status IS NULL"
);
/// The lease alone (heartbeat, release): never the point or the state (`updated_at`
/// moves too, so the server counts the row as changed). Params: lease (µs), principal,
/// operation, key, owner, fence.
pub(crate) const RENEW_LEASE: &str = concat!(
    "UPDATE idem_run SET lease_until = ",
    expiry!(),
    ", updated_at = GREATEST(UTC_TIMESTAMP(6), updated_at + INTERVAL 1 MICROSECOND) WHERE ",
    request_pk!(),
    " AND owner = ? AND fence = ? AND status IS NULL"
);
/// Deletes a run while its owner is the expected one (an expired run being replaced).
/// Params: principal, operation, key, expected owner.
pub(crate) const DELETE_RUN: &str = concat!(
    "DELETE FROM idem_run WHERE ",
    request_pk!(),
    " AND owner = ?"
);
/// After a start's lock wait ran out: the run's row, unless another transaction holds
/// it. Params: principal, operation, key.
pub(crate) const PROBE_RUN_LOCK: &str = concat!(
    "SELECT 1 FROM idem_run WHERE ",
    request_pk!(),
    " FOR UPDATE SKIP LOCKED"
);
/// Whether a committed row of the run exists (a consistent read: never waits for row
/// locks). Params: principal, operation, key.
pub(crate) const PROBE_RUN_EXISTS: &str = concat!("SELECT 1 FROM idem_run WHERE ", request_pk!());
/// Unexpired runs without a final answer whose lease ended, the longest-stalled first
/// (an autocommit read after [`READ_COMMITTED`]). Params: limit.
pub(crate) const STALLED_RUNS: &str = "SELECT principal, operation, request_key, point FROM idem_run \
     WHERE status IS NULL AND lease_until <= UTC_TIMESTAMP(6) AND expires_at > UTC_TIMESTAMP(6) \
     ORDER BY lease_until LIMIT ?";
/// Asks the server for its status flags (a no-op whose OK packet says whether the
/// session is still inside a transaction): before a run's guarded write and its
/// `COMMIT`, when the last packet did not already say so.
pub(crate) const STATUS_PROBE: &str = "DO 0";
/// Saves the session's row-lock and table-lock wait bounds and sets both for a run
/// transaction (whole seconds, appended twice by the backend: an integer, never user
/// text). `lock_wait_timeout` bounds waits for table locks (`LOCK TABLES`, DDL), which
/// `innodb_lock_wait_timeout` does not; either running out is error 1205.
pub(crate) const SET_RUN_LOCK_WAIT: &str = "SET @idem_run_lock_wait = @@SESSION.innodb_lock_wait_timeout, \
     @idem_run_mdl_wait = @@SESSION.lock_wait_timeout, SESSION innodb_lock_wait_timeout = ";
/// Gives the session its own wait bounds back.
pub(crate) const RESTORE_RUN_LOCK_WAIT: &str = "SET SESSION innodb_lock_wait_timeout = @idem_run_lock_wait, \
     SESSION lock_wait_timeout = @idem_run_mdl_wait";

/// Stores a message in the caller's transaction. Params: destination, message ID,
/// payload.
pub(crate) const ENQUEUE: &str = "INSERT INTO idem_outbox (destination, message_id, payload, created_at) \
     VALUES (?, ?, ?, UTC_TIMESTAMP(6))";
/// Locks the oldest due messages, skipping rows another relay holds (MariaDB 10.6+,
/// MySQL 8.0+). Due: unsent, not dead, the next attempt's time passed, no unexpired
/// claim, and no older pending message of the destination that is not due or is
/// claimed (the subquery is a plain read: a locking clause applies to the outer table
/// only). Under READ COMMITTED the locking read takes no gap locks, so producers'
/// `INSERT`s never wait for a relay. Params: limit.
pub(crate) const LOCK_DUE: &str = "SELECT o.id, o.destination, o.message_id, o.payload, o.attempts \
     FROM idem_outbox AS o WHERE o.sent_at IS NULL AND o.dead_at IS NULL \
     AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= UTC_TIMESTAMP(6)) \
     AND (o.claimed_until IS NULL OR o.claimed_until <= UTC_TIMESTAMP(6)) \
     AND NOT EXISTS (SELECT 1 FROM idem_outbox AS b WHERE b.destination = o.destination \
     AND b.id < o.id AND b.sent_at IS NULL AND b.dead_at IS NULL \
     AND (b.next_attempt_at > UTC_TIMESTAMP(6) OR b.claimed_until > UTC_TIMESTAMP(6))) \
     ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED";
/// Every pending (unsent, not dead) message of a destination up to an id, rows other
/// relays hold included: a plain (consistent, non-locking) read, which under READ
/// COMMITTED sees the latest committed rows. Params: destination, up to (id).
pub(crate) const PENDING_IDS: &str = "SELECT id FROM idem_outbox \
     WHERE destination = ? AND sent_at IS NULL AND dead_at IS NULL AND id <= ? ORDER BY id";
/// The start of [`claim_due`]'s statement. Params: token, lease (µs), then the ids.
pub(crate) const CLAIM_DUE: &str = concat!(
    "UPDATE idem_outbox SET claim_token = ?, claimed_until = ",
    expiry!(),
    ", attempts = attempts + 1 WHERE sent_at IS NULL AND id IN ("
);
/// The start of [`release`]'s statement. Params: token, then the ids.
pub(crate) const RELEASE: &str = "UPDATE idem_outbox SET claim_token = NULL, claimed_until = NULL, \
     attempts = GREATEST(attempts - 1, 0) WHERE sent_at IS NULL AND claim_token = ? AND id IN (";
/// The start of [`mark_sent`]'s statement. Params: token, then the ids.
pub(crate) const MARK_SENT: &str = "UPDATE idem_outbox SET sent_at = UTC_TIMESTAMP(6), \
     claim_token = NULL, claimed_until = NULL WHERE sent_at IS NULL AND claim_token = ? AND id IN (";
/// A failed attempt with attempts left: tried again after the delay. Only the pass's own
/// claim, or no unexpired claim. Params: error, delay (µs), id, token.
pub(crate) const RETRY_LATER: &str = concat!(
    "UPDATE idem_outbox SET last_error = ?, next_attempt_at = ",
    expiry!(),
    ", claim_token = NULL, claimed_until = NULL WHERE id = ? AND sent_at IS NULL \
     AND (claim_token = ? OR claimed_until IS NULL OR claimed_until <= UTC_TIMESTAMP(6))"
);
/// A failed attempt with none left: dead. Params: error, id, token.
pub(crate) const BURY: &str = "UPDATE idem_outbox SET last_error = ?, dead_at = UTC_TIMESTAMP(6), \
     claim_token = NULL, claimed_until = NULL WHERE id = ? AND sent_at IS NULL \
     AND (claim_token = ? OR claimed_until IS NULL OR claimed_until <= UTC_TIMESTAMP(6))";
/// The backlog: pending messages, dead ones, the oldest pending one's age (µs).
pub(crate) const OUTBOX_STATS: &str = "SELECT CAST(COALESCE(SUM(dead_at IS NULL), 0) AS SIGNED), \
     CAST(COUNT(dead_at) AS SIGNED), CAST(MAX(CASE WHEN dead_at IS NULL THEN \
     TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) END) AS SIGNED) \
     FROM idem_outbox WHERE sent_at IS NULL";
/// Unsent messages for an operator. Params: state, state, state (0 unsent, 1 pending,
/// 2 dead), destination or NULL, the same destination, after id, limit.
pub(crate) const LIST_OUTBOX: &str = "SELECT id, destination, message_id, attempts, \
     dead_at IS NOT NULL, last_error, TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)), \
     CASE WHEN next_attempt_at > UTC_TIMESTAMP(6) \
     THEN TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) END, \
     COALESCE(claimed_until > UTC_TIMESTAMP(6), 0) FROM idem_outbox WHERE sent_at IS NULL \
     AND (? = 0 OR (? = 1 AND dead_at IS NULL) OR (? = 2 AND dead_at IS NOT NULL)) \
     AND (? IS NULL OR destination = ?) AND id > ? ORDER BY id LIMIT ?";
/// The start of [`retry_ids`]'s statement: back to pending, due now, attempts reset.
pub(crate) const RETRY_IDS: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
     attempts = 0 WHERE sent_at IS NULL AND id IN (";
/// Every dead message back to pending. Params: destination or NULL, the same.
pub(crate) const RETRY_DEAD: &str = "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, \
     attempts = 0 WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (? IS NULL OR destination = ?)";
/// The start of [`drop_ids`]'s statement: deletes unsent messages.
pub(crate) const DROP_IDS: &str = "DELETE FROM idem_outbox WHERE sent_at IS NULL AND id IN (";
/// Deletes every dead message. Params: destination or NULL, the same.
pub(crate) const DROP_DEAD: &str = "DELETE FROM idem_outbox \
     WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (? IS NULL OR destination = ?)";

/// `prefix` + `n` placeholders + `)` (`n` ≥ 1).
fn with_ids(prefix: &str, n: usize) -> String {
    idem_core::runs::in_list(prefix, n, |_| "?".to_owned())
}
/// Claims `n` messages: [`CLAIM_DUE`] with `n` placeholders.
pub(crate) fn claim_due(n: usize) -> String {
    with_ids(CLAIM_DUE, n)
}
/// Gives back `n` messages: [`RELEASE`] with `n` placeholders.
pub(crate) fn release(n: usize) -> String {
    with_ids(RELEASE, n)
}
/// Marks `n` messages sent: [`MARK_SENT`] with `n` placeholders.
pub(crate) fn mark_sent(n: usize) -> String {
    with_ids(MARK_SENT, n)
}
/// Retries `n` messages: [`RETRY_IDS`] with `n` placeholders.
pub(crate) fn retry_ids(n: usize) -> String {
    with_ids(RETRY_IDS, n)
}
/// Drops `n` messages: [`DROP_IDS`] with `n` placeholders.
pub(crate) fn drop_ids(n: usize) -> String {
    with_ids(DROP_IDS, n)
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
    ("lookup_request_committed", LOOKUP_REQUEST_COMMITTED),
    ("read_committed", READ_COMMITTED),
    ("insert_message", INSERT_MESSAGE),
    ("select_message", SELECT_MESSAGE),
    ("replace_expired_message", REPLACE_EXPIRED_MESSAGE),
    ("expired_message", EXPIRED_MESSAGE),
    ("lookup_message", LOOKUP_MESSAGE),
    ("lookup_message_committed", LOOKUP_MESSAGE_COMMITTED),
    ("set_lock_wait", SET_LOCK_WAIT),
    ("restore_lock_wait", RESTORE_LOCK_WAIT),
    ("max_allowed_packet", MAX_ALLOWED_PACKET),
    ("wsrep_on", WSREP_ON),
    ("set_statement_lock_wait", SET_STATEMENT_LOCK_WAIT),
    ("start_transaction", START_TRANSACTION),
    ("start_transaction_then", START_TRANSACTION_THEN),
    ("commit", COMMIT),
    ("rollback", ROLLBACK),
    ("savepoint_claimed", SAVEPOINT_CLAIMED),
    ("release_claimed", RELEASE_CLAIMED),
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
    ("status_probe", STATUS_PROBE),
    ("set_run_lock_wait", SET_RUN_LOCK_WAIT),
    ("restore_run_lock_wait", RESTORE_RUN_LOCK_WAIT),
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
                // The one exception: a new run's no-op ON DUPLICATE KEY UPDATE, which
                // takes the existing row's lock exclusively and changes nothing.
                if *name == "insert_run" && banned == "ON DUPLICATE" {
                    assert!(
                        sql.ends_with("ON DUPLICATE KEY UPDATE owner = owner"),
                        "{sql}"
                    );
                    continue;
                }
                assert!(!upper.contains(banned), "{name} uses {banned}: {sql}");
            }
            assert!(!sql.contains('$'), "{name} uses PostgreSQL placeholders");
        }
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
            .flat_map(|(name, f)| [1, 3].map(|n| format!("-- {name}({n})\n{};\n", f(n))))
            .collect::<Vec<_>>()
            .join("\n");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn id_lists_bind_one_placeholder_per_id() {
        for n in [1, 2, 7, idem_core::runs::MAX_RELAY_BATCH as usize] {
            for (prefix, sql, before) in [
                (super::MARK_SENT, super::mark_sent(n), 1),
                (super::CLAIM_DUE, super::claim_due(n), 2),
                (super::RELEASE, super::release(n), 1),
                (super::RETRY_IDS, super::retry_ids(n), 0),
                (super::DROP_IDS, super::drop_ids(n), 0),
            ] {
                assert_eq!(sql.matches('?').count(), n + before, "{sql}");
                assert!(sql.starts_with(prefix) && sql.ends_with("?)"), "{sql}");
            }
        }
        // Never an empty `IN ()`, which is a syntax error.
        assert!(super::mark_sent(0).ends_with("(?)"));
    }

    #[test]
    fn run_statements_lock_what_they_must() {
        assert!(super::SELECT_RUN.ends_with(" FOR UPDATE"));
        assert!(super::LOCK_DUE.ends_with(" FOR UPDATE SKIP LOCKED"));
        assert!(super::PROBE_RUN_LOCK.ends_with(" FOR UPDATE SKIP LOCKED"));
        // Concurrent starts of an existing run take its row exclusively at once.
        assert!(super::INSERT_RUN.ends_with("ON DUPLICATE KEY UPDATE owner = owner"));
        for plain in [
            super::PENDING_IDS,
            super::STALLED_RUNS,
            super::PROBE_RUN_EXISTS,
        ] {
            assert!(
                !plain.contains("FOR UPDATE") && !plain.contains("LOCK IN"),
                "{plain}"
            );
        }
        // A write counts as matched only because it always changes `updated_at`.
        for write in [super::WRITE_RUN, super::RENEW_LEASE] {
            assert!(
                write.contains("updated_at + INTERVAL 1 MICROSECOND"),
                "{write}"
            );
        }
        assert!(
            super::WRITE_RUN
                .ends_with("AND owner = ? AND fence = ? AND point = ? AND status IS NULL")
        );
        assert!(super::RENEW_LEASE.ends_with("AND owner = ? AND fence = ? AND status IS NULL"));
    }

    #[test]
    fn hex_literals_carry_only_hex_digits_of_user_data() {
        use super::{Lit, inline};
        fn hex_literal(introducer: &str, bytes: &[u8]) -> String {
            let mut out = String::new();
            super::push_hex(&mut out, introducer, bytes);
            out
        }
        assert_eq!(hex_literal("_utf8mb4", b""), "_utf8mb4 X''");
        assert_eq!(hex_literal("_binary", b"k"), "_binary X'6B'");
        assert_eq!(hex_literal("_utf8mb4", "'".as_bytes()), "_utf8mb4 X'27'");
        assert_eq!(hex_literal("_utf8mb4", b"\\"), "_utf8mb4 X'5C'");
        assert_eq!(hex_literal("_utf8mb4", b"*/"), "_utf8mb4 X'2A2F'");
        assert_eq!(
            hex_literal("_utf8mb4", "é🦀".as_bytes()),
            "_utf8mb4 X'C3A9F09FA680'"
        );
        assert_eq!(hex_literal("_binary", &[0, 0xFF]), "_binary X'00FF'");
        for hostile in [
            "it's",
            "a\\'; DROP TABLE t; -- ",
            "*/ /*",
            "\"\"``",
            "漢字\u{0}",
        ] {
            let lit = hex_literal("_utf8mb4", hostile.as_bytes());
            let digits = lit
                .strip_prefix("_utf8mb4 X'")
                .and_then(|l| l.strip_suffix('\''))
                .expect("the literal's frame");
            assert_eq!(digits.len(), 2 * hostile.len());
            assert!(
                digits
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
            );
        }
        // Placeholders are replaced in order; a count that does not match is refused.
        assert_eq!(
            inline(
                "UPDATE t SET a = ?, b = ?, c = ? WHERE k = ?",
                &[Lit::Text("x"), Lit::Int(-7), Lit::Null, Lit::Bytes(b"?")]
            )
            .as_deref(),
            Some("UPDATE t SET a = _utf8mb4 X'78', b = -7, c = NULL WHERE k = _binary X'3F'")
        );
        assert_eq!(inline("SELECT ?", &[]), None);
        assert_eq!(inline("SELECT 1", &[Lit::Int(1)]), None);
        assert_eq!(
            inline("? ?", &[Lit::Int(i64::MIN), Lit::Int(i64::MAX)]).as_deref(),
            Some("-9223372036854775808 9223372036854775807")
        );
        // Every statement the merged messages inline has placeholders only (and the
        // guards' fixed `sql_mode`, which holds no `?`).
        for statement in [
            super::INSERT_REQUEST,
            super::INSERT_MESSAGE,
            super::COMPLETE_REQUEST_GUARDED,
            super::CHECK_MESSAGE_GUARDED,
            super::EXPIRED_REQUEST,
            super::EXPIRED_MESSAGE,
        ] {
            let rest = statement.replace("'STRICT_ALL_TABLES'", "");
            assert!(!rest.contains('\''), "{statement}");
        }
    }

    /// MariaDB's merged messages as the backend builds them, for one request and one
    /// message (key `k`, principal `p`, operation `op`; subscriber `s`, message id `m`).
    #[test]
    fn merged_messages_snapshot() {
        use super::{Lit, inline};
        let request_key = [Lit::Bytes(b"p"), Lit::Bytes(b"op"), Lit::Bytes(b"k")];
        let message_key = [Lit::Bytes(b"s"), Lit::Bytes(b"m")];
        fn with<'a>(first: &[Lit<'a>], key: &[Lit<'a>], last: &[Lit<'a>]) -> Vec<Lit<'a>> {
            first.iter().chain(key).chain(last).copied().collect()
        }
        let bound = format!("{}3 FOR ", super::SET_STATEMENT_LOCK_WAIT);
        let claim_request = format!(
            "{}{bound}{}",
            super::START_TRANSACTION_THEN,
            inline(
                super::INSERT_REQUEST,
                &with(
                    &[],
                    &request_key,
                    &[Lit::Text("{}"), Lit::Int(86_400_000_000)]
                )
            )
            .expect("claim")
        );
        let claim_message = format!(
            "{}{bound}{}; {}",
            super::START_TRANSACTION_THEN,
            inline(
                super::INSERT_MESSAGE,
                &with(&[], &message_key, &[Lit::Null, Lit::Int(86_400_000_000)])
            )
            .expect("claim"),
            super::SAVEPOINT_CLAIMED
        );
        let complete_request = super::complete_and_commit_request(
            &inline(
                super::COMPLETE_REQUEST_GUARDED,
                &with(
                    &[Lit::Int(0), Lit::Text("{\"ok\":true}")],
                    &request_key,
                    &[],
                ),
            )
            .expect("completion"),
        );
        let complete_message = super::complete_and_commit_message(
            &inline(super::CHECK_MESSAGE_GUARDED, &message_key).expect("check"),
        );
        let text = [
            ("claim_request", claim_request),
            ("claim_message", claim_message),
            ("complete_and_commit_request", complete_request),
            ("complete_and_commit_message", complete_message),
        ]
        .iter()
        .map(|(name, sql)| format!("-- {name}\n{sql};\n"))
        .collect::<Vec<_>>()
        .join("\n");
        insta::assert_snapshot!(text);
    }

    #[test]
    fn merged_completions_check_before_they_commit() {
        let request = super::complete_and_commit_request(super::COMPLETE_REQUEST_GUARDED);
        assert!(request.starts_with("SET STATEMENT sql_mode = 'STRICT_ALL_TABLES' FOR UPDATE"));
        // The guard is assigned before `response`: it reads the old value.
        let guard = request.find("status = IF(@@in_transaction = 1 AND response IS NULL");
        assert!(guard.is_some_and(|g| request.find("response = ?").is_some_and(|r| g < r)));
        assert!(request.ends_with("; COMMIT"), "{request}");
        let message = super::complete_and_commit_message(super::CHECK_MESSAGE_GUARDED);
        let release = message.find(super::RELEASE_CLAIMED).expect("the release");
        let check = message.find("processed_at = IF(").expect("the check");
        assert!(
            release < check && message.ends_with("; COMMIT"),
            "{message}"
        );
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
