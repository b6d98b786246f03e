//! `idem maintain` as real processes, three per engine, on SQLite, PostgreSQL and
//! MariaDB (both required: an unreachable server fails the test).
//!
//! Each process prints one JSON object per event (`--json`). From those lines the test
//! checks, per engine:
//! - exactly one runner at a time: the spans between each process's `acquired` and its
//!   `lost`/`releasing` (or its death, for the process killed with SIGKILL) never
//!   overlap, and every tick that did work falls inside its process's span;
//! - standbys do no work (their ticks run no task);
//! - after the runner is killed with SIGKILL, another process becomes the runner within
//!   the interval plus a generous bound (never a precise timing);
//! - a stalled run of an operation `idem maintain` has no step for is reported
//!   (`unhandled`) and left exactly as it was: same owner, same fence, not taken over.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem::core::runs::RunRow;
use idem::{Idem, Key, Operation, Principal, Request, RunStore, Scope, Started};
use serde_json::{Value, json};

/// Generous guard against a hung process (never an assertion on speed).
const GUARD: Duration = Duration::from_secs(120);
/// The processes' tick interval.
const INTERVAL_MS: u64 = 1000;
/// What a takeover may take beyond the interval: the kill, the server ending the dead
/// session, a loaded machine. Generous on purpose.
const TAKEOVER_SLACK_MS: u64 = 15_000;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One `idem maintain` process; its JSON lines arrive on the shared channel as
/// `(index, line)`.
struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn spawn(url: &str, lock: &str, index: usize, tx: &mpsc::Sender<(usize, Value)>) -> Proc {
    let interval = format!("{INTERVAL_MS}ms");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--url", url, "maintain", "--json", "--interval", &interval])
        .args(["--lock-name", lock, "--lock-timeout", "5s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn idem maintain");
    let stdout = child.stdout.take().unwrap();
    let tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let value: Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            if tx.send((index, value)).is_err() {
                break;
            }
        }
    });
    Proc { child }
}

/// Receives lines into `log` until `done(log)` holds (bounded by the guard).
fn wait_until(
    rx: &mpsc::Receiver<(usize, Value)>,
    log: &mut Vec<(usize, Value)>,
    what: &str,
    done: impl Fn(&[(usize, Value)]) -> bool,
) {
    let deadline = Instant::now() + GUARD;
    while !done(log) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => log.push(line),
            Err(_) => panic!("timed out waiting for {what}; lines so far:\n{log:#?}"),
        }
    }
}

fn event(v: &Value) -> &str {
    v["event"].as_str().unwrap_or_default()
}

fn at(v: &Value) -> u64 {
    v["at_ms"].as_u64().unwrap()
}

fn runner_ticks(log: &[(usize, Value)], index: usize) -> usize {
    log.iter()
        .filter(|(i, v)| *i == index && event(v) == "tick" && v["runner"] == true)
        .count()
}

fn standby_ticks(log: &[(usize, Value)], index: usize) -> usize {
    log.iter()
        .filter(|(i, v)| *i == index && event(v) == "tick" && v["runner"] == false)
        .count()
}

fn runner(log: &[(usize, Value)]) -> Option<usize> {
    log.iter()
        .rev()
        .find(|(_, v)| event(v) == "acquired")
        .map(|(i, _)| *i)
}

/// The stalled run left for the processes: an operation they have no step for.
fn ghost() -> (Scope, Key) {
    (
        Scope::new(
            Principal::new("account-9").unwrap(),
            Operation::new("ghost", 1).unwrap(),
        ),
        Key::new("stalled-1").unwrap(),
    )
}

/// Starts a run of `ghost:v1` with a 100 ms lease and abandons it; returns its row.
async fn stall<B: RunStore + std::fmt::Debug>(backend: B) -> RunRow {
    let idem = Idem::new(backend).with_lease(Duration::from_millis(100));
    let (scope, key) = ghost();
    let request = Request::new(json!({"amount": 5}));
    match idem
        .start::<std::convert::Infallible>(&scope, &key, &request)
        .await
    {
        Ok(Started::Run(run)) => drop(run),
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let row = read_run(idem.backend()).await;
    assert!(row.lease_over && row.status.is_none(), "{row:?}");
    row
}

async fn read_run<B: RunStore>(backend: &B) -> RunRow {
    let (scope, key) = ghost();
    let mut tx = backend.begin_runs(None).await.unwrap();
    let row = backend.read_run(&mut tx, &scope, &key).await.unwrap();
    backend.rollback_runs(tx).await.unwrap();
    row.expect("the stalled run is still there")
}

/// Three processes, the runner killed, the rest stopped; returns every line, by process.
fn elect_and_fail_over(url: &str) -> Vec<(usize, Value)> {
    let lock = format!(
        "t-{}-{:06x}",
        std::process::id(),
        fastrand::u32(..0xff_ffff)
    );
    let (tx, rx) = mpsc::channel();
    let mut procs: Vec<Option<Proc>> = (0..3).map(|i| Some(spawn(url, &lock, i, &tx))).collect();
    drop(tx);
    let mut log = Vec::new();

    // One becomes the runner and works; the other two tick as standbys beside it.
    wait_until(&rx, &mut log, "a runner and two standbys", |log| {
        runner(log).is_some_and(|r| {
            runner_ticks(log, r) >= 3
                && (0..3)
                    .filter(|i| *i != r)
                    .all(|i| standby_ticks(log, i) >= 2)
        })
    });
    let first = runner(&log).unwrap();

    // SIGKILL the runner: no release, no goodbye.
    let kill_sent = now_ms();
    let mut killed = procs[first].take().unwrap();
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    drop(killed);

    wait_until(&rx, &mut log, "a takeover", |log| {
        log.iter()
            .any(|(i, v)| *i != first && event(v) == "acquired")
    });
    let second = runner(&log).unwrap();
    assert_ne!(second, first);
    let took_over = log
        .iter()
        .find(|(i, v)| *i == second && event(v) == "acquired")
        .map(|(_, v)| at(v))
        .unwrap();
    let waited = took_over.saturating_sub(kill_sent);
    assert!(
        waited <= INTERVAL_MS + TAKEOVER_SLACK_MS,
        "the takeover took {waited} ms after the SIGKILL (interval {INTERVAL_MS} ms)"
    );
    wait_until(&rx, &mut log, "the new runner's ticks", |log| {
        runner_ticks(log, second) >= 2
    });

    // Stop the survivors (SIGTERM): each releases what it holds and exits 0.
    for p in procs.iter_mut().flatten() {
        let pid = p.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
    }
    for p in procs.iter_mut().flatten() {
        let status = p.child.wait().unwrap();
        assert!(status.success(), "idem maintain exited with {status}");
    }
    while let Ok(line) = rx.recv_timeout(GUARD) {
        log.push(line);
    }

    // Exactly one runner at a time: the spans of belief never overlap.
    let mut spans: Vec<(u64, u64, usize)> = Vec::new();
    for index in 0..3 {
        let mut start = None;
        for (_, v) in log.iter().filter(|(i, _)| *i == index) {
            match event(v) {
                "acquired" => start = Some(at(v)),
                "lost" | "releasing" => {
                    let s = start.take().expect("released without holding");
                    spans.push((s, at(v), index));
                }
                "tick" if v["runner"] == true => {
                    let s = start.expect("a runner tick outside a held span");
                    assert!(at(v) >= s);
                }
                "tick" => assert_eq!(v["tasks"], json!([]), "a standby worked: {v}"),
                _ => {}
            }
        }
        if let Some(s) = start {
            // The killed runner's span ends when the kill was sent: it died later, and
            // the server freed its lock only after that, so no other process can hold
            // the lock before this end without also overlapping its real hold.
            assert_eq!(index, first, "only the killed process ends while holding");
            spans.push((s, kill_sent, index));
        }
    }
    spans.sort_unstable();
    assert!(spans.len() >= 2, "{spans:?}");
    for pair in spans.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "two runners at once: {pair:?} in {spans:?}"
        );
    }
    eprintln!(
        "{}: runner spans (start ms, end ms, process) {spans:?}; takeover {waited} ms after \
         the SIGKILL; {} ticks",
        url.split(':').next().unwrap_or_default(),
        log.iter().filter(|(_, v)| event(v) == "tick").count()
    );
    // The stalled run of an unknown operation was reported by the runners' ticks.
    let reported = log.iter().any(|(_, v)| {
        v["tasks"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["task"] == "complete" && t["counts"]["unhandled"] == 1)
    });
    assert!(reported, "no tick reported the unhandled stalled run");
    log
}

fn required(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

#[test]
fn sqlite_one_runner_at_a_time_and_a_takeover_after_sigkill() {
    let dir = std::env::temp_dir().join(format!(
        "idem-maintain-{}-{:06x}",
        std::process::id(),
        fastrand::u32(..0xff_ffff)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("m.db").display());
    let rt = runtime();
    let migrated = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--url", &url, "migrate"])
        .status()
        .unwrap();
    assert!(migrated.success());
    let backend = rt
        .block_on(idem::sqlite::SqliteBackend::connect(&url))
        .unwrap();
    let before = rt.block_on(stall(backend.clone()));
    elect_and_fail_over(&url);
    let after = rt.block_on(read_run(&backend));
    assert_eq!(
        (&after.owner, after.fence, &after.point),
        (&before.owner, before.fence, &before.point),
        "the unknown operation's run was touched"
    );
    drop(backend);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn postgres_one_runner_at_a_time_and_a_takeover_after_sigkill() {
    use idem::postgres::sqlx;
    let base = required(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    );
    let schema = format!(
        "idem_maint_{}_{:06x}",
        std::process::id(),
        fastrand::u32(..0xff_ffff)
    );
    let rt = runtime();
    let admin = rt
        .block_on(sqlx::PgPool::connect(&base))
        .unwrap_or_else(|e| panic!("PostgreSQL at {base} must be running: {e}"));
    rt.block_on(
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}"))).execute(&admin),
    )
    .unwrap();
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}options=-c%20search_path%3D{schema}");
    let migrated = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--url", &url, "migrate"])
        .status()
        .unwrap();
    assert!(migrated.success());
    let backend = rt
        .block_on(idem::postgres::PgBackend::connect(&url))
        .unwrap();
    let before = rt.block_on(stall(backend.clone()));
    elect_and_fail_over(&url);
    let after = rt.block_on(read_run(&backend));
    assert_eq!(
        (&after.owner, after.fence, &after.point),
        (&before.owner, before.fence, &before.point),
        "the unknown operation's run was touched"
    );
    rt.block_on(backend.pool().close());
    rt.block_on(
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE"))).execute(&admin),
    )
    .unwrap();
}

#[test]
fn mariadb_one_runner_at_a_time_and_a_takeover_after_sigkill() {
    use idem::mysql::mysql_async::prelude::Queryable;
    let base = required("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
    let db = format!(
        "idem_maint_{}_{:06x}",
        std::process::id(),
        fastrand::u32(..0xff_ffff)
    );
    let rt = runtime();
    let admin = idem::mysql::MysqlBackend::connect(&base);
    let admin = rt
        .block_on(admin)
        .unwrap_or_else(|e| panic!("MariaDB at {base} must be running: {e}"));
    let run_sql = |sql: String| {
        rt.block_on(async {
            let mut conn = admin.pool().get_conn().await.unwrap();
            conn.query_drop(sql).await.unwrap();
        });
    };
    run_sql(format!("CREATE DATABASE {db}"));
    let (prefix, _) = base.rsplit_once('/').unwrap();
    let url = format!("{prefix}/{db}");
    let backend = rt
        .block_on(async {
            let migrated = Command::new(env!("CARGO_BIN_EXE_idem"))
                .args(["--url", &url, "migrate"])
                .status()
                .unwrap();
            assert!(migrated.success());
            idem::mysql::MysqlBackend::connect(&url).await
        })
        .unwrap();
    let before = rt.block_on(stall(backend.clone()));
    elect_and_fail_over(&url);
    let after = rt.block_on(read_run(&backend));
    assert_eq!(
        (&after.owner, after.fence, &after.point),
        (&before.owner, before.fence, &before.point),
        "the unknown operation's run was touched"
    );
    rt.block_on(backend.disconnect()).unwrap();
    run_sql(format!("DROP DATABASE {db}"));
    rt.block_on(admin.disconnect()).unwrap();
}

/// The runner's relay task, through the command: one elected tick with `--amqp` publishes
/// the committed outbox messages to RabbitMQ (required: `IDEM_AMQP_URL`, by default the
/// local broker), in order, with their message IDs, and marks them sent; the passes stop
/// at the bound the options set.
#[test]
fn sqlite_relay_task_publishes_the_outbox_to_rabbitmq() {
    use idem::consumer::lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeleteOptions};
    use idem::consumer::lapin::{Connection, ConnectionProperties};
    use idem::{OutboxStore, Outgoing};

    let amqp = required("IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let tag = format!("{}_{:06x}", std::process::id(), fastrand::u32(..0xff_ffff));
    let dir = std::env::temp_dir().join(format!("idem-maintain-relay-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("sqlite://{}", dir.join("m.db").display());
    let queue = format!("idem_maint_q_{tag}");
    let rt = runtime();
    let migrated = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--url", &url, "migrate"])
        .status()
        .unwrap();
    assert!(migrated.success());
    let backend = rt
        .block_on(idem::sqlite::SqliteBackend::connect(&url))
        .unwrap();
    rt.block_on(async {
        let mut tx = backend.begin_runs(None).await.unwrap();
        for i in 1..=5 {
            let m = Outgoing::new(&queue, &format!("m-{i}"), &json!({"n": i})).unwrap();
            backend.enqueue(&mut tx, &m).await.unwrap();
        }
        backend.commit_runs(tx).await.unwrap();
    });

    // Two passes of two messages: four published, one left for the next tick.
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--url", &url, "maintain", "--json", "--ticks", "1"])
        .args(["--amqp", &amqp, "--relay-batch", "2", "--relay-passes", "2"])
        .args([
            "--no-purge",
            "--no-complete",
            "--lock-name",
            &format!("relay-{tag}"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tick = lines.iter().find(|v| event(v) == "tick").unwrap();
    assert_eq!(tick["runner"], true, "{tick}");
    let relay = &tick["tasks"][0];
    assert_eq!(
        (
            &relay["task"],
            &relay["done"],
            &relay["more"],
            &relay["error"]
        ),
        (&json!("relay"), &json!(4), &json!(true), &Value::Null),
        "{tick}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("guest:guest"),
        "the broker's password is never printed"
    );

    let got = rt.block_on(async {
        let conn = Connection::connect(&amqp, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ must be running: {e}"));
        let ch = conn.create_channel().await.unwrap();
        let mut ids = Vec::new();
        while let Some(m) = ch
            .basic_get(queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            let d = m.delivery;
            ids.push(d.properties.message_id().as_ref().map(|s| s.to_string()));
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
        }
        let _ = ch
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = conn.close(200, "done".into()).await;
        ids
    });
    let want: Vec<Option<String>> = (1..=4).map(|i| Some(format!("m-{i}"))).collect();
    assert_eq!(got, want, "published in order, with their IDs");
    let unsent = rt.block_on(async {
        let mut tx = backend.begin_runs(None).await.unwrap();
        let rows = backend.lock_due(&mut tx, 100).await.unwrap();
        backend.rollback_runs(tx).await.unwrap();
        rows
    });
    let left: Vec<&str> = unsent.iter().map(|r| r.row.message_id.as_str()).collect();
    assert_eq!(left, ["m-5"], "the fifth waits for the next tick");
    drop(backend);
    std::fs::remove_dir_all(&dir).unwrap();
}
