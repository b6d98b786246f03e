//! `idem maintain`: the maintenance loop ([`idem::core::maintain::Maintainer`]) as an
//! operator command. Run it on every instance; one at a time holds the database's
//! maintenance lock, reports stalled runs, relays and purges; the others stand by and
//! take over within one interval when it dies. It knows no operation's step, so it
//! drives no stalled run: a service that does embeds the loop with its steps.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use idem::core::maintain::{
    self, Completion, DEFAULT_LOCK_NAME, Event, LeaderLock, Maintainer, Purge, TaskError,
    TickReport,
};
use idem::core::observe::cause_label;
use idem::{Backend, DbError, Idem, Maintenance, OutboxStore};
use idem_conformance::Bank;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::commands::parse_duration;
use crate::fail::{self, Fail, connect_within};

/// What `idem maintain --help` shows after the options.
pub(crate) const MAINTAIN_HELP: &str = "\
ONE RUNNER PER DATABASE:
  Start `idem maintain` on every instance (or on two hosts for failover). On each tick
  an instance that is not the runner tries the database's maintenance lock without
  waiting: PostgreSQL pg_try_advisory_lock, MySQL/MariaDB GET_LOCK, SQL Server
  sp_getapplock, Oracle DBMS_LOCK, SQLite an exclusive lock on the file
  <database>.<lock name>.lock. The lock lives on a session of its own and ends with it,
  so when the runner dies (even killed with SIGKILL) another instance takes over within
  one --interval. Instances elect one runner per --lock-name and schema/database.

WHAT THE RUNNER DOES ON EACH TICK (checking before each task that it still holds the
lock, and stopping at once if it does not):
  complete  lists stalled phased runs (their owner's lease ended before a final answer)
            and reports them by operation. This command knows no operation's step, so it
            never takes a run over, releases it or fails it: a client's retry with the
            same key resumes it, or a maintenance loop built into your service with the
            operation's step (idem::core::maintain::Completion) finishes it.
  relay     with --amqp or --nats: up to --relay-passes passes of --relay-batch outbox
            messages (as `idem relay`), in order per destination, at least once.
  purge     up to --purge-batches delete statements of --purge-batch rows, over the
            request, message, run and sent-outbox tables (as `idem purge`).

OUTPUT:
  One line per event on stdout: becoming the runner, each runner tick that did work or
  met a problem, a lost lock, shutdown. With --json, one JSON object per line for every event, standby ticks
  included: {\"event\": \"acquired\" | \"tick\" | \"lost\" | \"releasing\" | \"lock_error\" |
  \"stopped\", \"at_ms\": Unix milliseconds, \"pid\": …, …}.
  SIGINT or SIGTERM: the task in hand finishes, the lock is released, exit 0.
  --ticks N stops after N ticks (N = 1: one elected pass, for a scheduler). A --ticks
  run in which a task failed or the lock could not be tried exits with the last
  failure's code (13: idem's tables not found, 7: the connection was lost, ...) and
  says it on stderr; one in which another instance was the runner exits 0.";

/// The options of `idem maintain`.
#[derive(Debug, Args)]
pub(crate) struct MaintainArgs {
    /// The pause between ticks; a standby tries the lock once per tick, so it also bounds
    /// the takeover after the runner dies (for example 10s, 500ms).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    interval: Duration,
    /// How much of the interval each pause may be shortened by at random, 0 to 1.
    #[arg(long, default_value_t = maintain::DEFAULT_JITTER, value_parser = parse_fraction)]
    jitter: f64,
    /// The lock's name: instances with the same name on the same schema or database elect
    /// one runner (1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-').
    #[arg(long, default_value = DEFAULT_LOCK_NAME)]
    lock_name: String,
    /// The bound on one lock operation; a runner whose check takes longer stops working.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    lock_timeout: Duration,
    /// Stop after this many ticks (default: until SIGINT or SIGTERM).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    ticks: Option<u64>,
    /// One JSON object per event on stdout, standby ticks included.
    #[arg(long)]
    json: bool,

    /// Do not purge.
    #[arg(long)]
    no_purge: bool,
    /// Also keep records written less than this long ago, expired or not.
    #[arg(long, value_parser = parse_duration)]
    older_than: Option<Duration>,
    /// Rows per delete statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    purge_batch: u32,
    /// Delete statements per tick.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    purge_batches: u32,

    /// Relay the outbox to RabbitMQ (amqp://user:pass@host:5672/vhost), as `idem relay`.
    #[arg(long, value_name = "URL", conflicts_with = "nats")]
    amqp: Option<String>,
    /// RabbitMQ: publish to this existing exchange instead of the default one.
    #[arg(long, value_name = "NAME", requires = "amqp", conflicts_with = "nats")]
    exchange: Option<String>,
    /// Relay the outbox to NATS JetStream (nats://host:4222, or a cluster's URLs separated
    /// by commas), as `idem relay`.
    #[arg(long, value_name = "URL")]
    nats: Option<String>,
    /// NATS: the stream that captures destinations no stream captures yet.
    #[arg(long, value_name = "NAME", default_value = "IDEM_OUTBOX")]
    stream: String,
    /// Messages per relay pass.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    relay_batch: u32,
    /// Relay passes per tick.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    relay_passes: u32,

    /// Do not look for stalled runs.
    #[arg(long)]
    no_complete: bool,
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s:?} is not a number from 0 to 1")),
    }
}

/// A backend whose engine has a maintenance lock.
pub(crate) trait Elect: Backend + Maintenance + OutboxStore + Clone {
    /// The engine's lock.
    type Lock: LeaderLock + 'static;
    /// The lock named `name` for this backend's database.
    fn lock(&self, name: &str) -> Result<Self::Lock, DbError>;
}

#[cfg(feature = "sqlite")]
impl Elect for idem::sqlite::SqliteBackend {
    type Lock = idem::sqlite::SqliteLeaderLock;
    fn lock(&self, name: &str) -> Result<Self::Lock, DbError> {
        self.leader_lock(name)
    }
}

#[cfg(feature = "postgres")]
impl Elect for idem::postgres::PgBackend {
    type Lock = idem::postgres::PgLeaderLock;
    fn lock(&self, name: &str) -> Result<Self::Lock, DbError> {
        self.leader_lock(name)
    }
}

#[cfg(feature = "mysql")]
impl Elect for idem::mysql::MysqlBackend {
    type Lock = idem::mysql::MysqlLeaderLock;
    fn lock(&self, name: &str) -> Result<Self::Lock, DbError> {
        self.leader_lock(name)
    }
}

#[cfg(feature = "mssql")]
impl Elect for idem::mssql::MssqlBackend {
    type Lock = idem::mssql::MssqlLeaderLock;
    fn lock(&self, name: &str) -> Result<Self::Lock, DbError> {
        self.leader_lock(name)
    }
}

#[cfg(feature = "oracle")]
impl Elect for idem::oracle::OracleBackend {
    type Lock = idem::oracle::OracleLeaderLock;
    fn lock(&self, name: &str) -> Result<Self::Lock, DbError> {
        self.leader_lock(name)
    }
}

/// The broker `--amqp` / `--nats` name, if any.
#[cfg(any(feature = "amqp", feature = "nats"))]
fn broker(args: &MaintainArgs) -> Result<Option<crate::relay::Target>, Fail> {
    crate::relay::Target::from_options(
        args.amqp.as_deref(),
        args.exchange.as_deref(),
        args.nats.as_deref(),
        &args.stream,
    )
}

/// Without broker features, naming a broker is refused.
#[cfg(not(any(feature = "amqp", feature = "nats")))]
fn broker(args: &MaintainArgs) -> Result<Option<std::convert::Infallible>, Fail> {
    let feature = match (&args.amqp, &args.nats) {
        (Some(_), _) => "amqp",
        (None, Some(_)) => "nats",
        (None, None) => return Ok(None),
    };
    Err(Fail::new(
        fail::INVALID_INPUT,
        format!("this idem was built without the `{feature}` feature"),
    ))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A tick as one JSON object.
fn tick_json(t: &TickReport) -> Value {
    let tasks: Vec<Value> = t
        .tasks
        .iter()
        .map(|task| {
            let counts: serde_json::Map<String, Value> = task
                .work
                .counts
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
                .collect();
            json!({
                "task": task.name,
                "done": task.work.done,
                "more": task.work.more,
                "counts": counts,
                "problems": task.work.problems,
                "error": task.error.as_ref().map(|e| e.message.as_str()),
                "error_kind": task.error.as_ref().map(|e| cause_label(e.kind)),
                "ms": u64::try_from(task.took.as_millis()).unwrap_or(u64::MAX),
            })
        })
        .collect();
    json!({
        "event": "tick",
        "tick": t.number,
        "runner": t.runner,
        "tasks": tasks,
        "skipped": t.skipped,
    })
}

/// A runner tick as one line of text.
fn tick_text(t: &TickReport) -> String {
    let mut parts = Vec::new();
    for task in &t.tasks {
        let mut part = format!("{}: ", task.name);
        if let Some(e) = &task.error {
            part.push_str(&format!("failed: {e}"));
        } else {
            let counts: Vec<String> = task
                .work
                .counts
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            part.push_str(&counts.join(", "));
            if task.work.more {
                part.push_str(" (more left)");
            }
        }
        parts.push(part);
    }
    let mut line = format!("tick {} (runner): {}", t.number, parts.join("; "));
    if t.skipped > 0 {
        line.push_str(&format!("; {} task(s) skipped", t.skipped));
    }
    for task in &t.tasks {
        for p in &task.work.problems {
            line.push_str(&format!("\n  {}: {p}", task.name));
        }
    }
    line
}

/// The failures seen by a run: how many, and the last as its exit code and line.
#[derive(Debug, Default)]
struct Failures {
    count: u64,
    last: Option<Fail>,
}

impl Failures {
    fn record(failures: &Mutex<Self>, fail: Fail) {
        // A poisoned lock only means a panic elsewhere; the counts are still usable.
        let mut f = failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.count += 1;
        f.last = Some(fail);
    }

    /// A task's failure in tick `tick` on `engine`.
    fn task(engine: &str, tick: u64, task: &str, e: &TaskError) -> Fail {
        Fail::new(
            fail::code_for(engine, e.kind),
            fail::with_advice(format!("tick {tick}: {task}: {}", e.message), e.kind),
        )
    }

    /// What a `--ticks` run that saw failures exits with.
    fn outcome(self, ticks: u64) -> Result<(), Fail> {
        match self.last {
            None => Ok(()),
            Some(last) => Err(Fail::new(
                last.code,
                format!(
                    "maintain: {} failure(s) in {ticks} tick(s); the last: {}",
                    self.count, last.message
                ),
            )),
        }
    }
}

/// Prints events; counts ticks for `--ticks` and records failures in `failures`.
fn printer(
    engine: &'static str,
    json_lines: bool,
    stop_after: Option<u64>,
    done: Arc<Notify>,
    failures: Arc<Mutex<Failures>>,
) -> impl FnMut(&Event<'_>) + Send {
    let pid = std::process::id();
    let mut ticks = 0u64;
    move |event| {
        let at_ms = now_ms();
        let (object, text): (Value, Option<String>) = match event {
            Event::Acquired => (
                json!({"event": "acquired"}),
                Some("maintain: this instance is now the runner".to_owned()),
            ),
            Event::Lost { reason } => (
                json!({"event": "lost", "reason": reason}),
                Some(format!(
                    "maintain: the lock was lost ({reason}); standing by"
                )),
            ),
            Event::Releasing => (
                json!({"event": "releasing"}),
                Some("maintain: stopping; releasing the lock".to_owned()),
            ),
            Event::LockError { error } => {
                Failures::record(
                    &failures,
                    Fail::new(
                        fail::code_of(error),
                        format!(
                            "tick {}: the lock could not be tried: {}",
                            ticks + 1,
                            fail::message_of(error)
                        ),
                    ),
                );
                (
                    json!({"event": "lock_error", "error": error.to_string()}),
                    Some(format!("maintain: the lock could not be tried: {error}")),
                )
            }
            Event::Tick(t) => {
                ticks += 1;
                for task in &t.tasks {
                    if let Some(e) = &task.error {
                        Failures::record(&failures, Failures::task(engine, t.number, task.name, e));
                    }
                }
                // Text mode stays quiet on a runner's idle ticks.
                let busy = t.skipped > 0
                    || t.tasks.iter().any(|task| {
                        task.work.done > 0 || task.error.is_some() || !task.work.problems.is_empty()
                    });
                let text = (t.runner && busy).then(|| tick_text(t));
                (tick_json(t), text)
            }
            _ => (json!({"event": "other"}), None),
        };
        if json_lines {
            let mut object = object;
            if let Value::Object(m) = &mut object {
                m.insert("at_ms".into(), Value::from(at_ms));
                m.insert("pid".into(), Value::from(pid));
            }
            say!("{object}");
        } else if let Some(text) = text {
            say!("{text}");
        }
        if stop_after.is_some_and(|n| ticks >= n) {
            done.notify_one();
        }
    }
}

/// Completes on SIGTERM, SIGINT or after `--ticks`.
async fn shutdown(done: Arc<Notify>) -> Result<impl std::future::Future<Output = ()>, Fail> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Fail::new(fail::OTHER, format!("cannot handle SIGTERM: {e}")))?;
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| Fail::new(fail::OTHER, format!("cannot handle SIGINT: {e}")))?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
            () = done.notified() => {}
        }
    })
}

pub(crate) async fn run<K: Bank>(url: &str, args: MaintainArgs) -> Result<(), Fail>
where
    K::B: Elect,
{
    let broker = broker(&args)?;
    let bank = connect_within(url, K::connect(url, None)).await?;
    let backend = bank.backend().clone();
    let engine = backend.engine();
    let lock = backend.lock(&args.lock_name).map_err(|e| {
        Fail::new(
            if e.kind() == idem::ErrorKind::Configuration {
                fail::INVALID_INPUT
            } else {
                fail::code_of(&e)
            },
            e.to_string(),
        )
    })?;
    let idem = Idem::new(backend);
    let done = Arc::new(Notify::new());
    let stop = shutdown(Arc::clone(&done)).await?;
    let mut maintainer = Maintainer::new(idem, lock)
        .with_interval(args.interval)
        .with_jitter(args.jitter)
        .with_lock_timeout(args.lock_timeout);
    let mut plan = Vec::new();
    if !args.no_complete {
        // No step: stalled runs are listed and reported, never touched.
        maintainer = maintainer.with_task(Completion::new());
        plan.push("report stalled runs (none is touched)".to_owned());
    }
    #[cfg(any(feature = "amqp", feature = "nats"))]
    if let Some(target) = broker {
        maintainer = maintainer.with_task(
            maintain::Relay::new(crate::relay::Reconnecting::new(target))
                .batch(args.relay_batch)
                .passes(args.relay_passes),
        );
        plan.push("relay".to_owned());
    }
    #[cfg(not(any(feature = "amqp", feature = "nats")))]
    if let Some(never) = broker {
        match never {}
    }
    if !args.no_purge {
        maintainer = maintainer.with_task(
            Purge::new()
                .older_than(args.older_than.unwrap_or_default())
                .batch(args.purge_batch)
                .max_batches(args.purge_batches),
        );
        plan.push("purge".to_owned());
    }
    if !args.json {
        say!(
            "maintain: lock {:?} on {}, every {:?}: {}",
            args.lock_name,
            idem::redact(url),
            args.interval,
            if plan.is_empty() {
                "nothing to do".to_owned()
            } else {
                plan.join("; ")
            }
        );
    }
    let failures = Arc::new(Mutex::new(Failures::default()));
    let maintainer = maintainer.on_event(printer(
        engine,
        args.json,
        args.ticks,
        done,
        Arc::clone(&failures),
    ));
    let ran = maintainer.run(stop).await;
    let closed = bank.close().await;
    let failures = std::mem::take(
        &mut *failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    if args.json {
        say!(
            "{}",
            json!({
                "event": "stopped",
                "ticks": ran.ticks,
                "runner_ticks": ran.runner_ticks,
                "acquired": ran.acquired,
                "lost": ran.lost,
                "failures": failures.count,
                "at_ms": now_ms(),
                "pid": std::process::id(),
            })
        );
    } else {
        say!(
            "maintain: stopped after {} tick(s), {} as the runner",
            ran.ticks,
            ran.runner_ticks
        );
    }
    // A --ticks run is a scheduler's job: its exit code says whether its work failed. An
    // endless run is stopped by a signal; its failures are in its output and metrics.
    if args.ticks.is_some() {
        failures.outcome(ran.ticks)?;
    }
    closed.map_err(Fail::from)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use idem::core::maintain::{TaskReport, Work};

    #[test]
    fn fractions_are_checked() {
        assert_eq!(parse_fraction("0.25"), Ok(0.25));
        assert!(parse_fraction("1.5").is_err());
        assert!(parse_fraction("-0.1").is_err());
        assert!(parse_fraction("x").is_err());
    }

    #[test]
    fn ticks_print_as_text_and_json() {
        let t = TickReport {
            number: 3,
            runner: true,
            tasks: vec![TaskReport {
                name: "purge",
                work: Work {
                    done: 5,
                    more: true,
                    counts: vec![("requests", 5), ("messages", 0)],
                    problems: vec!["p".into()],
                },
                error: None,
                took: Duration::from_millis(7),
            }],
            skipped: 1,
        };
        assert_eq!(
            tick_text(&t),
            "tick 3 (runner): purge: requests 5, messages 0 (more left); 1 task(s) skipped\n  purge: p"
        );
        let v = tick_json(&t);
        assert_eq!(v["runner"], true);
        assert_eq!(v["tasks"][0]["counts"]["requests"], 5);
        assert_eq!(v["tasks"][0]["ms"], 7);
        assert_eq!(v["tasks"][0]["error"], Value::Null);
        assert_eq!(v["tasks"][0]["error_kind"], Value::Null);

        let failed = TickReport {
            tasks: vec![TaskReport {
                name: "complete",
                work: Work::default(),
                error: Some(TaskError {
                    kind: idem::ErrorKind::MissingTable,
                    message: "sqlite table or column not found (1): no such table: x".into(),
                }),
                took: Duration::ZERO,
            }],
            skipped: 0,
            ..t
        };
        assert_eq!(
            tick_text(&failed),
            "tick 3 (runner): complete: failed: sqlite table or column not found (1): no such table: x"
        );
        let v = tick_json(&failed);
        assert_eq!(
            v["tasks"][0]["error"],
            "sqlite table or column not found (1): no such table: x"
        );
        assert_eq!(v["tasks"][0]["error_kind"], "missing_table");
    }

    #[test]
    fn a_ticks_run_exits_with_its_last_failure() {
        assert!(Failures::default().outcome(1).is_ok());
        let failures = Mutex::new(Failures::default());
        let error = |kind| TaskError {
            kind,
            message: "the error".into(),
        };
        for (engine, task, kind) in [
            ("sqlite", "complete", idem::ErrorKind::Connection),
            ("postgres", "purge", idem::ErrorKind::MissingTable),
        ] {
            Failures::record(&failures, Failures::task(engine, 2, task, &error(kind)));
        }
        let f = failures.into_inner().unwrap().outcome(2).unwrap_err();
        assert_eq!(f.code, fail::MISSING_TABLE);
        assert!(
            f.message.starts_with(
                "maintain: 2 failure(s) in 2 tick(s); the last: tick 2: purge: the error; \
                 run `idem migrate` with this URL first"
            ),
            "{}",
            f.message
        );
        // SQLite's lost connection is a file that cannot be opened, as for every command.
        let f = Failures::task("sqlite", 1, "purge", &error(idem::ErrorKind::Connection));
        assert_eq!(
            (f.code, f.message.as_str()),
            (fail::MISSING_DATABASE, "tick 1: purge: the error")
        );
    }
}
