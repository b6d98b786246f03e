//! Engine traps on a live MySQL/MariaDB (`IDEM_MYSQL_URL`, default the local server;
//! fails if unreachable): lookups pinned to READ COMMITTED, payloads above
//! `max_allowed_packet`, JSON text kept byte for byte.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

#[allow(dead_code)] // shared helpers: this file does not use every one
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{Error, ErrorKind, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use idem_mysql::MysqlBackend;
use idem_mysql::mysql_async::prelude::Queryable;
use idem_mysql::mysql_async::{self, OptsBuilder, Row};

use common::PrivateDb;

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn scope() -> Scope {
    Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_uncommitted_session_never_replays_an_uncommitted_winner() {
    let db = PrivateDb::create("ru").await;
    // A second backend on the same database whose sessions default to READ UNCOMMITTED.
    let opts = OptsBuilder::from_opts(idem_mysql::parse_url(&common::url()).unwrap())
        .db_name(Some(&db.name))
        .setup(vec![
            "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
        ]);
    let dirty = MysqlBackend::connect_with(opts).await.unwrap();
    {
        let mut conn = dirty.pool().get_conn().await.unwrap();
        let level: Option<String> = conn
            .query_first("SELECT @@SESSION.tx_isolation")
            .await
            .unwrap_or(None); // MySQL 8.4 spells it transaction_isolation
        if let Some(level) = level {
            assert_eq!(level, "READ-UNCOMMITTED", "the fixture's session level");
        }
    }

    let winner_idem = Idem::new(db.backend.clone());
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let mut signals = Some((started_tx, release_rx));
    let winner = tokio::spawn(async move {
        winner_idem
            .execute(
                &scope(),
                &Key::new("k").unwrap(),
                &Request::new(serde_json::json!({"n": 1})),
                move |_tx| {
                    let signals = signals.take();
                    Box::pin(async move {
                        if let Some((started, release)) = signals {
                            let _ = started.send(());
                            let _ = tokio::time::timeout(HANG_GUARD, release).await;
                        }
                        Ok::<_, mysql_async::Error>(7)
                    })
                },
            )
            .await
    });
    tokio::time::timeout(HANG_GUARD, started_rx)
        .await
        .unwrap()
        .unwrap();

    // The fast path must not see the winner's uncommitted placeholder (it would be a
    // CorruptRecord error, or a replay of nothing); the claim then waits and answers
    // InProgress.
    let loser = Idem::new(dirty.clone()).with_wait_timeout(Duration::from_millis(300));
    let out = tokio::time::timeout(
        HANG_GUARD,
        loser.execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |_tx| Box::pin(async { Ok::<_, mysql_async::Error>(8) }),
        ),
    )
    .await
    .unwrap();
    assert!(
        matches!(out, Err(Error::InProgress { .. })),
        "a READ UNCOMMITTED session must not see an uncommitted winner: {out:?}"
    );
    let _ = release_tx.send(());
    let won = winner.await.unwrap();
    assert!(matches!(won, Ok(Outcome::Executed(7))), "{won:?}");
    let again = loser
        .execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |_tx| Box::pin(async { Ok::<_, mysql_async::Error>(8) }),
        )
        .await;
    assert!(matches!(again, Ok(Outcome::Replayed(7))), "{again:?}");
    dirty.disconnect().await.unwrap();
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_above_max_allowed_packet_is_a_non_retried_input_error() {
    let db = PrivateDb::create("packet").await;
    let max = u64::try_from(db.scalar("SELECT @@max_allowed_packet").await).unwrap();
    // The core's own size limit (1 MiB by default) would refuse this request first; lift
    // it so the server's limit is what this test meets.
    let idem = Idem::new(db.backend.clone()).with_max_request_bytes(usize::MAX);
    let runs = Arc::new(AtomicUsize::new(0));
    let big = "x".repeat(usize::try_from(max).unwrap() + 1024);
    let request = Request::new(serde_json::json!({ "blob": big }));
    let counted = Arc::clone(&runs);
    let out = tokio::time::timeout(
        HANG_GUARD,
        idem.execute(&scope(), &Key::new("big").unwrap(), &request, move |_tx| {
            counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok::<_, mysql_async::Error>(1) })
        }),
    )
    .await
    .expect("a payload above max_allowed_packet must not be retried in a loop");
    match out {
        Err(Error::Backend(e)) => {
            assert_eq!(e.kind(), ErrorKind::Other, "{e}");
            assert!(!e.kind().is_retryable(), "{e}");
            assert!(
                e.to_string().contains("max_allowed_packet"),
                "the error names the setting: {e}"
            );
            assert!(e.to_string().contains(&max.to_string()), "{e}");
        }
        other => panic!("expected a non-retried backend error, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the effect never ran");
    // The pool still works.
    let small = idem
        .execute(
            &scope(),
            &Key::new("small").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |_tx| Box::pin(async { Ok::<_, mysql_async::Error>(2) }),
        )
        .await;
    assert!(matches!(small, Ok(Outcome::Executed(2))), "{small:?}");
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        1
    );
    db.drop_database().await;
}

#[tokio::test]
async fn json_text_is_stored_byte_for_byte() {
    let db = PrivateDb::create("exact").await;
    let idem = Idem::new(db.backend.clone());
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
                Box::pin(async move { Ok::<_, mysql_async::Error>(value) })
            }
        })
        .await
        .unwrap();
    assert!(!out.is_replayed());
    let mut conn = db.backend.pool().get_conn().await.unwrap();
    let row: Row = conn
        .query_first("SELECT request, response FROM idem_request_result")
        .await
        .unwrap()
        .unwrap();
    drop(conn);
    let (stored_request, stored_response): (String, String) = mysql_async::from_row(row);
    assert_eq!(stored_request, request.to_json(), "the request's text");
    assert_eq!(
        stored_response,
        serde_json::to_string(&value).unwrap(),
        "the response's text"
    );
    // Replaying this request exactly also needs idem-core's exact float parsing
    // (serde_json's float_roundtrip); what the engine owes is the verbatim text above.
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_lock_wait_bound_does_not_apply_to_the_effect() {
    let db = PrivateDb::create("lockwait").await;
    db.exec("CREATE TABLE t (id INT PRIMARY KEY, n INT) ENGINE = InnoDB")
        .await;
    db.exec("INSERT INTO t VALUES (1, 0)").await;
    // Another session holds the row the effect updates for longer than the claim's
    // bound (1 s, the server's minimum), then commits.
    let mut holder = db.backend.pool().get_conn().await.unwrap();
    holder.query_drop("START TRANSACTION").await.unwrap();
    holder
        .query_drop("UPDATE t SET n = n + 1 WHERE id = 1")
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        holder.query_drop("COMMIT").await.unwrap();
        drop(holder);
    });
    // One attempt: a lock wait timeout in the effect would not be hidden by a retry.
    let idem = Idem::new(db.backend.clone())
        .with_wait_timeout(Duration::from_millis(100))
        .with_retry(idem_core::RetryPolicy {
            max_attempts: 1,
            ..idem_core::RetryPolicy::default()
        });
    let out = tokio::time::timeout(
        HANG_GUARD,
        idem.execute(
            &scope(),
            &Key::new("k").unwrap(),
            &Request::new(serde_json::json!({"n": 1})),
            |tx| {
                Box::pin(async move {
                    tx.query_drop("UPDATE t SET n = n + 1 WHERE id = 1").await?;
                    let n: Option<i64> = tx.query_first("SELECT n FROM t WHERE id = 1").await?;
                    Ok::<_, mysql_async::Error>(n.unwrap_or(-1))
                })
            },
        ),
    )
    .await
    .unwrap();
    assert!(
        matches!(out, Ok(Outcome::Executed(2))),
        "the effect waits with the session's innodb_lock_wait_timeout, not the claim's: {out:?}"
    );
    release.await.unwrap();
    db.drop_database().await;
}
