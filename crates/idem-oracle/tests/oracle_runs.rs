//! What only Oracle does for phased runs: the run transaction's bound through the call
//! timeout. What every engine must do is in the conformance suite (`idem-conformance`,
//! run by `tests/oracle.rs` when `IDEM_ORACLE_URL` is set).
//! Every test is `#[ignore]`d, so a run without a server reports each as ignored, by
//! name, with the reason (no Oracle server or client on the project's machines: not
//! verified live); `ci/test.sh` runs them with `--include-ignored` when
//! `IDEM_ORACLE_URL` is set. The URL's user needs
//! `CREATE USER`, `DROP USER` and the right to grant `CREATE SESSION`, `CREATE TABLE`
//! and `UNLIMITED TABLESPACE` (for example `SYSTEM` in `FREEPDB1`): each test runs as a
//! private user that it drops afterwards. The statements are snapshot-tested offline in
//! the crate's unit tests.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::runs::{NewRun, STARTED};
use idem_core::{ErrorKind, Key, Maintenance, Operation, Principal, RunStore, Scope};
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
        assert_eq!(backend.migrate().await.unwrap(), vec![1, 2, 3, 4, 5]);
        Self {
            admin,
            backend,
            name,
        }
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
