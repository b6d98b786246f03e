//! The transactional outbox relay against the real brokers: RabbitMQ (127.0.0.1:5672)
//! and NATS JetStream (127.0.0.1:4222), each on SQLite, PostgreSQL and MariaDB.
//!
//! Every case works in a private schema, database or file and private queues (RabbitMQ:
//! the destinations are queue names unique to the case) or a private stream (NATS: the
//! destinations are subjects unique to the case, captured by a stream named for the
//! case), removed afterwards. Messages for two destinations are enqueued inside
//! `Idem::execute` effects, one after another (so enqueue order is known); some effects
//! enqueue a message for each destination, and some fail after enqueueing, so their
//! messages are rolled back with them and must never be published. Then:
//!
//! - `relay_library`: `Idem::relay` with the crate's publisher until a pass publishes
//!   nothing; a further pass publishes nothing (all marked sent);
//! - `relay_cli`: `idem relay --once` (prints `published N`, exits 0); a second run
//!   prints `published 0`;
//! - `concurrent_relays`: two relays (two tasks, two broker connections, one publisher
//!   that is slow) drain the same outbox in small batches;
//!
//! and each checks that every committed message reached its destination exactly once,
//! with its message ID and payload, in enqueue order per destination (what the broker
//! stored, and for the library cases also the publisher's own log of publishes).
//! `unreachable_broker`: `idem relay` to a closed port exits 7 with a clear message.
//!
//! `retries_dead_and_operators` (RabbitMQ): messages for a destination the broker cannot
//! route (an exchange with no binding for it) are refused, tried again, and dead after
//! their last attempt, while the routable destination goes on; `idem outbox list --dead`
//! shows them, `idem outbox retry --dead --destination …` (once the queue is bound) and
//! `idem relay --once` deliver them in order, and `idem outbox drop --id …` removes one
//! for good.
//!
//! Brokers and engines are required: an unreachable one fails its cases. Build the
//! binary first: `cargo build -p idem-cli --all-features`.
#![allow(clippy::unwrap_used)]

#[path = "relay_support.rs"]
mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::consumer::PublishError;
use idem::consumer::amqp::AmqpPublisher;
use idem::consumer::async_nats::jetstream;
use idem::consumer::lapin::{self, Connection};
use idem::consumer::nats::NatsPublisher;
use idem::core::runs::OutboxRow;
use idem::core::{DbError, InvalidInput};
use idem::{Idem, Key, Operation, OutboxStore, Outgoing, Principal, Publisher, Request, Scope};
use idem_conformance::Bank;
use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use idem_conformance::sqlite::SqliteBank;
use libtest_mimic::{Arguments, Trial};
use serde_json::{Value, json};
use support::{
    Got, Private, Res, amqp_channel, amqp_url, check, delete_queues, drain_queue, fail,
    idem_binary, nats_js, nats_url, read_stream, unique,
};
use tokio::process::Command;

/// A hang guard only: no case asserts how long anything took.
const GUARD: Duration = Duration::from_secs(300);

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

// ---------------------------------------------------------------- publishers

/// Either broker's publisher.
#[derive(Debug)]
enum AnyPublisher {
    Amqp(AmqpPublisher),
    Nats(NatsPublisher),
}

impl Publisher for AnyPublisher {
    type Error = PublishError;
    async fn publish(&self, message: &OutboxRow) -> Result<(), PublishError> {
        match self {
            Self::Amqp(p) => p.publish(message).await,
            Self::Nats(p) => p.publish(message).await,
        }
    }
}

/// The publishes a relay made, in order: (destination, message ID).
type Log = Arc<Mutex<Vec<(String, String)>>>;

/// A publisher that waits `delay` before each publish and logs each confirmed one.
#[derive(Debug)]
struct Logged {
    inner: AnyPublisher,
    delay: Duration,
    log: Log,
}

impl Publisher for Logged {
    type Error = PublishError;
    async fn publish(&self, message: &OutboxRow) -> Result<(), PublishError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.publish(message).await?;
        self.log
            .lock()
            .unwrap()
            .push((message.destination.clone(), message.message_id.clone()));
        Ok(())
    }
}

// ---------------------------------------------------------------- the place messages go

/// A case's two destinations on one broker, private to the case.
struct Place {
    broker: Broker,
    destinations: [String; 2],
    /// NATS: the stream the publisher creates for the destinations.
    stream: String,
    amqp: Option<(Connection, lapin::Channel)>,
    js: Option<jetstream::Context>,
}

impl Place {
    async fn new(broker: Broker) -> Res<Self> {
        let base = unique("ob");
        let destinations = [format!("{base}.a"), format!("{base}.b")];
        let stream = unique("OB").to_uppercase();
        let (amqp, js) = match broker {
            Broker::Amqp => (Some(amqp_channel().await?), None),
            Broker::Nats => (None, Some(nats_js().await?)),
        };
        Ok(Self {
            broker,
            destinations,
            stream,
            amqp,
            js,
        })
    }

    async fn publisher(&self) -> Res<AnyPublisher> {
        match self.broker {
            Broker::Amqp => AmqpPublisher::connect(&amqp_url())
                .await
                .map(AnyPublisher::Amqp)
                .map_err(|e| fail(e.to_string())),
            Broker::Nats => NatsPublisher::connect(&nats_url(), &self.stream)
                .await
                .map(AnyPublisher::Nats)
                .map_err(|e| fail(e.to_string())),
        }
    }

    fn cli_args(&self) -> Vec<String> {
        match self.broker {
            Broker::Amqp => vec!["--amqp".into(), amqp_url()],
            Broker::Nats => vec![
                "--nats".into(),
                nats_url(),
                "--stream".into(),
                self.stream.clone(),
            ],
        }
    }

    /// Everything that reached the destinations (RabbitMQ: taken off the queues).
    async fn received(&self) -> Res<Vec<Got>> {
        match self.broker {
            Broker::Amqp => {
                let (_, ch) = self.amqp.as_ref().unwrap();
                let mut all = Vec::new();
                for d in &self.destinations {
                    all.extend(drain_queue(ch, d).await?);
                }
                Ok(all)
            }
            Broker::Nats => read_stream(self.js.as_ref().unwrap(), &self.stream).await,
        }
    }

    async fn remove(self) {
        if let Some((conn, ch)) = self.amqp {
            delete_queues(&ch, &self.destinations).await;
            let _ = conn.close(200, "done".into()).await;
        }
        if let Some(js) = self.js {
            let _ = js.delete_stream(&self.stream).await;
        }
    }
}

// ---------------------------------------------------------------- enqueueing

#[derive(Debug, thiserror::Error)]
enum EffectError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Input(#[from] InvalidInput),
    #[error("the effect failed on purpose after enqueueing (rolled back)")]
    OnPurpose,
}

/// One message the plan enqueues: its destination index, ID and payload.
#[derive(Debug, Clone)]
struct Planned {
    dest: usize,
    id: String,
    payload: Value,
}

/// One effect: its messages and whether it fails (rolled back with its messages).
#[derive(Debug, Clone)]
struct Effect {
    messages: Vec<Planned>,
    fails: bool,
}

/// `n` effects: each enqueues one message for a random destination; every 5th one
/// message for each destination (in a random order); effects 3, 11, 19, … fail.
fn plan(n: usize) -> Vec<Effect> {
    let prefix = unique("m");
    (0..n)
        .map(|i| {
            let dests: Vec<usize> = if i % 5 == 4 {
                let first = fastrand::usize(..2);
                vec![first, 1 - first]
            } else {
                vec![fastrand::usize(..2)]
            };
            let messages = dests
                .into_iter()
                .enumerate()
                .map(|(j, dest)| Planned {
                    dest,
                    id: format!("{prefix}-{i}-{j}"),
                    payload: json!({"effect": i, "n": j, "amount": fastrand::u32(1..10_000)}),
                })
                .collect();
            Effect {
                messages,
                fails: i % 8 == 3,
            }
        })
        .collect()
}

/// What must arrive: per destination, the committed messages in enqueue order.
fn expected(effects: &[Effect]) -> [Vec<Planned>; 2] {
    let mut out: [Vec<Planned>; 2] = [Vec::new(), Vec::new()];
    for e in effects.iter().filter(|e| !e.fails) {
        for m in &e.messages {
            out[m.dest].push(m.clone());
        }
    }
    out
}

/// Runs the plan's effects one after another through `Idem::execute`.
async fn enqueue<K: Private>(bank: &K, place: &Place, effects: &[Effect]) -> Res {
    let idem = Idem::new(bank.backend().clone());
    let scope = Scope::new(
        Principal::new("outbox-test").unwrap(),
        Operation::new("enqueue", 1).unwrap(),
    );
    for (i, effect) in effects.iter().enumerate() {
        let key = Key::new(format!("effect-{i}")).unwrap();
        let request = Request::new(json!({ "effect": i }));
        let messages: Vec<Outgoing> = effect
            .messages
            .iter()
            .map(|m| Outgoing::new(&place.destinations[m.dest], &m.id, &m.payload).unwrap())
            .collect();
        let fails = effect.fails;
        let backend = bank.backend().clone();
        let result = idem
            .execute(&scope, &key, &request, move |tx| {
                let backend = backend.clone();
                let messages = messages.clone();
                Box::pin(async move {
                    for m in &messages {
                        backend.enqueue(tx, m).await?;
                    }
                    if fails {
                        return Err(EffectError::OnPurpose);
                    }
                    Ok(json!({ "enqueued": messages.len() }))
                })
            })
            .await;
        match (result, fails) {
            (Ok(_), false) => {}
            (Err(idem::Error::Effect(EffectError::OnPurpose)), true) => {}
            (other, _) => {
                return Err(fail(format!("effect {i}: unexpected outcome {other:?}")));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- checks

/// Checks that each destination got exactly its committed messages, in order, with
/// their IDs and payloads. Returns a short summary.
fn verify(want: &[Vec<Planned>; 2], place: &Place, got: &[Got], rolled_back: usize) -> Res<String> {
    let mut per: BTreeMap<&str, Vec<&Got>> = BTreeMap::new();
    for g in got {
        per.entry(g.destination.as_str()).or_default().push(g);
    }
    let mut unknown: Vec<&str> = per
        .keys()
        .copied()
        .filter(|d| !place.destinations.iter().any(|p| p == d))
        .collect();
    unknown.sort_unstable();
    check(unknown.is_empty(), || {
        format!("messages reached other destinations: {unknown:?}")
    })?;
    for (d, name) in place.destinations.iter().enumerate() {
        let arrived = per.get(name.as_str()).cloned().unwrap_or_default();
        let ids: Vec<Option<&str>> = arrived.iter().map(|g| g.message_id.as_deref()).collect();
        let wanted: Vec<Option<&str>> = want[d].iter().map(|m| Some(m.id.as_str())).collect();
        check(ids == wanted, || {
            format!(
                "{name}: received {} messages {ids:?}, expected {} in enqueue order {wanted:?}",
                ids.len(),
                wanted.len()
            )
        })?;
        for (g, m) in arrived.iter().zip(&want[d]) {
            let body: Value = serde_json::from_str(&g.payload)
                .map_err(|e| fail(format!("{name}: payload {:?} is not JSON: {e}", g.payload)))?;
            check(body == m.payload, || {
                format!(
                    "{name}: message {} carried {body}, expected {}",
                    m.id, m.payload
                )
            })?;
        }
    }
    Ok(format!(
        "{} + {} messages arrived exactly once, in enqueue order, with IDs and payloads; {rolled_back} rolled-back effects' messages never published",
        want[0].len(),
        want[1].len()
    ))
}

/// Checks the publisher's log like [`verify`] (the publishes themselves, before any
/// broker-side deduplication).
fn verify_log(want: &[Vec<Planned>; 2], place: &Place, log: &Log) -> Res {
    let log = log.lock().unwrap().clone();
    for (d, name) in place.destinations.iter().enumerate() {
        let ids: Vec<&str> = log
            .iter()
            .filter(|(dest, _)| dest == name)
            .map(|(_, id)| id.as_str())
            .collect();
        let wanted: Vec<&str> = want[d].iter().map(|m| m.id.as_str()).collect();
        check(ids == wanted, || {
            format!("{name}: the relays published {ids:?}, expected once each in order {wanted:?}")
        })?;
    }
    let total: usize = want.iter().map(Vec::len).sum();
    check(log.len() == total, || {
        format!("{} publishes for {total} messages", log.len())
    })
}

fn rolled_back(effects: &[Effect]) -> usize {
    effects.iter().filter(|e| e.fails).count()
}

// ---------------------------------------------------------------- cases

struct Ctx<K> {
    bank: K,
    url: String,
    place: Place,
}

async fn with_ctx<K: Private>(
    broker: Broker,
    tag: &str,
    body: impl AsyncFnOnce(&Ctx<K>) -> Res<String>,
) -> Res<String> {
    let (bank, url) = K::private(tag).await?;
    let ready = async {
        bank.setup().await.map_err(|e| fail(e.to_string()))?;
        Place::new(broker).await
    }
    .await;
    let place = match ready {
        Ok(p) => p,
        Err(e) => {
            let _ = bank.close().await;
            return Err(e);
        }
    };
    let ctx = Ctx { bank, url, place };
    let result = tokio::time::timeout(GUARD, body(&ctx))
        .await
        .unwrap_or_else(|_| Err(fail("the case hung (hang guard)")));
    ctx.place.remove().await;
    let closed = ctx.bank.close().await;
    let text = result?;
    closed.map_err(|e| fail(format!("cleanup: {e}")))?;
    Ok(text)
}

/// Relays with `publisher` until a pass publishes nothing; returns the passes' total.
async fn drain<B: OutboxStore, P: Publisher>(
    idem: &Idem<B>,
    publisher: &P,
    batch: u32,
) -> Res<u64> {
    let mut total = 0;
    loop {
        let report = idem
            .relay(publisher, batch)
            .await
            .map_err(|e| fail(format!("relay: {e}")))?;
        total += report.published;
        if report.published == 0 {
            return Ok(total);
        }
    }
}

async fn relay_library<K: Private>(ctx: &Ctx<K>) -> Res<String> {
    let effects = plan(40);
    enqueue(&ctx.bank, &ctx.place, &effects).await?;
    let want = expected(&effects);
    let log = Log::default();
    let publisher = Logged {
        inner: ctx.place.publisher().await?,
        delay: Duration::ZERO,
        log: Arc::clone(&log),
    };
    let idem = Idem::new(ctx.bank.backend().clone());
    let published = drain(&idem, &publisher, 7).await?;
    let total = want[0].len() + want[1].len();
    check(published == total as u64, || {
        format!("the relay published {published} of {total}")
    })?;
    let again = drain(&idem, &publisher, 7).await?;
    check(again == 0, || {
        format!("a second relay published {again} again")
    })?;
    verify_log(&want, &ctx.place, &log)?;
    let got = ctx.place.received().await?;
    let text = verify(&want, &ctx.place, &got, rolled_back(&effects))?;
    Ok(format!("relay passes of 7 published {published}; {text}"))
}

async fn run_relay_cli(url: &str, args: &[String]) -> Res<(Option<i32>, String, String)> {
    let out = Command::new(idem_binary()?)
        .arg("--url")
        .arg(url)
        .arg("relay")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(GUARD, out)
        .await
        .map_err(|_| fail("idem relay hung (hang guard)"))?
        .map_err(|e| fail(format!("cannot run idem: {e}")))?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

async fn relay_cli<K: Private>(ctx: &Ctx<K>) -> Res<String> {
    let effects = plan(40);
    enqueue(&ctx.bank, &ctx.place, &effects).await?;
    let want = expected(&effects);
    let total = want[0].len() + want[1].len();
    let mut args = ctx.place.cli_args();
    args.extend(["--once".into(), "--batch".into(), "5".into()]);
    let (code, stdout, stderr) = run_relay_cli(&ctx.url, &args).await?;
    check(code == Some(0), || {
        format!("idem relay --once exited {code:?}: {stderr}")
    })?;
    check(stdout.trim() == format!("published {total}"), || {
        format!("idem relay printed {stdout:?}, expected \"published {total}\" ({stderr})")
    })?;
    let (code, stdout, stderr) = run_relay_cli(&ctx.url, &args).await?;
    check(code == Some(0) && stdout.trim() == "published 0", || {
        format!("a second idem relay --once exited {code:?} printing {stdout:?}: {stderr}")
    })?;
    let got = ctx.place.received().await?;
    let text = verify(&want, &ctx.place, &got, rolled_back(&effects))?;
    Ok(format!(
        "`idem relay --once --batch 5` printed \"published {total}\", a second run \"published 0\"; {text}"
    ))
}

/// What one of the concurrent relays did.
#[derive(Debug, Default, Clone, Copy)]
struct RelayRun {
    published: u64,
    deferred: u64,
    passes: u64,
}

async fn relay_until_idle<B: OutboxStore, P: Publisher>(
    idem: Idem<B>,
    publisher: P,
    batch: u32,
) -> Result<RelayRun, String> {
    let mut run = RelayRun::default();
    let mut idle = 0;
    while idle < 3 {
        let report = idem
            .relay(&publisher, batch)
            .await
            .map_err(|e| format!("relay: {e}"))?;
        run.passes += 1;
        run.published += report.published;
        run.deferred += report.deferred;
        if report.published == 0 && report.deferred == 0 {
            idle += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        } else {
            idle = 0;
            // A moment between passes, as a relay with other work has: on SQLite (one
            // writer) the other relay would otherwise rarely win the write lock.
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=5))).await;
        }
    }
    Ok(run)
}

async fn concurrent_relays<K: Private>(ctx: &Ctx<K>) -> Res<String> {
    let effects = plan(120);
    enqueue(&ctx.bank, &ctx.place, &effects).await?;
    let want = expected(&effects);
    let total = want[0].len() + want[1].len();
    let log = Log::default();
    let slow = |inner| Logged {
        inner,
        delay: Duration::from_millis(3),
        log: Arc::clone(&log),
    };
    let a = slow(ctx.place.publisher().await?);
    let b = slow(ctx.place.publisher().await?);
    let ta = tokio::spawn(relay_until_idle(
        Idem::new(ctx.bank.backend().clone()),
        a,
        4,
    ));
    let tb = tokio::spawn(relay_until_idle(
        Idem::new(ctx.bank.backend().clone()),
        b,
        4,
    ));
    let ra = ta.await.map_err(|e| fail(e.to_string()))?.map_err(fail)?;
    let rb = tb.await.map_err(|e| fail(e.to_string()))?.map_err(fail)?;
    check(ra.published + rb.published == total as u64, || {
        format!(
            "the relays published {} + {} of {total}",
            ra.published, rb.published
        )
    })?;
    let idem = Idem::new(ctx.bank.backend().clone());
    let again = drain(&idem, &ctx.place.publisher().await?, 50).await?;
    check(again == 0, || format!("{again} messages were left unsent"))?;
    verify_log(&want, &ctx.place, &log)?;
    let got = ctx.place.received().await?;
    let text = verify(&want, &ctx.place, &got, rolled_back(&effects))?;
    Ok(format!(
        "two relays, batches of 4, 3 ms per publish: A published {} in {} passes ({} deferred), B published {} in {} passes ({} deferred); each message published once; {text}",
        ra.published, ra.passes, ra.deferred, rb.published, rb.passes, rb.deferred
    ))
}

async fn unreachable_broker(broker: Broker) -> Res<String> {
    let (bank, url) = SqliteBank::private("unreachable").await?;
    let result = async {
        bank.setup().await.map_err(|e| fail(e.to_string()))?;
        let args: Vec<String> = match broker {
            Broker::Amqp => vec!["--amqp".into(), "amqp://guest:guest@127.0.0.1:1/%2f".into()],
            Broker::Nats => vec!["--nats".into(), "nats://127.0.0.1:1".into()],
        };
        let mut args = args;
        args.push("--once".into());
        let (code, stdout, stderr) = run_relay_cli(&url, &args).await?;
        check(code == Some(7), || {
            format!("idem relay to a closed port exited {code:?} (expected 7): {stdout} {stderr}")
        })?;
        check(stderr.contains("cannot connect"), || {
            format!("unclear error: {stderr}")
        })?;
        check(!stderr.contains("guest:guest"), || {
            format!("the password was printed: {stderr}")
        })?;
        Ok(format!("exit 7: {}", stderr.trim()))
    }
    .await;
    let _ = bank.close().await;
    result
}

// ---------------------------------------------------------------- retries and dead letters

async fn run_cli(url: &str, args: &[String]) -> Res<(Option<i32>, String, String)> {
    let out = Command::new(idem_binary()?)
        .arg("--url")
        .arg(url)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(GUARD, out)
        .await
        .map_err(|_| fail("idem hung (hang guard)"))?
        .map_err(|e| fail(format!("cannot run idem: {e}")))?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

async fn retries_dead_and_operators<K: Private>(ctx: &Ctx<K>) -> Res<String> {
    use idem::consumer::lapin::ExchangeKind;
    use idem::consumer::lapin::options::{
        ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    };
    use idem::consumer::lapin::types::FieldTable;

    let (_, ch) = ctx
        .place
        .amqp
        .as_ref()
        .ok_or_else(|| fail("no AMQP channel"))?;
    let [routed, unrouted] = ctx.place.destinations.clone();
    let exchange = unique("ox");
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(|e| fail(format!("declare exchange: {e}")))?;
    let declare_and_bind = |queue: String| {
        let (ch, exchange) = (ch.clone(), exchange.clone());
        async move {
            ch.queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| fail(format!("declare {queue}: {e}")))?;
            ch.queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| fail(format!("bind {queue}: {e}")))?;
            Res::Ok(())
        }
    };
    let result = async {
        declare_and_bind(routed.clone()).await?;
        // Enqueue r1, u1, u2, r2 in this order (one effect each).
        let ids = [(0, "r1"), (1, "u1"), (1, "u2"), (0, "r2")];
        let prefix = unique("dl");
        let effects: Vec<Effect> = ids
            .iter()
            .map(|(dest, id)| Effect {
                messages: vec![Planned {
                    dest: *dest,
                    id: format!("{prefix}-{id}"),
                    payload: json!({ "id": id }),
                }],
                fails: false,
            })
            .collect();
        enqueue(&ctx.bank, &ctx.place, &effects).await?;
        let id = |n: usize| effects[n].messages[0].id.clone();

        // The library relay, 2 attempts each: the unroutable ones die, the routed go on.
        let publisher = AmqpPublisher::connect(&amqp_url())
            .await
            .map_err(|e| fail(e.to_string()))?
            .to_exchange(&exchange)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let idem = Idem::new(ctx.bank.backend().clone());
        let options = idem::core::RelayOptions {
            max_attempts: 2,
            base_delay: Duration::from_millis(50),
            max_delay: Duration::from_millis(100),
            ..idem::core::RelayOptions::default()
        };
        let (mut failed, mut dead) = (0, 0);
        let began = std::time::Instant::now();
        while dead < 2 {
            check(began.elapsed() < GUARD, || {
                "the unroutable messages never died".into()
            })?;
            let report = idem
                .relay_with(&publisher, &options)
                .await
                .map_err(|e| fail(format!("relay: {e}")))?;
            failed += report.failed.len();
            dead += report.dead;
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
        let _ = publisher.close().await;
        check(failed == 4, || {
            format!("{failed} failed attempts, expected 2 × 2")
        })?;
        let got = drain_queue(ch, &routed).await?;
        let got_ids: Vec<Option<String>> = got.iter().map(|g| g.message_id.clone()).collect();
        check(got_ids == vec![Some(id(0)), Some(id(3))], || {
            format!("the routed destination got {got_ids:?}")
        })?;

        // The operator sees them, binds the queue, retries and relays.
        let (code, stdout, stderr) =
            run_cli(&ctx.url, &strings(&["outbox", "list", "--dead"])).await?;
        check(code == Some(0), || {
            format!("outbox list exited {code:?}: {stderr}")
        })?;
        check(
            stdout.starts_with("pending 0, dead 2")
                && stdout.contains(&id(1))
                && stdout.contains(&id(2))
                && stdout.contains("attempts 2\tdead"),
            || format!("outbox list --dead printed {stdout:?}"),
        )?;
        declare_and_bind(unrouted.clone()).await?;
        let (code, stdout, stderr) = run_cli(
            &ctx.url,
            &strings(&["outbox", "retry", "--dead", "--destination", &unrouted]),
        )
        .await?;
        check(code == Some(0) && stdout.trim() == "retried 2", || {
            format!("outbox retry exited {code:?} printing {stdout:?}: {stderr}")
        })?;
        let (code, stdout, stderr) = run_cli(
            &ctx.url,
            &strings(&[
                "relay",
                "--amqp",
                &amqp_url(),
                "--exchange",
                &exchange,
                "--once",
            ]),
        )
        .await?;
        check(code == Some(0) && stdout.trim() == "published 2", || {
            format!("idem relay --once exited {code:?} printing {stdout:?}: {stderr}")
        })?;
        let got = drain_queue(ch, &unrouted).await?;
        let got_ids: Vec<Option<String>> = got.iter().map(|g| g.message_id.clone()).collect();
        check(got_ids == vec![Some(id(1)), Some(id(2))], || {
            format!("after the retry, the other destination got {got_ids:?}, expected in order")
        })?;

        // Drop: a message for a third, unbound destination dies and is dropped by id.
        let lost = format!("{prefix}-nowhere");
        let message = Outgoing::new(&format!("{routed}.nowhere"), &lost, &json!({}))
            .map_err(|e| fail(e.to_string()))?;
        let backend = ctx.bank.backend().clone();
        idem.execute(
            &Scope::new(
                Principal::new("outbox-test").map_err(|e| fail(e.to_string()))?,
                Operation::new("enqueue", 1).map_err(|e| fail(e.to_string()))?,
            ),
            &Key::new(format!("drop-{prefix}")).map_err(|e| fail(e.to_string()))?,
            &Request::new(json!({ "drop": true })),
            move |tx| {
                let (backend, message) = (backend.clone(), message.clone());
                Box::pin(async move {
                    backend.enqueue(tx, &message).await?;
                    Ok::<_, EffectError>(json!({}))
                })
            },
        )
        .await
        .map_err(|e| fail(format!("enqueue: {e}")))?;
        let publisher = AmqpPublisher::connect(&amqp_url())
            .await
            .map_err(|e| fail(e.to_string()))?
            .to_exchange(&exchange)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let once = idem::core::RelayOptions {
            max_attempts: 1,
            ..options
        };
        let report = idem
            .relay_with(&publisher, &once)
            .await
            .map_err(|e| fail(format!("relay: {e}")))?;
        let _ = publisher.close().await;
        check(report.dead == 1, || {
            format!("the third message: {report:?}")
        })?;
        let listed = idem
            .outbox_list(&idem::core::runs::OutboxFilter::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        check(listed.len() == 1 && listed[0].message_id == lost, || {
            format!("unsent before the drop: {listed:?}")
        })?;
        let (code, stdout, stderr) = run_cli(
            &ctx.url,
            &strings(&["outbox", "drop", "--id", &listed[0].id.to_string()]),
        )
        .await?;
        check(code == Some(0) && stdout.trim() == "dropped 1", || {
            format!("outbox drop exited {code:?} printing {stdout:?}: {stderr}")
        })?;
        let (code, stdout, _) = run_cli(&ctx.url, &strings(&["outbox", "list"])).await?;
        check(
            code == Some(0) && stdout.trim() == "pending 0, dead 0",
            || format!("after the drop, outbox list printed {stdout:?}"),
        )?;
        Ok(format!(
            "2 unroutable messages: {failed} failed attempts, dead after 2 each, the routed \
             destination went on in order; listed, retried and relayed in order by the CLI; \
             a third dead message dropped"
        ))
    }
    .await;
    let _ = ch
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await;
    result
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

macro_rules! case {
    ($trials:ident, $broker:expr, $K:ty, $name:ident) => {{
        let broker = $broker;
        let name = format!(
            "{}::{}::{}",
            broker.name(),
            <$K as Private>::NAME,
            stringify!($name)
        );
        $trials.push(Trial::test(name.clone(), move || {
            let text = block_on(with_ctx::<$K>(broker, stringify!($name), async |ctx| {
                $name::<$K>(ctx).await
            }))?;
            println!("[{name}] {text}");
            Ok(())
        }));
    }};
}

fn engine_cases<K: Private>(trials: &mut Vec<Trial>, broker: Broker) {
    case!(trials, broker, K, relay_library);
    case!(trials, broker, K, relay_cli);
    case!(trials, broker, K, concurrent_relays);
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    case!(trials, Broker::Amqp, SqliteBank, retries_dead_and_operators);
    case!(trials, Broker::Amqp, PgBank, retries_dead_and_operators);
    case!(trials, Broker::Amqp, MysqlBank, retries_dead_and_operators);
    for broker in [Broker::Amqp, Broker::Nats] {
        engine_cases::<SqliteBank>(&mut trials, broker);
        engine_cases::<PgBank>(&mut trials, broker);
        engine_cases::<MysqlBank>(&mut trials, broker);
        let name = format!("{}::unreachable_broker", broker.name());
        trials.push(Trial::test(name.clone(), move || {
            let text = block_on(unreachable_broker(broker))?;
            println!("[{name}] {text}");
            Ok(())
        }));
    }
    libtest_mimic::run(&args, trials).exit_code()
}
