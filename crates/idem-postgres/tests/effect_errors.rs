//! A deadlock inside an effect is retried with the same key whatever shape the effect's
//! error type has: `#[error(transparent)]`, `#[from]`, `#[source]`, `anyhow::Error` or
//! `Box<dyn Error + Send + Sync>`. Two calls lock two rows in opposite order; PostgreSQL
//! picks one as the deadlock victim (40P01), and idem must run that call again instead of
//! returning its effect's error.
//! Needs PostgreSQL (`IDEM_POSTGRES_URL`, default the local server); fails if unreachable.

#![allow(clippy::unwrap_used)] // test helpers: a failed setup should stop the test loudly

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::{
    EffectError, Idem, Key, Maintenance, Operation, Outcome, Principal, Request, Scope,
};
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use idem_postgres::{PgBackend, PgTx, sqlx};

#[derive(Debug, thiserror::Error)]
enum Transparent {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[derive(Debug, thiserror::Error)]
enum Wrapped {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

#[derive(Debug, thiserror::Error)]
#[error("the debit failed")]
struct Sourced {
    #[source]
    cause: sqlx::Error,
}

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

async fn backend(schema: &str) -> PgBackend {
    let options = PgConnectOptions::from_str(&url()).unwrap();
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
         CREATE TABLE {schema}.pair (id int PRIMARY KEY, v int NOT NULL); \
         INSERT INTO {schema}.pair VALUES (1, 0), (2, 0)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let backend = PgBackend::connect_with(options.options([("search_path", schema)]), 4)
        .await
        .unwrap();
    backend.migrate().await.unwrap();
    backend
}

async fn bump(tx: &mut PgTx, id: i32) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE pair SET v = v + 1 WHERE id = $1")
        .bind(id)
        .execute(&mut **tx)
        .await
        .map(drop)
}

/// Two calls lock rows 1 and 2 in opposite order on their first attempt, so one of them
/// is a deadlock victim. Both must end `Executed`, the victim after a second attempt.
async fn deadlock_is_retried<E, M>(schema: &str, wrap: fn(sqlx::Error) -> E)
where
    E: EffectError<M>,
{
    let idem = Arc::new(Idem::new(backend(schema).await));
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let attempts = Arc::new(AtomicUsize::new(0));
    let scope = Arc::new(Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("pair", 1).unwrap(),
    ));
    let calls: Vec<_> = [(1, 2), (2, 1)]
        .into_iter()
        .map(|(first, second)| {
            let (idem, barrier, attempts, scope) = (
                idem.clone(),
                barrier.clone(),
                attempts.clone(),
                scope.clone(),
            );
            tokio::spawn(async move {
                let mine = Arc::new(AtomicUsize::new(0));
                let key = Key::new(format!("k{first}")).unwrap();
                idem.execute(
                    &scope,
                    &key,
                    &Request::new(serde_json::json!({"first": first})),
                    move |tx| {
                        attempts.fetch_add(1, Ordering::SeqCst);
                        let attempt = mine.fetch_add(1, Ordering::SeqCst);
                        let barrier = barrier.clone();
                        Box::pin(async move {
                            bump(tx, first).await.map_err(wrap)?;
                            if attempt == 0 {
                                barrier.wait().await;
                            }
                            bump(tx, second).await.map_err(wrap)?;
                            Ok::<_, E>(first)
                        })
                    },
                )
                .await
            })
        })
        .collect();
    for call in calls {
        let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), call)
            .await
            .expect("hang guard")
            .unwrap();
        match outcome {
            Ok(Outcome::Executed(_)) => {}
            other => panic!("{schema}: expected both calls to execute, got {other:?}"),
        }
    }
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        3,
        "{schema}: the deadlock victim runs its effect a second time"
    );
    let pool = idem.backend().pool();
    let sum: i64 = sqlx::query_scalar("SELECT sum(v)::bigint FROM pair")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(sum, 4, "each call moved both rows exactly once");
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_request_result")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(records, 2);
    println!("{schema}: deadlock victim retried; 3 effect attempts, 2 executed");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transparent_wrapper() {
    deadlock_is_retried("idem_effect_transparent", Transparent::Db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_wrapper() {
    deadlock_is_retried("idem_effect_from", Wrapped::Db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_field() {
    deadlock_is_retried("idem_effect_source", |cause| Sourced { cause }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anyhow_error() {
    deadlock_is_retried("idem_effect_anyhow", anyhow::Error::from).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boxed_error() {
    deadlock_is_retried("idem_effect_boxed", |e| {
        Box::new(e) as Box<dyn std::error::Error + Send + Sync>
    })
    .await;
}
