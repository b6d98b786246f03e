//! Broker faults with real servers: the idempotent consumers (`idem::consumer`) and the
//! outbox relay against RabbitMQ and NATS JetStream that lose dead-letter destinations,
//! restart, stop answering, or never speak at all.
//!
//! On the shared brokers (127.0.0.1:5672, 127.0.0.1:4222; private queues and streams),
//! per engine (SQLite, PostgreSQL, MariaDB):
//!
//! - `amqp::<engine>::dead_letter_queue_deleted`: the dead-letter queue is deleted while
//!   poison messages are being dead-lettered, and declared again later (issue 17.3);
//! - `nats::<engine>::dead_letter_stream_deleted`: the same with the dead-letter stream;
//! - `nats::<engine>::dead_letter_captured_by_source`: the dead-letter subject is captured
//!   by the consumed work-queue stream itself (`<stream>.>`; issue 17.2);
//! - `nats::sqlite::dead_letter_delivered_back_is_refused`: a consumer that would receive
//!   its own dead letters does not start.
//! - `amqp::queue_deleted_in_flight` (no database): a queue deleted and declared again
//!   over and over under publishes; RabbitMQ confirms what it drops with a deleted
//!   queue, and neither `publish_confirmed` (dead letters) nor `AmqpPublisher` (the
//!   relay) counts such a publish as stored.
//! - `amqp::consumed_queue_deleted` (SQLite): the queue idem's consumer reads is deleted
//!   and at once declared again, round after round; each deletion cancels the consumer
//!   (`x-cancel-on-ha-failover`), which is started again, and every credit is applied once.
//!
//! On private instances (ports 5682–5689 and 4232–4239, see `private.rs`), all three
//! engines at once or one after another:
//!
//! - `<broker>::restarted_mid_stream`: the broker is stopped and started again in the
//!   middle of a stream; consumers (one per engine) reconnect, and `idem relay` processes
//!   (one per engine) publish their outboxes through it, reconnecting;
//! - `<broker>::never_confirms`: the broker is paused (SIGSTOP) while a consumer waits
//!   for a dead letter's confirmation, and while the relay waits for a publish's; both
//!   time out and nothing counts as done; then it is resumed;
//! - `<broker>::silent_listener`: a TCP listener that accepts and never speaks; the
//!   consumer loops and the publishers give up within their timeout;
//! - `amqp::channel_closed_under_handler`: RabbitMQ's acknowledgement timeout closes the
//!   consumer's channel (the connection stays up) while a handler applies a message; the
//!   loop reconnects and the redelivery is answered as a duplicate;
//! - `<broker>::gone_for_good`: the broker stops under a consumer and never returns; the
//!   loop stops with a broker failure once its reconnection period is over.
//!
//! Invariants, read from the database and the broker after every consumer stopped: the
//! balance moved by exactly the good messages' sum and there is one record per good
//! message (nothing lost, nothing applied twice); every poison message is in the
//! dead-letter destination with its reason (copies counted: at least once); nothing is
//! left unacknowledged; every outbox message is marked sent and reached the broker at
//! least once (copies counted), and none was marked sent while the broker did not
//! confirm it. No case asserts how long anything took; every wait has a hang guard.
//!
//! Build the `idem` binary first (`cargo build -p idem-cli`): the relays run as
//! processes.
#![allow(clippy::unwrap_used)]

#[path = "../relay_support.rs"]
mod support;

mod private;

use std::collections::BTreeMap;
use std::future::Future;
use std::marker::PhantomData;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::consumer::amqp::{AmqpConfig, AmqpPublisher};
use idem::consumer::async_nats::jetstream::{self, stream};
use idem::consumer::async_nats::{self, HeaderMap};
use idem::consumer::lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idem::consumer::lapin::types::{AMQPValue, FieldTable};
use idem::consumer::lapin::{self, BasicProperties, Connection, ConnectionProperties};
use idem::consumer::nats::{MSG_ID_HEADER, NatsConfig, NatsPublisher};
use idem::consumer::{
    Backoff, CancellationToken, Consumer, ConsumerError, Decision, Event, Handler,
    ORIGINAL_ID_HEADER, Options, PublishError, REASON_HEADER, Stats,
};
use idem::core::runs::OutboxRow;
use idem::{
    BoxFuture, Idem, Key, Operation, OutboxStore, Outgoing, Principal, Publisher, RelayOptions,
    Request, Scope, Subscriber,
};
use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use idem_conformance::sqlite::SqliteBank;
use idem_conformance::{Balance, Bank, BankError};
use libtest_mimic::{Arguments, Trial};
use private::{PrivateBroker, signal};
use serde_json::{Value, json};
use support::{Private, Res, amqp_url, check, fail, idem_binary, nats_url, unique};
use tokio::process::{Child, Command};

const START: i64 = 1_000_000;
/// The subscriber of every consumer here.
const SUB: &str = "broker-faults";
/// An account that does not exist: its credits are refused for good (`effect-rejected`).
const UNKNOWN_ACCOUNT: i64 = 999;
/// Another unknown account: its first decode pauses the broker (see [`Trap`]).
const TRAP_ACCOUNT: i64 = 777;
/// Hang guards only.
const GUARD: Duration = Duration::from_secs(120);
/// Short broker timeouts, so a silent broker is detected quickly.
const BROKER_TIMEOUT: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------- engines

/// What the cases read from a private database.
trait Engine: Private {
    /// Processed-message records of [`SUB`].
    fn records(&self) -> impl Future<Output = Res<u64>> + Send;
    /// Outbox messages not marked sent.
    fn unsent(&self) -> impl Future<Output = Res<u64>> + Send;
}

fn db(e: impl std::fmt::Display) -> libtest_mimic::Failed {
    fail(e.to_string())
}

impl Engine for PgBank {
    async fn records(&self) -> Res<u64> {
        use idem::postgres::sqlx;
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_processed_message WHERE subscriber = $1")
                .bind(SUB)
                .fetch_one(self.backend().pool())
                .await
                .map_err(db)?;
        Ok(u64::try_from(n).unwrap())
    }

    async fn unsent(&self) -> Res<u64> {
        use idem::postgres::sqlx;
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL")
            .fetch_one(self.backend().pool())
            .await
            .map_err(db)?;
        Ok(u64::try_from(n).unwrap())
    }
}

impl Engine for MysqlBank {
    async fn records(&self) -> Res<u64> {
        use idem::mysql::mysql_async::prelude::Queryable;
        let mut conn = self.backend().pool().get_conn().await.map_err(db)?;
        let n: Option<u64> = conn
            .exec_first(
                "SELECT count(*) FROM idem_processed_message WHERE subscriber = ?",
                (SUB.as_bytes(),),
            )
            .await
            .map_err(db)?;
        Ok(n.unwrap_or(0))
    }

    async fn unsent(&self) -> Res<u64> {
        use idem::mysql::mysql_async::prelude::Queryable;
        let mut conn = self.backend().pool().get_conn().await.map_err(db)?;
        let n: Option<u64> = conn
            .query_first("SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL")
            .await
            .map_err(db)?;
        Ok(n.unwrap_or(0))
    }
}

impl Engine for SqliteBank {
    async fn records(&self) -> Res<u64> {
        let n: i64 = self
            .backend()
            .interact(|c| {
                c.query_row(
                    "SELECT count(*) FROM idem_processed_message WHERE subscriber = ?1",
                    [SUB],
                    |r| r.get(0),
                )
            })
            .await
            .map_err(db)?;
        Ok(u64::try_from(n).unwrap())
    }

    async fn unsent(&self) -> Res<u64> {
        let n: i64 = self
            .backend()
            .interact(|c| {
                c.query_row(
                    "SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL",
                    [],
                    |r| r.get(0),
                )
            })
            .await
            .map_err(db)?;
        Ok(u64::try_from(n).unwrap())
    }
}

async fn balance<K: Engine>(bank: &K) -> Res<i64> {
    bank.balance(1).await.map_err(db)
}

// ---------------------------------------------------------------- messages

/// What a case publishes: good credits of account 1, and poison messages.
#[derive(Debug, Clone)]
struct Plan {
    /// Good messages: ID → amount.
    good: BTreeMap<String, i64>,
    /// Poison messages: ID (none: no ID at all), body, the reason they must carry.
    poison: Vec<(Option<String>, String, &'static str)>,
}

impl Plan {
    /// `good` credits, `rejected` credits of an unknown account (`effect-rejected`),
    /// `malformed` negative amounts (`malformed-body`), `no_id` credits without an ID
    /// (`missing-message-id`), `trapped` credits of [`TRAP_ACCOUNT`] (`effect-rejected`).
    fn new(good: usize, rejected: usize, malformed: usize, no_id: usize, trapped: usize) -> Self {
        let tag = unique("m");
        let good = (0..good)
            .map(|i| (format!("{tag}-good-{i}"), fastrand::i64(1..=100)))
            .collect();
        let mut poison = Vec::new();
        for i in 0..rejected {
            poison.push((
                Some(format!("{tag}-rejected-{i}")),
                body(UNKNOWN_ACCOUNT, 10),
                "effect-rejected",
            ));
        }
        for i in 0..malformed {
            poison.push((
                Some(format!("{tag}-malformed-{i}")),
                body(1, -5),
                "malformed-body",
            ));
        }
        for _ in 0..no_id {
            poison.push((None, body(1, 10), "missing-message-id"));
        }
        for i in 0..trapped {
            poison.push((
                Some(format!("{tag}-trapped-{i}")),
                body(TRAP_ACCOUNT, 10),
                "effect-rejected",
            ));
        }
        Self { good, poison }
    }

    /// Every message, shuffled: (ID, body).
    fn messages(&self) -> Vec<(Option<String>, String)> {
        let mut all: Vec<(Option<String>, String)> = self
            .good
            .iter()
            .map(|(id, amount)| (Some(id.clone()), body(1, *amount)))
            .chain(self.poison.iter().map(|(id, b, _)| (id.clone(), b.clone())))
            .collect();
        fastrand::shuffle(&mut all);
        all
    }

    fn sum(&self) -> i64 {
        self.good.values().sum()
    }
}

fn body(account: i64, amount: i64) -> String {
    json!({ "account": account, "amount": amount }).to_string()
}

// ---------------------------------------------------------------- the handler

/// Every decision the loops carried out: (message ID, what).
#[derive(Debug, Default)]
struct Log(Mutex<Vec<(Option<String>, String)>>);

impl Log {
    fn count(&self, pred: impl Fn(&Option<String>, &str) -> bool) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(id, what)| pred(id, what))
            .count()
    }
}

/// Pauses a broker (SIGSTOP) at the first decode of a [`TRAP_ACCOUNT`] credit, so the
/// dead letter that follows is published to a broker that does not answer.
#[derive(Debug)]
struct Trap {
    pid: u32,
    sprung: AtomicBool,
}

/// Credits `{"account": N, "amount": N}` through the engine's credit effect (an unknown
/// account is refused for good), optionally pacing each effect.
struct Credit<K> {
    log: Arc<Log>,
    pace: Duration,
    trap: Option<Arc<Trap>>,
    bank: PhantomData<fn() -> K>,
}

impl<K> Credit<K> {
    fn new(log: Arc<Log>, pace: Duration, trap: Option<Arc<Trap>>) -> Self {
        Self {
            log,
            pace,
            trap,
            bank: PhantomData,
        }
    }
}

impl<K: Bank> Handler<K::B> for Credit<K> {
    type Message = (i64, i64);
    type Response = Balance;
    type Error = BankError;

    fn decode(&self, body: &[u8]) -> Result<((i64, i64), Request), String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let (Some(account), Some(amount)) = (v["account"].as_i64(), v["amount"].as_i64()) else {
            return Err("not {\"account\": N, \"amount\": N}".into());
        };
        if amount <= 0 {
            return Err(format!("amount {amount} is not positive"));
        }
        if account == TRAP_ACCOUNT
            && let Some(trap) = &self.trap
            && !trap.sprung.swap(true, Ordering::SeqCst)
        {
            signal(Some(trap.pid), "STOP").map_err(|e| format!("{e:?}"))?;
        }
        Ok(((account, amount), Request::new(v)))
    }

    fn apply<'t>(
        &self,
        tx: &'t mut <K::B as idem::Backend>::Tx,
        (account, amount): (i64, i64),
    ) -> BoxFuture<'t, Result<Balance, BankError>> {
        let pace = self.pace;
        Box::pin(async move {
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
            K::credit(tx, account, amount).await
        })
    }

    fn observe(&self, event: &Event<'_>) {
        let what = match event.decision {
            Decision::Applied => "applied".to_owned(),
            Decision::Duplicate => "duplicate".to_owned(),
            Decision::DeadLetter { reason, .. } => format!("dead-letter:{reason}"),
            Decision::Redeliver { detail } => format!("redeliver:{detail}"),
            _ => "other".to_owned(),
        };
        self.log
            .0
            .lock()
            .unwrap()
            .push((event.message_id.map(str::to_owned), what));
    }
}

/// The options of the consumers under fault: short timeouts and pauses.
fn options() -> Options {
    Options::default()
        .prefetch(10)
        .broker_timeout(BROKER_TIMEOUT)
        .reconnect_for(GUARD)
        .backoff(Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_secs(1),
        })
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
            Self::Amqp => "amqp",
            Self::Nats => "nats",
        }
    }
}

/// How a NATS case lays out its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// RabbitMQ: a queue and its dead-letter queue `<queue>.dead-letter`.
    Queue,
    /// NATS: stream `S` on `S.in`, dead letters on `S.dead-letter` in stream `S_DL`.
    Separate,
    /// NATS: one work-queue stream `S` on `S.>`, so it captures its own dead-letter
    /// subject `S.dead-letter`; the consumer's filter is `S.in`.
    Captured,
}

/// Where a case's messages and dead letters live, on one broker (shared or private).
/// Every operation opens a connection of its own: a private broker may have restarted.
#[derive(Debug, Clone)]
struct Topic {
    broker: Broker,
    url: String,
    layout: Layout,
    /// The queue (RabbitMQ) or stream (NATS).
    name: String,
}

/// One dead letter as stored: its original message ID, its reason, and its own ID.
#[derive(Debug, Clone)]
struct DeadLetter {
    original: Option<String>,
    reason: String,
}

async fn amqp_connect(url: &str) -> Res<(Connection, lapin::Channel)> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| {
            fail(format!(
                "RabbitMQ at {}: {e}",
                idem::consumer::amqp::redact(url)
            ))
        })?;
    let ch = conn.create_channel().await.map_err(db)?;
    Ok((conn, ch))
}

async fn nats_connect(url: &str, timeout: Duration) -> Res<jetstream::Context> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| fail(format!("NATS at {url}: {e}")))?;
    let mut js = jetstream::new(client);
    js.set_timeout(timeout);
    Ok(js)
}

fn header_text(headers: &Option<FieldTable>, name: &str) -> Option<String> {
    headers
        .as_ref()
        .and_then(|h| h.inner().get(name).cloned())
        .and_then(|v| match v {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            _ => None,
        })
}

impl Topic {
    async fn create(broker: Broker, url: &str, layout: Layout, tag: &str) -> Res<Self> {
        let topic = Self {
            broker,
            url: url.to_owned(),
            layout,
            name: unique(tag).to_uppercase(),
        };
        match broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(url).await?;
                for q in [topic.name.clone(), topic.dead_letter()] {
                    ch.queue_declare(
                        q.as_str().into(),
                        QueueDeclareOptions::durable(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(db)?;
                }
                let _ = conn.close(200, "created".into()).await;
            }
            Broker::Nats => {
                let js = nats_connect(url, GUARD).await?;
                match layout {
                    Layout::Captured => {
                        js.create_stream(stream::Config {
                            name: topic.name.clone(),
                            subjects: vec![format!("{}.>", topic.name)],
                            retention: stream::RetentionPolicy::WorkQueue,
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| fail(format!("create stream: {e}")))?;
                    }
                    _ => {
                        js.create_stream(stream::Config {
                            name: topic.name.clone(),
                            subjects: vec![topic.subject_in()],
                            ..Default::default()
                        })
                        .await
                        .map_err(|e| fail(format!("create stream: {e}")))?;
                        topic.create_dead_letter_stream(&js).await?;
                    }
                }
            }
        }
        Ok(topic)
    }

    fn subject_in(&self) -> String {
        format!("{}.in", self.name)
    }

    /// The dead-letter queue or subject (the consumers' default).
    fn dead_letter(&self) -> String {
        format!("{}.dead-letter", self.name)
    }

    /// The stream that captures the dead-letter subject.
    fn dead_letter_stream(&self) -> String {
        match self.layout {
            Layout::Captured => self.name.clone(),
            _ => format!("{}_DL", self.name),
        }
    }

    async fn create_dead_letter_stream(&self, js: &jetstream::Context) -> Res {
        js.create_stream(stream::Config {
            name: self.dead_letter_stream(),
            subjects: vec![self.dead_letter()],
            // A redelivered message dead-lettered again inside this window is
            // recognised as the same dead letter.
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| fail(format!("create dead-letter stream: {e}")))?;
        Ok(())
    }

    fn consumer_name(&self) -> &'static str {
        "faults"
    }

    /// A consumer of this topic with `handler`, running until `token` is cancelled.
    fn spawn<K: Engine>(
        &self,
        backend: K::B,
        handler: Credit<K>,
        options: Options,
        token: CancellationToken,
    ) -> tokio::task::JoinHandle<Result<Stats, ConsumerError>> {
        let consumer = Consumer::new(Idem::new(backend), Subscriber::new(SUB).unwrap(), handler)
            .with_options(options);
        match self.broker {
            Broker::Amqp => {
                let config = AmqpConfig::new(self.url.as_str(), self.name.as_str());
                tokio::spawn(
                    async move { idem::consumer::amqp::run(&consumer, &config, token).await },
                )
            }
            Broker::Nats => {
                let filter = match self.layout {
                    Layout::Captured => Some(self.subject_in()),
                    _ => None,
                };
                let config =
                    NatsConfig::new(self.url.as_str(), self.name.as_str(), self.consumer_name())
                        .filter_subject(filter)
                        .ack_wait(Duration::from_secs(2));
                tokio::spawn(
                    async move { idem::consumer::nats::run(&consumer, &config, token).await },
                )
            }
        }
    }

    /// Publishes every message and waits for each confirmation.
    async fn publish(&self, messages: &[(Option<String>, String)]) -> Res {
        match self.broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(&self.url).await?;
                ch.confirm_select(ConfirmSelectOptions::default())
                    .await
                    .map_err(db)?;
                let mut confirms = Vec::new();
                for (id, body) in messages {
                    let mut props = BasicProperties::default().with_delivery_mode(2);
                    if let Some(id) = id {
                        props = props.with_message_id(id.as_str().into());
                    }
                    confirms.push(
                        ch.basic_publish(
                            "".into(),
                            self.name.as_str().into(),
                            BasicPublishOptions {
                                mandatory: true,
                                immediate: false,
                            },
                            body.as_bytes(),
                            props,
                        )
                        .await
                        .map_err(db)?,
                    );
                }
                for c in confirms {
                    let c = c.await.map_err(db)?;
                    check(c == lapin::Confirmation::Ack(None), || {
                        format!("RabbitMQ did not take a message: {c:?}")
                    })?;
                }
                let _ = conn.close(200, "published".into()).await;
            }
            Broker::Nats => {
                let js = nats_connect(&self.url, GUARD).await?;
                let mut acks = Vec::new();
                for (id, body) in messages {
                    let mut headers = HeaderMap::new();
                    if let Some(id) = id {
                        headers.insert(MSG_ID_HEADER, id.as_str());
                    }
                    acks.push(
                        js.publish_with_headers(self.subject_in(), headers, body.clone().into())
                            .await
                            .map_err(db)?,
                    );
                }
                for a in acks {
                    let a = a.await.map_err(db)?;
                    check(!a.duplicate, || {
                        "JetStream dropped a message as a duplicate".into()
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Dead letters stored so far (without taking them).
    async fn dead_letter_count(&self) -> Res<usize> {
        match self.broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(&self.url).await?;
                let q = ch
                    .queue_declare(
                        self.dead_letter().as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await;
                let _ = conn.close(200, "counted".into()).await;
                // A deleted dead-letter queue holds nothing.
                Ok(q.map(|q| q.message_count() as usize).unwrap_or(0))
            }
            Broker::Nats => Ok(self.dead_letters().await.unwrap_or_default().len()),
        }
    }

    /// The dead letters (RabbitMQ: taken off the queue).
    async fn dead_letters(&self) -> Res<Vec<DeadLetter>> {
        let mut out = Vec::new();
        match self.broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(&self.url).await?;
                let dlq = self.dead_letter();
                while let Some(m) = ch
                    .basic_get(dlq.as_str().into(), BasicGetOptions::default())
                    .await
                    .map_err(db)?
                {
                    let d = m.delivery;
                    out.push(DeadLetter {
                        original: header_text(d.properties.headers(), ORIGINAL_ID_HEADER),
                        reason: header_text(d.properties.headers(), REASON_HEADER)
                            .unwrap_or_default(),
                    });
                    d.acker.ack(BasicAckOptions::default()).await.map_err(db)?;
                }
                let _ = conn.close(200, "drained".into()).await;
            }
            Broker::Nats => {
                let js = nats_connect(&self.url, GUARD).await?;
                let mut s = js
                    .get_stream(self.dead_letter_stream())
                    .await
                    .map_err(|e| fail(format!("dead-letter stream: {e}")))?;
                let state = s.info().await.map_err(db)?.state.clone();
                if state.messages > 0 {
                    for seq in state.first_sequence..=state.last_sequence {
                        let Ok(m) = s.get_raw_message(seq).await else {
                            continue; // consumed (work queue) or deleted
                        };
                        if m.subject.as_str() != self.dead_letter() {
                            continue;
                        }
                        let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned());
                        let own = get(MSG_ID_HEADER).unwrap_or_default();
                        check(own.starts_with("idem-dead-letter:"), || {
                            format!("a dead letter with message ID {own:?}, not one of its own")
                        })?;
                        out.push(DeadLetter {
                            original: get(ORIGINAL_ID_HEADER),
                            reason: get(REASON_HEADER).unwrap_or_default(),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Deletes the dead-letter destination and returns the dead letters it held (taken
    /// first, so none is lost by the test itself): RabbitMQ: drained, then deleted only
    /// if still empty (else again); NATS: the dead-letter stream is sealed (it refuses
    /// new messages), read, then deleted.
    async fn take_and_delete_dead_letter(&self) -> Res<Vec<DeadLetter>> {
        let mut taken = Vec::new();
        match self.broker {
            Broker::Amqp => {
                for _ in 0..100 {
                    taken.extend(self.dead_letters().await?);
                    let (conn, ch) = amqp_connect(&self.url).await?;
                    let deleted = ch
                        .queue_delete(
                            self.dead_letter().as_str().into(),
                            QueueDeleteOptions {
                                if_empty: true,
                                ..Default::default()
                            },
                        )
                        .await;
                    let _ = conn.close(200, "deleted".into()).await;
                    if deleted.is_ok() {
                        return Ok(taken);
                    }
                }
                Err(fail(
                    "the dead-letter queue never stayed empty long enough to delete it",
                ))
            }
            Broker::Nats => {
                let js = nats_connect(&self.url, GUARD).await?;
                let mut s = js.get_stream(self.dead_letter_stream()).await.map_err(db)?;
                let mut config = s.info().await.map_err(db)?.config.clone();
                config.sealed = true;
                js.update_stream(&config).await.map_err(db)?;
                taken.extend(self.dead_letters().await?);
                js.delete_stream(self.dead_letter_stream())
                    .await
                    .map_err(db)?;
                Ok(taken)
            }
        }
    }

    /// Creates the dead-letter destination again.
    async fn restore_dead_letter(&self) -> Res {
        match self.broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(&self.url).await?;
                ch.queue_declare(
                    self.dead_letter().as_str().into(),
                    QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await
                .map_err(db)?;
                let _ = conn.close(200, "declared".into()).await;
            }
            Broker::Nats => {
                let js = nats_connect(&self.url, GUARD).await?;
                self.create_dead_letter_stream(&js).await?;
            }
        }
        Ok(())
    }

    /// Messages neither acknowledged nor dead-lettered (after every consumer stopped).
    async fn left(&self) -> Res<u64> {
        match self.broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(&self.url).await?;
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
                    .map_err(db)?;
                let _ = conn.close(200, "counted".into()).await;
                Ok(u64::from(q.message_count()))
            }
            Broker::Nats => {
                let js = nats_connect(&self.url, GUARD).await?;
                let stream = js.get_stream(&self.name).await.map_err(db)?;
                let info = stream
                    .consumer_info(self.consumer_name())
                    .await
                    .map_err(db)?;
                Ok(info.num_pending + info.num_ack_pending as u64)
            }
        }
    }

    async fn delete(&self) {
        match self.broker {
            Broker::Amqp => {
                if let Ok((conn, ch)) = amqp_connect(&self.url).await {
                    for q in [self.name.clone(), self.dead_letter()] {
                        let _ = ch
                            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                            .await;
                    }
                    let _ = conn.close(200, "done".into()).await;
                }
            }
            Broker::Nats => {
                if let Ok(js) = nats_connect(&self.url, Duration::from_secs(5)).await {
                    let _ = js.delete_stream(&self.name).await;
                    let _ = js.delete_stream(self.dead_letter_stream()).await;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- the outbox relay

/// A relay's run: the outbox messages an engine enqueued for one destination.
struct Outbox {
    broker: Broker,
    url: String,
    /// RabbitMQ: a queue; NATS: a subject.
    destination: String,
    /// NATS: the stream the relay adds the subject to.
    stream: String,
    ids: Arc<Mutex<Vec<String>>>,
}

impl Outbox {
    fn new(broker: Broker, url: &str, tag: &str) -> Self {
        let base = unique(tag).to_uppercase();
        Self {
            broker,
            url: url.to_owned(),
            destination: format!("{base}.out"),
            stream: format!("{base}_OUT"),
            ids: Arc::default(),
        }
    }

    /// Enqueues `n` messages, one `Idem::execute` effect each.
    async fn enqueue<K: Engine>(&self, bank: &K, n: usize) -> Res {
        enqueue(
            bank.backend().clone(),
            self.destination.clone(),
            Arc::clone(&self.ids),
            n,
            Duration::ZERO,
        )
        .await
    }

    /// The IDs enqueued so far.
    fn ids(&self) -> Vec<String> {
        self.ids.lock().unwrap().clone()
    }

    /// `idem relay` publishing this engine's outbox until SIGTERM.
    fn spawn_cli(&self, db_url: &str) -> Res<Child> {
        let mut cmd = Command::new(idem_binary()?);
        cmd.arg("--url").arg(db_url).arg("relay");
        match self.broker {
            Broker::Amqp => cmd.args(["--amqp", &self.url]),
            Broker::Nats => cmd.args(["--nats", &self.url, "--stream", &self.stream]),
        };
        cmd.args(["--batch", "5", "--interval-ms", "100"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("cannot run idem relay: {e}")))
    }

    /// A publisher of this outbox's broker with short timeouts.
    async fn publisher(&self) -> Res<AnyPublisher> {
        match self.broker {
            Broker::Amqp => AmqpPublisher::connect_within(&self.url, BROKER_TIMEOUT)
                .await
                .map(AnyPublisher::Amqp)
                .map_err(db),
            Broker::Nats => {
                let js = nats_connect(&self.url, BROKER_TIMEOUT).await?;
                NatsPublisher::new(js, &self.stream)
                    .map(AnyPublisher::Nats)
                    .map_err(db)
            }
        }
    }

    /// How many copies of each message reached the destination (RabbitMQ: taken off
    /// the queue). Fails if a message never arrived or a stranger did.
    async fn copies(&self) -> Res<BTreeMap<String, usize>> {
        let mut got: Vec<Option<String>> = Vec::new();
        match self.broker {
            Broker::Amqp => {
                let (conn, ch) = amqp_connect(&self.url).await?;
                while let Some(m) = ch
                    .basic_get(self.destination.as_str().into(), BasicGetOptions::default())
                    .await
                    .map_err(db)?
                {
                    let d = m.delivery;
                    got.push(d.properties.message_id().as_ref().map(|s| s.to_string()));
                    d.acker.ack(BasicAckOptions::default()).await.map_err(db)?;
                }
                let _ = conn.close(200, "drained".into()).await;
            }
            Broker::Nats => {
                let js = nats_connect(&self.url, GUARD).await?;
                for m in support::read_stream(&js, &self.stream).await? {
                    if m.destination == self.destination {
                        got.push(m.message_id);
                    }
                }
            }
        }
        let mut copies: BTreeMap<String, usize> = self.ids().into_iter().map(|i| (i, 0)).collect();
        for id in got {
            let id = id.unwrap_or_default();
            let n = copies.get_mut(&id).ok_or_else(|| {
                fail(format!(
                    "a message nobody enqueued reached the broker: {id:?}"
                ))
            })?;
            *n += 1;
        }
        let missing: Vec<&String> = copies
            .iter()
            .filter(|(_, n)| **n == 0)
            .map(|(id, _)| id)
            .collect();
        check(missing.is_empty(), || {
            format!(
                "{} outbox messages never reached the broker: {missing:?}",
                missing.len()
            )
        })?;
        Ok(copies)
    }

    async fn remove(&self) {
        match self.broker {
            Broker::Amqp => {
                if let Ok((conn, ch)) = amqp_connect(&self.url).await {
                    let _ = ch
                        .queue_delete(
                            self.destination.as_str().into(),
                            QueueDeleteOptions::default(),
                        )
                        .await;
                    let _ = conn.close(200, "done".into()).await;
                }
            }
            Broker::Nats => {
                if let Ok(js) = nats_connect(&self.url, Duration::from_secs(5)).await {
                    let _ = js.delete_stream(&self.stream).await;
                }
            }
        }
    }
}

/// Enqueues `n` messages for `destination`, one `Idem::execute` effect each, `pace`
/// apart (an application that goes on producing while the broker has trouble).
async fn enqueue<B: OutboxStore + Clone>(
    backend: B,
    destination: String,
    ids: Arc<Mutex<Vec<String>>>,
    n: usize,
    pace: Duration,
) -> Res {
    let idem = Idem::new(backend.clone());
    let scope = Scope::new(
        Principal::new("broker-faults").unwrap(),
        Operation::new("enqueue", 1).unwrap(),
    );
    for _ in 0..n {
        let seq = ids.lock().unwrap().len();
        let id = format!("{}-{seq}", unique("out"));
        let m = Outgoing::new(&destination, &id, &json!({ "n": seq })).map_err(db)?;
        let b = backend.clone();
        idem.execute(
            &scope,
            &Key::new(id.as_str()).unwrap(),
            &Request::new(json!({ "id": id })),
            move |tx| {
                let b = b.clone();
                let m = m.clone();
                Box::pin(async move {
                    b.enqueue(tx, &m).await?;
                    Ok::<_, idem::DbError>(json!({}))
                })
            },
        )
        .await
        .map_err(db)?;
        ids.lock().unwrap().push(id);
        if !pace.is_zero() {
            tokio::time::sleep(pace).await;
        }
    }
    Ok(())
}

/// An `idem relay` process and the producer feeding its outbox.
struct RelayRun {
    outbox: Outbox,
    child: Child,
    producer: tokio::task::JoinHandle<Res>,
}

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

// ---------------------------------------------------------------- a consumer flow

/// One engine's consumer under fault: its private database, its topic, its plan, the
/// consumer task and what it logged.
struct Flow<K: Engine> {
    bank: K,
    url: String,
    topic: Topic,
    plan: Plan,
    log: Arc<Log>,
    token: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<Stats, ConsumerError>>>,
    relay: Option<RelayRun>,
    /// Dead letters the test took off a destination before deleting it.
    taken: Vec<DeadLetter>,
}

impl<K: Engine> Flow<K> {
    /// Creates the database and the topic, publishes the plan and starts the consumer.
    async fn start(
        broker: Broker,
        broker_url: &str,
        layout: Layout,
        tag: &str,
        plan: Plan,
        pace: Duration,
        trap: Option<Arc<Trap>>,
    ) -> Res<Self> {
        let (bank, url) = K::private(tag).await?;
        let ready = async {
            bank.setup().await.map_err(db)?;
            bank.set_balance(1, START).await.map_err(db)?;
            Topic::create(broker, broker_url, layout, tag).await
        }
        .await;
        let topic = match ready {
            Ok(t) => t,
            Err(e) => {
                let _ = bank.close().await;
                return Err(e);
            }
        };
        let mut flow = Self {
            bank,
            url,
            topic,
            plan,
            log: Arc::default(),
            token: CancellationToken::new(),
            task: None,
            relay: None,
            taken: Vec::new(),
        };
        if let Err(e) = flow.topic.publish(&flow.plan.messages()).await {
            flow.remove().await;
            return Err(e);
        }
        let handler = Credit::<K>::new(Arc::clone(&flow.log), pace, trap);
        flow.task = Some(flow.topic.spawn(
            flow.bank.backend().clone(),
            handler,
            options(),
            flow.token.clone(),
        ));
        Ok(flow)
    }

    /// Also starts `idem relay` and a producer that enqueues `n` outbox messages, 20 ms
    /// apart, for it.
    async fn with_relay(mut self, n: usize) -> Res<Self> {
        let outbox = Outbox::new(self.topic.broker, &self.topic.url, "relay");
        match outbox.spawn_cli(&self.url) {
            Ok(child) => {
                let producer = tokio::spawn(enqueue(
                    self.bank.backend().clone(),
                    outbox.destination.clone(),
                    Arc::clone(&outbox.ids),
                    n,
                    Duration::from_millis(20),
                ));
                self.relay = Some(RelayRun {
                    outbox,
                    child,
                    producer,
                });
                Ok(self)
            }
            Err(e) => {
                outbox.remove().await;
                self.remove().await;
                Err(e)
            }
        }
    }

    /// Waits (bounded) until the relay published something.
    async fn wait_relayed(&self) -> Res {
        let Some(run) = &self.relay else {
            return Ok(());
        };
        for _ in 0..(GUARD.as_millis() / 50) {
            let enqueued = run.outbox.ids.lock().unwrap().len() as u64;
            if enqueued > self.bank.unsent().await? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(fail("the relay published nothing (hang guard)"))
    }

    /// Waits (bounded) until `pred` holds of the balance moved.
    async fn wait_moved(&self, pred: impl Fn(i64) -> bool) -> Res {
        for _ in 0..(GUARD.as_millis() / 50) {
            if pred(balance(&self.bank).await? - START) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(fail("the consumer made no progress (hang guard)"))
    }

    /// Waits (bounded) until `n` decisions matching `pred` were logged; `false` if the
    /// guard ran out.
    async fn wait_logged(&self, n: usize, pred: impl Fn(&Option<String>, &str) -> bool) -> bool {
        for _ in 0..(GUARD.as_millis() / 50) {
            if self.log.count(&pred) >= n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// Lets the consumer finish, stops it, drains what is left with a second consumer,
    /// checks every invariant and returns the report.
    async fn finish(mut self, case: &str) -> Res<String> {
        let result = self.finish_inner(case).await;
        let text = result.map(|t| format!("[{} {} {case}] {t}", self.topic.broker.name(), K::NAME));
        self.remove().await;
        let text = text?;
        println!("{text}");
        Ok(text)
    }

    async fn finish_inner(&mut self, case: &str) -> Res<String> {
        // Phase 1: until every good message is applied and every poison message is in
        // the dead-letter destination, or the guard runs out (then the checks say why).
        let sum = self.plan.sum();
        let poison = self.plan.poison.len();
        for _ in 0..(GUARD.as_millis() / 100) {
            let moved = balance(&self.bank).await? - START;
            if moved == sum && self.topic.dead_letter_count().await? + self.taken.len() >= poison {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.token.cancel();
        let first = join(self.task.take()).await?;
        // Phase 2: a fresh consumer takes whatever came back (requeued or not yet
        // acknowledged) and stops when idle.
        let token = CancellationToken::new();
        let drain = self.topic.spawn(
            self.bank.backend().clone(),
            Credit::<K>::new(Arc::clone(&self.log), Duration::ZERO, None),
            options().max_idle(Some(Duration::from_secs(4))),
            token,
        );
        let second = join(Some(drain)).await?;
        let relay = match self.relay.take() {
            Some(run) => {
                let r = finish_relay(&self.bank, &run.outbox, run.child, run.producer).await;
                run.outbox.remove().await;
                Some(r?)
            }
            None => None,
        };

        // The invariants, from the database and the broker.
        let moved = balance(&self.bank).await? - START;
        let records = self.bank.records().await?;
        let left = self.topic.left().await?;
        let mut dead = self.topic.dead_letters().await?;
        let taken = self.taken.len();
        dead.append(&mut self.taken);
        check(moved == sum, || {
            format!("balance moved by {moved}, the good messages sum to {sum} (lost or doubled)")
        })?;
        check(records == self.plan.good.len() as u64, || {
            format!(
                "{records} records for {} good messages",
                self.plan.good.len()
            )
        })?;
        check(left == 0, || format!("{left} messages left unacknowledged"))?;
        let mut copies = 0;
        for (id, _, reason) in &self.plan.poison {
            let found = dead
                .iter()
                .filter(|d| d.original == *id && d.reason == *reason)
                .count();
            check(found >= 1, || {
                format!(
                    "poison message {id:?} ({reason}) is not in the dead-letter destination (lost); dead letters: {dead:?}"
                )
            })?;
            if id.is_some() {
                copies += found;
            }
        }
        for d in &dead {
            check(
                !d.original
                    .as_ref()
                    .is_some_and(|o| self.plan.good.contains_key(o)),
                || format!("a good message was dead-lettered: {d:?}"),
            )?;
        }
        let s = first + second;
        println!(
            "figures: {}",
            json!({
                "case": case,
                "broker": self.topic.broker.name(),
                "engine": K::NAME,
                "good": self.plan.good.len(),
                "poison": poison,
                "delivered": s.delivered,
                "applied": s.applied,
                "duplicates": s.duplicates,
                "dead_lettered": s.dead_lettered,
                "returned": s.returned,
                "reconnects": s.reconnects,
                "dead_letters_stored": dead.len(),
                "relay": relay.as_ref().map(|r| &r.1),
                "lost": 0,
                "doubled": 0,
            })
        );
        let relay = relay.map(|r| r.0);
        Ok(format!(
            "{} good + {} poison messages: delivered {}, applied {}, duplicates {}, dead-lettered {}, returned {}, reconnections {}; \
             balance +{moved} = good sum, {records} records; {} dead letters stored{} ({copies} for {} poison IDs); 0 left{}",
            self.plan.good.len(),
            poison,
            s.delivered,
            s.applied,
            s.duplicates,
            s.dead_lettered,
            s.returned,
            s.reconnects,
            dead.len(),
            if taken > 0 {
                format!(", {taken} of them taken off before the deletion")
            } else {
                String::new()
            },
            self.plan.poison.iter().filter(|p| p.0.is_some()).count(),
            relay.map(|r| format!("; relay: {r}")).unwrap_or_default()
        ))
    }

    async fn remove(mut self) {
        self.token.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
        if let Some(mut run) = self.relay.take() {
            run.producer.abort();
            let _ = run.child.kill().await;
            run.outbox.remove().await;
        }
        self.topic.delete().await;
        let _ = self.bank.close().await;
    }
}

/// Waits (bounded) for a consumer task and returns its counts.
async fn join(task: Option<tokio::task::JoinHandle<Result<Stats, ConsumerError>>>) -> Res<Stats> {
    let Some(task) = task else {
        return Ok(Stats::default());
    };
    match tokio::time::timeout(GUARD, task).await {
        Ok(Ok(Ok(stats))) => Ok(stats),
        Ok(Ok(Err(e))) => Err(fail(format!("the consumer stopped with an error: {e}"))),
        Ok(Err(e)) => Err(fail(format!("the consumer task failed: {e}"))),
        Err(_) => Err(fail("the consumer did not stop (hang guard)")),
    }
}

/// Waits until the relay marked every message sent, stops it (SIGTERM) and checks what
/// reached the broker.
async fn finish_relay<K: Engine>(
    bank: &K,
    outbox: &Outbox,
    child: Child,
    producer: tokio::task::JoinHandle<Res>,
) -> Res<(String, Value)> {
    tokio::time::timeout(GUARD, producer)
        .await
        .map_err(|_| fail("the producer hung (hang guard)"))?
        .map_err(db)??;
    let mut unsent = bank.unsent().await?;
    for _ in 0..(GUARD.as_millis() / 100) {
        if unsent == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        unsent = bank.unsent().await?;
    }
    let pid = child.id();
    signal(pid, "TERM")?;
    let out = tokio::time::timeout(GUARD, child.wait_with_output())
        .await
        .map_err(|_| fail("idem relay did not stop (hang guard)"))?
        .map_err(db)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    check(out.status.success(), || {
        format!("idem relay failed ({}): {stderr}", out.status)
    })?;
    check(unsent == 0, || {
        format!("{unsent} outbox messages never marked sent; relay said: {stderr}")
    })?;
    let copies = outbox.copies().await?;
    let total: usize = copies.values().sum();
    let retries = stderr.lines().filter(|l| l.contains("retrying")).count();
    let figures = json!({
        "messages": outbox.ids().len(),
        "copies": total,
        "failed_passes": retries,
    });
    Ok((
        format!(
            "{} outbox messages all marked sent ({}), {total} copies at the broker (each at least once), {retries} failed passes retried",
            outbox.ids().len(),
            stdout.trim()
        ),
        figures,
    ))
}

// ---------------------------------------------------------------- cases: shared brokers

/// Issue 17.3: the dead-letter queue is deleted while poison messages are dead-lettered.
/// RabbitMQ drops a message published to a queue that does not exist, and confirms it;
/// a consumer that published dead letters without `mandatory` acknowledged originals
/// whose dead letters were gone. Now they are returned until the queue exists again.
async fn dead_letter_queue_deleted<K: Engine>(broker: Broker) -> Res {
    let layout = if broker == Broker::Amqp {
        Layout::Queue
    } else {
        Layout::Separate
    };
    let plan = Plan::new(80, 16, 4, 2, 0);
    let flow = Flow::<K>::start(
        broker,
        &shared_url(broker),
        layout,
        "dldel",
        plan,
        Duration::from_millis(15),
        None,
    )
    .await?;
    let fault = async {
        // Some dead letters are stored, then the destination goes away.
        for _ in 0..(GUARD.as_millis() / 20) {
            if flow.topic.dead_letter_count().await? >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let taken = flow.topic.take_and_delete_dead_letter().await?;
        // Dead letters now fail and their messages come back (not with the old code:
        // the wait runs until every good message is applied, and the checks say the rest).
        let returned = |_: &Option<String>, what: &str| {
            what.starts_with("redeliver:") && what.contains("dead letter")
        };
        let sum = flow.plan.sum();
        for _ in 0..(GUARD.as_millis() / 50) {
            if flow.log.count(returned) >= 3 || balance(&flow.bank).await? - START == sum {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seen = flow.log.count(returned);
        flow.topic.restore_dead_letter().await?;
        Ok::<_, libtest_mimic::Failed>((seen, taken))
    }
    .await;
    let mut flow = flow;
    let seen = match fault {
        Ok((n, taken)) => {
            flow.taken = taken;
            n
        }
        Err(e) => {
            flow.remove().await;
            return Err(e);
        }
    };
    flow.finish(&format!(
        "dead-letter destination deleted mid-run ({seen} dead letters refused while it was gone)"
    ))
    .await?;
    Ok(())
}

/// Consume arguments that make a deleted queue always cancel its consumer
/// (`x-cancel-on-ha-failover`), as idem's own consumer asks. Without them RabbitMQ's
/// channel silently consumes again by name when a classic queue goes down, and can land
/// on a queue declared again under that name in the meantime, whose deliveries then never
/// reached the client (the drainers below lost confirmed messages in 7 of 24 runs with
/// two busy loops beside the test, and 36 of 2075 in one CI run; none in 30 runs with
/// these arguments).
fn cancel_on_queue_down() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-cancel-on-ha-failover".into(), AMQPValue::Boolean(true));
    args
}

/// A queue deleted (when empty) and declared again, over and over, while publishes to it
/// are on their way. RabbitMQ positively confirms a message routed to a queue that is
/// deleted before the message reached it, and drops it with the queue; the consumer's
/// dead-letter publish (`publish_confirmed`) and the relay's `AmqpPublisher` took such a
/// confirm for a stored message. Now each confirm is followed by a lookup of the queue:
/// every publish that succeeded is received by the drainers, and the others failed.
///
/// Two queues: one for `publish_confirmed`, one for the relay's publisher, which declares
/// its queue again as soon as a publish finds it missing. A lookup cannot tell a queue
/// declared again in the meantime from the one deleted, so a publish whose queue someone
/// else declares again before its lookup is not covered. The deleter declares both
/// queues again only after a pause, but a publish slowed down by a busy machine can
/// outlast it (a CI run with builds beside the test lost 3 of 2020, which the first
/// version of this check could not tell apart from a broken lookup): a lost message is
/// a failure unless its queue was deleted after the publish began **and** declared again
/// before it returned, times taken on either side of the broker's work. With the lookup
/// left out, messages are lost without being declared again in their publish.
async fn queue_deleted_in_flight() -> Res {
    use futures_util::StreamExt;
    use idem::consumer::amqp::publish_confirmed;
    use idem::consumer::lapin::options::{BasicCancelOptions, BasicConsumeOptions};
    use std::sync::atomic::AtomicU32;

    /// Deletions tried (each when the queue is empty), and how long the queue stays away.
    const ROUNDS: u32 = 60;
    const AWAY: Duration = Duration::from_millis(40);
    /// Tasks publishing with `publish_confirmed`; one more publishes with `AmqpPublisher`.
    const PUBLISHERS: u32 = 3;

    let url = amqp_url();
    let queue = unique("inflight");
    let relayed = unique("inflight_relay");
    let stop = Arc::new(AtomicBool::new(false));
    // The drainers outlive the publishers: a drainer whose consumer the last deletion
    // cancelled consumes again once the queue is back, and takes what the publishers
    // stored after that (left in the queue, those were counted as lost).
    let drained = Arc::new(AtomicBool::new(false));
    let received: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let declare = |ch: lapin::Channel, queue: String| async move {
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(db)
    };
    let (admin, ch) = amqp_connect(&url).await?;
    declare(ch.clone(), queue.clone()).await?;
    declare(ch, relayed.clone()).await?;

    // A drainer per queue consumes every message as it arrives, so the queue is empty
    // when the deleter asks; the broker cancels its consumer with each deletion.
    let drain = |queue: String| {
        let (url, stop, received) = (url.clone(), drained.clone(), received.clone());
        tokio::spawn(async move {
            let (conn, mut ch) = amqp_connect(&url).await?;
            // A consumer tag per consume: lapin files deliveries by tag, and the broker's
            // cancel of a consumer on a deleted queue, handled after a new consume with the
            // same tag, removed the new consumer, whose deliveries (`no_ack`: the broker
            // keeps no copy) were then dropped (4 to 48 messages in a row lost, one run in
            // two with two busy loops beside the test).
            let mut consumes = 0u32;
            while !stop.load(Ordering::SeqCst) {
                if !ch.status().connected() {
                    ch = conn.create_channel().await.map_err(db)?;
                }
                consumes += 1;
                let tag = format!("drainer-{consumes}");
                let consumed = ch
                    .basic_consume(
                        queue.as_str().into(),
                        tag.as_str().into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..BasicConsumeOptions::default()
                        },
                        cancel_on_queue_down(),
                    )
                    .await;
                let Ok(mut deliveries) = consumed else {
                    // Deleted and not declared again yet (the channel is closed).
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                };
                let mut cancelled = false;
                loop {
                    match tokio::time::timeout(Duration::from_millis(100), deliveries.next()).await
                    {
                        Ok(Some(Ok(d))) => {
                            let id = d.properties.message_id().as_ref().map(|s| s.to_string());
                            *received
                                .lock()
                                .unwrap()
                                .entry(id.unwrap_or_default())
                                .or_default() += 1;
                        }
                        Ok(Some(Err(e))) => return Err(db(e)),
                        // Cancelled by the deletion, or by us below: every delivery sent
                        // before the cancel was read first.
                        Ok(None) => break,
                        // Quiet for 100 ms after our own cancel: the stream is done.
                        Err(_) if cancelled => break,
                        // Quiet for 100 ms: consume again. A consumer registered while
                        // its queue was being deleted can miss the broker's cancel and
                        // wait on a queue that is gone (seen once in ten runs: 197
                        // messages left in the queue declared again, counted as lost).
                        // What the broker delivered before our cancel is answered is
                        // still read from the stream: with `no_ack` the broker holds no
                        // copy (dropping it lost 24 of 1302 in one CI run).
                        Err(_) => {
                            let _ = ch
                                .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
                                .await;
                            cancelled = true;
                        }
                    }
                }
            }
            let _ = conn.close(200, "drained".into()).await;
            Res::Ok(())
        })
    };
    let drainers = [drain(queue.clone()), drain(relayed.clone())];

    // Publishers: each counts what it was told was stored (with when the publish began
    // and returned), and what failed.
    let confirmed: Arc<Mutex<Vec<(String, Instant, Instant)>>> = Arc::default();
    let (refused, gone) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let failed = {
        let (refused, gone) = (refused.clone(), gone.clone());
        move |e: String| {
            refused.fetch_add(1, Ordering::SeqCst);
            if e.contains("is gone") {
                gone.fetch_add(1, Ordering::SeqCst);
            }
        }
    };
    let mut publishers = Vec::new();
    for task in 0..PUBLISHERS {
        let (url, queue, stop, confirmed, failed) = (
            url.clone(),
            queue.clone(),
            stop.clone(),
            confirmed.clone(),
            failed.clone(),
        );
        publishers.push(tokio::spawn(async move {
            let (conn, ch) = amqp_connect(&url).await?;
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(db)?;
            let mut n = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let id = format!("p{task}-{n}");
                n += 1;
                let props = BasicProperties::default().with_message_id(id.as_str().into());
                let began = Instant::now();
                match publish_confirmed(&conn, &ch, &queue, b"{}", props, BROKER_TIMEOUT).await {
                    Ok(()) => confirmed.lock().unwrap().push((id, began, Instant::now())),
                    Err(e) => failed(e.to_string()),
                }
            }
            let _ = conn.close(200, "published".into()).await;
            Res::Ok(())
        }));
    }
    {
        let (url, queue, stop, confirmed, failed) = (
            url.clone(),
            relayed.clone(),
            stop.clone(),
            confirmed.clone(),
            failed.clone(),
        );
        publishers.push(tokio::spawn(async move {
            let publisher = AmqpPublisher::connect_within(&url, BROKER_TIMEOUT)
                .await
                .map_err(db)?;
            let mut n = 0i64;
            while !stop.load(Ordering::SeqCst) {
                let row = OutboxRow {
                    id: n,
                    destination: queue.clone(),
                    message_id: format!("relay-{n}"),
                    payload: "{}".into(),
                };
                n += 1;
                let began = Instant::now();
                match publisher.publish(&row).await {
                    Ok(()) => {
                        let published = (row.message_id, began, Instant::now());
                        confirmed.lock().unwrap().push(published)
                    }
                    Err(e) => failed(e.to_string()),
                }
            }
            let _ = publisher.close().await;
            Res::Ok(())
        }));
    }

    // The deleter: delete each queue when empty, stay away, declare them again. Each
    // cycle: the queue, when its deletion was answered, when it was declared again.
    let mut cycles: Vec<(String, Instant, Instant)> = Vec::new();
    let deleted = async {
        let mut ch = admin.create_channel().await.map_err(db)?;
        let mut deletions = 0u32;
        for _ in 0..ROUNDS {
            tokio::time::sleep(Duration::from_millis(15)).await;
            let mut gone = Vec::new();
            for name in [&queue, &relayed] {
                let asked = ch
                    .queue_delete(
                        name.as_str().into(),
                        QueueDeleteOptions {
                            if_empty: true,
                            ..QueueDeleteOptions::default()
                        },
                    )
                    .await;
                if asked.is_ok() {
                    deletions += 1;
                    gone.push((name.clone(), Instant::now()));
                } else {
                    // Not empty: the broker closed the channel.
                    ch = admin.create_channel().await.map_err(db)?;
                }
            }
            tokio::time::sleep(AWAY).await;
            let again = Instant::now();
            cycles.extend(gone.into_iter().map(|(name, at)| (name, at, again)));
            declare(ch.clone(), queue.clone()).await?;
            declare(ch.clone(), relayed.clone()).await?;
        }
        Res::Ok(deletions)
    }
    .await;
    stop.store(true, Ordering::SeqCst);
    let mut outcome = deleted;
    for p in publishers {
        let joined = tokio::time::timeout(GUARD, p)
            .await
            .map_err(|_| fail("hang guard"))?;
        if let Err(e) = joined.map_err(db).and_then(|r| r) {
            outcome = outcome.and(Err(e));
        }
    }
    // Everything in the queue reaches the drainer before it stops.
    let wanted: Vec<(String, Instant, Instant)> = confirmed.lock().unwrap().clone();
    let lost = || {
        let got = received.lock().unwrap();
        wanted
            .iter()
            .filter(|(id, _, _)| !got.contains_key(id))
            .cloned()
            .collect::<Vec<_>>()
    };
    for _ in 0..100 {
        if lost().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drained.store(true, Ordering::SeqCst);
    for drainer in drainers {
        let joined = tokio::time::timeout(GUARD, drainer)
            .await
            .map_err(|_| fail("hang guard"))?;
        if let Err(e) = joined.map_err(db).and_then(|r| r) {
            outcome = outcome.and(Err(e));
        }
    }
    if let Ok(ch) = admin.create_channel().await {
        for name in [&queue, &relayed] {
            let _ = ch
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
    let _ = admin.close(200, "done".into()).await;
    let deletions = outcome?;
    let (refused, gone, lost) = (
        refused.load(Ordering::SeqCst),
        gone.load(Ordering::SeqCst),
        lost(),
    );
    check(deletions > 0, || {
        "the queue was never empty long enough to be deleted".into()
    })?;
    check(refused > 0, || {
        format!(
            "{deletions} deletions, but no publish failed: the queue was never missing under a publish"
        )
    })?;
    // A lost message the lookup could not see: its queue deleted after the publish
    // began and declared again before it returned.
    let declared_again = |(id, began, returned): &(String, Instant, Instant)| {
        let target = if id.starts_with("relay-") {
            &relayed
        } else {
            &queue
        };
        cycles
            .iter()
            .any(|(name, deleted, again)| name == target && deleted > began && again < returned)
    };
    let (unseen, missed): (Vec<_>, Vec<_>) = lost.iter().partition(|p| declared_again(p));
    check(missed.is_empty(), || {
        format!(
            "{} of {} publishes that succeeded never reached the queue (lost), and their queue \
             was not declared again before they returned, e.g. {:?}",
            missed.len(),
            wanted.len(),
            missed
                .iter()
                .take(5)
                .map(|(id, _, _)| id)
                .collect::<Vec<_>>()
        )
    })?;
    let relay = wanted
        .iter()
        .filter(|(id, _, _)| id.starts_with("relay-"))
        .count();
    println!(
        "[amqp queue deleted in flight] {deletions} deletions; {} publishes succeeded \
         ({} publish_confirmed, {relay} AmqpPublisher); {refused} failed ({gone} confirmed for \
         a queue that was gone); lost {}, each with its queue deleted and declared again \
         before the publish returned (what a lookup cannot see){}",
        wanted.len(),
        wanted.len() - relay,
        unseen.len(),
        if unseen.is_empty() {
            String::new()
        } else {
            format!(
                ": {:?}",
                unseen.iter().map(|(id, _, _)| id).collect::<Vec<_>>()
            )
        }
    );
    Ok(())
}

/// idem's AMQP consumer whose queue is deleted (when empty) and at once declared again,
/// round after round, with credits published and applied in between. The broker cancels
/// the consumer with each deletion and the loop stops with that error; the test starts it
/// again, as a supervisor would. The consume asks for the cancel in every case
/// (`x-cancel-on-ha-failover`): without it RabbitMQ may silently attach the consumer to
/// the queue declared again, whose messages then never reach it, and a round's credits
/// are never applied (10 runs of 10 failed so, in the first few rounds, with the consume
/// argument taken out; 35 of 35 passed with it, 15 of them with two busy loops beside).
async fn consumed_queue_deleted() -> Res {
    let (bank, _) = SqliteBank::private("qdel").await?;
    let result = consumed_queue_deleted_on(&bank).await;
    let _ = bank.close().await;
    result
}

async fn consumed_queue_deleted_on(bank: &SqliteBank) -> Res {
    use idem::consumer::amqp::{declare_queue, publish_confirmed};

    const ROUNDS: u32 = 40;
    /// Credits per round.
    const BATCH: u32 = 4;
    /// A hang guard for one round's credits (each applies in milliseconds).
    const ROUND_GUARD: Duration = Duration::from_secs(15);

    bank.setup().await.map_err(db)?;
    bank.set_balance(1, START).await.map_err(db)?;
    let url = amqp_url();
    let queue = unique("consumed_deleted");
    let (admin, publishing) = amqp_connect(&url).await?;
    declare_queue(&publishing, &queue).await.map_err(db)?;
    publishing
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(db)?;

    let deleting = admin.create_channel().await.map_err(db)?;
    let declaring = [
        admin.create_channel().await.map_err(db)?,
        admin.create_channel().await.map_err(db)?,
    ];

    let log: Arc<Log> = Arc::default();
    let token = CancellationToken::new();
    let cancelled = "the broker cancelled the consumer";
    let supervisor = {
        let consumer = Consumer::new(
            Idem::new(bank.backend().clone()),
            Subscriber::new(SUB).unwrap(),
            Credit::<SqliteBank>::new(Arc::clone(&log), Duration::ZERO, None),
        )
        .with_options(options());
        let config = AmqpConfig::new(url.as_str(), queue.as_str());
        let token = token.clone();
        tokio::spawn(async move {
            let mut cancels = 0u32;
            loop {
                match idem::consumer::amqp::run(&consumer, &config, token.clone()).await {
                    Ok(_) => return Ok(cancels),
                    Err(e) if e.to_string().contains(cancelled) => cancels += 1,
                    Err(e) => return Err(format!("the consumer stopped with an error: {e}")),
                }
            }
        })
    };

    let applied = |_: &Option<String>, what: &str| what == "applied";
    let rounds = async {
        let mut credits: BTreeMap<String, i64> = BTreeMap::new();
        let mut deletions = 0u32;
        // One more round of credits after the last deletion: the consumer came back.
        for round in 0..=ROUNDS {
            for i in 0..BATCH {
                let id = format!("{queue}-{round}-{i}");
                let amount = fastrand::i64(1..=100);
                let props = BasicProperties::default().with_message_id(id.as_str().into());
                let body = body(1, amount);
                publish_confirmed(
                    &admin,
                    &publishing,
                    &queue,
                    body.as_bytes(),
                    props,
                    BROKER_TIMEOUT,
                )
                .await
                .map_err(|e| fail(format!("round {round}: {e}")))?;
                credits.insert(id, amount);
            }
            let wanted = credits.len();
            let began = Instant::now();
            while log.count(applied) < wanted {
                if began.elapsed() > ROUND_GUARD || supervisor.is_finished() {
                    return Err(fail(format!(
                        "round {round}: {} of the {BATCH} credits published after the queue was \
                         deleted and declared again {deletions} times were not applied within \
                         {ROUND_GUARD:?} (the consumer was not cancelled, or it is attached to a \
                         queue that sends it nothing)",
                        wanted - log.count(applied)
                    )));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if round == ROUNDS {
                break;
            }
            // Deleted when empty while two channels declare it again and again, so that
            // it is back within a round trip, maybe before the consumer's channel has seen
            // it go.
            let done = AtomicBool::new(false);
            let delete = async {
                let deleted = deleting
                    .queue_delete(
                        queue.as_str().into(),
                        QueueDeleteOptions {
                            if_empty: true,
                            ..QueueDeleteOptions::default()
                        },
                    )
                    .await;
                done.store(true, Ordering::SeqCst);
                deleted.map_err(|e| fail(format!("round {round}: delete the empty queue: {e}")))
            };
            let redeclare = |channel: &lapin::Channel| {
                let (channel, done, queue) = (channel.clone(), &done, &queue);
                async move {
                    while !done.load(Ordering::SeqCst) {
                        declare_queue(&channel, queue).await.map_err(db)?;
                    }
                    declare_queue(&channel, queue).await.map_err(db)
                }
            };
            let (deleted, a, b) =
                tokio::join!(delete, redeclare(&declaring[0]), redeclare(&declaring[1]));
            deleted?;
            a?;
            b?;
            deletions += 1;
        }
        Res::Ok((credits, deletions))
    }
    .await;
    token.cancel();
    let stopped = tokio::time::timeout(GUARD, supervisor).await;
    if let Ok(ch) = admin.create_channel().await {
        for name in [queue.clone(), format!("{queue}.dead-letter")] {
            let _ = ch
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
    let _ = admin.close(200, "done".into()).await;
    let (credits, deletions) = rounds?;
    let cancels = match stopped {
        Ok(Ok(Ok(n))) => n,
        Ok(Ok(Err(e))) => return Err(fail(e)),
        Ok(Err(e)) => return Err(fail(format!("the consumer task failed: {e}"))),
        Err(_) => return Err(fail("the consumer did not stop (hang guard)")),
    };
    check(cancels == deletions, || {
        format!(
            "the queue was deleted {deletions} times under the consumer, which was cancelled {cancels} times"
        )
    })?;
    let entries = log.0.lock().unwrap().clone();
    let mut seen: BTreeMap<String, u32> = BTreeMap::new();
    for (id, what) in &entries {
        check(what == "applied", || {
            format!("{id:?} was not simply applied: {what}")
        })?;
        *seen.entry(id.clone().unwrap_or_default()).or_default() += 1;
    }
    check(
        seen.len() == credits.len() && seen.values().all(|n| *n == 1),
        || {
            format!(
                "{} credits published, {} applied, some more than once: {:?}",
                credits.len(),
                seen.len(),
                seen.iter()
                    .filter(|(_, n)| **n > 1)
                    .take(5)
                    .collect::<Vec<_>>()
            )
        },
    )?;
    let moved = balance(bank).await? - START;
    let sum: i64 = credits.values().sum();
    check(moved == sum, || {
        format!("the balance moved by {moved}, the credits sum to {sum}")
    })?;
    println!(
        "[amqp consumed queue deleted] {deletions} deletions under the consumer, each \
         cancelling it; {} credits each applied once (balance moved by {sum})",
        credits.len()
    );
    Ok(())
}

/// Issue 17.2: the dead-letter subject is captured by the consumed stream itself (a
/// work-queue stream on `<stream>.>`). A dead letter republished with the original
/// `Nats-Msg-Id` was dropped as a duplicate inside the duplicate window, and the
/// original acknowledged: gone. Dead letters have their own ID now.
async fn dead_letter_captured_by_source<K: Engine>() -> Res {
    let plan = Plan::new(40, 8, 4, 1, 0);
    let flow = Flow::<K>::start(
        Broker::Nats,
        &nats_url(),
        Layout::Captured,
        "dlcap",
        plan,
        Duration::ZERO,
        None,
    )
    .await?;
    flow.finish("dead-letter subject captured by the consumed work-queue stream")
        .await?;
    Ok(())
}

/// A consumer that would receive its own dead letters (the consumed stream captures the
/// dead-letter subject and the consumer has no filter) is refused at start: it would
/// apply them as new messages.
async fn dead_letter_delivered_back_is_refused() -> Res {
    let (bank, _url) = SqliteBank::private("dlback").await?;
    let result = async {
        bank.setup().await.map_err(db)?;
        let js = nats_connect(&nats_url(), GUARD).await?;
        let name = unique("DLBACK").to_uppercase();
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await
        .map_err(db)?;
        let consumer = Consumer::new(
            Idem::new(bank.backend().clone()),
            Subscriber::new(SUB).unwrap(),
            Credit::<SqliteBank>::new(Arc::default(), Duration::ZERO, None),
        )
        .with_options(options().max_idle(Some(Duration::from_secs(1))));
        let config = NatsConfig::new(nats_url(), name.as_str(), "unfiltered");
        let ran = tokio::time::timeout(
            GUARD,
            idem::consumer::nats::run(&consumer, &config, CancellationToken::new()),
        )
        .await
        .map_err(|_| fail("hang guard"))?;
        let _ = js.delete_stream(&name).await;
        match ran {
            Err(ConsumerError::Config(why)) if why.contains("its own dead letters") => {
                println!("[nats dead-letter subject delivered back] refused at start: {why}");
                Ok(())
            }
            other => Err(fail(format!(
                "expected a configuration refusal, got {other:?}"
            ))),
        }
    }
    .await;
    let _ = bank.close().await;
    result
}

fn shared_url(broker: Broker) -> String {
    match broker {
        Broker::Amqp => amqp_url(),
        Broker::Nats => nats_url(),
    }
}

// ---------------------------------------------------------------- cases: private brokers

async fn private_broker(broker: Broker) -> Res<PrivateBroker> {
    match broker {
        Broker::Amqp => PrivateBroker::rabbitmq().await,
        Broker::Nats => PrivateBroker::nats().await,
    }
}

/// The broker is stopped and started again in the middle of a stream, while a consumer
/// per engine consumes from it and an `idem relay` per engine publishes through it.
async fn restarted_mid_stream(broker: Broker) -> Res {
    let mut server = private_broker(broker).await?;
    let result = restarted_on(broker, &mut server).await;
    server.remove().await;
    result
}

async fn restarted_on(broker: Broker, server: &mut PrivateBroker) -> Res {
    let url = server.url();
    let layout = if broker == Broker::Amqp {
        Layout::Queue
    } else {
        Layout::Separate
    };
    let pace = Duration::from_millis(10);
    let plan = || Plan::new(300, 10, 5, 2, 0);
    let lite = Flow::<SqliteBank>::start(broker, &url, layout, "rst", plan(), pace, None).await?;
    let lite = lite.with_relay(150).await?;
    let pg = match Flow::<PgBank>::start(broker, &url, layout, "rst", plan(), pace, None).await {
        Ok(f) => f.with_relay(150).await,
        Err(e) => Err(e),
    };
    let pg = match pg {
        Ok(f) => f,
        Err(e) => {
            lite.remove().await;
            return Err(e);
        }
    };
    let my = match Flow::<MysqlBank>::start(broker, &url, layout, "rst", plan(), pace, None).await {
        Ok(f) => f.with_relay(150).await,
        Err(e) => Err(e),
    };
    let my = match my {
        Ok(f) => f,
        Err(e) => {
            lite.remove().await;
            pg.remove().await;
            return Err(e);
        }
    };
    // Mid-stream: every consumer has applied something, none has finished.
    let progress = async {
        lite.wait_moved(|m| m > 0).await?;
        pg.wait_moved(|m| m > 0).await?;
        my.wait_moved(|m| m > 0).await?;
        lite.wait_relayed().await?;
        pg.wait_relayed().await?;
        my.wait_relayed().await
    }
    .await;
    let restarted = match progress {
        Ok(()) => server.restart().await,
        Err(e) => Err(e),
    };
    if let Err(e) = restarted {
        lite.remove().await;
        pg.remove().await;
        my.remove().await;
        return Err(e);
    }
    let case = "broker restarted mid-stream";
    let (a, b, c) = tokio::join!(lite.finish(case), pg.finish(case), my.finish(case));
    a?;
    b?;
    c?;
    Ok(())
}

/// RabbitMQ closes the consumer's channel (not its connection) while a handler is still
/// applying a message: the broker's delivery-acknowledgement timeout (`consumer_timeout`,
/// 1 s here) is shorter than each effect (2.5 s). lapin then refuses to send the
/// acknowledgement (the channel is closed) or fails it; either way the loop must
/// reconnect rather than read on or stop, and the broker's redelivery of the applied
/// message is answered as a duplicate. One engine: the loop is the same for each.
async fn channel_closed_under_handler() -> Res {
    // The timeout is checked on each channel tick (every 60 s unless set).
    let server = PrivateBroker::rabbitmq_with(
        "consumer_timeout = 1000\n",
        &["{channel_tick_interval, 250}"],
    )
    .await?;
    let result = channel_closed_on(&server.url()).await;
    server.remove().await;
    result
}

async fn channel_closed_on(url: &str) -> Res {
    // Poison that needs no effect (an effect-rejected credit would time out forever).
    let plan = Plan::new(4, 0, 1, 1, 0);
    let pace = Duration::from_millis(2500);
    let flow = Flow::<SqliteBank>::start(Broker::Amqp, url, Layout::Queue, "cto", plan, pace, None)
        .await?;
    let log = Arc::clone(&flow.log);
    flow.finish("channel closed under the handler").await?;
    let duplicates = log.count(|_, what| what == "duplicate");
    check(duplicates >= 1, || {
        "no applied message came back as a duplicate: the broker never closed the channel \
         under a handler (the fault was not injected)"
            .into()
    })?;
    println!("channel closed under the handler: {duplicates} redeliveries answered as duplicates");
    Ok(())
}

/// The broker is paused (SIGSTOP) while it holds a consumer's dead letter and while the
/// relay waits for a publish's confirmation: both time out, the original is returned
/// and the outbox message stays unsent; then the broker is resumed and everything goes
/// through. One engine after another, on one private broker.
async fn never_confirms(broker: Broker) -> Res {
    let mut server = private_broker(broker).await?;
    let result = async {
        never_confirms_on::<SqliteBank>(broker, &mut server).await?;
        never_confirms_on::<PgBank>(broker, &mut server).await?;
        never_confirms_on::<MysqlBank>(broker, &mut server).await
    }
    .await;
    server.remove().await;
    result
}

async fn never_confirms_on<K: Engine>(broker: Broker, server: &mut PrivateBroker) -> Res {
    let url = server.url();
    let layout = if broker == Broker::Amqp {
        Layout::Queue
    } else {
        Layout::Separate
    };
    // The consumer: the trap pauses the broker at the first decode of its message, so the
    // dead letter that follows is published to a broker that does not answer.
    let trap = Arc::new(Trap {
        pid: server.process_id()?,
        sprung: AtomicBool::new(false),
    });
    let plan = Plan::new(60, 3, 0, 0, 1);
    let trapped = plan
        .poison
        .iter()
        .find(|p| p.1.contains(&TRAP_ACCOUNT.to_string()))
        .and_then(|p| p.0.clone());
    let flow = Flow::<K>::start(
        broker,
        &url,
        layout,
        "never",
        plan,
        Duration::from_millis(5),
        Some(Arc::clone(&trap)),
    )
    .await?;
    // The trapped message's dead letter was not confirmed: returned, not acknowledged.
    let refused = flow
        .wait_logged(1, |id, what| {
            *id == trapped && what.starts_with("redeliver:") && what.contains("dead letter")
        })
        .await;
    let resumed = server.resume();
    if !refused || resumed.is_err() {
        flow.remove().await;
        resumed?;
        return Err(fail(
            "the dead letter published to the paused broker was never reported as failed",
        ));
    }
    flow.finish("broker paused while a dead letter waits for its confirmation")
        .await?;

    // The relay: a publish whose confirmation never comes is a failure, never marked sent.
    let (bank, _url) = K::private("neverrelay").await?;
    let mut outbox = Outbox::new(broker, &url, "never");
    let result = relay_never_confirms(&bank, &mut outbox, server).await;
    outbox.remove().await;
    let _ = bank.close().await;
    let text = result?;
    println!(
        "[{} {} relay while the broker is paused] {text}",
        broker.name(),
        K::NAME
    );
    Ok(())
}

async fn relay_never_confirms<K: Engine>(
    bank: &K,
    outbox: &mut Outbox,
    server: &mut PrivateBroker,
) -> Res<String> {
    bank.setup().await.map_err(db)?;
    let idem = Idem::new(bank.backend().clone());
    let publisher = outbox.publisher().await?;
    // A first message goes through, so the destination exists and the publisher knows it:
    // what times out next is the publish's confirmation itself.
    outbox.enqueue(bank, 1).await?;
    let warm = idem.relay(&publisher, 100).await.map_err(db)?;
    check(warm.published == 1 && warm.failed.is_empty(), || {
        format!("the first pass: {warm:?}")
    })?;
    const N: usize = 10;
    outbox.enqueue(bank, N).await?;
    server.pause()?;
    let paused = tokio::time::timeout(GUARD, idem.relay(&publisher, 100)).await;
    server.resume()?;
    let paused = paused
        .map_err(|_| fail("a relay pass to the paused broker hung (hang guard)"))?
        .map_err(db)?;
    check(paused.published == 0 && paused.failed.len() == 1, || {
        format!("a pass while the broker does not answer must publish nothing: {paused:?}")
    })?;
    let failure = paused.failed[0].to_string();
    let unsent = bank.unsent().await?;
    check(unsent == N as u64, || {
        format!(
            "{unsent} messages unsent after the unconfirmed pass, expected all {N}: a message was marked sent without a confirmation"
        )
    })?;
    // Resumed: later passes publish everything (the unconfirmed message perhaps twice).
    // Short retry pauses: the unconfirmed message's next attempt is due within a fraction
    // of a second instead of the production default of a second doubling per failure.
    let options = RelayOptions {
        base_delay: Duration::from_millis(50),
        max_delay: Duration::from_millis(200),
        ..RelayOptions::with_batch(100)
    };
    let mut publisher = publisher;
    let mut passes = 0;
    while bank.unsent().await? > 0 {
        passes += 1;
        check(passes <= 200, || {
            "the relay never caught up (hang guard)".into()
        })?;
        match tokio::time::timeout(GUARD, idem.relay_with(&publisher, &options)).await {
            Ok(Ok(r)) if r.failed.is_empty() => {
                if r.published == 0 {
                    // Nothing due yet (a retry pause is running): wait for it.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            _ => {
                // As `idem relay` does: a fresh connection after a failure.
                tokio::time::sleep(Duration::from_millis(200)).await;
                publisher = outbox.publisher().await?;
            }
        }
    }
    let copies = outbox.copies().await?;
    let total: usize = copies.values().sum();
    println!(
        "figures: {}",
        json!({
            "case": "relay while the broker is paused",
            "broker": outbox.broker.name(),
            "engine": K::NAME,
            "messages": N + 1,
            "unconfirmed": N,
            "marked_sent_unconfirmed": N as u64 - unsent,
            "copies": total,
            "lost": 0,
        })
    );
    Ok(format!(
        "{} messages; the pass while paused failed ({failure}) and marked none of {N} sent; resumed: all marked sent after {passes} more passes, {total} copies at the broker (each at least once)",
        N + 1
    ))
}

/// A listener that accepts connections and never says a word: connecting consumers and
/// publishers give up within their timeout, with a connection error.
async fn silent_listener(broker: Broker) -> Res {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(db)?;
    let port = listener.local_addr().map_err(db)?.port();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    let accept = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            keep.lock().unwrap().push(socket);
        }
    });
    let url = match broker {
        Broker::Amqp => format!("amqp://guest:secret-pw@127.0.0.1:{port}/%2f"),
        Broker::Nats => format!("nats://127.0.0.1:{port}"),
    };
    let (bank, _) = SqliteBank::private("silent").await?;
    let result = async {
        bank.setup().await.map_err(db)?;
        let consumer = Consumer::new(
            Idem::new(bank.backend().clone()),
            Subscriber::new(SUB).unwrap(),
            Credit::<SqliteBank>::new(Arc::default(), Duration::ZERO, None),
        )
        .with_options(options());
        let token = CancellationToken::new();
        let consumed = match broker {
            Broker::Amqp => {
                tokio::time::timeout(
                    GUARD,
                    idem::consumer::amqp::run(
                        &consumer,
                        &AmqpConfig::new(url.as_str(), "q"),
                        token,
                    ),
                )
                .await
            }
            Broker::Nats => {
                tokio::time::timeout(
                    GUARD,
                    idem::consumer::nats::run(
                        &consumer,
                        &NatsConfig::new(url.as_str(), "S", "c"),
                        token,
                    ),
                )
                .await
            }
        }
        .map_err(|_| fail("the consumer hung on a silent broker (hang guard)"))?;
        let consumer_error = match consumed {
            Err(e @ ConsumerError::Connect { .. }) => e.to_string(),
            other => {
                return Err(fail(format!(
                    "the consumer: expected a connection error, got {other:?}"
                )));
            }
        };
        check(!consumer_error.contains("secret-pw"), || {
            format!("the password shows in {consumer_error:?}")
        })?;
        let published = tokio::time::timeout(GUARD, async {
            match broker {
                Broker::Amqp => AmqpPublisher::connect_within(&url, BROKER_TIMEOUT)
                    .await
                    .map(AnyPublisher::Amqp),
                Broker::Nats => NatsPublisher::connect(&url, "SILENT")
                    .await
                    .map(AnyPublisher::Nats),
            }
        })
        .await
        .map_err(|_| fail("the publisher hung on a silent broker (hang guard)"))?;
        let publisher_error = match published {
            Err(e @ PublishError::Connect { .. }) => e.to_string(),
            other => {
                return Err(fail(format!(
                    "the publisher: expected a connection error, got {other:?}"
                )));
            }
        };
        check(!publisher_error.contains("secret-pw"), || {
            format!("the password shows in {publisher_error:?}")
        })?;
        println!(
            "[{} silent listener] consumer: {consumer_error}; publisher: {publisher_error}",
            broker.name(),
        );
        Ok(())
    }
    .await;
    accept.abort();
    let _ = bank.close().await;
    result
}

/// The broker stops for good under a running consumer: the loop stops with a broker
/// failure once its reconnection period is over, instead of waiting forever.
async fn gone_for_good(broker: Broker) -> Res {
    let mut server = private_broker(broker).await?;
    let (bank, _) = SqliteBank::private("gone").await?;
    let result = async {
        bank.setup().await.map_err(db)?;
        let topic = Topic::create(broker, &server.url(), Layout::Separate, "gone").await?;
        let period = Duration::from_secs(3);
        let task = topic.spawn::<SqliteBank>(
            bank.backend().clone(),
            Credit::new(Arc::default(), Duration::ZERO, None),
            options().reconnect_for(period),
            CancellationToken::new(),
        );
        // Running: let it take a pull or its queue, then the broker goes.
        tokio::time::sleep(Duration::from_secs(1)).await;
        server.stop().await?;
        let ended = tokio::time::timeout(GUARD, task)
            .await
            .map_err(|_| fail("the consumer waited for the broker forever (hang guard)"))?
            .map_err(db)?;
        match ended {
            Err(e @ ConsumerError::Broker { .. })
                if e.to_string().contains("get the broker back") =>
            {
                println!(
                    "[{} broker gone for good] the consumer stopped: {e}",
                    broker.name()
                );
                Ok(())
            }
            other => Err(fail(format!(
                "expected a broker failure after {period:?} of reconnection, got {other:?}"
            ))),
        }
    }
    .await;
    let _ = bank.close().await;
    server.remove().await;
    result
}

// ---------------------------------------------------------------- harness

fn block_on(f: impl Future<Output = Res>) -> Res {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(db)?;
    rt.block_on(f)
}

fn per_engine<K: Engine>(trials: &mut Vec<Trial>) {
    for broker in [Broker::Amqp, Broker::Nats] {
        let case = match broker {
            Broker::Amqp => "dead_letter_queue_deleted",
            Broker::Nats => "dead_letter_stream_deleted",
        };
        trials.push(Trial::test(
            format!("{}::{}::{case}", broker.name(), K::NAME),
            move || block_on(dead_letter_queue_deleted::<K>(broker)),
        ));
    }
    trials.push(Trial::test(
        format!("nats::{}::dead_letter_captured_by_source", K::NAME),
        || block_on(dead_letter_captured_by_source::<K>()),
    ));
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    per_engine::<SqliteBank>(&mut trials);
    per_engine::<PgBank>(&mut trials);
    per_engine::<MysqlBank>(&mut trials);
    trials.push(Trial::test("amqp::queue_deleted_in_flight", || {
        block_on(queue_deleted_in_flight())
    }));
    trials.push(Trial::test("amqp::consumed_queue_deleted", || {
        block_on(consumed_queue_deleted())
    }));
    trials.push(Trial::test(
        "nats::sqlite::dead_letter_delivered_back_is_refused",
        || block_on(dead_letter_delivered_back_is_refused()),
    ));
    trials.push(Trial::test("amqp::channel_closed_under_handler", || {
        block_on(channel_closed_under_handler())
    }));
    for broker in [Broker::Amqp, Broker::Nats] {
        let name = broker.name();
        trials.push(Trial::test(
            format!("{name}::restarted_mid_stream"),
            move || block_on(restarted_mid_stream(broker)),
        ));
        trials.push(Trial::test(format!("{name}::never_confirms"), move || {
            block_on(never_confirms(broker))
        }));
        trials.push(Trial::test(format!("{name}::silent_listener"), move || {
            block_on(silent_listener(broker))
        }));
        trials.push(Trial::test(format!("{name}::gone_for_good"), move || {
            block_on(gone_for_good(broker))
        }));
    }
    libtest_mimic::run(&args, trials).exit_code()
}
