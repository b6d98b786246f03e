//! The Citus support, checked on plain PostgreSQL (`IDEM_POSTGRES_URL`, default the local
//! server; fails if unreachable): the distributed purge never deletes a record that was
//! taken over while it ran, and `PgBackend::distribute` refuses a server without Citus.
//! The same checks run on a real Citus cluster in `tests/citus.rs` (`IDEM_CITUS_URL`).
//! Each test works in a schema of its own and drops it.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::str::FromStr;
use std::time::Duration;

use idem_core::{ErrorKind, Maintenance, Table};
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use idem_postgres::{PgBackend, PurgeStyle, sqlx};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A private, migrated schema: (admin pool, backend on the schema, schema name).
async fn private(prefix: &str, purge: PurgeStyle) -> (PgPool, PgBackend, String) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() & 0xff_ffff)
        .unwrap_or(0);
    let schema = format!("idem_t_{prefix}_{}_{nanos:06x}", std::process::id());
    let options = PgConnectOptions::from_str(&url()).unwrap();
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {} (set IDEM_POSTGRES_URL): {e}", url()));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let options = options
        .options([("search_path", schema.as_str())])
        .application_name(&schema);
    let backend = PgBackend::connect_with(options, 8)
        .await
        .unwrap()
        .with_purge_style(purge);
    backend.migrate().await.unwrap();
    (admin, backend, schema)
}

async fn drop_private(admin: PgPool, backend: PgBackend, schema: String) {
    backend.pool().close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
}

/// A purge that found an expired record must not delete it once another transaction
/// has taken the key over (a new request, live again): the purge's `DELETE` rechecks
/// the expiry on the row it deletes. Without the recheck the `DELETE` waits for the
/// takeover's row lock, then deletes the new, live record by its key, and a retry of
/// the new request would run its effect again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_purge_keeps_a_record_taken_over_while_it_ran() {
    let (admin, backend, schema) = private("dpurge", PurgeStyle::Distributed).await;
    let pool = backend.pool().clone();
    sqlx::query(
        "INSERT INTO idem_request_result (principal, operation, request_key, request, response, created_at, expires_at) \
         VALUES ('account-1', 'debit:v1', 'checkout-42', '{\"amount\":100}', '{\"balance\":900}', \
         now() - interval '2 days', now() - interval '1 day')",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The takeover of the expired key by a new request, not yet committed.
    let mut takeover = pool.begin().await.unwrap();
    let taken = sqlx::query(
        "UPDATE idem_request_result SET request = '{\"amount\":7}', response = '{\"balance\":893}', \
         created_at = now(), expires_at = now() + interval '1 day' \
         WHERE principal = 'account-1' AND operation = 'debit:v1' AND request_key = 'checkout-42'",
    )
    .execute(&mut *takeover)
    .await
    .unwrap();
    assert_eq!(taken.rows_affected(), 1);
    let purger = {
        let backend = backend.clone();
        tokio::spawn(async move {
            backend
                .purge_batch(Table::Requests, Duration::ZERO, 100)
                .await
        })
    };
    // Wait (bounded) until the purge's DELETE waits for the takeover's row lock.
    let schema_name = schema.clone();
    let waiting = tokio::time::timeout(HANG_GUARD, async {
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND application_name = $1 AND query LIKE 'DELETE FROM idem_request_result%'",
            )
            .bind(&schema_name)
            .fetch_one(&admin)
            .await
            .unwrap();
            if n > 0 {
                break;
            }
            assert!(
                !purger.is_finished(),
                "the purge ended before waiting for the takeover"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        waiting.is_ok(),
        "the purge never waited for the takeover ({schema_name})"
    );
    takeover.commit().await.unwrap();
    let deleted = tokio::time::timeout(HANG_GUARD, purger)
        .await
        .expect("the purge hung")
        .unwrap()
        .unwrap();
    let kept: Option<String> = sqlx::query_scalar(
        "SELECT response FROM idem_request_result \
         WHERE principal = 'account-1' AND operation = 'debit:v1' AND request_key = 'checkout-42'",
    )
    .fetch_optional(&pool)
    .await
    .unwrap();
    assert_eq!(
        (deleted, kept.as_deref()),
        (0, Some("{\"balance\":893}")),
        "the purge deleted the record a new request had taken over"
    );
    drop_private(admin, backend, schema).await;
}

/// On a server without the citus extension, `distribute` changes nothing and says why.
#[tokio::test]
async fn distribute_refuses_a_server_without_citus() {
    let (admin, backend, schema) = private("dnocitus", PurgeStyle::SkipLocked).await;
    let e = backend.distribute().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Configuration, "{e}");
    assert!(e.to_string().contains("not Citus"), "{e}");
    // The tables are still plain tables: a purge with row locks runs.
    backend
        .purge_batch(Table::Requests, Duration::ZERO, 10)
        .await
        .unwrap();
    drop_private(admin, backend, schema).await;
}
