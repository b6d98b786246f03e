//! The key-lock claim (`ClaimStyle::KeyLock`, the default on a single server), live
//! (`IDEM_POSTGRES_URL`, default the local server; fails if unreachable): what its lock
//! and its one-message completion promise beyond the conformance suite. Each test works
//! in schemas of its own and drops them.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{Error, Idem, Key, Maintenance, Operation, Outcome, Principal, Request, Scope};
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use idem_postgres::{ClaimStyle, PgBackend, sqlx};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

async fn admin() -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect_with(PgConnectOptions::from_str(&url()).unwrap())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {} (set IDEM_POSTGRES_URL): {e}", url()))
}

/// A migrated backend on a new schema `idem_t_keylock_<name>_<pid>`.
async fn schema(admin: &PgPool, name: &str) -> (PgBackend, String) {
    let schema = format!("idem_t_keylock_{name}_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
    )))
    .execute(admin)
    .await
    .unwrap();
    let options = PgConnectOptions::from_str(&url())
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let backend = PgBackend::connect_with(options, 8)
        .await
        .unwrap()
        .with_claim_style(ClaimStyle::KeyLock);
    backend.migrate().await.unwrap();
    (backend, schema)
}

async fn drop_schema(admin: &PgPool, backend: PgBackend, schema: &str) {
    backend.pool().close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(admin)
        .await
        .unwrap();
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    )
}

/// The same key in idem's tables of two schemas: a call holding it in one schema does
/// not hold up the other (the lock's name carries the table's OID).
#[tokio::test]
async fn the_same_key_in_two_schemas_never_waits() {
    let admin = admin().await;
    let (one, one_schema) = schema(&admin, "one").await;
    let (two, two_schema) = schema(&admin, "two").await;
    let key = Key::new("shared").unwrap();
    let request = Request::new(serde_json::json!({"n": 1}));
    let (held_tx, held_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let idem = Idem::new(one.clone());
        let (key, request) = (key.clone(), request.clone());
        let mut signals = Some((held_tx, release_rx));
        tokio::spawn(async move {
            idem.execute(&scope(), &key, &request, move |_tx| {
                let signals = signals.take();
                Box::pin(async move {
                    if let Some((held, release)) = signals {
                        let _ = held.send(());
                        let _ = tokio::time::timeout(HANG_GUARD, release).await;
                    }
                    Ok::<_, sqlx::Error>(1_i64)
                })
            })
            .await
        })
    };
    held_rx.await.unwrap();
    // A bound far below the holder's time: waiting on the other schema's lock would
    // answer InProgress.
    let other = Idem::new(two.clone())
        .with_wait_timeout(Duration::from_millis(200))
        .execute(&scope(), &key, &request, |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(2_i64) })
        })
        .await;
    assert!(
        matches!(other, Ok(Outcome::Executed(2))),
        "the other schema's call: {other:?}"
    );
    release_tx.send(()).unwrap();
    let held = holder.await.unwrap();
    assert!(matches!(held, Ok(Outcome::Executed(1))), "{held:?}");
    drop_schema(&admin, one, &one_schema).await;
    drop_schema(&admin, two, &two_schema).await;
    admin.close().await;
}

/// Runs one call with key `k` whose effect, the first time only, has another session
/// (no key lock) run `meanwhile` and commit; `setup` runs before the call. The
/// completion's guard must stop the COMMIT: the effect's writes roll back, and the retry
/// replays `expected` without running the effect again.
async fn a_foreign_write_meanwhile_replays(
    name: &str,
    setup: &'static str,
    meanwhile: &'static str,
    expected: i64,
) {
    let admin = admin().await;
    let (backend, schema_name) = schema(&admin, name).await;
    sqlx::raw_sql(setup).execute(backend.pool()).await.unwrap();
    let writer = backend.pool().clone();
    let runs = Arc::new(AtomicUsize::new(0));
    let out = Idem::new(backend.clone())
        .execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            {
                let runs = Arc::clone(&runs);
                move |tx| {
                    let (writer, first) =
                        (writer.clone(), runs.fetch_add(1, Ordering::SeqCst) == 0);
                    Box::pin(async move {
                        sqlx::query("INSERT INTO effects VALUES (1)")
                            .execute(&mut **tx)
                            .await?;
                        if first {
                            sqlx::query(meanwhile).execute(&writer).await?;
                        }
                        Ok::<_, sqlx::Error>(1_i64)
                    })
                }
            },
        )
        .await;
    assert!(
        matches!(out, Ok(Outcome::Replayed(n)) if n == expected),
        "{out:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the retry replays without the effect"
    );
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(backend.pool())
        .await
        .unwrap();
    assert_eq!(
        effects, 0,
        "the effect's writes rolled back with the refused completion"
    );
    drop_schema(&admin, backend, &schema_name).await;
    admin.close().await;
}

/// A record of the key committed meanwhile by a session that takes no key lock (SQL of
/// the application's own, or an idem claiming with a placeholder): the completion's
/// `INSERT` meets it (23505), and the retry replays that record.
#[tokio::test]
async fn a_record_written_without_the_lock_wins_and_replays() {
    a_foreign_write_meanwhile_replays(
        "foreign",
        "CREATE TABLE effects (n int)",
        "INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
         VALUES ('p', 'op:v1', 'k', '{\"n\":1}', '7', 0, now(), now() + interval '1 day')",
        7,
    )
    .await;
}

/// The same on the replacing path: the claim found the key's record expired, and while
/// the effect ran another session (no key lock) renewed it, live. The completion's
/// `ON CONFLICT DO UPDATE` refuses to overwrite a live record (without touching a key
/// column, which the least-privilege writer may not update), and the retry replays the
/// renewed record.
#[tokio::test]
async fn an_expired_record_renewed_meanwhile_is_not_overwritten() {
    a_foreign_write_meanwhile_replays(
        "renewed",
        "CREATE TABLE effects (n int); \
         INSERT INTO idem_request_result (principal, operation, request_key, request, response, status, created_at, expires_at) \
         VALUES ('p', 'op:v1', 'k', '{\"n\":1}', '5', 0, now() - interval '2 days', now() - interval '1 day')",
        "UPDATE idem_request_result SET response = '8', created_at = now(), \
         expires_at = now() + interval '1 day' WHERE request_key = 'k'",
        8,
    )
    .await;
}

/// The lock and the claim's settings end with the transaction: a call right after a
/// failed effect takes the key at once, and a session handed out again by the pool
/// holds no advisory lock and no idem setting.
#[tokio::test]
async fn nothing_of_a_claim_outlives_its_transaction() {
    let admin = admin().await;
    let (backend, name) = schema(&admin, "ends").await;
    let idem = Idem::new(backend.clone()).with_wait_timeout(Duration::from_millis(200));
    let key = Key::new("k").unwrap();
    let request = Request::new(serde_json::json!({"n": 1}));
    let failed = idem
        .execute(&scope(), &key, &request, |_tx| {
            Box::pin(async { Err::<i64, _>(sqlx::Error::RowNotFound) })
        })
        .await;
    assert!(matches!(failed, Err(Error::Effect(_))), "{failed:?}");
    let again = idem
        .execute(&scope(), &key, &request, |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(3_i64) })
        })
        .await;
    assert!(matches!(again, Ok(Outcome::Executed(3))), "{again:?}");
    let replay = idem
        .execute(&scope(), &key, &request, |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(4_i64) })
        })
        .await;
    assert!(matches!(replay, Ok(Outcome::Replayed(3))), "{replay:?}");
    // Every pooled session, as the next user gets it.
    let mut conns = Vec::new();
    for _ in 0..backend.pool().size() {
        conns.push(backend.pool().acquire().await.unwrap());
    }
    for conn in &mut conns {
        let (locks, claimed): (i64, Option<String>) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()), \
             NULLIF(current_setting('idem.claimed_at', true), '')",
        )
        .fetch_one(&mut **conn)
        .await
        .unwrap();
        assert_eq!(locks, 0, "no advisory lock left on a pooled session");
        assert_eq!(claimed, None, "no claim time left on a pooled session");
        // `SAVEPOINT` is refused outside a transaction block (25P01).
        let err = sqlx::query("SAVEPOINT probe")
            .execute(&mut **conn)
            .await
            .unwrap_err();
        assert_eq!(
            err.as_database_error().and_then(|d| d.code()).as_deref(),
            Some("25P01"),
            "a pooled session is outside any transaction: {err}"
        );
    }
    drop(conns);
    drop_schema(&admin, backend, &name).await;
    admin.close().await;
}

/// A session whose prepared completion was deallocated behind idem's back (a `DEALLOCATE`
/// of its name; `DEALLOCATE ALL` would take sqlx's own statements too, and `DISCARD ALL`
/// also forgets the name): the completion fails before its COMMIT, the retry prepares it
/// again, and the effect commits once.
#[tokio::test]
async fn a_deallocated_completion_is_prepared_again() {
    let admin = admin().await;
    let (backend, name) = schema(&admin, "dealloc").await;
    let options = PgConnectOptions::from_str(&url())
        .unwrap()
        .options([("search_path", name.as_str())]);
    // One connection, so the second call runs on the session the first prepared on.
    let one = PgBackend::connect_with(options, 1)
        .await
        .unwrap()
        .with_claim_style(ClaimStyle::KeyLock);
    sqlx::raw_sql("CREATE TABLE effects (n int)")
        .execute(one.pool())
        .await
        .unwrap();
    let idem = Idem::new(one.clone());
    let request = Request::new(serde_json::json!({"n": 1}));
    let first = idem
        .execute(&scope(), &Key::new("a").unwrap(), &request, |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(1_i64) })
        })
        .await;
    assert!(matches!(first, Ok(Outcome::Executed(1))), "{first:?}");
    let runs = Arc::new(AtomicUsize::new(0));
    let second = idem
        .execute(&scope(), &Key::new("b").unwrap(), &request, {
            let runs = Arc::clone(&runs);
            move |tx| {
                let first = runs.fetch_add(1, Ordering::SeqCst) == 0;
                Box::pin(async move {
                    sqlx::query("INSERT INTO effects VALUES (1)")
                        .execute(&mut **tx)
                        .await?;
                    if first {
                        let name: String =
                            sqlx::query_scalar("SELECT current_setting('idem.complete_request')")
                                .fetch_one(&mut **tx)
                                .await?;
                        assert!(name.starts_with("idem_cr_"), "{name}");
                        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DEALLOCATE {name}")))
                            .execute(&mut **tx)
                            .await?;
                    }
                    Ok::<_, sqlx::Error>(2_i64)
                })
            }
        })
        .await;
    assert!(matches!(second, Ok(Outcome::Executed(2))), "{second:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the retry ran the effect again"
    );
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(one.pool())
        .await
        .unwrap();
    assert_eq!(effects, 1, "the failed attempt's effect rolled back");
    one.pool().close().await;
    drop_schema(&admin, backend, &name).await;
    admin.close().await;
}
