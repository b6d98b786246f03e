//! Phased runs and the outbox, statement by statement (the `RunStore` and `OutboxStore`
//! methods called directly), on a temporary database file (and in memory).

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::path::PathBuf;
use std::time::Duration;

use idem_core::runs::{NewRun, RunWrite, STARTED};
use idem_core::{
    ErrorKind, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal, RunStore, Scope,
    Status, Table,
};
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

/// Inserts and commits a run.
async fn started(
    backend: &SqliteBackend,
    k: &str,
    owner: &str,
    lease: Duration,
    retention: Duration,
) {
    let mut tx = backend.begin_runs(None).await.unwrap();
    let inserted = backend
        .insert_run(
            &mut tx,
            &scope(),
            &key(k),
            &new_run(owner, lease, retention),
        )
        .await
        .unwrap();
    assert!(inserted, "{k} is new");
    backend.commit_runs(tx).await.unwrap();
}

fn message(destination: &str, id: &str) -> Outgoing {
    Outgoing::new(destination, id, &serde_json::json!({"m": id})).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_are_inserted_once_read_and_written_only_by_their_owner() {
    let db = TempDb::new("runs");
    let backend = db.backend(4).await;
    let (s, k) = (scope(), key("k1"));
    started(&backend, "k1", "owner-a", HOUR, HOUR).await;

    let mut tx = backend.begin_runs(None).await.unwrap();
    assert!(
        !backend
            .insert_run(&mut tx, &s, &k, &new_run("owner-b", HOUR, HOUR))
            .await
            .unwrap(),
        "the identity is taken"
    );
    let row = backend.read_run(&mut tx, &s, &k).await.unwrap().unwrap();
    assert_eq!(row.owner, "owner-a");
    assert_eq!(row.request, r#"{"amount":100}"#);
    assert_eq!((row.fence, row.point.as_str()), (0, STARTED));
    assert_eq!(
        (&row.state, row.status, &row.response),
        (&None, None, &None)
    );
    assert!(!row.lease_over && !row.expired, "{row:?}");
    assert!(
        backend
            .read_run(&mut tx, &s, &key("missing"))
            .await
            .unwrap()
            .is_none()
    );

    // A stale owner's write and delete change nothing.
    let stale = RunWrite {
        owner: "owner-b",
        fence: 1,
        point: "hijacked",
        state: Some("{}"),
        status: None,
        response: None,
        lease: HOUR,
    };
    assert!(
        !backend
            .write_run(&mut tx, &s, &k, "owner-b", &stale)
            .await
            .unwrap()
    );
    assert!(
        !backend
            .delete_run(&mut tx, &s, &k, "owner-b")
            .await
            .unwrap()
    );
    assert_eq!(
        backend.read_run(&mut tx, &s, &k).await.unwrap().unwrap(),
        row
    );

    // The owner's write, with a zero lease: the lease is over at once.
    let phase = RunWrite {
        owner: "owner-a",
        fence: 0,
        point: "order_created",
        state: Some(r#"{"order":7}"#),
        status: None,
        response: None,
        lease: Duration::ZERO,
    };
    assert!(
        backend
            .write_run(&mut tx, &s, &k, "owner-a", &phase)
            .await
            .unwrap()
    );
    backend.commit_runs(tx).await.unwrap();

    let mut tx = backend.begin_runs(None).await.unwrap();
    let row = backend.read_run(&mut tx, &s, &k).await.unwrap().unwrap();
    assert_eq!(row.point, "order_created");
    assert_eq!(row.state.as_deref(), Some(r#"{"order":7}"#));
    assert!(row.lease_over && !row.expired, "{row:?}");
    let takeover = RunWrite {
        owner: "owner-c",
        fence: 1,
        point: &row.point,
        state: row.state.as_deref(),
        status: None,
        response: None,
        lease: HOUR,
    };
    assert!(
        backend
            .write_run(&mut tx, &s, &k, "owner-a", &takeover)
            .await
            .unwrap()
    );
    assert!(
        !backend
            .write_run(&mut tx, &s, &k, "owner-a", &phase)
            .await
            .unwrap(),
        "the earlier owner is refused"
    );
    let finish = RunWrite {
        owner: "owner-c",
        fence: 1,
        point: "order_created",
        state: Some(r#"{"order":7}"#),
        status: Some(Status::Rejected),
        response: Some(r#"{"declined":true}"#),
        lease: HOUR,
    };
    assert!(
        backend
            .write_run(&mut tx, &s, &k, "owner-c", &finish)
            .await
            .unwrap()
    );
    assert!(
        !backend
            .write_run(&mut tx, &s, &k, "owner-c", &finish)
            .await
            .unwrap(),
        "a finished run is not written again"
    );
    backend.commit_runs(tx).await.unwrap();

    let mut tx = backend.begin_runs(None).await.unwrap();
    let row = backend.read_run(&mut tx, &s, &k).await.unwrap().unwrap();
    assert_eq!((row.owner.as_str(), row.fence), ("owner-c", 1));
    assert_eq!(row.status, Some(Status::Rejected));
    assert_eq!(row.response.as_deref(), Some(r#"{"declined":true}"#));
    backend.rollback_runs(tx).await.unwrap();

    // Expired (retention zero): deleted by its owner and inserted again in one
    // transaction, as a start replaces it.
    started(&backend, "k2", "owner-x", HOUR, Duration::ZERO).await;
    let mut tx = backend.begin_runs(None).await.unwrap();
    let row = backend
        .read_run(&mut tx, &s, &key("k2"))
        .await
        .unwrap()
        .unwrap();
    assert!(row.expired, "{row:?}");
    assert!(
        backend
            .delete_run(&mut tx, &s, &key("k2"), "owner-x")
            .await
            .unwrap()
    );
    let mut again = new_run("owner-y", HOUR, HOUR);
    again.fence = row.fence + 1;
    assert!(
        backend
            .insert_run(&mut tx, &s, &key("k2"), &again)
            .await
            .unwrap()
    );
    backend.commit_runs(tx).await.unwrap();

    // A huge retention is clamped, not an overflow.
    started(&backend, "forever", "o", Duration::MAX, Duration::MAX).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_runs_are_the_unfinished_unexpired_ones_whose_lease_ended() {
    let db = TempDb::new("stalled");
    let backend = db.backend(4).await;
    started(&backend, "live", "o1", HOUR, HOUR).await;
    started(&backend, "stalled", "o2", Duration::ZERO, HOUR).await;
    started(&backend, "expired", "o3", Duration::ZERO, Duration::ZERO).await;
    started(&backend, "finished", "o4", Duration::ZERO, HOUR).await;
    let mut tx = backend.begin_runs(None).await.unwrap();
    let finish = RunWrite {
        owner: "o4",
        fence: 0,
        point: STARTED,
        state: None,
        status: Some(Status::Succeeded),
        response: Some("1"),
        lease: Duration::ZERO,
    };
    assert!(
        backend
            .write_run(&mut tx, &scope(), &key("finished"), "o4", &finish)
            .await
            .unwrap()
    );
    backend.commit_runs(tx).await.unwrap();

    let stalled = backend.stalled_runs(10).await.unwrap();
    assert_eq!(stalled.len(), 1, "{stalled:?}");
    assert_eq!(
        (
            stalled[0].principal.as_str(),
            stalled[0].operation.as_str(),
            stalled[0].key.as_str(),
            stalled[0].point.as_str()
        ),
        ("p", "order:v1", "stalled", STARTED)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_drains_in_order_and_purges_sent_messages_only() {
    let db = TempDb::new("outbox");
    let backend = db.backend(4).await;
    let mut tx = backend.begin_runs(None).await.unwrap();
    for (destination, id) in [("a", "m1"), ("b", "m2"), ("a", "m3"), ("a", "m4")] {
        backend
            .enqueue(&mut tx, &message(destination, id))
            .await
            .unwrap();
    }
    backend.commit_runs(tx).await.unwrap();
    // An enqueue that rolls back leaves nothing.
    let mut tx = backend.begin_runs(None).await.unwrap();
    backend
        .enqueue(&mut tx, &message("a", "rolled-back"))
        .await
        .unwrap();
    backend.rollback_runs(tx).await.unwrap();

    let mut tx = backend.begin_runs(None).await.unwrap();
    let rows = backend.lock_unsent(&mut tx, 3).await.unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(ids, ["m1", "m2", "m3"], "oldest first, bounded");
    assert_eq!(rows[1].destination, "b");
    assert_eq!(rows[0].payload, r#"{"m":"m1"}"#);
    assert!(rows.windows(2).all(|w| w[0].id < w[1].id));
    assert_eq!(
        backend.unsent_ids(&mut tx, "a", rows[2].id).await.unwrap(),
        [rows[0].id, rows[2].id]
    );
    backend
        .mark_sent(&mut tx, &[rows[0].id, rows[2].id])
        .await
        .unwrap();
    backend.mark_sent(&mut tx, &[]).await.unwrap();
    backend.commit_runs(tx).await.unwrap();

    let mut tx = backend.begin_runs(None).await.unwrap();
    let rest = backend.lock_unsent(&mut tx, 10).await.unwrap();
    let ids: Vec<&str> = rest.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(ids, ["m2", "m4"]);
    assert_eq!(
        backend.unsent_ids(&mut tx, "a", i64::MAX).await.unwrap(),
        [rest[1].id]
    );
    backend.rollback_runs(tx).await.unwrap();

    // Purges: sent messages (not unsent ones), expired runs (not stalled ones).
    started(&backend, "stalled", "o1", Duration::ZERO, HOUR).await;
    started(&backend, "expired", "o2", HOUR, Duration::ZERO).await;
    assert_eq!(
        backend.purge_batch(Table::Outbox, HOUR, 100).await.unwrap(),
        0
    );
    assert_eq!(
        backend.purge_batch(Table::Runs, HOUR, 100).await.unwrap(),
        0
    );
    assert_eq!(
        backend
            .purge_batch(Table::Outbox, Duration::ZERO, 1)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        backend
            .purge_batch(Table::Outbox, Duration::ZERO, 100)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        backend
            .purge_batch(Table::Runs, Duration::ZERO, 100)
            .await
            .unwrap(),
        1
    );
    let (runs, unsent): (Vec<String>, Vec<String>) = backend
        .interact(|c| {
            let runs = c
                .prepare("SELECT request_key FROM idem_run")?
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            let unsent = c
                .prepare("SELECT message_id FROM idem_outbox ORDER BY id")?
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            Ok((runs, unsent))
        })
        .await
        .unwrap();
    assert_eq!(runs, ["stalled"]);
    assert_eq!(unsent, ["m2", "m4"]);
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

/// Records what the relay publishes.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<idem_core::runs::OutboxRow>>);

impl idem_core::Publisher for Recorder {
    type Error = std::convert::Infallible;

    async fn publish(
        &self,
        message: &idem_core::runs::OutboxRow,
    ) -> Result<(), std::convert::Infallible> {
        self.0.lock().unwrap().push(message.clone());
        Ok(())
    }
}

/// A phase's effect: inserts `n` into `t`.
fn insert(
    tx: &mut idem_sqlite::SqliteTx,
    n: i64,
) -> idem_core::BoxFuture<'_, Result<i64, idem_core::DbError>> {
    Box::pin(tx.run(move |c| {
        c.query_row("INSERT INTO t (n) VALUES (?1) RETURNING n", [n], |r| {
            r.get(0)
        })
        .map_err(idem_sqlite::db_error)
    }))
}

/// Through idem-core: a start, a phase, a takeover after the lease ran out (the earlier
/// owner's phase is refused and rolled back), a finish that enqueues a message, the
/// replay, and the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phased_run_end_to_end() {
    use idem_core::{DbError, Error, Idem, Request, Started};

    let db = TempDb::new("e2e");
    let backend = db.backend(4).await;
    backend
        .interact(|c| c.execute_batch("CREATE TABLE t (n INTEGER NOT NULL)"))
        .await
        .unwrap();
    let idem = Idem::new(backend.clone())
        .with_lease(Duration::from_millis(200))
        .with_wait_timeout(Duration::from_millis(50));
    let (s, k) = (scope(), key("e2e"));
    let request = Request::new(serde_json::json!({"amount": 5}));

    let Ok(Started::Run(mut first)) = idem.start::<DbError>(&s, &k, &request).await else {
        panic!("a new run")
    };
    assert_eq!((first.point(), first.fence()), (STARTED, 0));
    assert_eq!(first.phase("created", |tx| insert(tx, 1)).await.unwrap(), 1);
    let busy = idem.start::<DbError>(&s, &k, &request).await.unwrap_err();
    assert!(matches!(busy, Error::InProgress { .. }), "{busy:?}");

    let began = std::time::Instant::now();
    let mut second = loop {
        match idem.start::<DbError>(&s, &k, &request).await {
            Ok(Started::Run(run)) => break run,
            Err(Error::InProgress { .. }) if began.elapsed() < HANG_GUARD => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{other:?}"),
        }
    };
    assert!(second.resumed());
    assert_eq!((second.point(), second.fence()), ("created", 1));
    assert_eq!(second.state::<i64>().unwrap(), Some(1));
    let lost = first.phase("stale", |tx| insert(tx, 2)).await.unwrap_err();
    assert!(matches!(lost, Error::LeaseLost { fence: 0 }), "{lost:?}");

    let message = Outgoing::new("orders", &second.message_id("paid"), &1).unwrap();
    let outbox = backend.clone();
    let answer = second
        .finish(move |tx| {
            let (outbox, message) = (outbox.clone(), message.clone());
            Box::pin(async move {
                outbox.enqueue(tx, &message).await?;
                Ok::<_, DbError>(serde_json::json!({"paid": true}))
            })
        })
        .await
        .unwrap();
    assert_eq!(answer, serde_json::json!({"paid": true}));
    match idem.start::<DbError>(&s, &k, &request).await {
        Ok(Started::Finished(f)) => assert_eq!(f.json(), r#"{"paid":true}"#),
        other => panic!("{other:?}"),
    }
    let rows: Vec<i64> = backend
        .interact(|c| {
            c.prepare("SELECT n FROM t ORDER BY n")?
                .query_map([], |r| r.get(0))?
                .collect()
        })
        .await
        .unwrap();
    assert_eq!(rows, [1], "the stale owner's phase was rolled back");

    let recorder = Recorder::default();
    assert_eq!(idem.relay(&recorder, 10).await.unwrap().published, 1);
    assert_eq!(idem.relay(&recorder, 10).await.unwrap().published, 0);
    let published = recorder.0.lock().unwrap().clone();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].destination, "orders");
}
