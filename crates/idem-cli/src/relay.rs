//! `idem relay`: publishes the transactional outbox (the messages effects enqueued, such
//! as the orders' `order.paid`) to RabbitMQ or NATS JetStream with `Idem::relay`.

use std::time::Duration;

use clap::Args;
use idem::consumer::{CancellationToken, PublishError};
use idem::core::RelayError;
use idem::core::runs::OutboxRow;
use idem::{Idem, Publisher};
use idem_conformance::Bank;

use crate::fail::{self, Fail, connect_within};

/// What `idem relay --help` shows after the options.
pub(crate) const RELAY_HELP: &str = "\
WHAT IS PUBLISHED:
  Every message committed to the outbox (idem_outbox), the oldest first, in order per
  destination. Each pass claims a batch in a short transaction, publishes with no
  transaction open (each publish bounded by --publish-timeout-ms), then marks what the
  broker confirmed sent in a second short transaction.
  RabbitMQ: the default exchange (or --exchange), routing key = the destination, the
            message ID in the `message_id` property, persistent, publisher confirms; the
            first time a destination is seen, the queue of that name is declared durable
            when missing (not with --exchange).
  NATS:     JetStream, subject = the destination, the message ID in the `Nats-Msg-Id`
            header, the stream's PubAck awaited; a subject no stream captures is added to
            --stream (created when missing).
  Delivery is at least once: a relay stopped between the broker's confirmation and its
  record leaves its claim to run out, and the message is published again, with the same
  message ID. Several relays may run at once: each claims the rows it publishes and skips
  the others' (order is kept).
  A message the broker refuses (or does not confirm in time) is tried again after a
  growing pause; after --max-attempts it is dead: skipped, and the rest of its
  destination goes on. `idem outbox list|retry|drop` shows and handles dead messages.
  --once: passes until one publishes nothing, then prints `published N` and exits 0.
  Otherwise: runs until SIGINT or SIGTERM (the pass in hand finishes), retrying failures
  after a growing pause, and prints `published N` when it stops.
  A broker that cannot be reached at start exits 7, one that refuses the credentials 9
  (as a database does); a failure during an --once run exits 1 (what was confirmed
  before it is marked sent).";

/// Where `idem relay` publishes: one broker.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("broker").args(["amqp", "nats"]).required(true)))]
pub(crate) struct RelayArgs {
    /// RabbitMQ URL (amqp://user:pass@host:5672/vhost).
    #[arg(long, value_name = "URL")]
    amqp: Option<String>,
    /// RabbitMQ: publish to this existing exchange (routed by its bindings, the
    /// destination as routing key) instead of the default exchange; no queue is declared.
    #[arg(long, value_name = "NAME", requires = "amqp", conflicts_with = "nats")]
    exchange: Option<String>,
    /// NATS URL (nats://[user:password@]host:4222, or a cluster's URLs separated by
    /// commas).
    #[arg(long, value_name = "URL")]
    nats: Option<String>,
    /// NATS: the stream that captures destinations no stream captures yet (created when
    /// missing).
    #[arg(long, value_name = "NAME", default_value = "IDEM_OUTBOX")]
    stream: String,
    /// Messages per pass (one transaction each; at most 1000).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,
    /// Attempts per message before it is dead (no longer published; see `idem outbox`).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_attempts: u32,
    /// How long one publish may wait for the broker's confirmation before the attempt
    /// counts as failed.
    #[arg(long, value_name = "MS", default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..=600_000))]
    publish_timeout_ms: u64,
    /// Stop after the first pass that published nothing.
    #[arg(long)]
    once: bool,
    /// Pause after a pass that published nothing before the next one.
    #[arg(long, value_name = "MS", default_value_t = 200,
        value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    interval_ms: u64,
}

/// Where outbox messages go (RabbitMQ or NATS JetStream), to connect and reconnect:
/// shared by `idem relay` and `idem maintain`.
#[derive(Debug, Clone)]
pub(crate) enum Target {
    #[cfg(feature = "amqp")]
    Amqp {
        url: String,
        exchange: Option<String>,
    },
    #[cfg(feature = "nats")]
    Nats { url: String, stream: String },
}

/// The broker's publisher.
#[derive(Debug)]
pub(crate) enum AnyPublisher {
    #[cfg(feature = "amqp")]
    Amqp(idem::consumer::amqp::AmqpPublisher),
    #[cfg(feature = "nats")]
    Nats(idem::consumer::nats::NatsPublisher),
}

impl Publisher for AnyPublisher {
    type Error = PublishError;

    async fn publish(&self, message: &OutboxRow) -> Result<(), PublishError> {
        match self {
            #[cfg(feature = "amqp")]
            Self::Amqp(p) => p.publish(message).await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish(message).await,
        }
    }
}

impl AnyPublisher {
    async fn close(self) {
        let _ = match self {
            #[cfg(feature = "amqp")]
            Self::Amqp(p) => p.close().await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.close().await,
        };
    }
}

impl Target {
    /// The broker a command's options name: `None` when neither `--amqp` nor `--nats`
    /// was given; an error when the option's feature was not built in.
    pub(crate) fn from_options(
        amqp: Option<&str>,
        exchange: Option<&str>,
        nats: Option<&str>,
        stream: &str,
    ) -> Result<Option<Self>, Fail> {
        let unbuilt = |feature: &str| {
            Fail::new(
                fail::INVALID_INPUT,
                format!("this idem was built without the `{feature}` feature"),
            )
        };
        if let Some(url) = amqp {
            #[cfg(feature = "amqp")]
            return Ok(Some(Self::Amqp {
                url: url.to_owned(),
                exchange: exchange.map(str::to_owned),
            }));
            #[cfg(not(feature = "amqp"))]
            {
                let _ = (url, exchange);
                return Err(unbuilt("amqp"));
            }
        }
        if let Some(url) = nats {
            #[cfg(feature = "nats")]
            return Ok(Some(Self::Nats {
                url: url.to_owned(),
                stream: stream.to_owned(),
            }));
            #[cfg(not(feature = "nats"))]
            {
                let _ = (url, stream);
                return Err(unbuilt("nats"));
            }
        }
        let _ = (unbuilt, exchange, stream);
        Ok(None)
    }

    fn from_args(args: &RelayArgs) -> Result<Self, Fail> {
        Self::from_options(
            args.amqp.as_deref(),
            args.exchange.as_deref(),
            args.nats.as_deref(),
            &args.stream,
        )?
        .ok_or_else(|| Fail::new(fail::INVALID_INPUT, "give --amqp URL or --nats URL"))
    }

    /// The broker's name and URL, for messages.
    fn describe(&self) -> (&'static str, &str) {
        match self {
            #[cfg(feature = "amqp")]
            Self::Amqp { url, .. } => ("amqp", url),
            #[cfg(feature = "nats")]
            Self::Nats { url, .. } => ("nats", url),
        }
    }

    /// Connects once, without a bound of its own.
    async fn connect_once(&self) -> Result<AnyPublisher, PublishError> {
        match self {
            #[cfg(feature = "amqp")]
            Self::Amqp { url, exchange } => {
                let p = idem::consumer::amqp::AmqpPublisher::connect(url).await?;
                let p = match exchange {
                    Some(x) => p.to_exchange(x).await?,
                    None => p,
                };
                Ok(AnyPublisher::Amqp(p))
            }
            #[cfg(feature = "nats")]
            Self::Nats { url, stream } => Ok(AnyPublisher::Nats(
                idem::consumer::nats::NatsPublisher::connect(url, stream).await?,
            )),
        }
    }

    /// Connects, giving up with exit code 8 after the usual connection timeout.
    async fn connect(&self) -> Result<AnyPublisher, Fail> {
        match tokio::time::timeout(fail::CONNECT_TIMEOUT, self.connect_once()).await {
            Ok(connected) => connected.map_err(publish_fail),
            Err(_) => Err(Fail::new(
                fail::TIMED_OUT,
                format!(
                    "no answer from the broker within {} s",
                    fail::CONNECT_TIMEOUT.as_secs()
                ),
            )),
        }
    }
}

/// A publisher that connects on first use and again after a failed publish (the broker
/// restarted), so a long-running loop (`idem maintain`) keeps relaying without a restart.
#[derive(Debug)]
pub(crate) struct Reconnecting {
    target: Target,
    connected: tokio::sync::Mutex<Option<AnyPublisher>>,
}

impl Reconnecting {
    /// Connects lazily to `target`.
    pub(crate) fn new(target: Target) -> Self {
        Self {
            target,
            connected: tokio::sync::Mutex::new(None),
        }
    }
}

impl Publisher for Reconnecting {
    type Error = PublishError;

    async fn publish(&self, message: &OutboxRow) -> Result<(), PublishError> {
        let mut slot = self.connected.lock().await;
        let publisher = match slot.take() {
            Some(p) => p,
            None => match tokio::time::timeout(fail::CONNECT_TIMEOUT, self.target.connect_once())
                .await
            {
                Ok(connected) => connected?,
                Err(_) => {
                    let (broker, url) = self.target.describe();
                    return Err(PublishError::Connect {
                        broker,
                        target: idem::redact(url),
                        source: Box::new(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("no answer within {} s", fail::CONNECT_TIMEOUT.as_secs()),
                        )),
                    });
                }
            },
        };
        let published = publisher.publish(message).await;
        if published.is_ok() {
            *slot = Some(publisher);
        } else {
            // The connection may be gone: the next message connects afresh.
            publisher.close().await;
        }
        published
    }
}

fn publish_fail(e: PublishError) -> Fail {
    let code = match &e {
        e if e.is_authentication() => fail::AUTHENTICATION,
        PublishError::Config(_) => fail::INVALID_INPUT,
        PublishError::Connect { .. } => fail::CANNOT_CONNECT,
        _ => fail::OTHER,
    };
    Fail::new(code, e.to_string())
}

fn relay_fail(e: RelayError) -> Fail {
    match e {
        RelayError::Db(db) => Fail::from(db),
        other => Fail::new(fail::OTHER, other.to_string()),
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
        eprintln!("stopping: finishing the pass in hand");
        token.cancel();
    });
    Ok(())
}

/// The pause after the `failures`-th failure in a row: 0.5 s doubling up to 10 s.
fn backoff(failures: u32) -> Duration {
    let ms = 500u64.saturating_mul(1 << failures.saturating_sub(1).min(5));
    Duration::from_millis(ms.min(10_000))
}

pub(crate) async fn relay<K: Bank>(url: &str, args: RelayArgs) -> Result<(), Fail> {
    let target = Target::from_args(&args)?;
    let shutdown = CancellationToken::new();
    cancel_on_signals(shutdown.clone())?;
    // The operator's database: idem's tables must be there already (`idem migrate`); the
    // relay creates nothing, and none of the demo's tables.
    let bank = connect_within(url, K::connect(url, None)).await?;
    let publisher = match target.connect().await {
        Ok(p) => p,
        Err(e) => {
            let _ = bank.close().await;
            return Err(e);
        }
    };
    let idem = Idem::new(bank.backend().clone());
    let (published, result) = run_passes(&idem, &target, publisher, &args, &shutdown).await;
    let closed = bank.close().await;
    if result.is_err() && published > 0 {
        eprintln!("relay: published {published} before the failure");
    }
    result?;
    closed.map_err(Fail::from)?;
    say!("published {published}");
    Ok(())
}

/// Runs relay passes; returns the messages published and how it ended.
async fn run_passes<B: idem::OutboxStore>(
    idem: &Idem<B>,
    target: &Target,
    publisher: AnyPublisher,
    args: &RelayArgs,
    shutdown: &CancellationToken,
) -> (u64, Result<(), Fail>) {
    let mut publisher = Some(publisher);
    let mut published = 0u64;
    let mut failures = 0u32;
    let interval = Duration::from_millis(args.interval_ms);
    let publish_timeout = Duration::from_millis(args.publish_timeout_ms);
    let options = idem::core::RelayOptions {
        batch: args.batch,
        max_attempts: args.max_attempts,
        publish_timeout,
        claim_lease: (publish_timeout * 3).max(Duration::from_secs(60)),
        ..idem::core::RelayOptions::default()
    };
    let result = loop {
        if shutdown.is_cancelled() {
            break Ok(());
        }
        let Some(p) = publisher.as_ref() else {
            // Reconnecting after a broker failure (not with --once).
            match target.connect().await {
                Ok(p) => {
                    eprintln!("relay: reconnected to the broker");
                    publisher = Some(p);
                }
                Err(e) => {
                    failures += 1;
                    let pause = backoff(failures);
                    eprintln!("relay: {}; retrying in {pause:?}", e.message);
                    pause_or_stop(pause, shutdown).await;
                }
            }
            continue;
        };
        match idem.relay_with(p, &options).await {
            Ok(report) if report.failed.is_empty() => {
                failures = 0;
                published += report.published;
                if report.published == 0 {
                    if args.once {
                        break Ok(());
                    }
                    pause_or_stop(interval, shutdown).await;
                }
            }
            Ok(report) => {
                // The broker refused a message: it is tried again after its pause (or is
                // dead); its destination waits, in order; the others went on.
                published += report.published;
                for failure in &report.failed {
                    eprintln!("relay: {failure}");
                }
                if args.once {
                    break Err(Fail::new(
                        fail::OTHER,
                        format!(
                            "{} destination(s) could not be published; their messages stay in the outbox",
                            report.failed.len()
                        ),
                    ));
                }
                failures += 1;
                let pause = backoff(failures);
                eprintln!("relay: retrying in {pause:?} with a fresh broker connection");
                // The connection may be gone: start over with a fresh one.
                if let Some(p) = publisher.take() {
                    p.close().await;
                }
                pause_or_stop(pause, shutdown).await;
            }
            Err(e) if args.once => break Err(relay_fail(e)),
            Err(e) => {
                failures += 1;
                let pause = backoff(failures);
                eprintln!("relay: {e}; retrying in {pause:?}");
                pause_or_stop(pause, shutdown).await;
            }
        }
    };
    if let Some(p) = publisher {
        p.close().await;
    }
    (published, result)
}

async fn pause_or_stop(pause: Duration, shutdown: &CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep(pause) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_bounded() {
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(2), Duration::from_secs(1));
        assert_eq!(backoff(40), Duration::from_secs(10));
    }
}
