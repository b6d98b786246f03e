//! `ExecuteBlocking::execute_blocking`: the whole call in one trip to the blocking pool,
//! with the promises of `execute`. One test function: the trip counter is the
//! process's, so nothing else may run beside it.

#![allow(clippy::unwrap_used)] // test setup: fail loudly

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::blocking::trips;
use idem_core::{Error, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use idem_sqlite::{ExecuteBlocking, SqliteBackend, SqliteOptions, url_for};

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn scope() -> Scope {
    Scope::new(
        Principal::new("p").unwrap(),
        Operation::new("debit", 1).unwrap(),
    )
}

fn debit(amount: i64) -> Request {
    Request::new(serde_json::json!({ "amount": amount }))
}

#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("insufficient funds")]
    Funds,
    #[error(transparent)]
    Db(#[from] idem_sqlite::rusqlite::Error),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trip_per_call_with_the_promises_of_execute() {
    let dir = std::env::temp_dir().join(format!("idem-sync-effect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bank.db");
    let _ = std::fs::remove_file(&path);
    let backend = SqliteBackend::connect(&url_for(&path)).await.unwrap();
    let idem = Idem::new(backend.clone());
    idem.migrate().await.unwrap();
    backend
        .interact(|c| {
            c.execute_batch(
                "CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
                 INSERT INTO account VALUES (1, 1000);",
            )
        })
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let debit_effect = |amount: i64, runs: Arc<AtomicUsize>| {
        move |c: &idem_sqlite::rusqlite::Connection| -> Result<i64, Refused> {
            runs.fetch_add(1, Ordering::SeqCst);
            let balance: i64 = c.query_row(
                "UPDATE account SET balance = balance - ?1 WHERE id = 1 RETURNING balance",
                [amount],
                |r| r.get(0),
            )?;
            if balance < 0 {
                return Err(Refused::Funds);
            }
            Ok(balance)
        }
    };

    // A new request: executed, in one trip to the blocking pool (the connection is
    // already open and clean: no check at checkout).
    let before = trips();
    let out = idem
        .execute_blocking(
            &scope(),
            &Key::new("k-1").unwrap(),
            &debit(100),
            debit_effect(100, Arc::clone(&runs)),
        )
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed(900));
    assert_eq!(trips() - before, 1, "a new request is one trip");
    // `execute` with the same effect takes one trip per step.
    let before = trips();
    let effect_runs = Arc::clone(&runs);
    let out = idem
        .execute(&scope(), &Key::new("k-async").unwrap(), &debit(1), |tx| {
            let effect = debit_effect(1, Arc::clone(&effect_runs));
            Box::pin(async move { tx.run(effect).await })
        })
        .await
        .unwrap();
    assert_eq!(out, Outcome::Executed(899));
    let async_trips = trips() - before;
    assert!(async_trips >= 3, "claim, effect, completion: {async_trips}");

    // A retry replays the stored answer without running the effect, in one trip.
    let before = trips();
    let out = idem
        .execute_blocking(
            &scope(),
            &Key::new("k-1").unwrap(),
            &debit(100),
            debit_effect(100, Arc::clone(&runs)),
        )
        .await
        .unwrap();
    assert_eq!(out, Outcome::Replayed(900));
    assert_eq!(trips() - before, 1, "a replay is one trip");
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The same key with a different request is refused; nothing runs.
    let reused = idem
        .execute_blocking(
            &scope(),
            &Key::new("k-1").unwrap(),
            &debit(5),
            debit_effect(5, Arc::clone(&runs)),
        )
        .await;
    assert!(matches!(reused, Err(Error::KeyReused { .. })), "{reused:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // An effect error rolls its writes and the record back.
    let refused = idem
        .execute_blocking(
            &scope(),
            &Key::new("k-big").unwrap(),
            &debit(10_000),
            debit_effect(10_000, Arc::clone(&runs)),
        )
        .await;
    assert!(
        matches!(refused, Err(Error::Effect(Refused::Funds))),
        "{refused:?}"
    );

    // A panicking effect: re-raised here; its writes rolled back; the database usable.
    let panicking = idem.clone();
    let panicked = tokio::spawn(async move {
        panicking
            .execute_blocking(
                &scope(),
                &Key::new("k-panic").unwrap(),
                &debit(1),
                |c| -> Result<i64, Refused> {
                    c.execute("UPDATE account SET balance = 0 WHERE id = 1", [])?;
                    panic!("the effect panicked on purpose");
                },
            )
            .await
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());

    // Concurrent calls with one new key: the effect runs once, every answer is its.
    let mut calls = Vec::new();
    for _ in 0..8 {
        let idem = idem.clone();
        let runs = Arc::clone(&runs);
        calls.push(tokio::spawn(async move {
            idem.execute_blocking(
                &scope(),
                &Key::new("k-storm").unwrap(),
                &debit(7),
                debit_effect(7, runs),
            )
            .await
        }));
    }
    let mut executed = 0;
    for call in calls {
        match tokio::time::timeout(HANG_GUARD, call)
            .await
            .unwrap()
            .unwrap()
        {
            Ok(Outcome::Executed(892)) => executed += 1,
            Ok(Outcome::Replayed(892)) | Err(Error::InProgress { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        4,
        "k-1, k-async, k-big, k-storm"
    );

    let (balance, records): (i64, i64) = backend
        .interact(|c| {
            c.query_row(
                "SELECT (SELECT balance FROM account WHERE id = 1), \
                 (SELECT count(*) FROM idem_request_result)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
        })
        .await
        .unwrap();
    assert_eq!(balance, 892, "1000 - 100 - 1 - 7: nothing else applied");
    assert_eq!(records, 3, "k-1, k-async, k-storm");

    // An in-memory database (one connection) works the same way.
    let memory = Idem::new(
        SqliteBackend::open_with_options(idem_sqlite::Location::Memory, SqliteOptions::default())
            .await
            .unwrap(),
    );
    memory.migrate().await.unwrap();
    for expected in [Outcome::Executed(1), Outcome::Replayed(1)] {
        let out = memory
            .execute_blocking(&scope(), &Key::new("m").unwrap(), &debit(1), |c| {
                c.query_row("SELECT 1", [], |r| r.get::<_, i64>(0))
            })
            .await
            .unwrap();
        assert_eq!(out, expected);
    }
    drop(backend);
    let _ = std::fs::remove_dir_all(&dir);
}
