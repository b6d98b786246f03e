//! What only SQLite does for phased runs and the outbox: the run transaction's bounded
//! wait for the database's write lock (the connection's own busy timeout given back),
//! and an in-memory database's single connection. What every engine must do is in the
//! conformance suite (`idem-conformance`, run by `tests/sqlite.rs`).

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::path::PathBuf;
use std::time::Duration;

use idem_core::runs::{NewRun, STARTED};
use idem_core::{ErrorKind, Key, Maintenance, Operation, Principal, RunStore, Scope};
use idem_sqlite::{Location, SqliteBackend, SqliteOptions};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh database file (and its WAL files) removed on drop.
struct TempDb(PathBuf);

impl TempDb {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("idem-sqlite-runs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.db"));
        let db = Self(path);
        db.remove();
        db
    }

    fn remove(&self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut name = self.0.clone().into_os_string();
            name.push(suffix);
            let _ = std::fs::remove_file(name);
        }
    }

    async fn backend(&self, connections: usize) -> SqliteBackend {
        let options = SqliteOptions::default()
            .max_connections(connections)
            .busy_timeout(BUSY_TIMEOUT);
        let backend = SqliteBackend::open_with_options(Location::File(self.0.clone()), options)
            .await
            .unwrap();
        backend.migrate().await.unwrap();
        backend
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        self.remove();
        // The directory goes with the last test's file (a no-op while others use it).
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("order", 1).unwrap(),
    )
}

fn key(k: &str) -> Key {
    Key::new(k).unwrap()
}

fn new_run<'a>(owner: &'a str, lease: Duration, retention: Duration) -> NewRun<'a> {
    NewRun {
        request: r#"{"amount":100}"#,
        owner,
        fence: 0,
        point: STARTED,
        lease,
        retention,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_begin_waits_for_the_write_lock_at_most_its_bound() {
    let db = TempDb::new("bounded");
    // One pooled connection, so the busy timeout read afterwards is the one that waited.
    let backend = db.backend(1).await;
    // Another process's writer, holding the write lock.
    let other = idem_sqlite::rusqlite::Connection::open(&db.0).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();

    let err = tokio::time::timeout(
        HANG_GUARD,
        backend.begin_runs(Some(Duration::from_millis(50))),
    )
    .await
    .expect("the wait is bounded")
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    assert!(err.kind().is_retryable());

    // The connection has its configured busy timeout back.
    let busy_ms: i64 = backend
        .interact(|c| c.query_row("PRAGMA busy_timeout", [], |r| r.get(0)))
        .await
        .unwrap();
    assert_eq!(busy_ms, 5000);

    other.execute_batch("ROLLBACK").unwrap();
    let tx = backend
        .begin_runs(Some(Duration::from_millis(50)))
        .await
        .unwrap();
    backend.commit_runs(tx).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_memory_run_transaction_refuses_a_nested_one_instead_of_hanging() {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    backend.migrate().await.unwrap();
    // In a task of its own, as a request handler runs (the holder is known by task).
    let task = backend.clone();
    tokio::spawn(async move {
        let backend = task;
        let mut tx = backend.begin_runs(None).await.unwrap();
        backend
            .insert_run(&mut tx, &scope(), &key("m"), &new_run("o", HOUR, HOUR))
            .await
            .unwrap();
        // The same task: its only connection is this transaction.
        let nested = tokio::time::timeout(HANG_GUARD, backend.begin_runs(None))
            .await
            .expect("refused at once")
            .unwrap_err();
        assert_eq!(nested.kind(), ErrorKind::Configuration, "{nested}");
        // Another task waits at most its bound.
        let other = backend.clone();
        let waited = tokio::spawn(async move {
            other
                .begin_runs(Some(Duration::from_millis(50)))
                .await
                .map(drop)
        })
        .await
        .unwrap()
        .unwrap_err();
        assert_eq!(waited.kind(), ErrorKind::Busy, "{waited}");
        // Phases run their SQL on the run transaction.
        let n: i64 = tx
            .run(|c| c.query_row("SELECT count(*) FROM idem_run", [], |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(n, 1);
        backend.commit_runs(tx).await.unwrap();
    })
    .await
    .unwrap();
    // Committed, and the connection is free again.
    let mut tx = backend.begin_runs(None).await.unwrap();
    assert!(
        backend
            .read_run(&mut tx, &scope(), &key("m"))
            .await
            .unwrap()
            .is_some()
    );
    backend.rollback_runs(tx).await.unwrap();
}
