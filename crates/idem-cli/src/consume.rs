//! `idem consume` and `idem publish`: the demo's credit as an idempotent consumer on
//! RabbitMQ or NATS JetStream, and a publisher of test messages.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Args;
use idem::consumer::{CancellationToken, Consumer, Decision, Event, Handler, Options, Stats};
use idem::{BoxFuture, Idem, Request, Subscriber};
use idem_conformance::{Balance, Bank, BankError};
use serde::Deserialize;
use serde_json::json;

use crate::commands::{connected, positive};
use crate::fail::{self, Fail};

/// The message format, shown by `idem consume --help` and `idem publish --help`.
pub(crate) const MESSAGE_FORMAT: &str = "\
MESSAGE FORMAT (any AMQP 0-9-1 or NATS client can produce it):
  body:        the JSON object {\"account\": 1, \"amount\": 50}: an existing account and a
               positive whole amount to credit; no other fields.
  message ID:  RabbitMQ: the AMQP `message_id` basic property.
               NATS JetStream: the `Nats-Msg-Id` header (or, with --nats-message-id
               sequence, the stream sequence: then only redeliveries are duplicates).
  The account is credited once per (subscriber, message ID), however often the message
  is delivered; the delivery is acknowledged only after that commit.
  Dead letters (no message ID, an unusable ID or body, a body too large to store, the
  same ID with another body, an unknown account) are published to the dead-letter queue
  or subject with the reason in the `x-idem-dead-letter-reason` header
  (`missing-message-id`, `invalid-message-id`, `malformed-body`, `payload-too-large`,
  `payload-mismatch`, `effect-rejected`) and acknowledged only once the broker stored
  them; a dead letter the broker did not store returns the message for redelivery.
  A database failure (a lost connection included) returns the message for redelivery
  after a growing pause. A lost broker connection is made again for --reconnect-for
  seconds.
  SIGTERM or Ctrl-C: the message in hand is finished, then the command exits 0.
  stdout: one JSON line of counts when the command ends. A broker that cannot be reached
  at start exits 7, one that refuses the credentials 9 (as a database does); a broker
  failure while consuming (a refusal, or no connection again within --reconnect-for
  seconds) exits 1, and the messages in hand are redelivered.";

/// Where `idem consume` reads from: one broker, with its queue or stream.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("broker").args(["amqp", "nats"]).required(true)))]
pub(crate) struct ConsumeArgs {
    /// RabbitMQ URL (amqp://user:pass@host:5672/vhost): consume --queue.
    #[arg(long, value_name = "URL", requires = "queue")]
    amqp: Option<String>,
    /// The queue (durable, no arguments; declared that way when missing).
    #[arg(long, requires = "amqp", conflicts_with = "nats")]
    queue: Option<String>,
    /// NATS URL (nats://[user:password@]host:4222, or a cluster's URLs separated by commas):
    /// consume --stream through the durable --consumer.
    #[arg(long, value_name = "URL", requires_all = ["stream", "consumer"])]
    nats: Option<String>,
    /// The JetStream stream (created by others).
    #[arg(long, requires = "nats", conflicts_with = "amqp")]
    stream: Option<String>,
    /// The durable JetStream consumer (created when missing).
    #[arg(long, requires = "nats", conflicts_with = "amqp")]
    consumer: Option<String>,
    /// The subscriber: its own record per message ID.
    #[arg(long)]
    subscriber: String,
    /// Dead-letter queue (RabbitMQ; default `<queue>.dead-letter`) or subject (NATS,
    /// captured by a stream; default `<stream>.dead-letter`).
    #[arg(long, value_name = "NAME")]
    dead_letter: Option<String>,
    /// Deliveries taken before they are acknowledged (AMQP prefetch, JetStream batch).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    prefetch: u16,
    /// NATS: seconds the server waits for an acknowledgement before redelivering
    /// (applies when this command creates the consumer).
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    ack_wait: u64,
    /// NATS: the subject filter of a consumer created here (default: the whole stream).
    #[arg(long, requires = "nats", conflicts_with = "amqp")]
    filter_subject: Option<String>,
    /// NATS: where the message ID comes from.
    #[arg(long, value_enum, default_value_t = NatsId::Header)]
    nats_message_id: NatsId,
    /// Exit 0 after this many seconds without a delivery.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    max_idle: Option<u64>,
    /// Seconds a broker request may take: connecting, a dead letter's confirmation
    /// (not confirmed in time: the message is returned for redelivery).
    #[arg(long, value_name = "SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    broker_timeout: u64,
    /// Seconds to keep reconnecting after the broker connection was lost (0: exit at once).
    #[arg(long, value_name = "SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(0..=86_400))]
    reconnect_for: u64,
    /// Fault injection for tests: SIGKILL this process after the Nth applied message's
    /// commit, before its acknowledgement.
    #[arg(long, hide = true, value_name = "N")]
    crash_after_commit: Option<u64>,
    /// Fault injection for tests: SIGKILL this process inside the Nth effect, after its
    /// UPDATE and before the commit.
    #[arg(long, hide = true, value_name = "N")]
    crash_before_commit: Option<u64>,
}

/// `--nats-message-id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum NatsId {
    /// The `Nats-Msg-Id` header.
    Header,
    /// `<stream>:<sequence>`.
    Sequence,
}

/// The demo message.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct Credit {
    account: i64,
    amount: i64,
}

/// The demo's credit (`K::credit`, the same effect as `idem credit-message`) as a
/// consumer handler, with the hidden fault injection.
struct CreditHandler<K> {
    crash_after_commit: Option<u64>,
    crash_before_commit: Option<u64>,
    applied: AtomicU64,
    effects: Arc<AtomicU64>,
    bank: PhantomData<fn() -> K>,
}

/// Ends this process with SIGKILL (no destructors, no acknowledgement, no rollback sent):
/// what a crash or `kill -9` does.
fn kill_self(when: &str) -> ! {
    eprintln!("fault injection: SIGKILL {when}");
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &std::process::id().to_string()])
        .status();
    std::process::abort()
}

impl<K: Bank> Handler<K::B> for CreditHandler<K> {
    type Message = Credit;
    type Response = Balance;
    type Error = BankError;

    fn decode(&self, body: &[u8]) -> Result<(Credit, Request), String> {
        let credit: Credit = serde_json::from_slice(body)
            .map_err(|e| format!("the body is not {{\"account\": N, \"amount\": N}}: {e}"))?;
        positive(credit.amount).map_err(|e| e.to_string())?;
        let payload = Request::new(json!({ "account": credit.account, "amount": credit.amount }));
        Ok((credit, payload))
    }

    fn apply<'t>(
        &self,
        tx: &'t mut <K::B as idem::Backend>::Tx,
        credit: Credit,
    ) -> BoxFuture<'t, Result<Balance, BankError>> {
        let crash = self.crash_before_commit;
        let effects = Arc::clone(&self.effects);
        Box::pin(async move {
            let balance = K::credit(tx, credit.account, credit.amount).await?;
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            if crash == Some(n) {
                kill_self(&format!("in effect {n}, before its commit"));
            }
            Ok(balance)
        })
    }

    fn observe(&self, event: &Event<'_>) {
        let id = event.message_id.unwrap_or("(none)");
        let again = if event.redelivered {
            " (redelivered)"
        } else {
            ""
        };
        match event.decision {
            Decision::Applied => {
                let n = self.applied.fetch_add(1, Ordering::SeqCst) + 1;
                if self.crash_after_commit == Some(n) {
                    kill_self(&format!(
                        "after applied message {n} ({id}) committed, before its acknowledgement"
                    ));
                }
            }
            Decision::Duplicate => {
                eprintln!("duplicate: message {id}{again} was processed before; acknowledged");
            }
            Decision::DeadLetter { reason, detail } => {
                eprintln!("dead-letter: message {id}{again}: {reason}: {detail}");
            }
            Decision::Redeliver { detail } => {
                eprintln!("redeliver: message {id}{again}: {detail}");
            }
            _ => {}
        }
    }
}

/// Cancels `token` on SIGTERM or Ctrl-C.
fn cancel_on_signals(token: CancellationToken) -> Result<(), Fail> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Fail::new(fail::OTHER, format!("cannot handle SIGTERM: {e}")))?;
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| Fail::new(fail::OTHER, format!("cannot handle SIGINT: {e}")))?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("stopping: finishing the message in hand");
        token.cancel();
    });
    Ok(())
}

fn broker_fail(e: idem::consumer::ConsumerError) -> Fail {
    let code = match e {
        ref e if e.is_authentication() => fail::AUTHENTICATION,
        idem::consumer::ConsumerError::Config(_) => fail::INVALID_INPUT,
        idem::consumer::ConsumerError::Connect { .. } => fail::CANNOT_CONNECT,
        _ => fail::OTHER,
    };
    Fail::new(code, e.to_string())
}

pub(crate) async fn consume<K: Bank>(url: &str, args: ConsumeArgs) -> Result<(), Fail> {
    let subscriber = Subscriber::new(args.subscriber.as_str())?;
    let bank = connected::<K>(url).await?;
    let handler = CreditHandler {
        crash_after_commit: args.crash_after_commit,
        crash_before_commit: args.crash_before_commit,
        applied: AtomicU64::new(0),
        effects: Arc::new(AtomicU64::new(0)),
        bank: PhantomData::<fn() -> K>,
    };
    let options = Options::default()
        .prefetch(args.prefetch)
        .max_idle(args.max_idle.map(Duration::from_secs))
        .broker_timeout(Duration::from_secs(args.broker_timeout))
        .reconnect_for(Duration::from_secs(args.reconnect_for));
    let consumer =
        Consumer::new(Idem::new(bank.backend().clone()), subscriber, handler).with_options(options);
    let shutdown = CancellationToken::new();
    cancel_on_signals(shutdown.clone())?;
    let running = run_broker(&consumer, &args, shutdown);
    // The loops can run on a spawned task: checked here at compile time.
    fn is_send<T: Send>(_: &T) {}
    is_send(&running);
    let result = running.await;
    bank.close().await?;
    let stats = result?;
    say!(
        "{}",
        json!({
            "delivered": stats.delivered,
            "applied": stats.applied,
            "duplicates": stats.duplicates,
            "dead_lettered": stats.dead_lettered,
            "returned": stats.returned,
            "reconnects": stats.reconnects,
        })
    );
    eprintln!("consumed: {stats}");
    Ok(())
}

async fn run_broker<B: idem::Backend, H: Handler<B>>(
    consumer: &Consumer<B, H>,
    args: &ConsumeArgs,
    shutdown: CancellationToken,
) -> Result<Stats, Fail> {
    if let Some(url) = &args.amqp {
        #[cfg(feature = "amqp")]
        {
            use idem::consumer::amqp::{AmqpConfig, run};
            let queue = args
                .queue
                .as_deref()
                .ok_or_else(|| Fail::new(fail::INVALID_INPUT, "--amqp needs --queue"))?;
            let mut config = AmqpConfig::new(url.as_str(), queue);
            if let Some(dl) = &args.dead_letter {
                config = config.dead_letter_queue(dl.as_str());
            }
            return run(consumer, &config, shutdown).await.map_err(broker_fail);
        }
        #[cfg(not(feature = "amqp"))]
        {
            let _ = (url, consumer, shutdown);
            return Err(Fail::new(
                fail::INVALID_INPUT,
                "this idem was built without the `amqp` feature",
            ));
        }
    }
    let url = args
        .nats
        .as_deref()
        .ok_or_else(|| Fail::new(fail::INVALID_INPUT, "give --amqp URL or --nats URL"))?;
    #[cfg(feature = "nats")]
    {
        use idem::consumer::nats::{MessageIdSource, NatsConfig, run};
        let (Some(stream), Some(name)) = (&args.stream, &args.consumer) else {
            return Err(Fail::new(
                fail::INVALID_INPUT,
                "--nats needs --stream and --consumer",
            ));
        };
        let mut config = NatsConfig::new(url, stream.as_str(), name.as_str())
            .ack_wait(Duration::from_secs(args.ack_wait))
            .filter_subject(args.filter_subject.clone())
            .id_source(match args.nats_message_id {
                NatsId::Header => MessageIdSource::Header,
                NatsId::Sequence => MessageIdSource::StreamSequence,
            });
        if let Some(dl) = &args.dead_letter {
            config = config.dead_letter_subject(dl.as_str());
        }
        run(consumer, &config, shutdown).await.map_err(broker_fail)
    }
    #[cfg(not(feature = "nats"))]
    {
        let _ = (url, consumer, shutdown);
        Err(Fail::new(
            fail::INVALID_INPUT,
            "this idem was built without the `nats` feature",
        ))
    }
}

/// What `idem publish` sends, and to which broker.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("broker").args(["amqp", "nats"]).required(true)))]
pub(crate) struct PublishArgs {
    /// RabbitMQ URL: publish to --queue (declared durable when missing).
    #[arg(long, value_name = "URL", requires = "queue")]
    amqp: Option<String>,
    /// The queue.
    #[arg(long, requires = "amqp", conflicts_with = "nats")]
    queue: Option<String>,
    /// NATS URL (or a cluster's URLs separated by commas): publish through JetStream to
    /// --subject (a stream must capture it).
    #[arg(long, value_name = "URL", requires = "subject")]
    nats: Option<String>,
    /// The subject.
    #[arg(long, requires = "nats", conflicts_with = "amqp")]
    subject: Option<String>,
    /// A message ID; repeat the option for several messages, or repeat an ID to publish a
    /// duplicate on purpose. Without any, one message without an ID is published.
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<String>,
    /// Publish each message this many times.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    times: u32,
    /// The account to credit.
    #[arg(long, default_value_t = 1)]
    account: i64,
    /// The amount (not checked here: a consumer dead-letters a bad one).
    #[arg(long, default_value_t = 50, allow_negative_numbers = true)]
    amount: i64,
}

pub(crate) async fn publish(args: PublishArgs) -> Result<(), Fail> {
    let body = json!({ "account": args.account, "amount": args.amount }).to_string();
    let ids: Vec<Option<&str>> = if args.ids.is_empty() {
        vec![None]
    } else {
        args.ids.iter().map(|s| Some(s.as_str())).collect()
    };
    let mut sent = 0u64;
    if let Some(url) = &args.amqp {
        #[cfg(feature = "amqp")]
        {
            use idem::consumer::amqp::{connect, declare_queue, publish_confirmed};
            use idem::consumer::lapin::BasicProperties;
            use idem::consumer::lapin::options::ConfirmSelectOptions;
            let queue = args.queue.as_deref().unwrap_or_default();
            // Every exchange with the broker is bounded: lapin leaves some requests
            // pending for good when their channel closes under them.
            let timeout = idem::consumer::DEFAULT_BROKER_TIMEOUT;
            let silent = |what: &str| {
                Fail::new(
                    fail::OTHER,
                    format!("amqp: {what}: no answer from the broker within {timeout:?}"),
                )
            };
            let connection = connect(url).await.map_err(broker_fail)?;
            let result = async {
                let setup = async {
                    let channel = connection
                        .create_channel()
                        .await
                        .map_err(|e| Fail::new(fail::OTHER, e.to_string()))?;
                    declare_queue(&channel, queue).await.map_err(broker_fail)?;
                    channel
                        .confirm_select(ConfirmSelectOptions::default())
                        .await
                        .map_err(|e| Fail::new(fail::OTHER, e.to_string()))?;
                    Ok::<_, Fail>(channel)
                };
                let channel = tokio::time::timeout(timeout, setup)
                    .await
                    .map_err(|_| silent("open a channel in confirm mode"))??;
                for _ in 0..args.times {
                    for id in &ids {
                        let mut props = BasicProperties::default()
                            .with_delivery_mode(2)
                            .with_content_type("application/json".into());
                        if let Some(id) = id {
                            props = props.with_message_id((*id).into());
                        }
                        publish_confirmed(
                            &connection,
                            &channel,
                            queue,
                            body.as_bytes(),
                            props,
                            timeout,
                        )
                        .await
                        .map_err(broker_fail)?;
                        sent += 1;
                    }
                }
                Ok::<(), Fail>(())
            }
            .await;
            let closed = tokio::time::timeout(timeout, connection.close(200, "done".into())).await;
            result?;
            // Every message was confirmed: a close without an answer loses nothing.
            if closed.is_err() {
                eprintln!("{}", silent("close the connection").message);
            }
            eprintln!("published {sent} messages to queue {queue:?}");
            return Ok(());
        }
        #[cfg(not(feature = "amqp"))]
        {
            let _ = url;
            return Err(Fail::new(
                fail::INVALID_INPUT,
                "this idem was built without the `amqp` feature",
            ));
        }
    }
    #[cfg(feature = "nats")]
    {
        use idem::consumer::async_nats::HeaderMap;
        use idem::consumer::nats::{MSG_ID_HEADER, connect};
        let url = args.nats.as_deref().unwrap_or_default();
        let subject = args.subject.clone().unwrap_or_default();
        let js = connect(url).await.map_err(broker_fail)?;
        let mut dropped = 0u64;
        for _ in 0..args.times {
            for id in &ids {
                let mut headers = HeaderMap::new();
                if let Some(id) = id {
                    headers.insert(MSG_ID_HEADER, *id);
                }
                let ack = js
                    .publish_with_headers(subject.clone(), headers, body.clone().into())
                    .await
                    .map_err(|e| {
                        Fail::new(
                            fail::OTHER,
                            format!("nats: cannot publish to {subject:?}: {e}"),
                        )
                    })?
                    .await
                    .map_err(|e| {
                        Fail::new(
                            fail::OTHER,
                            format!("nats: cannot publish to {subject:?}: {e}"),
                        )
                    })?;
                sent += 1;
                if ack.duplicate {
                    dropped += 1;
                }
            }
        }
        eprintln!(
            "published {sent} messages to subject {subject:?} ({dropped} dropped by the stream's duplicate window)"
        );
        Ok(())
    }
    #[cfg(not(feature = "nats"))]
    {
        let _ = (ids, body, sent);
        Err(Fail::new(
            fail::INVALID_INPUT,
            "this idem was built without the `nats` feature",
        ))
    }
}
