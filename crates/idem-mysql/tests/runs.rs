//! Live checks of the statements behind phased runs and the outbox (`RunStore`,
//! `OutboxStore`): conflicts, the lease and expiry flags, the guarded write, the
//! skip-locked relay read, purges and the bounded lock wait.
//!
//! Needs the server at `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`,
//! MariaDB 10.6+ or MySQL 8.0+ for `SKIP LOCKED`); fails if it is unreachable.

mod common;

use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Duration;

use idem_core::runs::{NewRun, OutboxRow, RunWrite, STARTED};
use idem_core::{
    ErrorKind, Idem, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal, Publisher,
    RunStore, Scope, Started, Status, Table,
};
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

#[tokio::test]
async fn a_taken_identity_is_false_not_an_error() {
    let db = PrivateDb::create("runs_conflict").await;
    let b = &db.backend;
    let k = key("k-1");
    committed_run(b, &k, "owner-a", HOUR, HOUR).await;
    let mut tx = b.begin_runs(None).await.expect("begin");
    let again = b
        .insert_run(&mut tx, &scope(), &k, &new_run("owner-b", HOUR, HOUR))
        .await
        .expect("a duplicate is not an error");
    assert!(!again, "the identity is taken");
    // The transaction is still usable after the duplicate (1062 ends the statement only).
    let row = b
        .read_run(&mut tx, &scope(), &k)
        .await
        .expect("read")
        .expect("row");
    assert_eq!(row.owner, "owner-a");
    assert_eq!(row.request, r#"{"amount":5}"#);
    assert_eq!((row.fence, row.point.as_str()), (0, STARTED));
    assert_eq!((row.state, row.status, row.response), (None, None, None));
    b.rollback_runs(tx).await.expect("rollback");
    assert_eq!(db.scalar("SELECT COUNT(*) FROM idem_run").await, 1);
    db.drop_database().await;
}

#[tokio::test]
async fn reads_report_the_lease_and_the_expiry_by_the_database_clock() {
    let db = PrivateDb::create("runs_flags").await;
    let b = &db.backend;
    let (ended, expired, live) = (key("lease-ended"), key("expired"), key("live"));
    committed_run(b, &ended, "o", Duration::ZERO, HOUR).await;
    committed_run(b, &expired, "o", HOUR, Duration::ZERO).await;
    committed_run(b, &live, "o", HOUR, HOUR).await;
    let mut tx = b.begin_runs(None).await.expect("begin");
    let mut flags = Vec::new();
    for k in [&ended, &expired, &live] {
        let row = b
            .read_run(&mut tx, &scope(), k)
            .await
            .expect("read")
            .expect("row");
        flags.push((row.lease_over, row.expired));
    }
    assert_eq!(flags, [(true, false), (false, true), (false, false)]);
    assert!(
        b.read_run(&mut tx, &scope(), &key("never"))
            .await
            .expect("read")
            .is_none()
    );
    b.rollback_runs(tx).await.expect("rollback");

    // The completer lists the unexpired run whose lease ended, and only it: not one
    // that has its final answer.
    committed_run(b, &key("finished"), "o", Duration::ZERO, HOUR).await;
    db.exec("UPDATE idem_run SET status = 0, response = '1' WHERE request_key = 'finished'")
        .await;
    let stalled = b.stalled_runs(10).await.expect("stalled");
    assert_eq!(stalled.len(), 1, "{stalled:?}");
    assert_eq!(
        (
            stalled[0].principal.as_str(),
            stalled[0].operation.as_str(),
            stalled[0].key.as_str(),
            stalled[0].point.as_str()
        ),
        ("user-7", "charge:v1", "lease-ended", STARTED)
    );
    db.drop_database().await;
}

#[tokio::test]
async fn the_guarded_write_refuses_a_stale_owner_and_a_finished_run() {
    let db = PrivateDb::create("runs_write").await;
    let b = &db.backend;
    let k = key("k-w");
    committed_run(b, &k, "owner-a", HOUR, HOUR).await;
    let snapshot = "SELECT CONCAT_WS('|', owner, fence, point, COALESCE(state, '-'), \
                    COALESCE(status, '-'), lease_until, updated_at) FROM idem_run";
    let before = text(&db, snapshot).await;

    // A stale owner changes nothing.
    let mut tx = b.begin_runs(None).await.expect("begin");
    let stale = b
        .write_run(
            &mut tx,
            &scope(),
            &k,
            "owner-x",
            &write("owner-x", "p1", HOUR),
        )
        .await
        .expect("write");
    assert!(!stale);
    b.commit_runs(tx).await.expect("commit");
    assert_eq!(
        text(&db, snapshot).await,
        before,
        "a refused write changes nothing"
    );

    // The owner's write counts as matched even when it writes the same values twice in
    // a row (the server counts changed rows; `updated_at` always moves).
    let mut tx = b.begin_runs(None).await.expect("begin");
    for _ in 0..3 {
        let w = write("owner-a", "p1", HOUR);
        assert!(
            b.write_run(&mut tx, &scope(), &k, "owner-a", &w)
                .await
                .expect("write")
        );
    }
    // A takeover: a new owner and fence, guarded by the old owner.
    let takeover = RunWrite {
        fence: 1,
        ..write("owner-b", "p1", HOUR)
    };
    assert!(
        b.write_run(&mut tx, &scope(), &k, "owner-a", &takeover)
            .await
            .expect("takeover")
    );
    b.commit_runs(tx).await.expect("commit");

    // The final answer; afterwards nothing can write the run.
    let mut tx = b.begin_runs(None).await.expect("begin");
    let finish = RunWrite {
        fence: 1,
        status: Some(Status::Rejected),
        response: Some(r#""declined""#),
        ..write("owner-b", "p1", HOUR)
    };
    assert!(
        b.write_run(&mut tx, &scope(), &k, "owner-b", &finish)
            .await
            .expect("finish")
    );
    b.commit_runs(tx).await.expect("commit");
    let finished = text(&db, snapshot).await;
    let mut tx = b.begin_runs(None).await.expect("begin");
    let after = RunWrite {
        fence: 1,
        ..write("owner-b", "p2", HOUR)
    };
    assert!(
        !b.write_run(&mut tx, &scope(), &k, "owner-b", &after)
            .await
            .expect("write"),
        "a finished run is never written again"
    );
    let row = b
        .read_run(&mut tx, &scope(), &k)
        .await
        .expect("read")
        .expect("row");
    b.rollback_runs(tx).await.expect("rollback");
    assert_eq!(text(&db, snapshot).await, finished);
    assert_eq!(
        (row.owner.as_str(), row.fence, row.point.as_str()),
        ("owner-b", 1, "p1")
    );
    assert_eq!(row.status, Some(Status::Rejected));
    assert_eq!(row.response.as_deref(), Some(r#""declined""#));
    assert_eq!(row.state.as_deref(), Some(r#"{"order":1}"#));

    // Deleting is guarded by the owner too.
    let mut tx = b.begin_runs(None).await.expect("begin");
    assert!(
        !b.delete_run(&mut tx, &scope(), &k, "owner-a")
            .await
            .expect("delete")
    );
    assert!(
        b.delete_run(&mut tx, &scope(), &k, "owner-b")
            .await
            .expect("delete")
    );
    b.commit_runs(tx).await.expect("commit");
    assert_eq!(db.scalar("SELECT COUNT(*) FROM idem_run").await, 0);
    db.drop_database().await;
}

async fn enqueue(b: &MysqlBackend, messages: &[(&str, &str)]) {
    let mut tx = b.begin_runs(None).await.expect("begin");
    for (destination, id) in messages {
        let m = Outgoing::new(destination, id, &serde_json::json!({"id": id})).expect("message");
        b.enqueue(&mut tx, &m).await.expect("enqueue");
    }
    b.commit_runs(tx).await.expect("commit");
}

fn ids(rows: &[OutboxRow]) -> Vec<i64> {
    rows.iter().map(|r| r.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_skip_each_others_rows_but_see_them_as_unsent() {
    let db = PrivateDb::create("outbox_skip").await;
    let b = &db.backend;
    enqueue(b, &[("a", "m1"), ("a", "m2"), ("a", "m3"), ("b", "m4")]).await;
    let all: Vec<i64> = {
        let mut conn = b.pool().get_conn().await.expect("conn");
        conn.query("SELECT id FROM idem_outbox ORDER BY id")
            .await
            .expect("ids")
    };
    assert_eq!(all.len(), 4);

    let mut first = b.begin_runs(None).await.expect("begin");
    let mine = b.lock_unsent(&mut first, 2).await.expect("lock");
    assert_eq!(ids(&mine), all[..2]);
    assert_eq!(
        (mine[0].destination.as_str(), mine[0].message_id.as_str()),
        ("a", "m1")
    );
    assert_eq!(mine[0].payload, r#"{"id":"m1"}"#);

    // A second relay skips the first one's rows instead of waiting for them…
    let mut second = b.begin_runs(None).await.expect("begin");
    let theirs = b.lock_unsent(&mut second, 10).await.expect("lock");
    assert_eq!(ids(&theirs), all[2..]);
    // …but its plain read still sees them unsent, so it keeps destination a's order.
    let unsent = b
        .unsent_ids(&mut second, "a", all[2])
        .await
        .expect("unsent");
    assert_eq!(unsent, all[..3]);
    assert_eq!(
        b.unsent_ids(&mut second, "b", all[3])
            .await
            .expect("unsent"),
        [all[3]]
    );

    // Once the first relay has marked its rows sent and committed, the second one's
    // next read sees it (READ COMMITTED: the latest committed rows, not a snapshot).
    b.mark_sent(&mut first, &ids(&mine)).await.expect("mark");
    b.commit_runs(first).await.expect("commit");
    let unsent = b
        .unsent_ids(&mut second, "a", all[2])
        .await
        .expect("unsent");
    assert_eq!(unsent, [all[2]]);
    b.mark_sent(&mut second, &ids(&theirs)).await.expect("mark");
    b.commit_runs(second).await.expect("commit");

    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_outbox WHERE sent_at IS NOT NULL")
            .await,
        4
    );
    let mut tx = b.begin_runs(None).await.expect("begin");
    assert!(b.lock_unsent(&mut tx, 10).await.expect("lock").is_empty());
    assert!(b.mark_sent(&mut tx, &[]).await.is_ok(), "nothing to mark");
    b.rollback_runs(tx).await.expect("rollback");
    db.drop_database().await;
}

/// A publisher that keeps what it was given.
#[derive(Default)]
struct Collect(Mutex<Vec<(String, String)>>);

impl Publisher for Collect {
    type Error = Infallible;

    async fn publish(&self, message: &OutboxRow) -> Result<(), Infallible> {
        if let Ok(mut seen) = self.0.lock() {
            seen.push((message.destination.clone(), message.message_id.clone()));
        }
        Ok(())
    }
}

/// The core's phased run and relay, end to end on this engine.
#[tokio::test]
async fn a_phased_run_and_its_outbox_message_end_to_end() {
    let db = PrivateDb::create("runs_e2e").await;
    let idem = Idem::new(db.backend.clone()).with_wait_timeout(Duration::from_millis(300));
    let k = key("order-1");
    let request = idem_core::Request::new(serde_json::json!({"amount": 5}));
    let Started::Run(mut run) = idem
        .start::<Infallible>(&scope(), &k, &request)
        .await
        .expect("start")
    else {
        panic!("a new key starts a run");
    };
    let message = Outgoing::new(
        "orders",
        &run.message_id("order.paid"),
        &serde_json::json!({"order": 1}),
    )
    .expect("message");
    let backend = run.backend().clone();
    let state: u32 = run
        .phase("charged", move |tx| {
            let (backend, message) = (backend.clone(), message.clone());
            Box::pin(async move {
                backend.enqueue(tx, &message).await?;
                Ok::<_, idem_core::DbError>(7)
            })
        })
        .await
        .expect("phase");
    assert_eq!(state, 7);
    let answer: String = run
        .finish(|_tx| Box::pin(async { Ok::<_, idem_core::DbError>("paid".to_owned()) }))
        .await
        .expect("finish");
    assert_eq!(answer, "paid");
    match idem
        .start::<Infallible>(&scope(), &k, &request)
        .await
        .expect("again")
    {
        Started::Finished(f) => assert_eq!(f.json(), r#""paid""#),
        Started::Run(_) => panic!("a finished run replays its answer"),
    }

    let publisher = Collect::default();
    let report = idem.relay(&publisher, 10).await.expect("relay");
    assert_eq!(report.published, 1);
    let seen = publisher.0.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, "orders");
    assert_eq!(
        idem.relay(&publisher, 10).await.expect("relay").published,
        0
    );
    drop(idem);
    db.drop_database().await;
}

#[tokio::test]
async fn purges_delete_only_expired_runs_and_sent_messages() {
    let db = PrivateDb::create("runs_purge").await;
    let b = &db.backend;
    committed_run(b, &key("expired"), "o", HOUR, Duration::ZERO).await;
    committed_run(b, &key("live"), "o", HOUR, HOUR).await;
    enqueue(b, &[("a", "sent"), ("a", "unsent")]).await;
    let mut tx = b.begin_runs(None).await.expect("begin");
    let first = b.lock_unsent(&mut tx, 1).await.expect("lock");
    b.mark_sent(&mut tx, &ids(&first)).await.expect("mark");
    b.commit_runs(tx).await.expect("commit");

    // Nothing is old enough yet.
    assert_eq!(
        b.purge_batch(Table::Runs, HOUR, 100).await.expect("purge"),
        0
    );
    assert_eq!(
        b.purge_batch(Table::Outbox, HOUR, 100)
            .await
            .expect("purge"),
        0
    );
    assert_eq!(
        b.purge_batch(Table::Runs, Duration::ZERO, 100)
            .await
            .expect("purge"),
        1
    );
    assert_eq!(
        b.purge_batch(Table::Outbox, Duration::ZERO, 100)
            .await
            .expect("purge"),
        1
    );
    assert_eq!(text(&db, "SELECT request_key FROM idem_run").await, "live");
    assert_eq!(
        text(&db, "SELECT message_id FROM idem_outbox").await,
        "unsent"
    );
    assert_eq!(
        b.purge_batch(Table::Outbox, Duration::ZERO, 100)
            .await
            .expect("purge"),
        0,
        "an unsent message is never purged"
    );
    db.drop_database().await;
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
            "owner-a",
            &write("owner-a", "p1", HOUR),
        )
        .await
        .expect_err("the transaction is gone");
    assert_eq!(err.kind(), ErrorKind::Other, "{err}");
    b.rollback_runs(tx).await.expect("rollback");
    assert_eq!(text(&db, "SELECT point FROM idem_run").await, STARTED);
    db.drop_database().await;
}

/// Two retries race to take over a run whose lease ended: both `INSERT`s fail with
/// 1062 (each holding a shared lock on the row), both then lock it `FOR UPDATE`, and
/// InnoDB picks a deadlock victim, which the core retries. Exactly one takes the run
/// over; the other finds the new owner's live lease and answers in-progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_takeovers_have_one_winner() {
    let db = PrivateDb::create("runs_race").await;
    let k = key("race");
    committed_run(&db.backend, &k, "crashed-owner", Duration::ZERO, HOUR).await;
    let request = idem_core::Request::new(serde_json::json!({"amount": 5}));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let idem = Idem::new(db.backend.clone()).with_wait_timeout(Duration::from_millis(300));
            let (k, request) = (k.clone(), request.clone());
            tokio::spawn(async move {
                match idem.start::<Infallible>(&scope(), &k, &request).await {
                    Ok(Started::Run(run)) => Ok((run.fence(), run.resumed())),
                    Ok(Started::Finished(_)) => panic!("the run has no answer"),
                    Err(e) => Err(e.to_string()),
                }
            })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            Ok(won) => winners.push(won),
            Err(e) => assert!(e.contains("in progress"), "{e}"),
        }
    }
    assert_eq!(winners, [(1, true)], "one takeover, fence raised once");
    db.drop_database().await;
}
