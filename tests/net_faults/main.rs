//! The network-fault suite: lost replies, connections cut mid-statement and delayed
//! replies, injected by a TCP proxy between idem and a real server
//! (`idem_conformance::proxy`), on every path that commits.
//!
//! The most common fault of this domain is a `COMMIT` that succeeds on the server while
//! the client only sees a broken connection. The proxy follows the PostgreSQL and MySQL
//! wire protocols (prepared statements included) and, per key, finds a chosen statement
//! by markers in its SQL or bound parameters ("the `COMMIT` after the statement that
//! writes the history row of key K at point `charged`"); there it forwards the statement
//! and drops the server's answer, cuts the connection in the middle of the statement, or
//! delays the answer.
//!
//! Trials, per engine (`postgres::`, `mysql::`, and `galera::` on the first node of the
//! private Galera cluster when `IDEM_GALERA_URLS` is set, ignored by name otherwise):
//!
//! - `execute`, `execute_final`, `consume`: the claim's reply lost, the completion cut,
//!   the commit's reply lost, cut or delayed (also past the client's patience);
//! - `phased`: `start`, both phases, `heartbeat`, `release` (after a failed step),
//!   `finish` and `fail`, through `Idem::execute_phased`;
//! - `complete`: the completer taking stalled runs over and driving them to their end;
//! - `outbox`: `enqueue` inside an effect, then the relay's claim and mark-sent.
//!
//! After each fault the client retries with the same key until it gets a definite
//! answer; then the checker reads the database (an operation whose outcome was unknown
//! may have happened or not, never twice): every effect applied exactly once (a ledger
//! row per application, no unique constraint), a run's recovery point never moved
//! backwards (each phase records the point it saw), every answer a client got equal to
//! the stored one, every committed outbox message published at least once (an in-test
//! publisher records what the relay sent) and none of a rolled-back effect. Every
//! planned fault must have hit.
//!
//! `cargo test -p idem-tests --features mysql --test net_faults` (scale 1);
//! bigger: `-- --scale 5` or `IDEM_NETFAULT_SCALE=5` (keys × 5). One engine:
//! `-- postgres::`. Each trial prints one `NETFAULTS …` line with its figures.
//! `record_wire_fixtures` (ignored) records the protocol fixtures of the proxy's
//! offline tests.

#![allow(clippy::unwrap_used)]

mod check;
mod client;
mod engines;
mod paths;
mod record;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use libtest_mimic::{Arguments, Failed, Trial};

use crate::client::{Env, Figures, Res, fail};
use crate::engines::Net;

/// No trial runs longer than this (a hang guard; nothing asserts durations).
const TRIAL_GUARD: Duration = Duration::from_secs(600);

const TRIALS: [&str; 6] = [
    "execute",
    "execute_final",
    "consume",
    "phased",
    "complete",
    "outbox",
];

fn main() -> ExitCode {
    let (scale, args) = match split_scale(std::env::args()) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let args = Arguments::from_iter(args);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(rt) => Arc::new(rt),
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let postgres = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let mysql = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let galera = std::env::var("IDEM_GALERA_URLS")
        .ok()
        .and_then(|urls| urls.split_whitespace().next().map(str::to_owned))
        .ok_or_else(|| {
            "IDEM_GALERA_URLS is not set: run through `ci/galera.sh run cargo test …`, which \
             starts the private 3-node cluster"
                .to_owned()
        });
    let mut trials = Vec::new();
    trials.extend(engine_trials::<PgBank>(
        &rt,
        "postgres",
        Ok(postgres.clone()),
        scale,
    ));
    trials.extend(engine_trials::<MysqlBank>(
        &rt,
        "mysql",
        Ok(mysql.clone()),
        scale,
    ));
    trials.extend(engine_trials::<MysqlBank>(&rt, "galera", galera, scale));
    let recorder = Arc::clone(&rt);
    trials.push(
        Trial::test("record_wire_fixtures", move || {
            recorder
                .block_on(record::fixtures(&postgres, &mysql))
                .map(|written| println!("{written}"))
        })
        .with_ignored_flag(true),
    );
    libtest_mimic::run(&args, trials).exit_code()
}

/// Takes `--scale N` (or `--scale=N`) out of the arguments; `IDEM_NETFAULT_SCALE`
/// otherwise.
fn split_scale(args: impl Iterator<Item = String>) -> Result<(u32, Vec<String>), String> {
    let parse = |s: &str| {
        s.parse::<u32>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| format!("--scale takes a whole number from 1 to 100, not {s:?}"))
    };
    let mut scale = match std::env::var("IDEM_NETFAULT_SCALE") {
        Ok(s) => parse(&s)?,
        Err(_) => 1,
    };
    let mut rest = Vec::new();
    let mut args = args;
    while let Some(arg) = args.next() {
        if arg == "--scale" {
            let value = args.next().ok_or("--scale needs a value")?;
            scale = parse(&value)?;
        } else if let Some(value) = arg.strip_prefix("--scale=") {
            scale = parse(value)?;
        } else {
            rest.push(arg);
        }
    }
    Ok((scale, rest))
}

fn engine_trials<K: Net>(
    rt: &Arc<tokio::runtime::Runtime>,
    engine: &'static str,
    url: Result<String, String>,
    scale: u32,
) -> Vec<Trial> {
    if let Err(reason) = &url {
        eprintln!("SKIPPED {engine}::*: {reason}");
    }
    TRIALS
        .iter()
        .map(|&name| {
            let trial = format!("{engine}::{name}");
            match &url {
                Err(_) => Trial::test(trial, || Ok(())).with_ignored_flag(true),
                Ok(url) => {
                    let (rt, url) = (Arc::clone(rt), url.clone());
                    Trial::test(trial.clone(), move || {
                        let run = run_trial::<K>(url, name, scale);
                        let figures = rt
                            .block_on(async { tokio::time::timeout(TRIAL_GUARD, run).await })
                            .map_err(|_| {
                                fail(format!("{trial}: no end after {TRIAL_GUARD:?}"))
                            })??;
                        println!("NETFAULTS {trial} (scale {scale}): {figures}");
                        Ok::<(), Failed>(())
                    })
                }
            }
        })
        .collect()
}

async fn run_trial<K: Net>(url: String, name: &'static str, scale: u32) -> Res<Figures> {
    let env = Env::<K>::open(&url, name).await?;
    let result = match name {
        "execute" => paths::execute(&env, scale).await,
        "execute_final" => paths::execute_final(&env, scale).await,
        "consume" => paths::consume(&env, scale).await,
        "phased" => paths::phased(&env, scale).await,
        "complete" => paths::complete(&env, scale).await,
        "outbox" => paths::outbox(&env, scale).await,
        other => Err(fail(format!("no trial {other}"))),
    };
    let closed = env.close().await;
    let figures = result?;
    closed?;
    Ok(figures)
}
