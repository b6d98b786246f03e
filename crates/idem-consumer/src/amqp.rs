//! RabbitMQ (AMQP 0-9-1) through lapin.
//!
//! - **Message ID**: the `message_id` basic property. A delivery without one is
//!   dead-lettered (`missing-message-id`).
//! - **Queue**: declared durable with no arguments when missing (the same declaration
//!   succeeds on a queue other tools declared that way). The dead-letter queue is
//!   declared the same way when the loop starts.
//! - **Acknowledgement**: manual, after the commit. A dead-lettered message is published
//!   to the dead-letter queue on the default exchange, `mandatory`, persistent, with its
//!   `message_id`, its headers and the `x-idem-dead-letter-*` headers, and acknowledged
//!   only after the broker confirmed that publish (publisher confirms) without returning
//!   it, and after the dead-letter queue was looked up again (see
//!   [`publish_confirmed`]: RabbitMQ confirms a message whose queue is deleted while
//!   the message is on its way, and drops it). A dead letter the broker returns as
//!   unroutable (the dead-letter queue was deleted or expired), negatively
//!   acknowledges, confirms for a queue that is gone, or does not confirm within
//!   [`crate::Options::broker_timeout`] is a failure: the original is returned for
//!   redelivery, never acknowledged. No queue arguments (`x-dead-letter-exchange`) are
//!   required of anyone.
//! - **Redelivery**: `basic.nack` with `requeue`, after a [`crate::Backoff`] pause.
//!   RabbitMQ marks such deliveries `redelivered`; it also requeues every unacknowledged
//!   message of a consumer whose channel or connection closes (a crash).
//! - **Lost connection** (a broker restart, a network failure): the broker requeues the
//!   messages in hand; the loop connects again with growing pauses for up to
//!   [`crate::Options::reconnect_for`], declares its queues again and goes on.
//! - **Queue deleted** under the loop: the broker cancels the consumer and the loop
//!   stops with a broker error ("the broker cancelled the consumer"); connecting again
//!   would declare the queue someone deleted. The consume asks for that cancellation in
//!   every case (`x-cancel-on-ha-failover`): without it, RabbitMQ silently moves a
//!   consumer of a deleted classic queue to a queue declared again under the same name,
//!   and in our runs that queue's deliveries never reached the client.
//! - **Prefetch**: `basic.qos` with [`crate::Options::prefetch`].

use std::time::Duration;

use futures_util::StreamExt;
use idem_core::Backend;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use crate::decision::Decision;
use crate::error::ConsumerError;
use crate::handler::{Consumer, Event, Failures, Handler, Lost, Stats};
use crate::{DETAIL_HEADER, ORIGINAL_ID_HEADER, REASON_HEADER, SUBSCRIBER_HEADER};

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

/// Connects to `url`, waiting at most [`crate::DEFAULT_BROKER_TIMEOUT`].
pub async fn connect(url: &str) -> Result<Connection, ConsumerError> {
    connect_within(url, crate::DEFAULT_BROKER_TIMEOUT).await
}

/// Connects to `url`; a broker that does not complete the handshake within `timeout`
/// (a listener that accepts and never answers) is a [`ConsumerError::Connect`].
pub async fn connect_within(url: &str, timeout: Duration) -> Result<Connection, ConsumerError> {
    let connect_error = |source: Box<dyn std::error::Error + Send + Sync>| ConsumerError::Connect {
        broker: "amqp",
        target: redact(url),
        source,
    };
    match tokio::time::timeout(
        timeout,
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(e)) => Err(connect_error(e.into())),
        Err(_) => Err(connect_error(
            format!("no answer from the broker within {timeout:?}").into(),
        )),
    }
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
    if let Some(id) = original.message_id() {
        headers.insert(ShortString::from(ORIGINAL_ID_HEADER), text(id.as_str()));
    }
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
/// closes. A lost connection is made again for up to [`crate::Options::reconnect_for`].
/// Returns the counts, or the broker error that stopped the loop (its messages in hand
/// are requeued by the broker): the first connection failing, a broker refusing the
/// queues, or the broker still unreachable at the end of the reconnection period. A queue
/// being deleted while the consumer sets up (404 `NOT_FOUND` to its declare or consume)
/// is waited out like a lost connection, within the same period.
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
    let options = *consumer.options();
    let mut connection = connect_within(&config.url, options.broker_timeout).await?;
    let mut session = Session::default();
    loop {
        let result = consume(consumer, config, &connection, &shutdown, &mut session).await;
        // Closing requeues everything not acknowledged (bounded: the broker may be gone).
        let _ = tokio::time::timeout(
            options.broker_timeout,
            connection.close(200, "idem consumer stopped".into()),
        )
        .await;
        let error = match result {
            Ok(()) => return Ok(session.stats),
            Err(End::Refused(e)) => return Err(e),
            Err(End::Lost(e)) => e,
        };
        connection = match reconnect(config, &options, &shutdown, error).await? {
            Some(c) => c,
            None => return Ok(session.stats),
        };
        session.stats.reconnects += 1;
    }
}

/// Connects again after `error` lost the connection; `None` when `shutdown` fired first,
/// the last connection error when the reconnection period ended.
async fn reconnect(
    config: &AmqpConfig,
    options: &crate::Options,
    shutdown: &CancellationToken,
    error: ConsumerError,
) -> Result<Option<Connection>, ConsumerError> {
    let mut lost = Lost::new();
    let mut last = error;
    loop {
        let Some(pause) = lost.next_pause(options) else {
            return Err(Lost::gave_up("amqp", options, last));
        };
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(pause) => {}
        }
        match connect_within(&config.url, options.broker_timeout).await {
            Ok(c) => return Ok(Some(c)),
            Err(e) => last = e,
        }
    }
}

/// Whether the consumer's setup failed with the broker's 404 `NOT_FOUND`: its queue is
/// being deleted. A declare creates a missing queue, so 404 is not "no such queue": RabbitMQ
/// answers it ("home node … of durable queue … is down or inaccessible") while a deleted
/// queue's process ends, and a consume answers it for a queue deleted after the declare.
/// The setup is tried again after a pause, as after a lost connection (seen once in a run
/// of the fault suite's `consumed_queue_deleted`, which then stopped the consumer).
fn queue_going(e: &ConsumerError) -> bool {
    let ConsumerError::Broker { source, .. } = e else {
        return false;
    };
    matches!(
        source.downcast_ref::<lapin::Error>().map(lapin::Error::kind),
        Some(lapin::ErrorKind::ProtocolError(p)) if p.get_id() == 404
    )
}

/// Why a session with the broker ended.
enum End {
    /// The broker refused something on a live connection (a queue declared with other
    /// arguments, the consumer cancelled): connecting again would not help.
    Refused(ConsumerError),
    /// The connection was lost or stopped answering: connect again.
    Lost(ConsumerError),
}

impl End {
    fn of(connection: &Connection, error: ConsumerError) -> Self {
        if connection.status().connected() {
            Self::Refused(error)
        } else {
            Self::Lost(error)
        }
    }
}

/// What lives across reconnections.
#[derive(Default)]
struct Session {
    stats: Stats,
    failures: Failures,
}

async fn consume<B, H>(
    consumer: &Consumer<B, H>,
    config: &AmqpConfig,
    connection: &Connection,
    shutdown: &CancellationToken,
    session: &mut Session,
) -> Result<(), End>
where
    B: Backend,
    H: Handler<B>,
{
    let options = *consumer.options();
    let tag = format!("idem-{}-{}", consumer.subscriber(), std::process::id());
    let setup = async {
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
        let deliveries = channel
            .basic_consume(
                config.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                cancel_when_queue_goes(),
            )
            .await
            .map_err(broker(format!("consume queue {:?}", config.queue)))?;
        Ok::<_, ConsumerError>((channel, deliveries))
    };
    let (channel, mut deliveries) = match tokio::time::timeout(options.broker_timeout, setup).await
    {
        Ok(Ok(ready)) => ready,
        Ok(Err(e)) if queue_going(&e) => return Err(End::Lost(e)),
        Ok(Err(e)) => return Err(End::of(connection, e)),
        Err(_) => {
            return Err(End::Lost(ConsumerError::broker(
                "amqp",
                format!("consume queue {:?}", config.queue),
                format!(
                    "no answer from the broker within {:?}",
                    options.broker_timeout
                ),
            )));
        }
    };

    let Session { stats, failures } = session;
    loop {
        let next = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            next = idle_bounded(options.max_idle, deliveries.next()) => next,
        };
        let delivery = match next {
            Idle::Quiet => break,
            Idle::Item(None) => {
                return Err(End::of(
                    connection,
                    ConsumerError::broker(
                        "amqp",
                        format!("consume queue {:?}", config.queue),
                        "the broker cancelled the consumer",
                    ),
                ));
            }
            Idle::Item(Some(Err(e))) => {
                return Err(End::Lost(broker(format!(
                    "receive from {:?}",
                    config.queue
                ))(e)));
            }
            Idle::Item(Some(Ok(d))) => d,
        };
        stats.delivered += 1;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str());
        let decision = match consumer.handle(id, &delivery.data).await {
            Decision::DeadLetter { reason, detail } => {
                let props = dead_letter_properties(
                    &delivery.properties,
                    consumer.subscriber().as_str(),
                    reason.code(),
                    &detail,
                );
                match publish_confirmed(
                    connection,
                    &channel,
                    &config.dead_letter_queue,
                    &delivery.data,
                    props,
                    options.broker_timeout,
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
        consumer.handler().observe(&Event {
            message_id: id,
            redelivered: delivery.redelivered,
            decision: &decision,
        });
        if let Some(pause) = failures.after(&decision, &options.backoff) {
            // Cancellation cuts the pause short; the message goes back either way.
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(pause) => {}
            }
            let nack = delivery.acker.nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            });
            settle(
                nack,
                "return a message for redelivery",
                options.broker_timeout,
            )
            .await?;
        } else {
            let ack = delivery.acker.ack(BasicAckOptions::default());
            settle(ack, "acknowledge", options.broker_timeout).await?;
        }
        stats.count(&decision);
    }
    let _ = tokio::time::timeout(options.broker_timeout, async {
        let _ = channel
            .basic_cancel(tag.as_str().into(), BasicCancelOptions::default())
            .await;
        let _ = channel.close(200, "idem consumer stopped".into()).await;
    })
    .await;
    Ok(())
}

/// The consume's arguments: `x-cancel-on-ha-failover`, so that a queue that goes away
/// always cancels the consumer. Without it, when a classic queue is deleted, RabbitMQ's
/// channel consumes again by name, without telling the client (a path meant for a
/// mirrored queue that failed over), and finds any queue declared under that name in the
/// meantime, by the relay's publisher for one. In the trial `amqp::consumed_queue_deleted`
/// (tests/broker_faults, RabbitMQ 3.10), a consume without it then received nothing more
/// from the queue declared again, in 10 runs of 10: the loop waited, silent, while its
/// messages piled up.
fn cancel_when_queue_goes() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert("x-cancel-on-ha-failover".into(), AMQPValue::Boolean(true));
    arguments
}

/// Waits up to `timeout` for an acknowledgement (or its negative) to be sent. Bounded
/// because lapin (4.12) never completes one whose channel closes while it is queued, as
/// when the broker restarts: the connection is then treated as lost, and the broker
/// delivers the message again (the consumer's record makes that a duplicate). One lapin
/// refuses to send because the channel closed is a lost connection too, even while the
/// connection itself is still up: the loop reconnects rather than reading on.
async fn settle(
    sent: impl Future<Output = lapin::Result<bool>>,
    action: &str,
    timeout: Duration,
) -> Result<(), End> {
    match tokio::time::timeout(timeout, sent).await {
        Ok(Ok(true)) => Ok(()),
        // lapin answers `false` without sending anything when the channel has closed
        // (the acker is poisoned); each delivery is settled once, so never "already used".
        Ok(Ok(false)) => Err(End::Lost(ConsumerError::broker(
            "amqp",
            action,
            "not sent: the channel is closed",
        ))),
        Ok(Err(e)) => Err(End::Lost(broker(action)(e))),
        Err(_) => Err(End::Lost(ConsumerError::broker(
            "amqp",
            action,
            format!("not sent within {timeout:?}: the channel is gone"),
        ))),
    }
}

/// Publishes `body` to `queue` (default exchange, `mandatory`) on `channel` and waits
/// up to `timeout` for the broker's confirm and for the queue to be looked up again.
/// The channel must be in confirm mode; `connection` is the one it belongs to.
///
/// `Ok` only when the broker confirmed the message without returning it **and** the
/// queue still exists afterwards. RabbitMQ positively confirms a message routed to a
/// queue that is deleted before the message reached it, and drops the message with the
/// queue; the lookup (a passive declare on a channel of its own, since a missing queue
/// closes the channel it is asked on) tells that case apart: the deletion is complete
/// before the confirm is sent. A message returned as unroutable (no such queue),
/// negatively acknowledged, confirmed for a queue that is gone, or not confirmed in
/// time is an error (the message may or may not be stored in that last case). What no
/// lookup can see: the queue deleted and declared again by someone else between the
/// confirm and the lookup.
pub async fn publish_confirmed(
    connection: &Connection,
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
    timeout: Duration,
) -> Result<(), ConsumerError> {
    let action = || format!("publish to {queue:?}");
    let refused = |why: String| ConsumerError::broker("amqp", action(), why);
    let confirmed = tokio::time::timeout(timeout, async {
        let confirmation = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body,
                properties,
            )
            .await?
            .await?;
        if !matches!(confirmation, Confirmation::Ack(None)) {
            return Ok((confirmation, true));
        }
        let lookup = connection.create_channel().await?;
        let found = queue_exists(&lookup, queue).await?;
        if found {
            let _ = lookup.close(200, "found".into()).await;
        }
        Ok::<_, lapin::Error>((confirmation, found))
    })
    .await;
    match confirmed {
        Err(_) => Err(refused(format!(
            "no confirmation from the broker within {timeout:?}"
        ))),
        Ok(Err(e)) => Err(broker(action())(e)),
        Ok(Ok((Confirmation::Ack(None), true))) => Ok(()),
        Ok(Ok((Confirmation::Ack(None), false))) => Err(refused(format!(
            "the broker confirmed the message, but queue {queue:?} is gone: it was deleted \
             while the message was on its way, and the message with it"
        ))),
        Ok(Ok((Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)), _))) => {
            Err(refused(format!(
                "the broker returned the message as unroutable ({} {})",
                returned.reply_code, returned.reply_text
            )))
        }
        Ok(Ok((Confirmation::Nack(None), _))) => {
            Err(refused("the broker refused the message (nack)".to_owned()))
        }
        Ok(Ok((Confirmation::NotRequested, _))) => Err(refused(
            "the channel is not in confirm mode, so the publish is unconfirmed".to_owned(),
        )),
    }
}

/// Whether `queue` exists: a passive declare on `channel`. A missing queue is
/// `Ok(false)`, and the broker closes `channel` (so it must not be one that carries
/// anything else).
pub(crate) async fn queue_exists(channel: &Channel, queue: &str) -> Result<bool, lapin::Error> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    let looked_up = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    match looked_up {
        Ok(_) => Ok(true),
        Err(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp)
                if matches!(amqp.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)) =>
            {
                Ok(false)
            }
            _ => Err(e),
        },
    }
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
