//! Idempotent consumers on real brokers: RabbitMQ (AMQP 0-9-1, feature `amqp`, built on
//! [lapin](https://docs.rs/lapin)) and NATS JetStream (feature `nats`, built on
//! [async-nats](https://docs.rs/async-nats)). With neither feature this crate is only the
//! broker-independent core, with no broker client in the dependency graph.
//!
//! A broker delivers at least once. Each delivery goes through one decision, written once
//! for both brokers ([`Consumer::handle`] and [`classify`]):
//!
//! 1. the message ID is taken from the broker's own field (AMQP `message_id` property;
//!    JetStream `Nats-Msg-Id` header, or the stream sequence, see [`nats::MessageIdSource`]);
//! 2. the effect runs through [`Idem::consume`], so the `(subscriber, message_id)` record
//!    commits in the same transaction as the effect;
//! 3. the outcome becomes a [`Decision`]:
//!    - applied or duplicate → **acknowledge** (only after the commit);
//!    - no message ID, an unusable ID, an undecodable body, a payload too large to store,
//!      the same ID with a different payload, or a final effect error
//!      ([`Handler::on_effect_error`]: by default the effect's own refusals) →
//!      **dead-letter**: the message is published to the configured dead-letter queue or
//!      subject with the reason in the `x-idem-dead-letter-reason` header, and acknowledged
//!      only once the broker stored that copy (otherwise it is redelivered);
//!    - a database that failed or is unreachable, inside the effect too (a lost
//!      connection, a deadlock) → **redeliver**: negative acknowledgement after a growing,
//!      jittered pause ([`Backoff`]), so the message is never lost and a database outage
//!      is never a hot loop.
//!
//! A lost broker connection is made again for [`Options::reconnect_for`]; every broker
//! request is bounded by [`Options::broker_timeout`].
//!
//! Shutdown (a [`CancellationToken`]) lets the message in hand finish: it is committed
//! and acknowledged, or returned; messages prefetched but not started are returned to the
//! broker.
//!
//! Implement [`Handler`] (decode the body, run the effect in the transaction), wrap it in
//! a [`Consumer`] with an [`Idem`] and a subscriber, and pass it to `amqp::run` or
//! `nats::run`. The `idem demo consume` command (crates/idem-cli/src/consume.rs) is a complete
//! example: the demo's credit on any engine. docs/consumers.md describes each broker's
//! message ID, redelivery window and dead-lettering.
//!
//! The other direction, the transactional outbox: [`idem_core::Idem::relay`] publishes
//! the messages effects enqueued, in order per destination, through an
//! [`idem_core::Publisher`]: `amqp::AmqpPublisher` (default exchange, routing key = the
//! destination, `message_id`, persistent, publisher confirms) or `nats::NatsPublisher`
//! (JetStream, subject = the destination, `Nats-Msg-Id`, PubAck). A message counts as
//! published only once the broker confirmed it; failures are [`PublishError`]s. The
//! `idem relay` command (crates/idem-cli/src/relay.rs) runs the relay on any engine.

mod decision;
mod error;
mod handler;
mod publish;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;

pub use decision::{DeadLetterReason, Decision, classify};
pub use error::ConsumerError;
pub use handler::{
    Backoff, Consumer, DEFAULT_BROKER_TIMEOUT, DEFAULT_RECONNECT_FOR, Event, Failures, Handler,
    OnEffectError, Options, Stats,
};
pub use publish::PublishError;
pub use tokio_util::sync::CancellationToken;

#[cfg(feature = "nats")]
pub use async_nats;
#[cfg(feature = "amqp")]
pub use lapin;

pub use idem_core::Idem;

/// The header that carries the reason of a dead-lettered message (a [`DeadLetterReason`]
/// code such as `payload-mismatch`).
pub const REASON_HEADER: &str = "x-idem-dead-letter-reason";
/// The header that carries a human-readable detail of a dead-lettered message.
pub const DETAIL_HEADER: &str = "x-idem-dead-letter-detail";
/// The header that names the subscriber that dead-lettered a message.
pub const SUBSCRIBER_HEADER: &str = "x-idem-subscriber";
/// The header that carries the original message ID of a dead letter (JetStream dead
/// letters have a message ID of their own, derived from the original delivery).
pub const ORIGINAL_ID_HEADER: &str = "x-idem-original-message-id";
