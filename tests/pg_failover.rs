//! PostgreSQL failover: a load of idempotent debits, the primary killed
//! (`pg_ctl stop -m immediate`), the standby promoted, the clients pointed at it, and
//! every key retried with the same key.
//!
//! Run it through `ci/pg-failover.sh run sync|async cargo test -p idem-tests --features
//! cluster,postgres --test pg_failover`: the script starts a private primary and
//! streaming standby and sets `IDEM_PGFO_*`; without them the trial fails.
//! - `sync` (synchronous_standby_names, synchronous_commit = on): asserts 0 acknowledged
//!   requests lost and 0 doubled;
//! - `async`: counts the acknowledged requests whose record vanished with the primary
//!   and whose retry executed the effect again (the honest limit), and asserts that the
//!   database itself never holds a key twice or an effect without its record.

#![allow(clippy::unwrap_used)]

#[path = "cluster_support.rs"]
mod support;

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem::core::{Error, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use idem::postgres::sqlx;
use idem::postgres::{PgBackend, PurgeStyle};
use idem_conformance::postgres::PgBank;
use idem_conformance::{Balance, Bank, BankError};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;
use support::{guarded, lost_server};
use tokio::sync::watch;

const CLIENTS: usize = 16;
const KEYS_PER_CLIENT: usize = 60;
const FAIL_OVER_AFTER: u64 = 300;
const START: i64 = 1_000_000;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| {
        format!(
            "{name} is not set: run this target through `ci/pg-failover.sh run sync|async cargo test …`, \
             which starts the primary and its standby"
        )
    })
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("failover-client").unwrap(),
        Operation::new("debit", 1).unwrap(),
    )
}

async fn debit(
    idem: &Idem<PgBackend>,
    key: &str,
    account: i64,
    amount: i64,
) -> Result<Outcome<Balance>, Error<BankError>> {
    let key = Key::new(key)?;
    idem.execute(
        &scope(),
        &key,
        &Request::new(json!({ "account": account, "amount": amount })),
        move |tx| PgBank::debit(tx, account, amount),
    )
    .await
}

/// What one key went through.
#[derive(Debug, Clone)]
struct KeyLog {
    key: String,
    account: i64,
    amount: i64,
    /// The acknowledged response, and whether the old primary acknowledged it.
    acked: Option<(Balance, bool)>,
    interrupted: bool,
}

async fn failover_run(mode: String) -> Result<String, String> {
    let primary = env("IDEM_PGFO_PRIMARY_URL")?;
    let standby = env("IDEM_PGFO_STANDBY_URL")?;
    let failover = env("IDEM_PGFO_FAILOVER")?;
    let bank = PgBank::connect(&primary, None)
        .await
        .map_err(|e| format!("cannot reach the primary {primary}: {e}"))?;
    bank.setup().await.map_err(err)?;
    for client in 0..CLIENTS {
        bank.set_balance(client as i64 + 1, START)
            .await
            .map_err(err)?;
    }
    let first = Arc::new(Idem::new(bank.backend().clone()));
    // The idem the clients use now; replaced by the standby's after the failover.
    let (tx, rx) = watch::channel((0u32, first));
    let acked = Arc::new(AtomicU64::new(0));
    let amount_of = |i: usize| (i as i64 % 9) + 1;
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let (mut rx, acked) = (rx.clone(), Arc::clone(&acked));
        tasks.push(tokio::spawn(async move {
            let mut log = Vec::new();
            for i in 0..KEYS_PER_CLIENT {
                let mut entry = KeyLog {
                    key: format!("fo-{client}-{i}"),
                    account: client as i64 + 1,
                    amount: amount_of(i),
                    acked: None,
                    interrupted: false,
                };
                for tries in 1.. {
                    let (generation, idem) = rx.borrow_and_update().clone();
                    match debit(&idem, &entry.key, entry.account, entry.amount).await {
                        Ok(o) => {
                            // Acknowledged by the old primary when the call ran on its
                            // pool (generation 0), even if it began after the failover
                            // command started: until the kill lands, the old primary still
                            // commits, and with async replication such a commit may be lost.
                            entry.acked = Some((*o.response(), generation == 0));
                            acked.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        Err(e) if lost_server(&e) && tries < 5 => {
                            // Unknown outcome: wait for the new primary, same key.
                            entry.interrupted = true;
                            if generation == 0 {
                                let _ =
                                    tokio::time::timeout(Duration::from_secs(120), rx.changed())
                                        .await;
                            }
                        }
                        Err(e) => return Err(format!("{} failed: {e}", entry.key)),
                    }
                }
                log.push(entry);
            }
            Ok(log)
        }));
    }
    // The failover, mid-load.
    for _ in 0..12_000 {
        if acked.load(Ordering::SeqCst) >= FAIL_OVER_AFTER {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let acked_at = acked.load(Ordering::SeqCst);
    let cmd = failover.clone();
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .args(["-c", &cmd])
            .status()
    })
    .await
    .map_err(err)?
    .map_err(err)?;
    if !status.success() {
        return Err(format!("`{failover}` failed: {status}"));
    }
    let promoted = PgBank::connect(&standby, None)
        .await
        .map_err(|e| format!("cannot reach the promoted standby {standby}: {e}"))?;
    let second = Arc::new(Idem::new(promoted.backend().clone()));
    tx.send((1, Arc::clone(&second))).map_err(err)?;
    let mut logs = Vec::new();
    for t in tasks {
        logs.extend(t.await.map_err(err)??);
    }
    // Every key once more, with the same key, on the new primary.
    let (mut lost, mut lost_changed, mut expected) = (0usize, 0usize, 0i64);
    let mut in_flight_replayed = 0;
    for l in &logs {
        expected += l.amount;
        let again = debit(&second, &l.key, l.account, l.amount)
            .await
            .map_err(|e| format!("{} retried on the new primary: {e}", l.key))?;
        let (response, before) = l.acked.ok_or(format!("{} never acknowledged", l.key))?;
        match again {
            Outcome::Replayed(b) if b == response => {
                if l.interrupted {
                    in_flight_replayed += 1;
                }
            }
            Outcome::Replayed(b) => {
                return Err(format!(
                    "{}: acknowledged {response:?}, replayed {b:?}",
                    l.key
                ));
            }
            Outcome::Executed(b) => {
                // Acknowledged, then lost with the old primary: the retry ran it again.
                lost += 1;
                if b != response {
                    lost_changed += 1;
                }
                if !before {
                    return Err(format!(
                        "{} acknowledged by the new primary, then lost",
                        l.key
                    ));
                }
            }
        }
    }
    let moved: i64 = {
        let total: i64 =
            sqlx::query_scalar("SELECT CAST(SUM(balance) AS bigint) FROM idem_demo_account")
                .fetch_one(promoted.backend().pool())
                .await
                .map_err(err)?;
        START * CLIENTS as i64 - total
    };
    let records = promoted.count_records().await.map_err(err)?;
    // The Citus-compatible purge (no FOR UPDATE SKIP LOCKED), on the promoted server:
    // a live record is never deleted, and expired ones go in bounded batches.
    let purger = Idem::new(
        PgBackend::from_pool(promoted.backend().pool().clone())
            .with_purge_style(PurgeStyle::Distributed),
    );
    let kept = purger
        .purge(Duration::from_secs(3600), 100)
        .await
        .map_err(err)?;
    if kept.requests != 0 {
        return Err(format!(
            "the distributed purge deleted {} live records",
            kept.requests
        ));
    }
    // Every record is live (24-hour retention); let them all expire now, then purge.
    sqlx::query(
        "UPDATE idem_request_result SET expires_at = clock_timestamp() - interval '1 second'",
    )
    .execute(promoted.backend().pool())
    .await
    .map_err(err)?;
    let purged = purger.purge(Duration::ZERO, 100).await.map_err(err)?;
    if purged.requests != records || u64::from(purged.batches) < (records / 100) {
        return Err(format!(
            "the distributed purge deleted {} of {records} expired records in {} statements",
            purged.requests, purged.batches
        ));
    }
    let _ = promoted.close().await;
    drop(bank);
    if moved != expected || records != logs.len() as u64 {
        return Err(format!(
            "after the failover: balance moved by {moved} (expected {expected}), {records} records (expected {})",
            logs.len()
        ));
    }
    let interrupted = logs.iter().filter(|l| l.interrupted).count();
    if mode == "sync" && lost != 0 {
        return Err(format!(
            "synchronous replication lost {lost} acknowledged requests (their retry executed again)"
        ));
    }
    Ok(format!(
        "{mode} replication: {} requests from {CLIENTS} clients, primary killed after {acked_at} \
         acknowledgements, {interrupted} calls interrupted and retried with the same key on the \
         promoted standby ({in_flight_replayed} of them replayed a commit that had reached it); \
         acknowledged-then-lost whose retry executed again: {lost} ({lost_changed} with a different \
         response than the one acknowledged); doubled in the database: 0 (balance moved by exactly \
         {expected}, one record per key); then the Citus-style purge (PurgeStyle::Distributed) kept \
         every live record and deleted {records} expired ones in {} statements",
        logs.len(),
        purged.batches
    ))
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let mode = std::env::var("IDEM_PGFO_MODE").unwrap_or_else(|_| "unset".into());
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap(),
    );
    let name = format!("pg_failover::{mode}_replication");
    let trial = Trial::test(name.clone(), move || {
        if mode != "sync" && mode != "async" {
            return Err(Failed::from(env("IDEM_PGFO_MODE").err().unwrap_or_else(
                || format!("IDEM_PGFO_MODE is {mode:?}, expected sync or async"),
            )));
        }
        let line =
            guarded(&rt, "failover", 300, failover_run(mode.clone())).map_err(Failed::from)?;
        println!("{name}: {line}");
        Ok(())
    });
    libtest_mimic::run(&args, vec![trial]).exit_code()
}
