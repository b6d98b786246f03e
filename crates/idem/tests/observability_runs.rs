//! Spans and metrics of phased runs and the outbox relay, on SQLite: every documented
//! run and relay metric is recorded through a test recorder with the values the calls
//! imply, and no span or event carries the key, the request or a message ID.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::core::observe;
use idem::core::runs::OutboxRow;
use idem::core::{RelayOptions, Started};
use idem::sqlite::SqliteBackend;
use idem::{
    DbError, Error, Idem, Key, Operation, OutboxStore, Outgoing, Principal, Publisher, Request,
    Scope,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};
use serde_json::json;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("account-1").unwrap(),
        Operation::new("order", 1).unwrap(),
    )
}

/// Refuses the message IDs it was given; takes the others.
struct Broker(Vec<&'static str>);

impl Publisher for Broker {
    type Error = std::io::Error;

    async fn publish(&self, message: &OutboxRow) -> Result<(), std::io::Error> {
        if self.0.contains(&message.message_id.as_str()) {
            return Err(std::io::Error::other("refused"));
        }
        Ok(())
    }
}

fn noted(
    _tx: &mut idem::sqlite::SqliteTx,
) -> idem::BoxFuture<'_, Result<serde_json::Value, DbError>> {
    Box::pin(async { Ok(json!({ "noted": true })) })
}

/// One of each run and relay signal.
async fn calls() {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    let idem = Idem::new(backend)
        .with_lease(Duration::from_millis(200))
        .with_wait_timeout(Duration::from_millis(50));
    idem.migrate().await.unwrap();
    let key = Key::new("secret-key-RK7").unwrap();
    let request = Request::new(json!({ "note": "secret-request-RQ3" }));

    // Started, a phase, a heartbeat, then released: the next start takes it over and
    // the earlier owner's phase is refused (lease lost).
    let Ok(Started::Run(mut first)) = idem.start::<DbError>(&scope(), &key, &request).await else {
        panic!("a new run")
    };
    first.phase("noted", noted).await.unwrap();
    first.heartbeat::<DbError>().await.unwrap();
    first.release().await.unwrap();
    let Ok(Started::Run(mut second)) = idem.start::<DbError>(&scope(), &key, &request).await else {
        panic!("a takeover")
    };
    assert!(second.resumed());
    let lost = first.phase("stale", noted).await;
    assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
    // Finished, with an outbox message; another run ends failed.
    let outbox = second.backend().clone();
    let message = Outgoing::new("orders", "secret-message-MX1", &json!({})).unwrap();
    second
        .finish(move |tx| {
            let (outbox, message) = (outbox.clone(), message.clone());
            Box::pin(async move {
                outbox.enqueue(tx, &message).await?;
                Ok::<_, DbError>(json!({ "done": true }))
            })
        })
        .await
        .unwrap();
    let other = Key::new("secret-key-RK8").unwrap();
    let Ok(Started::Run(mut third)) = idem.start::<DbError>(&scope(), &other, &request).await
    else {
        panic!("a new run")
    };
    third
        .fail(|_tx| Box::pin(async { Ok::<_, DbError>(json!({ "declined": true })) }))
        .await
        .unwrap();

    // The relay: one published, one failed attempt with attempts left (pending), one
    // dead.
    for (destination, id) in [
        ("retry", "secret-message-MX2"),
        ("dead", "secret-message-MX3"),
    ] {
        let mut tx = idem::RunStore::begin_runs(idem.backend(), None)
            .await
            .unwrap();
        let m = Outgoing::new(destination, id, &json!({})).unwrap();
        idem.backend().enqueue(&mut tx, &m).await.unwrap();
        idem::RunStore::commit_runs(idem.backend(), tx)
            .await
            .unwrap();
    }
    let broker = Broker(vec!["secret-message-MX2", "secret-message-MX3"]);
    let patient = RelayOptions {
        max_attempts: 5,
        base_delay: Duration::from_secs(60),
        max_delay: Duration::from_secs(60),
        ..RelayOptions::default()
    };
    let first_pass = idem.relay_with(&broker, &patient).await.unwrap();
    assert_eq!(
        (
            first_pass.published,
            first_pass.failed.len(),
            first_pass.dead
        ),
        (1, 2, 0)
    );
    // The dead destination's message is retried now by an operator and dies at once.
    let dead = idem
        .outbox_list(&idem::core::runs::OutboxFilter {
            destination: Some("dead".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    idem.outbox_retry(&[dead[0].id], None).await.unwrap();
    let impatient = RelayOptions {
        max_attempts: 1,
        ..RelayOptions::default()
    };
    let second_pass = idem.relay_with(&broker, &impatient).await.unwrap();
    assert_eq!(
        (
            second_pass.published,
            second_pass.failed.len(),
            second_pass.dead
        ),
        (0, 1, 1)
    );
    assert_eq!(
        (second_pass.backlog.pending, second_pass.backlog.dead),
        (1, 1)
    );
}

fn labels(key: &CompositeKey) -> Vec<(String, String)> {
    let mut labels: Vec<_> = key
        .key()
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    labels.sort();
    labels
}

/// A `MakeWriter` collecting everything the subscriber prints.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One test, two phases on one thread (tracing caches per call site whether anyone
/// listens).
#[test]
fn run_and_relay_signals() {
    metrics_are_recorded();
    spans_carry_the_run_but_never_its_key();
}

fn metrics_are_recorded() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || runtime().block_on(calls()));
    let snapshot = snapshotter.snapshot().into_vec();
    #[allow(clippy::cast_precision_loss)] // small counts in a test
    let value = |name: &str, kind: MetricKind, want: &[(&str, &str)]| -> f64 {
        let mut want: Vec<(String, String)> = want
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        want.sort();
        let found: Vec<&DebugValue> = snapshot
            .iter()
            .filter(|(k, ..)| k.kind() == kind && k.key().name() == name && labels(k) == want)
            .map(|(.., v)| v)
            .collect();
        assert_eq!(found.len(), 1, "{name} {want:?} in {snapshot:#?}");
        match found[0] {
            DebugValue::Counter(n) => *n as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(_) => panic!("{name} is a histogram"),
        }
    };
    let engine = [("engine", "sqlite")];
    let counter = |name: &str, want: &[(&str, &str)]| value(name, MetricKind::Counter, want);
    let gauge = |name: &str| value(name, MetricKind::Gauge, &engine);
    assert_eq!(counter(observe::RUNS_STARTED, &engine), 2.0);
    assert_eq!(counter(observe::RUN_TAKEOVERS, &engine), 1.0);
    assert_eq!(counter(observe::RUN_PHASES, &engine), 1.0);
    assert_eq!(counter(observe::RUN_LEASE_LOST, &engine), 1.0);
    assert_eq!(
        counter(
            observe::RUNS_FINISHED,
            &[("engine", "sqlite"), ("status", "succeeded")]
        ),
        1.0
    );
    assert_eq!(
        counter(
            observe::RUNS_FINISHED,
            &[("engine", "sqlite"), ("status", "failed")]
        ),
        1.0
    );
    assert_eq!(counter(observe::RELAY_PUBLISHED, &engine), 1.0);
    assert_eq!(counter(observe::RELAY_FAILED, &engine), 3.0);
    assert_eq!(counter(observe::RELAY_DEAD, &engine), 1.0);
    assert_eq!(gauge(observe::OUTBOX_PENDING), 1.0);
    assert_eq!(gauge(observe::OUTBOX_DEAD), 1.0);
    let age = gauge(observe::OUTBOX_OLDEST_PENDING_AGE);
    assert!((0.0..60.0).contains(&age), "{age}");

    let documented = [
        observe::RUNS_STARTED,
        observe::RUN_TAKEOVERS,
        observe::RUN_PHASES,
        observe::RUN_LEASE_LOST,
        observe::RUNS_FINISHED,
        observe::RUN_UNKNOWN_COMMITS,
        observe::RELAY_PUBLISHED,
        observe::RELAY_FAILED,
        observe::RELAY_DEAD,
        observe::OUTBOX_PENDING,
        observe::OUTBOX_DEAD,
        observe::OUTBOX_OLDEST_PENDING_AGE,
    ];
    for (key, ..) in &snapshot {
        assert!(documented.contains(&key.key().name()), "{key:?}");
        for (label, value) in labels(key) {
            assert!(["engine", "status"].contains(&label.as_str()), "{key:?}");
            assert!(!value.contains("secret"), "{key:?}");
        }
    }
}

fn spans_carry_the_run_but_never_its_key() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || runtime().block_on(calls()));
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    for secret in [
        "secret-key-RK7",
        "secret-key-RK8",
        "secret-request-RQ3",
        "secret-message-MX",
    ] {
        assert!(!text.contains(secret), "{secret} leaked:\n{text}");
    }
    for expected in [
        "idem.run{call=\"start\"",
        "idem.run{call=\"phase\"",
        "idem.run{call=\"finish\"",
        "idem.run{call=\"fail\"",
        "outcome=\"started\"",
        "outcome=\"taken_over\"",
        "outcome=\"committed\"",
        "outcome=\"lease_lost\"",
        "outcome=\"succeeded\"",
        "outcome=\"failed\"",
        "idem: run taken over",
        "idem: run lease lost",
        "idem.relay{engine=\"sqlite\"",
        "published=1",
        "idem: an outbox message is dead",
        "key_hash=",
        "message_hash=",
    ] {
        assert!(text.contains(expected), "no {expected:?} in:\n{text}");
    }
}
