//! A purge that meets a busy database retries the batch under the retry policy instead of
//! stopping at the first `SQLITE_BUSY`. Another connection holds the write lock for a
//! while; the backend's busy timeout is much shorter than that, so each DELETE gives up
//! with `SQLITE_BUSY` until the lock is released.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::time::Duration;

use idem_core::{Idem, Key, Operation, Principal, Request, RetryPolicy, Scope};
use idem_sqlite::{Location, SqliteBackend};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_purge_batch_is_retried() {
    let dir = std::env::temp_dir().join(format!("idem-purge-retry-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("purge.db");
    let _ = std::fs::remove_file(&path);
    let backend =
        SqliteBackend::open_with(Location::File(path.clone()), 4, Duration::from_millis(20))
            .await
            .unwrap();
    let idem = Idem::new(backend.clone()).with_retry(RetryPolicy {
        max_attempts: 50,
        base_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(100),
    });
    idem.migrate().await.unwrap();

    // One record that is already expired (1 s retention, then wait it out).
    let scope = Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1)
            .unwrap()
            .with_retention(Duration::from_secs(1)),
    );
    idem.execute(
        &scope,
        &Key::new("k").unwrap(),
        &Request::new(serde_json::json!({})),
        |_tx| Box::pin(async { Ok::<_, std::io::Error>(1) }),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // Another process-like connection takes the write lock and keeps it for a while.
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let c = idem_sqlite::rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("BEGIN IMMEDIATE").unwrap();
        locked_tx.send(()).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        c.execute_batch("COMMIT").unwrap();
    });
    locked_rx.recv().unwrap();

    let report = tokio::time::timeout(Duration::from_secs(60), idem.purge(Duration::ZERO, 100))
        .await
        .expect("hang guard")
        .expect("the purge outlasts the lock");
    holder.join().unwrap();
    assert_eq!(report.requests, 1, "{report:?}");
    assert!(
        report.retried >= 1,
        "the first batch met the held lock and was retried: {report:?}"
    );
    let left: i64 = backend
        .interact(|c| c.query_row("SELECT count(*) FROM idem_request_result", [], |r| r.get(0)))
        .await
        .unwrap();
    assert_eq!(left, 0);
    std::fs::remove_dir_all(&dir).ok();
}
