//! Phased runs and the outbox (`RunStore`, `OutboxStore`), live against Oracle.
//! Every test is `#[ignore]`d, so a run without a server reports each as ignored, by
//! name, with the reason (no Oracle server or client on the project's machines: not
//! verified live); `ci/test.sh` runs them with `--include-ignored` when
//! `IDEM_ORACLE_URL` is set. The URL's user needs
//! `CREATE USER`, `DROP USER` and the right to grant `CREATE SESSION`, `CREATE TABLE`
//! and `UNLIMITED TABLESPACE` (for example `SYSTEM` in `FREEPDB1`): each test runs as a
//! private user that it drops afterwards. The statements are snapshot-tested offline in
//! the crate's unit tests.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::convert::Infallible;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::runs::{NewRun, OutboxRow, RunWrite, STARTED};
use idem_core::serde_json::json;
use idem_core::{
    DbError, ErrorKind, Idem, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal,
    Publisher, Request, RunStore, Scope, Started, Status, Table,
};
use idem_oracle::{ConnectOptions, OracleBackend};

const HOUR: Duration = Duration::from_secs(3600);

/// The server's URL. These tests are `#[ignore]`d: `ci/test.sh` runs them with
/// `--include-ignored` when `IDEM_ORACLE_URL` is set.
fn url() -> String {
    match std::env::var("IDEM_ORACLE_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!("IDEM_ORACLE_URL is not set: these tests need a live Oracle"),
    }
}

/// A private user with idem's tables: (admin, backend, user name).
struct Private {
    admin: OracleBackend,
    backend: OracleBackend,
    name: String,
}

impl Private {
    async fn create(url: &str, connections: usize) -> Self {
        let options = ConnectOptions::from_url(url).unwrap();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!("IDEM_RUNS_{}_{nanos}", std::process::id());
        let password = format!("Idem_{nanos:08x}_{:05}_9z", std::process::id() % 100_000);
        let admin = OracleBackend::connect_with(options.clone().max_connections(1))
            .await
            .unwrap();
        let (create, grant) = (
            format!("CREATE USER {name} IDENTIFIED BY \"{password}\""),
            format!("GRANT CREATE SESSION, CREATE TABLE, UNLIMITED TABLESPACE TO {name}"),
        );
        admin
            .interact(move |c| {
                c.execute(&create, &[])?;
                c.execute(&grant, &[]).map(drop)
            })
            .await
            .unwrap();
        let private = ConnectOptions::new(name.clone(), password, options.connect_string())
            .max_connections(connections);
        let backend = OracleBackend::connect_with(private).await.unwrap();
        assert_eq!(backend.migrate().await.unwrap(), vec![1, 2, 3]);
        Self {
            admin,
            backend,
            name,
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        let sql = sql.to_owned();
        self.backend
            .interact(move |c| c.query_row_as::<i64>(&sql, &[]))
            .await
            .unwrap()
    }

    async fn remove(self) {
        let Self {
            admin,
            backend,
            name,
        } = self;
        backend.close().await;
        drop(backend);
        let statement = format!("DROP USER {name} CASCADE");
        for attempt in 1..=10 {
            let sql = statement.clone();
            match admin
                .interact(move |c| c.execute(&sql, &[]).map(drop))
                .await
            {
                // ORA-01940: a session of the user is still logging off.
                Err(e) if e.code() == Some("ORA-01940") && attempt < 10 => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => {
                    other.unwrap();
                    break;
                }
            }
        }
        admin.close().await;
    }
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
    b: &OracleBackend,
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

async fn enqueue(b: &OracleBackend, messages: &[(&str, &str)]) {
    let mut tx = b.begin_runs(None).await.unwrap();
    for (destination, id) in messages {
        let m = Outgoing::new(destination, id, &json!({"id": id})).unwrap();
        b.enqueue(&mut tx, &m).await.unwrap();
    }
    b.commit_runs(tx).await.unwrap();
}

fn ids(rows: &[OutboxRow]) -> Vec<i64> {
    rows.iter().map(|r| r.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_ORACLE_URL (no Oracle on the project's machines: not verified live)"]
async fn conflicts_flags_and_stalled_runs() {
    let url = url();
    let db = Private::create(&url, 4).await;
    let b = &db.backend;
    let (ended, expired, live) = (key("lease-ended"), key("expired"), key("live"));
    committed_run(b, &ended, "o", Duration::ZERO, HOUR).await;
    committed_run(b, &expired, "o", HOUR, Duration::ZERO).await;
    committed_run(b, &live, "o", HOUR, HOUR).await;

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
    db.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_ORACLE_URL (no Oracle on the project's machines: not verified live)"]
async fn the_guarded_write_refuses_a_stale_owner_and_a_finished_run() {
    let url = url();
    let db = Private::create(&url, 4).await;
    let b = &db.backend;
    let k = key("k-w");
    committed_run(b, &k, "owner-a", HOUR, HOUR).await;

    let mut tx = b.begin_runs(None).await.unwrap();
    assert!(
        !b.write_run(&mut tx, &scope(), &k, "owner-x", &write("owner-x", "p1"))
            .await
            .unwrap()
    );
    b.commit_runs(tx).await.unwrap();
    assert_eq!(
        db.count("SELECT COUNT(*) FROM idem_run WHERE point = 'started' AND state IS NULL")
            .await,
        1,
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
    assert_eq!(db.count("SELECT COUNT(*) FROM idem_run").await, 0);
    db.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_ORACLE_URL (no Oracle on the project's machines: not verified live)"]
async fn relays_skip_each_others_rows_but_see_them_as_unsent() {
    let url = url();
    let db = Private::create(&url, 4).await;
    let b = &db.backend;
    enqueue(b, &[("a", "m1"), ("a", "m2"), ("a", "m3"), ("b", "m4")]).await;

    let mut first = b.begin_runs(None).await.unwrap();
    let mine = b.lock_unsent(&mut first, 2).await.unwrap();
    assert_eq!(mine.len(), 2, "at most the limit is fetched, and locked");
    assert_eq!(
        (mine[0].destination.as_str(), mine[0].message_id.as_str()),
        ("a", "m1")
    );
    assert_eq!(mine[0].payload, r#"{"id":"m1"}"#);

    let mut second = b.begin_runs(None).await.unwrap();
    let theirs = b.lock_unsent(&mut second, 10).await.unwrap();
    assert_eq!(theirs.len(), 2, "SKIP LOCKED skips the first relay's rows");
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
        db.count("SELECT COUNT(*) FROM idem_outbox WHERE sent_at IS NOT NULL")
            .await,
        4
    );
    db.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_ORACLE_URL (no Oracle on the project's machines: not verified live)"]
async fn purges_delete_only_expired_runs_and_sent_messages() {
    let url = url();
    let db = Private::create(&url, 4).await;
    let b = &db.backend;
    committed_run(b, &key("expired"), "o", HOUR, Duration::ZERO).await;
    committed_run(b, &key("live"), "o", HOUR, HOUR).await;
    enqueue(b, &[("a", "sent"), ("a", "unsent")]).await;
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
    assert_eq!(db.count("SELECT COUNT(*) FROM idem_run").await, 1);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM idem_outbox WHERE sent_at IS NULL")
            .await,
        1
    );
    db.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_ORACLE_URL (no Oracle on the project's machines: not verified live)"]
async fn a_bounded_wait_for_a_held_run_is_a_lock_timeout() {
    let url = url();
    let db = Private::create(&url, 4).await;
    let b = &db.backend;
    let k = key("held");
    committed_run(b, &k, "o", HOUR, HOUR).await;

    let mut holder = b.begin_runs(None).await.unwrap();
    assert!(
        b.read_run(&mut holder, &scope(), &k)
            .await
            .unwrap()
            .is_some()
    );
    let mut waiter = b
        .begin_runs(Some(Duration::from_millis(200)))
        .await
        .unwrap();
    let err = b
        .read_run(&mut waiter, &scope(), &k)
        .await
        .expect_err("the row is held");
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    assert!(
        matches!(err.code(), Some("DPI-1067" | "ORA-03156")),
        "{err}"
    );
    // Rolling back may find the cut connection unusable: the pool then closes it.
    let _ = b.rollback_runs(waiter).await;
    b.rollback_runs(holder).await.unwrap();

    let mut tx = b.begin_runs(Some(Duration::from_secs(5))).await.unwrap();
    assert!(b.read_run(&mut tx, &scope(), &k).await.unwrap().is_some());
    b.commit_runs(tx).await.unwrap();
    db.remove().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs IDEM_ORACLE_URL (no Oracle on the project's machines: not verified live)"]
async fn a_phased_run_and_its_outbox_message_end_to_end() {
    let url = url();
    let db = Private::create(&url, 4).await;
    let idem = Idem::new(db.backend.clone()).with_wait_timeout(Duration::from_millis(300));
    let k = key("order-1");
    let request = Request::new(json!({"amount": 5}));
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
        &json!({"order": 1}),
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
    db.remove().await;
}
