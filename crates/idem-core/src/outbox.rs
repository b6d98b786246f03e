//! The transactional outbox: messages stored in the effect's transaction, published
//! later by a relay ([`crate::Idem::relay`]), at least once, in order per destination.

use std::collections::BTreeSet;
use std::error::Error as StdError;
use std::future::Future;

use serde::Serialize;

use crate::error::{DbError, InvalidInput};
use crate::ident::MAX_IDENT_BYTES;
use crate::runs::{MAX_RELAY_BATCH, OutboxRow, OutboxStore};

/// A message to store in the outbox, validated before any SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    destination: String,
    message_id: String,
    payload: String,
}

fn check_name(what: &'static str, value: &str) -> Result<(), InvalidInput> {
    if value.is_empty() || value.len() > MAX_IDENT_BYTES {
        return Err(InvalidInput::new(
            what,
            format!("must be 1 to {MAX_IDENT_BYTES} bytes, got {}", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(InvalidInput::new(
            what,
            "must not contain control characters",
        ));
    }
    Ok(())
}

impl Outgoing {
    /// A message for `destination` (a queue, routing key or subject) with the ID
    /// consumers deduplicate by and a JSON payload. Both names are 1 to 255 bytes
    /// without control characters; the payload must serialize to JSON.
    pub fn new<T: Serialize + ?Sized>(
        destination: &str,
        message_id: &str,
        payload: &T,
    ) -> Result<Self, InvalidInput> {
        check_name("outbox destination", destination)?;
        check_name("outbox message id", message_id)?;
        let payload = serde_json::to_string(payload).map_err(|e| {
            InvalidInput::new("outbox payload", format!("cannot be stored as JSON: {e}"))
        })?;
        Ok(Self {
            destination: destination.to_owned(),
            message_id: message_id.to_owned(),
            payload,
        })
    }

    /// Where it goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The message ID.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The payload, JSON text.
    pub fn payload(&self) -> &str {
        &self.payload
    }
}

/// Publishes one outbox message to a broker (RabbitMQ, NATS, …), with its message ID,
/// and returns once the broker confirmed it.
pub trait Publisher: Send + Sync {
    /// The broker's error.
    type Error: StdError + Send + Sync + 'static;

    /// Publishes `message`; `Ok` only when the broker has it.
    fn publish(&self, message: &OutboxRow) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// What one relay pass did.
#[derive(Debug, Default)]
pub struct RelayReport {
    /// Messages published and marked sent.
    pub published: u64,
    /// Messages locked but left for later: an older message of their destination is
    /// held by another relay, so publishing them now would break the order.
    pub deferred: u64,
    /// Destinations whose next message the broker refused in this pass: that message and
    /// the destination's later ones stay unsent, in order, for the next pass; the other
    /// destinations went on.
    pub failed: Vec<RelayFailure>,
}

/// A message the broker refused (or did not confirm).
#[derive(Debug, thiserror::Error)]
#[error("publishing outbox message {message_id} to {destination}: {source}")]
pub struct RelayFailure {
    /// The destination.
    pub destination: String,
    /// The message that failed.
    pub message_id: String,
    /// The broker's error.
    pub source: Box<dyn StdError + Send + Sync>,
}

/// Why a relay pass failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The database failed; nothing of this pass is marked sent (what was published will
    /// be published again: consumers deduplicate by message ID).
    #[error("outbox: {0}")]
    Db(#[from] DbError),
}

impl<B: OutboxStore> crate::Idem<B> {
    /// Publishes up to `limit` outbox messages with `publisher` and marks them sent, in
    /// one transaction: the oldest unsent rows are locked with the engine's skip-locked
    /// read, so several relays share the work; a destination whose older message another
    /// relay holds is deferred (its messages stay unsent, in order). Delivery is at least
    /// once: a relay that dies after publishing and before its commit publishes again.
    ///
    /// A pass that meets a busy database, a deadlock or a lock timeout is run again under
    /// the retry policy ([`crate::Idem::with_retry`]). `limit` is capped at
    /// [`crate::runs::MAX_RELAY_BATCH`].
    pub async fn relay<P: Publisher>(
        &self,
        publisher: &P,
        limit: u32,
    ) -> Result<RelayReport, RelayError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.relay_once(publisher, limit).await {
                Err(RelayError::Db(e)) if e.kind().is_retryable() => {
                    self.pause::<std::convert::Infallible>(attempt, e)
                        .await
                        .map_err(|e| match e {
                            crate::Error::RetriesExhausted { last, .. } => RelayError::Db(last),
                            other => RelayError::Db(DbError::new(
                                "idem",
                                crate::ErrorKind::Other,
                                other.to_string(),
                            )),
                        })?;
                }
                other => return other,
            }
        }
    }

    async fn relay_once<P: Publisher>(
        &self,
        publisher: &P,
        limit: u32,
    ) -> Result<RelayReport, RelayError> {
        let backend = self.backend();
        let mut tx = backend.begin_runs(None).await?;
        match relay_in(backend, &mut tx, publisher, limit.clamp(1, MAX_RELAY_BATCH)).await {
            Ok((report, sent)) => {
                if !sent.is_empty()
                    && let Err(e) = backend.mark_sent(&mut tx, &sent).await
                {
                    let _ = backend.rollback_runs(tx).await;
                    return Err(e.into());
                }
                backend.commit_runs(tx).await?;
                Ok(report)
            }
            Err(e) => {
                let _ = backend.rollback_runs(tx).await;
                Err(e.into())
            }
        }
    }
}

type Sent = Vec<i64>;

async fn relay_in<B: OutboxStore, P: Publisher>(
    backend: &B,
    tx: &mut B::Tx,
    publisher: &P,
    limit: u32,
) -> Result<(RelayReport, Sent), DbError> {
    let rows = backend.lock_unsent(tx, limit).await?;
    let mut report = RelayReport::default();
    let mut sent = Vec::new();
    // Destinations in the order of their oldest locked message.
    let mut seen = BTreeSet::new();
    let destinations: Vec<&str> = rows
        .iter()
        .filter(|r| seen.insert(r.destination.as_str()))
        .map(|r| r.destination.as_str())
        .collect();
    for destination in destinations {
        let mine: Vec<&OutboxRow> = rows
            .iter()
            .filter(|r| r.destination == destination)
            .collect();
        let up_to = mine.last().map_or(0, |r| r.id);
        let unsent = backend.unsent_ids(tx, destination, up_to).await?;
        // Publish the longest run of our rows that starts at the destination's oldest
        // unsent message and has no row of another relay in between.
        let ready = mine
            .iter()
            .zip(unsent.iter())
            .take_while(|(row, id)| row.id == **id)
            .count();
        report.deferred += (mine.len() - ready) as u64;
        for (i, row) in mine[..ready].iter().enumerate() {
            if let Err(e) = publisher.publish(row).await {
                // This destination stops here, in order; the others go on.
                report.deferred += (ready - i - 1) as u64;
                report.failed.push(RelayFailure {
                    destination: row.destination.clone(),
                    message_id: row.message_id.clone(),
                    source: Box::new(e),
                });
                break;
            }
            sent.push(row.id);
            report.published += 1;
        }
    }
    Ok((report, sent))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outgoing_is_validated() {
        assert!(Outgoing::new("", "m", &1).is_err());
        assert!(Outgoing::new("d", "", &1).is_err());
        assert!(Outgoing::new("d", "a\nb", &1).is_err());
        assert!(Outgoing::new(&"d".repeat(256), "m", &1).is_err());
        let m = Outgoing::new("order.paid", "m-1", &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(m.payload(), r#"{"a":1}"#);
    }
}
