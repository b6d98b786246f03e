//! The outbox publisher for NATS JetStream.

use std::collections::HashSet;
use std::sync::Mutex;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::{self, Context, stream};
use idem_core::Publisher;
use idem_core::runs::OutboxRow;

use super::{MSG_ID_HEADER, REQUEST_TIMEOUT};
use crate::publish::PublishError;

const BROKER: &str = "nats";

/// The stream [`NatsPublisher`] adds subjects to when no stream captures a destination.
pub const DEFAULT_STREAM: &str = "IDEM_OUTBOX";

/// How often [`NatsPublisher`] tries to make a stream capture a subject before it gives
/// up (another relay may be changing the same stream's subjects at the same moment).
const COVER_ATTEMPTS: u32 = 5;

/// Publishes outbox messages to NATS JetStream (an [`idem_core::Publisher`] for
/// [`idem_core::Idem::relay`]).
///
/// - **Where**: subject = the message's destination. The first time a destination is
///   seen, the publisher makes sure a stream captures that subject: any stream that
///   already does is used as it is; otherwise the subject is added to the configured
///   stream ([`DEFAULT_STREAM`] by default), which is created (file storage, default
///   limits) when missing. Should the subject drop out of every stream later (another
///   relay rewrote the stream's subjects from an older copy), the publish makes a
///   stream capture it again and tries once more. A destination that is not a valid NATS subject (spaces,
///   empty tokens, wildcards) is [`PublishError::Destination`].
/// - **Message**: the payload (JSON text, header `Content-Type: application/json`),
///   the message ID in the `Nats-Msg-Id` header, so JetStream itself drops a
///   re-publish inside the stream's duplicate window.
/// - **Confirmation**: a publish succeeds only once the stream acknowledged it
///   (PubAck, a duplicate included); requests time out after [`REQUEST_TIMEOUT`].
#[derive(Debug)]
pub struct NatsPublisher {
    js: Context,
    stream: String,
    covered: Mutex<HashSet<String>>,
}

/// A stream name JetStream accepts: non-empty, no whitespace, `.`, `*` or `>`.
fn valid_stream(name: &str) -> bool {
    !name.is_empty()
        && !name
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>'))
}

/// Why `subject` cannot be published to, if it cannot.
fn subject_problem(subject: &str) -> Option<&'static str> {
    if subject.chars().any(char::is_whitespace) {
        return Some("a NATS subject has no whitespace");
    }
    let tokens: Vec<&str> = subject.split('.').collect();
    if tokens.iter().any(|t| t.is_empty()) {
        return Some("a NATS subject has no empty tokens (leading, trailing or double dots)");
    }
    if tokens.iter().any(|t| *t == "*" || *t == ">") {
        return Some("a message cannot be published to a wildcard subject");
    }
    None
}

impl NatsPublisher {
    /// Connects to `url` (`nats://host:4222`, or with credentials as
    /// [`crate::nats::connect_within`] takes them); subjects no stream captures are added
    /// to `stream` (see [`DEFAULT_STREAM`]).
    pub async fn connect(url: &str, stream: &str) -> Result<Self, PublishError> {
        if !valid_stream(stream) {
            return Err(stream_name_error(stream));
        }
        let client = super::connect_options(url)
            .connect(super::servers(url).as_slice())
            .await
            .map_err(|e| PublishError::Connect {
                broker: BROKER,
                target: crate::publish::redact(url),
                source: e.into(),
            })?;
        let mut js = jetstream::new(client);
        js.set_timeout(REQUEST_TIMEOUT);
        Self::new(js, stream)
    }

    /// A publisher on an existing JetStream context; subjects no stream captures are
    /// added to `stream`.
    pub fn new(js: Context, stream: &str) -> Result<Self, PublishError> {
        if !valid_stream(stream) {
            return Err(stream_name_error(stream));
        }
        Ok(Self {
            js,
            stream: stream.to_owned(),
            covered: Mutex::new(HashSet::new()),
        })
    }

    /// The stream subjects are added to.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// Flushes and closes the connection (every publish has been acknowledged already).
    pub async fn close(self) -> Result<(), PublishError> {
        self.js
            .client()
            .drain()
            .await
            .map_err(|e| PublishError::broker(BROKER, "close the connection", e))
    }

    fn set_covered(&self, subject: &str, covered: bool) {
        let mut set = self
            .covered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if covered {
            set.insert(subject.to_owned());
        } else {
            set.remove(subject);
        }
    }

    fn is_covered(&self, subject: &str) -> bool {
        self.covered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(subject)
    }

    /// Makes sure some stream captures `subject`, once per subject.
    async fn ensure_subject(&self, subject: &str) -> Result<(), PublishError> {
        if self.is_covered(subject) {
            return Ok(());
        }
        if let Some(reason) = subject_problem(subject) {
            return Err(PublishError::Destination {
                broker: BROKER,
                destination: subject.to_owned(),
                reason: reason.into(),
            });
        }
        let action = || format!("make stream {:?} capture subject {subject:?}", self.stream);
        let mut last: Option<PublishError> = None;
        for _ in 0..COVER_ATTEMPTS {
            match self.js.stream_by_subject(subject).await {
                Ok(_) => {
                    self.set_covered(subject, true);
                    return Ok(());
                }
                Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {}
                Err(e) => {
                    return Err(PublishError::broker(
                        BROKER,
                        format!("find the stream of subject {subject:?}"),
                        e,
                    ));
                }
            }
            let found = self
                .js
                .get_or_create_stream(stream::Config {
                    name: self.stream.clone(),
                    subjects: vec![subject.to_owned()],
                    ..stream::Config::default()
                })
                .await;
            let found = match found {
                Ok(s) => s,
                // Another relay may have created it at the same moment: look again.
                Err(e) => {
                    last = Some(PublishError::broker(BROKER, action(), e));
                    continue;
                }
            };
            let mut config = found.cached_info().config.clone();
            if config.subjects.iter().any(|s| s == subject) {
                continue;
            }
            if config.subjects.is_empty() {
                // A stream without subjects captures its own name: keep it.
                config.subjects.push(config.name.clone());
            }
            config.subjects.push(subject.to_owned());
            if let Err(e) = self.js.update_stream(&config).await {
                last = Some(PublishError::broker(BROKER, action(), e));
            }
        }
        Err(last.unwrap_or_else(|| {
            PublishError::broker(
                BROKER,
                action(),
                format!(
                    "the subject was added but no stream captured it after {COVER_ATTEMPTS} attempts"
                ),
            )
        }))
    }

    async fn publish_row(&self, row: &OutboxRow) -> Result<(), PublishError> {
        match self.publish_once(row).await {
            // Another relay may have rewritten the stream's subjects from an older copy
            // of its configuration: make a stream capture the subject again, once.
            Err(PublishError::Refused { .. }) => self.publish_once(row).await,
            other => other,
        }
    }

    async fn publish_once(&self, row: &OutboxRow) -> Result<(), PublishError> {
        self.ensure_subject(&row.destination).await?;
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, row.message_id.as_str());
        headers.insert("Content-Type", "application/json");
        let action = || {
            format!(
                "publish message {} to {:?}",
                row.message_id, row.destination
            )
        };
        let acked = match self
            .js
            .publish_with_headers(
                row.destination.clone(),
                headers,
                row.payload.clone().into_bytes().into(),
            )
            .await
        {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match acked {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                // The stream was removed or changed: look for one again next time.
                self.set_covered(&row.destination, false);
                Err(PublishError::Refused {
                    broker: BROKER,
                    destination: row.destination.clone(),
                    message_id: row.message_id.clone(),
                    reason: "no stream captures the subject any more".into(),
                })
            }
            Err(e) => Err(PublishError::broker(BROKER, action(), e)),
        }
    }
}

fn stream_name_error(stream: &str) -> PublishError {
    PublishError::Config(format!(
        "stream name {stream:?} must be non-empty, without whitespace, '.', '*' or '>'"
    ))
}

impl Publisher for NatsPublisher {
    type Error = PublishError;

    fn publish(
        &self,
        message: &OutboxRow,
    ) -> impl Future<Output = Result<(), PublishError>> + Send {
        self.publish_row(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(valid_stream(DEFAULT_STREAM));
        assert!(!valid_stream("a.b"));
        assert!(!valid_stream(""));
        assert!(!valid_stream("a b"));
        assert_eq!(subject_problem("order.paid"), None);
        assert!(subject_problem("order paid").is_some());
        assert!(subject_problem("order..paid").is_some());
        assert!(subject_problem(".order").is_some());
        assert!(subject_problem("order.*").is_some());
        assert!(subject_problem("order.>").is_some());
    }
}
