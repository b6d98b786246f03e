//! Live: the seed's schema shape deadlocks on InnoDB, and idem retries the victims.
//!
//! Every debit inserts a row that references the account by FOREIGN KEY, then updates
//! the account. The foreign-key check takes a shared lock on the account row; the
//! `UPDATE` needs it exclusively, so two such transactions that both hold the shared lock
//! deadlock (1213). `fk_deadlocks_are_retried_and_each_debit_commits_once` makes that
//! certain rather than likely: every request's *first* effect waits at a barrier after its
//! insert, so all of them hold the shared lock before any of them updates (retried
//! attempts skip the barrier). `natural_fk_contention_commits_each_debit_once` runs the
//! same debits without the barrier and asserts only the outcome.
//!
//! Needs the server at `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`);
//! fails if it is unreachable.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{
    Error, ErrorKind, Idem, Key, Operation, Outcome, Principal, Request, RetryPolicy, Scope,
};
use idem_mysql::error_codes;
use idem_mysql::mysql_async::prelude::Queryable;
use idem_mysql::mysql_async::{self, Row};
use idem_mysql::{MysqlBackend, MysqlTx};

use common::PrivateDb;

const REQUESTS: usize = 24;
const INITIAL: i64 = 1_000_000;
const AMOUNT: i64 = 10;

/// What the effects saw, across all attempts.
#[derive(Default)]
struct Seen {
    invocations: AtomicUsize,
    deadlocks: AtomicUsize,
    lock_timeouts: AtomicUsize,
}

fn other(message: &str) -> mysql_async::Error {
    mysql_async::Error::Other(Box::new(io::Error::other(message.to_owned())))
}

/// The seed-shaped effect: FK insert, then the account update, then the balance.
async fn debit(
    tx: &mut MysqlTx,
    key: &str,
    barrier: Option<&tokio::sync::Barrier>,
) -> Result<i64, mysql_async::Error> {
    tx.exec_drop(
        "INSERT INTO dl_debit (account_id, amount, request_key) VALUES (1, ?, ?)",
        (AMOUNT, key.as_bytes()),
    )
    .await?;
    if let Some(barrier) = barrier {
        // Not a timing assertion: only a guard against a hung test if some request never
        // reaches its first effect.
        let _ = tokio::time::timeout(Duration::from_secs(30), barrier.wait()).await;
    }
    tx.exec_drop(
        "UPDATE dl_account SET balance = balance - ? WHERE id = 1 AND balance >= ?",
        (AMOUNT, AMOUNT),
    )
    .await?;
    if tx.affected_rows() != 1 {
        return Err(other("insufficient balance"));
    }
    let row: Option<Row> = tx
        .exec_first("SELECT balance FROM dl_account WHERE id = 1", ())
        .await?;
    row.and_then(|mut r| r.take_opt::<i64, usize>(0))
        .and_then(Result::ok)
        .ok_or_else(|| other("no balance"))
}

type Ended = (String, Result<Outcome<i64>, Error<mysql_async::Error>>);

async fn run_request(
    idem: Arc<Idem<MysqlBackend>>,
    scope: Arc<Scope>,
    key: String,
    start: Arc<tokio::sync::Barrier>,
    barrier: Option<Arc<tokio::sync::Barrier>>,
    seen: Arc<Seen>,
) -> Ended {
    let first = Arc::new(AtomicBool::new(true));
    let k = Key::new(key.as_str()).expect("key");
    let request = Request::new(serde_json::json!({ "account": 1, "amount": AMOUNT }));
    let effect_key = key.clone();
    start.wait().await;
    let out = idem
        .execute(&scope, &k, &request, move |tx| {
            let (barrier, seen, first, key) = (
                barrier.clone(),
                Arc::clone(&seen),
                Arc::clone(&first),
                effect_key.clone(),
            );
            Box::pin(async move {
                seen.invocations.fetch_add(1, Ordering::SeqCst);
                let first = first.swap(false, Ordering::SeqCst);
                let wait = barrier.as_deref().filter(|_| first);
                let result = debit(tx, &key, wait).await;
                if let Err(e) = &result {
                    match error_codes::classify(e) {
                        ErrorKind::Deadlock => seen.deadlocks.fetch_add(1, Ordering::SeqCst),
                        ErrorKind::LockTimeout => seen.lock_timeouts.fetch_add(1, Ordering::SeqCst),
                        _ => 0,
                    };
                }
                result
            })
        })
        .await;
    (key, out)
}

/// What one storm of concurrent debits saw.
struct Storm {
    deadlocks: usize,
    lock_timeouts: usize,
    invocations: usize,
}

/// Runs `REQUESTS` concurrent debits with distinct keys on one account, then checks
/// that exactly the executed ones committed, each once.
async fn storm(prefix: &str, deterministic: bool) -> Storm {
    let db = PrivateDb::create(prefix).await;
    db.exec(
        "CREATE TABLE dl_account (id BIGINT PRIMARY KEY, \
         balance BIGINT NOT NULL CHECK (balance >= 0)) ENGINE=InnoDB",
    )
    .await;
    db.exec(
        "CREATE TABLE dl_debit (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         account_id BIGINT NOT NULL, amount BIGINT NOT NULL, request_key VARBINARY(255) NOT NULL, \
         CONSTRAINT dl_debit_account FOREIGN KEY (account_id) REFERENCES dl_account (id)) ENGINE=InnoDB",
    )
    .await;
    db.exec(&format!(
        "INSERT INTO dl_account (id, balance) VALUES (1, {INITIAL})"
    ))
    .await;

    let idem = Arc::new(Idem::new(db.backend.clone()).with_retry(RetryPolicy {
        max_attempts: 40,
        base_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(200),
    }));
    let scope = Arc::new(Scope::new(
        Principal::new("account-1").expect("principal"),
        Operation::new("debit", 1).expect("operation"),
    ));
    let start = Arc::new(tokio::sync::Barrier::new(REQUESTS));
    let barrier = deterministic.then(|| Arc::new(tokio::sync::Barrier::new(REQUESTS)));
    let seen = Arc::new(Seen::default());
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            tokio::spawn(run_request(
                Arc::clone(&idem),
                Arc::clone(&scope),
                format!("order-{i}"),
                Arc::clone(&start),
                barrier.clone(),
                Arc::clone(&seen),
            ))
        })
        .collect();

    let mut executed: HashMap<String, i64> = HashMap::new();
    let mut exhausted: Vec<String> = Vec::new();
    for task in tasks {
        let (key, out) = task.await.expect("task");
        match out {
            Ok(Outcome::Executed(balance)) => {
                assert!(executed.insert(key, balance).is_none());
            }
            Err(Error::RetriesExhausted { last, .. }) => {
                assert!(
                    last.kind().is_retryable(),
                    "{key}: gave up on a non-retryable error {last}"
                );
                exhausted.push(key);
            }
            other => panic!("{key}: expected Executed, got {other:?}"),
        }
    }
    let invocations = seen.invocations.load(Ordering::SeqCst);
    let deadlocks = seen.deadlocks.load(Ordering::SeqCst);
    let lock_timeouts = seen.lock_timeouts.load(Ordering::SeqCst);
    println!(
        "{prefix}: {REQUESTS} requests: {} executed once, {} gave up; {invocations} effect invocations, \
         {deadlocks} deadlocks (1213) and {lock_timeouts} lock wait timeouts (1205) retried",
        executed.len(),
        exhausted.len()
    );

    // Every failed effect was a deadlock or lock wait timeout, and each was retried
    // except the last one of a request that gave up.
    assert_eq!(
        invocations + exhausted.len(),
        REQUESTS + deadlocks + lock_timeouts
    );
    assert_eq!(executed.len() + exhausted.len(), REQUESTS);
    assert!(!executed.is_empty(), "no request executed");

    // Exactly the executed debits committed, each once.
    let n = i64::try_from(executed.len()).expect("count");
    assert_eq!(
        db.scalar("SELECT balance FROM dl_account WHERE id = 1")
            .await,
        INITIAL - n * AMOUNT
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result").await,
        n
    );
    assert_eq!(
        db.scalar("SELECT COUNT(*) FROM idem_request_result WHERE response IS NULL")
            .await,
        0,
        "an unfinished record was committed"
    );
    assert_eq!(db.scalar("SELECT COUNT(*) FROM dl_debit").await, n);
    assert_eq!(
        db.scalar(
            "SELECT COUNT(*) FROM (SELECT request_key FROM dl_debit \
             GROUP BY request_key HAVING COUNT(*) > 1) AS twice"
        )
        .await,
        0,
        "an effect committed twice"
    );
    for key in &exhausted {
        let committed = db
            .scalar(&format!(
                "SELECT COUNT(*) FROM dl_debit WHERE request_key = '{key}'"
            ))
            .await;
        assert_eq!(committed, 0, "{key} gave up, yet its effect committed");
    }
    // The debits were serialized: the responses are the balances after 1, 2, … n debits.
    let balances: BTreeSet<i64> = executed.values().copied().collect();
    let expected: BTreeSet<i64> = (1..=n).map(|i| INITIAL - i * AMOUNT).collect();
    assert_eq!(balances, expected);

    // A retry of each executed key replays its stored response and debits nothing more.
    for (key, balance) in &executed {
        let k = Key::new(key.as_str()).expect("key");
        let request = Request::new(serde_json::json!({ "amount": AMOUNT, "account": 1 }));
        let out = idem
            .execute(&scope, &k, &request, |_tx| {
                Box::pin(async { Err::<i64, _>(other("a replay must not run the effect")) })
            })
            .await;
        match out {
            Ok(Outcome::Replayed(b)) => assert_eq!(b, *balance, "{key}"),
            other => panic!("{key}: expected Replayed({balance}), got {other:?}"),
        }
    }
    assert_eq!(
        db.scalar("SELECT balance FROM dl_account WHERE id = 1")
            .await,
        INITIAL - n * AMOUNT
    );
    drop(idem);
    db.drop_database().await;
    Storm {
        deadlocks,
        lock_timeouts,
        invocations,
    }
}

/// Deterministic: every request's first attempt holds the FK's shared lock before any
/// update, so deadlocks must happen, and every victim must be retried to success.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fk_deadlocks_are_retried_and_each_debit_commits_once() {
    let seen = storm("deadlock", true).await;
    assert!(
        seen.deadlocks + seen.lock_timeouts >= 1,
        "no deadlock or lock wait timeout happened"
    );
    assert!(
        seen.invocations > REQUESTS,
        "{} invocations: nothing was retried",
        seen.invocations
    );
}

/// The same debits without the barrier: whether InnoDB deadlocks depends on timing, so
/// only the outcome is asserted; the deadlocks seen are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn natural_fk_contention_commits_each_debit_once() {
    storm("contention", false).await;
}
