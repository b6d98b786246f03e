//! Under REPEATABLE READ a waiting loser cannot see the winner's row: with a placeholder
//! claim the server answers SQLSTATE 40001; with the key lock (the default on a single
//! server) the loser knows it waited with a snapshot taken before the wait and answers a
//! serialization failure itself, before any effect. Either way idem classifies it and
//! retries the whole transaction with the same key, and the effect runs once.
//! Needs PostgreSQL (`IDEM_POSTGRES_URL`, default the local server); fails if unreachable.

#![allow(clippy::unwrap_used)] // test helpers: a failed setup should stop the test loudly

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    Error, ErrorKind, Idem, Key, Maintenance, Operation, Outcome, Principal, Request, RetryPolicy,
    Scope,
};
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use idem_postgres::{ClaimStyle, PgBackend, db_error, sqlx};

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

async fn repeatable_read_backend(schema: &str, style: ClaimStyle) -> PgBackend {
    let options = PgConnectOptions::from_str(&url()).unwrap();
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let options = options.options([
        ("search_path", schema),
        ("default_transaction_isolation", "repeatable read"),
    ]);
    let backend = PgBackend::connect_with(options, 20)
        .await
        .unwrap()
        .with_claim_style(style);
    backend.migrate().await.unwrap();
    backend
}

/// 12 concurrent duplicates, each effect holding its transaction for a while.
async fn race(
    idem: Arc<Idem<PgBackend>>,
    runs: Arc<AtomicUsize>,
) -> Vec<Result<Outcome<i64>, Error<sqlx::Error>>> {
    let scope = Arc::new(Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    ));
    let barrier = Arc::new(tokio::sync::Barrier::new(12));
    let tasks: Vec<_> = (0..12)
        .map(|_| {
            let (idem, scope, runs, barrier) =
                (idem.clone(), scope.clone(), runs.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let key = Key::new("same-key").unwrap();
                idem.execute(
                    &scope,
                    &key,
                    &Request::new(serde_json::json!({"n": 1})),
                    move |tx| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Box::pin(async move {
                            let one: i64 = sqlx::query_scalar("SELECT 1::bigint")
                                .fetch_one(&mut **tx)
                                .await?;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            Ok(one)
                        })
                    },
                )
                .await
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serialization_failures_are_classified_and_retried_with_the_key_lock() {
    serialization_failures_are_classified_and_retried(ClaimStyle::KeyLock, "idem_t_isolation_rr")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serialization_failures_are_classified_and_retried_with_a_placeholder() {
    serialization_failures_are_classified_and_retried(
        ClaimStyle::Placeholder,
        "idem_t_isolation_rr_placeholder",
    )
    .await;
}

async fn serialization_failures_are_classified_and_retried(style: ClaimStyle, schema: &str) {
    let backend = repeatable_read_backend(schema, style).await;

    // Without retries, the losers' 40001 surfaces, classified by its code.
    let no_retry = RetryPolicy {
        max_attempts: 1,
        ..RetryPolicy::default()
    };
    let idem = Arc::new(
        Idem::new(backend.clone())
            .with_retry(no_retry)
            .with_fast_path(false),
    );
    let results = race(idem, Arc::new(AtomicUsize::new(0))).await;
    let executed = results
        .iter()
        .filter(|r| matches!(r, Ok(Outcome::Executed(1))))
        .count();
    let serialization = results
        .iter()
        .filter(|r| matches!(r, Err(Error::RetriesExhausted { last, .. }) if last.kind() == ErrorKind::SerializationFailure && last.code().is_none_or(|c| c == "40001")))
        .count();
    assert_eq!(executed, 1, "{results:?}");
    assert!(
        serialization >= 1,
        "expected serialization failures for the waiting losers: {results:?}"
    );
    assert_eq!(
        executed
            + serialization
            + results
                .iter()
                .filter(|r| matches!(r, Ok(Outcome::Replayed(1))))
                .count(),
        12,
        "{results:?}"
    );

    // With the default policy, every loser retries with the same key and replays.
    sqlx::query("DELETE FROM idem_request_result")
        .execute(backend.pool())
        .await
        .map_err(db_error)
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let idem = Arc::new(Idem::new(backend.clone()).with_fast_path(false));
    let results = race(idem, runs.clone()).await;
    assert_eq!(
        results
            .iter()
            .filter(|r| matches!(r, Ok(Outcome::Executed(1))))
            .count(),
        1,
        "{results:?}"
    );
    assert_eq!(
        results
            .iter()
            .filter(|r| matches!(r, Ok(Outcome::Replayed(1))))
            .count(),
        11,
        "{results:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the effect ran once");

    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url())
        .await
        .unwrap();
    backend.pool().close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}
