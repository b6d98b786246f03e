//! Spans and metrics of real calls on SQLite: every documented metric name and label is
//! recorded through a test recorder with the values the calls imply, and no span or event
//! ever carries the key, the request or the response. The same for one tick of the
//! maintenance loop (completer, purge, the lock): `idem_maintain_*` and `idem_complete_*`.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::core::observe;
use idem::sqlite::SqliteBackend;
use idem::{
    BoxFuture, Consumed, DbError, Error, ErrorKind, Idem, Key, MessageId, Operation, Outcome,
    Principal, Request, RetryPolicy, Scope, Subscriber,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
#[error("the effect refused")]
struct Refused;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn backend() -> Idem<SqliteBackend> {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    let idem = Idem::new(backend).with_retry(RetryPolicy {
        max_attempts: 3,
        base_delay: Duration::from_millis(1),
        max_delay: Duration::from_millis(2),
    });
    idem.migrate().await.unwrap();
    idem.backend()
        .interact(|c| c.execute_batch("CREATE TABLE effects (n INTEGER NOT NULL)"))
        .await
        .unwrap();
    idem
}

fn insert_effect(
    tx: &mut idem::sqlite::SqliteTx,
) -> BoxFuture<'_, Result<serde_json::Value, DbError>> {
    Box::pin(async move {
        tx.run(|c| c.execute("INSERT INTO effects (n) VALUES (1)", []))
            .await
            .map_err(|e| DbError::new("test", ErrorKind::Other, e.to_string()))?;
        Ok(json!({"response": "secret-response-RR5"}))
    })
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("account-1").unwrap(),
        Operation::new("debit", 1).unwrap(),
    )
}

/// The calls behind both tests: one of each outcome SQLite can produce.
async fn calls(idem: &Idem<SqliteBackend>) {
    let scope = scope();
    let key = Key::new("secret-key-ZZ9").unwrap();
    let request = Request::new(json!({"amount": 100, "note": "secret-request-QQ7"}));

    let first = idem.execute(&scope, &key, &request, insert_effect).await;
    assert!(matches!(first, Ok(Outcome::Executed(_))), "{first:?}");
    let again = idem.execute(&scope, &key, &request, insert_effect).await;
    assert!(matches!(again, Ok(Outcome::Replayed(_))), "{again:?}");
    let other = Request::new(json!({"amount": 5}));
    let reused = idem.execute(&scope, &key, &other, insert_effect).await;
    assert!(matches!(reused, Err(Error::KeyReused { .. })), "{reused:?}");

    let failed = idem
        .execute(&scope, &Key::new("k-failed").unwrap(), &request, |_tx| {
            Box::pin(async { Err::<serde_json::Value, _>(Refused) })
        })
        .await;
    assert!(matches!(failed, Err(Error::Effect(Refused))), "{failed:?}");

    // A busy database on every attempt: two retries, then the policy's last attempt.
    let busy = idem
        .execute(&scope, &Key::new("k-busy").unwrap(), &request, |_tx| {
            Box::pin(async {
                Err::<serde_json::Value, _>(DbError::new("sqlite", ErrorKind::Busy, "locked"))
            })
        })
        .await;
    assert!(
        matches!(busy, Err(Error::RetriesExhausted { attempts: 3, .. })),
        "{busy:?}"
    );

    let subscriber = Subscriber::new("ledger").unwrap();
    let message = MessageId::new("secret-message-MM1").unwrap();
    for expected_duplicate in [false, true] {
        let consumed = idem
            .consume(
                &subscriber,
                &message,
                None,
                |tx: &mut idem::sqlite::SqliteTx| {
                    Box::pin(async move {
                        tx.run(|c| c.execute("INSERT INTO effects (n) VALUES (2)", []))
                            .await
                            .map_err(|e| DbError::new("test", ErrorKind::Other, e.to_string()))
                    })
                },
            )
            .await
            .unwrap();
        assert_eq!(matches!(consumed, Consumed::Duplicate), expected_duplicate);
    }

    let rows: i64 = idem
        .backend()
        .interact(|c| c.query_row("SELECT COUNT(*) FROM effects", [], |r| r.get(0)))
        .await
        .unwrap();
    assert_eq!(rows, 2, "one debit and one credit committed");
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

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<_> = list
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    v.sort();
    v
}

/// One test, two phases on one thread: tracing caches per call site whether anyone
/// listens, so a concurrent test without a subscriber could hide the spans of this one.
#[test]
fn spans_and_metrics_of_real_calls() {
    spans_carry_the_call_but_never_the_key_or_the_request();
    metrics_are_recorded_with_their_documented_names_and_labels();
    // The maintenance loop's and the completer's signals, on the same thread for the
    // same reason.
    maintenance::metrics_are_recorded();
    maintenance::spans_are_recorded();
}

fn metrics_are_recorded_with_their_documented_names_and_labels() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        runtime().block_on(async {
            let idem = backend().await;
            calls(&idem).await;
            let report = idem.purge(Duration::from_secs(3600), 100).await.unwrap();
            assert_eq!(report.requests, 0, "nothing is an hour old");
        });
    });
    let snapshot = snapshotter.snapshot().into_vec();

    let counter = |name: &str, want: &[(&str, &str)]| -> u64 {
        let want = pairs(want);
        let found: Vec<u64> = snapshot
            .iter()
            .filter(|(k, ..)| {
                k.kind() == MetricKind::Counter && k.key().name() == name && labels(k) == want
            })
            .map(|(.., v)| match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .collect();
        assert_eq!(found.len(), 1, "{name} {want:?} in {snapshot:#?}");
        found[0]
    };
    let execute = [("call", "execute"), ("engine", "sqlite")];
    assert_eq!(counter(observe::EXECUTED, &execute), 1);
    assert_eq!(counter(observe::REPLAYED, &execute), 1);
    assert_eq!(counter(observe::KEY_REUSED, &execute), 1);
    assert_eq!(counter(observe::EFFECT_FAILED, &execute), 1);
    assert_eq!(counter(observe::RETRIES_EXHAUSTED, &execute), 1);
    assert_eq!(
        counter(observe::RETRIED, &[("engine", "sqlite"), ("cause", "busy")]),
        2
    );
    let consume = [("call", "consume"), ("engine", "sqlite")];
    assert_eq!(counter(observe::EXECUTED, &consume), 1);
    assert_eq!(counter(observe::REPLAYED, &consume), 1);

    let histogram = |want: &[(&str, &str)]| -> usize {
        let want = pairs(want);
        let found: Vec<usize> = snapshot
            .iter()
            .filter(|(k, ..)| {
                k.kind() == MetricKind::Histogram
                    && k.key().name() == observe::CALL_DURATION
                    && labels(k) == want
            })
            .map(|(.., v)| match v {
                DebugValue::Histogram(samples) => {
                    assert!(samples.iter().all(|s| s.into_inner() >= 0.0));
                    samples.len()
                }
                other => panic!("not a histogram: {other:?}"),
            })
            .collect();
        assert_eq!(found.len(), 1, "{want:?} in {snapshot:#?}");
        found[0]
    };
    for outcome in [
        "executed",
        "replayed",
        "key_reused",
        "effect_failed",
        "retries_exhausted",
    ] {
        let samples = histogram(&[
            ("call", "execute"),
            ("engine", "sqlite"),
            ("outcome", outcome),
        ]);
        assert_eq!(samples, 1, "{outcome}");
    }
    assert_eq!(
        histogram(&[
            ("call", "purge"),
            ("engine", "sqlite"),
            ("outcome", "executed")
        ]),
        1
    );

    // Every metric name idem emitted is one of the documented ones, and no label value
    // carries a key, a request, a response or a principal.
    let documented = [
        observe::EXECUTED,
        observe::REPLAYED,
        observe::KEY_REUSED,
        observe::IN_PROGRESS,
        observe::RETRIED,
        observe::RETRIES_EXHAUSTED,
        observe::EFFECT_FAILED,
        observe::CALL_DURATION,
    ];
    for (key, ..) in &snapshot {
        assert!(documented.contains(&key.key().name()), "{key:?}");
        for (label, value) in labels(key) {
            assert!(
                ["call", "engine", "outcome", "cause"].contains(&label.as_str()),
                "{key:?}"
            );
            assert!(
                !value.contains("secret") && !value.contains("account-1"),
                "{key:?}"
            );
        }
    }
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

fn spans_carry_the_call_but_never_the_key_or_the_request() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        runtime().block_on(async {
            let idem = backend().await;
            calls(&idem).await;
        });
    });
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();

    for secret in [
        "secret-key-ZZ9",
        "secret-request-QQ7",
        "secret-response-RR5",
        "secret-message-MM1",
        "amount",
    ] {
        assert!(!text.contains(secret), "{secret} leaked into:\n{text}");
    }
    let hash = observe::key_hash("secret-key-ZZ9");
    let closes: Vec<&str> = text.lines().filter(|l| l.contains("close")).collect();
    assert_eq!(closes.len(), 7, "one span per call:\n{text}");
    let ours: Vec<&str> = closes
        .iter()
        .copied()
        .filter(|l| l.contains(&format!("key_hash=\"{hash}\"")))
        .collect();
    assert_eq!(ours.len(), 3, "three calls with the key:\n{text}");
    for (line, outcome) in ours.iter().zip(["executed", "replayed", "key_reused"]) {
        for field in [
            "idem.call",
            "call=\"execute\"",
            "engine=\"sqlite\"",
            "principal=\"account-1\"",
            "operation=\"debit:v1\"",
            &format!("outcome=\"{outcome}\""),
        ] {
            assert!(line.contains(field), "{field} missing in {line}");
        }
    }
    assert!(
        ours[0].contains("attempt=1"),
        "the claim's attempt: {}",
        ours[0]
    );
    let retries: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("retrying after a retryable database error"))
        .collect();
    assert_eq!(retries.len(), 2, "{text}");
    assert!(retries[0].contains("attempt=1") && retries[0].contains("cause=\"busy\""));
    assert!(retries[1].contains("attempt=2"));
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("retries exhausted") && l.contains("attempt=3"))
            .count(),
        1,
        "{text}"
    );
    let consume = closes
        .iter()
        .filter(|l| l.contains("call=\"consume\"") && l.contains("principal=\"ledger\""))
        .count();
    assert_eq!(consume, 2, "{text}");
}

// ---------------------------------------------------------------------------------------
// The maintenance loop and the completer (names in `idem::core::maintain::signals`).

mod maintenance {
    use super::*;
    use idem::core::maintain::{Completion, Event, Maintainer, Purge, signals};
    use idem::{Run, Started};

    type Step = fn(&mut Run<SqliteBackend>) -> BoxFuture<'_, Result<(), Error<Refused>>>;

    fn finish(run: &mut Run<SqliteBackend>) -> BoxFuture<'_, Result<(), Error<Refused>>> {
        Box::pin(async move {
            run.finish(|_tx| Box::pin(async { Ok::<_, Refused>(json!({"done": true})) }))
                .await?;
            Ok(())
        })
    }

    fn void(run: &mut Run<SqliteBackend>) -> BoxFuture<'_, Result<(), Error<Refused>>> {
        Box::pin(async move {
            run.fail(|_tx| Box::pin(async { Ok::<_, Refused>(json!({"void": true})) }))
                .await?;
            Ok(())
        })
    }

    fn refuse(_: &mut Run<SqliteBackend>) -> BoxFuture<'_, Result<(), Error<Refused>>> {
        Box::pin(async { Err(Error::Effect(Refused)) })
    }

    /// One tick of a runner over: runs of `done:v1`, `void:v1` and `stuck:v1` (steps that
    /// succeed, fail, and cannot move), one of `ghost:v1` (no step), and an expired record.
    async fn one_tick() {
        let idem = backend().await.with_lease(Duration::from_millis(200));
        for (operation, key) in [
            ("done:v1", "secret-stalled-key-1"),
            ("void:v1", "secret-stalled-key-2"),
            ("stuck:v1", "secret-stalled-key-3"),
            ("ghost:v1", "secret-stalled-key-4"),
        ] {
            let scope = Scope::new(
                Principal::new("account-1").unwrap(),
                operation.parse().unwrap(),
            );
            let key = Key::new(key).unwrap();
            let request = Request::new(json!({"note": "secret-request-QQ7"}));
            let started = idem.start::<Refused>(&scope, &key, &request).await;
            assert!(matches!(started, Ok(Started::Run(_))), "{started:?}");
        }
        let short = Scope::new(
            Principal::new("account-1").unwrap(),
            Operation::new("debit", 1)
                .unwrap()
                .with_retention(Duration::from_secs(1)),
        );
        let first = idem
            .execute(
                &short,
                &Key::new("k-expiring").unwrap(),
                &Request::new(json!({})),
                insert_effect,
            )
            .await;
        assert!(matches!(first, Ok(Outcome::Executed(_))), "{first:?}");
        tokio::time::sleep(Duration::from_millis(1300)).await;

        let steps: [(&str, Step); 3] =
            [("done:v1", finish), ("void:v1", void), ("stuck:v1", refuse)];
        let mut completion = Completion::new();
        for (operation, step) in steps {
            completion = completion.step(&operation.parse().unwrap(), step);
        }
        let lock = idem.backend().leader_lock("idem-maintain").unwrap();
        let (ticked, stop) = tokio::sync::oneshot::channel::<()>();
        let mut ticked = Some(ticked);
        let summary = Maintainer::new(idem, lock)
            .with_task(completion)
            .with_task(Purge::new())
            .on_event(move |e| {
                if let Event::Tick(t) = e {
                    assert!(t.runner && t.skipped == 0, "{t:?}");
                    assert!(t.tasks.iter().all(|task| task.error.is_none()), "{t:?}");
                    if let Some(tx) = ticked.take() {
                        let _ = tx.send(());
                    }
                }
            })
            .run(async {
                let _ = stop.await;
            })
            .await;
        assert_eq!((summary.ticks, summary.runner_ticks), (1, 1), "{summary:?}");
    }

    pub(super) fn metrics_are_recorded() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || runtime().block_on(one_tick()));
        let snapshot = snapshotter.snapshot().into_vec();
        let value = |name: &str, want: &[(&str, &str)]| -> Option<&DebugValue> {
            let want = pairs(want);
            snapshot
                .iter()
                .find(|(k, ..)| k.key().name() == name && labels(k) == want)
                .map(|(.., v)| v)
        };
        let counter = |name: &str, want: &[(&str, &str)]| match value(name, want) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{name} {want:?}: {other:?} in {snapshot:#?}"),
        };
        let gauge = |name: &str| match value(name, &[("engine", "sqlite")]) {
            Some(DebugValue::Gauge(g)) => g.into_inner(),
            other => panic!("{name}: {other:?} in {snapshot:#?}"),
        };
        let sqlite = [("engine", "sqlite")];
        assert_eq!(counter(signals::ACQUIRED, &sqlite), 1);
        assert_eq!(gauge(signals::RUNNER), 0.0, "released at shutdown");
        assert!(gauge(signals::LAST_RUN) > 1.0e9, "a Unix time");
        assert_eq!(
            counter(signals::TICKS, &[("engine", "sqlite"), ("role", "runner")]),
            1
        );
        assert_eq!(
            counter(signals::WORK, &[("engine", "sqlite"), ("task", "complete")]),
            2,
            "one run succeeded, one failed"
        );
        assert_eq!(
            counter(signals::WORK, &[("engine", "sqlite"), ("task", "purge")]),
            1,
            "the expired record"
        );
        for (result, n) in [("succeeded", 1), ("failed", 1), ("left", 1)] {
            let labels = [("engine", "sqlite"), ("result", result)];
            assert_eq!(counter(signals::COMPLETE_RUNS, &labels), n, "{result}");
        }
        assert_eq!(gauge(signals::COMPLETE_STALLED), 4.0);
        assert_eq!(gauge(signals::COMPLETE_UNHANDLED), 1.0, "ghost:v1");
        for task in ["complete", "purge"] {
            let labels = [("engine", "sqlite"), ("outcome", "ok"), ("task", task)];
            match value(signals::TASK_DURATION, &labels) {
                Some(DebugValue::Histogram(samples)) => assert_eq!(samples.len(), 1, "{task}"),
                other => panic!("{task}: {other:?}"),
            }
        }
        assert!(
            value(signals::ERRORS, &[("engine", "sqlite"), ("task", "purge")]).is_none(),
            "no task failed"
        );
        // Labels are the documented ones, and never a principal, operation or key.
        for (key, ..) in &snapshot {
            let name = key.key().name();
            if !(name.starts_with("idem_maintain_") || name.starts_with("idem_complete_")) {
                continue;
            }
            for (label, value) in labels(key) {
                assert!(
                    ["engine", "role", "task", "outcome", "result"].contains(&label.as_str()),
                    "{key:?}"
                );
                assert!(
                    !value.contains("secret") && !value.contains("account") && !value.contains(':'),
                    "{key:?}"
                );
            }
        }
    }

    pub(super) fn spans_are_recorded() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || runtime().block_on(one_tick()));
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        for secret in ["secret-stalled-key", "secret-request-QQ7"] {
            assert!(!text.contains(secret), "{secret} leaked into:\n{text}");
        }
        // The lines that close a span named `name` (the innermost span of the line).
        let closes = |name: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.ends_with("close") || l.contains(": close "))
                .filter(|l| {
                    let context = l.split(": idem_core").next().unwrap_or_default();
                    let innermost = context.rsplit("}:").next().unwrap_or_default();
                    innermost.trim_start().split('{').next() == Some(name)
                        || innermost.contains(&format!(" {name}{{"))
                })
                .map(str::to_owned)
                .collect()
        };
        let ticks = closes(signals::TICK_SPAN);
        assert_eq!(ticks.len(), 1, "{text}");
        assert!(ticks[0].contains("role=\"runner\"") && ticks[0].contains("tick=1"));
        let tasks = closes(signals::TASK_SPAN);
        assert_eq!(tasks.len(), 2, "{text}");
        assert!(
            tasks.iter().any(|l| l.contains("task=\"complete\"")
                && l.contains("outcome=\"ok\"")
                && l.contains("work=2")),
            "{text}"
        );
        let runs = closes(signals::RUN_SPAN);
        assert_eq!(runs.len(), 3, "one per run with a step:\n{text}");
        let hash = observe::key_hash("secret-stalled-key-1");
        assert!(
            runs.iter().any(|l| l.contains("operation=\"done:v1\"")
                && l.contains(&format!("key_hash=\"{hash}\""))
                && l.contains("point=\"started\"")
                && l.contains("result=\"succeeded\"")),
            "{text}"
        );
        assert!(runs.iter().any(|l| l.contains("result=\"left\"")));
        // The setup's own start of the ghost run has its `idem.run` span; the
        // maintenance tick adds nothing about it.
        assert!(
            !text
                .lines()
                .any(|l| l.contains("ghost:v1") && !l.contains("idem.run{call=\"start\"")),
            "an unhandled run gets no span:\n{text}"
        );
        assert!(text.contains("this instance is now the maintenance runner"));
        assert!(text.contains("releasing the maintenance lock"));
    }
}
