//! `idem demo serve` through a real HTTP client, on SQLite, PostgreSQL and MariaDB.
//!
//! Each test starts the built `idem` binary on a free port in a private namespace
//! (`--namespace`, removed at shutdown) and talks to it with reqwest. PostgreSQL and
//! MariaDB are required: an unreachable server fails the test.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use reqwest::{Client, Response, StatusCode};
use serde_json::{Value, json};

/// Generous guard against a hung server (never an assertion on speed).
const GUARD: Duration = Duration::from_secs(120);

struct Server {
    child: Child,
    base: String,
    output: mpsc::Receiver<String>,
}

impl Server {
    fn start(url: &str, extra: &[&str]) -> Self {
        let ns = format!(
            "idem_http_{}_{:06x}",
            std::process::id(),
            fastrand::u32(..0xff_ffff)
        );
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args([
                "--url",
                url,
                "demo",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--namespace",
                &ns,
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn idem demo serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let first = match rx.recv_timeout(GUARD) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait().ok();
                panic!(
                    "idem demo serve printed no address (exit: {status:?}); is {url} reachable?"
                );
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
            output: rx,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// SIGTERM, then the exit status and the rest of the output (bounded wait).
    fn stop(mut self) -> String {
        let pid = self.child.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(killed.success());
        let mut rest = Vec::new();
        let deadline = std::time::Instant::now() + GUARD;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "idem demo serve exited with {status}");
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "idem demo serve did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        while let Ok(line) = self.output.recv_timeout(Duration::from_secs(5)) {
            rest.push(line);
        }
        rest.join("\n")
    }
}

impl Drop for Server {
    /// After a failed assertion: SIGTERM first, so the server still removes its private
    /// namespace; SIGKILL only if it has not stopped within the guard.
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = std::time::Instant::now() + GUARD;
        while std::time::Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> Client {
    Client::builder().timeout(GUARD).build().unwrap()
}

async fn debit(c: &Client, s: &Server, account: i64, key: &str, amount: i64) -> Response {
    c.post(s.url(&format!("/accounts/{account}/debits")))
        .bearer_auth("account-1")
        .header("Idempotency-Key", key)
        .json(&json!({ "amount": amount }))
        .send()
        .await
        .unwrap()
}

async fn set_balance(c: &Client, s: &Server, account: i64, balance: i64) {
    let r = c
        .put(s.url(&format!("/accounts/{account}")))
        .json(&json!({ "balance": balance }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

async fn balance(c: &Client, s: &Server, account: i64) -> i64 {
    let r = c
        .get(s.url(&format!("/accounts/{account}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.json::<Value>().await.unwrap()["balance"]
        .as_i64()
        .unwrap()
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

/// The seed's walkthrough, every refusal, the 64-request storm and the OpenAPI document.
async fn walkthrough(url: &str) {
    let server = Server::start(url, &["--wait-timeout", "60s"]);
    let c = client();
    set_balance(&c, &server, 1, 1000).await;

    // 900, then the stored 900 replayed with the header.
    let r = debit(&c, &server, 1, "\"checkout-42\"", 100).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(!replayed(&r));
    assert_eq!(r.headers()["location"], "/accounts/1");
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"balance": 900}));
    let r = debit(&c, &server, 1, "checkout-42", 100).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(replayed(&r), "the bare token names the same key");
    assert_eq!(r.headers()["location"], "/accounts/1");
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"balance": 900}));
    assert_eq!(balance(&c, &server, 1).await, 900);

    // Same key, different amount or account: 422, nothing debited.
    let r = debit(&c, &server, 1, "checkout-42", 101).await;
    problem(
        r,
        StatusCode::UNPROCESSABLE_ENTITY,
        "urn:idem:problem:key-reused",
    )
    .await;
    set_balance(&c, &server, 2, 1000).await;
    let r = debit(&c, &server, 2, "checkout-42", 100).await;
    problem(
        r,
        StatusCode::UNPROCESSABLE_ENTITY,
        "urn:idem:problem:key-reused",
    )
    .await;
    assert_eq!(balance(&c, &server, 1).await, 900);
    assert_eq!(balance(&c, &server, 2).await, 1000);

    // Insufficient: 402 and not stored, so the same key succeeds once the money is there.
    set_balance(&c, &server, 3, 10).await;
    let r = debit(&c, &server, 3, "top-up-first", 50).await;
    problem(
        r,
        StatusCode::PAYMENT_REQUIRED,
        "urn:idem:demo:insufficient-balance",
    )
    .await;
    set_balance(&c, &server, 3, 100).await;
    let r = debit(&c, &server, 3, "top-up-first", 50).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(!replayed(&r), "the refused debit left no record");
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"balance": 50}));

    // Unknown account and no principal.
    let r = debit(&c, &server, 404, "nobody", 1).await;
    problem(r, StatusCode::NOT_FOUND, "urn:idem:demo:no-account").await;
    let r = c.get(server.url("/accounts/404")).send().await.unwrap();
    problem(r, StatusCode::NOT_FOUND, "urn:idem:demo:no-account").await;
    let r = c
        .post(server.url("/accounts/1/debits"))
        .header("Idempotency-Key", "anon")
        .json(&json!({"amount": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    problem(
        r,
        StatusCode::UNAUTHORIZED,
        "urn:idem:problem:unauthenticated",
    )
    .await;

    // Bad keys and bodies: 400 before any SQL; nothing changes.
    let long = "k".repeat(256);
    let bad_keys: [(&str, Vec<&str>); 6] = [
        ("missing", vec![]),
        ("repeated", vec!["k1", "k1"]),
        ("empty", vec!["\"\""]),
        ("oversized", vec![long.as_str()]),
        ("space in a bare key", vec!["a b"]),
        ("unterminated quote", vec!["\"abc"]),
    ];
    for (what, keys) in bad_keys {
        let mut req = c
            .post(server.url("/accounts/1/debits"))
            .bearer_auth("account-1")
            .json(&json!({"amount": 1}));
        for k in keys {
            req = req.header("Idempotency-Key", k);
        }
        let r = req.send().await.unwrap();
        let body = problem(
            r,
            StatusCode::BAD_REQUEST,
            "urn:idem:problem:invalid-idempotency-key",
        )
        .await;
        assert!(body["detail"].is_string(), "{what}: {body}");
    }
    for raw in [
        "not json",
        "{\"amount\": 1, \"amount\": 2}",
        "{\"amount\": 0}",
        "{\"amount\": 1, \"x\": 1}",
    ] {
        let r = c
            .post(server.url("/accounts/1/debits"))
            .bearer_auth("account-1")
            .header("Idempotency-Key", "body-check")
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        problem(r, StatusCode::BAD_REQUEST, "urn:idem:problem:invalid-body").await;
    }
    assert_eq!(balance(&c, &server, 1).await, 900);
    // The refused requests stored nothing: the key is still free.
    let r = debit(&c, &server, 1, "body-check", 1).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(!replayed(&r));
    assert_eq!(balance(&c, &server, 1).await, 899);

    // The consumer: credit once per message.
    let msg =
        server.url("/subscribers/balance-projection/messages/00000000-0000-4000-8000-000000000001");
    set_balance(&c, &server, 1, 900).await;
    let r = c
        .post(&msg)
        .json(&json!({"account": 1, "amount": 50}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"outcome": "applied", "balance": 950})
    );
    let r = c
        .post(&msg)
        .json(&json!({"amount": 50, "account": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"outcome": "duplicate"})
    );
    let r = c
        .post(&msg)
        .json(&json!({"account": 1, "amount": 51}))
        .send()
        .await
        .unwrap();
    problem(
        r,
        StatusCode::UNPROCESSABLE_ENTITY,
        "urn:idem:problem:payload-mismatch",
    )
    .await;
    assert_eq!(balance(&c, &server, 1).await, 950);

    // 64 concurrent requests with one key: one effect, identical answers.
    set_balance(&c, &server, 5, 100_000).await;
    let storm: Vec<_> = (0..64)
        .map(|_| {
            let c = c.clone();
            let url = server.url("/accounts/5/debits");
            tokio::spawn(async move {
                let r = c
                    .post(url)
                    .bearer_auth("account-1")
                    .header("Idempotency-Key", "storm")
                    .json(&json!({"amount": 7}))
                    .send()
                    .await
                    .unwrap();
                let replay = replayed(&r);
                (r.status(), replay, r.text().await.unwrap())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for h in storm {
        answers.push(h.await.unwrap());
    }
    let executed = answers.iter().filter(|a| !a.1).count();
    assert_eq!(executed, 1, "exactly one winner: {answers:?}");
    let winner = answers.iter().find(|a| !a.1).unwrap().clone();
    assert_eq!(winner.0, StatusCode::CREATED);
    assert_eq!(
        serde_json::from_str::<Value>(&winner.2).unwrap(),
        json!({"balance": 99_993})
    );
    for a in &answers {
        assert_eq!(
            (a.0, &a.2),
            (winner.0, &winner.2),
            "every answer is the winner's"
        );
    }
    assert_eq!(balance(&c, &server, 5).await, 99_993);
    println!(
        "storm: 64 requests, {} executed, {} replayed, all {} {}",
        executed,
        answers.len() - executed,
        winner.0.as_u16(),
        winner.2
    );

    // The OpenAPI document describes every route, status and problem type.
    let doc: Value = c
        .get(server.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/accounts/{id}",
        "/accounts/{id}/debits",
        "/subscribers/{name}/messages/{message_id}",
        "/openapi.json",
    ] {
        assert!(paths.contains_key(p), "{p} missing from {:?}", paths.keys());
    }
    let debits = &doc["paths"]["/accounts/{id}/debits"]["post"]["responses"];
    for status in ["201", "400", "401", "402", "404", "409", "422", "503"] {
        assert!(debits.get(status).is_some(), "debits lack {status}");
    }
    let text = doc.to_string();
    for t in [
        "key-reused",
        "in-progress",
        "invalid-idempotency-key",
        "insufficient-balance",
        "unavailable",
    ] {
        assert!(text.contains(t), "{t} not documented");
    }

    let out = server.stop();
    assert!(out.contains("stopped"), "{out}");
}

/// A winner held past the wait bound, a client that disconnects, and a shutdown with a
/// request in flight.
async fn held_winner(url: &str) {
    let server = Server::start(url, &["--debit-delay", "3s", "--wait-timeout", "500ms"]);
    let c = client();
    set_balance(&c, &server, 1, 1000).await;

    // Two at once: one holds the key for 3 s, the other gives up after 0.5 s with 409.
    let (a, b) = tokio::join!(
        debit(&c, &server, 1, "slow", 10),
        debit(&c, &server, 1, "slow", 10)
    );
    let (won, lost) = if a.status() == StatusCode::CREATED {
        (a, b)
    } else {
        (b, a)
    };
    assert_eq!(won.status(), StatusCode::CREATED);
    assert!(!replayed(&won));
    let retry_after: u64 = lost
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap())
        .unwrap_or(0);
    problem(lost, StatusCode::CONFLICT, "urn:idem:problem:in-progress").await;
    assert!(retry_after >= 1);
    let r = debit(&c, &server, 1, "slow", 10).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(replayed(&r), "after the commit the retry replays");
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"balance": 990}));

    // A client that disconnects mid-request: the effect commits with its record or
    // leaves no trace. Either way the retry with the same key debits exactly once.
    let impatient = Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = impatient
        .post(server.url("/accounts/1/debits"))
        .bearer_auth("account-1")
        .header("Idempotency-Key", "gone")
        .json(&json!({"amount": 25}))
        .send()
        .await;
    assert!(
        gone.unwrap_err().is_timeout(),
        "the client gave up mid-request"
    );
    let mut last = None;
    for _ in 0..200 {
        let r = debit(&c, &server, 1, "gone", 25).await;
        if r.status() != StatusCode::CONFLICT {
            last = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let r = last.expect("the key stayed in progress");
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"balance": 965}));
    assert_eq!(balance(&c, &server, 1).await, 965);

    // Shutdown with a request in flight: the request finishes, then the server exits.
    let inflight = {
        let c = c.clone();
        let url = server.url("/accounts/1/debits");
        tokio::spawn(async move {
            c.post(url)
                .bearer_auth("account-1")
                .header("Idempotency-Key", "during-shutdown")
                .json(&json!({"amount": 5}))
                .send()
                .await
        })
    };
    // Ordering only: let the request reach the server before the signal.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stop = tokio::task::spawn_blocking(move || server.stop());
    let r = inflight.await.unwrap().unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"balance": 960}));
    let out = stop.await.unwrap();
    assert!(out.contains("stopped"), "{out}");
}

fn required(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

/// A fresh directory for one SQLite test; `check_empty` then proves that shutdown removed
/// the private database file (and its WAL files).
struct SqliteDir(std::path::PathBuf);

impl SqliteDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idem-http-{tag}-{}-{:06x}",
            std::process::id(),
            fastrand::u32(..0xff_ffff)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn url(&self) -> String {
        format!("sqlite://{}/http.db", self.0.display())
    }

    fn check_empty(self) {
        let left: Vec<_> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "shutdown left {left:?} behind");
    }
}

impl Drop for SqliteDir {
    /// The directory is this test's own; a failed test must not leave it behind either.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_walkthrough() {
    let dir = SqliteDir::new("walk");
    walkthrough(&dir.url()).await;
    dir.check_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_held_winner() {
    let dir = SqliteDir::new("held");
    held_winner(&dir.url()).await;
    dir.check_empty();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_walkthrough() {
    walkthrough(&required(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_held_winner() {
    held_winner(&required(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_walkthrough() {
    walkthrough(&required(
        "IDEM_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_held_winner() {
    held_winner(&required(
        "IDEM_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ))
    .await;
}
