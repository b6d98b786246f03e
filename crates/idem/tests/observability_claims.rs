//! The `in_progress` outcome, which SQLite never produces (its single writer makes every
//! claim wait its turn): two calls with one key on PostgreSQL and on MySQL/MariaDB, the
//! second refused while the first holds the claim, counted with the engine's label.
//! Requires both servers (`IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`); unreachable fails.

#![allow(clippy::unwrap_used)]

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use idem::core::observe;
use idem::mysql::MysqlBackend;
use idem::mysql::mysql_async::prelude::Queryable;
use idem::postgres::PgBackend;
use idem::postgres::sqlx::{self, postgres::PgConnectOptions};
use idem::{Backend, Error, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde_json::{Value, json};

type Answer = Result<Outcome<Value>, Error<std::io::Error>>;

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// Runs `calls` on a current-thread runtime with a recorder of this thread's metrics.
fn recorded<F: Future<Output = (Answer, Answer)>>(
    calls: impl FnOnce() -> F,
) -> ((Answer, Answer), Snapshotter) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let answers = metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(calls())
    });
    (answers, snapshotter)
}

/// The first call claims the key and holds it until the second has its answer.
async fn held_key<B: Backend>(idem: &Idem<B>) -> (Answer, Answer) {
    let scope = Scope::new(
        Principal::new("account-1").unwrap(),
        Operation::new("debit", 1).unwrap(),
    );
    let key = Key::new("held-key").unwrap();
    let request = Request::new(json!({"amount": 1}));
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let mut started_tx = Some(started_tx);
    let mut release_rx = Some(release_rx);
    let holder = idem.execute(&scope, &key, &request, |_tx| {
        let started = started_tx.take();
        let release = release_rx.take();
        Box::pin(async move {
            if let Some(started) = started {
                let _ = started.send(());
            }
            if let Some(release) = release {
                // Bounded: a missing release ends the effect instead of hanging.
                let _ = tokio::time::timeout(Duration::from_secs(60), release).await;
            }
            Ok::<_, std::io::Error>(json!({"balance": 99}))
        })
    });
    let waiter = async {
        started_rx.await.unwrap();
        let answer = idem
            .execute(&scope, &key, &request, |_tx| {
                Box::pin(async { Ok::<_, std::io::Error>(json!({"ran": "twice"})) })
            })
            .await;
        let _ = release_tx.send(());
        answer
    };
    tokio::join!(holder, waiter)
}

/// The first call executed, the second was refused as in progress, and the metrics say
/// so under `engine`.
fn check((first, second): (Answer, Answer), snapshotter: &Snapshotter, engine: &str) {
    assert!(
        matches!(first, Ok(Outcome::Executed(_))),
        "{engine}: {first:?}"
    );
    assert!(
        matches!(second, Err(Error::InProgress { .. })),
        "{engine}: {second:?}"
    );
    let snapshot = snapshotter.snapshot().into_vec();
    // Counters as their value, histograms as their number of samples.
    let value = |kind: MetricKind, name: &str, outcome: Option<&str>| -> Vec<u64> {
        snapshot
            .iter()
            .filter(|(k, ..)| {
                let labels: Vec<(&str, &str)> =
                    k.key().labels().map(|l| (l.key(), l.value())).collect();
                k.kind() == kind
                    && k.key().name() == name
                    && labels.contains(&("call", "execute"))
                    && labels.contains(&("engine", engine))
                    && outcome.is_none_or(|o| labels.contains(&("outcome", o)))
            })
            .map(|(.., v)| match v {
                DebugValue::Counter(n) => *n,
                DebugValue::Histogram(samples) => samples.len() as u64,
                DebugValue::Gauge(_) => panic!("{name} is not a gauge"),
            })
            .collect()
    };
    assert_eq!(
        value(MetricKind::Counter, observe::IN_PROGRESS, None),
        vec![1],
        "{engine}"
    );
    assert_eq!(
        value(MetricKind::Counter, observe::EXECUTED, None),
        vec![1],
        "{engine}"
    );
    assert_eq!(
        value(
            MetricKind::Histogram,
            observe::CALL_DURATION,
            Some("in_progress")
        ),
        vec![1],
        "{engine}"
    );
}

#[test]
fn postgres_a_call_refused_while_another_holds_the_key_counts_as_in_progress() {
    let (answers, snapshotter) = recorded(|| async {
        let admin = PgBackend::connect(&postgres_url()).await.unwrap();
        let ns = format!("idem_obs_{}", std::process::id());
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {ns} CASCADE"
        )))
        .execute(admin.pool())
        .await
        .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {ns}")))
            .execute(admin.pool())
            .await
            .unwrap();
        let options = PgConnectOptions::from_str(&postgres_url())
            .unwrap()
            .options([("search_path", ns.as_str())]);
        let backend = PgBackend::connect_with(options, 4).await.unwrap();
        let idem = Idem::new(backend).with_wait_timeout(Duration::from_millis(300));
        idem.migrate().await.unwrap();
        let answers = held_key(&idem).await;
        drop(idem);
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {ns} CASCADE")))
            .execute(admin.pool())
            .await
            .unwrap();
        answers
    });
    check(answers, &snapshotter, "postgres");
}

#[test]
fn mysql_a_call_refused_while_another_holds_the_key_counts_as_in_progress() {
    let (answers, snapshotter) = recorded(|| async {
        // A database of its own, next to the test database of the URL.
        let url = mysql_url();
        let (server, _) = url.rsplit_once('/').unwrap();
        let db = format!("idem_obs_{}", std::process::id());
        let admin = MysqlBackend::connect(&url).await.unwrap();
        let sql = |statement: String| {
            let pool = admin.pool().clone();
            async move {
                let mut conn = pool.get_conn().await.unwrap();
                conn.query_drop(statement).await.unwrap();
            }
        };
        sql(format!("DROP DATABASE IF EXISTS {db}")).await;
        sql(format!("CREATE DATABASE {db}")).await;
        let backend = MysqlBackend::connect(&format!("{server}/{db}"))
            .await
            .unwrap();
        let idem = Idem::new(backend).with_wait_timeout(Duration::from_millis(300));
        idem.migrate().await.unwrap();
        let answers = held_key(&idem).await;
        drop(idem);
        sql(format!("DROP DATABASE {db}")).await;
        answers
    });
    check(answers, &snapshotter, "mysql");
}
