//! Phased runs and the outbox (`RunStore`, `OutboxStore`), live against SQL Server.
//! Every test is `#[ignore]`d, so a run without a server reports each as ignored, by
//! name, with the reason (no SQL Server on the project's machines: not verified live);
//! `ci/test.sh` runs them with `--include-ignored` when `IDEM_MSSQL_URL` is set. The statements are
//! snapshot-tested offline in the crate's unit tests.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::convert::Infallible;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::runs::{NewRun, OutboxRow, RunWrite, STARTED};
use idem_core::{
    DbError, ErrorKind, Idem, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal,
    Publisher, Request, RunStore, Scope, Started, Status, Table,
};
use idem_mssql::{MssqlBackend, MssqlOptions};

const HOUR: Duration = Duration::from_secs(3600);

/// The server's URL. These tests are `#[ignore]`d: `ci/test.sh` runs them with
/// `--include-ignored` when `IDEM_MSSQL_URL` is set.
fn url() -> String {
    match std::env::var("IDEM_MSSQL_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!("IDEM_MSSQL_URL is not set: these tests need a live SQL Server"),
    }
}

async fn batch(backend: &MssqlBackend, sql: String) {
    backend
        .interact(move |c| {
            Box::pin(async move { c.simple_query(sql).await?.into_results().await.map(drop) })
        })
        .await
        .unwrap();
}

/// The first column of the first row, as a bigint.
async fn scalar(backend: &MssqlBackend, sql: &str) -> i64 {
    let sql = sql.to_owned();
    backend
        .interact(move |c| {
            Box::pin(async move {
                let row = c.simple_query(sql).await?.into_row().await?;
                Ok(row.and_then(|r| r.get::<i64, _>(0)).unwrap_or(-1))
            })
        })
        .await
        .unwrap()
}

/// The first column of the first row, as text.
async fn text(backend: &MssqlBackend, sql: &str) -> String {
    let sql = sql.to_owned();
    backend
        .interact(move |c| {
            Box::pin(async move {
                let row = c.simple_query(sql).await?.into_row().await?;
                Ok(row
                    .and_then(|r| r.get::<&str, _>(0).map(str::to_owned))
                    .unwrap_or_default())
            })
        })
        .await
        .unwrap()
}

/// A private database with idem's tables; returns (admin, backend, name).
async fn private(
    url: &str,
    prefix: &str,
    connections: usize,
) -> (MssqlBackend, MssqlBackend, String) {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let name = format!("idem_{prefix}_{}_{nanos}", std::process::id());
    let options = MssqlOptions::parse(url).unwrap();
    let admin = MssqlBackend::connect_with(options.clone().max_connections(2))
        .await
        .unwrap();
    batch(&admin, format!("CREATE DATABASE [{name}]")).await;
    let backend = MssqlBackend::connect_with(options.database(&name).max_connections(connections))
        .await
        .unwrap();
    assert_eq!(backend.migrate().await.unwrap(), vec![1, 2, 3]);
    (admin, backend, name)
}

async fn drop_private(admin: MssqlBackend, backend: MssqlBackend, name: String) {
    backend.close().await;
    batch(
        &admin,
        format!(
            "ALTER DATABASE [{name}] SET SINGLE_USER WITH ROLLBACK IMMEDIATE; DROP DATABASE [{name}]"
        ),
    )
    .await;
    admin.close().await;
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("user-7").unwrap(),
        Operation::new("charge", 1).unwrap(),
    )
}

fn key(k: &str) -> Key {
    Key::new(k).unwrap()
}

fn new_run(owner: &str, lease: Duration, retention: Duration) -> NewRun<'_> {
    NewRun {
        request: r#"{"amount":5}"#,
        owner,
        fence: 0,
        point: STARTED,
        lease,
        retention,
    }
}

fn write<'a>(owner: &'a str, point: &'a str) -> RunWrite<'a> {
    RunWrite {
        owner,
        fence: 0,
        point,
        state: Some(r#"{"order":1}"#),
        status: None,
        response: None,
        lease: HOUR,
    }
}

async fn committed_run(
    b: &MssqlBackend,
    k: &Key,
    owner: &str,
    lease: Duration,
    retention: Duration,
) {
    let mut tx = b.begin_runs(None).await.unwrap();
    assert!(
        b.insert_run(&mut tx, &scope(), k, &new_run(owner, lease, retention))
            .await
            .unwrap()
    );
    b.commit_runs(tx).await.unwrap();
}

async fn enqueue(b: &MssqlBackend, messages: &[(&str, &str)]) {
    let mut tx = b.begin_runs(None).await.unwrap();
    for (destination, id) in messages {
        let m = Outgoing::new(destination, id, &serde_json::json!({"id": id})).unwrap();
        b.enqueue(&mut tx, &m).await.unwrap();
    }
    b.commit_runs(tx).await.unwrap();
}

fn ids(rows: &[OutboxRow]) -> Vec<i64> {
    rows.iter().map(|r| r.id).collect()
}

#[tokio::test]
#[ignore = "needs IDEM_MSSQL_URL (no SQL Server on the project's machines: not verified live)"]
async fn conflicts_flags_and_stalled_runs() {
    let url = url();
    let (admin, b, name) = private(&url, "runs_flags", 4).await;
    let (ended, expired, live) = (key("lease-ended"), key("expired"), key("live"));
    committed_run(&b, &ended, "o", Duration::ZERO, HOUR).await;
    committed_run(&b, &expired, "o", HOUR, Duration::ZERO).await;
    committed_run(&b, &live, "o", HOUR, HOUR).await;

    let mut tx = b.begin_runs(None).await.unwrap();
    assert!(
        !b.insert_run(&mut tx, &scope(), &live, &new_run("other", HOUR, HOUR))
            .await
            .unwrap(),
        "a taken identity is false, not an error"
    );
    let mut flags = Vec::new();
    for k in [&ended, &expired, &live] {
        let row = b.read_run(&mut tx, &scope(), k).await.unwrap().unwrap();
        assert_eq!((row.owner.as_str(), row.point.as_str()), ("o", STARTED));
        assert_eq!(row.request, r#"{"amount":5}"#);
        flags.push((row.lease_over, row.expired));
    }
    assert_eq!(flags, [(true, false), (false, true), (false, false)]);
    assert!(
        b.read_run(&mut tx, &scope(), &key("never"))
            .await
            .unwrap()
            .is_none()
    );
    b.rollback_runs(tx).await.unwrap();

    let stalled = b.stalled_runs(10).await.unwrap();
    assert_eq!(stalled.len(), 1, "{stalled:?}");
    assert_eq!(
        (stalled[0].principal.as_str(), stalled[0].key.as_str()),
        ("user-7", "lease-ended")
    );
    drop_private(admin, b, name).await;
}

#[tokio::test]
#[ignore = "needs IDEM_MSSQL_URL (no SQL Server on the project's machines: not verified live)"]
async fn the_guarded_write_refuses_a_stale_owner_and_a_finished_run() {
    let url = url();
    let (admin, b, name) = private(&url, "runs_write", 4).await;
    let k = key("k-w");
    committed_run(&b, &k, "owner-a", HOUR, HOUR).await;
    let snapshot = "SELECT CONCAT(CONVERT(nvarchar(64), owner, 2), N'|', fence, N'|', point, N'|', \
                    state, N'|', status, N'|', CONVERT(nvarchar(40), updated_at, 126)) FROM idem_run";
    let before = text(&b, snapshot).await;

    let mut tx = b.begin_runs(None).await.unwrap();
    assert!(
        !b.write_run(&mut tx, &scope(), &k, "owner-x", &write("owner-x", "p1"))
            .await
            .unwrap()
    );
    b.commit_runs(tx).await.unwrap();
    assert_eq!(
        text(&b, snapshot).await,
        before,
        "a refused write changes nothing"
    );

    let mut tx = b.begin_runs(None).await.unwrap();
    for _ in 0..2 {
        let w = write("owner-a", "p1");
        assert!(
            b.write_run(&mut tx, &scope(), &k, "owner-a", &w)
                .await
                .unwrap()
        );
    }
    let takeover = RunWrite {
        fence: 1,
        ..write("owner-b", "p1")
    };
    assert!(
        b.write_run(&mut tx, &scope(), &k, "owner-a", &takeover)
            .await
            .unwrap()
    );
    let finish = RunWrite {
        fence: 1,
        status: Some(Status::Rejected),
        response: Some(r#""declined""#),
        ..write("owner-b", "p1")
    };
    assert!(
        b.write_run(&mut tx, &scope(), &k, "owner-b", &finish)
            .await
            .unwrap()
    );
    b.commit_runs(tx).await.unwrap();

    let mut tx = b.begin_runs(None).await.unwrap();
    let after = RunWrite {
        fence: 1,
        ..write("owner-b", "p2")
    };
    assert!(
        !b.write_run(&mut tx, &scope(), &k, "owner-b", &after)
            .await
            .unwrap(),
        "a finished run is never written again"
    );
    let row = b.read_run(&mut tx, &scope(), &k).await.unwrap().unwrap();
    assert_eq!(
        (row.owner.as_str(), row.fence, row.point.as_str()),
        ("owner-b", 1, "p1")
    );
    assert_eq!(row.status, Some(Status::Rejected));
    assert_eq!(row.response.as_deref(), Some(r#""declined""#));
    assert!(
        !b.delete_run(&mut tx, &scope(), &k, "owner-a")
            .await
            .unwrap()
    );
    assert!(
        b.delete_run(&mut tx, &scope(), &k, "owner-b")
            .await
            .unwrap()
    );
    b.commit_runs(tx).await.unwrap();
    assert_eq!(scalar(&b, "SELECT COUNT_BIG(*) FROM idem_run").await, 0);
    drop_private(admin, b, name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_MSSQL_URL (no SQL Server on the project's machines: not verified live)"]
async fn relays_skip_each_others_rows_but_see_them_as_unsent() {
    let url = url();
    let (admin, b, name) = private(&url, "outbox_skip", 4).await;
    enqueue(&b, &[("a", "m1"), ("a", "m2"), ("a", "m3"), ("b", "m4")]).await;

    let mut first = b.begin_runs(None).await.unwrap();
    let mine = b.lock_unsent(&mut first, 2).await.unwrap();
    assert_eq!(mine.len(), 2);
    assert_eq!(
        (mine[0].destination.as_str(), mine[0].message_id.as_str()),
        ("a", "m1")
    );
    assert_eq!(mine[0].payload, r#"{"id":"m1"}"#);

    let mut second = b.begin_runs(None).await.unwrap();
    let theirs = b.lock_unsent(&mut second, 10).await.unwrap();
    assert_eq!(theirs.len(), 2, "READPAST skips the first relay's rows");
    assert!(theirs[0].id > mine[1].id);
    let mut expected = ids(&mine);
    expected.push(theirs[0].id);
    assert_eq!(
        b.unsent_ids(&mut second, "a", theirs[0].id).await.unwrap(),
        expected
    );

    b.mark_sent(&mut first, &ids(&mine)).await.unwrap();
    b.commit_runs(first).await.unwrap();
    assert_eq!(
        b.unsent_ids(&mut second, "a", theirs[0].id).await.unwrap(),
        [theirs[0].id]
    );
    b.mark_sent(&mut second, &ids(&theirs)).await.unwrap();
    b.commit_runs(second).await.unwrap();
    assert_eq!(
        scalar(
            &b,
            "SELECT COUNT_BIG(*) FROM idem_outbox WHERE sent_at IS NOT NULL"
        )
        .await,
        4
    );
    drop_private(admin, b, name).await;
}

#[tokio::test]
#[ignore = "needs IDEM_MSSQL_URL (no SQL Server on the project's machines: not verified live)"]
async fn purges_delete_only_expired_runs_and_sent_messages() {
    let url = url();
    let (admin, b, name) = private(&url, "runs_purge", 4).await;
    committed_run(&b, &key("expired"), "o", HOUR, Duration::ZERO).await;
    committed_run(&b, &key("live"), "o", HOUR, HOUR).await;
    enqueue(&b, &[("a", "sent"), ("a", "unsent")]).await;
    let mut tx = b.begin_runs(None).await.unwrap();
    let first = b.lock_unsent(&mut tx, 1).await.unwrap();
    b.mark_sent(&mut tx, &ids(&first)).await.unwrap();
    b.commit_runs(tx).await.unwrap();

    assert_eq!(b.purge_batch(Table::Runs, HOUR, 100).await.unwrap(), 0);
    assert_eq!(b.purge_batch(Table::Outbox, HOUR, 100).await.unwrap(), 0);
    assert_eq!(
        b.purge_batch(Table::Runs, Duration::ZERO, 100)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        b.purge_batch(Table::Outbox, Duration::ZERO, 100)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        b.purge_batch(Table::Outbox, Duration::ZERO, 100)
            .await
            .unwrap(),
        0,
        "an unsent message is never purged"
    );
    assert_eq!(scalar(&b, "SELECT COUNT_BIG(*) FROM idem_run").await, 1);
    assert_eq!(
        scalar(
            &b,
            "SELECT COUNT_BIG(*) FROM idem_outbox WHERE sent_at IS NULL"
        )
        .await,
        1
    );
    drop_private(admin, b, name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_MSSQL_URL (no SQL Server on the project's machines: not verified live)"]
async fn a_bounded_wait_for_a_held_run_is_a_lock_timeout_and_is_given_back() {
    let url = url();
    // Two connections: the holder's and the waiter's, which is reused afterwards.
    let (admin, b, name) = private(&url, "runs_wait", 2).await;
    let k = key("held");
    committed_run(&b, &k, "o", HOUR, HOUR).await;
    let own = scalar(&b, "SELECT CAST(@@LOCK_TIMEOUT AS bigint)").await;

    let mut holder = b.begin_runs(None).await.unwrap();
    assert!(
        b.read_run(&mut holder, &scope(), &k)
            .await
            .unwrap()
            .is_some()
    );
    let mut waiter = b.begin_runs(Some(Duration::from_millis(50))).await.unwrap();
    let err = b
        .read_run(&mut waiter, &scope(), &k)
        .await
        .expect_err("the row is held");
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    assert_eq!(err.code(), Some("1222"));
    b.rollback_runs(waiter).await.unwrap();
    assert_eq!(
        scalar(&b, "SELECT CAST(@@LOCK_TIMEOUT AS bigint)").await,
        own
    );
    b.rollback_runs(holder).await.unwrap();

    let mut tx = b.begin_runs(Some(Duration::from_secs(2))).await.unwrap();
    assert!(b.read_run(&mut tx, &scope(), &k).await.unwrap().is_some());
    b.commit_runs(tx).await.unwrap();
    for _ in 0..2 {
        assert_eq!(
            scalar(&b, "SELECT CAST(@@LOCK_TIMEOUT AS bigint)").await,
            own
        );
    }
    drop_private(admin, b, name).await;
}

/// A publisher that keeps what it was given.
#[derive(Default)]
struct Collect(Mutex<Vec<String>>);

impl Publisher for Collect {
    type Error = Infallible;

    async fn publish(&self, message: &OutboxRow) -> Result<(), Infallible> {
        if let Ok(mut seen) = self.0.lock() {
            seen.push(message.message_id.clone());
        }
        Ok(())
    }
}

#[tokio::test]
#[ignore = "needs IDEM_MSSQL_URL (no SQL Server on the project's machines: not verified live)"]
async fn a_phased_run_and_its_outbox_message_end_to_end() {
    let url = url();
    let (admin, b, name) = private(&url, "runs_e2e", 4).await;
    let idem = Idem::new(b.clone()).with_wait_timeout(Duration::from_millis(300));
    let k = key("order-1");
    let request = Request::new(serde_json::json!({"amount": 5}));
    let Started::Run(mut run) = idem
        .start::<Infallible>(&scope(), &k, &request)
        .await
        .unwrap()
    else {
        panic!("a new key starts a run");
    };
    let message = Outgoing::new(
        "orders",
        &run.message_id("order.paid"),
        &serde_json::json!({"order": 1}),
    )
    .unwrap();
    let backend = run.backend().clone();
    let state: u32 = run
        .phase("charged", move |tx| {
            let (backend, message) = (backend.clone(), message.clone());
            Box::pin(async move {
                backend.enqueue(tx, &message).await?;
                Ok::<_, DbError>(7)
            })
        })
        .await
        .unwrap();
    assert_eq!(state, 7);
    let answer: String = run
        .finish(|_tx| Box::pin(async { Ok::<_, DbError>("paid".to_owned()) }))
        .await
        .unwrap();
    assert_eq!(answer, "paid");
    match idem
        .start::<Infallible>(&scope(), &k, &request)
        .await
        .unwrap()
    {
        Started::Finished(f) => assert_eq!(f.json(), r#""paid""#),
        Started::Run(_) => panic!("a finished run replays its answer"),
    }
    let publisher = Collect::default();
    assert_eq!(idem.relay(&publisher, 10).await.unwrap().published, 1);
    assert_eq!(idem.relay(&publisher, 10).await.unwrap().published, 0);
    drop(idem);
    drop_private(admin, b, name).await;
}
