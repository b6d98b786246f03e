//! What only MySQL/MariaDB does for phased runs: the bounded waits (row and table
//! locks) given back to the session, a transaction lost inside a phase, concurrent
//! starts of one run without deadlocks, and a table lock told apart from a held run.
//! What every engine must do is in the conformance suite (`idem-conformance`, run by
//! `tests/mysql.rs`).
//!
//! Needs the server at `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`,
//! MariaDB 10.6+ or MySQL 8.0+ for `SKIP LOCKED`); fails if it is unreachable.

#[allow(dead_code)] // shared with other test targets
mod common;

use std::convert::Infallible;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::runs::{NewRun, RunGuard, RunWrite, STARTED};
use idem_core::{Error, ErrorKind, Idem, Key, Operation, Principal, RunStore, Scope, Started};
use idem_mysql::MysqlBackend;
use idem_mysql::mysql_async::prelude::Queryable;
use idem_mysql::mysql_async::{OptsBuilder, PoolConstraints, PoolOpts};

use common::PrivateDb;

const HOUR: Duration = Duration::from_secs(3600);

fn scope() -> Scope {
    Scope::new(
        Principal::new("user-7").expect("principal"),
        Operation::new("charge", 1).expect("operation"),
    )
}

fn key(k: &str) -> Key {
    Key::new(k).expect("key")
}

fn new_run<'a>(owner: &'a str, lease: Duration, retention: Duration) -> NewRun<'a> {
    NewRun {
        request: r#"{"amount":5}"#,
        owner,
        fence: 0,
        point: STARTED,
        lease,
        retention,
    }
}

/// Inserts and commits a run.
async fn committed_run(
    b: &MysqlBackend,
    k: &Key,
    owner: &str,
    lease: Duration,
    retention: Duration,
) {
    let mut tx = b.begin_runs(None).await.expect("begin");
    assert!(
        b.insert_run(&mut tx, &scope(), k, &new_run(owner, lease, retention))
            .await
            .expect("insert")
    );
    b.commit_runs(tx).await.expect("commit");
}

/// The first column of the first row, as text.
async fn text(db: &PrivateDb, query: &str) -> String {
    let mut conn = db.backend.pool().get_conn().await.expect("connection");
    let v: Option<String> = conn
        .query_first(query)
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"));
    v.unwrap_or_else(|| panic!("{query}: no row"))
}

fn write<'a>(owner: &'a str, point: &'a str, lease: Duration) -> RunWrite<'a> {
    RunWrite {
        owner,
        fence: 0,
        point,
        state: Some(r#"{"order":1}"#),
        status: None,
        response: None,
        lease,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_wait_for_a_held_run_is_a_lock_timeout_and_is_given_back() {
    let db = PrivateDb::create("runs_wait").await;
    // Two connections: the holder's and the waiter's, which is reused afterwards.
    let constraints = PoolConstraints::new(1, 2).expect("constraints");
    let opts = OptsBuilder::from_opts(idem_mysql::parse_url(&common::url()).expect("url"))
        .db_name(Some(&db.name))
        .pool_opts(PoolOpts::default().with_constraints(constraints));
    let b = MysqlBackend::connect_with(opts).await.expect("connect");
    let k = key("held");
    committed_run(&b, &k, "o", HOUR, HOUR).await;
    let session_default = {
        let mut conn = b.pool().get_conn().await.expect("conn");
        let v: Option<i64> = conn
            .query_first("SELECT @@SESSION.innodb_lock_wait_timeout")
            .await
            .expect("read");
        v.expect("value")
    };

    let mut holder = b.begin_runs(None).await.expect("begin");
    assert!(
        b.read_run(&mut holder, &scope(), &k)
            .await
            .expect("lock")
            .is_some()
    );
    let mut waiter = b
        .begin_runs(Some(Duration::from_millis(50)))
        .await
        .expect("begin");
    let started = std::time::Instant::now();
    let err = b
        .read_run(&mut waiter, &scope(), &k)
        .await
        .expect_err("the row is held");
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    assert_eq!(err.code(), Some("1205"));
    // The server's unit is whole seconds: 50 ms waits 1 s, never the session's 50 s.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    b.rollback_runs(waiter).await.expect("rollback");

    // The waiter's session has its own bound back (the holder still has the other one).
    {
        let mut conn = b.pool().get_conn().await.expect("conn");
        let v: Option<i64> = conn
            .query_first("SELECT @@SESSION.innodb_lock_wait_timeout")
            .await
            .expect("read");
        assert_eq!(v, Some(session_default));
    }
    b.rollback_runs(holder).await.expect("rollback");

    // A bounded transaction that commits gives the bound back too.
    let mut tx = b
        .begin_runs(Some(Duration::from_secs(2)))
        .await
        .expect("begin");
    assert!(
        b.read_run(&mut tx, &scope(), &k)
            .await
            .expect("read")
            .is_some()
    );
    b.commit_runs(tx).await.expect("commit");
    for _ in 0..2 {
        let mut conn = b.pool().get_conn().await.expect("conn");
        let v: Option<i64> = conn
            .query_first("SELECT @@SESSION.innodb_lock_wait_timeout")
            .await
            .expect("read");
        assert_eq!(v, Some(session_default));
    }
    b.disconnect().await.expect("disconnect");
    db.drop_database().await;
}

/// A phase whose effect swallowed a deadlock (the server rolled back and autocommits
/// what follows) must not record its recovery point.
#[tokio::test]
async fn a_lost_transaction_is_refused_before_the_guarded_write() {
    let db = PrivateDb::create("runs_lost").await;
    let b = &db.backend;
    let k = key("lost");
    committed_run(b, &k, "owner-a", HOUR, HOUR).await;
    let mut tx = b.begin_runs(None).await.expect("begin");
    // What the server's deadlock rollback leaves behind: no transaction.
    tx.query_drop("ROLLBACK").await.expect("rollback");
    let err = b
        .write_run(
            &mut tx,
            &scope(),
            &k,
            &RunGuard {
                owner: "owner-a",
                fence: 0,
                point: STARTED,
            },
            &write("owner-a", "p1", HOUR),
        )
        .await
        .expect_err("the transaction is gone");
    assert_eq!(err.kind(), ErrorKind::Other, "{err}");
    b.rollback_runs(tx).await.expect("rollback");
    assert_eq!(text(&db, "SELECT point FROM idem_run").await, STARTED);
    db.drop_database().await;
}

/// What a tracing subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Many retries start one existing run whose lease ended, at once: exactly one takes it
/// over (fence 1), the others find its new owner's live lease and answer InProgress,
/// and no transaction became a deadlock victim on the way (the retries the core logs,
/// by cause, are counted: a plain INSERT's duplicate-key error left shared locks that
/// every starter then asked to upgrade, a certain deadlock).
#[tokio::test]
async fn concurrent_starts_of_an_existing_run_never_deadlock() {
    const STARTERS: usize = 8;
    let db = PrivateDb::create("runs_race").await;
    let k = key("race");
    committed_run(&db.backend, &k, "crashed-owner", Duration::ZERO, HOUR).await;
    let request = idem_core::Request::new(serde_json::json!({"amount": 5}));
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // One thread (the test's runtime): the subscriber sees every task's events.
    let guard = tracing_subscriber::util::SubscriberInitExt::set_default(subscriber);
    let tasks: Vec<_> = (0..STARTERS)
        .map(|_| {
            let idem = Idem::new(db.backend.clone()).with_wait_timeout(Duration::from_millis(300));
            let (k, request) = (k.clone(), request.clone());
            tokio::spawn(async move {
                match idem.start::<Infallible>(&scope(), &k, &request).await {
                    Ok(Started::Run(run)) => Ok((run.fence(), run.resumed())),
                    Ok(Started::Finished(_)) => Err("finished".to_owned()),
                    Err(Error::InProgress { .. }) => Err("in progress".to_owned()),
                    Err(e) => Err(e.to_string()),
                }
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut others = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            Ok(won) => winners.push(won),
            Err(e) => others.push(e),
        }
    }
    drop(guard);
    let log =
        String::from_utf8_lossy(&captured.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned();
    let deadlocks = log
        .lines()
        .filter(|l| l.contains("retrying") && l.contains("deadlock"))
        .count();
    db.drop_database().await;
    assert_eq!(winners, [(1, true)], "one takeover, fence raised once");
    assert!(
        others.iter().all(|e| e == "in progress"),
        "the others: {others:?}"
    );
    assert_eq!(deadlocks, 0, "deadlock retries:\n{log}");
}

/// A table lock (`LOCK TABLES … WRITE`, as DDL takes one too) is not a call holding the
/// key: a start bounded by it answers LockWait, within its bound (the run transaction
/// bounds table-lock waits too: `lock_wait_timeout`, whole seconds).
#[tokio::test]
async fn a_start_held_up_by_a_table_lock_is_a_lock_wait() {
    let db = PrivateDb::create("runs_tablelock").await;
    let k = key("locked");
    let idem = Idem::new(db.backend.clone()).with_wait_timeout(Duration::from_millis(300));
    let request = idem_core::Request::new(serde_json::json!({"amount": 5}));
    let opts = idem_mysql::mysql_async::OptsBuilder::from_opts(
        idem_mysql::parse_url(&common::url()).expect("url"),
    )
    .db_name(Some(&db.name));
    let mut locker = idem_mysql::mysql_async::Conn::new(opts)
        .await
        .expect("connect");
    locker
        .query_drop("LOCK TABLES idem_run WRITE")
        .await
        .expect("lock");
    let blocked = tokio::time::timeout(
        Duration::from_secs(60),
        idem.start::<Infallible>(&scope(), &k, &request),
    )
    .await;
    locker.query_drop("UNLOCK TABLES").await.expect("unlock");
    locker.disconnect().await.expect("disconnect");
    let blocked = blocked.expect("the start's wait for a table lock is bounded");
    assert!(
        matches!(blocked, Err(Error::LockWait { .. })),
        "a table lock: {blocked:?}"
    );
    let started = idem.start::<Infallible>(&scope(), &k, &request).await;
    assert!(matches!(started, Ok(Started::Run(_))), "{started:?}");
    db.drop_database().await;
}
