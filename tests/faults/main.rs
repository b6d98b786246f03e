//! The fault suite: idem's exactly-once promise under killed sessions and killed clients.
//!
//! Per live engine (SQLite, PostgreSQL, MariaDB/MySQL), each trial works in a private
//! schema, database or file, debits one account through `Idem::execute` and injects
//! faults at a known point of the transaction:
//!
//! - `session_killed_in_claim`: a second connection kills the session while its claim
//!   waits for a concurrent holder of the same key (`pg_terminate_backend`, `KILL`);
//! - `session_killed_in_effect`: killed between the effect's two statements;
//! - `session_killed_at_commit`: killed while its `COMMIT` (PostgreSQL: a deferred
//!   trigger) or its completion statement (MariaDB: a trigger) waits on a gate the test
//!   holds, or killed just as the gate opens (racing the commit);
//! - `client_process_killed`: a child process running idem is SIGKILLed inside the
//!   effect, at the commit gate, and at a random moment of a stream of debits;
//! - `broken_protocol_is_caught`: the same process kill against two deliberately broken
//!   protocols must make the invariant checker fail: the record committed in a
//!   transaction of its own before the effect (a lost effect), or after it (a doubled
//!   one).
//!
//! After every fault each key is retried with the same key until it succeeds (bounded),
//! and the invariant is checked: the balance moved by exactly the sum of the stored
//! debits; every stored record has its effect applied exactly once (a ledger row written
//! by the effect, with no unique constraint, counts applications); one record per key;
//! every successful reply equals the stored response.
//!
//! Size: `--scale N` (or `IDEM_FAULT_SCALE=N`) multiplies the rounds of every trial
//! (default 1, about a minute for the three engines in a debug build):
//! `cargo test -p idem-tests --all-features --test faults -- --scale 10`.
//! Each trial prints one `FAULTS …` line with its figures.

#![allow(clippy::unwrap_used)]

mod check;
mod child;
mod engines;
mod scenarios;

use std::process::ExitCode;
use std::sync::Arc;

use libtest_mimic::{Arguments, Failed, Trial};

/// The environment variable that turns this binary into a child client.
pub(crate) const CHILD_ENV: &str = "IDEM_FAULT_CHILD";

fn main() -> ExitCode {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        return child::main(&spec);
    }
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
    let mut trials = Vec::new();
    #[cfg(feature = "sqlite")]
    trials.extend(engine_trials::<idem_conformance::sqlite::SqliteBank>(
        &rt,
        scale,
        std::env::var("IDEM_SQLITE_URL").unwrap_or_else(|_| {
            let dir = std::env::temp_dir().join("idem-faults");
            format!("sqlite://{}/faults.db", dir.display())
        }),
    ));
    #[cfg(feature = "postgres")]
    trials.extend(engine_trials::<idem_conformance::postgres::PgBank>(
        &rt,
        scale,
        std::env::var("IDEM_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into()),
    ));
    #[cfg(feature = "mysql")]
    trials.extend(engine_trials::<idem_conformance::mysql::MysqlBank>(
        &rt,
        scale,
        std::env::var("IDEM_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into()),
    ));
    libtest_mimic::run(&args, trials).exit_code()
}

/// Takes `--scale N` (or `--scale=N`) out of the arguments; `IDEM_FAULT_SCALE` otherwise.
fn split_scale(args: impl Iterator<Item = String>) -> Result<(u32, Vec<String>), String> {
    let parse = |s: &str| {
        s.parse::<u32>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| format!("--scale takes a whole number from 1 to 1000, not {s:?}"))
    };
    let mut scale = match std::env::var("IDEM_FAULT_SCALE") {
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

type Scenario = fn(engines::Ctx) -> scenarios::BoxRun;

fn engine_trials<K: engines::Faulty>(
    rt: &Arc<tokio::runtime::Runtime>,
    scale: u32,
    url: String,
) -> Vec<Trial> {
    let mut list: Vec<(&str, Scenario)> = Vec::new();
    if K::SESSIONS_KILLABLE {
        list.push(("session_killed_in_claim", |c| {
            Box::pin(scenarios::killed_in_claim::<K>(c))
        }));
        list.push(("session_killed_in_effect", |c| {
            Box::pin(scenarios::killed_in_effect::<K>(c))
        }));
        list.push(("session_killed_at_commit", |c| {
            Box::pin(scenarios::killed_at_commit::<K>(c))
        }));
    }
    list.push(("client_process_killed", |c| {
        Box::pin(scenarios::process_killed::<K>(c))
    }));
    list.push(("broken_protocol_is_caught", |c| {
        Box::pin(scenarios::broken_protocol::<K>(c))
    }));
    list.into_iter()
        .map(|(name, run)| {
            let rt = Arc::clone(rt);
            let url = url.clone();
            let trial = format!("{}::{name}", K::ENGINE);
            Trial::test(trial.clone(), move || {
                let ctx = engines::Ctx {
                    url,
                    scale,
                    trial: name,
                };
                rt.block_on(run(ctx))
                    .map(|figures| println!("FAULTS {trial}: {figures}"))
                    .map_err(Failed::from)
            })
        })
        .collect()
}
