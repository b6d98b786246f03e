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

pub(crate) const SELECT_REQUEST: &str = concat!(
    "SELECT request, response, status FROM idem_request_result ",
    "WHERE principal = ?1 AND operation = ?2 AND request_key = ?3 AND created_at >= ",
    now_us!(),
    " - ?4"
);

pub(crate) const SELECT_MESSAGE: &str = concat!(
    "SELECT fingerprint FROM idem_processed_message ",
    "WHERE subscriber = ?1 AND message_id = ?2 AND processed_at >= ",
    now_us!(),
    " - ?3"
);

/// Written once, with the final response, while `BEGIN IMMEDIATE` holds the write
/// lock. The conflict branch replaces an expired record only: the claim saw no live one.
pub(crate) const UPSERT_REQUEST: &str = concat!(
    "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at) ",
    "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ",
    now_us!(),
    ") ON CONFLICT (principal, operation, request_key) DO UPDATE SET ",
    "request = excluded.request, response = excluded.response, status = excluded.status, created_at = excluded.created_at"
);

pub(crate) const UPSERT_MESSAGE: &str = concat!(
    "INSERT INTO idem_processed_message (subscriber, message_id, fingerprint, processed_at) VALUES (?1, ?2, ?3, ",
    now_us!(),
    ") ON CONFLICT (subscriber, message_id) DO UPDATE SET ",
    "fingerprint = excluded.fingerprint, processed_at = excluded.processed_at"
);

pub(crate) const PURGE_REQUESTS: &str = concat!(
    "DELETE FROM idem_request_result WHERE (principal, operation, request_key) IN (",
    "SELECT principal, operation, request_key FROM idem_request_result WHERE created_at < ",
    now_us!(),
    " - ?1 ORDER BY created_at LIMIT ?2)"
);

pub(crate) const PURGE_MESSAGES: &str = concat!(
    "DELETE FROM idem_processed_message WHERE (subscriber, message_id) IN (",
    "SELECT subscriber, message_id FROM idem_processed_message WHERE processed_at < ",
    now_us!(),
    " - ?1 ORDER BY processed_at LIMIT ?2)"
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
    ("select_request", SELECT_REQUEST),
    ("select_message", SELECT_MESSAGE),
    ("upsert_request", UPSERT_REQUEST),
    ("upsert_message", UPSERT_MESSAGE),
    ("purge_requests", PURGE_REQUESTS),
    ("purge_messages", PURGE_MESSAGES),
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
