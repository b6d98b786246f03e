//! The other direction: publishing the transactional outbox to a broker.
//!
//! [`idem_core::Idem::relay`] reads the outbox in order and hands each message to an
//! [`idem_core::Publisher`]; this crate has one per broker:
//!
//! - `amqp::AmqpPublisher` (feature `amqp`): RabbitMQ, the default exchange (or a named
//!   one), routing key = the destination, the message ID in the `message_id` property,
//!   persistent, each publish confirmed by the broker (publisher confirms).
//! - `nats::NatsPublisher` (feature `nats`): JetStream, subject = the destination, the
//!   message ID in the `Nats-Msg-Id` header, each publish acknowledged by the stream
//!   that stored it (PubAck).
//!
//! A publish counts only once the broker confirmed it, so a message the relay marks sent
//! is on the broker. Delivery is at least once: a relay that dies between the broker's
//! confirmation and its commit publishes the message again, with the same message ID,
//! which consumers deduplicate by (and JetStream drops inside its duplicate window).

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The URL with every secret replaced by `***`, for messages ([`idem_core::redact`]).
#[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(dead_code))]
pub(crate) fn redact(url: &str) -> String {
    idem_core::redact(url)
}

/// Why a publisher could not be set up or a message could not be published. The
/// relay leaves an unpublished message in the outbox, to be published by a later pass.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The configuration is unusable (a stream name the broker refuses, …).
    #[error("invalid publisher configuration: {0}")]
    Config(String),
    /// The broker could not be reached (refused, unreachable, bad credentials:
    /// [`PublishError::is_authentication`] tells the last apart).
    #[error("{broker}: cannot connect to {target}: {source}")]
    Connect {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// The URL, password redacted.
        target: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The message's destination cannot be used as this broker's queue name, routing
    /// key or subject. Fix the destination the application enqueues.
    #[error("{broker}: destination {destination:?} cannot be used: {reason}")]
    Destination {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// The destination.
        destination: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The broker did not take the message: it negatively acknowledged it, or returned
    /// it as unroutable.
    #[error("{broker}: the broker did not take message {message_id} for {destination}: {reason}")]
    Refused {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// The destination.
        destination: String,
        /// The message ID.
        message_id: String,
        /// What the broker said.
        reason: String,
    },
    /// The broker refused an operation (declaring a queue, creating a stream,
    /// publishing), the connection to it failed, or it did not answer in time.
    #[error("{broker}: cannot {action}: {source}")]
    Broker {
        /// `"amqp"` or `"nats"`.
        broker: &'static str,
        /// What the publisher was doing.
        action: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
}

impl PublishError {
    /// A broker error while doing `action`.
    pub fn broker(
        broker: &'static str,
        action: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Broker {
            broker,
            action: action.into(),
            source: source.into(),
        }
    }

    /// `true` for [`PublishError::Connect`]: the broker could not be reached at all.
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }

    /// `true` for a [`PublishError::Connect`] in which the broker refused the
    /// credentials (AMQP 403 `ACCESS_REFUSED`, NATS authorization violation): a retry
    /// with the same URL fails the same way.
    pub fn is_authentication(&self) -> bool {
        matches!(self, Self::Connect { source, .. } if crate::error::refused_credentials(source.as_ref()))
    }
}
