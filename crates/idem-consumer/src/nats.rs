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
//!   double ack).
//! - **Dead letters** are published through JetStream to
//!   [`NatsConfig::dead_letter_subject`] with the original headers, the
//!   `x-idem-dead-letter-*` headers, and a message ID of their own:
//!   `Nats-Msg-Id: idem-dead-letter:<subscriber>:<stream>:<stream sequence>` (derived
//!   from the delivery, so the same for every redelivery of it), with the original ID
//!   in `x-idem-original-message-id`. Reusing the original ID would make JetStream drop
//!   the dead letter as a duplicate of the original whenever one stream captures both
//!   subjects. The original is acknowledged only after a stream stored the dead letter.
//!   A PubAck that says `duplicate` means this publish stored nothing: it counts only
//!   when the stream still holds the earlier copy of this very dead letter (same ID,
//!   same subject, at the sequence the PubAck names: the message was dead-lettered
//!   before and came back because its acknowledgement was lost). Any other duplicate,
//!   no PubAck within [`crate::Options::broker_timeout`], or no stream for the subject
//!   is a failure: the original is returned for redelivery, never acknowledged.
//! - **A dead-letter subject this consumer would receive** (captured by the consumed
//!   stream and matched by the consumer's filter, such as the default
//!   `<stream>.dead-letter` under a `<stream>.>` stream with an unfiltered consumer) is
//!   refused when the loop starts ([`crate::ConsumerError::Config`]): the consumer would
//!   apply its own dead letters as new messages.
//! - **Redelivery**: `-NAK` with a delay (the [`crate::Backoff`] pause); the server also
//!   redelivers any message not acknowledged within `ack_wait` (a crash).
//! - **Lost connection** (a server restart, a network failure): the client reconnects
//!   on its own; the loop pauses and pulls again for up to
//!   [`crate::Options::reconnect_for`]. A message whose acknowledgement failed comes
//!   back after `ack_wait` and is recognised as a duplicate.
//! - **Prefetch**: the pull batch size ([`crate::Options::prefetch`]).

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::connection::State;
use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::{self, AckKind, Context};
use futures_util::StreamExt;
use idem_core::Backend;
use tokio_util::sync::CancellationToken;

use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::handler::{Consumer, Event, Failures, Handler, Lost, Stats};
use crate::{DETAIL_HEADER, ORIGINAL_ID_HEADER, REASON_HEADER, SUBSCRIBER_HEADER};

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

/// Connects to `url` and returns its JetStream context (connecting and requests wait up
/// to [`REQUEST_TIMEOUT`]).
pub async fn connect(url: &str) -> Result<Context, ConsumerError> {
    connect_within(url, REQUEST_TIMEOUT).await
}

/// Connects to `url` and returns its JetStream context: a server that does not complete
/// the handshake within `timeout` (a listener that accepts and never answers) is a
/// [`ConsumerError::Connect`]; JetStream requests (a PubAck, a confirmed `+ACK`) wait
/// up to `timeout` too. The URL's credentials log in: `nats://user:password@host` or
/// `nats://token@host`, percent-encoded (a refusal is
/// [`ConsumerError::is_authentication`]). A cluster's URLs may be given separated by
/// commas (`nats://a:4222,nats://b:4222`): the client tries them in turn.
pub async fn connect_within(url: &str, timeout: Duration) -> Result<Context, ConsumerError> {
    let connect_error = |source: Box<dyn std::error::Error + Send + Sync>| ConsumerError::Connect {
        broker: "nats",
        target: crate::publish::redact(url),
        source,
    };
    let servers = servers(url);
    let connecting = connect_options(url)
        .connection_timeout(timeout)
        .connect(servers.as_slice());
    let client = match tokio::time::timeout(timeout.saturating_mul(2), connecting).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => return Err(connect_error(e.into())),
        Err(_) => {
            return Err(connect_error(
                format!("no answer from the server within {timeout:?}").into(),
            ));
        }
    };
    let mut js = jetstream::new(client);
    js.set_timeout(timeout);
    Ok(js)
}

/// The servers `url` names: one URL, or a cluster's URLs separated by commas
/// (`nats://a:4222,nats://b:4222`, as NATS clients take them; the client tries them in
/// turn). A comma inside one URL (in a password) does not split it: a list is only read
/// where more than one `://` is, as [`idem_core::redact`] reads it.
pub(crate) fn servers(url: &str) -> Vec<&str> {
    if url.matches("://").count() > 1 && url.contains(',') {
        url.split(',').map(str::trim).collect()
    } else {
        vec![url]
    }
}

/// The options that log in with the credentials `url` carries, as NATS URLs carry them:
/// `nats://user:password@host` a user and a password, `nats://token@host` a token
/// (percent-decoded); in a list, the first URL that carries any. async-nats 0.50 reads
/// none of them from the URL (nats-io/nats.rs#1623): without this, a server that requires
/// them refused idem with an authorization violation whatever the URL said.
pub(crate) fn connect_options(url: &str) -> async_nats::ConnectOptions {
    let decoded = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    // A URL that does not parse is left to `connect`, which says why.
    let with_login = servers(url)
        .into_iter()
        .filter_map(|one| one.parse::<async_nats::ServerAddr>().ok())
        .find(|addr| addr.username().is_some());
    let Some(addr) = with_login else {
        return async_nats::ConnectOptions::new();
    };
    match (addr.username(), addr.password()) {
        (Some(user), Some(password)) => {
            async_nats::ConnectOptions::with_user_and_password(decoded(user), decoded(password))
        }
        (Some(token), None) => async_nats::ConnectOptions::with_token(decoded(token)),
        _ => async_nats::ConnectOptions::new(),
    }
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

/// The message ID of the dead letter of a delivery: derived from the stream and the
/// stream sequence, so every redelivery of one stored message gets the same ID, and
/// never the original's ID (JetStream would drop the dead letter as a duplicate of the
/// original when one stream captures both subjects).
fn dead_letter_id(subscriber: &str, message: &jetstream::Message) -> String {
    match message.info() {
        Ok(info) => format!(
            "idem-dead-letter:{subscriber}:{}:{}",
            info.stream, info.stream_sequence
        ),
        // Not a JetStream delivery (no acknowledgement subject to parse): unique.
        Err(_) => format!(
            "idem-dead-letter:{subscriber}:{:016x}{:016x}",
            fastrand::u64(..),
            fastrand::u64(..)
        ),
    }
}

/// Whether `subject` matches the NATS subject `filter` (`*` one token, `>` the rest).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut wanted = filter.split('.');
    let mut tokens = subject.split('.');
    loop {
        match (wanted.next(), tokens.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(w), Some(t)) if w == t => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Refuses a dead-letter subject that the consumed stream captures and this consumer's
/// filter matches: the consumer would receive its own dead letters as new messages.
async fn check_dead_letter_route(
    js: &Context,
    config: &NatsConfig,
    pull: &PullConsumer,
) -> Result<(), ConsumerError> {
    let filter = &pull.cached_info().config.filter_subject;
    if !filter.is_empty() && !subject_matches(filter, &config.dead_letter_subject) {
        return Ok(());
    }
    match js
        .stream_by_subject(config.dead_letter_subject.as_str())
        .await
    {
        Ok(stream) if stream == config.stream => Err(ConsumerError::Config(format!(
            "the dead-letter subject {:?} is captured by the consumed stream {:?} and matched by \
             consumer {:?}'s filter ({}): the consumer would receive its own dead letters as new \
             messages; give the consumer a filter subject that excludes it, or choose a \
             dead-letter subject another stream captures",
            config.dead_letter_subject,
            config.stream,
            config.consumer,
            if filter.is_empty() {
                "the whole stream".to_owned()
            } else {
                format!("{filter:?}")
            }
        ))),
        Ok(_) => Ok(()),
        // No stream captures it (yet): each dead letter fails and its message is returned
        // until one does.
        Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => Ok(()),
        Err(e) => Err(broker(format!(
            "find the stream of the dead-letter subject {:?}",
            config.dead_letter_subject
        ))(e)),
    }
}

/// Consumes through the durable consumer until `shutdown` is cancelled or nothing
/// arrived for [`crate::Options::max_idle`]. The message in hand when `shutdown` fires is
/// finished; messages of the current pull not yet started are returned at once (`-NAK`).
/// A lost connection is waited out for up to [`crate::Options::reconnect_for`].
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
    let js = connect_within(&config.url, options.broker_timeout).await?;
    let pull = durable_consumer(&js, config).await?;
    check_dead_letter_route(&js, config, &pull).await?;
    let client = js.client();
    let mut stats = Stats::default();
    let mut failures = Failures::default();
    let mut quiet = Duration::ZERO;
    let mut lost: Option<Lost> = None;
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        if options.max_idle.is_some_and(|idle| quiet >= idle) {
            break;
        }
        let started = tokio::time::Instant::now();
        let pulled = session(
            consumer,
            config,
            &js,
            &pull,
            &shutdown,
            &mut stats,
            &mut failures,
        )
        .await;
        let connected = client.connection_state() == State::Connected;
        let error = match pulled {
            Ok(got) if got || connected => {
                lost = None;
                if got {
                    quiet = Duration::ZERO;
                } else {
                    quiet += started.elapsed();
                }
                continue;
            }
            Ok(_) => ConsumerError::broker(
                "nats",
                "pull messages",
                "the connection to the server is lost",
            ),
            Err(e) => e,
        };
        // The client reconnects on its own; wait for it, for a while.
        let Some(pause) = lost.get_or_insert_with(Lost::new).next_pause(&options) else {
            return Err(Lost::gave_up("nats", &options, error));
        };
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(pause) => {}
        }
    }
    stats.reconnects = reconnects(&client);
    Ok(stats)
}

/// Connections the client made again after the first.
fn reconnects(client: &async_nats::Client) -> u64 {
    client
        .statistics()
        .connects
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(1)
}

/// One pull: the batch's messages, each decided and acknowledged or returned. `Ok(true)`
/// when a message was handled, `Err` when the broker failed (the messages in hand come
/// back after `ack_wait`).
async fn session<B, H>(
    consumer: &Consumer<B, H>,
    config: &NatsConfig,
    js: &Context,
    pull: &PullConsumer,
    shutdown: &CancellationToken,
    stats: &mut Stats,
    failures: &mut Failures,
) -> Result<bool, ConsumerError>
where
    B: Backend,
    H: Handler<B>,
{
    let options = *consumer.options();
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
        let decision = match consumer.handle(id.as_deref(), &message.payload).await {
            Decision::DeadLetter { reason, detail } => {
                let mut headers = message.headers.clone().unwrap_or_default();
                if let Some(original) = message.headers.as_ref().and_then(|h| h.get(MSG_ID_HEADER))
                {
                    headers.insert(ORIGINAL_ID_HEADER, original.as_str());
                }
                let dl_id = dead_letter_id(consumer.subscriber().as_str(), &message);
                headers.insert(MSG_ID_HEADER, dl_id.as_str());
                headers.insert(REASON_HEADER, reason.code());
                headers.insert(DETAIL_HEADER, detail.as_str());
                headers.insert(SUBSCRIBER_HEADER, consumer.subscriber().as_str());
                match publish_dead_letter(
                    js,
                    &config.dead_letter_subject,
                    &dl_id,
                    headers,
                    message.payload.to_vec(),
                )
                .await
                {
                    Ok(()) => Decision::DeadLetter { reason, detail },
                    Err(e) => Decision::redeliver(format!(
                        "the dead letter ({reason}) was not stored: {e}"
                    )),
                }
            }
            other => other,
        };
        let redelivered = message.info().map(|i| i.delivered > 1).unwrap_or(false);
        consumer.handler().observe(&Event {
            message_id: id.as_deref(),
            redelivered,
            decision: &decision,
        });
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
    Ok(got)
}

/// Publishes through JetStream and waits until a stream stored the message. A PubAck
/// that says `duplicate` is an error: the stream dropped this publish as a copy of a
/// message with the same `Nats-Msg-Id` inside its duplicate window, so this publish
/// stored nothing.
pub async fn publish_stored(
    js: &Context,
    subject: &str,
    headers: HeaderMap,
    body: Vec<u8>,
) -> Result<(), ConsumerError> {
    let ack = publish_acked(js, subject, headers, body).await?;
    if ack.duplicate {
        return Err(dropped_as_duplicate(subject, &ack));
    }
    Ok(())
}

async fn publish_acked(
    js: &Context,
    subject: &str,
    headers: HeaderMap,
    body: Vec<u8>,
) -> Result<jetstream::publish::PublishAck, ConsumerError> {
    js.publish_with_headers(subject.to_owned(), headers, body.into())
        .await
        .map_err(broker(format!("publish to {subject:?}")))?
        .await
        .map_err(broker(format!("publish to {subject:?}")))
}

fn dropped_as_duplicate(subject: &str, ack: &jetstream::publish::PublishAck) -> ConsumerError {
    ConsumerError::broker(
        "nats",
        format!("publish to {subject:?}"),
        format!(
            "stream {:?} dropped the message as a duplicate of its message {} (the same \
             Nats-Msg-Id inside the duplicate window): this publish stored nothing",
            ack.stream, ack.sequence
        ),
    )
}

/// Publishes a dead letter with its own message ID `id` and waits until a stream stored
/// it. A PubAck that says `duplicate` stored nothing: it counts only when the stream
/// still holds the earlier copy of this very dead letter (the same ID on the same
/// subject, at the sequence the PubAck names), which is the case of a message
/// dead-lettered before, whose acknowledgement was lost, redelivered and dead-lettered
/// again. Anything else is an error, and the original must not be acknowledged.
async fn publish_dead_letter(
    js: &Context,
    subject: &str,
    id: &str,
    headers: HeaderMap,
    body: Vec<u8>,
) -> Result<(), ConsumerError> {
    let ack = publish_acked(js, subject, headers, body).await?;
    if !ack.duplicate {
        return Ok(());
    }
    let stored = async {
        let stream = js.get_stream(&ack.stream).await.ok()?;
        let earlier = stream.get_raw_message(ack.sequence).await.ok()?;
        let same_id = earlier
            .headers
            .get(MSG_ID_HEADER)
            .is_some_and(|v| v.as_str() == id);
        Some(same_id && earlier.subject.as_str() == subject)
    }
    .await;
    if stored == Some(true) {
        Ok(())
    } else {
        Err(dropped_as_duplicate(subject, &ack))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_list_splits_at_commas_between_urls_only() {
        assert_eq!(
            servers("nats://a:4222, nats://u:p@b:4222"),
            ["nats://a:4222", "nats://u:p@b:4222"]
        );
        // One URL whose password holds a comma stays whole.
        assert_eq!(servers("nats://u:p,w@a:4222"), ["nats://u:p,w@a:4222"]);
        assert_eq!(servers("nats://a:4222"), ["nats://a:4222"]);
    }

    #[test]
    fn subjects_match_filters() {
        assert!(subject_matches("ORDERS.>", "ORDERS.dead-letter"));
        assert!(subject_matches("ORDERS.*", "ORDERS.dead-letter"));
        assert!(subject_matches("ORDERS.dead-letter", "ORDERS.dead-letter"));
        assert!(subject_matches(">", "ORDERS.dead-letter"));
        assert!(!subject_matches("ORDERS.in", "ORDERS.dead-letter"));
        assert!(!subject_matches("ORDERS.*", "ORDERS.dead-letter.x"));
        assert!(!subject_matches("ORDERS.>", "ORDERS"));
        assert!(!subject_matches("ORDERS.in.>", "ORDERS.dead-letter"));
    }

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
