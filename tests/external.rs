//! The card-charge walkthrough under faults: an external effect (a charge at a payment
//! provider) made exactly once although the server is SIGKILLed between its phases and
//! the provider fails before and after charging.
//!
//! Per engine (SQLite in a temporary file, PostgreSQL, MariaDB; each required: an
//! unreachable one fails the test), in a private schema, database or file:
//!
//! 1. `idem demo fake-provider` starts with `--fail-before-charge 0.15 --fail-after-charge
//!    0.15 --delay 100` (a random `--seed`, printed).
//! 2. A deterministic pass: for each kill point (`started`, `order_created`, `charging`,
//!    `charged`, `finished`) `idem demo serve --provider …` starts with `IDEM_SERVE_KILL_AT`
//!    set to that point alone and `IDEM_SERVE_KILL_P=1`, and one client sends a fresh key
//!    until the server dies there: every point is hit at least once.
//! 3. The faulty run: every key (`IDEM_EXTERNAL_KEYS`, default 12, including the five
//!    left mid-way by step 2) is sent by two concurrent clients, each retrying (409,
//!    502, 503, connection errors: after a short pause) until it got 201. Meanwhile a
//!    supervisor restarts `idem demo serve` whenever it dies, each time with a new random
//!    non-empty subset of the kill points and `IDEM_SERVE_KILL_P=0.3`. Leases are short
//!    (`--lease-ms 800`), so a retry takes a dead server's run over quickly.
//! 4. `idem relay --once` publishes the outbox to a private RabbitMQ exchange whose
//!    private queue is bound to `order.paid`.
//!
//! Then, per engine: the provider charged exactly once per key (GET /charges: as many
//! charges as keys, each provider idempotency key once); as many paid orders as keys and
//! none pending; as many `order.paid` messages as keys, with distinct message IDs, each
//! naming an order and charge some client was answered with; and for each key, both
//! clients got 201 with identical bodies. Kills are counted per point from serve's
//! stderr (`idem serve: killed at <point>`) and printed in one summary line per engine.
//!
//! Build the binary first: `cargo build -p idem-cli --all-features`. Size: `IDEM_EXTERNAL_KEYS`.
#![allow(clippy::unwrap_used)]

#[path = "relay_support.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::consumer::CancellationToken;
use idem::consumer::lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use idem::consumer::lapin::types::FieldTable;
use idem::consumer::lapin::{self, Connection, ExchangeKind};
use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use idem_conformance::sqlite::SqliteBank;
use libtest_mimic::{Arguments, Trial};
use serde::Deserialize;
use serde_json::{Value, json};
use support::{
    Private, Res, amqp_channel, amqp_url, check, delete_queues, drain_queue, fail, idem_binary,
    unique,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStderr, Command};
use tokio::sync::watch;

/// The kill points of `idem serve`'s test hook, in the order a run reaches them.
const POINTS: [&str; 5] = [
    "started",
    "order_created",
    "charging",
    "charged",
    "finished",
];
/// The principal (bearer token) of every order.
const PRINCIPAL: &str = "shop";
/// The destination of the orders' outbox messages.
const ORDER_PAID: &str = "order.paid";
/// The lease of an order's run.
const LEASE_MS: u64 = 800;
/// How long serve waits for the provider.
const PROVIDER_TIMEOUT_MS: u64 = 1000;
/// The kill probability of the faulty run.
const KILL_P: f64 = 0.3;
/// A hang guard only: the whole engine run.
const GUARD: Duration = Duration::from_secs(300);
/// How long one key may take to get both its answers before the test gives up.
const KEY_DEADLINE: Duration = Duration::from_secs(150);

/// Keys per engine (`IDEM_EXTERNAL_KEYS`, default 12; at least the 5 kill points).
fn key_count() -> usize {
    std::env::var("IDEM_EXTERNAL_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12usize)
        .max(POINTS.len())
}

// ---------------------------------------------------------------- processes

/// A child `idem` process with its address (from its "listening on" line) and its
/// stderr collected in the background.
struct Proc {
    child: Child,
    addr: String,
    stderr: tokio::task::JoinHandle<String>,
}

/// Starts `idem <args>` with `env` and waits for its `listening on http://…` line.
async fn start(args: &[String], env: &[(&str, String)]) -> Res<Proc> {
    let mut cmd = Command::new(idem_binary()?);
    cmd.args(args)
        .env_remove("IDEM_SERVE_KILL_AT")
        .env_remove("IDEM_SERVE_KILL_P")
        .env_remove("IDEM_SERVE_KILL_DELAY_MS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| fail(format!("cannot run idem: {e}")))?;
    let stderr = collect(child.stderr.take().unwrap());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(at) = line.find("listening on http://") {
                let rest = &line[at + "listening on ".len()..];
                let addr = rest.split_whitespace().next().unwrap_or_default();
                return Some(addr.to_owned());
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(addr)) => {
            // Keep reading stdout, so the process never writes to a closed pipe.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok(Proc {
                child,
                addr,
                stderr,
            })
        }
        other => {
            let _ = child.start_kill();
            let _ = child.wait().await;
            let err = stderr.await.unwrap_or_default();
            Err(fail(format!(
                "idem {} did not start ({}): {err}",
                args.join(" "),
                if other.is_err() {
                    "no address within 60 s"
                } else {
                    "no address printed"
                }
            )))
        }
    }
}

fn collect(mut stderr: ChildStderr) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    })
}

impl Proc {
    /// Waits for the process to end; its exit status and stderr.
    async fn ended(mut self) -> (Option<ExitStatus>, String) {
        let status = self.child.wait().await.ok();
        let err = self.stderr.await.unwrap_or_default();
        (status, err)
    }

    /// SIGTERM (a graceful stop), then waits; SIGKILL if it does not stop in 20 s.
    async fn stop(mut self) -> (Option<ExitStatus>, String) {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
        }
        self.ended().await
    }
}

fn killed_by_sigkill(status: Option<ExitStatus>) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.and_then(|s| s.signal()) == Some(9)
}

/// The points a dead server's stderr says it was killed at.
fn kill_points(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.trim().strip_prefix("idem serve: killed at "))
        .map(|p| p.trim().to_owned())
        .collect()
}

// ---------------------------------------------------------------- the run

/// What is shared by everything in one engine's run.
struct Setup {
    engine: &'static str,
    url: String,
    provider: String,
    http: reqwest::Client,
    tally: Mutex<Tally>,
}

#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    kills: BTreeMap<String, u64>,
    restarts: u64,
    /// Kill lines printed by a server another request's kill was already ending.
    raced: u64,
    /// 201 bodies per key.
    bodies: BTreeMap<String, Vec<Value>>,
}

impl Setup {
    fn serve_args(&self) -> Vec<String> {
        [
            "--url",
            &self.url,
            "demo",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            &self.provider,
            "--lease-ms",
            &LEASE_MS.to_string(),
            "--provider-timeout-ms",
            &PROVIDER_TIMEOUT_MS.to_string(),
        ]
        .map(String::from)
        .to_vec()
    }

    /// Starts serve with the kill hook at `points` with probability `p`.
    async fn serve(&self, points: &[&str], p: f64) -> Res<Proc> {
        let mut env = Vec::new();
        if !points.is_empty() {
            env.push(("IDEM_SERVE_KILL_AT", points.join(",")));
            env.push(("IDEM_SERVE_KILL_P", p.to_string()));
            env.push((
                "IDEM_SERVE_KILL_DELAY_MS",
                fastrand::u64(20..=90).to_string(),
            ));
        }
        start(&self.serve_args(), &env).await
    }

    /// Records a dead server's kill and returns its point; an end other than SIGKILL
    /// at a point is an error. Two requests may reach kill points at the same moment
    /// and both print their line before the process is gone: the first one killed it.
    fn died(&self, status: Option<ExitStatus>, stderr: &str) -> Res<String> {
        let points = kill_points(stderr);
        let first = match points.first() {
            Some(p) if killed_by_sigkill(status) => p.clone(),
            _ => {
                return Err(fail(format!(
                    "idem serve ended with {status:?}, not killed at a point: {stderr}"
                )));
            }
        };
        let mut t = self.tally.lock().unwrap();
        *t.kills.entry(first.clone()).or_default() += 1;
        t.raced += points.len() as u64 - 1;
        Ok(first)
    }
}

/// How one order request ended.
enum Sent {
    /// 201 with this body.
    Created(Value),
    /// 409, 502 or 503: try again with the same key.
    Retry,
    /// No answer (the server died, or is restarting).
    NoAnswer,
}

/// One `POST /orders`.
async fn send(setup: &Setup, addr: &str, key: &str, amount: u64) -> Res<Sent> {
    setup.tally.lock().unwrap().requests += 1;
    let response = setup
        .http
        .post(format!("{addr}/orders"))
        .bearer_auth(PRINCIPAL)
        .header("Idempotency-Key", key)
        .json(&json!({ "amount": amount }))
        .send()
        .await;
    let response = match response {
        Ok(r) => r,
        Err(_) => return Ok(Sent::NoAnswer),
    };
    let status = response.status().as_u16();
    let text = match response.text().await {
        Ok(t) => t,
        Err(_) => return Ok(Sent::NoAnswer),
    };
    match status {
        201 => serde_json::from_str(&text).map(Sent::Created).map_err(|e| {
            fail(format!(
                "{key}: 201 with a body that is not JSON ({e}): {text}"
            ))
        }),
        409 | 502 | 503 => Ok(Sent::Retry),
        other => Err(fail(format!(
            "{} {key}: POST /orders answered {other}: {text}",
            setup.engine
        ))),
    }
}

/// A short pause before a retry.
async fn pause() {
    tokio::time::sleep(Duration::from_millis(fastrand::u64(50..=150))).await;
}

/// One client: sends `key` until it gets 201 (through every restart of the server,
/// whose current address `addr` holds; `None` while it is down).
async fn client(
    setup: Arc<Setup>,
    addr: watch::Receiver<Option<String>>,
    key: String,
    amount: u64,
) -> Res {
    let began = Instant::now();
    loop {
        check(began.elapsed() < KEY_DEADLINE, || {
            format!("{} {key}: no 201 within {KEY_DEADLINE:?}", setup.engine)
        })?;
        let current = addr.borrow().clone();
        let Some(current) = current else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        match send(&setup, &current, &key, amount).await? {
            Sent::Created(body) => {
                setup
                    .tally
                    .lock()
                    .unwrap()
                    .bodies
                    .entry(key)
                    .or_default()
                    .push(body);
                return Ok(());
            }
            Sent::Retry | Sent::NoAnswer => pause().await,
        }
    }
}

/// Step 2: each point alone with probability 1, one fresh key each.
async fn every_point_once(setup: &Setup, keys: &[(String, u64)]) -> Res {
    for (point, (key, amount)) in POINTS.iter().zip(keys) {
        let mut proc = setup.serve(&[point], 1.0).await?;
        let began = Instant::now();
        loop {
            check(began.elapsed() < KEY_DEADLINE, || {
                format!("{} {key}: serve never reached {point}", setup.engine)
            })?;
            match send(setup, &proc.addr, key, *amount).await? {
                Sent::Created(body) => {
                    let _ = proc.stop().await;
                    return Err(fail(format!(
                        "{} {key}: 201 {body} although serve should die at {point}",
                        setup.engine
                    )));
                }
                Sent::Retry => pause().await,
                Sent::NoAnswer => {
                    let exited =
                        tokio::time::timeout(Duration::from_secs(3), proc.child.wait()).await;
                    if exited.is_ok() {
                        break;
                    }
                }
            }
        }
        let (status, stderr) = proc.ended().await;
        let at = setup.died(status, &stderr)?;
        check(at == *point, || {
            format!("{}: killed at {at}, expected {point}", setup.engine)
        })?;
    }
    Ok(())
}

/// A random non-empty subset of the points.
fn random_points() -> Vec<&'static str> {
    loop {
        let some: Vec<&str> = POINTS.into_iter().filter(|_| fastrand::bool()).collect();
        if !some.is_empty() {
            return some;
        }
    }
}

/// Keeps a server up, restarting it with a new random kill configuration whenever it
/// dies, until `stop`.
async fn supervise(
    setup: Arc<Setup>,
    addr: watch::Sender<Option<String>>,
    stop: CancellationToken,
) -> Res {
    loop {
        let proc = setup.serve(&random_points(), KILL_P).await?;
        addr.send_replace(Some(proc.addr.clone()));
        let mut proc = proc;
        tokio::select! {
            _ = proc.child.wait() => {
                addr.send_replace(None);
                let (status, stderr) = proc.ended().await;
                setup.died(status, &stderr)?;
                setup.tally.lock().unwrap().restarts += 1;
            }
            () = stop.cancelled() => {
                addr.send_replace(None);
                let (status, stderr) = proc.stop().await;
                if killed_by_sigkill(status) {
                    // Killed at a point just as the run ended: count it.
                    setup.died(status, &stderr)?;
                }
                return Ok(());
            }
        }
    }
}

/// Step 3: every key by two clients under random kills.
async fn faulty_run(setup: &Arc<Setup>, keys: &[(String, u64)]) -> Res {
    let (tx, rx) = watch::channel(None);
    let stop = CancellationToken::new();
    let supervisor = tokio::spawn(supervise(Arc::clone(setup), tx, stop.clone()));
    let mut clients = Vec::new();
    for (key, amount) in keys {
        for _ in 0..2 {
            clients.push(tokio::spawn(client(
                Arc::clone(setup),
                rx.clone(),
                key.clone(),
                *amount,
            )));
        }
    }
    let mut all = tokio::spawn(async move {
        for c in clients {
            c.await.map_err(|e| fail(e.to_string()))??;
        }
        Ok::<(), libtest_mimic::Failed>(())
    });
    let mut supervisor = supervisor;
    tokio::select! {
        done = &mut all => {
            stop.cancel();
            let supervised = supervisor.await.map_err(|e| fail(e.to_string()))?;
            done.map_err(|e| fail(e.to_string()))??;
            supervised
        }
        // It only ends early on an error (a server that did not start, or died otherwise
        // than at a kill point).
        supervised = &mut supervisor => {
            all.abort();
            supervised.map_err(|e| fail(e.to_string()))??;
            Err(fail("the supervisor stopped early"))
        }
    }
}

#[derive(Debug, Deserialize)]
struct Charge {
    id: String,
    idempotency_key: String,
    amount: u64,
}

#[derive(Debug, Default, Deserialize)]
struct ProviderStats {
    failed_before: u64,
    failed_after: u64,
    replays: u64,
}

async fn get_json<T: for<'de> Deserialize<'de>>(http: &reqwest::Client, url: &str) -> Res<T> {
    let r = http
        .get(url)
        .send()
        .await
        .map_err(|e| fail(format!("GET {url}: {e}")))?;
    check(r.status().is_success(), || {
        format!("GET {url}: {}", r.status())
    })?;
    r.json().await.map_err(|e| fail(format!("GET {url}: {e}")))
}

/// A private exchange with a private queue bound to `order.paid`.
struct PaidQueue {
    conn: Connection,
    ch: lapin::Channel,
    exchange: String,
    queue: String,
}

impl PaidQueue {
    async fn create() -> Res<Self> {
        let (conn, ch) = amqp_channel().await?;
        let exchange = unique("ext_x");
        let queue = unique("ext_q");
        let e = |e: lapin::Error| fail(e.to_string());
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(e)?;
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(e)?;
        ch.queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            ORDER_PAID.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(e)?;
        Ok(Self {
            conn,
            ch,
            exchange,
            queue,
        })
    }

    async fn remove(self) {
        delete_queues(&self.ch, std::slice::from_ref(&self.queue)).await;
        let _ = self
            .ch
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.conn.close(200, "done".into()).await;
    }
}

/// Step 4: `idem relay --once` to the private queue; the messages.
async fn relay(setup: &Setup, paid: &PaidQueue) -> Res<Vec<support::Got>> {
    let out = Command::new(idem_binary()?)
        .args(["--url", &setup.url, "relay", "--amqp", &amqp_url()])
        .args(["--exchange", &paid.exchange, "--once"])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .map_err(|_| fail("idem relay hung"))?
        .map_err(|e| fail(format!("cannot run idem relay: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    check(
        out.status.success() && stdout.starts_with("published "),
        || {
            format!(
                "idem relay --once failed ({}): {stdout} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        },
    )?;
    drain_queue(&paid.ch, &paid.queue).await
}

/// One engine's whole run; returns the summary line.
async fn external<K: Private>() -> Res<String> {
    let (bank, url) = K::private("ext").await?;
    let provider_seed = fastrand::u64(..);
    let provider = start(
        &[
            "demo",
            "fake-provider",
            "--listen",
            "127.0.0.1:0",
            "--fail-before-charge",
            "0.15",
            "--fail-after-charge",
            "0.15",
            "--delay",
            "100",
            "--seed",
            &provider_seed.to_string(),
        ]
        .map(String::from),
        &[],
    )
    .await;
    let provider = match provider {
        Ok(p) => p,
        Err(e) => {
            let _ = bank.close().await;
            return Err(e);
        }
    };
    let paid = match PaidQueue::create().await {
        Ok(q) => q,
        Err(e) => {
            let _ = provider.stop().await;
            let _ = bank.close().await;
            return Err(e);
        }
    };
    let setup = Arc::new(Setup {
        engine: K::NAME,
        url,
        provider: provider.addr.clone(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()
            .map_err(|e| fail(e.to_string()))?,
        tally: Mutex::new(Tally::default()),
    });
    let began = Instant::now();
    let result = tokio::time::timeout(GUARD, run_and_check(&bank, &setup, &paid))
        .await
        .unwrap_or_else(|_| Err(fail("the run hung (hang guard)")))
        .map(|line| {
            format!(
                "{line}, provider --seed {provider_seed}, {:.1} s",
                began.elapsed().as_secs_f64()
            )
        })
        .map_err(|e| fail(format!("{e:?} (provider --seed {provider_seed})")));
    let (_, provider_err) = provider.stop().await;
    paid.remove().await;
    let closed = bank.close().await;
    let line = result.map_err(|e| fail(format!("{e:?}\nprovider stderr: {provider_err}")))?;
    closed.map_err(|e| fail(format!("cleanup: {e}")))?;
    Ok(line)
}

async fn run_and_check<K: Private>(bank: &K, setup: &Arc<Setup>, paid: &PaidQueue) -> Res<String> {
    bank.setup().await.map_err(|e| fail(e.to_string()))?;
    let n = key_count();
    let keys: Vec<(String, u64)> = (0..n)
        .map(|i| (format!("order-{i}"), fastrand::u64(100..=99_999)))
        .collect();
    every_point_once(setup, &keys).await?;
    faulty_run(setup, &keys).await?;

    let charges: Vec<Charge> =
        get_json(&setup.http, &format!("{}/charges", setup.provider)).await?;
    let stats: ProviderStats = get_json(&setup.http, &format!("{}/stats", setup.provider))
        .await
        .unwrap_or_default();
    let paid_orders = bank
        .count_orders("paid")
        .await
        .map_err(|e| fail(e.to_string()))?;
    let pending = bank
        .count_orders("pending")
        .await
        .map_err(|e| fail(e.to_string()))?;
    let messages = relay(setup, paid).await?;

    let engine = setup.engine;
    let t = setup.tally.lock().unwrap();
    // The provider charged once per key.
    let mut per_key: BTreeMap<&str, u64> = BTreeMap::new();
    for c in &charges {
        *per_key.entry(c.idempotency_key.as_str()).or_default() += 1;
    }
    check(charges.len() == n, || {
        format!(
            "{engine}: {} charges for {n} keys: {charges:?}",
            charges.len()
        )
    })?;
    check(
        per_key.len() == n && per_key.values().all(|&c| c == 1),
        || format!("{engine}: provider idempotency keys not once each: {per_key:?}"),
    )?;
    let amounts: BTreeSet<u64> = keys.iter().map(|(_, a)| *a).collect();
    check(charges.iter().all(|c| amounts.contains(&c.amount)), || {
        format!("{engine}: a charge of an amount no key asked for: {charges:?}")
    })?;
    // Every key answered 201 to both clients, identically.
    for (key, amount) in &keys {
        let bodies = t.bodies.get(key).cloned().unwrap_or_default();
        check(bodies.len() == 2, || {
            format!("{engine} {key}: {} answers 201, expected 2", bodies.len())
        })?;
        check(bodies.iter().all(|b| *b == bodies[0]), || {
            format!("{engine} {key}: different 201 bodies: {bodies:?}")
        })?;
        check(bodies[0]["status"] == "paid", || {
            format!("{engine} {key}: not paid: {}", bodies[0])
        })?;
        let charge_id = bodies[0]["charge_id"].as_str().unwrap_or_default();
        let charge = charges.iter().find(|c| c.id == charge_id);
        check(charge.is_some_and(|c| c.amount == *amount), || {
            format!("{engine} {key}: answered charge {charge_id}, the provider has {charge:?}")
        })?;
    }
    // The orders.
    check(paid_orders == n as u64 && pending == 0, || {
        format!("{engine}: {paid_orders} paid orders and {pending} pending for {n} keys")
    })?;
    // The messages.
    let ids: BTreeSet<Option<&str>> = messages.iter().map(|m| m.message_id.as_deref()).collect();
    check(
        messages.len() == n && ids.len() == n && !ids.contains(&None),
        || {
            format!(
                "{engine}: {} order.paid messages with {} distinct message IDs for {n} keys: {messages:?}",
                messages.len(),
                ids.len()
            )
        },
    )?;
    let answered: BTreeSet<(i64, String)> = t
        .bodies
        .values()
        .filter_map(|b| b.first())
        .map(|b| {
            (
                b["order_id"].as_i64().unwrap_or_default(),
                b["charge_id"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    for m in &messages {
        let p: Value = serde_json::from_str(&m.payload)
            .map_err(|e| fail(format!("{engine}: message payload {:?}: {e}", m.payload)))?;
        let pair = (
            p["order_id"].as_i64().unwrap_or_default(),
            p["charge_id"].as_str().unwrap_or_default().to_owned(),
        );
        check(
            answered.contains(&pair) && p["principal"] == PRINCIPAL,
            || format!("{engine}: message {p} names no order a client was answered with"),
        )?;
    }
    for point in POINTS {
        check(t.kills.get(point).copied().unwrap_or(0) >= 1, || {
            format!("{engine}: no kill at {point}: {:?}", t.kills)
        })?;
    }
    let kills: u64 = t.kills.values().sum();
    let by_point = POINTS
        .iter()
        .map(|p| format!("{p} {}", t.kills.get(*p).copied().unwrap_or(0)))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(format!(
        "external {engine}: keys {n}, requests {}, kills {kills} ({by_point}), provider faults {} (before {}, after {}), charges {}, paid orders {paid_orders}, messages {}\n\
         external {engine} details: serve restarts in the faulty run {}, extra kill lines from concurrent requests {}, provider replays {}",
        t.requests,
        stats.failed_before + stats.failed_after,
        stats.failed_before,
        stats.failed_after,
        charges.len(),
        messages.len(),
        t.restarts,
        t.raced,
        stats.replays,
    ))
}

// ---------------------------------------------------------------- harness

fn block_on(f: impl Future<Output = Res<String>>) -> Res<String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| fail(e.to_string()))?;
    rt.block_on(f)
}

fn trial<K: Private>() -> Trial {
    Trial::test(format!("external::{}", K::NAME), || {
        let line = block_on(external::<K>())?;
        println!("{line}");
        Ok(())
    })
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let trials = vec![
        trial::<SqliteBank>(),
        trial::<PgBank>(),
        trial::<MysqlBank>(),
    ];
    libtest_mimic::run(&args, trials).exit_code()
}
