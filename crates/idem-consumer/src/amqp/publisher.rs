//! The outbox publisher for RabbitMQ.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use idem_core::Publisher;
use idem_core::runs::OutboxRow;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};

use super::redact;
use crate::publish::PublishError;

const BROKER: &str = "amqp";

/// How long a publish waits for the broker's confirmation by default.
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes outbox messages to RabbitMQ (an [`idem_core::Publisher`] for
/// [`idem_core::Idem::relay`]).
///
/// - **Where**: the default exchange with routing key = the message's destination, so
///   the message lands in the queue of that name. The first time a destination is seen
///   the queue is looked up (a passive declare: a queue others declared, with whatever
///   arguments, is used as it is) and declared durable with no arguments when missing,
///   so no message is dropped for want of a queue. With
///   [`AmqpPublisher::to_exchange`], messages go to that exchange instead, routed by
///   its bindings, and no queue is declared.
/// - **Message**: the payload (JSON text, `content_type` `application/json`), the
///   message ID in the `message_id` property, persistent (`delivery_mode` 2).
/// - **Confirmation**: the channel is in confirm mode; a publish succeeds only once the
///   broker acknowledged it. A negative acknowledgement, or a message returned as
///   unroutable (publishes are `mandatory`), is [`PublishError::Refused`]; no
///   confirmation within the timeout ([`DEFAULT_CONFIRM_TIMEOUT`],
///   [`AmqpPublisher::with_confirm_timeout`]) is [`PublishError::Broker`] (the message
///   may or may not be stored: the relay publishes it again, with the same message ID).
/// - **A queue deleted under a publish**: RabbitMQ positively confirms a message routed
///   to a queue that is deleted before the message reached it, and drops it with the
///   queue. On the default exchange each confirm is therefore followed by a lookup of
///   the queue (a passive declare, on a channel kept for lookups: one more round
///   trip); a queue that is gone makes the publish [`PublishError::Refused`], and the
///   next publish to it declares it again. With an exchange, the queues its bindings
///   route to are not known here, and a bound queue deleted under a publish loses
///   the message although the broker confirmed it.
///   The same timeout bounds connecting, the queue declaration before a destination's
///   first publish, and [`AmqpPublisher::close`], so a broker that accepts connections
///   and never answers fails each call instead of holding it.
pub struct AmqpPublisher {
    target: String,
    connection: Connection,
    channel: Channel,
    exchange: Option<String>,
    declared: Mutex<HashSet<String>>,
    /// The channel queues are looked up on after a confirm (closed by the broker when a
    /// queue is missing, then opened again). Boxed: a channel is large, and this one is
    /// seldom touched.
    lookups: Mutex<Option<Box<Channel>>>,
    confirm_timeout: Duration,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("target", &self.target)
            .field("exchange", &self.exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

fn broker(action: impl Into<String>) -> impl FnOnce(lapin::Error) -> PublishError {
    let action = action.into();
    move |e| PublishError::broker(BROKER, action, e)
}

impl AmqpPublisher {
    /// Connects to `url` (`amqp://user:pass@host:5672/vhost`) and opens a channel in
    /// confirm mode; messages go to the default exchange. A broker that does not
    /// complete the handshake within [`DEFAULT_CONFIRM_TIMEOUT`] is
    /// [`PublishError::Connect`].
    pub async fn connect(url: &str) -> Result<Self, PublishError> {
        Self::connect_within(url, DEFAULT_CONFIRM_TIMEOUT).await
    }

    /// [`AmqpPublisher::connect`] with `timeout` for the handshake and, afterwards, for
    /// each confirmation ([`AmqpPublisher::with_confirm_timeout`]).
    pub async fn connect_within(url: &str, timeout: Duration) -> Result<Self, PublishError> {
        let target = redact(url);
        let connect_error =
            |source: Box<dyn std::error::Error + Send + Sync>| PublishError::Connect {
                broker: BROKER,
                target: target.clone(),
                source,
            };
        let connection = match tokio::time::timeout(
            timeout,
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(connect_error(e.into())),
            Err(_) => {
                return Err(connect_error(
                    format!("no answer from the broker within {timeout:?}").into(),
                ));
            }
        };
        let opened = tokio::time::timeout(timeout, open_confirmed(&connection))
            .await
            .unwrap_or_else(|_| {
                Err(PublishError::broker(
                    BROKER,
                    "open a channel in confirm mode",
                    format!("no answer from the broker within {timeout:?}"),
                ))
            });
        let channel = match opened {
            Ok(ch) => ch,
            Err(e) => {
                let _ = tokio::time::timeout(
                    timeout,
                    connection.close(200, "idem relay stopped".into()),
                )
                .await;
                return Err(e);
            }
        };
        Ok(Self {
            target,
            connection,
            channel,
            exchange: None,
            declared: Mutex::new(HashSet::new()),
            lookups: Mutex::new(None),
            confirm_timeout: timeout,
        })
    }

    /// Publishes to `exchange` (which must exist: it is checked now) instead of the
    /// default exchange; its bindings route each message by its destination (the
    /// routing key), and no queue is declared. A message no binding routes is returned
    /// by the broker and fails the publish. The check waits at most the confirmation
    /// timeout for the broker's answer.
    pub async fn to_exchange(mut self, exchange: &str) -> Result<Self, PublishError> {
        if exchange.is_empty() || exchange.len() > 255 {
            return Err(PublishError::Config(format!(
                "the exchange name must have 1 to 255 bytes, not {}",
                exchange.len()
            )));
        }
        // On a channel of its own: a failed passive declare closes its channel. Bounded
        // like every exchange with the broker (lapin leaves some requests pending for
        // good when their channel closes under them).
        let action = format!("find exchange {exchange:?}");
        let lookup = async {
            let ch = self
                .connection
                .create_channel()
                .await
                .map_err(broker("open a channel"))?;
            let found = ch
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Direct,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(broker(action.clone()));
            let _ = ch.close(200, "checked".into()).await;
            found
        };
        tokio::time::timeout(self.confirm_timeout, lookup)
            .await
            .map_err(|_| {
                PublishError::broker(
                    BROKER,
                    action.clone(),
                    format!(
                        "no answer from the broker within {:?}",
                        self.confirm_timeout
                    ),
                )
            })??;
        self.exchange = Some(exchange.to_owned());
        Ok(self)
    }

    /// Sets how long a publish waits for the broker's confirmation.
    #[must_use]
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// The exchange messages go to (`None`: the default exchange).
    pub fn exchange(&self) -> Option<&str> {
        self.exchange.as_deref()
    }

    /// Closes the connection (every publish has been confirmed already), waiting at most
    /// the confirmation timeout for the broker's answer (a broker that stopped answering
    /// does not hold the caller).
    pub async fn close(self) -> Result<(), PublishError> {
        match tokio::time::timeout(
            self.confirm_timeout,
            self.connection.close(200, "idem relay stopped".into()),
        )
        .await
        {
            Ok(closed) => closed.map_err(broker("close the connection")),
            Err(_) => Err(PublishError::broker(
                BROKER,
                "close the connection",
                format!(
                    "no answer from the broker within {:?}",
                    self.confirm_timeout
                ),
            )),
        }
    }

    fn is_declared(&self, queue: &str) -> bool {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(queue)
    }

    /// The queue is missing: the next publish to it looks it up (and declares it) again.
    fn forget(&self, queue: &str) {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(queue);
    }

    /// Whether `queue` still exists, on the lookup channel (opened when there is none).
    async fn still_exists(&self, queue: &str) -> Result<bool, lapin::Error> {
        let kept = self
            .lookups
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .filter(|ch| ch.status().connected());
        let channel = match kept {
            Some(ch) => ch,
            None => Box::new(self.connection.create_channel().await?),
        };
        let found = super::queue_exists(&channel, queue).await?;
        if found {
            *self
                .lookups
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(channel);
        }
        Ok(found)
    }

    /// Makes sure the queue `queue` exists (default exchange only), once per queue.
    async fn ensure_queue(&self, queue: &str) -> Result<(), PublishError> {
        if self.exchange.is_some() || self.is_declared(queue) {
            return Ok(());
        }
        if queue.starts_with("amq.") {
            return Err(PublishError::Destination {
                broker: BROKER,
                destination: queue.to_owned(),
                reason: "queue names starting with `amq.` are reserved by the broker".into(),
            });
        }
        // Declarations run on channels of their own: a failed declare closes its channel,
        // and the publishing channel must survive it.
        let ch = self
            .connection
            .create_channel()
            .await
            .map_err(broker("open a channel"))?;
        // Any failure of the lookup (the queue missing or not) is left to the declare
        // below, whose error names the queue.
        if let Ok(true) = super::queue_exists(&ch, queue).await {
            let _ = ch.close(200, "found".into()).await;
        } else {
            let ch = self
                .connection
                .create_channel()
                .await
                .map_err(broker("open a channel"))?;
            let declared = ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await
                .map_err(broker(format!("declare queue {queue:?}")));
            let _ = ch.close(200, "declared".into()).await;
            declared?;
        }
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(queue.to_owned());
        Ok(())
    }

    async fn publish_row(&self, row: &OutboxRow) -> Result<(), PublishError> {
        // A broker that stopped answering must not hold the relay in a declaration.
        tokio::time::timeout(self.confirm_timeout, self.ensure_queue(&row.destination))
            .await
            .map_err(|_| {
                PublishError::broker(
                    BROKER,
                    format!("find or declare queue {:?}", row.destination),
                    format!(
                        "no answer from the broker within {:?}",
                        self.confirm_timeout
                    ),
                )
            })??;
        let props = BasicProperties::default()
            .with_message_id(row.message_id.as_str().into())
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        let exchange = self.exchange.as_deref().unwrap_or("");
        let action = || {
            format!(
                "publish message {} to {:?}",
                row.message_id, row.destination
            )
        };
        let confirmed = tokio::time::timeout(self.confirm_timeout, async {
            let confirmation = self
                .channel
                .basic_publish(
                    exchange.into(),
                    row.destination.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    row.payload.as_bytes(),
                    props,
                )
                .await?
                .await?;
            // A confirm is not enough on the default exchange: see the type's docs.
            let gone = self.exchange.is_none()
                && matches!(confirmation, Confirmation::Ack(None))
                && !self.still_exists(&row.destination).await?;
            Ok::<_, lapin::Error>((confirmation, gone))
        })
        .await;
        let confirmation = match confirmed {
            Err(_) => {
                return Err(PublishError::broker(
                    BROKER,
                    action(),
                    format!(
                        "no confirmation from the broker within {:?}",
                        self.confirm_timeout
                    ),
                ));
            }
            Ok(Err(e)) => return Err(broker(action())(e)),
            Ok(Ok(c)) => c,
        };
        let refused = |reason: String| PublishError::Refused {
            broker: BROKER,
            destination: row.destination.clone(),
            message_id: row.message_id.clone(),
            reason,
        };
        let (confirmation, gone) = confirmation;
        if gone
            || matches!(
                confirmation,
                Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_))
            )
        {
            self.forget(&row.destination);
        }
        match confirmation {
            Confirmation::Ack(None) if gone => Err(refused(format!(
                "confirmed, but queue {:?} is gone: it was deleted while the message was on \
                 its way, and the message with it",
                row.destination
            ))),
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(refused(format!(
                    "returned as unroutable ({} {})",
                    returned.reply_code, returned.reply_text
                )))
            }
            Confirmation::Nack(None) => Err(refused("negatively acknowledged (nack)".into())),
            Confirmation::NotRequested => Err(refused(
                "the channel is not in confirm mode, so the publish is unconfirmed".into(),
            )),
        }
    }
}

async fn open_confirmed(connection: &Connection) -> Result<Channel, PublishError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(broker("open a channel"))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker("enable publisher confirms"))?;
    Ok(channel)
}

impl Publisher for AmqpPublisher {
    type Error = PublishError;

    fn publish(
        &self,
        message: &OutboxRow,
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        self.publish_row(message)
    }
}
