//! Phased runs and the outbox, statement by statement (the `RunStore` and `OutboxStore`
//! methods called directly), live (`IDEM_POSTGRES_URL`, default the local server; fails
//! if unreachable). Each test works in a schema of its own and drops it.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::str::FromStr;
use std::time::Duration;

use idem_core::runs::{NewRun, RunWrite, STARTED};
use idem_core::{
    ErrorKind, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal, RunStore, Scope,
    Status, Table,
};
use idem_postgres::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use idem_postgres::{PgBackend, PurgeStyle, sqlx};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn unique() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() & 0xff_ffff)
        .unwrap_or(0);
    format!("{}_{nanos:06x}", std::process::id())
}

/// A migrated private schema: (admin pool, backend on the schema with `connections`
/// connections, schema name).
async fn private(prefix: &str, connections: u32) -> (PgPool, PgBackend, String) {
    let schema = format!("idem_t_{prefix}_{}", unique());
    let options = PgConnectOptions::from_str(&url()).unwrap();
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {} (set IDEM_POSTGRES_URL): {e}", url()));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let backend = PgBackend::connect_with(
        options.options([("search_path", schema.as_str())]),
        connections,
    )
    .await
    .unwrap();
    backend.migrate().await.unwrap();
    (admin, backend, schema)
}

async fn drop_private(admin: PgPool, backend: PgBackend, schema: String) {
    backend.pool().close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
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
async fn started(backend: &PgBackend, k: &str, owner: &str, lease: Duration, retention: Duration) {
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

async fn enqueued(backend: &PgBackend, messages: &[(&str, &str)]) {
    let mut tx = backend.begin_runs(None).await.unwrap();
    for (destination, id) in messages {
        backend
            .enqueue(&mut tx, &message(destination, id))
            .await
            .unwrap();
    }
    backend.commit_runs(tx).await.unwrap();
}

#[tokio::test]
async fn runs_are_inserted_once_read_and_written_only_by_their_owner() {
    let (admin, backend, schema) = private("runs", 4).await;
    let (s, k) = (scope(), key("k1"));
    started(&backend, "k1", "owner-a", HOUR, HOUR).await;

    // A second insert of the identity inserts nothing; the read sees the first run.
    let mut tx = backend.begin_runs(None).await.unwrap();
    let again = backend
        .insert_run(&mut tx, &s, &k, &new_run("owner-b", HOUR, HOUR))
        .await
        .unwrap();
    assert!(!again, "the identity is taken");
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

    // A stale owner's write changes nothing.
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
    let unchanged = backend.read_run(&mut tx, &s, &k).await.unwrap().unwrap();
    assert_eq!(unchanged, row);

    // The owner's write moves the run on; a zero lease ends the lease at once.
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
    // A takeover: a new owner, the fence raised, written while the old owner is expected.
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
    // The earlier owner is refused from now on.
    assert!(
        !backend
            .write_run(&mut tx, &s, &k, "owner-a", &phase)
            .await
            .unwrap()
    );
    // The final answer, then nothing more: a finished run is never written again.
    let finish = RunWrite {
        owner: "owner-c",
        fence: 1,
        point: "order_created",
        state: Some(r#"{"order":7}"#),
        status: Some(Status::Succeeded),
        response: Some(r#"{"paid":true}"#),
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
    assert_eq!(row.status, Some(Status::Succeeded));
    assert_eq!(row.response.as_deref(), Some(r#"{"paid":true}"#));
    backend.rollback_runs(tx).await.unwrap();

    // Expired: retention zero. Deleted (by its owner) and inserted again in one
    // transaction, as a start replaces an expired run.
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

    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn stalled_runs_are_the_unfinished_unexpired_ones_whose_lease_ended() {
    let (admin, backend, schema) = private("stalled", 4).await;
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
        status: Some(Status::Rejected),
        response: Some(r#"{"declined":true}"#),
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
    assert_eq!(stalled[0].key, "stalled");
    assert_eq!(stalled[0].principal, "p");
    assert_eq!(stalled[0].operation, "order:v1");
    assert_eq!(stalled[0].point, STARTED);
    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn a_second_relay_skips_the_rows_the_first_holds() {
    let (admin, backend, schema) = private("skiplocked", 4).await;
    enqueued(
        &backend,
        &[("a", "m1"), ("a", "m2"), ("b", "m3"), ("a", "m4")],
    )
    .await;

    let mut first = backend.begin_runs(None).await.unwrap();
    let held = backend.lock_unsent(&mut first, 2).await.unwrap();
    let held_ids: Vec<&str> = held.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(held_ids, ["m1", "m2"]);
    assert_eq!(held[0].destination, "a");
    assert_eq!(held[0].payload, r#"{"m":"m1"}"#);

    let mut second = backend.begin_runs(None).await.unwrap();
    let rows = tokio::time::timeout(HANG_GUARD, backend.lock_unsent(&mut second, 10))
        .await
        .expect("SKIP LOCKED never waits")
        .unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(ids, ["m3", "m4"], "the first relay's rows are skipped");
    // The plain read still sees the held rows (so the relay can keep the order).
    let unsent = tokio::time::timeout(HANG_GUARD, backend.unsent_ids(&mut second, "a", rows[1].id))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(unsent, [held[0].id, held[1].id, rows[1].id]);
    backend
        .mark_sent(&mut second, &[rows[0].id, rows[1].id])
        .await
        .unwrap();
    backend.commit_runs(second).await.unwrap();
    backend.rollback_runs(first).await.unwrap();

    // Released: the next relay gets the first relay's rows; the sent ones are gone.
    let mut tx = backend.begin_runs(None).await.unwrap();
    let rest = backend.lock_unsent(&mut tx, 10).await.unwrap();
    let rest_ids: Vec<&str> = rest.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(rest_ids, ["m1", "m2"]);
    assert_eq!(
        backend.unsent_ids(&mut tx, "b", i64::MAX).await.unwrap(),
        Vec::<i64>::new()
    );
    backend.mark_sent(&mut tx, &[]).await.unwrap();
    backend.rollback_runs(tx).await.unwrap();
    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn purges_delete_expired_runs_and_sent_messages_only() {
    let (admin, backend, schema) = private("purge", 4).await;
    for style in [PurgeStyle::SkipLocked, PurgeStyle::Distributed] {
        let backend = backend.clone().with_purge_style(style);
        sqlx::raw_sql("TRUNCATE idem_run; TRUNCATE idem_outbox")
            .execute(backend.pool())
            .await
            .unwrap();
        started(&backend, "live", "o1", Duration::ZERO, HOUR).await;
        started(&backend, "expired", "o2", HOUR, Duration::ZERO).await;
        enqueued(&backend, &[("a", "m1"), ("a", "m2"), ("b", "m3")]).await;
        let mut tx = backend.begin_runs(None).await.unwrap();
        let rows = backend.lock_unsent(&mut tx, 2).await.unwrap();
        backend
            .mark_sent(&mut tx, &[rows[0].id, rows[1].id])
            .await
            .unwrap();
        backend.commit_runs(tx).await.unwrap();

        // Not old enough yet.
        assert_eq!(
            backend.purge_batch(Table::Runs, HOUR, 100).await.unwrap(),
            0
        );
        assert_eq!(
            backend.purge_batch(Table::Outbox, HOUR, 100).await.unwrap(),
            0
        );
        // Bounded batches.
        assert_eq!(
            backend
                .purge_batch(Table::Outbox, Duration::ZERO, 1)
                .await
                .unwrap(),
            1,
            "{style:?}"
        );
        assert_eq!(
            backend
                .purge_batch(Table::Outbox, Duration::ZERO, 100)
                .await
                .unwrap(),
            1,
            "{style:?}"
        );
        assert_eq!(
            backend
                .purge_batch(Table::Runs, Duration::ZERO, 100)
                .await
                .unwrap(),
            1,
            "{style:?}"
        );
        let runs: Vec<String> = sqlx::query_scalar("SELECT request_key FROM idem_run")
            .fetch_all(backend.pool())
            .await
            .unwrap();
        assert_eq!(runs, ["live"], "a stalled but unexpired run stays");
        let unsent: Vec<String> =
            sqlx::query_scalar("SELECT message_id FROM idem_outbox WHERE sent_at IS NULL")
                .fetch_all(backend.pool())
                .await
                .unwrap();
        let all: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox")
            .fetch_one(backend.pool())
            .await
            .unwrap();
        assert_eq!((unsent, all), (vec!["m3".to_owned()], 1), "unsent stays");
    }
    drop_private(admin, backend, schema).await;
}

#[tokio::test]
async fn a_bounded_start_waits_for_a_held_run_at_most_its_bound() {
    // Two connections: the holder's and the bounded one's.
    let (admin, backend, schema) = private("locktimeout", 2).await;
    let (s, k) = (scope(), key("held"));
    started(&backend, "held", "o1", HOUR, HOUR).await;

    let mut holder = backend.begin_runs(None).await.unwrap();
    assert!(
        backend
            .read_run(&mut holder, &s, &k)
            .await
            .unwrap()
            .is_some()
    );

    let mut bounded = backend
        .begin_runs(Some(Duration::from_millis(50)))
        .await
        .unwrap();
    let err = tokio::time::timeout(HANG_GUARD, backend.read_run(&mut bounded, &s, &k))
        .await
        .expect("the wait is bounded")
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    assert_eq!(err.code(), Some("55P03"));
    backend.rollback_runs(bounded).await.unwrap();

    // An uncommitted insert of the same identity bounds a start's insert the same way.
    let mut inserter = backend.begin_runs(None).await.unwrap();
    backend.rollback_runs(holder).await.unwrap();
    assert!(
        backend
            .insert_run(&mut inserter, &s, &key("new"), &new_run("o2", HOUR, HOUR))
            .await
            .unwrap()
    );
    let mut bounded = backend
        .begin_runs(Some(Duration::from_millis(50)))
        .await
        .unwrap();
    let err = tokio::time::timeout(
        HANG_GUARD,
        backend.insert_run(&mut bounded, &s, &key("new"), &new_run("o3", HOUR, HOUR)),
    )
    .await
    .expect("the wait is bounded")
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LockTimeout, "{err}");
    backend.rollback_runs(bounded).await.unwrap();
    backend.rollback_runs(inserter).await.unwrap();

    // The bound was transaction-local: both pooled sessions have their own value back.
    let mut tx = backend.begin_runs(None).await.unwrap();
    let mut other = backend.begin_runs(None).await.unwrap();
    for tx in [&mut tx, &mut other] {
        let value: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&mut **tx)
            .await
            .unwrap();
        assert_eq!(value, "0", "no bound without a wait");
    }
    backend.rollback_runs(other).await.unwrap();
    backend.rollback_runs(tx).await.unwrap();
    drop_private(admin, backend, schema).await;
}

/// `migrations/grants.sql` covers the new tables: the writer runs every run
/// and outbox statement, the purger purges both, neither can do the other's work.
#[tokio::test]
async fn the_least_privilege_roles_cover_runs_and_the_outbox() {
    const GRANTS: &str = include_str!("../migrations/grants.sql");
    let (admin, owner, schema) = private("grants", 2).await;
    let s = unique();
    let (writer_role, purger_role) = (format!("idem_writer_{s}"), format!("idem_purger_{s}"));
    let (writer, purger) = (format!("idem_w_{s}"), format!("idem_p_{s}"));
    let script = GRANTS
        .replace("idem_writer", &writer_role)
        .replace("idem_purger", &purger_role);
    sqlx::raw_sql(sqlx::AssertSqlSafe(script))
        .execute(owner.pool())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {writer} LOGIN PASSWORD 'pw-{writer}' IN ROLE {writer_role}; \
         CREATE ROLE {purger} LOGIN PASSWORD 'pw-{purger}' IN ROLE {purger_role};"
    )))
    .execute(&admin)
    .await
    .unwrap();

    let connect_as = |user: String| {
        let schema = schema.clone();
        async move {
            let options = PgConnectOptions::from_str(&url())
                .unwrap()
                .username(&user)
                .password(&format!("pw-{user}"))
                .options([("search_path", schema.as_str())]);
            PgBackend::connect_with(options, 2).await.unwrap()
        }
    };
    let (writer_db, purger_db) = (
        connect_as(writer.clone()).await,
        connect_as(purger.clone()).await,
    );
    let checks = tokio::spawn(async move {
        let (s, k) = (scope(), key("k"));
        // The writer: every statement of a start, a phase, a replacement and a relay.
        started(&writer_db, "k", "o1", Duration::ZERO, Duration::ZERO).await;
        let mut tx = writer_db
            .begin_runs(Some(Duration::from_secs(5)))
            .await
            .unwrap();
        let row = writer_db.read_run(&mut tx, &s, &k).await.unwrap().unwrap();
        let write = RunWrite {
            owner: "o2",
            fence: 1,
            point: "p1",
            state: Some("{}"),
            status: None,
            response: None,
            lease: HOUR,
        };
        assert!(
            writer_db
                .write_run(&mut tx, &s, &k, &row.owner, &write)
                .await
                .unwrap()
        );
        assert!(writer_db.delete_run(&mut tx, &s, &k, "o2").await.unwrap());
        writer_db
            .enqueue(&mut tx, &message("a", "m1"))
            .await
            .unwrap();
        writer_db.commit_runs(tx).await.unwrap();
        assert!(writer_db.stalled_runs(10).await.unwrap().is_empty());
        started(&writer_db, "expired", "o1", HOUR, Duration::ZERO).await;
        let mut tx = writer_db.begin_runs(None).await.unwrap();
        let rows = writer_db.lock_unsent(&mut tx, 10).await.unwrap();
        assert_eq!(
            writer_db
                .unsent_ids(&mut tx, "a", rows[0].id)
                .await
                .unwrap(),
            [rows[0].id]
        );
        writer_db.mark_sent(&mut tx, &[rows[0].id]).await.unwrap();
        writer_db.commit_runs(tx).await.unwrap();
        // The writer cannot purge the outbox, nor re-key a run.
        let refused = writer_db
            .purge_batch(Table::Outbox, Duration::ZERO, 10)
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Some("42501"), "{refused}");
        let rekey = sqlx::query("UPDATE idem_run SET request_key = 'other'")
            .execute(writer_db.pool())
            .await
            .unwrap_err();
        assert_eq!(
            rekey.as_database_error().and_then(|d| d.code()).as_deref(),
            Some("42501")
        );
        // The purger purges both tables, and cannot write either.
        assert_eq!(
            purger_db
                .purge_batch(Table::Runs, Duration::ZERO, 10)
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            purger_db
                .purge_batch(Table::Outbox, Duration::ZERO, 10)
                .await
                .unwrap(),
            1
        );
        let mut tx = purger_db.begin_runs(None).await.unwrap();
        let err = purger_db
            .enqueue(&mut tx, &message("a", "m2"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some("42501"), "{err}");
        purger_db.rollback_runs(tx).await.unwrap();
        writer_db.pool().close().await;
        purger_db.pool().close().await;
    })
    .await;
    drop_private(admin, owner, schema).await;
    let cleanup = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url())
        .await
        .unwrap();
    for role in [&writer, &purger, &writer_role, &purger_role] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
            .execute(&cleanup)
            .await
            .unwrap();
    }
    cleanup.close().await;
    if let Err(e) = checks {
        std::panic::resume_unwind(e.into_panic());
    }
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
    tx: &mut idem_postgres::PgTx,
    n: i64,
) -> idem_core::BoxFuture<'_, Result<i64, idem_core::DbError>> {
    Box::pin(async move {
        sqlx::query_scalar("INSERT INTO t (n) VALUES ($1) RETURNING n")
            .bind(n)
            .fetch_one(&mut **tx)
            .await
            .map_err(idem_postgres::db_error)
    })
}

/// Through idem-core: a start, a phase, a takeover after the lease ran out (the earlier
/// owner's phase is refused and rolled back), a finish that enqueues a message, the
/// replay, and the relay.
#[tokio::test]
async fn a_phased_run_end_to_end() {
    use idem_core::{DbError, Error, Idem, Request, Started};

    let (admin, backend, schema) = private("e2e", 4).await;
    sqlx::raw_sql("CREATE TABLE t (n bigint NOT NULL)")
        .execute(backend.pool())
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
    // The lease is live: a retry is told the run is in progress.
    let busy = idem.start::<DbError>(&s, &k, &request).await.unwrap_err();
    assert!(matches!(busy, Error::InProgress { .. }), "{busy:?}");

    // The lease runs out: a retry takes over at the last recovery point.
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
    let rows: Vec<i64> = sqlx::query_scalar("SELECT n FROM t ORDER BY n")
        .fetch_all(backend.pool())
        .await
        .unwrap();
    assert_eq!(rows, [1], "the stale owner's phase was rolled back");

    let recorder = Recorder::default();
    assert_eq!(idem.relay(&recorder, 10).await.unwrap().published, 1);
    assert_eq!(idem.relay(&recorder, 10).await.unwrap().published, 0);
    let published = recorder.0.lock().unwrap().clone();
    assert_eq!(published.len(), 1);
    assert_eq!(published[0].destination, "orders");
    drop_private(admin, backend, schema).await;
}
