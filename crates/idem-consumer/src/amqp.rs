//! RabbitMQ (AMQP 0-9-1) through lapin.
//!
//! - **Message ID**: the `message_id` basic property. A delivery without one is
//!   dead-lettered (`missing-message-id`).
//! - **Queue**: declared durable with no arguments when missing (the same declaration
//!   succeeds on a queue other tools declared that way). The dead-letter queue is
//!   declared the same way.
//! - **Acknowledgement**: manual, after the commit. A dead-lettered message is published
//!   to the dead-letter queue on the default exchange, persistent, with its
//!   `message_id`, its headers and the `x-idem-dead-letter-*` headers, and acknowledged
//!   only after the broker confirmed that publish (publisher confirms). No queue
//!   arguments (`x-dead-letter-exchange`) are required of anyone.
//! - **Redelivery**: `basic.nack` with `requeue`, after a [`crate::Backoff`] pause.
//!   RabbitMQ marks such deliveries `redelivered`; it also requeues every unacknowledged
//!   message of a consumer whose channel or connection closes (a crash).
//! - **Prefetch**: `basic.qos` with [`crate::Options::prefetch`].

use std::time::Duration;

use futures_util::StreamExt;
use idem_core::Backend;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::handler::{Consumer, Event, Failures, Handler, Stats};
use crate::{DETAIL_HEADER, REASON_HEADER, SUBSCRIBER_HEADER};

mod publisher;
pub use publisher::{AmqpPublisher, DEFAULT_CONFIRM_TIMEOUT};

/// Where to consume from.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AmqpConfig {
    /// The broker, `amqp://user:pass@host:port/vhost`.
    pub url: String,
    /// The queue to consume.
    pub queue: String,
    /// The dead-letter queue.
    pub dead_letter_queue: String,
}

impl std::fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &redact(&self.url))
            .field("queue", &self.queue)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .finish()
    }
}

impl AmqpConfig {
    /// Consume `queue` on `url`; dead letters go to `<queue>.dead-letter` unless
    /// [`AmqpConfig::dead_letter_queue`] says otherwise.
    pub fn new(url: impl Into<String>, queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            url: url.into(),
            dead_letter_queue: format!("{queue}.dead-letter"),
            queue,
        }
    }

    /// Sets the dead-letter queue.
    #[must_use]
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = queue.into();
        self
    }

    fn validate(&self) -> Result<(), ConsumerError> {
        for (what, name) in [
            ("queue", &self.queue),
            ("dead-letter queue", &self.dead_letter_queue),
        ] {
            if name.is_empty() || name.len() > 255 {
                return Err(ConsumerError::Config(format!(
                    "the {what} name must have 1 to 255 bytes, not {}",
                    name.len()
                )));
            }
        }
        if self.queue == self.dead_letter_queue {
            return Err(ConsumerError::Config(format!(
                "the dead-letter queue must differ from the consumed queue {:?}",
                self.queue
            )));
        }
        Ok(())
    }
}

/// The URL with any password replaced by `***`.
pub fn redact(url: &str) -> String {
    crate::publish::redact(url)
}

fn broker(action: impl Into<String>) -> impl FnOnce(lapin::Error) -> ConsumerError {
    let action = action.into();
    move |e| ConsumerError::broker("amqp", action, e)
}

/// Declares `queue` durable with no arguments (a no-op when it exists that way).
pub async fn declare_queue(channel: &Channel, queue: &str) -> Result<(), ConsumerError> {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .map_err(broker(format!("declare queue {queue:?}")))?;
    Ok(())
}

/// Connects to `url`.
pub async fn connect(url: &str) -> Result<Connection, ConsumerError> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| ConsumerError::Connect {
            broker: "amqp",
            target: redact(url),
            source: e.into(),
        })
}

fn dead_letter_properties(
    original: &BasicProperties,
    subscriber: &str,
    reason: &str,
    detail: &str,
) -> BasicProperties {
    let mut headers = original.headers().clone().unwrap_or_default();
    let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes()));
    headers.insert(ShortString::from(REASON_HEADER), text(reason));
    headers.insert(ShortString::from(DETAIL_HEADER), text(detail));
    headers.insert(ShortString::from(SUBSCRIBER_HEADER), text(subscriber));
    let mut props = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(id) = original.message_id() {
        props = props.with_message_id(id.clone());
    }
    if let Some(ct) = original.content_type() {
        props = props.with_content_type(ct.clone());
    }
    props
}

/// Consumes `config.queue` until `shutdown` is cancelled or the consumer has been idle
/// for [`crate::Options::max_idle`]. The message in hand when `shutdown` fires is
/// finished; prefetched messages not started are returned to the queue when the channel
/// closes. Returns the counts, or the broker error that stopped the loop (its messages
/// in hand are requeued by the broker).
pub async fn run<B, H>(
    consumer: &Consumer<B, H>,
    config: &AmqpConfig,
    shutdown: CancellationToken,
) -> Result<Stats, ConsumerError>
where
    B: Backend,
    H: Handler<B>,
{
    config.validate()?;
    let connection = connect(&config.url).await?;
    let result = consume(consumer, config, &connection, &shutdown).await;
    // Closing requeues everything not acknowledged.
    let _ = connection.close(200, "idem consumer stopped".into()).await;
    result
}

async fn consume<B, H>(
    consumer: &Consumer<B, H>,
    config: &AmqpConfig,
    connection: &Connection,
    shutdown: &CancellationToken,
) -> Result<Stats, ConsumerError>
where
    B: Backend,
    H: Handler<B>,
{
    let options = *consumer.options();
    let channel = connection
        .create_channel()
        .await
        .map_err(broker("open a channel"))?;
    declare_queue(&channel, &config.queue).await?;
    declare_queue(&channel, &config.dead_letter_queue).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker("enable publisher confirms"))?;
    channel
        .basic_qos(options.prefetch.max(1), BasicQosOptions::default())
        .await
        .map_err(broker("set the prefetch count"))?;
    let tag = format!("idem-{}-{}", consumer.subscriber(), std::process::id());
    let mut deliveries = channel
        .basic_consume(
            config.queue.as_str().into(),
            tag.as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(broker(format!("consume queue {:?}", config.queue)))?;

    let mut stats = Stats::default();
    let mut failures = Failures::default();
    loop {
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            next = idle_bounded(options.max_idle, deliveries.next()) => next,
        };
        let delivery = match next {
            Idle::Quiet => break,
            Idle::Item(None) => {
                return Err(ConsumerError::broker(
                    "amqp",
                    format!("consume queue {:?}", config.queue),
                    "the broker cancelled the consumer",
                ));
            }
            Idle::Item(Some(Err(e))) => {
                return Err(broker(format!("receive from {:?}", config.queue))(e));
            }
            Idle::Item(Some(Ok(d))) => d,
        };
        stats.delivered += 1;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str());
        let decision = consumer.handle(id, &delivery.data).await;
        consumer.handler().observe(&Event {
            message_id: id,
            redelivered: delivery.redelivered,
            decision: &decision,
        });
        let decision = match decision {
            Decision::DeadLetter { reason, detail } => {
                let props = dead_letter_properties(
                    &delivery.properties,
                    consumer.subscriber().as_str(),
                    reason.code(),
                    &detail,
                );
                match publish_confirmed(&channel, &config.dead_letter_queue, &delivery.data, props)
                    .await
                {
                    Ok(()) => Decision::DeadLetter { reason, detail },
                    Err(e) => Decision::redeliver(e.to_string()),
                }
            }
            other => other,
        };
        if let Some(pause) = failures.after(&decision, &options.backoff) {
            // Cancellation cuts the pause short; the message goes back either way.
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(pause) => {}
            }
            delivery
                .acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
                .map_err(broker("return a message for redelivery"))?;
        } else {
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .map_err(broker("acknowledge"))?;
        }
        stats.count(&decision);
    }
    let _ = channel
        .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
        .await;
    let _ = channel.close(200, "idem consumer stopped".into()).await;
    Ok(stats)
}

/// Publishes `body` to `queue` (default exchange) and waits for the broker's confirm.
pub async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), ConsumerError> {
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .map_err(broker(format!("publish to {queue:?}")))?
        .await
        .map_err(broker(format!("publish to {queue:?}")))?;
    if confirm.is_nack() {
        return Err(ConsumerError::broker(
            "amqp",
            format!("publish to {queue:?}"),
            "the broker refused the message (nack)",
        ));
    }
    Ok(())
}

pub(crate) enum Idle<T> {
    Item(T),
    Quiet,
}

pub(crate) async fn idle_bounded<T>(
    max_idle: Option<Duration>,
    next: impl Future<Output = T>,
) -> Idle<T> {
    match max_idle {
        None => Idle::Item(next.await),
        Some(idle) => match tokio::time::timeout(idle, next).await {
            Ok(item) => Idle::Item(item),
            Err(_) => Idle::Quiet,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
        let c = AmqpConfig::new("amqp://u:pw@h/", "q");
        assert!(!format!("{c:?}").contains("pw"));
        assert_eq!(c.dead_letter_queue, "q.dead-letter");
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(AmqpConfig::new("amqp://h", "").validate().is_err());
        assert!(
            AmqpConfig::new("amqp://h", "q")
                .dead_letter_queue("q")
                .validate()
                .is_err()
        );
        assert!(AmqpConfig::new("amqp://h", "q").validate().is_ok());
    }
}
