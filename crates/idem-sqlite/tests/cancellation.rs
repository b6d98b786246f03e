//! An effect may time out one of its own statements (`tokio::time::timeout` around

#![allow(clippy::unwrap_used)] // test setup: fail loudly
//! `SqliteTx::run`). The protocol must then roll back and report the effect's error, not
//! panic, and the pool must stay usable.

use std::time::Duration;

use idem_core::{Error, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use idem_sqlite::SqliteBackend;

#[derive(Debug, thiserror::Error)]
#[error("the statement timed out")]
struct TimedOut;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_statement_in_an_effect_rolls_back_cleanly() {
    let dir = std::env::temp_dir().join(format!("idem-cancel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}/cancel.db", dir.display());
    let backend = SqliteBackend::connect(&url).await.unwrap();
    let idem = Idem::new(backend.clone());
    idem.migrate().await.unwrap();
    backend
        .interact(|c| c.execute_batch("CREATE TABLE t (n INTEGER)"))
        .await
        .unwrap();

    let scope = Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    );
    let key = Key::new("k").unwrap();
    let request = Request::new(serde_json::json!({}));
    let out = idem
        .execute(&scope, &key, &request, |tx| {
            Box::pin(async move {
                let slow = tx.run(|c| {
                    c.execute("INSERT INTO t VALUES (1)", []).unwrap();
                    std::thread::sleep(Duration::from_millis(1000));
                });
                tokio::time::timeout(Duration::from_millis(20), slow)
                    .await
                    .map_err(|_| TimedOut)?;
                Ok::<_, TimedOut>(1)
            })
        })
        .await;
    assert!(matches!(out, Err(Error::Effect(TimedOut))), "{out:?}");

    // Nothing of the effect stayed, and the key and the pool work again.
    let rows: i64 = backend
        .interact(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)))
        .await
        .unwrap();
    assert_eq!(rows, 0, "the timed-out effect's insert must roll back");
    let out = idem
        .execute(&scope, &key, &request, |_| {
            Box::pin(async { Ok::<_, TimedOut>(2) })
        })
        .await;
    assert!(matches!(out, Ok(Outcome::Executed(2))), "{out:?}");
    std::fs::remove_dir_all(&dir).ok();
}
