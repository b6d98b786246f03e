//! The card-charge walkthrough through the built binary: `idem demo fake-provider`,
//! `idem demo serve --provider` (`POST /orders`) on SQLite and PostgreSQL, the serve kill
//! hook, and `idem demo complete`. Every `idem` run here is an `idem demo …` command.
//!
//! Each test starts its own provider on a free port. The SQLite tests work in a private
//! directory; the PostgreSQL tests in a private schema that the test creates (through the
//! conformance fixture) and drops, so that a killed and restarted `idem demo serve` finds its
//! data again; the MySQL/MariaDB tests likewise in a private database. PostgreSQL and
//! MySQL/MariaDB are required (`IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`, with the defaults of
//! `ci/test.sh`): an unreachable server fails the test.
#![cfg(all(feature = "sqlite", feature = "postgres"))]
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idem_conformance::Bank;
use idem_conformance::postgres::PgBank;
use idem_conformance::sqlite::SqliteBank;
use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};

/// Generous guard against a hang (never an assertion on speed).
const GUARD: Duration = Duration::from_secs(120);

/// The kill hook's variables, never inherited from the environment by accident.
const KILL_VARS: [&str; 3] = [
    "IDEM_SERVE_KILL_AT",
    "IDEM_SERVE_KILL_P",
    "IDEM_SERVE_KILL_DELAY_MS",
];

/// A running `idem demo …` process that printed its address.
struct Proc {
    child: Child,
    base: String,
    stdout: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        command
            .arg("demo")
            .args(args)
            .env_remove("IDEM_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for var in KILL_VARS {
            command.env_remove(var);
        }
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawn idem");
        let stdout = lines(child.stdout.take().unwrap(), false);
        let stderr = lines(child.stderr.take().unwrap(), true);
        let first = match stdout.recv_timeout(GUARD) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait().ok();
                let err: Vec<String> = stderr.try_iter().collect();
                panic!("idem {args:?} printed no address (exit: {status:?}): {err:?}");
            }
        };
        let base = first
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {first:?}"))
            .to_owned();
        Self {
            child,
            base,
            stdout,
            stderr,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn port(&self) -> u16 {
        self.base.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Waits (bounded) for the process to end on its own; its status and stderr.
    fn wait_exit(mut self) -> (ExitStatus, String) {
        let deadline = Instant::now() + GUARD;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the process did not exit");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = Vec::new();
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_secs(5)) {
            err.push(line);
        }
        (status, err.join("\n"))
    }

    /// SIGTERM; the exit must be a success. The rest of stdout.
    fn stop(mut self) -> String {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let deadline = Instant::now() + GUARD;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "exited with {status}");
                break;
            }
            assert!(Instant::now() < deadline, "did not stop");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut rest = Vec::new();
        while let Ok(line) = self.stdout.recv_timeout(Duration::from_secs(5)) {
            rest.push(line);
        }
        rest.join("\n")
    }
}

impl Drop for Proc {
    /// After a failed assertion: SIGTERM, then SIGKILL if it has not stopped.
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines of a pipe, through a channel (stderr is also echoed for the test log).
fn lines(pipe: impl std::io::Read + Send + 'static, echo: bool) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if echo {
                eprintln!("{line}");
            }
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn provider(extra: &[&str]) -> Proc {
    provider_at("127.0.0.1:0", extra)
}

fn provider_at(listen: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["fake-provider", "--listen", listen];
    args.extend_from_slice(extra);
    Proc::spawn(&args, &[])
}

/// `idem demo serve --provider` with a 1 s lease (a killed owner's run is taken over soon).
fn serve(url: &str, provider: &str, env: &[(&str, &str)]) -> Proc {
    Proc::spawn(
        &[
            "--url",
            url,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            provider,
            "--lease-ms",
            "1000",
        ],
        env,
    )
}

/// Runs `idem demo <args>` to its end (bounded).
fn idem(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("demo")
        .args(args)
        .env_remove("IDEM_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idem {args:?} still ran after {GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn client() -> Client {
    Client::builder().timeout(GUARD).build().unwrap()
}

/// A local port nothing listens on: bound, then released.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn charge(c: &Client, p: &Proc, key: Option<&str>, body: &str) -> Response {
    let mut req = c
        .post(p.url("/charges"))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    req.send().await.unwrap()
}

async fn get_json(c: &Client, url: String) -> Value {
    let r = c.get(url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.json().await.unwrap()
}

async fn charges(c: &Client, p: &Proc) -> Vec<Value> {
    get_json(c, p.url("/charges"))
        .await
        .as_array()
        .unwrap()
        .clone()
}

async fn order_as(
    c: &Client,
    s: &Proc,
    principal: &str,
    key: &str,
    amount: i64,
) -> reqwest::Result<Response> {
    c.post(s.url("/orders"))
        .bearer_auth(principal)
        .header("Idempotency-Key", key)
        .json(&json!({ "amount": amount }))
        .send()
        .await
}

async fn order(c: &Client, s: &Proc, key: &str, amount: i64) -> Response {
    order_as(c, s, "account-1", key, amount).await.unwrap()
}

/// Retries while the key's run is held by a live lease (409), bounded.
async fn order_until_done(c: &Client, s: &Proc, key: &str, amount: i64) -> Response {
    let deadline = Instant::now() + GUARD;
    loop {
        let r = order(c, s, key, amount).await;
        if r.status() != StatusCode::CONFLICT {
            return r;
        }
        assert!(Instant::now() < deadline, "{key} stayed in progress");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn replayed(r: &Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

async fn problem(r: Response, status: StatusCode, type_uri: &str) -> Value {
    assert_eq!(r.status(), status);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["type"], type_uri, "{body}");
    assert_eq!(body["status"], status.as_u16());
    body
}

/// A paid order's body; checks its shape.
async fn paid(r: Response) -> Value {
    assert_eq!(r.status(), StatusCode::CREATED);
    let body: Value = r.json().await.unwrap();
    assert!(body["order_id"].is_i64(), "{body}");
    assert!(
        body["charge_id"].as_str().unwrap().starts_with("ch_"),
        "{body}"
    );
    assert_eq!(body["status"], "paid", "{body}");
    assert_eq!(body.as_object().unwrap().len(), 3, "{body}");
    body
}

// ---------------------------------------------------------------------------------
// The database a test works in, readable from the test (order counts).

trait Engine: Bank {
    async fn open(tag: &str) -> Db<Self>;
}

struct Db<K: Bank> {
    /// The URL `idem` is given.
    url: String,
    bank: Option<K>,
    dir: Option<PathBuf>,
    /// A server's private schema or database: the command that drops it if the test
    /// fails (best effort; `close` drops it otherwise).
    drop_command: Option<Vec<String>>,
}

impl<K: Bank> Db<K> {
    async fn count(&self, status: &str) -> u64 {
        self.bank
            .as_ref()
            .unwrap()
            .count_orders(status)
            .await
            .unwrap()
    }

    /// (paid, pending, failed) orders.
    async fn orders(&self) -> (u64, u64, u64) {
        (
            self.count("paid").await,
            self.count("pending").await,
            self.count("failed").await,
        )
    }

    async fn close(mut self) {
        self.bank.take().unwrap().close().await.unwrap();
        self.drop_command = None;
    }
}

impl<K: Bank> Drop for Db<K> {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some([program, args @ ..]) = self.drop_command.as_deref() {
            let _ = Command::new(program)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn unique(tag: &str) -> String {
    format!(
        "idem_orders_{tag}_{}_{:06x}",
        std::process::id(),
        fastrand::u32(..0xff_ffff)
    )
}

impl Engine for SqliteBank {
    async fn open(tag: &str) -> Db<Self> {
        let dir = std::env::temp_dir().join(unique(tag));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}/orders.db", dir.display());
        let bank = SqliteBank::connect(&url, None).await.unwrap();
        bank.setup().await.unwrap();
        Db {
            url,
            bank: Some(bank),
            dir: Some(dir),
            drop_command: None,
        }
    }
}

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

impl Engine for PgBank {
    async fn open(tag: &str) -> Db<Self> {
        let admin = postgres_url();
        let schema = unique(tag);
        let bank = PgBank::connect(&admin, Some(&schema)).await.unwrap();
        bank.setup().await.unwrap();
        let sep = if admin.contains('?') { '&' } else { '?' };
        Db {
            url: format!("{admin}{sep}options%5Bsearch_path%5D={schema}"),
            bank: Some(bank),
            dir: None,
            drop_command: Some(vec![
                "psql".into(),
                admin,
                "-qc".into(),
                format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
            ]),
        }
    }
}

#[cfg(feature = "mysql")]
fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".into())
}

#[cfg(feature = "mysql")]
impl Engine for idem_conformance::mysql::MysqlBank {
    async fn open(tag: &str) -> Db<Self> {
        let admin = mysql_url();
        let database = unique(tag);
        let bank = Self::connect(&admin, Some(&database)).await.unwrap();
        bank.setup().await.unwrap();
        // The same server, the private database.
        let (path, query) = admin.split_once('?').unwrap_or((&admin, ""));
        let (server, _) = path.rsplit_once('/').unwrap();
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        // `scheme://[user[:password]@]host:port`, for the mysql client's clean-up.
        let authority = server.split_once("://").unwrap().1;
        let (user, host_port) = authority.rsplit_once('@').unwrap_or(("root", authority));
        let (host, port) = host_port.split_once(':').unwrap_or((host_port, "3306"));
        let user = user.split(':').next().unwrap_or("root");
        Db {
            url: format!("{server}/{database}{query}"),
            bank: Some(bank),
            dir: None,
            drop_command: Some(vec![
                "mysql".into(),
                format!("--host={host}"),
                format!("--port={port}"),
                format!("--user={user}"),
                "-e".into(),
                format!("DROP DATABASE IF EXISTS {database}"),
            ]),
        }
    }
}

// ---------------------------------------------------------------------------------
// The fake provider.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_provider_charges_once_per_key() {
    let p = provider(&[]);
    let c = client();
    let r = charge(&c, &p, Some("k-1"), r#"{"amount": 100}"#).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    let first: Value = r.json().await.unwrap();
    assert_eq!(
        first,
        json!({"id": "ch_1", "idempotency_key": "k-1", "amount": 100})
    );
    // The same key and amount: the first charge, no new one.
    let r = charge(&c, &p, Some("k-1"), r#"{"amount": 100}"#).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.json::<Value>().await.unwrap(), first);
    // Another amount under the key: 422; no key or a bad body: 400.
    let r = charge(&c, &p, Some("k-1"), r#"{"amount": 101}"#).await;
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let r = charge(&c, &p, None, r#"{"amount": 100}"#).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    for bad in [
        r#"{"amount": 0}"#,
        r#"{"amount": -5}"#,
        r#"{"amount": 1.5}"#,
        "{}",
        "x",
    ] {
        let r = charge(&c, &p, Some("k-bad"), bad).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad}");
    }
    let r = charge(&c, &p, Some("k-2"), r#"{"amount": 5}"#).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(
        charges(&c, &p).await,
        [
            first,
            json!({"id": "ch_2", "idempotency_key": "k-2", "amount": 5})
        ]
    );
    assert_eq!(
        get_json(&c, p.url("/stats")).await,
        json!({"charges": 2, "failed_before": 0, "failed_after": 0, "replays": 1})
    );
    let out = p.stop();
    assert!(out.contains("stopped (2 charges"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_provider_fails_on_demand() {
    let c = client();
    // Before the charge: 500 and nothing charged, every time.
    let p = provider(&["--fail-before-charge", "1"]);
    for _ in 0..2 {
        let r = charge(&c, &p, Some("k"), r#"{"amount": 10}"#).await;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert!(charges(&c, &p).await.is_empty());
    assert_eq!(get_json(&c, p.url("/stats")).await["failed_before"], 2);
    p.stop();

    // After the charge: recorded, then 500 or no answer; the retry finds the charge.
    let p = provider(&["--fail-after-charge", "1", "--seed", "7"]);
    let impatient = Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let keys = ["a-1", "a-2", "a-3", "a-4"];
    for key in keys {
        let r = impatient
            .post(p.url("/charges"))
            .header("Idempotency-Key", key)
            .json(&json!({"amount": 10}))
            .send()
            .await;
        match r {
            Ok(r) => assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR, "{key}"),
            Err(e) => assert!(e.is_timeout(), "{key}: {e}"),
        }
    }
    let made = charges(&c, &p).await;
    let made_keys: Vec<&str> = made
        .iter()
        .map(|c| c["idempotency_key"].as_str().unwrap())
        .collect();
    assert_eq!(made_keys, keys);
    for (key, first) in keys.iter().zip(&made) {
        let r = charge(&c, &p, Some(key), r#"{"amount": 10}"#).await;
        assert_eq!(r.status(), StatusCode::OK, "{key}");
        assert_eq!(&r.json::<Value>().await.unwrap(), first);
    }
    assert_eq!(charges(&c, &p).await.len(), 4, "the retries charged again");
    assert_eq!(
        get_json(&c, p.url("/stats")).await,
        json!({"charges": 4, "failed_before": 0, "failed_after": 4, "replays": 4})
    );
    p.stop();
}

#[test]
fn usage_errors_exit_2_and_help_names_the_options() {
    for (args, says) in [
        (
            &["fake-provider", "--fail-before-charge", "1.5"][..],
            "not a probability",
        ),
        (
            &["fake-provider", "--fail-after-charge", "-1"],
            "not a probability",
        ),
        (&["complete"], "needs the database"),
        (
            &["--url", "sqlite::memory:", "serve", "--provider", "ftp://x"],
            "must be an http:// URL",
        ),
        (
            &["--url", "sqlite::memory:", "serve", "--lease-ms", "10"],
            "lease-ms",
        ),
    ] {
        let out = idem(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "--url",
            "sqlite::memory:",
            "demo",
            "serve",
            "--provider",
            "http://127.0.0.1:1",
        ])
        .env("IDEM_SERVE_KILL_AT", "nowhere")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("IDEM_SERVE_KILL_AT"));
    for (command, words) in [
        (
            "fake-provider",
            &[
                "--fail-before-charge",
                "--fail-after-charge",
                "--delay",
                "Idempotency-Key",
            ][..],
        ),
        (
            "complete",
            &["--provider", "--lease-ms", "--limit", "--json", "order:v1"],
        ),
        (
            "serve",
            &[
                "--provider",
                "--provider-timeout-ms",
                "--lease-ms",
                "/orders",
            ],
        ),
    ] {
        let out = idem(&[command, "--help"]);
        assert_eq!(out.status.code(), Some(0), "{command}");
        let help = text(&out.stdout);
        for w in words {
            assert!(help.contains(w), "{command} --help lacks {w}:\n{help}");
        }
    }
}

// ---------------------------------------------------------------------------------
// POST /orders.

/// New orders, retries, a reused key, refusals, and a provider that is down at first.
async fn orders_flow<K: Engine>(tag: &str) {
    let db = K::open(tag).await;
    let c = client();
    // The provider's port is chosen now; nothing listens on it yet.
    let port = free_port();
    let provider_url = format!("http://127.0.0.1:{port}");
    let s = serve(&db.url, &provider_url, &[]);

    // Provider down: 502, and the order's run is released for the retry.
    let r = order(&c, &s, "order-1", 250).await;
    assert!(r.headers().contains_key("retry-after"));
    let body = problem(
        r,
        StatusCode::BAD_GATEWAY,
        "urn:idem:demo:provider-unavailable",
    )
    .await;
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("same Idempotency-Key"),
        "{body}"
    );
    assert_eq!(
        db.orders().await,
        (0, 1, 0),
        "the order row committed before the call"
    );

    let p = provider_at(&format!("127.0.0.1:{port}"), &[]);
    assert_eq!(p.port(), port);
    let r = order(&c, &s, "order-1", 250).await;
    assert!(!replayed(&r));
    let first = paid(r).await;
    assert_eq!(first["charge_id"], "ch_1");
    assert_eq!(db.orders().await, (1, 0, 0), "the same order was paid");

    // The retry: the stored answer, marked as a replay.
    let r = order(&c, &s, "order-1", 250).await;
    assert!(replayed(&r));
    assert_eq!(paid(r).await, first);

    // Another amount under the key: 422, nothing charged.
    let r = order(&c, &s, "order-1", 251).await;
    problem(
        r,
        StatusCode::UNPROCESSABLE_ENTITY,
        "urn:idem:problem:key-reused",
    )
    .await;

    // The same key of another principal is another order.
    let r = order_as(&c, &s, "account-2", "order-1", 250).await.unwrap();
    assert!(!replayed(&r));
    let other = paid(r).await;
    assert_ne!(other["order_id"], first["order_id"]);
    assert_eq!(other["charge_id"], "ch_2");

    // Refusals before any SQL.
    let r = c
        .post(s.url("/orders"))
        .bearer_auth("account-1")
        .json(&json!({"amount": 1}))
        .send()
        .await
        .unwrap();
    problem(
        r,
        StatusCode::BAD_REQUEST,
        "urn:idem:problem:invalid-idempotency-key",
    )
    .await;
    for raw in ["not json", r#"{"amount": 0}"#, r#"{"amount": 1, "x": 1}"#] {
        let r = c
            .post(s.url("/orders"))
            .bearer_auth("account-1")
            .header("Idempotency-Key", "bad-body")
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        problem(r, StatusCode::BAD_REQUEST, "urn:idem:problem:invalid-body").await;
    }
    let r = c
        .post(s.url("/orders"))
        .header("Idempotency-Key", "anon")
        .json(&json!({"amount": 1}))
        .send()
        .await
        .unwrap();
    problem(
        r,
        StatusCode::UNAUTHORIZED,
        "urn:idem:problem:unauthenticated",
    )
    .await;

    // Exactly one charge per order, under the run's provider key.
    let made = charges(&c, &p).await;
    assert_eq!(made.len(), 2, "{made:?}");
    for ch in &made {
        assert_eq!(ch["amount"], 250);
        assert!(ch["idempotency_key"].as_str().unwrap().starts_with("idem-"));
    }
    assert_ne!(made[0]["idempotency_key"], made[1]["idempotency_key"]);
    assert_eq!(db.orders().await, (2, 0, 0));

    // The OpenAPI document describes the route.
    let doc = get_json(&c, s.url("/openapi.json")).await;
    let responses = &doc["paths"]["/orders"]["post"]["responses"];
    for status in ["201", "400", "401", "409", "422", "502", "503"] {
        assert!(responses.get(status).is_some(), "/orders lacks {status}");
    }
    assert!(doc.to_string().contains("provider-unavailable"));

    assert!(s.stop().contains("stopped"));
    p.stop();
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_orders() {
    orders_flow::<SqliteBank>("flow").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_orders() {
    orders_flow::<PgBank>("flow").await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_orders() {
    orders_flow::<idem_conformance::mysql::MysqlBank>("flow").await;
}

/// The provider charges, then its answer is lost (a 500 or no answer within serve's
/// provider timeout): 502, and the retry finds the charge instead of charging again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_lost_answer_is_found_by_the_retry() {
    let db = SqliteBank::open("lost").await;
    let c = client();
    let p = provider(&["--fail-after-charge", "1", "--seed", "3"]);
    let s = Proc::spawn(
        &[
            "--url",
            &db.url,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            &p.base,
            "--provider-timeout-ms",
            "500",
        ],
        &[],
    );
    for (i, key) in ["lost-1", "lost-2", "lost-3"].iter().enumerate() {
        let r = order(&c, &s, key, 70).await;
        problem(
            r,
            StatusCode::BAD_GATEWAY,
            "urn:idem:demo:provider-unavailable",
        )
        .await;
        assert_eq!(charges(&c, &p).await.len(), i + 1, "the charge was made");
        let r = order(&c, &s, key, 70).await;
        assert!(!replayed(&r));
        let body = paid(r).await;
        let made = charges(&c, &p).await;
        assert_eq!(made.len(), i + 1, "{key}: charged again: {made:?}");
        assert_eq!(made[i]["id"], body["charge_id"]);
    }
    let stats = get_json(&c, p.url("/stats")).await;
    assert_eq!(
        stats,
        json!({"charges": 3, "failed_before": 0, "failed_after": 3, "replays": 3})
    );
    assert_eq!(db.orders().await, (3, 0, 0));
    s.stop();
    p.stop();
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_provider_there_is_no_orders_route() {
    let db = SqliteBank::open("noroute").await;
    let s = Proc::spawn(&["--url", &db.url, "serve", "--listen", "127.0.0.1:0"], &[]);
    let r = order(&client(), &s, "k", 1).await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    s.stop();
    db.close().await;
}

// ---------------------------------------------------------------------------------
// The kill hook: a crash at every point charges once.

/// Starts serve with the hook at `point`, sends the order and checks that the process
/// died by SIGKILL at that point without answering.
async fn killed_at(db_url: &str, provider_url: &str, point: &str, key: &str, amount: i64) {
    let s = serve(
        db_url,
        provider_url,
        &[
            ("IDEM_SERVE_KILL_AT", point),
            ("IDEM_SERVE_KILL_DELAY_MS", "200"),
        ],
    );
    let c = client();
    let r = order_as(&c, &s, "account-1", key, amount).await;
    assert!(r.is_err(), "{point}: answered {:?}", r.map(|r| r.status()));
    let (status, err) = s.wait_exit();
    assert_eq!(status.signal(), Some(9), "{point}: {status}");
    assert!(
        err.contains(&format!("idem serve: killed at {point}")),
        "{err}"
    );
}

async fn kill_points<K: Engine>(tag: &str) {
    let db = K::open(tag).await;
    let c = client();
    // New charges answer after 1 s: the `charging` kill (200 ms) lands mid-request.
    let p = provider(&["--delay", "1000"]);
    let points = [
        "started",
        "order_created",
        "charging",
        "charged",
        "finished",
    ];
    for (i, point) in points.iter().enumerate() {
        let key = format!("kill-{point}");
        killed_at(&db.url, &p.base, point, &key, 100 + i as i64).await;
        // Restarted without the hook: the retry takes the run over once the lease ends.
        let s = serve(&db.url, &p.base, &[]);
        let r = order_until_done(&c, &s, &key, 100 + i as i64).await;
        let finished_before = *point == "finished";
        assert_eq!(replayed(&r), finished_before, "{point}");
        let body = paid(r).await;
        let made = charges(&c, &p).await;
        assert_eq!(made.len(), i + 1, "{point}: one charge per order: {made:?}");
        assert_eq!(made[i]["id"], body["charge_id"], "{point}");
        assert_eq!(made[i]["amount"], 100 + i as i64, "{point}");
        // And the next retry replays the same answer.
        let r = order(&c, &s, &key, 100 + i as i64).await;
        assert!(replayed(&r));
        assert_eq!(paid(r).await, body);
        s.stop();
    }
    assert_eq!(db.orders().await, (5, 0, 0));
    let stats = get_json(&c, p.url("/stats")).await;
    assert_eq!(stats["charges"], 5, "{stats}");
    // `charged` at least: the provider answered, then serve died; the retry's repeated
    // call found the first charge.
    assert!(stats["replays"].as_u64().unwrap() >= 1, "{stats}");
    p.stop();
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_kill_points() {
    kill_points::<SqliteBank>("kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_kill_points() {
    kill_points::<PgBank>("kill").await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_kill_points() {
    kill_points::<idem_conformance::mysql::MysqlBank>("kill").await;
}

// ---------------------------------------------------------------------------------
// idem demo complete.

async fn completer<K: Engine>(tag: &str) {
    let db = K::open(tag).await;
    let c = client();
    let p = provider(&[]);
    // One run that never reached the provider, one that stopped after its order.
    killed_at(&db.url, &p.base, "started", "abandon", 40).await;
    killed_at(&db.url, &p.base, "order_created", "resume", 60).await;
    assert_eq!(db.orders().await, (0, 1, 0));

    // Without --provider: the first ends failed, the second is left. Runs whose lease
    // is live are not touched: let the 1 s leases end first.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let out = idem(&["--url", &db.url, "complete"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "order:v1: succeeded 0, failed 1, busy 0, left 1\n  resume: stopped after its order \
         was created: needs --provider to learn the charge's outcome\n"
    );
    assert!(charges(&c, &p).await.is_empty());

    // With --provider: charged once, paid.
    let out = idem(&[
        "--url",
        &db.url,
        "complete",
        "--provider",
        &p.base,
        "--lease-ms",
        "5000",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "order:v1: succeeded 1, failed 0, busy 0, left 0\n"
    );
    let made = charges(&c, &p).await;
    assert_eq!(made.len(), 1, "{made:?}");
    assert_eq!(made[0]["amount"], 60);
    assert_eq!(db.orders().await, (1, 0, 0));

    // Nothing is left.
    let out = idem(&[
        "--url",
        &db.url,
        "complete",
        "--provider",
        &p.base,
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        serde_json::from_slice::<Value>(&out.stdout).unwrap(),
        json!({"found": 0, "operations": {}})
    );

    // The clients' retries replay the stored answers.
    let s = serve(&db.url, &p.base, &[]);
    let r = order(&c, &s, "resume", 60).await;
    assert!(replayed(&r));
    let body = paid(r).await;
    assert_eq!(body["charge_id"], made[0]["id"]);
    let r = order(&c, &s, "resume", 60).await;
    assert_eq!(paid(r).await, body);
    let r = order(&c, &s, "abandon", 40).await;
    assert!(replayed(&r));
    let failed = problem(
        r,
        StatusCode::UNPROCESSABLE_ENTITY,
        "urn:idem:demo:order-failed",
    )
    .await;
    assert_eq!(
        failed["order"],
        json!({"status": "failed", "reason": "abandoned before the charge"})
    );
    assert_eq!(charges(&c, &p).await.len(), 1);
    s.stop();
    p.stop();
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_complete() {
    completer::<SqliteBank>("complete").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_complete() {
    completer::<PgBank>("complete").await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_complete() {
    completer::<idem_conformance::mysql::MysqlBank>("complete").await;
}
