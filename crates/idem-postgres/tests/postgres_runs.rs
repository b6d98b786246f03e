//! What only PostgreSQL does for phased runs and the outbox, live (`IDEM_POSTGRES_URL`,
//! default the local server; fails if unreachable): the transaction-local
//! `lock_timeout`, a table lock told apart from a held run, and the least-privilege
//! roles of `grants.sql`. What every engine must do is in the conformance suite
//! (`idem-conformance`, run by `tests/postgres.rs`). Each test works in a schema of its
//! own and drops it.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::str::FromStr;
use std::time::Duration;

use idem_core::runs::{NewRun, RunGuard, RunWrite, STARTED};
use idem_core::{
    Error, ErrorKind, Idem, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal,
    Publisher, Request, RunStore, Scope, Table,
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

/// A broker that refuses everything.
struct Refuse;

impl Publisher for Refuse {
    type Error = std::io::Error;

    async fn publish(&self, _: &idem_core::runs::OutboxRow) -> Result<(), std::io::Error> {
        Err(std::io::Error::other("refused"))
    }
}

/// A broker that takes everything.
struct Accept;

impl Publisher for Accept {
    type Error = std::io::Error;

    async fn publish(&self, _: &idem_core::runs::OutboxRow) -> Result<(), std::io::Error> {
        Ok(())
    }
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

/// A table lock on `idem_run` (here `LOCK TABLE`; DDL or a migration alike) is not a
/// call holding the key: a start that waited past its bound for it answers LockWait
/// (the probe after the lock timeout found nothing holding the run's row), and a
/// start held up by the run's own row answers InProgress.
#[tokio::test]
async fn a_start_held_up_by_a_table_lock_is_a_lock_wait() {
    let (admin, backend, schema) = private("tablelock", 4).await;
    let (s, k) = (scope(), key("locked"));
    let idem = Idem::new(backend.clone()).with_wait_timeout(Duration::from_millis(300));
    let request = Request::new(serde_json::json!({"amount": 100}));

    let mut locker = admin.begin().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "LOCK TABLE {schema}.idem_run IN ACCESS EXCLUSIVE MODE"
    )))
    .execute(&mut *locker)
    .await
    .unwrap();
    let blocked = tokio::time::timeout(HANG_GUARD, idem.start::<std::io::Error>(&s, &k, &request))
        .await
        .expect("the wait is bounded");
    locker.rollback().await.unwrap();
    assert!(
        matches!(blocked, Err(Error::LockWait { .. })),
        "a table lock: {blocked:?}"
    );
    let shown = blocked.map(drop).unwrap_err().to_string();
    assert!(shown.contains("not for a call with this key"), "{shown}");

    // Without the lock the key is free: the start owns a new run.
    let started = idem.start::<std::io::Error>(&s, &k, &request).await;
    assert!(
        matches!(started, Ok(idem_core::Started::Run(_))),
        "{started:?}"
    );
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

/// The distributed purge style (no row locks, for Citus) deletes the same rows as the
/// default: expired runs and sent messages only.
#[tokio::test]
async fn distributed_purges_delete_expired_runs_and_sent_messages_only() {
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
        let relayed = Idem::new(backend.clone()).relay(&Accept, 2).await.unwrap();
        assert_eq!(relayed.published, 2);
        assert_eq!(
            backend.purge_batch(Table::Runs, HOUR, 100).await.unwrap(),
            0
        );
        assert_eq!(
            backend.purge_batch(Table::Outbox, HOUR, 100).await.unwrap(),
            0
        );
        for (table, limit, want) in [
            (Table::Outbox, 1, 1),
            (Table::Outbox, 100, 1),
            (Table::Runs, 100, 1),
        ] {
            assert_eq!(
                backend
                    .purge_batch(table, Duration::ZERO, limit)
                    .await
                    .unwrap(),
                want,
                "{style:?} {table:?}"
            );
        }
        let runs: Vec<String> = sqlx::query_scalar("SELECT request_key FROM idem_run")
            .fetch_all(backend.pool())
            .await
            .unwrap();
        assert_eq!(runs, ["live"], "a stalled but unexpired run stays");
        let left: Vec<String> = sqlx::query_scalar("SELECT message_id FROM idem_outbox")
            .fetch_all(backend.pool())
            .await
            .unwrap();
        assert_eq!(left, ["m3"], "unsent stays");
    }
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
        let guard = RunGuard {
            owner: &row.owner,
            fence: row.fence,
            point: &row.point,
        };
        assert!(
            writer_db
                .write_run(&mut tx, &s, &k, &guard, &write)
                .await
                .unwrap()
        );
        assert!(
            writer_db
                .renew_lease(&mut tx, &s, &k, "o2", 1, HOUR)
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
        // The relay as the writer: a failed attempt (retry later), dead after the last,
        // the operator's retry, then sent.
        enqueued(&writer_db, &[("b", "m3")]).await;
        let idem = Idem::new(writer_db.clone());
        let options = idem_core::RelayOptions {
            max_attempts: 1,
            ..idem_core::RelayOptions::default()
        };
        let refused = idem.relay_with(&Refuse, &options).await.unwrap();
        assert_eq!((refused.published, refused.dead), (0, 2), "m1 and m3");
        assert_eq!(idem.outbox_retry(&[], None).await.unwrap(), 2);
        let sent = idem.relay_with(&Accept, &options).await.unwrap();
        assert_eq!(sent.published, 2);
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
            2,
            "m1 and m3, both sent"
        );
        let mut tx = purger_db.begin_runs(None).await.unwrap();
        let err = purger_db
            .enqueue(&mut tx, &message("a", "m2"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some("42501"), "{err}");
        purger_db.rollback_runs(tx).await.unwrap();
        // Dropping unsent messages is the purger's (DELETE), not the writer's.
        enqueued(&writer_db, &[("a", "m4")]).await;
        let listed = Idem::new(purger_db.clone())
            .outbox_list(&idem_core::runs::OutboxFilter::default())
            .await
            .unwrap();
        assert_eq!(listed.len(), 1);
        let refused = Idem::new(writer_db.clone())
            .outbox_drop(&[listed[0].id], None)
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Some("42501"), "{refused}");
        assert_eq!(
            Idem::new(purger_db.clone())
                .outbox_drop(&[listed[0].id], None)
                .await
                .unwrap(),
            1
        );
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
