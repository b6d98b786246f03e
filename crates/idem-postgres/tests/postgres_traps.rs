//! PostgreSQL engine traps, live (`IDEM_POSTGRES_URL`, default the local server; fails
//! if unreachable). Each test works in a schema of its own and drops it.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::str::FromStr;
use std::time::Duration;

use idem_core::{
    Error, ErrorKind, Idem, Key, Maintenance, Operation, Outcome, Principal, Request, RetryPolicy,
    Scope,
};
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use idem_postgres::{PgBackend, sqlx};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A private schema: (admin pool, backend on the schema, schema name).
async fn private(prefix: &str) -> (PgPool, PgBackend, String) {
    let schema = format!(
        "idem_t_{prefix}_{}_{:06x}",
        std::process::id(),
        fastrand_u32()
    );
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
    let backend = PgBackend::connect_with(options.options([("search_path", schema.as_str())]), 8)
        .await
        .unwrap();
    backend.migrate().await.unwrap();
    (admin, backend, schema)
}

fn fastrand_u32() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() & 0xff_ffff)
        .unwrap_or(0)
}

async fn drop_private(admin: PgPool, backend: PgBackend, schema: String) {
    backend.pool().close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    )
}

async fn records(backend: &PgBackend) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_request_result")
        .fetch_one(backend.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn an_effect_that_ends_the_transaction_is_not_executed() {
    let (admin, backend, schema) = private("rollback").await;
    let idem = Idem::new(backend.clone());
    let out = idem
        .execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |tx| {
                Box::pin(async move {
                    sqlx::query("ROLLBACK").execute(&mut **tx).await?;
                    Ok::<_, sqlx::Error>(1)
                })
            },
        )
        .await;
    match out {
        Err(Error::Backend(e)) => {
            assert_eq!(e.kind(), ErrorKind::Other, "{e}");
            assert!(e.to_string().contains("ended inside the effect"), "{e}");
        }
        other => panic!("nothing was stored, so this must not be a success: {other:?}"),
    }
    assert_eq!(records(&backend).await, 0);
    drop_private(admin, backend, schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_lock_timeout_does_not_bound_the_effect() {
    let (admin, backend, schema) = private("locktimeout").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {schema}.t (id int PRIMARY KEY, n int); INSERT INTO {schema}.t VALUES (1, 0)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    // Another session holds the row the effect updates, longer than the wait bound.
    let mut holder = admin.begin().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE {schema}.t SET n = n + 1 WHERE id = 1"
    )))
    .execute(&mut *holder)
    .await
    .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        holder.commit().await.unwrap();
    });
    // One attempt: a lock timeout inside the effect would not be hidden by a retry.
    let idem = Idem::new(backend.clone())
        .with_wait_timeout(Duration::from_millis(100))
        .with_retry(RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        });
    let out = tokio::time::timeout(
        HANG_GUARD,
        idem.execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |tx| {
                Box::pin(async move {
                    let n: i32 =
                        sqlx::query_scalar("UPDATE t SET n = n + 1 WHERE id = 1 RETURNING n")
                            .fetch_one(&mut **tx)
                            .await?;
                    Ok::<_, sqlx::Error>(n)
                })
            },
        ),
    )
    .await
    .unwrap();
    assert!(
        matches!(out, Ok(Outcome::Executed(2))),
        "the effect waits with the session's lock_timeout, not the claim's: {out:?}"
    );
    release.await.unwrap();
    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn json_text_is_stored_byte_for_byte() {
    let (admin, backend, schema) = private("exact").await;
    let idem = Idem::new(backend.clone());
    let value = serde_json::json!({
        "computed": 0.3 - 0.1,
        "big": 1e16,
        "negative_zero": -0.0,
        "nul": "a\u{0}b",
        "twenty_digits": 12_345_678_901_234_567_890_u64,
    });
    let request = Request::new(value.clone());
    let out = idem
        .execute(&scope(), &Key::new("exact").unwrap(), &request, {
            let value = value.clone();
            move |_tx| {
                let value = value.clone();
                Box::pin(async move { Ok::<_, sqlx::Error>(value) })
            }
        })
        .await
        .unwrap();
    assert!(!out.is_replayed());
    let (stored_request, stored_response): (String, String) =
        sqlx::query_as("SELECT request, response FROM idem_request_result")
            .fetch_one(backend.pool())
            .await
            .unwrap();
    assert_eq!(stored_request, request.to_json(), "the request's text");
    assert_eq!(
        stored_response,
        serde_json::to_string(&value).unwrap(),
        "the response's text"
    );
    // Replaying this request exactly also needs idem-core's exact float parsing
    // (serde_json's float_roundtrip); what the engine owes is the verbatim text above.
    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn the_effect_gets_the_sessions_own_lock_timeout_back() {
    let (admin, backend, schema) = private("sessionvalue").await;
    // A pool whose sessions SET their own lock_timeout (not a configuration default).
    let options = PgConnectOptions::from_str(&url())
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, "SET lock_timeout = '31s'")
                    .await
                    .map(drop)
            })
        })
        .connect_with(options)
        .await
        .unwrap();
    let session = PgBackend::from_pool(pool);
    let idem = Idem::new(session.clone()).with_wait_timeout(Duration::from_millis(250));
    let out = idem
        .execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |tx| {
                Box::pin(async move {
                    sqlx::query_scalar::<_, String>("SELECT current_setting('lock_timeout')")
                        .fetch_one(&mut **tx)
                        .await
                })
            },
        )
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed("31s".to_owned()));
    session.pool().close().await;
    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn a_consumer_effect_that_ends_the_transaction_is_not_applied() {
    let (admin, backend, schema) = private("msgrollback").await;
    let idem = Idem::new(backend.clone());
    let out = idem
        .consume(
            &idem_core::Subscriber::new("s").unwrap(),
            &idem_core::MessageId::new("m").unwrap(),
            None,
            |tx| {
                Box::pin(async move {
                    sqlx::query("ROLLBACK").execute(&mut **tx).await?;
                    Ok::<_, sqlx::Error>(())
                })
            },
        )
        .await;
    assert!(
        matches!(&out, Err(Error::Backend(e)) if e.to_string().contains("ended inside the effect")),
        "the message ID was not recorded, so this must not be Applied: {out:?}"
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_processed_message")
        .fetch_one(backend.pool())
        .await
        .unwrap();
    assert_eq!(n, 0);
    drop_private(admin, backend, schema).await;
}

/// `max_connections` and `acquire_timeout`, the pool settings every engine takes under
/// the same names: with the only connection held, a call fails with a connection error
/// once the acquire timeout passes, instead of waiting on.
#[tokio::test]
async fn acquisition_is_bounded_by_the_acquire_timeout() {
    let (admin, backend, schema) = private("acquire").await;
    let options = PgConnectOptions::from_str(&url())
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = idem_core::PoolOptions::new(1).acquire_timeout(Duration::from_millis(200));
    let small = PgBackend::connect_pooled(options, pool).await.unwrap();
    let held = small.pool().acquire().await.unwrap();
    let err = tokio::time::timeout(
        HANG_GUARD,
        small.purge_batch(idem_core::Table::Requests, Duration::ZERO, 10),
    )
    .await
    .expect("the acquire timeout bounds the wait")
    .expect_err("no free connection");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    drop(held);
    assert_eq!(
        small
            .purge_batch(idem_core::Table::Requests, Duration::ZERO, 10)
            .await
            .unwrap(),
        0,
        "the freed connection serves the next call"
    );
    small.pool().close().await;
    drop_private(admin, backend, schema).await;
}

/// A session the server ended from another connection (`pg_terminate_backend`: SQLSTATE
/// 57P01, as in a fast shutdown) is a lost connection, the CLI's exit 7, whether it sat
/// idle between statements or was running one; never "another database error". (A
/// connection terminated while idle in the pool is replaced by sqlx's checkout ping.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_session_is_a_connection_error() {
    let (admin, backend, schema) = private("terminated").await;
    let terminate = |pid: i32| {
        let admin = admin.clone();
        async move {
            // Waits (up to 10 s) until the backend process has exited.
            let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
                .bind(pid)
                .fetch_one(&admin)
                .await
                .unwrap();
            assert!(done, "backend {pid} was not terminated");
        }
    };

    // Idle: a connection held between statements, terminated meanwhile; its next
    // statement finds the session gone.
    let mut conn = backend.pool().acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    terminate(pid).await;
    let err = tokio::time::timeout(HANG_GUARD, sqlx::query("SELECT 1").execute(&mut *conn))
        .await
        .unwrap()
        .map(drop)
        .map_err(idem_postgres::db_error)
        .expect_err("the session is gone");
    assert_eq!(
        err.kind(),
        ErrorKind::Connection,
        "{err} ({:?})",
        err.code()
    );
    drop(conn);

    // In use: a statement running when another session terminates it.
    let mut conn = backend.pool().acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    let running = tokio::spawn(async move {
        let out = sqlx::query("SELECT pg_sleep(60)").execute(&mut *conn).await;
        out.map(drop).map_err(idem_postgres::db_error)
    });
    tokio::time::timeout(HANG_GUARD, async {
        loop {
            let sleeping: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND query = 'SELECT pg_sleep(60)' AND state = 'active')",
            )
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
            if sleeping {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the statement started");
    terminate(pid).await;
    let err = tokio::time::timeout(HANG_GUARD, running)
        .await
        .unwrap()
        .unwrap()
        .expect_err("the statement's session was terminated");
    assert_eq!(err.kind(), ErrorKind::Connection, "{err}");
    assert_eq!(err.code(), Some("57P01"), "{err}");
    drop_private(admin, backend, schema).await;
}

/// A completion and its `COMMIT` travel as one message that ends by beginning an empty
/// transaction (sqlx still counts the one it began); the `ROLLBACK` sqlx queues for it
/// goes out with the ping that returns the connection. On a pool of one connection, the
/// next checkout must find it outside any transaction, the record and the effect
/// committed, and a key and response with quotes, backslashes and non-ASCII text stored
/// byte for byte.
#[tokio::test]
async fn a_completed_request_returns_its_connection_outside_any_transaction() {
    let (admin, wide, schema) = private("onemsg").await;
    let options = PgConnectOptions::from_str(&url())
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let backend = PgBackend::connect_with(options, 1).await.unwrap();
    sqlx::query("CREATE TABLE effect_rows (n int)")
        .execute(backend.pool())
        .await
        .unwrap();
    let idem = Idem::new(backend.clone());
    let key = Key::new(r"k'; -- \ é 🦀").unwrap();
    let answer = serde_json::json!({"s": "a'b\\c\"d é", "n": 1});
    for round in 0..3 {
        let expected = answer.clone();
        let out = idem
            .execute(
                &scope(),
                &key,
                &Request::new(serde_json::json!({"n": 1})),
                move |tx| {
                    let expected = expected.clone();
                    Box::pin(async move {
                        sqlx::query("INSERT INTO effect_rows VALUES (1)")
                            .execute(&mut **tx)
                            .await?;
                        Ok::<_, sqlx::Error>(expected)
                    })
                },
            )
            .await
            .unwrap();
        if round == 0 {
            assert_eq!(out, Outcome::Executed(answer.clone()));
        } else {
            assert_eq!(out, Outcome::Replayed(answer.clone()));
        }
        // `SAVEPOINT` is refused outside a transaction block (25P01): the connection came
        // back outside any transaction.
        let mut conn = backend.pool().acquire().await.unwrap();
        let err = sqlx::query("SAVEPOINT probe")
            .execute(&mut *conn)
            .await
            .unwrap_err();
        assert_eq!(
            err.as_database_error().and_then(|d| d.code()).as_deref(),
            Some("25P01"),
            "{err}"
        );
    }
    let (rows, stored_key, response): (i64, String, String) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM effect_rows), request_key, response FROM idem_request_result",
    )
    .fetch_one(backend.pool())
    .await
    .unwrap();
    assert_eq!(rows, 1, "the effect ran once");
    assert_eq!(stored_key, key.as_str());
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&response).unwrap(),
        answer
    );
    backend.pool().close().await;
    drop_private(admin, wide, schema).await;
}

/// After the migrations the record tables carry their primary key and the `expires_at`
/// index the purge reads by, nothing else: 0005 dropped the claim-time indexes no
/// statement used, which every new record paid for.
#[tokio::test]
async fn the_record_tables_carry_only_the_indexes_idem_reads() {
    let (admin, backend, schema) = private("indexes").await;
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = $1 \
         AND tablename IN ('idem_request_result', 'idem_processed_message') ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        indexes,
        [
            "idem_processed_message_expires_at",
            "idem_processed_message_pkey",
            "idem_request_result_expires_at",
            "idem_request_result_pkey",
        ]
    );
    drop_private(admin, backend, schema).await;
}
