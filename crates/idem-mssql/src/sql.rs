//! Every statement the SQL Server backend sends.
//!
//! Parameters are tiberius' `@P1, @P2, …` (sent through `sp_executesql`). Scope, key,
//! subscriber and message ID are bound as bytes (`varbinary`); JSON as `nvarchar`.
//!
//! The expiry cutoff is `SYSUTCDATETIME()` minus the retention, passed as three `int`s
//! (days, seconds, microseconds): `DATEADD` takes an `int`, so one number of seconds
//! overflows after 68 years and one number of microseconds after 36 minutes.
//! `SYSUTCDATETIME()` is evaluated once per statement.

macro_rules! cutoff {
    ($days:literal, $secs:literal, $micros:literal) => {
        concat!(
            "DATEADD(microsecond, -@P",
            $micros,
            ", DATEADD(second, -@P",
            $secs,
            ", DATEADD(day, -@P",
            $days,
            ", SYSUTCDATETIME())))"
        )
    };
}
/// The end of a retention window that starts now (days, seconds, microseconds).
macro_rules! expiry {
    ($days:literal, $secs:literal, $micros:literal) => {
        concat!(
            "DATEADD(microsecond, @P",
            $micros,
            ", DATEADD(second, @P",
            $secs,
            ", DATEADD(day, @P",
            $days,
            ", SYSUTCDATETIME())))"
        )
    };
}
macro_rules! request_pk {
    () => {
        "principal = @P1 AND operation = @P2 AND request_key = @P3"
    };
}
macro_rules! message_pk {
    () => {
        "subscriber = @P1 AND message_id = @P2"
    };
}
/// Statements whose row count idem reads start with this: a server whose
/// `user options` turn NOCOUNT on would otherwise report no counts.
macro_rules! counted {
    () => {
        "SET NOCOUNT OFF; "
    };
}
macro_rules! begin {
    ($level:literal) => {
        concat!(
            "SET XACT_ABORT OFF; SET TRANSACTION ISOLATION LEVEL ",
            $level,
            "; BEGIN TRANSACTION"
        )
    };
}

/// Starts a claim's transaction. `XACT_ABORT OFF` keeps the transaction open after
/// the claim's expected duplicate-key error (2627 is statement-terminating only).
/// The isolation level is session state on a pooled connection, so it is set every time.
pub(crate) const BEGIN_READ_COMMITTED: &str = begin!("READ COMMITTED");
pub(crate) const BEGIN_REPEATABLE_READ: &str = begin!("REPEATABLE READ");
pub(crate) const BEGIN_SERIALIZABLE: &str = begin!("SERIALIZABLE");
pub(crate) const BEGIN_SNAPSHOT: &str = begin!("SNAPSHOT");
pub(crate) const COMMIT: &str = "COMMIT TRANSACTION";
/// Commits only when exactly idem's transaction is open (`@@TRANCOUNT = 1`); returns
/// the count it found. Any other count (0: the effect ended the transaction; 2+: a
/// nested `BEGIN` left open) is refused: nothing is committed, and the backend rolls
/// back and discards the connection.
pub(crate) const CHECKED_COMMIT: &str = "DECLARE @trancount int = @@TRANCOUNT; \
     IF @trancount = 1 COMMIT TRANSACTION; SELECT @trancount AS trancount";
/// The start of a claim's first batch: `@@TRANCOUNT` as it was **before** `BEGIN` (it
/// must be 0, else the pooled session was already inside a transaction, left by
/// `interact`, `SET IMPLICIT_TRANSACTIONS ON` or a procedure, and idem's `COMMIT` would
/// only decrement it: the backend then discards the connection), and the session's
/// `@@LOCK_TIMEOUT`, restored after the claim.
pub(crate) const CLAIM_STATE: &str =
    "SELECT @@TRANCOUNT AS trancount, @@LOCK_TIMEOUT AS lock_timeout";
/// Bounds lock waits (session level; the backend appends the milliseconds, an integer
/// it computed or read from `@@LOCK_TIMEOUT`): the claim's bound, then the session's own
/// value again before the effect runs and before the connection goes back to the pool.
pub(crate) const SET_LOCK_TIMEOUT: &str = "SET LOCK_TIMEOUT ";
/// Safe after errors that already ended the transaction (1205 rolls it back).
pub(crate) const ROLLBACK: &str = "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION";
/// The health check of a connection that sat idle in the pool.
pub(crate) const PING: &str = "SELECT 1";

/// The claim: a plain INSERT. A conflicting key waits for the transaction holding it
/// (bounded by `LOCK_TIMEOUT`: 1222); then it succeeds (that one rolled back) or fails
/// with 2627 (it committed). Params: principal, operation, key, request, retention
/// (days, seconds, microseconds).
pub(crate) const INSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result (principal, operation, request_key, request, created_at, expires_at) \
     VALUES (@P1, @P2, @P3, @P4, SYSUTCDATETIME(), ",
    expiry!(5, 6, 7),
    ")"
);
/// The re-read after 2627, as a new statement: under READ COMMITTED (locking or
/// READ_COMMITTED_SNAPSHOT) it sees the row the INSERT collided with.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status, CASE WHEN expires_at <= SYSUTCDATETIME() THEN 1 ELSE 0 END AS expired \
     FROM idem_request_result WHERE ",
    request_pk!()
);
/// Takes over an expired record. The predicate is checked again on the row's current
/// version once its lock is granted, so two takers cannot both win.
pub(crate) const REPLACE_EXPIRED_REQUEST: &str = concat!(
    counted!(),
    "UPDATE idem_request_result SET request = @P4, response = NULL, status = 0, created_at = SYSUTCDATETIME(), expires_at = ",
    expiry!(5, 6, 7),
    " WHERE ",
    request_pk!(),
    " AND expires_at <= SYSUTCDATETIME()"
);
/// Stores the response in the winner's transaction, just before COMMIT: one row, still
/// unfinished, not expired while the effect ran.
pub(crate) const COMPLETE_REQUEST: &str = concat!(
    counted!(),
    "UPDATE idem_request_result SET response = @P4, status = @P5 WHERE ",
    request_pk!(),
    " AND response IS NULL AND expires_at > SYSUTCDATETIME()"
);
/// Why a completion found no row: 1 when the record expired.
pub(crate) const EXPIRED_REQUEST: &str = concat!(
    "SELECT CASE WHEN expires_at <= SYSUTCDATETIME() THEN 1 ELSE 0 END FROM idem_request_result WHERE ",
    request_pk!()
);
/// The replay fast path (autocommit), pinned to READ COMMITTED whatever the session's
/// level (READ UNCOMMITTED would replay an uncommitted winner). The backend puts
/// `SET LOCK_TIMEOUT <wait>; ` in front (a locking read waits for an uncommitted
/// winner). Inside `sp_executesql` the SETs last for this call only.
pub(crate) const LOOKUP_REQUEST: &str = concat!(
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
    "SELECT request, response, status FROM idem_request_result WHERE ",
    request_pk!(),
    " AND expires_at > SYSUTCDATETIME()"
);

/// Params: subscriber, message ID, fingerprint, retention (days, seconds, microseconds).
pub(crate) const INSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at, expires_at) \
     VALUES (@P1, @P2, @P3, SYSUTCDATETIME(), ",
    expiry!(4, 5, 6),
    ")"
);
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint, CASE WHEN expires_at <= SYSUTCDATETIME() THEN 1 ELSE 0 END AS expired \
     FROM idem_processed_message WHERE ",
    message_pk!()
);
pub(crate) const REPLACE_EXPIRED_MESSAGE: &str = concat!(
    counted!(),
    "UPDATE idem_processed_message SET fingerprint = @P3, processed_at = SYSUTCDATETIME(), expires_at = ",
    expiry!(4, 5, 6),
    " WHERE ",
    message_pk!(),
    " AND expires_at <= SYSUTCDATETIME()"
);
/// Before a message's commit: 0 when the claimed record is still live, 1 when it expired
/// while the effect ran, no row when it is gone.
pub(crate) const EXPIRED_MESSAGE: &str = concat!(
    "SELECT CASE WHEN expires_at <= SYSUTCDATETIME() THEN 1 ELSE 0 END FROM idem_processed_message WHERE ",
    message_pk!()
);
pub(crate) const LOOKUP_MESSAGE: &str = concat!(
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
    "SELECT fingerprint FROM idem_processed_message WHERE ",
    message_pk!(),
    " AND expires_at > SYSUTCDATETIME()"
);

/// One bounded batch of records that are expired **and** were claimed at least the
/// given age ago; rows still locked by a live transaction make it wait. The isolation
/// level is reset here because a pooled session keeps the last claim's (a SNAPSHOT
/// delete could fail with 3960); inside `sp_executesql` the SET lasts for this call.
pub(crate) const PURGE_REQUESTS: &str = concat!(
    counted!(),
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
    "DELETE TOP (@P4) FROM idem_request_result WHERE expires_at <= SYSUTCDATETIME() AND created_at <= ",
    cutoff!(1, 2, 3)
);
pub(crate) const PURGE_MESSAGES: &str = concat!(
    counted!(),
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
    "DELETE TOP (@P4) FROM idem_processed_message WHERE expires_at <= SYSUTCDATETIME() AND processed_at <= ",
    cutoff!(1, 2, 3)
);

// Phased runs and the outbox (migrations 0003 and 0004). Run statements run inside the
// transaction `begin_runs` opened (READ COMMITTED, `XACT_ABORT OFF`, like a claim's);
// `STALLED_RUNS` runs on its own.

/// A new run. A conflicting key waits for the transaction holding it (bounded by
/// `LOCK_TIMEOUT`: 1222), then succeeds (that one rolled back) or fails with 2627 (it
/// committed; with `XACT_ABORT OFF` only the statement ends). Params: principal,
/// operation, key, request, owner, fence, point, lease (days, seconds, microseconds),
/// retention (days, seconds, microseconds).
pub(crate) const INSERT_RUN: &str = concat!(
    "INSERT INTO idem_run (principal, operation, request_key, request, owner, fence, point, \
     lease_until, created_at, updated_at, expires_at) \
     VALUES (@P1, @P2, @P3, @P4, @P5, @P6, @P7, ",
    expiry!(8, 9, 10),
    ", SYSUTCDATETIME(), SYSUTCDATETIME(), ",
    expiry!(11, 12, 13),
    ")"
);
/// Reads a run and locks its row until the transaction ends: `UPDLOCK` (an update lock,
/// which also makes the read a locking read of the latest committed version under
/// READ_COMMITTED_SNAPSHOT) held to the end by `HOLDLOCK`, on the row only.
/// Params: principal, operation, key.
pub(crate) const SELECT_RUN: &str = concat!(
    "SELECT request, owner, fence, point, state, status, response, \
     CASE WHEN lease_until <= SYSUTCDATETIME() THEN 1 ELSE 0 END AS lease_over, \
     CASE WHEN expires_at <= SYSUTCDATETIME() THEN 1 ELSE 0 END AS expired \
     FROM idem_run WITH (UPDLOCK, HOLDLOCK, ROWLOCK) WHERE ",
    request_pk!()
);
/// The guarded write, a compare-and-set: changes the row only while it holds the
/// expected owner, fence and point and has no final answer. SQL Server counts the rows
/// the `WHERE` matched. Params: principal, operation, key, expected owner, owner, fence,
/// point, state, status, response, lease (days, seconds, microseconds), expected fence,
/// expected point.
pub(crate) const WRITE_RUN: &str = concat!(
    counted!(),
    "UPDATE idem_run SET owner = @P5, fence = @P6, point = @P7, state = @P8, status = @P9, \
     response = @P10, lease_until = ",
    expiry!(11, 12, 13),
    ", updated_at = SYSUTCDATETIME() WHERE ",
    request_pk!(),
    " AND owner = @P4 AND fence = @P14 AND point = @P15 AND status IS NULL"
);
/// The lease alone (heartbeat, release): never the point or the state. Params:
/// principal, operation, key, owner, fence, lease (days, seconds, microseconds).
pub(crate) const RENEW_LEASE: &str = concat!(
    counted!(),
    "UPDATE idem_run SET lease_until = ",
    expiry!(6, 7, 8),
    " WHERE ",
    request_pk!(),
    " AND owner = @P4 AND fence = @P5 AND status IS NULL"
);
/// Deletes a run while its owner is the expected one (an expired run being replaced).
/// Params: principal, operation, key, expected owner.
pub(crate) const DELETE_RUN: &str = concat!(
    counted!(),
    "DELETE FROM idem_run WHERE ",
    request_pk!(),
    " AND owner = @P4"
);
/// After a start's lock wait ran out: the run's row, unless another transaction holds
/// it (`READPAST` skips a locked row). Params: principal, operation, key.
pub(crate) const PROBE_RUN_LOCK: &str = concat!(
    "SELECT 1 FROM idem_run WITH (UPDLOCK, READPAST, ROWLOCK) WHERE ",
    request_pk!()
);
/// Whether a row of the run exists, an uncommitted one included (`NOLOCK`: never waits
/// for row locks; a concurrent start's insert counts as held). Params: principal,
/// operation, key.
pub(crate) const PROBE_RUN_EXISTS: &str =
    concat!("SELECT 1 FROM idem_run WITH (NOLOCK) WHERE ", request_pk!());
/// Unexpired runs without a final answer whose lease ended, the longest-stalled first:
/// an autocommit read pinned to READ COMMITTED (inside `sp_executesql` the SET lasts
/// for this call). Params: limit.
pub(crate) const STALLED_RUNS: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
     SELECT TOP (@P1) principal, operation, request_key, point FROM idem_run \
     WHERE status IS NULL AND lease_until <= SYSUTCDATETIME() AND expires_at > SYSUTCDATETIME() \
     ORDER BY lease_until";

/// Stores a message in the caller's transaction. Params: destination, message ID,
/// payload.
pub(crate) const ENQUEUE: &str =
    "INSERT INTO idem_outbox (destination, message_id, payload) VALUES (@P1, @P2, @P3)";
/// Locks the oldest due messages, skipping rows other transactions hold (another
/// relay's, or a producer's uncommitted insert). Due: unsent, not dead, the next
/// attempt's time passed, no unexpired claim, and no older pending message of the
/// destination that is not due or is claimed. Params: limit.
pub(crate) const LOCK_DUE: &str = "SELECT TOP (@P1) o.id, o.destination, o.message_id, o.payload, \
     CAST(o.attempts AS bigint) FROM idem_outbox AS o WITH (UPDLOCK, READPAST, ROWLOCK) \
     WHERE o.sent_at IS NULL AND o.dead_at IS NULL \
     AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= SYSUTCDATETIME()) \
     AND (o.claimed_until IS NULL OR o.claimed_until <= SYSUTCDATETIME()) \
     AND NOT EXISTS (SELECT 1 FROM idem_outbox AS b WHERE b.destination = o.destination \
     AND b.id < o.id AND b.sent_at IS NULL AND b.dead_at IS NULL \
     AND (b.next_attempt_at > SYSUTCDATETIME() OR b.claimed_until > SYSUTCDATETIME())) \
     ORDER BY o.id";
/// Every pending message of a destination up to an id, rows other relays hold included
/// (a plain READ COMMITTED read: a shared lock is compatible with their update locks,
/// and READ_COMMITTED_SNAPSHOT reads versions). Params: destination, up to (id).
pub(crate) const PENDING_IDS: &str = "SELECT id FROM idem_outbox \
     WHERE destination = @P1 AND sent_at IS NULL AND dead_at IS NULL AND id <= @P2 ORDER BY id";
/// The start of [`claim_due`]'s statement. Params: token, lease (days, seconds,
/// microseconds), then the ids.
pub(crate) const CLAIM_DUE: &str = concat!(
    "UPDATE idem_outbox SET claim_token = @P1, claimed_until = ",
    expiry!(2, 3, 4),
    ", attempts = attempts + 1 WHERE sent_at IS NULL AND id IN ("
);
/// The start of [`release`]'s statement. Params: token, then the ids.
pub(crate) const RELEASE: &str = "UPDATE idem_outbox SET claim_token = NULL, claimed_until = NULL, \
     attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END \
     WHERE sent_at IS NULL AND claim_token = @P1 AND id IN (";
/// The start of [`mark_sent`]'s statement. Params: token, then the ids.
pub(crate) const MARK_SENT: &str = concat!(
    counted!(),
    "UPDATE idem_outbox SET sent_at = SYSUTCDATETIME(), claim_token = NULL, claimed_until = NULL \
     WHERE sent_at IS NULL AND claim_token = @P1 AND id IN ("
);
/// A failed attempt with attempts left: tried again after the delay. Only the pass's own
/// claim, or no unexpired claim. Params: error, delay (days, seconds, microseconds), id,
/// token.
pub(crate) const RETRY_LATER: &str = concat!(
    counted!(),
    "UPDATE idem_outbox SET last_error = @P1, next_attempt_at = ",
    expiry!(2, 3, 4),
    ", claim_token = NULL, claimed_until = NULL WHERE id = @P5 AND sent_at IS NULL \
     AND (claim_token = @P6 OR claimed_until IS NULL OR claimed_until <= SYSUTCDATETIME())"
);
/// A failed attempt with none left: dead. Params: error, id, token.
pub(crate) const BURY: &str = concat!(
    counted!(),
    "UPDATE idem_outbox SET last_error = @P1, dead_at = SYSUTCDATETIME(), claim_token = NULL, \
     claimed_until = NULL WHERE id = @P2 AND sent_at IS NULL \
     AND (claim_token = @P3 OR claimed_until IS NULL OR claimed_until <= SYSUTCDATETIME())"
);
/// The backlog: pending messages, dead ones, the oldest pending one's age (µs).
pub(crate) const OUTBOX_STATS: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
     SELECT CAST(COUNT(CASE WHEN dead_at IS NULL THEN 1 END) AS bigint), \
     CAST(COUNT(dead_at) AS bigint), MAX(CASE WHEN dead_at IS NULL \
     THEN DATEDIFF_BIG(microsecond, created_at, SYSUTCDATETIME()) END) \
     FROM idem_outbox WHERE sent_at IS NULL";
/// Unsent messages for an operator. Params: state (0 unsent, 1 pending, 2 dead),
/// destination or NULL, after id, limit.
pub(crate) const LIST_OUTBOX: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; \
     SELECT TOP (@P4) id, destination, message_id, CAST(attempts AS bigint), \
     CASE WHEN dead_at IS NULL THEN 0 ELSE 1 END, last_error, \
     DATEDIFF_BIG(microsecond, created_at, SYSUTCDATETIME()), \
     CASE WHEN next_attempt_at > SYSUTCDATETIME() \
     THEN DATEDIFF_BIG(microsecond, SYSUTCDATETIME(), next_attempt_at) END, \
     CASE WHEN claimed_until > SYSUTCDATETIME() THEN 1 ELSE 0 END \
     FROM idem_outbox WHERE sent_at IS NULL \
     AND (@P1 = 0 OR (@P1 = 1 AND dead_at IS NULL) OR (@P1 = 2 AND dead_at IS NOT NULL)) \
     AND (@P2 IS NULL OR destination = @P2) AND id > @P3 ORDER BY id";
/// The start of [`retry_ids`]'s statement: back to pending, due now, attempts reset.
pub(crate) const RETRY_IDS: &str = concat!(
    counted!(),
    "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, attempts = 0 \
     WHERE sent_at IS NULL AND id IN ("
);
/// Every dead message back to pending. Params: destination or NULL.
pub(crate) const RETRY_DEAD: &str = concat!(
    counted!(),
    "UPDATE idem_outbox SET dead_at = NULL, next_attempt_at = NULL, attempts = 0 \
     WHERE sent_at IS NULL AND dead_at IS NOT NULL AND (@P1 IS NULL OR destination = @P1)"
);
/// The start of [`drop_ids`]'s statement: deletes unsent messages.
pub(crate) const DROP_IDS: &str = concat!(
    counted!(),
    "DELETE FROM idem_outbox WHERE sent_at IS NULL AND id IN ("
);
/// Deletes every dead message. Params: destination or NULL.
pub(crate) const DROP_DEAD: &str = concat!(
    counted!(),
    "DELETE FROM idem_outbox WHERE sent_at IS NULL AND dead_at IS NOT NULL \
     AND (@P1 IS NULL OR destination = @P1)"
);

/// `prefix` + `@P{first}` … `@P{first + n - 1}` + `)` (`n` ≥ 1).
fn with_ids(prefix: &str, n: usize, first: usize) -> String {
    idem_core::runs::in_list(prefix, n, |i| format!("@P{}", i + first - 1))
}
/// Claims `n` messages: [`CLAIM_DUE`], the ids from `@P5`.
pub(crate) fn claim_due(n: usize) -> String {
    with_ids(CLAIM_DUE, n, 5)
}
/// Gives back `n` messages: [`RELEASE`], the ids from `@P2`.
pub(crate) fn release(n: usize) -> String {
    with_ids(RELEASE, n, 2)
}
/// Marks `n` messages sent: [`MARK_SENT`], the ids from `@P2`.
pub(crate) fn mark_sent(n: usize) -> String {
    with_ids(MARK_SENT, n, 2)
}
/// Retries `n` messages: [`RETRY_IDS`], the ids from `@P1`.
pub(crate) fn retry_ids(n: usize) -> String {
    with_ids(RETRY_IDS, n, 1)
}
/// Drops `n` messages: [`DROP_IDS`], the ids from `@P1`.
pub(crate) fn drop_ids(n: usize) -> String {
    with_ids(DROP_IDS, n, 1)
}

/// One bounded batch of runs that are expired **and** were started at least the given
/// age ago (like [`PURGE_REQUESTS`]). Params: older than (days, seconds, microseconds),
/// limit.
pub(crate) const PURGE_RUNS: &str = concat!(
    counted!(),
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
    "DELETE TOP (@P4) FROM idem_run WHERE expires_at <= SYSUTCDATETIME() AND created_at <= ",
    cutoff!(1, 2, 3)
);
/// One bounded batch of messages sent at least the given age ago; unsent ones are never
/// purged. Params: older than (days, seconds, microseconds), limit.
pub(crate) const PURGE_OUTBOX: &str = concat!(
    counted!(),
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ",
    "DELETE TOP (@P4) FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at <= ",
    cutoff!(1, 2, 3)
);

/// Serializes concurrent migrators of one database and schema: an exclusive
/// application lock owned by the migration's transaction (released by COMMIT or
/// ROLLBACK). Returns sp_getapplock's status: 0 or 1 granted, negative refused.
pub(crate) const MIGRATION_LOCK: &str = "DECLARE @resource nvarchar(255) = CONCAT(SCHEMA_NAME(), N'.idem_schema_migrations'); \
     DECLARE @status int; \
     EXEC @status = sp_getapplock @Resource = @resource, @LockMode = N'Exclusive', @LockOwner = N'Transaction', @LockTimeout = 60000; \
     SELECT @status AS status";
pub(crate) const CREATE_MIGRATIONS: &str = "IF OBJECT_ID(N'idem_schema_migrations', N'U') IS NULL \
     CREATE TABLE idem_schema_migrations (version int NOT NULL CONSTRAINT idem_schema_migrations_pkey PRIMARY KEY, \
     name nvarchar(255) NOT NULL, \
     applied_at datetime2(7) NOT NULL CONSTRAINT idem_schema_migrations_applied_df DEFAULT SYSUTCDATETIME())";
pub(crate) const SELECT_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations";
pub(crate) const INSERT_MIGRATION: &str =
    "INSERT INTO idem_schema_migrations (version, name) VALUES (@P1, @P2)";

#[cfg(test)]
pub(crate) const ALL: &[(&str, &str)] = &[
    ("begin_read_committed", BEGIN_READ_COMMITTED),
    ("begin_repeatable_read", BEGIN_REPEATABLE_READ),
    ("begin_serializable", BEGIN_SERIALIZABLE),
    ("begin_snapshot", BEGIN_SNAPSHOT),
    ("commit", COMMIT),
    ("checked_commit", CHECKED_COMMIT),
    ("set_lock_timeout", SET_LOCK_TIMEOUT),
    ("claim_state", CLAIM_STATE),
    ("rollback", ROLLBACK),
    ("ping", PING),
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
    ("migration_lock", MIGRATION_LOCK),
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

    /// The highest `@Pn` a statement uses, and whether every `@P1..@Pn` appears.
    fn placeholders(sql: &str) -> (usize, bool) {
        let mut seen = Vec::new();
        let bytes = sql.as_bytes();
        let mut i = 0;
        while i + 2 < bytes.len() {
            if bytes[i] == b'@' && bytes[i + 1] == b'P' {
                let digits: String = sql[i + 2..]
                    .chars()
                    .take_while(char::is_ascii_digit)
                    .collect();
                if let Ok(n) = digits.parse::<usize>() {
                    seen.push(n);
                }
            }
            i += 1;
        }
        let max = seen.iter().copied().max().unwrap_or(0);
        (max, (1..=max).all(|n| seen.contains(&n)))
    }

    #[test]
    fn placeholders_are_dense_and_match_the_binds() {
        // (statement, parameters bound by lib.rs)
        let expected = [
            ("insert_request", 7),
            ("select_request", 3),
            ("replace_expired_request", 7),
            ("complete_request", 5),
            ("expired_request", 3),
            ("lookup_request", 3),
            ("insert_message", 6),
            ("select_message", 2),
            ("replace_expired_message", 6),
            ("expired_message", 2),
            ("lookup_message", 2),
            ("purge_requests", 4),
            ("purge_messages", 4),
            ("insert_run", 13),
            ("select_run", 3),
            ("write_run", 15),
            ("renew_lease", 8),
            ("delete_run", 4),
            ("probe_run_lock", 3),
            ("probe_run_exists", 3),
            ("stalled_runs", 1),
            ("enqueue", 3),
            ("lock_due", 1),
            ("pending_ids", 2),
            ("retry_later", 6),
            ("bury", 3),
            ("outbox_stats", 0),
            ("list_outbox", 4),
            ("retry_dead", 1),
            ("drop_dead", 1),
            ("purge_runs", 4),
            ("purge_outbox", 4),
            ("insert_migration", 2),
            ("begin_read_committed", 0),
            ("migration_lock", 0),
        ];
        for (name, want) in expected {
            let sql = ALL
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, s)| *s)
                .unwrap_or_else(|| panic!("no statement {name}"));
            let (max, dense) = placeholders(sql);
            assert_eq!(max, want, "{name}: highest placeholder");
            assert!(dense, "{name}: placeholders are not 1..={max}");
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
    fn id_lists_bind_one_dense_placeholder_per_id() {
        for n in [1, 2, 9, 10, idem_core::runs::MAX_RELAY_BATCH as usize] {
            for (sql, before) in [
                (super::claim_due(n), 4),
                (super::release(n), 1),
                (super::mark_sent(n), 1),
                (super::retry_ids(n), 0),
                (super::drop_ids(n), 0),
            ] {
                assert_eq!(placeholders(&sql), (n + before, true), "{sql}");
                assert_eq!(sql.matches("@P").count(), n + before, "{sql}");
            }
        }
        // Never an empty `IN ()`, which is a syntax error.
        assert!(super::retry_ids(0).ends_with("(@P1)"));
    }

    #[test]
    fn run_statements_lock_what_they_must() {
        assert!(super::SELECT_RUN.contains("WITH (UPDLOCK, HOLDLOCK, ROWLOCK)"));
        assert!(super::LOCK_DUE.contains("WITH (UPDLOCK, READPAST, ROWLOCK)"));
        assert!(super::PROBE_RUN_LOCK.contains("WITH (UPDLOCK, READPAST, ROWLOCK)"));
        for plain in [super::PENDING_IDS, super::STALLED_RUNS] {
            assert!(
                !plain.contains("WITH ("),
                "{plain}: must not skip or take locks"
            );
        }
        for counted in [
            super::WRITE_RUN,
            super::RENEW_LEASE,
            super::DELETE_RUN,
            super::MARK_SENT,
            super::RETRY_LATER,
            super::BURY,
            super::RETRY_IDS,
            super::RETRY_DEAD,
            super::DROP_IDS,
            super::DROP_DEAD,
            super::PURGE_RUNS,
            super::PURGE_OUTBOX,
        ] {
            assert!(counted.starts_with("SET NOCOUNT OFF; "), "{counted}");
        }
    }

    #[test]
    fn no_merge_and_no_ignore_dup_key() {
        for (name, sql) in ALL {
            let upper = sql.to_ascii_uppercase();
            assert!(!upper.contains("MERGE"), "{name} uses MERGE");
            assert!(
                !upper.contains("IGNORE_DUP_KEY"),
                "{name} uses IGNORE_DUP_KEY"
            );
        }
        let migration = crate::MIGRATIONS
            .iter()
            .map(|m| m.sql.to_ascii_uppercase())
            .collect::<String>();
        assert!(!migration.contains("IGNORE_DUP_KEY"));
    }
}
