//! Every statement the PostgreSQL backend sends.

macro_rules! cutoff {
    ($n:literal) => {
        concat!("clock_timestamp() - make_interval(secs => $", $n, ")")
    };
}
/// One reading of the database clock, shared by every column a statement sets.
macro_rules! now {
    () => {
        "(SELECT clock_timestamp() AS t) AS now"
    };
}
macro_rules! request_pk {
    () => {
        "principal = $1 AND operation = $2 AND request_key = $3"
    };
}
macro_rules! message_pk {
    () => {
        "subscriber = $1 AND message_id = $2"
    };
}

/// The claim: conflicts wait for the other transaction (bounded by `lock_timeout`) and
/// then do nothing. `created_at` and `expires_at` come from one reading of the database
/// clock. Params: principal, operation, key, request, retention (s).
pub(crate) const INSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result (principal, operation, request_key, request, created_at, expires_at) ",
    "SELECT $1, $2, $3, $4, now.t, now.t + make_interval(secs => $5) FROM ",
    now!(),
    " ON CONFLICT (principal, operation, request_key) DO NOTHING"
);
/// The separate re-read after a conflict: under READ COMMITTED a new statement sees the
/// winner's committed row, which the INSERT's snapshot may not have.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status, expires_at <= clock_timestamp() AS expired FROM idem_request_result WHERE ",
    request_pk!()
);
/// Takes an expired record over as a fresh placeholder. Params: principal, operation,
/// key, request, retention (s).
pub(crate) const REPLACE_EXPIRED_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET request = $4, response = NULL, status = 0, created_at = now.t, ",
    "expires_at = now.t + make_interval(secs => $5) FROM ",
    now!(),
    " WHERE ",
    request_pk!(),
    " AND expires_at <= now.t"
);
/// Completes the placeholder just before `COMMIT`: exactly one row, still unfinished in
/// this transaction and not expired while the effect ran (else a waiting loser could
/// take the committed record over and run the effect again). Params: principal,
/// operation, key, response, status.
pub(crate) const COMPLETE_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET response = $4, status = $5 WHERE ",
    request_pk!(),
    " AND response IS NULL AND expires_at > clock_timestamp()"
);
/// Why a completion found no row: `Some(true)` when the record expired.
pub(crate) const EXPIRED_REQUEST: &str = concat!(
    "SELECT expires_at <= clock_timestamp() FROM idem_request_result WHERE ",
    request_pk!()
);
/// The replay fast path. Params: principal, operation, key.
pub(crate) const LOOKUP_REQUEST: &str = concat!(
    "SELECT request, response, status FROM idem_request_result WHERE ",
    request_pk!(),
    " AND expires_at > clock_timestamp()"
);

/// Params: subscriber, message ID, fingerprint, retention (s).
pub(crate) const INSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at, expires_at) ",
    "SELECT $1, $2, $3, now.t, now.t + make_interval(secs => $4) FROM ",
    now!(),
    " ON CONFLICT (subscriber, message_id) DO NOTHING"
);
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint, expires_at <= clock_timestamp() AS expired FROM idem_processed_message WHERE ",
    message_pk!()
);
/// Params: subscriber, message ID, fingerprint, retention (s).
pub(crate) const REPLACE_EXPIRED_MESSAGE: &str = concat!(
    "UPDATE idem_processed_message SET fingerprint = $3, processed_at = now.t, ",
    "expires_at = now.t + make_interval(secs => $4) FROM ",
    now!(),
    " WHERE ",
    message_pk!(),
    " AND expires_at <= now.t"
);
/// Before a message's commit: `true` while the claimed row is live, `false` when it
/// expired while the effect ran, no row when it is gone (the effect ended the
/// transaction). A plain read: the transaction sees its own row.
pub(crate) const EXPIRED_MESSAGE: &str = concat!(
    "SELECT expires_at <= clock_timestamp() FROM idem_processed_message WHERE ",
    message_pk!()
);
pub(crate) const LOOKUP_MESSAGE: &str = concat!(
    "SELECT fingerprint FROM idem_processed_message WHERE ",
    message_pk!(),
    " AND expires_at > clock_timestamp()"
);

/// Records that are expired **and** were claimed at least `$1` seconds ago, oldest
/// expiry first; rows locked by a live transaction are skipped. Params: older than (s),
/// limit.
pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE expires_at <= clock_timestamp() AND created_at <= ",
    cutoff!(1),
    " ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);
/// Like [`PURGE_REQUESTS`], for messages.
pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE expires_at <= clock_timestamp() AND processed_at <= ",
    cutoff!(1),
    " ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);

/// Bounds the claim's lock waits for this transaction only (`is_local`), and returns
/// the value the effect must get back (the session's, whatever set it: configuration,
/// role, startup options or a `SET` on the pooled connection). The `MATERIALIZED` CTE
/// reads it before `set_config` runs. Params: the bound, as text (`"500ms"`).
pub(crate) const SET_LOCK_TIMEOUT: &str = "WITH old AS MATERIALIZED (SELECT current_setting('lock_timeout') AS v) \
     SELECT old.v, set_config('lock_timeout', $1, true) FROM old";
/// Gives the effect the session's `lock_timeout` back once the claim is won (still
/// transaction-local: the session keeps its value after the transaction). Params: the
/// value [`SET_LOCK_TIMEOUT`] returned.
pub(crate) const RESTORE_LOCK_TIMEOUT: &str = "SELECT set_config('lock_timeout', $1, true)";

/// Serializes concurrent migrators of one schema.
pub(crate) const MIGRATION_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.idem_schema_migrations'))";
pub(crate) const CREATE_MIGRATIONS: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
     version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())";
pub(crate) const SELECT_MIGRATIONS: &str = "SELECT version FROM idem_schema_migrations";
pub(crate) const INSERT_MIGRATION: &str =
    "INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)";

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
    ("set_lock_timeout", SET_LOCK_TIMEOUT),
    ("restore_lock_timeout", RESTORE_LOCK_TIMEOUT),
    ("migration_lock", MIGRATION_LOCK),
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
}
