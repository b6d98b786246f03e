//! NATS JetStream through async-nats.
//!
//! - **Message ID** ([`MessageIdSource`]): by default the `Nats-Msg-Id` header, the
//!   publisher's own ID (JetStream also uses it to drop re-published duplicates inside
//!   the stream's duplicate window; idem covers redeliveries and duplicates published
//!   after that window). Alternatively the stream sequence (`<stream>:<sequence>`):
//!   every publish is then a new message, and only redeliveries are recognised.
//! - **Stream**: created by others; the consumer only looks it up. The durable pull
//!   consumer is created when missing (explicit acks, [`NatsConfig::ack_wait`], optional
//!   filter subject) and reused as it is when it exists.
//! - **Acknowledgement**: explicit, after the commit (`+ACK`, confirmed by the server:
//!   double ack). A dead-lettered message is published through JetStream to
//!   [`NatsConfig::dead_letter_subject`] with the `x-idem-dead-letter-*` headers and its
//!   original headers (so its `Nats-Msg-Id`), and acknowledged only after the stream
//!   that captures that subject stored it. That subject must belong to a stream (not the
//!   consumed one's filter), or the publish fails and the message is redelivered.
//! - **Redelivery**: `-NAK` with a delay (the [`crate::Backoff`] pause); the server also
//!   redelivers any message not acknowledged within `ack_wait` (a crash).
//! - **Prefetch**: the pull batch size ([`crate::Options::prefetch`]).

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind, Context};
use futures_util::StreamExt;
use idem_core::Backend;
use tokio_util::sync::CancellationToken;

use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::handler::{Consumer, Event, Failures, Handler, Stats};
use crate::{DETAIL_HEADER, REASON_HEADER, SUBSCRIBER_HEADER};

mod publisher;
pub use publisher::{DEFAULT_STREAM, NatsPublisher};

/// The header JetStream publishers set for deduplication, used as the message ID.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Where the message ID comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MessageIdSource {
    /// The `Nats-Msg-Id` header (missing → dead-lettered as `missing-message-id`).
    #[default]
    Header,
    /// The stream and its sequence number, `<stream>:<sequence>`.
    StreamSequence,
}

/// Where to consume from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The server, `nats://host:port`.
    pub url: String,
    /// The stream (created by others).
    pub stream: String,
    /// The durable consumer's name (created when missing).
    pub consumer: String,
    /// The subject dead letters are published to (captured by some stream).
    pub dead_letter_subject: String,
    /// Only for a consumer created here: the subject filter (all of the stream by default).
    pub filter_subject: Option<String>,
    /// Only for a consumer created here: how long the server waits for an
    /// acknowledgement before it redelivers.
    pub ack_wait: Duration,
    /// Where the message ID comes from.
    pub id_source: MessageIdSource,
}

impl NatsConfig {
    /// Consume `stream` through the durable consumer `consumer`; dead letters go to
    /// `<stream>.dead-letter`, the acknowledgement wait is 30 s.
    pub fn new(
        url: impl Into<String>,
        stream: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        let stream = stream.into();
        Self {
            url: url.into(),
            dead_letter_subject: format!("{stream}.dead-letter"),
            stream,
            consumer: consumer.into(),
            filter_subject: None,
            ack_wait: Duration::from_secs(30),
            id_source: MessageIdSource::Header,
        }
    }

    /// Sets the dead-letter subject.
    #[must_use]
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = subject.into();
        self
    }

    /// Sets the filter subject of a consumer created here.
    #[must_use]
    pub fn filter_subject(mut self, subject: Option<String>) -> Self {
        self.filter_subject = subject;
        self
    }

    /// Sets the acknowledgement wait of a consumer created here.
    #[must_use]
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// Sets where the message ID comes from.
    #[must_use]
    pub fn id_source(mut self, source: MessageIdSource) -> Self {
        self.id_source = source;
        self
    }

    fn validate(&self) -> Result<(), ConsumerError> {
        let bad = |what: &str, v: &str| {
            v.is_empty()
                || v.chars()
                    .any(|c| c.is_whitespace() || c == '.' && what != "subject")
        };
        if bad("stream", &self.stream) {
            return Err(ConsumerError::Config(format!(
                "stream name {:?} must be non-empty, without spaces or dots",
                self.stream
            )));
        }
        if bad("consumer", &self.consumer) {
            return Err(ConsumerError::Config(format!(
                "consumer name {:?} must be non-empty, without spaces or dots",
                self.consumer
            )));
        }
        if bad("subject", &self.dead_letter_subject) {
            return Err(ConsumerError::Config(format!(
                "dead-letter subject {:?} must be non-empty, without spaces",
                self.dead_letter_subject
            )));
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(ConsumerError::Config(
                "the acknowledgement wait must be at least 1 s".into(),
            ));
        }
        Ok(())
    }
}

fn broker<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    action: impl Into<String>,
) -> impl FnOnce(E) -> ConsumerError {
    let action = action.into();
    move |e| ConsumerError::broker("nats", action, e)
}

/// Connects to `url` and returns its JetStream context (requests wait up to
/// [`REQUEST_TIMEOUT`]).
pub async fn connect(url: &str) -> Result<Context, ConsumerError> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| ConsumerError::Connect {
            broker: "nats",
            target: url.to_owned(),
            source: e.into(),
        })?;
    let mut js = jetstream::new(client);
    js.set_timeout(REQUEST_TIMEOUT);
    Ok(js)
}

/// How long a JetStream request (a publish acknowledgement, a confirmed `+ACK`) may take
/// before it counts as failed: generous, so a loaded server is not mistaken for a lost one.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The durable pull consumer `config.consumer` on `config.stream`, created when missing.
pub async fn durable_consumer(
    js: &Context,
    config: &NatsConfig,
) -> Result<PullConsumer, ConsumerError> {
    let stream = js
        .get_stream(&config.stream)
        .await
        .map_err(broker(format!("find stream {:?}", config.stream)))?;
    stream
        .get_or_create_consumer(
            &config.consumer,
            PullConfig {
                durable_name: Some(config.consumer.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                filter_subject: config.filter_subject.clone().unwrap_or_default(),
                ..PullConfig::default()
            },
        )
        .await
        .map_err(broker(format!(
            "find or create consumer {:?} on stream {:?}",
            config.consumer, config.stream
        )))
}

fn message_id(message: &jetstream::Message, source: MessageIdSource) -> Option<String> {
    match source {
        MessageIdSource::Header => message
            .headers
            .as_ref()
            .and_then(|h| h.get(MSG_ID_HEADER))
            .map(|v| v.as_str().to_owned()),
        MessageIdSource::StreamSequence => message
            .info()
            .ok()
            .map(|i| format!("{}:{}", i.stream, i.stream_sequence)),
    }
}

/// How long a pull request waits for messages before the loop looks at its clock.
const PULL_EXPIRY: Duration = Duration::from_secs(1);

/// Consumes through the durable consumer until `shutdown` is cancelled or nothing
/// arrived for [`crate::Options::max_idle`]. The message in hand when `shutdown` fires is
/// finished; messages of the current pull not yet started are returned at once (`-NAK`).
pub async fn run<B, H>(
    consumer: &Consumer<B, H>,
    config: &NatsConfig,
    shutdown: CancellationToken,
) -> Result<Stats, ConsumerError>
where
    B: Backend,
    H: Handler<B>,
{
    config.validate()?;
    let options = *consumer.options();
    let js = connect(&config.url).await?;
    let pull = durable_consumer(&js, config).await?;
    let mut stats = Stats::default();
    let mut failures = Failures::default();
    let mut quiet = Duration::ZERO;
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        if options.max_idle.is_some_and(|idle| quiet >= idle) {
            break;
        }
        let started = tokio::time::Instant::now();
        let mut batch = pull
            .batch()
            .max_messages(usize::from(options.prefetch.max(1)))
            .expires(PULL_EXPIRY)
            .messages()
            .await
            .map_err(broker("pull messages"))?;
        let mut got = false;
        while let Some(next) = batch.next().await {
            let message = next.map_err(broker("receive a message"))?;
            if shutdown.is_cancelled() {
                message
                    .ack_with(AckKind::Nak(None))
                    .await
                    .map_err(broker("return a message"))?;
                stats.delivered += 1;
                stats.returned += 1;
                continue;
            }
            got = true;
            stats.delivered += 1;
            let id = message_id(&message, config.id_source);
            let decision = consumer.handle(id.as_deref(), &message.payload).await;
            let redelivered = message.info().map(|i| i.delivered > 1).unwrap_or(false);
            consumer.handler().observe(&Event {
                message_id: id.as_deref(),
                redelivered,
                decision: &decision,
            });
            let decision = match decision {
                Decision::DeadLetter { reason, detail } => {
                    let mut headers = message.headers.clone().unwrap_or_default();
                    headers.insert(REASON_HEADER, reason.code());
                    headers.insert(DETAIL_HEADER, detail.as_str());
                    headers.insert(SUBSCRIBER_HEADER, consumer.subscriber().as_str());
                    match publish_stored(
                        &js,
                        &config.dead_letter_subject,
                        headers,
                        message.payload.to_vec(),
                    )
                    .await
                    {
                        Ok(()) => Decision::DeadLetter { reason, detail },
                        Err(e) => Decision::redeliver(e.to_string()),
                    }
                }
                other => other,
            };
            match failures.after(&decision, &options.backoff) {
                Some(pause) => {
                    // The server waits `pause` before redelivering; this loop waits too, so
                    // a database outage is not a hot loop over the rest of the stream.
                    message
                        .ack_with(AckKind::Nak(Some(pause)))
                        .await
                        .map_err(broker("return a message for redelivery"))?;
                    tokio::select! {
                        () = shutdown.cancelled() => {}
                        () = tokio::time::sleep(pause) => {}
                    }
                }
                None => message.double_ack().await.map_err(broker("acknowledge"))?,
            }
            stats.count(&decision);
        }
        if got {
            quiet = Duration::ZERO;
        } else {
            quiet += started.elapsed();
        }
    }
    Ok(stats)
}

/// Publishes through JetStream and waits until a stream stored the message.
pub async fn publish_stored(
    js: &Context,
    subject: &str,
    headers: HeaderMap,
    body: Vec<u8>,
) -> Result<(), ConsumerError> {
    js.publish_with_headers(subject.to_owned(), headers, body.into())
        .await
        .map_err(broker(format!("publish to {subject:?}")))?
        .await
        .map_err(broker(format!("publish to {subject:?}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        let ok = NatsConfig::new("nats://127.0.0.1:4222", "ORDERS", "billing");
        assert!(ok.validate().is_ok());
        assert_eq!(ok.dead_letter_subject, "ORDERS.dead-letter");
        assert!(NatsConfig::new("n", "a.b", "c").validate().is_err());
        assert!(NatsConfig::new("n", "s", "").validate().is_err());
        assert!(
            NatsConfig::new("n", "s", "c")
                .ack_wait(Duration::from_millis(10))
                .validate()
                .is_err()
        );
    }
}
