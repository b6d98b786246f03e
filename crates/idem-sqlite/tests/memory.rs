//! SQLite traps: an in-memory database survives cancelled calls and panicking effects;
//! `interact` inside an effect is refused instead of deadlocking; `synchronous=FULL` by
//! default; a record that expires during its effect is refused; JSON text is verbatim;
//! a stored response that does not decode is an error, never a replay.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::time::Duration;

use idem_core::{
    DbError, Error, ErrorKind, Idem, Key, Operation, Outcome, Principal, Request, Scope,
};
use idem_sqlite::{Location, SqliteBackend, SqliteOptions, Synchronous};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn scope() -> Scope {
    Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("op", 1).unwrap(),
    )
}

fn request() -> Request {
    Request::new(serde_json::json!({"n": 1}))
}

/// A migrated in-memory database with a table `t` and one committed record `kept`.
async fn memory() -> (SqliteBackend, Idem<SqliteBackend>) {
    let backend = SqliteBackend::connect("sqlite::memory:").await.unwrap();
    let idem = Idem::new(backend.clone());
    idem.migrate().await.unwrap();
    backend
        .interact(|c| c.execute_batch("CREATE TABLE t (n INTEGER)"))
        .await
        .unwrap();
    let out = idem
        .execute(&scope(), &Key::new("kept").unwrap(), &request(), |tx| {
            Box::pin(async move {
                tx.run(|c| c.execute("INSERT INTO t VALUES (1)", []).map(|_| 1))
                    .await
            })
        })
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed(1));
    (backend, idem)
}

/// The database still holds its table, its row and its record.
async fn assert_intact(backend: &SqliteBackend, idem: &Idem<SqliteBackend>) {
    let rows: i64 = tokio::time::timeout(
        HANG_GUARD,
        backend.interact(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get(0))),
    )
    .await
    .unwrap()
    .expect("the in-memory database must survive");
    assert_eq!(rows, 1, "only the committed row");
    let again = idem
        .execute(&scope(), &Key::new("kept").unwrap(), &request(), |_tx| {
            Box::pin(async { Ok::<_, rusqlite_error::E>(2) })
        })
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed(1), "the committed record replays");
}

mod rusqlite_error {
    pub(crate) type E = idem_sqlite::rusqlite::Error;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_keeps_the_memory_database() {
    let (backend, idem) = memory().await;
    let (scope, request) = (scope(), request());
    let (key, key2) = (
        Key::new("cancelled").unwrap(),
        Key::new("cancelled-2").unwrap(),
    );
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let mut started = Some(started_tx);
    let call = idem.execute(&scope, &key, &request, |tx| {
        let started = started.take();
        Box::pin(async move {
            tx.run(|c| c.execute("INSERT INTO t VALUES (2)", []))
                .await?;
            if let Some(s) = started {
                let _ = s.send(());
            }
            // Never finishes on its own: the caller gives up (a timeout, a dropped
            // HTTP handler).
            std::future::pending::<()>().await;
            Ok::<_, rusqlite_error::E>(0)
        })
    });
    tokio::select! {
        _ = call => panic!("the call cannot finish"),
        _ = started_rx => {}
    }
    // Also cancel while a statement runs on the blocking pool.
    let call = idem.execute(&scope, &key2, &request, |tx| {
        Box::pin(async move {
            tx.run(|c| {
                c.execute("INSERT INTO t VALUES (3)", [])?;
                std::thread::sleep(Duration::from_millis(300));
                Ok::<_, rusqlite_error::E>(0)
            })
            .await
        })
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(50), call)
            .await
            .is_err()
    );
    assert_intact(&backend, &idem).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_effect_keeps_the_memory_database() {
    let (backend, idem) = memory().await;
    for key in ["panics-in-run", "panics-in-effect"] {
        let idem2 = idem.clone();
        let task = tokio::spawn(async move {
            idem2
                .execute(&scope(), &Key::new(key).unwrap(), &request(), move |tx| {
                    Box::pin(async move {
                        tx.run(|c| c.execute("INSERT INTO t VALUES (4)", []))
                            .await?;
                        if key == "panics-in-run" {
                            tx.run(|_| -> Result<i64, rusqlite_error::E> {
                                panic!("a bug inside the driver call")
                            })
                            .await
                        } else {
                            panic!("a bug in the effect")
                        }
                    })
                })
                .await
        });
        let joined = tokio::time::timeout(HANG_GUARD, task).await.unwrap();
        assert!(
            joined.unwrap_err().is_panic(),
            "{key}: the panic propagates"
        );
        assert_intact(&backend, &idem).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interact_inside_an_effect_is_refused_not_a_deadlock() {
    let (backend, idem) = memory().await;
    let inner = backend.clone();
    let task = tokio::spawn(async move {
        idem.execute(
            &scope(),
            &Key::new("nested").unwrap(),
            &request(),
            move |_tx| {
                let inner = inner.clone();
                Box::pin(async move {
                    inner
                        .interact(|c| c.query_row("SELECT 1", [], |r| r.get::<_, i64>(0)))
                        .await
                })
            },
        )
        .await
    });
    let out = tokio::time::timeout(HANG_GUARD, task)
        .await
        .expect("interact inside an effect must not deadlock")
        .unwrap();
    match out {
        Err(Error::Effect(e)) => {
            assert_eq!(e.kind(), ErrorKind::Configuration, "{e}");
            assert!(e.to_string().contains("SqliteTx::run"), "{e}");
        }
        other => panic!("expected a clear refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn synchronous_is_full_unless_normal_is_asked_for() {
    let dir = std::env::temp_dir().join(format!("idem-sync-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pragma = |b: SqliteBackend| async move {
        b.interact(|c| c.query_row("PRAGMA synchronous", [], |r| r.get::<_, i64>(0)))
            .await
            .unwrap()
    };
    let full = SqliteBackend::open(Location::File(dir.join("full.db")))
        .await
        .unwrap();
    assert_eq!(pragma(full).await, 2, "FULL by default");
    let normal = SqliteBackend::open_with_options(
        Location::File(dir.join("normal.db")),
        SqliteOptions::default().synchronous(Synchronous::Normal),
    )
    .await
    .unwrap();
    assert_eq!(pragma(normal).await, 1, "NORMAL only when asked for");
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn json_text_is_stored_byte_for_byte() {
    let (backend, idem) = memory().await;
    let value = serde_json::json!({
        "computed": 0.3 - 0.1,
        "big": 1e16,
        "negative_zero": -0.0,
        "nul": "a\u{0}b",
        "twenty_digits": 12_345_678_901_234_567_890_u64,
    });
    let request = Request::new(value.clone());
    let response = value.clone();
    idem.execute(
        &scope(),
        &Key::new("exact").unwrap(),
        &request,
        move |_tx| {
            let response = response.clone();
            Box::pin(async move { Ok::<_, DbError>(response) })
        },
    )
    .await
    .unwrap();
    let (stored_request, stored_response): (String, String) = backend
        .interact(|c| {
            c.query_row(
                "SELECT request, response FROM idem_request_result WHERE request_key = 'exact'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })
        .await
        .unwrap();
    assert_eq!(stored_request, request.to_json(), "the request's text");
    assert_eq!(stored_response, serde_json::to_string(&value).unwrap());
}

/// A stored response that is no longer JSON is a corrupt record (the table's `json_valid`
/// check is switched off here to write one); JSON of another shape than the caller's
/// type is the caller's decode error. Neither runs the effect again.
#[tokio::test]
async fn a_stored_response_that_does_not_decode_is_an_error_not_a_replay() {
    let (backend, idem) = memory().await;
    let (scope, key, request) = (scope(), Key::new("kept").unwrap(), request());
    let replay = || {
        idem.execute(&scope, &key, &request, |tx| {
            Box::pin(async move {
                tx.run(|c| c.execute("INSERT INTO t VALUES (2)", []).map(|_| 2_i64))
                    .await
            })
        })
    };
    let overwrite = |response: &'static str| {
        backend.interact(move |c| {
            c.execute_batch("PRAGMA ignore_check_constraints = ON")?;
            let n = c.execute(
                "UPDATE idem_request_result SET response = ?1 WHERE request_key = 'kept'",
                [response],
            );
            c.execute_batch("PRAGMA ignore_check_constraints = OFF")?;
            n
        })
    };
    assert_eq!(overwrite("{\"n\":").await.unwrap(), 1);
    match replay().await {
        Err(Error::Backend(e)) => {
            assert_eq!(e.kind(), ErrorKind::CorruptRecord, "{e}");
            assert!(
                e.to_string().contains("stored response is unreadable"),
                "{e}"
            );
        }
        other => panic!("a corrupt record, not {other:?}"),
    }
    assert_eq!(overwrite("1 2").await.unwrap(), 1);
    assert!(
        matches!(replay().await, Err(Error::Backend(e)) if e.kind() == ErrorKind::CorruptRecord),
        "trailing text is no JSON value"
    );
    assert_eq!(overwrite("\"one\"").await.unwrap(), 1);
    assert!(
        matches!(replay().await, Err(Error::Decode(_))),
        "JSON that is not an integer"
    );
    assert_eq!(overwrite("7").await.unwrap(), 1);
    assert_eq!(replay().await.unwrap(), Outcome::Replayed(7));
    let rows: i64 = backend
        .interact(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)))
        .await
        .unwrap();
    assert_eq!(rows, 1, "the effect never ran again");
}

/// SQLite has one writer: a claim of another key that waits past its bound while a
/// transaction holds the write lock is busy (retried), not in flight. Only the same
/// identity, known to be claimed by this backend, answers InProgress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_same_identity_is_in_flight() {
    let dir = std::env::temp_dir().join(format!("idem-inflight-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let backend = SqliteBackend::open(Location::File(dir.join("f.db")))
        .await
        .unwrap();
    let idem = Idem::new(backend.clone());
    idem.migrate().await.unwrap();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let mut signals = Some((started_tx, release_rx));
    let winner = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.execute(
                &scope(),
                &Key::new("held").unwrap(),
                &request(),
                move |_tx| {
                    let signals = signals.take();
                    Box::pin(async move {
                        if let Some((started, release)) = signals {
                            let _ = started.send(());
                            let _ = tokio::time::timeout(HANG_GUARD, release).await;
                        }
                        Ok::<_, DbError>(1)
                    })
                },
            )
            .await
        })
    };
    tokio::time::timeout(HANG_GUARD, started_rx)
        .await
        .unwrap()
        .unwrap();
    let short = idem
        .clone()
        .with_wait_timeout(Duration::from_secs(1))
        .with_retry(idem_core::RetryPolicy {
            max_attempts: 1,
            ..idem_core::RetryPolicy::default()
        });
    let same = short
        .execute(&scope(), &Key::new("held").unwrap(), &request(), |_tx| {
            Box::pin(async { Ok::<_, DbError>(2) })
        })
        .await;
    assert!(matches!(same, Err(Error::InProgress { .. })), "{same:?}");
    let other = short
        .execute(&scope(), &Key::new("other").unwrap(), &request(), |_tx| {
            Box::pin(async { Ok::<_, DbError>(3) })
        })
        .await;
    assert!(
        matches!(&other, Err(Error::RetriesExhausted { last, .. }) if last.kind() == ErrorKind::Busy),
        "another key waits for the writer: busy and retried, not in flight: {other:?}"
    );
    let _ = release_tx.send(());
    let won = winner.await.unwrap();
    assert_eq!(won.unwrap(), Outcome::Executed(1));
    let other = idem
        .execute(&scope(), &Key::new("other").unwrap(), &request(), |_tx| {
            Box::pin(async { Ok::<_, DbError>(3) })
        })
        .await
        .unwrap();
    assert_eq!(other, Outcome::Executed(3));
    std::fs::remove_dir_all(&dir).ok();
}

/// `execute_blocking` on a current-thread runtime (the default of `#[tokio::test]`):
/// the call runs on a blocking thread while the runtime's only thread waits for it.
#[tokio::test]
async fn execute_blocking_runs_on_a_current_thread_runtime() {
    use idem_sqlite::ExecuteBlocking;
    let (_backend, idem) = memory().await;
    for expected in [Outcome::Executed(2), Outcome::Replayed(2)] {
        let out = tokio::time::timeout(
            HANG_GUARD,
            idem.execute_blocking(&scope(), &Key::new("sync").unwrap(), &request(), |c| {
                c.execute("INSERT INTO t VALUES (2)", [])?;
                c.query_row("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0))
            }),
        )
        .await
        .expect("no hang")
        .unwrap();
        assert_eq!(out, expected);
    }
}

/// After the migrations the record tables carry the `expires_at` index the purge reads
/// by and nothing else (`WITHOUT ROWID` tables keep their key in the table itself): 0005
/// dropped the claim-time indexes no statement used.
#[tokio::test]
async fn the_record_tables_carry_only_the_indexes_idem_reads() {
    let (backend, _idem) = memory().await;
    let indexes = backend
        .interact(|c| {
            let mut s = c.prepare(
                "SELECT name FROM sqlite_schema WHERE type = 'index' AND tbl_name IN \
                 ('idem_request_result', 'idem_processed_message') ORDER BY name",
            )?;
            let names = s.query_map([], |r| r.get::<_, String>(0))?;
            names.collect::<Result<Vec<_>, _>>()
        })
        .await
        .unwrap();
    assert_eq!(
        indexes,
        [
            "idem_processed_message_expires_at",
            "idem_request_result_expires_at",
        ]
    );
}

/// An effect that writes a row, then outlives a 1 s record window (the shortest allowed).
fn slow(
    tx: &mut idem_sqlite::SqliteTx,
) -> idem_core::BoxFuture<'_, Result<i64, rusqlite_error::E>> {
    Box::pin(async move {
        tx.run(|c| c.execute("INSERT INTO t VALUES (5)", []))
            .await?;
        tokio::time::sleep(Duration::from_millis(1600)).await;
        Ok(5)
    })
}

/// A record whose window ends while its effect runs is refused at completion with the
/// error that says so (the upsert's window guard), for a request and for a message: the
/// effect's row is rolled back and no record is written. The effects sleep past a 1 s
/// window (the fault), nothing is timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_expiring_during_its_effect_is_refused() {
    let (backend, idem) = memory().await;
    let short = Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("short", 1)
            .unwrap()
            .with_retention(Duration::from_secs(1)),
    );
    let out = idem
        .execute(&short, &Key::new("slow").unwrap(), &request(), slow)
        .await;
    let refused = |what: &str, out: String| {
        assert!(
            out.contains("the record expired before the effect finished"),
            "{what}: {out}"
        );
    };
    refused("request", format!("{:?}", out.map_err(|e| e.to_string())));
    let messages = idem.clone().with_message_retention(Duration::from_secs(1));
    let consumed = messages
        .consume(
            &idem_core::Subscriber::new("s").unwrap(),
            &idem_core::MessageId::new("m").unwrap(),
            None,
            slow,
        )
        .await;
    refused(
        "message",
        format!("{:?}", consumed.map_err(|e| e.to_string())),
    );
    let (records, messages): (i64, i64) = backend
        .interact(|c| {
            c.query_row(
                "SELECT (SELECT count(*) FROM idem_request_result), (SELECT count(*) FROM idem_processed_message)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })
        .await
        .unwrap();
    assert_eq!((records, messages), (1, 0), "only the record `kept`");
    assert_intact(&backend, &idem).await;
}
