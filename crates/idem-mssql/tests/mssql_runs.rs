//! What only SQL Server does for phased runs: the run transaction's `LOCK_TIMEOUT`, given
//! back to the session. What every engine must do is in the conformance suite
//! (`idem-conformance`, run by `tests/mssql.rs` when `IDEM_MSSQL_URL` is set).
//! Every test is `#[ignore]`d, so a run without a server reports each as ignored, by
//! name, with the reason (no SQL Server on the project's machines: not verified live);
//! `ci/test.sh` runs them with `--include-ignored` when `IDEM_MSSQL_URL` is set. The statements are
//! snapshot-tested offline in the crate's unit tests.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::runs::{NewRun, STARTED};
use idem_core::{ErrorKind, Key, Maintenance, Operation, Principal, RunStore, Scope};
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
    assert_eq!(backend.migrate().await.unwrap(), vec![1, 2, 3, 4, 5]);
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
