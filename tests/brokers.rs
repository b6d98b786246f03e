//! Idempotent consumers against the real brokers: RabbitMQ (127.0.0.1:5672) and NATS
//! JetStream (127.0.0.1:4222), each on SQLite, PostgreSQL and MariaDB. Every case runs
//! the `idem` binary as a separate process (so it can be SIGKILLed), in a private
//! queue/stream and a private schema/database/file that it removes afterwards, checks the
//! invariant (the balance moved by exactly the distinct messages' sum, one record per
//! message ID, nothing left unacknowledged) and prints its counts.
//!
//! Brokers and engines are required: an unreachable one fails its cases.
//! Build the binary first: `cargo build -p idem-cli --all-features` (ci/test.sh does).
//! `IDEM_BROKER_MESSAGES` sets the size of the competing-consumers run (default 10,000,
//! on every engine and both brokers).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use idem::consumer::async_nats::jetstream::{self, stream};
use idem::consumer::async_nats::{self, HeaderMap};
use idem::consumer::lapin::options::{
    BasicAckOptions, BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem::consumer::lapin::types::{AMQPValue, FieldTable};
use idem::consumer::lapin::{self, BasicProperties, Connection, ConnectionProperties};
use idem::consumer::{
    Consumer, DeadLetterReason, Decision, Handler, ORIGINAL_ID_HEADER, REASON_HEADER,
    nats::MSG_ID_HEADER,
};
use idem::{BoxFuture, Idem, Request, Subscriber};
use idem_conformance::Bank;
use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use idem_conformance::sqlite::SqliteBank;
use idem_conformance::{Balance, BankError};
use libtest_mimic::{Arguments, Trial};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

#[path = "relay_support.rs"]
mod support;

use support::{Private, Res, amqp_url, check, fail, idem_binary, nats_url, unique};

/// A message to publish: its ID (none for a message without one) and its amount.
type Msg = (Option<String>, i64);

/// A hang guard only: no case asserts how long anything took.
const GUARD: Duration = Duration::from_secs(600);
const START: i64 = 1_000_000;

// ---------------------------------------------------------------- engines

/// A private database for one case ([`Private`]), and what the cases read from it.
trait Engine: Private {
    /// Processed-message records of `subscriber`.
    fn records(&self, subscriber: &str) -> impl Future<Output = Res<u64>> + Send;
}

impl Engine for PgBank {
    async fn records(&self, subscriber: &str) -> Res<u64> {
        use idem::postgres::sqlx;
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_processed_message WHERE subscriber = $1")
                .bind(subscriber)
                .fetch_one(self.backend().pool())
                .await
                .map_err(|e| fail(e.to_string()))?;
        Ok(u64::try_from(n).unwrap())
    }
}

impl Engine for MysqlBank {
    async fn records(&self, subscriber: &str) -> Res<u64> {
        use idem::mysql::mysql_async::prelude::Queryable;
        let mut conn = self
            .backend()
            .pool()
            .get_conn()
            .await
            .map_err(|e| fail(e.to_string()))?;
        let n: Option<u64> = conn
            .exec_first(
                "SELECT count(*) FROM idem_processed_message WHERE subscriber = ?",
                (subscriber.as_bytes(),),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok(n.unwrap_or(0))
    }
}

impl Engine for SqliteBank {
    async fn records(&self, subscriber: &str) -> Res<u64> {
        let subscriber = subscriber.to_owned();
        let n: i64 = self
            .backend()
            .interact(move |c| {
                c.query_row(
                    "SELECT count(*) FROM idem_processed_message WHERE subscriber = ?1",
                    [subscriber],
                    |r| r.get(0),
                )
            })
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok(u64::try_from(n).unwrap())
    }
}

// ---------------------------------------------------------------- brokers

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Amqp,
    Nats,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Broker::Amqp => "amqp",
            Broker::Nats => "nats",
        }
    }
}

/// A private queue (and its dead-letter queue) or stream (and its dead-letter stream).
struct Topic {
    broker: Broker,
    name: String,
    amqp: Option<(Connection, lapin::Channel)>,
    js: Option<jetstream::Context>,
}

/// The JetStream duplicate window of the test streams: duplicates published on purpose
/// are published after it.
const NATS_DUP_WINDOW: Duration = Duration::from_millis(200);

impl Topic {
    async fn create(broker: Broker, tag: &str) -> Res<Self> {
        let name = unique(tag).to_uppercase();
        match broker {
            Broker::Amqp => {
                let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
                    .await
                    .map_err(|e| {
                        fail(format!(
                            "RabbitMQ at {}: {e}",
                            idem::consumer::amqp::redact(&amqp_url())
                        ))
                    })?;
                let ch = conn
                    .create_channel()
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                for q in [name.clone(), format!("{name}.dead-letter")] {
                    ch.queue_declare(
                        q.as_str().into(),
                        QueueDeclareOptions::durable(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                }
                ch.confirm_select(ConfirmSelectOptions::default())
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                Ok(Self {
                    broker,
                    name,
                    amqp: Some((conn, ch)),
                    js: None,
                })
            }
            Broker::Nats => {
                let client = async_nats::connect(nats_url())
                    .await
                    .map_err(|e| fail(format!("NATS at {}: {e}", nats_url())))?;
                let mut js = jetstream::new(client);
                js.set_timeout(idem::consumer::nats::REQUEST_TIMEOUT);
                for (stream, subject) in [
                    (name.clone(), format!("{name}.in")),
                    (format!("{name}_DL"), format!("{name}.dead-letter")),
                ] {
                    js.create_stream(stream::Config {
                        name: stream,
                        subjects: vec![subject],
                        duplicate_window: NATS_DUP_WINDOW,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| fail(format!("create stream: {e}")))?;
                }
                Ok(Self {
                    broker,
                    name,
                    amqp: None,
                    js: Some(js),
                })
            }
        }
    }

    fn consume_args(&self, subscriber: &str) -> Vec<String> {
        let mut a: Vec<String> = match self.broker {
            Broker::Amqp => vec![
                "--amqp".into(),
                amqp_url(),
                "--queue".into(),
                self.name.clone(),
            ],
            Broker::Nats => vec![
                "--nats".into(),
                nats_url(),
                "--stream".into(),
                self.name.clone(),
                "--consumer".into(),
                "idem-test".into(),
                "--ack-wait".into(),
                "2".into(),
            ],
        };
        a.extend(["--subscriber".into(), subscriber.into()]);
        a
    }

    fn publish_args(&self) -> Vec<String> {
        match self.broker {
            Broker::Amqp => vec![
                "--amqp".into(),
                amqp_url(),
                "--queue".into(),
                self.name.clone(),
            ],
            Broker::Nats => vec![
                "--nats".into(),
                nats_url(),
                "--subject".into(),
                format!("{}.in", self.name),
            ],
        }
    }

    /// Publishes `(id, account 1, amount)` messages, pipelined, and waits for every
    /// broker confirmation. Returns how many the broker stored.
    async fn publish(&self, messages: &[Msg]) -> Res<usize> {
        let mut stored = 0;
        for chunk in messages.chunks(500) {
            match self.broker {
                Broker::Amqp => {
                    let (_, ch) = self.amqp.as_ref().unwrap();
                    let mut confirms = Vec::new();
                    for (id, amount) in chunk {
                        let body = format!(r#"{{"account": 1, "amount": {amount}}}"#);
                        let mut props = BasicProperties::default().with_delivery_mode(2);
                        if let Some(id) = id {
                            props = props.with_message_id(id.as_str().into());
                        }
                        confirms.push(
                            ch.basic_publish(
                                "".into(),
                                self.name.as_str().into(),
                                Default::default(),
                                body.as_bytes(),
                                props,
                            )
                            .await
                            .map_err(|e| fail(e.to_string()))?,
                        );
                    }
                    for c in confirms {
                        let c = c.await.map_err(|e| fail(e.to_string()))?;
                        check(c.is_ack(), || "RabbitMQ refused a publish".into())?;
                        stored += 1;
                    }
                }
                Broker::Nats => {
                    let js = self.js.as_ref().unwrap();
                    let mut acks = Vec::new();
                    for (id, amount) in chunk {
                        let body = format!(r#"{{"account": 1, "amount": {amount}}}"#);
                        let mut headers = HeaderMap::new();
                        if let Some(id) = id {
                            headers.insert(MSG_ID_HEADER, id.as_str());
                        }
                        acks.push(
                            js.publish_with_headers(
                                format!("{}.in", self.name),
                                headers,
                                body.into(),
                            )
                            .await
                            .map_err(|e| fail(e.to_string()))?,
                        );
                    }
                    for a in acks {
                        let a = a.await.map_err(|e| fail(e.to_string()))?;
                        if !a.duplicate {
                            stored += 1;
                        }
                    }
                }
            }
        }
        Ok(stored)
    }

    /// Messages neither acknowledged nor dead-lettered (after every consumer stopped).
    async fn left(&self) -> Res<u64> {
        match self.broker {
            Broker::Amqp => {
                let (_, ch) = self.amqp.as_ref().unwrap();
                let q = ch
                    .queue_declare(
                        self.name.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                Ok(u64::from(q.message_count()))
            }
            Broker::Nats => {
                let js = self.js.as_ref().unwrap();
                let stream = js
                    .get_stream(&self.name)
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                let info = stream
                    .consumer_info("idem-test")
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                Ok(info.num_pending + info.num_ack_pending as u64)
            }
        }
    }

    /// The dead letters: (message ID, reason header).
    async fn dead_letters(&self) -> Res<Vec<(Option<String>, String)>> {
        let mut out = Vec::new();
        match self.broker {
            Broker::Amqp => {
                let (_, ch) = self.amqp.as_ref().unwrap();
                let dlq = format!("{}.dead-letter", self.name);
                while let Some(m) = ch
                    .basic_get(dlq.as_str().into(), BasicGetOptions::default())
                    .await
                    .map_err(|e| fail(e.to_string()))?
                {
                    let d = m.delivery;
                    let reason = d
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|h| h.inner().get(REASON_HEADER).cloned())
                        .and_then(|v| match v {
                            AMQPValue::LongString(s) => {
                                Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                            }
                            _ => None,
                        })
                        .unwrap_or_default();
                    let id = d.properties.message_id().as_ref().map(|s| s.to_string());
                    d.acker
                        .ack(BasicAckOptions::default())
                        .await
                        .map_err(|e| fail(e.to_string()))?;
                    out.push((id, reason));
                }
            }
            Broker::Nats => {
                let js = self.js.as_ref().unwrap();
                let mut stream = js
                    .get_stream(format!("{}_DL", self.name))
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                let last = stream
                    .info()
                    .await
                    .map_err(|e| fail(e.to_string()))?
                    .state
                    .last_sequence;
                for seq in 1..=last {
                    let m = stream
                        .get_raw_message(seq)
                        .await
                        .map_err(|e| fail(e.to_string()))?;
                    let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned());
                    // A JetStream dead letter has an ID of its own; the original's is kept.
                    let own = get(MSG_ID_HEADER).unwrap_or_default();
                    check(own.starts_with("idem-dead-letter:"), || {
                        format!("dead letter with message ID {own:?}, not one of its own")
                    })?;
                    out.push((
                        get(ORIGINAL_ID_HEADER),
                        get(REASON_HEADER).unwrap_or_default(),
                    ));
                }
            }
        }
        Ok(out)
    }

    async fn delete(self) {
        match self.broker {
            Broker::Amqp => {
                if let Some((conn, ch)) = self.amqp {
                    for q in [self.name.clone(), format!("{}.dead-letter", self.name)] {
                        let _ = ch
                            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                    let _ = conn.close(200, "done".into()).await;
                }
            }
            Broker::Nats => {
                if let Some(js) = self.js {
                    let _ = js.delete_stream(&self.name).await;
                    let _ = js.delete_stream(format!("{}_DL", self.name)).await;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- processes

/// The consumer's JSON summary line.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
struct Summary {
    delivered: u64,
    applied: u64,
    duplicates: u64,
    dead_lettered: u64,
    returned: u64,
}

impl std::ops::Add for Summary {
    type Output = Summary;
    fn add(self, o: Summary) -> Summary {
        Summary {
            delivered: self.delivered + o.delivered,
            applied: self.applied + o.applied,
            duplicates: self.duplicates + o.duplicates,
            dead_lettered: self.dead_lettered + o.dead_lettered,
            returned: self.returned + o.returned,
        }
    }
}

impl Summary {
    fn acked(&self) -> u64 {
        self.applied + self.duplicates + self.dead_lettered
    }
}

/// Starts `idem demo <command> <args>` on `db_url`.
fn spawn(db_url: &str, command: &str, args: &[String]) -> Res<Child> {
    Command::new(idem_binary()?)
        .arg("--url")
        .arg(db_url)
        .arg("demo")
        .arg(command)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| fail(format!("cannot run idem: {e}")))
}

struct Ended {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

/// Waits (bounded) for `child` and collects its output; a process still running at the
/// guard is killed, and the failure shows what it printed (why it hung).
async fn finish(mut child: Child) -> Res<Ended> {
    use tokio::io::AsyncReadExt;
    let read = |pipe: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>| {
        tokio::spawn(async move {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text).await;
            }
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = read(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = read(child.stderr.take().map(|p| Box::new(p) as _));
    let waited = tokio::time::timeout(GUARD, child.wait()).await;
    if waited.is_err() {
        let _ = child.kill().await;
    }
    let (stdout, stderr) = (
        stdout.await.unwrap_or_default(),
        stderr.await.unwrap_or_default(),
    );
    let Ok(status) = waited else {
        let tail = |s: &str| {
            s.lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        };
        return Err(fail(format!(
            "an idem process hung (hang guard, killed); its stdout:\n{}\nits stderr:\n{}",
            tail(&stdout),
            tail(&stderr)
        )));
    };
    Ok(Ended {
        status: status.map_err(|e| fail(e.to_string()))?,
        stdout,
        stderr,
    })
}

/// Waits for a consumer that must exit 0 and returns its summary.
async fn summary(child: Child) -> Res<Summary> {
    let e = finish(child).await?;
    check(e.status.success(), || {
        format!("idem demo consume failed ({}): {}", e.status, e.stderr)
    })?;
    let line = e.stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|err| fail(format!("no summary in {:?}: {err}", e.stdout)))
}

async fn killed(child: Child) -> Res<String> {
    use std::os::unix::process::ExitStatusExt;
    let e = finish(child).await?;
    check(e.status.signal() == Some(9), || {
        format!("expected death by SIGKILL, got {} ({})", e.status, e.stderr)
    })?;
    Ok(e.stderr)
}

fn consume_args(topic: &Topic, subscriber: &str, extra: &[&str]) -> Vec<String> {
    let mut a = topic.consume_args(subscriber);
    a.extend(extra.iter().map(|s| (*s).to_owned()));
    a
}

// ---------------------------------------------------------------- cases

/// One case's context: a private database and a private topic.
struct Ctx<K> {
    bank: K,
    url: String,
    topic: Topic,
}

async fn with_ctx<K: Engine>(
    broker: Broker,
    tag: &str,
    body: impl AsyncFnOnce(&Ctx<K>) -> Res,
) -> Res {
    let (bank, url) = K::private(tag).await?;
    let ready = async {
        bank.setup().await.map_err(|e| fail(e.to_string()))?;
        bank.set_balance(1, START)
            .await
            .map_err(|e| fail(e.to_string()))?;
        Topic::create(broker, tag).await
    }
    .await;
    let topic = match ready {
        Ok(t) => t,
        Err(e) => {
            let _ = bank.close().await;
            return Err(e);
        }
    };
    let ctx = Ctx { bank, url, topic };
    let result = body(&ctx).await;
    ctx.topic.delete().await;
    let closed = ctx.bank.close().await;
    result?;
    closed.map_err(|e| fail(format!("cleanup: {e}")))
}

async fn balance<K: Engine>(bank: &K) -> Res<i64> {
    bank.balance(1).await.map_err(|e| fail(e.to_string()))
}

/// Checks the invariant after every consumer stopped: the balance moved by exactly the
/// distinct messages' sum, one record per distinct message ID, nothing left on the broker.
async fn invariant<K: Engine>(
    ctx: &Ctx<K>,
    subscriber: &str,
    distinct: &BTreeMap<String, i64>,
) -> Res<String> {
    let moved = balance(&ctx.bank).await? - START;
    let sum: i64 = distinct.values().sum();
    let records = ctx.bank.records(subscriber).await?;
    let left = ctx.topic.left().await?;
    check(moved == sum, || {
        format!("balance moved by {moved}, the distinct messages sum to {sum}")
    })?;
    check(records == distinct.len() as u64, || {
        format!(
            "{records} records for {} distinct message IDs",
            distinct.len()
        )
    })?;
    check(left == 0, || format!("{left} messages left unacknowledged"))?;
    Ok(format!(
        "balance +{moved} = distinct sum {sum}; {records} records for {} IDs; {left} left on the broker",
        distinct.len()
    ))
}

fn report(case: &str, ctx_broker: Broker, engine: &str, text: &str) {
    println!("[{} {engine} {case}] {text}", ctx_broker.name());
}

async fn same_message_n_times<K: Engine>(ctx: &Ctx<K>) -> Res {
    const N: u32 = 5;
    let id = unique("msg");
    let mut args = ctx.topic.publish_args();
    args.extend(["--id".into(), id.clone(), "--amount".into(), "50".into()]);
    if ctx.topic.broker == Broker::Amqp {
        args.extend(["--times".into(), N.to_string()]);
        let e = finish(spawn(&ctx.url, "publish", &args)?).await?;
        check(e.status.success(), || e.stderr.clone())?;
    } else {
        // JetStream itself drops a re-publish inside the duplicate window: publish after it.
        for _ in 0..N {
            let e = finish(spawn(&ctx.url, "publish", &args)?).await?;
            check(
                e.status.success() && e.stderr.contains("(0 dropped"),
                || e.stderr.clone(),
            )?;
            tokio::time::sleep(NATS_DUP_WINDOW + Duration::from_millis(100)).await;
        }
    }
    let sub = "balance-projection";
    let s = summary(spawn(
        &ctx.url,
        "consume",
        &consume_args(&ctx.topic, sub, &["--max-idle", "3"]),
    )?)
    .await?;
    check(
        s.delivered == u64::from(N) && s.applied == 1 && s.duplicates == u64::from(N) - 1,
        || format!("{s:?}"),
    )?;
    check(s.acked() == u64::from(N), || {
        format!("acknowledged {} of {N}", s.acked())
    })?;
    let text = invariant(ctx, sub, &BTreeMap::from([(id, 50)])).await?;
    report(
        "same message N times",
        ctx.topic.broker,
        K::NAME,
        &format!(
            "published {N}, delivered {}, applied {}, duplicates {}, acknowledged {}; {text}",
            s.delivered,
            s.applied,
            s.duplicates,
            s.acked()
        ),
    );
    Ok(())
}

fn three() -> (Vec<Msg>, BTreeMap<String, i64>) {
    let msgs: Vec<Msg> = [10, 20, 30]
        .into_iter()
        .map(|a| (Some(unique("m")), a))
        .collect();
    let distinct = msgs
        .iter()
        .map(|(id, a)| (id.clone().unwrap(), *a))
        .collect();
    (msgs, distinct)
}

async fn crash_after_commit<K: Engine>(ctx: &Ctx<K>) -> Res {
    let (msgs, distinct) = three();
    ctx.topic.publish(&msgs).await?;
    let sub = "crash-after";
    let why = killed(spawn(
        &ctx.url,
        "consume",
        &consume_args(
            &ctx.topic,
            sub,
            &["--crash-after-commit", "2", "--prefetch", "1"],
        ),
    )?)
    .await?;
    check(why.contains("SIGKILL after applied message 2"), || {
        why.clone()
    })?;
    let before = balance(&ctx.bank).await? - START;
    check(before == 30, || {
        format!("after the crash the balance moved by {before}, expected 10 + 20 committed")
    })?;
    let s = summary(spawn(
        &ctx.url,
        "consume",
        &consume_args(&ctx.topic, sub, &["--max-idle", "5"]),
    )?)
    .await?;
    check(s.applied == 1 && s.duplicates >= 1, || {
        format!("the unacknowledged message must come back as a duplicate: {s:?}")
    })?;
    let text = invariant(ctx, sub, &distinct).await?;
    report(
        "killed after commit, before ack",
        ctx.topic.broker,
        K::NAME,
        &format!(
            "first process: 2 committed then SIGKILL (balance +{before}); restart: delivered {}, applied {}, duplicates {}; {text}",
            s.delivered, s.applied, s.duplicates
        ),
    );
    Ok(())
}

async fn crash_before_commit<K: Engine>(ctx: &Ctx<K>) -> Res {
    let (msgs, distinct) = three();
    ctx.topic.publish(&msgs).await?;
    let sub = "crash-before";
    let why = killed(spawn(
        &ctx.url,
        "consume",
        &consume_args(
            &ctx.topic,
            sub,
            &["--crash-before-commit", "2", "--prefetch", "1"],
        ),
    )?)
    .await?;
    check(why.contains("before its commit"), || why.clone())?;
    let before = balance(&ctx.bank).await? - START;
    check(before == 10, || {
        format!("after the crash the balance moved by {before}, expected only the first 10")
    })?;
    let s = summary(spawn(
        &ctx.url,
        "consume",
        &consume_args(&ctx.topic, sub, &["--max-idle", "5"]),
    )?)
    .await?;
    check(s.applied == 2 && s.duplicates == 0, || {
        format!("the uncommitted message must be applied on redelivery: {s:?}")
    })?;
    let text = invariant(ctx, sub, &distinct).await?;
    report(
        "killed before commit",
        ctx.topic.broker,
        K::NAME,
        &format!(
            "first process: 1 committed, SIGKILL inside the 2nd (balance +{before}); restart: delivered {}, applied {}, duplicates {}; {text}",
            s.delivered, s.applied, s.duplicates
        ),
    );
    Ok(())
}

async fn dead_letters<K: Engine>(ctx: &Ctx<K>) -> Res {
    let id = unique("dl");
    ctx.topic
        .publish(&[(None, 50), (Some(id.clone()), 50)])
        .await?;
    tokio::time::sleep(NATS_DUP_WINDOW + Duration::from_millis(100)).await;
    ctx.topic.publish(&[(Some(id.clone()), 51)]).await?;
    // Through `idem demo publish`: an unknown account (the effect refuses it for good) and a
    // negative amount (refused before any SQL).
    let (unknown, negative) = (unique("dl-account"), unique("dl-amount"));
    for (mid, account, amount) in [(&unknown, "999", "50"), (&negative, "1", "-5")] {
        let mut args = ctx.topic.publish_args();
        args.extend(["--id", mid, "--account", account, "--amount", amount].map(String::from));
        let e = finish(spawn(&ctx.url, "publish", &args)?).await?;
        check(e.status.success(), || e.stderr.clone())?;
    }
    let sub = "dead-letters";
    let s = summary(spawn(
        &ctx.url,
        "consume",
        &consume_args(&ctx.topic, sub, &["--max-idle", "3"]),
    )?)
    .await?;
    check(
        s.applied == 1 && s.dead_lettered == 4 && s.acked() == 5,
        || format!("{s:?}"),
    )?;
    let mut dl = ctx.topic.dead_letters().await?;
    dl.sort();
    let mut expected = vec![
        (None, "missing-message-id".to_owned()),
        (Some(id.clone()), "payload-mismatch".to_owned()),
        (Some(unknown), "effect-rejected".to_owned()),
        (Some(negative), "malformed-body".to_owned()),
    ];
    expected.sort();
    check(dl == expected, || {
        format!("dead letters {dl:?}, expected {expected:?}")
    })?;
    let text = invariant(ctx, sub, &BTreeMap::from([(id, 50)])).await?;
    report(
        "dead letters",
        ctx.topic.broker,
        K::NAME,
        &format!(
            "applied {}, dead-lettered {} with reasons {:?}; {text}",
            s.applied,
            s.dead_lettered,
            dl.iter().map(|d| d.1.as_str()).collect::<Vec<_>>()
        ),
    );
    Ok(())
}

fn distinct_messages(n: usize) -> (Vec<Msg>, BTreeMap<String, i64>) {
    let msgs: Vec<Msg> = (0..n)
        .map(|i| (Some(format!("{}-{i}", unique("c"))), fastrand::i64(1..=100)))
        .collect();
    let distinct = msgs
        .iter()
        .map(|(id, a)| (id.clone().unwrap(), *a))
        .collect();
    (msgs, distinct)
}

async fn graceful_shutdown<K: Engine>(ctx: &Ctx<K>) -> Res {
    let (msgs, distinct) = distinct_messages(300);
    ctx.topic.publish(&msgs).await?;
    let sub = "graceful";
    let child = spawn(&ctx.url, "consume", &consume_args(&ctx.topic, sub, &[]))?;
    let pid = child.id().ok_or_else(|| fail("no pid"))?;
    wait_until_moved(&ctx.bank).await?;
    let kill = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await
        .map_err(|e| fail(e.to_string()))?;
    check(kill.success(), || "kill -TERM failed".into())?;
    let first = summary(child).await?;
    let second = summary(spawn(
        &ctx.url,
        "consume",
        &consume_args(&ctx.topic, sub, &["--max-idle", "3"]),
    )?)
    .await?;
    check(first.applied + second.applied == 300, || {
        format!("{first:?} then {second:?}")
    })?;
    let text = invariant(ctx, sub, &distinct).await?;
    report(
        "SIGTERM",
        ctx.topic.broker,
        K::NAME,
        &format!(
            "300 messages; SIGTERM after the first commits: exit 0 with applied {} (NAKed {} pulled but not started); second process applied {}, duplicates {}; {text}",
            first.applied, first.returned, second.applied, second.duplicates
        ),
    );
    Ok(())
}

/// Waits (bounded) until the first effects are visible.
async fn wait_until_moved<K: Engine>(bank: &K) -> Res {
    for _ in 0..6000 {
        if balance(bank).await.unwrap_or(START) > START {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(fail("no message was applied (hang guard)"))
}

/// The competing-consumers run's size (`IDEM_BROKER_MESSAGES`, default 10,000), the same
/// on every engine and broker.
fn competing_size() -> usize {
    std::env::var("IDEM_BROKER_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n >= 10)
        .unwrap_or(10_000)
}

async fn competing_consumers<K: Engine>(ctx: &Ctx<K>) -> Res {
    let n = competing_size();
    let dups = n / 10;
    let (mut msgs, distinct) = distinct_messages(n - dups);
    let originals = msgs.clone();

    // Each duplicated message is published twice in all (JetStream would drop a third
    // copy inside its duplicate window).
    let mut duplicates = originals;
    fastrand::shuffle(&mut duplicates);
    duplicates.truncate(dups);
    let sub = "competing";
    let args = consume_args(&ctx.topic, sub, &["--max-idle", "5", "--prefetch", "20"]);
    let a = spawn(&ctx.url, "consume", &args)?;
    let b = spawn(&ctx.url, "consume", &args)?;
    let stored = if ctx.topic.broker == Broker::Amqp {
        msgs.extend(duplicates);
        fastrand::shuffle(&mut msgs);
        ctx.topic.publish(&msgs).await?
    } else {
        let first = ctx.topic.publish(&msgs).await?;
        tokio::time::sleep(NATS_DUP_WINDOW + Duration::from_millis(200)).await;
        first + ctx.topic.publish(&duplicates).await?
    };
    check(stored == n, || {
        format!("the broker stored {stored} of {n} publishes")
    })?;
    let (sa, sb) = (summary(a).await?, summary(b).await?);
    let s = sa + sb;
    check(s.applied == distinct.len() as u64, || {
        format!(
            "applied {} of {} distinct: {sa:?} {sb:?}",
            s.applied,
            distinct.len()
        )
    })?;
    check(s.duplicates >= dups as u64, || {
        format!("{} duplicates acknowledged, {dups} published", s.duplicates)
    })?;
    check(s.acked() >= n as u64, || {
        format!("acknowledged {} of {n}", s.acked())
    })?;
    let text = invariant(ctx, sub, &distinct).await?;
    report(
        "two competing consumers",
        ctx.topic.broker,
        K::NAME,
        &format!(
            "{n} messages ({} distinct, {dups} duplicates): consumer A applied {} dup {}, consumer B applied {} dup {}; delivered {}, acknowledged {}, returned {}; {text}",
            distinct.len(),
            sa.applied,
            sa.duplicates,
            sb.applied,
            sb.duplicates,
            s.delivered,
            s.acked(),
            s.returned
        ),
    );
    Ok(())
}

// ---------------------------------------------------------------- database outage

/// A private PostgreSQL 15 instance on a free port, in its own data directory, started
/// and stopped by the case (the shared server is never touched).
struct PrivatePg {
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

/// PostgreSQL's server programs: `IDEM_PG_BIN`, or the newest `/usr/lib/postgresql/*/bin`.
fn pg_bin(name: &str) -> PathBuf {
    if let Ok(dir) = std::env::var("IDEM_PG_BIN") {
        return Path::new(&dir).join(name);
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .max()
        .unwrap_or(15);
    Path::new("/usr/lib/postgresql")
        .join(newest.to_string())
        .join("bin")
        .join(name)
}

impl PrivatePg {
    async fn run(&self, program: &str, args: &[&str]) -> Res {
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(pg_bin(program));
            c
        } else {
            Command::new(pg_bin(program))
        };
        let out = tokio::time::timeout(Duration::from_secs(120), cmd.args(args).output())
            .await
            .map_err(|_| fail(format!("{program} hung")))?
            .map_err(|e| fail(format!("cannot run {program}: {e}")))?;
        check(out.status.success(), || {
            format!(
                "{program} {args:?} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }

    async fn init() -> Res<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| fail(e.to_string()))?
            .port();
        let dir = std::env::temp_dir().join(unique("pgdata"));
        std::fs::create_dir_all(&dir).map_err(|e| fail(e.to_string()))?;
        let uid = Command::new("id")
            .arg("-u")
            .output()
            .await
            .map_err(|e| fail(e.to_string()))?;
        let as_postgres = String::from_utf8_lossy(&uid.stdout).trim() == "0";
        if as_postgres {
            let st = Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(&dir)
                .status()
                .await
                .map_err(|e| fail(e.to_string()))?;
            check(st.success(), || "chown of the data directory failed".into())?;
        }
        let pg = Self {
            dir,
            port,
            as_postgres,
        };
        let data = pg.dir.join("data");
        pg.run(
            "initdb",
            &[
                "-D",
                &data.to_string_lossy(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        )
        .await?;
        pg.start().await?;
        Ok(pg)
    }

    async fn start(&self) -> Res {
        let data = self.dir.join("data");
        let log = self.dir.join("log");
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            self.port,
            self.dir.display()
        );
        self.run(
            "pg_ctl",
            &[
                "-D",
                &data.to_string_lossy(),
                "-l",
                &log.to_string_lossy(),
                "-w",
                "-o",
                &opts,
                "start",
            ],
        )
        .await
    }

    async fn stop(&self) -> Res {
        let data = self.dir.join("data");
        self.run(
            "pg_ctl",
            &["-D", &data.to_string_lossy(), "-m", "fast", "-w", "stop"],
        )
        .await
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    async fn remove(self) {
        let data = self.dir.join("data");
        let _ = self
            .run(
                "pg_ctl",
                &[
                    "-D",
                    &data.to_string_lossy(),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
            )
            .await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn database_down(broker: Broker) -> Res {
    let pg = PrivatePg::init().await?;
    let result = database_down_on(broker, &pg).await;
    pg.remove().await;
    result
}

/// How long the private PostgreSQL is down.
const OUTAGE: Duration = Duration::from_secs(12);

async fn database_down_on(broker: Broker, pg: &PrivatePg) -> Res {
    const N: usize = 3000;
    let url = pg.url();
    let bank = PgBank::connect(&url, None)
        .await
        .map_err(|e| fail(e.to_string()))?;
    bank.setup().await.map_err(|e| fail(e.to_string()))?;
    bank.set_balance(1, START)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let topic = Topic::create(broker, "down").await?;
    let ctx = Ctx { bank, url, topic };
    let result = async {
        let (msgs, distinct) = distinct_messages(N);
        ctx.topic.publish(&msgs).await?;
        let sub = "outage";
        let child = spawn(&ctx.url, "consume", &consume_args(&ctx.topic, sub, &["--max-idle", "30"]))?;
        wait_until_moved(&ctx.bank).await?;
        pg.stop().await?;
        // Longer than the backend pool's 10 s acquire timeout, so the outage is not hidden
        // by a waiting pool: deliveries in it fail and must be returned and redelivered.
        tokio::time::sleep(OUTAGE).await;
        pg.start().await?;
        let s = summary(child).await?;
        check(s.returned >= 1, || format!("the outage was not seen by the consumer: {s:?}"))?;
        // The proof: every distinct message moved the balance once and left one record.
        let text = invariant(&ctx, sub, &distinct).await?;
        // The messages are distinct, so a duplicate here is a delivery whose COMMIT
        // succeeded while its reply was lost to the shutdown: the consumer could not
        // know, returned it, and recognised it on redelivery. Only a returned delivery
        // can come back that way.
        check(s.applied + s.duplicates == N as u64, || {
            format!("applied {} + duplicates {} is not {N}: {s:?}", s.applied, s.duplicates)
        })?;
        check(s.duplicates <= s.returned, || {
            format!("{} duplicates but only {} deliveries returned: {s:?}", s.duplicates, s.returned)
        })?;
        check(s.dead_lettered == 0 && s.delivered == s.acked() + s.returned, || {
            format!("deliveries not accounted for: {s:?}")
        })?;
        report(
            "database down 12 s mid-stream",
            broker,
            "postgres (private instance)",
            &format!("{N} messages; returned for redelivery during the outage {}, delivered {}, applied {}, duplicates {} (commits whose reply the outage lost); {text}", s.returned, s.delivered, s.applied, s.duplicates),
        );
        Ok(())
    }
    .await;
    ctx.topic.delete().await;
    let _ = ctx.bank.close().await;
    result
}

// ---------------------------------------------------------------- decisions (no broker)

/// Decodes any JSON body into the payload and credits account 1 with 1 (the reason
/// labels case).
struct AnyJson<K>(std::marker::PhantomData<fn() -> K>);

impl<K: Bank> Handler<K::B> for AnyJson<K> {
    type Message = ();
    type Response = Balance;
    type Error = BankError;

    fn decode(&self, body: &[u8]) -> Result<((), Request), String> {
        let value: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        Ok(((), Request::new(value)))
    }

    fn apply<'t>(
        &self,
        tx: &'t mut <K::B as idem::Backend>::Tx,
        (): (),
    ) -> BoxFuture<'t, Result<Balance, BankError>> {
        K::credit(tx, 1, 1)
    }
}

/// Every reason label names what happened (issue 17.9: an oversized payload was labelled
/// `invalid-message-id`), and a setting idem refuses is not the message's fault.
async fn reason_labels<K: Engine>(bank: &K) -> Res {
    let sub = Subscriber::new("labels").unwrap();
    let idem = Idem::new(bank.backend().clone()).with_max_request_bytes(256);
    let consumer = Consumer::new(idem, sub.clone(), AnyJson::<K>(Default::default()));
    let mut deep = json!(1);
    for _ in 0..200 {
        deep = json!([deep]);
    }
    /// What is sent, its message ID and body, and the reason it must be dead-lettered with
    /// (`None`: applied).
    type Case = (
        &'static str,
        Option<String>,
        Vec<u8>,
        Option<DeadLetterReason>,
    );
    let cases: Vec<Case> = vec![
        (
            "a payload over the size limit",
            Some(unique("big")),
            json!({ "pad": "x".repeat(1000) }).to_string().into_bytes(),
            Some(DeadLetterReason::PayloadTooLarge),
        ),
        (
            "a payload nested 200 levels deep",
            Some(unique("deep")),
            deep.to_string().into_bytes(),
            Some(DeadLetterReason::MalformedBody),
        ),
        (
            "a body that is not JSON",
            Some(unique("text")),
            b"not json".to_vec(),
            Some(DeadLetterReason::MalformedBody),
        ),
        (
            "a message ID of 256 bytes",
            Some("i".repeat(256)),
            b"{}".to_vec(),
            Some(DeadLetterReason::InvalidMessageId),
        ),
        (
            "no message ID",
            None,
            b"{}".to_vec(),
            Some(DeadLetterReason::MissingMessageId),
        ),
        ("a small payload", Some(unique("ok")), b"{}".to_vec(), None),
    ];
    let mut seen = Vec::new();
    for (what, id, body, expected) in cases {
        let d = consumer.handle(id.as_deref(), &body).await;
        let ok = match (&d, expected) {
            (Decision::DeadLetter { reason, .. }, Some(want)) => *reason == want,
            (Decision::Applied, None) => true,
            _ => false,
        };
        check(ok, || {
            format!("{what}: decided {d:?}, expected {expected:?}")
        })?;
        seen.push(match d {
            Decision::DeadLetter { reason, .. } => reason.code(),
            _ => "applied",
        });
    }
    // A message retention idem refuses (below its minimum) refuses every call: returned
    // for redelivery until the setting is fixed, never dead-lettered.
    let broken = Idem::new(bank.backend().clone()).with_message_retention(Duration::ZERO);
    let consumer = Consumer::new(broken, sub, AnyJson::<K>(Default::default()));
    let d = consumer.handle(Some(&unique("ret")), b"{}").await;
    check(matches!(d, Decision::Redeliver { .. }), || {
        format!("a refused retention setting: decided {d:?}, expected redelivery")
    })?;
    let moved = balance(bank).await? - START;
    check(moved == 1, || {
        format!("balance moved by {moved}, expected 1")
    })?;
    println!(
        "[{} reason labels] {seen:?}; a refused retention: redeliver",
        K::NAME
    );
    Ok(())
}

/// An engine whose session an effect can lose on purpose.
trait Killable: Engine {
    /// Inside the effect: kills the transaction's own session from another connection of
    /// `backend`'s pool, and waits until it is gone.
    fn kill_own_session<'t>(
        backend: &'t Self::B,
        tx: &'t mut <Self::B as idem::Backend>::Tx,
    ) -> BoxFuture<'t, Result<(), BankError>>;
}

fn bank_error(e: impl std::fmt::Display) -> BankError {
    BankError::Db(idem::DbError::new(
        "test",
        idem::ErrorKind::Other,
        e.to_string(),
    ))
}

impl Killable for PgBank {
    fn kill_own_session<'t>(
        backend: &'t Self::B,
        tx: &'t mut <Self::B as idem::Backend>::Tx,
    ) -> BoxFuture<'t, Result<(), BankError>> {
        use idem::postgres::sqlx;
        Box::pin(async move {
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut **tx)
                .await
                .map_err(bank_error)?;
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)")
                .bind(pid)
                .fetch_one(backend.pool())
                .await
                .map_err(bank_error)?;
            if killed {
                Ok(())
            } else {
                Err(bank_error(format!("session {pid} was not terminated")))
            }
        })
    }
}

impl Killable for MysqlBank {
    fn kill_own_session<'t>(
        backend: &'t Self::B,
        tx: &'t mut <Self::B as idem::Backend>::Tx,
    ) -> BoxFuture<'t, Result<(), BankError>> {
        use idem::mysql::mysql_async::prelude::Queryable;
        Box::pin(async move {
            let id: Option<u64> = tx
                .query_first("SELECT CONNECTION_ID()")
                .await
                .map_err(bank_error)?;
            let id = id.ok_or_else(|| bank_error("no connection id"))?;
            let mut control = backend.pool().get_conn().await.map_err(bank_error)?;
            control
                .query_drop(format!("KILL CONNECTION {id}"))
                .await
                .map_err(bank_error)?;
            // KILL only flags the thread: wait until it has left the process list.
            for _ in 0..500 {
                let left: Option<u64> = control
                    .exec_first(
                        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
                        (id,),
                    )
                    .await
                    .map_err(bank_error)?;
                if left == Some(0) {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(bank_error(format!("session {id} survived KILL")))
        })
    }
}

/// Credits `{"account": N, "amount": N}`; the first effect loses its own database
/// session before the credit, so the credit fails on a dead connection.
struct LosesConnection<K: Killable> {
    backend: K::B,
    armed: std::sync::atomic::AtomicBool,
}

impl<K: Killable> Handler<K::B> for LosesConnection<K> {
    type Message = (i64, i64);
    type Response = Balance;
    type Error = BankError;

    fn decode(&self, body: &[u8]) -> Result<((i64, i64), Request), String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let (Some(account), Some(amount)) = (v["account"].as_i64(), v["amount"].as_i64()) else {
            return Err("not {\"account\": N, \"amount\": N}".into());
        };
        Ok(((account, amount), Request::new(v)))
    }

    fn apply<'t>(
        &self,
        tx: &'t mut <K::B as idem::Backend>::Tx,
        (account, amount): (i64, i64),
    ) -> BoxFuture<'t, Result<Balance, BankError>> {
        let lose = self.armed.swap(false, std::sync::atomic::Ordering::SeqCst);
        let backend = self.backend.clone();
        Box::pin(async move {
            if lose {
                K::kill_own_session(&backend, tx).await?;
            }
            K::credit(tx, account, amount).await
        })
    }
    // `on_effect_error` is the default: what every handler that does not override it gets.
}

/// Issue 17.9: the consumer's default turned a connection lost inside the effect into a
/// dead letter. It is redelivered now, and the redelivery applies the message once.
async fn lost_connection_in_effect<K: Killable>(bank: &K) -> Res {
    let sub = "lost-connection";
    let handler = LosesConnection::<K> {
        backend: bank.backend().clone(),
        armed: std::sync::atomic::AtomicBool::new(true),
    };
    let consumer = Consumer::new(
        Idem::new(bank.backend().clone()),
        Subscriber::new(sub).unwrap(),
        handler,
    );
    let id = unique("lost");
    let body = br#"{"account": 1, "amount": 50}"#;
    let first = consumer.handle(Some(&id), body).await;
    check(matches!(first, Decision::Redeliver { .. }), || {
        format!(
            "a connection lost inside the effect must be redelivered, not dead-lettered: {first:?}"
        )
    })?;
    let after_loss = balance(bank).await? - START;
    check(after_loss == 0, || {
        format!("the lost effect moved the balance by {after_loss}")
    })?;
    let second = consumer.handle(Some(&id), body).await;
    check(second == Decision::Applied, || {
        format!("the redelivery: {second:?}")
    })?;
    let third = consumer.handle(Some(&id), body).await;
    check(third == Decision::Duplicate, || {
        format!("the third: {third:?}")
    })?;
    let moved = balance(bank).await? - START;
    let records = bank.records(sub).await?;
    check(moved == 50 && records == 1, || {
        format!("balance moved by {moved}, {records} records (expected 50 and 1)")
    })?;
    println!(
        "[{} connection lost inside the effect] first delivery: session killed inside the effect, decided redeliver (not dead-lettered), nothing committed; redelivery applied; third delivery a duplicate; balance +50, 1 record",
        K::NAME
    );
    Ok(())
}

// ---------------------------------------------------------------- harness

fn block_on(f: impl Future<Output = Res>) -> Res {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| fail(e.to_string()))?;
    rt.block_on(f)
}

macro_rules! case {
    ($trials:ident, $broker:expr, $K:ty, $name:ident) => {{
        let broker = $broker;
        $trials.push(Trial::test(
            format!(
                "{}::{}::{}",
                broker.name(),
                <$K as Private>::NAME,
                stringify!($name)
            ),
            move || {
                block_on(with_ctx::<$K>(broker, stringify!($name), async |ctx| {
                    $name::<$K>(ctx).await
                }))
            },
        ));
    }};
}

/// A private database with account 1 at [`START`], for the cases without a broker.
async fn with_bank<K: Engine>(tag: &str, body: impl AsyncFnOnce(&K) -> Res) -> Res {
    let (bank, _url) = K::private(tag).await?;
    let ready = async {
        bank.setup().await.map_err(|e| fail(e.to_string()))?;
        bank.set_balance(1, START)
            .await
            .map_err(|e| fail(e.to_string()))
    }
    .await;
    let result = match ready {
        Ok(()) => body(&bank).await,
        Err(e) => Err(e),
    };
    let closed = bank.close().await;
    result?;
    closed.map_err(|e| fail(format!("cleanup: {e}")))
}

macro_rules! decision_case {
    ($trials:ident, $K:ty, $name:ident) => {{
        $trials.push(Trial::test(
            format!("consumer::{}::{}", <$K as Private>::NAME, stringify!($name)),
            move || {
                block_on(with_bank::<$K>(stringify!($name), async |bank| {
                    $name::<$K>(bank).await
                }))
            },
        ));
    }};
}

fn engine_cases<K: Engine>(trials: &mut Vec<Trial>, broker: Broker) {
    case!(trials, broker, K, same_message_n_times);
    case!(trials, broker, K, crash_after_commit);
    case!(trials, broker, K, crash_before_commit);
    case!(trials, broker, K, dead_letters);
    case!(trials, broker, K, graceful_shutdown);
    case!(trials, broker, K, competing_consumers);
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    decision_case!(trials, SqliteBank, reason_labels);
    decision_case!(trials, PgBank, lost_connection_in_effect);
    decision_case!(trials, MysqlBank, lost_connection_in_effect);
    for broker in [Broker::Amqp, Broker::Nats] {
        engine_cases::<SqliteBank>(&mut trials, broker);
        engine_cases::<PgBank>(&mut trials, broker);
        engine_cases::<MysqlBank>(&mut trials, broker);
        trials.push(Trial::test(
            format!("{}::postgres::database_down", broker.name()),
            move || block_on(database_down(broker)),
        ));
    }
    libtest_mimic::run(&args, trials).exit_code()
}
