//! Citus, live: set `IDEM_CITUS_URL` to a coordinator (workers added, the coordinator in
//! the metadata: `citus_set_coordinator_host`); unset, every trial is reported as
//! skipped, by name. See `docs/scale-out.md` for what ran where.
//!
//! - `citus::<case>`: every conformance case, each in a private schema whose idem tables
//!   `PgBackend::distribute` placed before the case ran (request, run and message tables
//!   distributed, the outbox a Citus local table), the demo's tables distributed by
//!   their keys, purges in the `PurgeStyle::Distributed` style.
//! - `citus::same_key_storm`: many concurrent calls per key from several pools, on an
//!   effect table co-located with the records: one effect per key, every reply equal.
//! - `citus::purge_*`: the distributed purge over shards, the row-lock purge switching to
//!   it, and a key taken over while a purge runs.
//! - `citus::distribute_*`: the placement report, outbox ids kept across it, and
//!   idem's co-location group kept apart from your tables' and other installs'.
//! - `citus::later_migrations_run_on_distributed_tables`: the upgrade path.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::core::{Idem, Key, Maintenance, Outcome, Request, Scope, Table};
use idem::core::{Operation, Principal};
use idem::postgres::sqlx::postgres::PgConnectOptions;
use idem::postgres::sqlx::{self, Row};
use idem::postgres::{PgBackend, Placed, PurgeStyle, db_error};
use idem_conformance::harness::{namespace, run_case};
use idem_conformance::postgres::CitusBank;
use idem_conformance::{Balance, Bank, BankError, Target, cases};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;

/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(120);

type Res = Result<(), String>;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Res {
    if ok { Ok(()) } else { Err(what()) }
}

/// A backend on the fixture's schema with a pool of its own.
async fn pool_on(
    url: &str,
    schema: &str,
    size: u32,
    purge: PurgeStyle,
) -> Result<PgBackend, String> {
    let options = PgConnectOptions::from_str(url)
        .map_err(err)?
        .options([("search_path", schema)])
        .application_name(schema);
    Ok(PgBackend::connect_with(options, size)
        .await
        .map_err(err)?
        .with_purge_style(purge))
}

/// A distributed fixture in a private schema; `f` gets it, the schema's name and the URL.
async fn with_citus<F, Fut>(url: &str, name: &str, f: F) -> Res
where
    F: FnOnce(Arc<CitusBank>, String, String) -> Fut,
    Fut: std::future::Future<Output = Res>,
{
    let ns = namespace(name);
    let bank = CitusBank::connect(url, Some(&ns))
        .await
        .map_err(|e| format!("cannot connect to Citus at {}: {e}", idem::redact(url)))?;
    bank.setup().await.map_err(err)?;
    let bank = Arc::new(bank);
    let result = f(Arc::clone(&bank), ns.clone(), url.to_owned()).await;
    match Arc::try_unwrap(bank) {
        Ok(bank) => bank.close().await.map_err(err)?,
        Err(_) => eprintln!("warning: citus::{name}: schema {ns} left behind"),
    }
    result
}

async fn exec(bank: &CitusBank, sql: &str) -> Res {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(bank.backend().pool())
        .await
        .map(drop)
        .map_err(err)
}

async fn count(bank: &CitusBank, sql: &str) -> Result<i64, String> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(bank.backend().pool())
        .await
        .map_err(err)
}

// ---------------------------------------------------------------------------------------
// The same-key storm

const PRINCIPALS: usize = 8;
const KEYS_PER_PRINCIPAL: usize = 8;
const CALLS_PER_KEY: usize = 16;
const POOLS: usize = 3;
const START_BALANCE: i64 = 1_000_000;

/// The storm's effect: a debit of the principal's own account and a ledger row, both on
/// the principal's shard (co-located with the records).
fn storm_effect<'t>(
    tx: &'t mut idem::postgres::PgTx,
    principal: String,
    key: String,
    amount: i64,
    runs: Arc<AtomicUsize>,
) -> idem::core::BoxFuture<'t, Result<Balance, BankError>> {
    Box::pin(async move {
        runs.fetch_add(1, Ordering::SeqCst);
        let balance: i64 = sqlx::query_scalar(
            "UPDATE idem_storm_account SET balance = balance - $2 \
             WHERE principal = $1 AND balance >= $2 RETURNING balance",
        )
        .bind(&principal)
        .bind(amount)
        .fetch_one(&mut **tx)
        .await
        .map_err(db_error)?;
        sqlx::query(
            "INSERT INTO idem_storm_ledger (principal, request_key, amount) VALUES ($1, $2, $3)",
        )
        .bind(&principal)
        .bind(&key)
        .bind(amount)
        .execute(&mut **tx)
        .await
        .map_err(db_error)?;
        Ok(Balance { balance })
    })
}

async fn same_key_storm(url: String) -> Res {
    with_citus(&url, "storm", |bank, ns, url| async move {
        exec(
            &bank,
            "CREATE TABLE idem_storm_account (principal text COLLATE \"C\" PRIMARY KEY, balance bigint NOT NULL CHECK (balance >= 0)); \
             CREATE TABLE idem_storm_ledger (principal text COLLATE \"C\" NOT NULL, request_key text NOT NULL, amount bigint NOT NULL); \
             SELECT create_distributed_table('idem_storm_account', 'principal', colocate_with => 'idem_request_result'); \
             SELECT create_distributed_table('idem_storm_ledger', 'principal', colocate_with => 'idem_request_result')",
        )
        .await?;
        let groups = count(
            &bank,
            "SELECT count(DISTINCT colocationid) FROM pg_dist_partition WHERE logicalrelid IN \
             ('idem_request_result'::regclass, 'idem_storm_account'::regclass, 'idem_storm_ledger'::regclass)",
        )
        .await?;
        ensure(groups == 1, || format!("storm tables in {groups} co-location groups"))?;
        for p in 0..PRINCIPALS {
            exec(
                &bank,
                &format!("INSERT INTO idem_storm_account VALUES ('acct-{p}', {START_BALANCE})"),
            )
            .await?;
        }
        let mut idems = Vec::new();
        for _ in 0..POOLS {
            let backend = pool_on(&url, &ns, 24, PurgeStyle::Distributed).await?;
            idems.push(Arc::new(Idem::new(backend)));
        }
        let runs = Arc::new(AtomicUsize::new(0));
        let client_retries = Arc::new(AtomicU64::new(0));
        let calls = PRINCIPALS * KEYS_PER_PRINCIPAL * CALLS_PER_KEY;
        let barrier = Arc::new(tokio::sync::Barrier::new(calls));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for p in 0..PRINCIPALS {
            for k in 0..KEYS_PER_PRINCIPAL {
                for c in 0..CALLS_PER_KEY {
                    let idem = Arc::clone(&idems[(p + k + c) % POOLS]);
                    let (runs, retries, barrier) =
                        (Arc::clone(&runs), Arc::clone(&client_retries), Arc::clone(&barrier));
                    let amount = i64::try_from(1 + p * KEYS_PER_PRINCIPAL + k).unwrap();
                    tasks.push(tokio::spawn(async move {
                        let principal = format!("acct-{p}");
                        let key_text = format!("storm-{k}");
                        let scope = Scope::new(
                            Principal::new(&principal).map_err(err)?,
                            Operation::new("debit", 1).map_err(err)?,
                        );
                        let key = Key::new(&key_text).map_err(err)?;
                        let request = Request::new(json!({ "amount": amount }));
                        barrier.wait().await;
                        // A client retries a failed call with the same key.
                        let mut attempt = 0;
                        loop {
                            attempt += 1;
                            let (pr, kt, r) = (principal.clone(), key_text.clone(), Arc::clone(&runs));
                            let out = idem
                                .execute(&scope, &key, &request, move |tx| {
                                    storm_effect(tx, pr.clone(), kt.clone(), amount, Arc::clone(&r))
                                })
                                .await;
                            match out {
                                Ok(o) => return Ok::<_, String>(((p, k), o)),
                                Err(e) if attempt < 20 => {
                                    retries.fetch_add(1, Ordering::SeqCst);
                                    eprintln!("storm: {principal}/{key_text}: retried after {e}");
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                                Err(e) => return Err(format!("{principal}/{key_text}: {e}")),
                            }
                        }
                    }));
                }
            }
        }
        let mut by_key: HashMap<(usize, usize), Vec<Outcome<Balance>>> = HashMap::new();
        for t in tasks {
            let (key, out) = tokio::time::timeout(HANG_GUARD, t)
                .await
                .map_err(|_| "a storm call hung".to_owned())?
                .map_err(err)??;
            by_key.entry(key).or_default().push(out);
        }
        let elapsed = started.elapsed();
        let (mut executed, mut replayed) = (0, 0);
        for ((p, k), outs) in &by_key {
            let answers: Vec<i64> = outs
                .iter()
                .map(|o| match o {
                    Outcome::Executed(b) | Outcome::Replayed(b) => b.balance,
                })
                .collect();
            let winners = outs.iter().filter(|o| matches!(o, Outcome::Executed(_))).count();
            ensure(winners == 1, || format!("acct-{p}/storm-{k}: {winners} executed"))?;
            ensure(answers.iter().all(|a| *a == answers[0]), || {
                format!("acct-{p}/storm-{k}: different replies {answers:?}")
            })?;
            executed += winners;
            replayed += outs.len() - winners;
        }
        ensure(executed == PRINCIPALS * KEYS_PER_PRINCIPAL, || {
            format!("{executed} keys executed")
        })?;
        let ledger_ok = count(
            &bank,
            "SELECT count(*) FROM (SELECT principal, request_key FROM idem_storm_ledger \
             GROUP BY principal, request_key HAVING count(*) = 1) AS once",
        )
        .await?;
        let ledger_rows = count(&bank, "SELECT count(*) FROM idem_storm_ledger").await?;
        let keys = i64::try_from(PRINCIPALS * KEYS_PER_PRINCIPAL).unwrap();
        ensure(ledger_ok == keys && ledger_rows == keys, || {
            format!("ledger: {ledger_rows} rows, {ledger_ok} keys with exactly one")
        })?;
        for p in 0..PRINCIPALS {
            let want = START_BALANCE
                - (0..KEYS_PER_PRINCIPAL)
                    .map(|k| i64::try_from(1 + p * KEYS_PER_PRINCIPAL + k).unwrap())
                    .sum::<i64>();
            let got = count(
                &bank,
                &format!("SELECT balance FROM idem_storm_account WHERE principal = 'acct-{p}'"),
            )
            .await?;
            ensure(got == want, || format!("acct-{p}: balance {got}, expected {want}"))?;
        }
        let records = count(&bank, "SELECT count(*) FROM idem_request_result").await?;
        ensure(records == keys, || format!("{records} records for {keys} keys"))?;
        println!(
            "same-key storm: {keys} keys x {CALLS_PER_KEY} concurrent calls from {POOLS} pools \
             of 24 connections: {executed} executed, {replayed} replayed, every reply equal \
             per key, 1 ledger row per key, balances exact; {} effect runs, {} client \
             retries; {:.1} s",
            runs.load(Ordering::SeqCst),
            client_retries.load(Ordering::SeqCst),
            elapsed.as_secs_f64()
        );
        for idem in idems {
            idem.backend().pool().close().await;
        }
        Ok(())
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Purges

/// Expired and live records spread over many principals (so over shards), expired
/// messages over many subscribers.
async fn fill(bank: &CitusBank, tag: &str, expired: usize, live: usize) -> Res {
    exec(
        bank,
        &format!(
            "INSERT INTO idem_request_result (principal, operation, request_key, request, response, created_at, expires_at) \
             SELECT 'p-' || (i % 37), 'debit:v1', '{tag}-' || i, '{{}}', '{{}}', now() - interval '2 days', now() - interval '1 day' \
             FROM generate_series(1, {expired}) AS i; \
             INSERT INTO idem_request_result (principal, operation, request_key, request, response) \
             SELECT 'p-' || (i % 37), 'debit:v1', '{tag}-live-' || i, '{{}}', '{{}}' FROM generate_series(1, {live}) AS i; \
             INSERT INTO idem_processed_message (subscriber, message_id, processed_at, expires_at) \
             SELECT 's-' || (i % 11), '{tag}-' || i, now() - interval '2 days', now() - interval '1 day' \
             FROM generate_series(1, {expired}) AS i"
        ),
    )
    .await
}

async fn purge_distributed_over_shards(url: String) -> Res {
    with_citus(&url, "purge", |bank, ns, url| async move {
        fill(&bank, "a", 300, 20).await?;
        let idem = Idem::new(bank.backend().clone());
        let report = idem.purge(Duration::ZERO, 40).await.map_err(err)?;
        ensure(report.requests == 300 && report.messages == 300, || {
            format!("purged {report:?}")
        })?;
        let left = count(&bank, "SELECT count(*) FROM idem_request_result").await?;
        ensure(left == 20, || {
            format!("{left} records left, expected the 20 live ones")
        })?;
        println!(
            "distributed purge: 300 expired records over 37 principals and 300 expired \
             messages over 11 subscribers deleted in {} statements of at most 40, 20 live \
             records kept",
            report.batches
        );
        // A backend left with the row-lock style: Citus refuses its first statement
        // (0A000) and it switches to the distributed style.
        fill(&bank, "b", 100, 0).await?;
        let skip_locked = pool_on(&url, &ns, 2, PurgeStyle::SkipLocked).await?;
        let report = Idem::new(skip_locked.clone())
            .purge(Duration::ZERO, 40)
            .await
            .map_err(|e| format!("a SkipLocked purge on Citus: {e}"))?;
        ensure(report.requests == 100 && report.messages == 100, || {
            format!("purged {report:?}")
        })?;
        skip_locked.pool().close().await;
        println!("row-lock purge on Citus: refused, switched, 100 + 100 deleted");
        Ok(())
    })
    .await
}

/// As `crates/idem-postgres/tests/distributed.rs` on plain PostgreSQL: a purge that read
/// an expired key must not delete it once a new request has taken it over. On Citus the
/// purge reads its batch with a statement of its own, then deletes on the shard.
async fn purge_keeps_a_key_taken_over_meanwhile(url: String) -> Res {
    with_citus(&url, "takeover", |bank, ns, url| async move {
        exec(
            &bank,
            "INSERT INTO idem_request_result (principal, operation, request_key, request, response, created_at, expires_at) \
             VALUES ('account-1', 'debit:v1', 'checkout-42', '{\"amount\":100}', '{\"balance\":900}', \
             now() - interval '2 days', now() - interval '1 day')",
        )
        .await?;
        let pool = bank.backend().pool().clone();
        let mut takeover = pool.begin().await.map_err(err)?;
        let gpid: i64 = sqlx::query_scalar("SELECT citus_backend_gpid()")
            .fetch_one(&mut *takeover)
            .await
            .map_err(err)?;
        sqlx::query(
            "UPDATE idem_request_result SET request = '{\"amount\":7}', response = '{\"balance\":893}', \
             created_at = statement_timestamp(), expires_at = statement_timestamp() + interval '1 day' \
             WHERE principal = 'account-1' AND operation = 'debit:v1' AND request_key = 'checkout-42'",
        )
        .execute(&mut *takeover)
        .await
        .map_err(err)?;
        let purger = {
            let backend = pool_on(&url, &ns, 2, PurgeStyle::Distributed).await?;
            tokio::spawn(async move {
                let n = backend.purge_batch(Table::Requests, Duration::ZERO, 100).await;
                backend.pool().close().await;
                n
            })
        };
        let waited = tokio::time::timeout(HANG_GUARD, async {
            loop {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM citus_lock_waits WHERE blocking_gpid = $1",
                )
                .bind(gpid)
                .fetch_one(&pool)
                .await
                .map_err(err)?;
                if n > 0 {
                    return Ok::<_, String>(());
                }
                if purger.is_finished() {
                    return Err("the purge ended before waiting for the takeover".into());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .map_err(|_| "the purge never waited for the takeover".to_owned())?;
        waited?;
        takeover.commit().await.map_err(err)?;
        let deleted = tokio::time::timeout(HANG_GUARD, purger)
            .await
            .map_err(|_| "the purge hung".to_owned())?
            .map_err(err)?
            .map_err(err)?;
        let kept: Option<String> = sqlx::query_scalar(
            "SELECT response FROM idem_request_result \
             WHERE principal = 'account-1' AND operation = 'debit:v1' AND request_key = 'checkout-42'",
        )
        .fetch_optional(&pool)
        .await
        .map_err(err)?;
        ensure(deleted == 0 && kept.as_deref() == Some("{\"balance\":893}"), || {
            format!("the purge deleted {deleted}; the record now: {kept:?}")
        })
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Placement

async fn distribute_reports_each_table(url: String) -> Res {
    // The fixture distributed once already: a second run changes nothing.
    with_citus(&url, "report", |bank, _, _| async move {
        let again = bank.backend().distribute().await.map_err(err)?;
        let lines: Vec<String> = again.iter().map(ToString::to_string).collect();
        ensure(again.iter().all(|p| p.already), || format!("{lines:#?}"))?;
        let tables: Vec<&str> = again.iter().map(|p| p.table).collect();
        ensure(
            tables
                == [
                    "idem_request_result",
                    "idem_run",
                    "idem_processed_message",
                    "idem_outbox",
                    "idem_schema_migrations",
                ],
            || format!("{tables:?}"),
        )?;
        ensure(
            again[..3]
                .iter()
                .all(|p| matches!(p.placed, Placed::Distributed { .. }))
                && again[3].placed == Placed::CoordinatorLocal,
            || format!("{lines:#?}"),
        )?;
        let citus = count(
            &bank,
            "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid IN ('idem_request_result'::regclass, \
             'idem_run'::regclass, 'idem_processed_message'::regclass) AND partmethod = 'h'",
        )
        .await?;
        ensure(citus == 3, || format!("{citus} idem tables hash-distributed"))?;
        for line in lines {
            println!("{line}");
        }
        Ok(())
    })
    .await
}

/// Messages enqueued before the outbox became a Citus local table keep their ids, and
/// later ones get higher ids (Citus 13.2 restarts the identity sequence at 1).
async fn distribute_keeps_outbox_ids(url: String) -> Res {
    let ns = namespace("outboxids");
    // Connected, migrated, not yet distributed.
    let bank = CitusBank::connect(&url, Some(&ns)).await.map_err(err)?;
    let result = async {
        bank.backend().migrate().await.map_err(err)?;
        let pool = bank.backend().pool().clone();
        let enqueue = |m: &'static str| {
            sqlx::query(
                "INSERT INTO idem_outbox (destination, message_id, payload) VALUES ('orders', $1, '{}') RETURNING id",
            )
            .bind(m)
        };
        let mut before = Vec::new();
        for m in ["m-1", "m-2", "m-3"] {
            let row = enqueue(m).fetch_one(&pool).await.map_err(err)?;
            before.push(row.try_get::<i64, _>(0).map_err(err)?);
        }
        // An id used by a rolled-back transaction is never handed out again either.
        let mut tx = pool.begin().await.map_err(err)?;
        let rolled: i64 = enqueue("m-rolled-back")
            .fetch_one(&mut *tx)
            .await
            .map_err(err)?
            .try_get(0)
            .map_err(err)?;
        tx.rollback().await.map_err(err)?;
        let placed = bank.backend().distribute().await.map_err(err)?;
        ensure(
            placed
                .iter()
                .any(|p| p.table == "idem_outbox" && p.placed == Placed::CoordinatorLocal && !p.already),
            || format!("{placed:?}"),
        )?;
        let after: i64 = enqueue("m-4")
            .fetch_one(&pool)
            .await
            .map_err(err)?
            .try_get(0)
            .map_err(err)?;
        let kept: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM idem_outbox WHERE message_id IN ('m-1', 'm-2', 'm-3') ORDER BY id",
        )
        .fetch_all(&pool)
        .await
        .map_err(err)?;
        ensure(kept == before, || format!("ids {before:?} became {kept:?}"))?;
        ensure(after > rolled, || {
            format!("a message enqueued after distribution got id {after}, not above {rolled}")
        })?;
        println!("outbox ids {before:?} (and {rolled}, rolled back) kept; the next message got {after}");
        Ok(())
    }
    .await;
    bank.close().await.map_err(err)?;
    result
}

/// idem's tables (keys `text COLLATE "C"`) get a co-location group of their own: never
/// one of your `text`-keyed tables' groups (Citus refuses to mix collations in one group,
/// and before 14.0 it records every `text` group under the default collation, so
/// joining "the default group" could pick any of them), nor another install's. Your
/// table distributed before idem's stays apart, and one co-located with idem's on
/// purpose (`colocate_with => 'idem_request_result'`, a `COLLATE "C"` key) joins them.
async fn distribute_keeps_a_colocation_group_of_its_own(url: String) -> Res {
    let ns = namespace("colocation");
    let bank = CitusBank::connect(&url, Some(&ns)).await.map_err(err)?;
    let result = async {
        let pool = bank.backend().pool().clone();
        let run = |sql: &'static str| {
            let pool = pool.clone();
            async move {
                sqlx::raw_sql(sql)
                    .execute(&pool)
                    .await
                    .map(drop)
                    .map_err(|e| format!("{sql}: {e}"))
            }
        };
        // Yours first (its own group: on Citus 13 a default one could be joined to
        // another schema's idem tables, the very confusion this checks idem avoids).
        run("CREATE TABLE app_orders (customer text PRIMARY KEY, n int); \
             SELECT create_distributed_table('app_orders', 'customer', colocate_with => 'none')")
        .await?;
        bank.backend().migrate().await.map_err(err)?;
        bank.backend()
            .distribute()
            .await
            .map_err(|e| format!("idem's tables after a table of yours: {e}"))?;
        run("CREATE TABLE app_ledger (principal text COLLATE \"C\" NOT NULL, n int); \
             SELECT create_distributed_table('app_ledger', 'principal', colocate_with => 'idem_request_result')")
        .await?;
        let group: Vec<String> = sqlx::query_scalar(
            "SELECT logicalrelid::regclass::text FROM pg_dist_partition WHERE colocationid = \
             (SELECT colocationid FROM pg_dist_partition WHERE logicalrelid = 'idem_request_result'::regclass) \
             ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .map_err(err)?;
        ensure(
            group
                == [
                    "app_ledger",
                    "idem_processed_message",
                    "idem_request_result",
                    "idem_run",
                ],
            || format!("idem_request_result's co-location group: {group:?}"),
        )?;
        println!("idem's co-location group: {group:?}");
        Ok(())
    }
    .await;
    bank.close().await.map_err(err)?;
    result
}

/// An install distributed at migration 3 takes the later migrations through Citus (the
/// upgrade path: `idem migrate` of a newer idem on a distributed schema).
async fn later_migrations_run_on_distributed_tables(url: String) -> Res {
    let ns = namespace("upgrade");
    let bank = CitusBank::connect(&url, Some(&ns)).await.map_err(err)?;
    let result = async {
        let pool = bank.backend().pool().clone();
        sqlx::raw_sql(
            "CREATE TABLE idem_schema_migrations (version integer PRIMARY KEY, name text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        )
        .execute(&pool)
        .await
        .map_err(err)?;
        for m in idem::postgres::MIGRATIONS.iter().filter(|m| m.version <= 3) {
            sqlx::raw_sql(m.sql).execute(&pool).await.map_err(err)?;
            sqlx::query("INSERT INTO idem_schema_migrations (version, name) VALUES ($1, $2)")
                .bind(i32::try_from(m.version).unwrap())
                .bind(m.name)
                .execute(&pool)
                .await
                .map_err(err)?;
        }
        bank.backend().distribute().await.map_err(err)?;
        let later: Vec<u32> = idem::postgres::MIGRATIONS
            .iter()
            .map(|m| m.version)
            .filter(|v| *v > 3)
            .collect();
        let applied = bank
            .backend()
            .migrate()
            .await
            .map_err(|e| format!("migrations after distribution: {e}"))?;
        ensure(applied == later, || format!("applied {applied:?}, expected {later:?}"))?;
        let citus_tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_dist_partition WHERE logicalrelid IN ('idem_request_result'::regclass, \
             'idem_run'::regclass, 'idem_processed_message'::regclass, 'idem_outbox'::regclass)",
        )
        .fetch_one(&pool)
        .await
        .map_err(err)?;
        ensure(citus_tables == 4, || format!("{citus_tables} idem tables managed by Citus"))?;
        println!("migrations {later:?} applied after distribution");
        Ok(())
    }
    .await;
    bank.close().await.map_err(err)?;
    result
}

// ---------------------------------------------------------------------------------------

type Extra = fn(String) -> idem::core::BoxFuture<'static, Res>;

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let target = Target::optional("IDEM_CITUS_URL");
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap(),
    );
    let extras: Vec<(&str, Extra)> = vec![
        ("same_key_storm", |u| Box::pin(same_key_storm(u))),
        ("purge_distributed_over_shards", |u| {
            Box::pin(purge_distributed_over_shards(u))
        }),
        ("purge_keeps_a_key_taken_over_meanwhile", |u| {
            Box::pin(purge_keeps_a_key_taken_over_meanwhile(u))
        }),
        ("distribute_reports_each_table", |u| {
            Box::pin(distribute_reports_each_table(u))
        }),
        ("distribute_keeps_outbox_ids", |u| {
            Box::pin(distribute_keeps_outbox_ids(u))
        }),
        ("distribute_keeps_a_colocation_group_of_its_own", |u| {
            Box::pin(distribute_keeps_a_colocation_group_of_its_own(u))
        }),
        ("later_migrations_run_on_distributed_tables", |u| {
            Box::pin(later_migrations_run_on_distributed_tables(u))
        }),
    ];
    let mut trials = Vec::new();
    for case in cases::all::<CitusBank>() {
        let name = format!("citus::{}", case.name);
        trials.push(match &target {
            Target::Skip(reason) => {
                eprintln!("SKIPPED {name}: {reason}");
                Trial::test(name, || Ok(())).with_ignored_flag(true)
            }
            Target::Url(url) => {
                let (url, rt) = (url.clone(), Arc::clone(&rt));
                Trial::test(name, move || {
                    rt.block_on(run_case::<CitusBank>(&url, &case))
                        .map(|_| ())
                        .map_err(|e| Failed::from(e.to_string()))
                })
            }
        });
    }
    for (extra, run) in extras {
        let name = format!("citus::{extra}");
        trials.push(match &target {
            Target::Skip(reason) => {
                eprintln!("SKIPPED {name}: {reason}");
                Trial::test(name, || Ok(())).with_ignored_flag(true)
            }
            Target::Url(url) => {
                let (url, rt) = (url.clone(), Arc::clone(&rt));
                Trial::test(name, move || rt.block_on(run(url)).map_err(Failed::from))
            }
        });
    }
    libtest_mimic::run(&args, trials).exit_code()
}
