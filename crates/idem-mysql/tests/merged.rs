//! MariaDB's merged messages, live (`IDEM_MYSQL_URL`, default the local server; fails if
//! unreachable): values inlined as hex literals round-trip byte for byte and compare
//! equal to the same values bound as parameters; the hex form's size is refused before
//! any SQL; and a transaction idem opened never goes back to the pool open (a dropped
//! `MysqlTx`, a cancelled `execute`).

#![allow(clippy::unwrap_used)] // test setup: fail loudly

#[allow(dead_code)] // shared helpers: this file does not use every one
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    Consumed, Error, ErrorKind, Idem, Key, MessageId, Operation, Outcome, PoolOptions, Principal,
    Request, RunStore, Scope, Subscriber,
};
use idem_mysql::MysqlBackend;
use idem_mysql::mysql_async::prelude::Queryable;
use idem_mysql::mysql_async::{self, OptsBuilder, Row};

use common::PrivateDb;

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

/// Text that would break a statement if it were ever quoted or escaped by hand.
const HOSTILE: [&str; 6] = [
    "it's",
    "back\\slash\\",
    "*/ -- ; DROP TABLE idem_request_result; /*",
    "\"double\" `tick` %_",
    "é 漢字 🦀 \u{200b}",
    "trailing space ",
];

async fn is_mariadb(db: &PrivateDb) -> bool {
    let mut conn = db.backend.pool().get_conn().await.unwrap();
    let version: Option<String> = conn.query_first("SELECT @@version").await.unwrap();
    version.unwrap_or_default().contains("MariaDB")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_values_round_trip_byte_for_byte_and_compare_equal() {
    let db = PrivateDb::create("hexlit").await;
    let idem = Idem::new(db.backend.clone());
    for (i, text) in HOSTILE.iter().enumerate() {
        let scope = Scope::new(
            Principal::new(format!("p-{text}")).unwrap(),
            Operation::new("op", 1).unwrap(),
        );
        let key = Key::new(format!("k{i}-{text}")).unwrap();
        let request = Request::new(serde_json::json!({ "text": text }));
        let response = serde_json::json!({ "echo": text, "empty": "" });
        let answer = response.clone();
        let first = idem
            .execute(&scope, &key, &request, move |_tx| {
                let answer = answer.clone();
                Box::pin(async move { Ok::<_, mysql_async::Error>(answer) })
            })
            .await;
        assert!(
            matches!(first, Ok(Outcome::Executed(_))),
            "{text:?}: {first:?}"
        );
        // The replay's lookup binds the key as parameters: it finds the row the claim
        // inserted with hex literals, and returns the response byte for byte.
        let again = idem
            .execute(&scope, &key, &request, |_tx| {
                Box::pin(async { Ok::<_, mysql_async::Error>(serde_json::json!("ran twice")) })
            })
            .await;
        match again {
            Ok(Outcome::Replayed(v)) => assert_eq!(v, response, "{text:?}"),
            other => panic!("{text:?}: expected a replay, got {other:?}"),
        }
        // Every column compares equal to the same values bound as parameters.
        let mut conn = db.backend.pool().get_conn().await.unwrap();
        let row: Option<Row> = conn
            .exec_first(
                "SELECT request, response, HEX(request_key) FROM idem_request_result \
                 WHERE principal = ? AND operation = ? AND request_key = ?",
                (
                    scope.principal.as_str().as_bytes(),
                    scope.operation.as_str().as_bytes(),
                    key.as_str().as_bytes(),
                ),
            )
            .await
            .unwrap();
        let mut row = row.unwrap_or_else(|| panic!("{text:?}: no row for the bound key"));
        let stored_request: String = row.take(0).unwrap();
        let stored_response: String = row.take(1).unwrap();
        let key_hex: String = row.take(2).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&stored_request).unwrap(),
            serde_json::json!({ "text": text })
        );
        assert!(stored_request.contains(&serde_json::to_string(text).unwrap()));
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&stored_response).unwrap(),
            response
        );
        let expected_hex: String = key.as_str().bytes().map(|b| format!("{b:02X}")).collect();
        assert_eq!(key_hex, expected_hex, "{text:?}: the key's bytes");
    }
    // A consumer's message record: the same, for the subscriber and message id.
    let sub = Subscriber::new("sub-it's \\ */").unwrap();
    let id = MessageId::new("m-é-'").unwrap();
    let consumed = idem
        .consume(&sub, &id, None, |_tx| {
            Box::pin(async { Ok::<_, mysql_async::Error>(()) })
        })
        .await;
    assert!(
        matches!(consumed, Ok(Consumed::Applied(()))),
        "{consumed:?}"
    );
    let again = idem
        .consume(&sub, &id, None, |_tx| {
            Box::pin(async { Ok::<_, mysql_async::Error>(()) })
        })
        .await;
    assert!(matches!(again, Ok(Consumed::Duplicate)), "{again:?}");
    assert_eq!(
        db.scalar(&format!(
            "SELECT COUNT(*) FROM idem_processed_message WHERE subscriber = X'{}' \
             AND message_id = X'{}'",
            hex(sub.as_str()),
            hex(id.as_str())
        ))
        .await,
        1
    );
    // Nothing was injected: the tables are all still there, with only idem's rows.
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        i64::try_from(HOSTILE.len()).unwrap()
    );
    drop(idem);
    db.drop_database().await;
}

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02X}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_whose_hex_form_exceeds_max_allowed_packet_is_refused_before_any_sql() {
    let db = PrivateDb::create("hexpacket").await;
    if !is_mariadb(&db).await {
        // MySQL binds the payload: its own limit is checked by mysql_traps.rs.
        db.drop_database().await;
        return;
    }
    let max = u64::try_from(db.scalar("SELECT @@max_allowed_packet").await).unwrap();
    let idem = Idem::new(db.backend.clone()).with_max_request_bytes(usize::MAX);
    let runs = Arc::new(AtomicUsize::new(0));
    // Fits as bytes, not as hex.
    let big = "x".repeat(usize::try_from(max / 2).unwrap() + 64);
    let request = Request::new(serde_json::json!({ "blob": big }));
    let counted = Arc::clone(&runs);
    let out = tokio::time::timeout(
        HANG_GUARD,
        idem.execute(
            &Scope::new(
                Principal::new("p").unwrap(),
                Operation::new("op", 1).unwrap(),
            ),
            &Key::new("half").unwrap(),
            &request,
            move |_tx| {
                counted.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok::<_, mysql_async::Error>(1) })
            },
        ),
    )
    .await
    .expect("not retried in a loop");
    match out {
        Err(Error::Backend(e)) => {
            assert_eq!(e.kind(), ErrorKind::Other, "{e}");
            assert_eq!(e.code(), Some("1153"), "{e}");
            let text = e.to_string();
            assert!(
                text.contains("max_allowed_packet") && text.contains("hex"),
                "{e}"
            );
        }
        other => panic!("expected a non-retried backend error, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the effect never ran");
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        0
    );
    drop(idem);
    db.drop_database().await;
}

/// A backend on the private database whose pool holds one connection, so the next
/// checkout is the connection the last transaction used.
async fn one_connection(db: &PrivateDb) -> MysqlBackend {
    let opts = OptsBuilder::from_opts(idem_mysql::parse_url(&common::url()).unwrap())
        .db_name(Some(&db.name));
    MysqlBackend::connect_pooled(opts, PoolOptions::new(1))
        .await
        .unwrap()
}

/// The connection's id, whether it is inside a transaction, and the rows of `t`.
async fn state(backend: &MysqlBackend) -> (u64, i64, i64) {
    let mut conn = tokio::time::timeout(HANG_GUARD, backend.pool().get_conn())
        .await
        .expect("the connection came back to the pool")
        .unwrap();
    let row: Option<(u64, i64, i64)> = conn
        .query_first("SELECT CONNECTION_ID(), @@in_transaction, (SELECT COUNT(*) FROM t)")
        .await
        .unwrap();
    row.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_open_transaction_is_rolled_back_before_the_connection_is_reused() {
    let db = PrivateDb::create("droptx").await;
    db.exec("CREATE TABLE t (id INT PRIMARY KEY) ENGINE = InnoDB")
        .await;
    let backend = one_connection(&db).await;
    let (before, in_tx, rows) = state(&backend).await;
    assert_eq!((in_tx, rows), (0, 0));

    // A run transaction (the public way to hold a MysqlTx), written to, then dropped.
    let mut tx = backend.begin_runs(None).await.unwrap();
    tx.query_drop("INSERT INTO t VALUES (1)").await.unwrap();
    let open: Option<i64> = tx
        .conn()
        .query_first("SELECT @@in_transaction")
        .await
        .unwrap();
    assert_eq!(open, Some(1), "the write is inside idem's transaction");
    drop(tx);
    let (after, in_tx, rows) = state(&backend).await;
    assert_eq!(after, before, "the same connection, reused");
    assert_eq!(in_tx, 0, "handed out outside any transaction");
    assert_eq!(rows, 0, "the dropped transaction's write is gone");

    // An execute cancelled in the middle of its effect.
    let idem = Idem::new(backend.clone());
    let scope = Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    );
    let cancelled = tokio::time::timeout(
        Duration::from_millis(500),
        idem.execute(
            &scope,
            &Key::new("cancelled").unwrap(),
            &Request::new(serde_json::json!({})),
            |tx| {
                Box::pin(async move {
                    tx.query_drop("INSERT INTO t VALUES (2)").await?;
                    // Hangs until the caller gives up.
                    std::future::pending::<()>().await;
                    Ok::<_, mysql_async::Error>(1)
                })
            },
        ),
    )
    .await;
    assert!(
        cancelled.is_err(),
        "the effect was cancelled: {cancelled:?}"
    );
    let (after, in_tx, rows) = state(&backend).await;
    assert_eq!(after, before, "the same connection, reused");
    assert_eq!(in_tx, 0, "handed out outside any transaction");
    assert_eq!(rows, 0, "the cancelled effect's write is gone");
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        0,
        "and so is the claim"
    );
    // The key is free again: an honest effect commits once.
    let out = idem
        .execute(
            &scope,
            &Key::new("cancelled").unwrap(),
            &Request::new(serde_json::json!({})),
            |tx| {
                Box::pin(async move {
                    tx.query_drop("INSERT INTO t VALUES (3)").await?;
                    tx.query_drop("SET @idem_probe = 3").await?;
                    Ok::<_, mysql_async::Error>(3)
                })
            },
        )
        .await;
    assert!(matches!(out, Ok(Outcome::Executed(3))), "{out:?}");
    let (_, in_tx, rows) = state(&backend).await;
    assert_eq!((in_tx, rows), (0, 1));
    // The reset was for the dropped transactions only (mysql_async gives every checkout
    // its pool's setting back): the next transaction's connection went back to the pool
    // without one (this pool resets nothing), so what its effect left is still there.
    let mut conn = backend.pool().get_conn().await.unwrap();
    let probe: Option<Option<i64>> = conn.query_first("SELECT @idem_probe").await.unwrap();
    assert_eq!(
        probe,
        Some(Some(3)),
        "no reset after a transaction that ended"
    );
    drop(conn);
    drop(idem);
    backend.disconnect().await.unwrap();
    db.drop_database().await;
}

/// The backend error of `out`, or a panic naming what came instead.
fn backend_error<T: std::fmt::Debug>(out: Result<T, Error<mysql_async::Error>>) -> String {
    match out {
        Err(Error::Backend(e)) => {
            assert_eq!(e.kind(), ErrorKind::Other, "{e}");
            assert!(!e.kind().is_retryable(), "{e}");
            e.to_string()
        }
        other => panic!("expected a non-retried backend error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_merged_completion_refuses_with_the_same_errors_as_the_separate_checks() {
    let db = PrivateDb::create("signals").await;
    db.exec("CREATE TABLE t (id INT PRIMARY KEY) ENGINE = InnoDB")
        .await;
    let window = Duration::from_millis(1200);
    let idem = Idem::new(db.backend.clone()).with_message_retention(window);
    let scope = Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap().with_retention(window),
    );
    let request = Request::new(serde_json::json!({}));

    // The effect ends idem's transaction: nothing is completed, even in autocommit.
    let lost = idem
        .execute(&scope, &Key::new("lost").unwrap(), &request, |tx| {
            Box::pin(async move {
                tx.query_drop("ROLLBACK").await?;
                Ok::<_, mysql_async::Error>(1)
            })
        })
        .await;
    let text = backend_error(lost);
    assert!(
        text.contains("transaction ended inside the effect"),
        "{text}"
    );

    // The record expires while the effect runs.
    let expired = idem
        .execute(&scope, &Key::new("slow").unwrap(), &request, move |tx| {
            Box::pin(async move {
                tx.query_drop("INSERT INTO t VALUES (1)").await?;
                tokio::time::sleep(window + Duration::from_millis(600)).await;
                Ok::<_, mysql_async::Error>(1)
            })
        })
        .await;
    let text = backend_error(expired);
    assert!(
        text.contains("retention is shorter than the effect"),
        "{text}"
    );

    // The same for a consumer's message record.
    let sub = Subscriber::new("sub").unwrap();
    let lost = idem
        .consume(&sub, &MessageId::new("m-lost").unwrap(), None, |tx| {
            Box::pin(async move {
                tx.query_drop("ROLLBACK").await?;
                Ok::<_, mysql_async::Error>(())
            })
        })
        .await;
    let text = backend_error(lost);
    assert!(
        text.contains("transaction ended inside the effect"),
        "{text}"
    );
    let expired = idem
        .consume(&sub, &MessageId::new("m-slow").unwrap(), None, move |tx| {
            Box::pin(async move {
                tx.query_drop("INSERT INTO t VALUES (2)").await?;
                tokio::time::sleep(window + Duration::from_millis(600)).await;
                Ok::<_, mysql_async::Error>(())
            })
        })
        .await;
    let text = backend_error(expired);
    assert!(
        text.contains("retention is shorter than the effect"),
        "{text}"
    );

    // Nothing of any of them committed.
    assert_eq!(db.scalar("SELECT COUNT(*) FROM t").await, 0);
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        0
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_processed_message")
            .await,
        0
    );
    drop(idem);
    db.drop_database().await;
}
