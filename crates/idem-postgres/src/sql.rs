//! Every statement the PostgreSQL backend sends.

macro_rules! cutoff {
    ($n:literal) => {
        concat!("clock_timestamp() - make_interval(secs => $", $n, ")")
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

/// The claim: conflicts wait for the other transaction and then do nothing.
pub(crate) const INSERT_REQUEST: &str = "INSERT INTO idem_request_result (principal, operation, request_key, request) \
     VALUES ($1, $2, $3, $4::jsonb) ON CONFLICT (principal, operation, request_key) DO NOTHING";
/// The separate re-read after a conflict: under READ COMMITTED a new statement sees the
/// winner's committed row, which the INSERT's snapshot may not have.
pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request::text, response::text, status, created_at < ",
    cutoff!(4),
    " AS expired FROM idem_request_result WHERE ",
    request_pk!()
);
pub(crate) const REPLACE_EXPIRED_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET request = $4::jsonb, response = NULL, status = 0, created_at = clock_timestamp() WHERE ",
    request_pk!(),
    " AND created_at < ",
    cutoff!(5)
);
pub(crate) const COMPLETE_REQUEST: &str = concat!(
    "UPDATE idem_request_result SET response = $4::jsonb, status = $5 WHERE ",
    request_pk!()
);
pub(crate) const LOOKUP_REQUEST: &str = concat!(
    "SELECT request::text, response::text, status FROM idem_request_result WHERE ",
    request_pk!(),
    " AND created_at >= ",
    cutoff!(4)
);

pub(crate) const INSERT_MESSAGE: &str = "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint) \
     VALUES ($1, $2, $3::jsonb) ON CONFLICT (subscriber, message_id) DO NOTHING";
pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint::text, processed_at < ",
    cutoff!(3),
    " AS expired FROM idem_processed_message WHERE ",
    message_pk!()
);
pub(crate) const REPLACE_EXPIRED_MESSAGE: &str = concat!(
    "UPDATE idem_processed_message SET fingerprint = $3::jsonb, processed_at = clock_timestamp() WHERE ",
    message_pk!(),
    " AND processed_at < ",
    cutoff!(4)
);
pub(crate) const LOOKUP_MESSAGE: &str = concat!(
    "SELECT fingerprint::text FROM idem_processed_message WHERE ",
    message_pk!(),
    " AND processed_at >= ",
    cutoff!(3)
);

pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE created_at < ",
    cutoff!(1),
    " ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);
/// The purge for distributed PostgreSQL (Citus): the same bounded batch without the
/// multi-shard `FOR UPDATE SKIP LOCKED` Citus refuses. Concurrent purgers may wait for
/// each other instead of skipping rows. Params: age (s), limit.
pub(crate) const PURGE_REQUESTS_DISTRIBUTED: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE created_at < ",
    cutoff!(1),
    " ORDER BY created_at LIMIT $2)"
);
/// The message purge for distributed PostgreSQL (see [`PURGE_REQUESTS_DISTRIBUTED`]).
pub(crate) const PURGE_MESSAGES_DISTRIBUTED: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE processed_at < ",
    cutoff!(1),
    " ORDER BY processed_at LIMIT $2)"
);
pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE processed_at < ",
    cutoff!(1),
    " ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
);

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
    ("lookup_request", LOOKUP_REQUEST),
    ("insert_message", INSERT_MESSAGE),
    ("select_message", SELECT_MESSAGE),
    ("replace_expired_message", REPLACE_EXPIRED_MESSAGE),
    ("lookup_message", LOOKUP_MESSAGE),
    ("purge_requests", PURGE_REQUESTS),
    ("purge_messages", PURGE_MESSAGES),
    ("migration_lock", MIGRATION_LOCK),
    ("create_migrations", CREATE_MIGRATIONS),
    ("select_migrations", SELECT_MIGRATIONS),
    ("insert_migration", INSERT_MIGRATION),
];

#[cfg(test)]
mod tests {
    #[test]
    fn distributed_purges_take_no_row_locks() {
        for sql in [
            super::PURGE_REQUESTS_DISTRIBUTED,
            super::PURGE_MESSAGES_DISTRIBUTED,
        ] {
            assert!(!sql.contains("FOR UPDATE"), "{sql}");
            assert!(sql.contains("LIMIT $2"), "still bounded: {sql}");
        }
    }

    #[test]
    fn statements_snapshot() {
        let text: String = super::ALL
            .iter()
            .map(|(name, sql)| format!("-- {name}\n{sql};\n\n"))
            .collect();
        insta::assert_snapshot!(text);
    }
}
