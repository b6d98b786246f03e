//! What to do with one delivery, decided once for every broker.

use std::fmt;

use idem_core::{Consumed, Error};

/// Why a message was dead-lettered. The code ([`DeadLetterReason::code`]) is the value
/// of the [`crate::REASON_HEADER`] header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The delivery carried no message ID (`missing-message-id`).
    MissingMessageId,
    /// The message ID is not a valid idem message ID: longer than 255 bytes or with
    /// control characters (`invalid-message-id`).
    InvalidMessageId,
    /// The handler's [`crate::Handler::decode`] refused the body (not parseable, or
    /// values it does not accept), or the decoded payload nests deeper than
    /// [`idem_core::MAX_JSON_DEPTH`] levels (`malformed-body`).
    MalformedBody,
    /// The decoded payload is larger than idem stores with a message ID
    /// ([`idem_core::Idem::with_max_request_bytes`] of canonical JSON) (`payload-too-large`).
    PayloadTooLarge,
    /// The message ID was processed before with a different payload (`payload-mismatch`).
    PayloadMismatch,
    /// The effect refused the message for good: its error was final (see
    /// [`crate::OnEffectError::for_kind`]) (`effect-rejected`).
    EffectRejected,
}

impl DeadLetterReason {
    /// The stable code written in the reason header.
    pub fn code(self) -> &'static str {
        match self {
            Self::MissingMessageId => "missing-message-id",
            Self::InvalidMessageId => "invalid-message-id",
            Self::MalformedBody => "malformed-body",
            Self::PayloadTooLarge => "payload-too-large",
            Self::PayloadMismatch => "payload-mismatch",
            Self::EffectRejected => "effect-rejected",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// What the consumer does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// The effect and its record committed in this delivery: acknowledge.
    Applied,
    /// The subscriber processed this message ID before: acknowledge, nothing ran.
    Duplicate,
    /// Publish to the dead-letter destination with the reason, then acknowledge.
    DeadLetter {
        /// Why.
        reason: DeadLetterReason,
        /// A human-readable detail.
        detail: String,
    },
    /// Nothing committed: negatively acknowledge after a pause, for redelivery.
    Redeliver {
        /// What failed.
        detail: String,
    },
}

impl Decision {
    /// A dead-letter decision.
    pub fn dead_letter(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Self::DeadLetter {
            reason,
            detail: detail.into(),
        }
    }

    /// A redelivery decision.
    pub fn redeliver(detail: impl Into<String>) -> Self {
        Self::Redeliver {
            detail: detail.into(),
        }
    }
}

/// What idem's [`InvalidInput`] names a consumed message's ID (`MessageId::new`).
const MESSAGE_ID_INPUT: &str = "message ID";
/// What idem's [`InvalidInput`] names a consumed message's payload
/// (`Idem::consume`: larger than the request limit).
const PAYLOAD_INPUT: &str = "message payload";

/// Classifies the result of [`idem_core::Idem::consume`]. `effect` decides for the
/// effect's own errors (see [`crate::Handler::on_effect_error`]).
///
/// - `Ok(Applied)` → [`Decision::Applied`]; `Ok(Duplicate)` → [`Decision::Duplicate`];
/// - a payload mismatch → dead-letter (`payload-mismatch`);
/// - the message ID refused before any SQL → dead-letter (`invalid-message-id`); the
///   payload refused before any SQL (over the size limit) → dead-letter
///   (`payload-too-large`);
/// - any other refused input (the consumer's own settings, such as a message retention
///   below [`idem_core::MIN_RETENTION`]) → redeliver: it is not the message's fault, and
///   the message must survive until the setting is fixed;
/// - another delivery of the same ID still in flight, a lock wait, exhausted retries,
///   or any database error → redeliver: the database is not the message's fault, and
///   nothing committed.
pub fn classify<R, E: fmt::Display>(
    result: Result<Consumed<R>, Error<E>>,
    effect: impl FnOnce(&E) -> Decision,
) -> Decision {
    match result {
        Ok(Consumed::Applied(_)) => Decision::Applied,
        Ok(Consumed::Duplicate) => Decision::Duplicate,
        Err(Error::PayloadMismatch { stored, supplied }) => Decision::dead_letter(
            DeadLetterReason::PayloadMismatch,
            format!(
                "message ID reused with a different payload (stored {stored}, supplied {supplied})"
            ),
        ),
        Err(Error::InvalidInput(e)) => match e.what() {
            MESSAGE_ID_INPUT => {
                Decision::dead_letter(DeadLetterReason::InvalidMessageId, e.to_string())
            }
            PAYLOAD_INPUT => {
                Decision::dead_letter(DeadLetterReason::PayloadTooLarge, e.to_string())
            }
            _ => Decision::redeliver(e.to_string()),
        },
        Err(Error::Effect(e)) => effect(&e),
        Err(other) => Decision::redeliver(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_core::{DbError, ErrorKind, InvalidInput};
    use serde_json::json;

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("boom")]
    struct Boom;

    fn final_effect(_: &Boom) -> Decision {
        Decision::dead_letter(DeadLetterReason::EffectRejected, "boom")
    }

    #[test]
    fn successes_are_acknowledged() {
        assert_eq!(
            classify::<u8, Boom>(Ok(Consumed::Applied(1)), final_effect),
            Decision::Applied
        );
        assert_eq!(
            classify::<u8, Boom>(Ok(Consumed::Duplicate), final_effect),
            Decision::Duplicate
        );
    }

    #[test]
    fn poison_messages_are_dead_lettered() {
        let d = classify::<u8, Boom>(
            Err(Error::PayloadMismatch {
                stored: json!({"amount": 50}),
                supplied: json!({"amount": 51}),
            }),
            final_effect,
        );
        assert!(
            matches!(&d, Decision::DeadLetter { reason: DeadLetterReason::PayloadMismatch, detail } if detail.contains("51")),
            "{d:?}"
        );
        let d = classify::<u8, Boom>(
            Err(Error::InvalidInput(InvalidInput::new(
                "message ID",
                "too long",
            ))),
            final_effect,
        );
        assert!(matches!(
            d,
            Decision::DeadLetter {
                reason: DeadLetterReason::InvalidMessageId,
                ..
            }
        ));
        let d = classify::<u8, Boom>(
            Err(Error::InvalidInput(InvalidInput::new(
                "message payload",
                "is 2000000 bytes of canonical JSON, more than the limit",
            ))),
            final_effect,
        );
        assert!(
            matches!(
                d,
                Decision::DeadLetter {
                    reason: DeadLetterReason::PayloadTooLarge,
                    ..
                }
            ),
            "an oversized payload is not an invalid message ID: {d:?}"
        );
        let d = classify::<u8, Boom>(Err(Error::Effect(Boom)), final_effect);
        assert!(matches!(
            d,
            Decision::DeadLetter {
                reason: DeadLetterReason::EffectRejected,
                ..
            }
        ));
    }

    #[test]
    fn database_failures_are_redelivered() {
        for kind in [
            ErrorKind::Connection,
            ErrorKind::Other,
            ErrorKind::CorruptRecord,
        ] {
            let d = classify::<u8, Boom>(
                Err(Error::Backend(DbError::new("postgres", kind, "down"))),
                final_effect,
            );
            assert!(matches!(d, Decision::Redeliver { .. }), "{kind}: {d:?}");
        }
        let d = classify::<u8, Boom>(
            Err(Error::RetriesExhausted {
                attempts: 10,
                last: DbError::new("mysql", ErrorKind::Deadlock, "deadlock"),
            }),
            final_effect,
        );
        assert!(matches!(d, Decision::Redeliver { .. }));
        let d = classify::<u8, Boom>(
            Err(Error::InProgress {
                waited: Duration::from_secs(5),
            }),
            final_effect,
        );
        assert!(matches!(d, Decision::Redeliver { .. }));
    }

    #[test]
    fn a_refused_setting_is_not_the_message_fault() {
        // A retention below the minimum refuses every call: dead-lettering would empty
        // the queue into the dead-letter destination until the setting is fixed.
        let d = classify::<u8, Boom>(
            Err(Error::InvalidInput(InvalidInput::new(
                "message retention",
                "0ns is shorter than the minimum of 1s",
            ))),
            final_effect,
        );
        assert!(matches!(d, Decision::Redeliver { .. }), "{d:?}");
        let d = classify::<u8, Boom>(
            Err(Error::LockWait {
                waited: Duration::from_secs(5),
            }),
            final_effect,
        );
        assert!(matches!(d, Decision::Redeliver { .. }), "{d:?}");
    }

    #[test]
    fn reason_codes_are_stable() {
        let all = [
            (DeadLetterReason::MissingMessageId, "missing-message-id"),
            (DeadLetterReason::InvalidMessageId, "invalid-message-id"),
            (DeadLetterReason::MalformedBody, "malformed-body"),
            (DeadLetterReason::PayloadTooLarge, "payload-too-large"),
            (DeadLetterReason::PayloadMismatch, "payload-mismatch"),
            (DeadLetterReason::EffectRejected, "effect-rejected"),
        ];
        for (reason, code) in all {
            assert_eq!(reason.code(), code);
            assert_eq!(reason.to_string(), code);
        }
    }
}
