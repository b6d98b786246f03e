//! The maintenance lock on a live PostgreSQL (`IDEM_POSTGRES_URL`, default the local
//! server; fails if unreachable): one holder per name and schema, a holder whose session
//! is terminated finds out, and the lock is free again at once.

#![allow(clippy::unwrap_used)]

use std::str::FromStr;
use std::time::{Duration, Instant};

use idem_core::maintain::LeaderLock;
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use idem_postgres::{PgBackend, sqlx};

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

async fn backend(admin: &sqlx::PgPool, schema: &str) -> PgBackend {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    )))
    .execute(admin)
    .await
    .unwrap();
    let options = PgConnectOptions::from_str(&url())
        .unwrap()
        .options([("search_path", schema)]);
    PgBackend::connect_with(options, 2).await.unwrap()
}

#[tokio::test]
async fn one_holder_per_name_and_schema_and_a_terminated_holder_knows() {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(PgConnectOptions::from_str(&url()).unwrap())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} must be running: {e}", url()));
    let pid = std::process::id();
    let (s1, s2) = (
        format!("idem_leader_a_{pid}"),
        format!("idem_leader_b_{pid}"),
    );
    let one = backend(&admin, &s1).await;
    let two = backend(&admin, &s2).await;
    let a = one.leader_lock("idem-maintain").unwrap();
    let b = one.leader_lock("idem-maintain").unwrap();
    let mut held = a.try_acquire().await.unwrap().expect("free at first");
    assert!(a.is_held(&mut held).await.unwrap());
    assert!(
        b.try_acquire().await.unwrap().is_none(),
        "one holder per name"
    );
    let elsewhere = two.leader_lock("idem-maintain").unwrap();
    let other_schema = elsewhere.try_acquire().await.unwrap();
    assert!(other_schema.is_some(), "another schema elects on its own");
    let other_name = one
        .leader_lock("reports")
        .unwrap()
        .try_acquire()
        .await
        .unwrap();
    assert!(other_name.is_some(), "another name is another lock");

    // The holder's session is terminated (as when its process dies): it finds out at its
    // next check, and the lock is free for another session.
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(held.session())
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(terminated);
    assert!(
        !a.is_held(&mut held).await.unwrap_or(false),
        "the check sees it"
    );
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut taken = loop {
        if let Some(h) = b.try_acquire().await.unwrap() {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "the lock stayed taken after the session ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(b.is_held(&mut taken).await.unwrap());
    b.release(taken).await.unwrap();
    let again = a.try_acquire().await.unwrap();
    assert!(again.is_some(), "free again after release");
    drop((again, other_schema, other_name));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA {s1} CASCADE; DROP SCHEMA {s2} CASCADE"
    )))
    .execute(&admin)
    .await
    .unwrap();
}
