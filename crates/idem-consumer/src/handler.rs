//! The broker-independent half: a handler's effect through `Idem::consume`, the
//! redelivery backoff, and the counts a loop reports.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use idem_core::{
    Backend, BoxFuture, ErrorKind, Idem, MAX_JSON_DEPTH, MessageId, Request, Subscriber,
};

use crate::decision::{DeadLetterReason, Decision, classify};

/// What to do when the effect itself fails (see [`Handler::on_effect_error`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnEffectError {
    /// A final refusal: dead-letter with reason `effect-rejected`.
    DeadLetter,
    /// A passing failure: redeliver after a pause.
    Redeliver,
}

impl OnEffectError {
    /// The default decision for an effect's error, from the kind of the first database
    /// error in its chain of sources, as the engine classified it by its error code
    /// (`None`: the chain holds no database error):
    ///
    /// | database error in the chain | decision |
    /// |---|---|
    /// | none: the effect's own refusal (an unknown account, a rule of the business) | [`OnEffectError::DeadLetter`] |
    /// | [`ErrorKind::UniqueViolation`]: the message's data conflicts with stored data | [`OnEffectError::DeadLetter`] |
    /// | any other kind: a lost connection, a deadlock, a lock wait, a busy or failing database | [`OnEffectError::Redeliver`] |
    ///
    /// A lost connection is never final: the effect rolled back (or its outcome is
    /// unknown and the redelivery finds the record), and the message must come back.
    pub fn for_kind(kind: Option<ErrorKind>) -> Self {
        match kind {
            None | Some(ErrorKind::UniqueViolation) => Self::DeadLetter,
            Some(_) => Self::Redeliver,
        }
    }
}

/// A message's decoding and local effect. The consumer runs the effect through
/// [`Idem::consume`], in the same transaction as the `(subscriber, message_id)` record.
pub trait Handler<B: Backend>: Send + Sync {
    /// The decoded message (cloned into each transaction attempt).
    type Message: Clone + Send + Sync + 'static;
    /// What the effect returns.
    type Response: Send + 'static;
    /// The effect's error.
    type Error: StdError + Send + Sync + 'static;

    /// Decodes a body into the message and the canonical payload stored with the ID and
    /// compared on redelivery. An `Err` dead-letters the message (`malformed-body`) with
    /// the text as the detail.
    fn decode(&self, body: &[u8]) -> Result<(Self::Message, Request), String>;

    /// The local effect, inside the idem transaction.
    fn apply<'t>(
        &self,
        tx: &'t mut B::Tx,
        message: Self::Message,
    ) -> BoxFuture<'t, Result<Self::Response, Self::Error>>;

    /// Whether a failed effect is final (dead-letter) or passing (redeliver). Nothing
    /// committed either way. `kind` is the kind of the first database error in `error`'s
    /// chain of sources, found by the backend's classification of driver errors (by
    /// engine code, never by message text), `None` when the chain holds none. The
    /// default is [`OnEffectError::for_kind`]: the effect's own errors and unique
    /// violations are final, every other database error (a lost connection above all)
    /// is redelivered.
    fn on_effect_error(&self, error: &Self::Error, kind: Option<ErrorKind>) -> OnEffectError {
        let _ = error;
        OnEffectError::for_kind(kind)
    }

    /// Called once per delivery with the decision the loop carries out, before the
    /// broker is told (logging, metrics). A dead letter whose publish failed is seen
    /// here as [`Decision::Redeliver`].
    fn observe(&self, event: &Event<'_>) {
        let _ = event;
    }
}

/// A decision about to be carried out (passed to [`Handler::observe`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct Event<'a> {
    /// The broker's message ID, if the delivery had one.
    pub message_id: Option<&'a str>,
    /// Whether the broker marked the delivery as a redelivery.
    pub redelivered: bool,
    /// What the consumer is about to do.
    pub decision: &'a Decision,
}

/// Growing, jittered pauses before a failed message is returned to the broker: the
/// `n`-th consecutive failure waits a uniform time in `[d/2, d]` with
/// `d = min(max, base · 2^(n-1))`. A success resets the count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first pause's upper bound.
    pub base: Duration,
    /// No pause is longer.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The pause after `failures` consecutive failures (1 for the first).
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << failures.saturating_sub(1).min(20));
        let cap = exp.min(self.max);
        let micros = u64::try_from(cap.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(fastrand::u64(micros / 2..=micros))
    }
}

/// How long a broker request may take by default ([`Options::broker_timeout`]): generous,
/// so a loaded broker is not mistaken for a lost one.
pub const DEFAULT_BROKER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a loop keeps reconnecting to a broker it lost by default
/// ([`Options::reconnect_for`]).
pub const DEFAULT_RECONNECT_FOR: Duration = Duration::from_secs(300);

/// Settings shared by both brokers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// Deliveries the broker may hand over before they are acknowledged (AMQP
    /// `basic.qos` prefetch count; JetStream pull batch size). At least 1.
    pub prefetch: u16,
    /// Stop (successfully) after this long without any delivery.
    pub max_idle: Option<Duration>,
    /// Pauses before a failed message is returned.
    pub backoff: Backoff,
    /// How long one broker request may take before it counts as failed: connecting,
    /// the confirmation of a dead-letter publish (RabbitMQ's publisher confirm,
    /// JetStream's PubAck), a confirmed JetStream acknowledgement, sending a RabbitMQ
    /// acknowledgement (one not sent in time is a lost connection). A dead letter whose
    /// confirmation does not come in time is not acknowledged: the message is returned.
    pub broker_timeout: Duration,
    /// After the connection to the broker was lost (a restart, a network failure), how
    /// long the loop keeps reconnecting, with growing pauses, before it stops with the
    /// broker's error. Messages in hand are redelivered by the broker either way.
    /// Zero: stop at the first loss.
    pub reconnect_for: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            prefetch: 10,
            max_idle: None,
            backoff: Backoff::default(),
            broker_timeout: DEFAULT_BROKER_TIMEOUT,
            reconnect_for: DEFAULT_RECONNECT_FOR,
        }
    }
}

impl Options {
    /// Sets the prefetch count (values below 1 become 1).
    #[must_use]
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Stops after `idle` without deliveries.
    #[must_use]
    pub fn max_idle(mut self, idle: Option<Duration>) -> Self {
        self.max_idle = idle;
        self
    }

    /// Sets the redelivery backoff.
    #[must_use]
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Sets how long one broker request may take (at least 100 ms).
    #[must_use]
    pub fn broker_timeout(mut self, timeout: Duration) -> Self {
        self.broker_timeout = timeout.max(Duration::from_millis(100));
        self
    }

    /// Sets how long the loop keeps reconnecting to a lost broker.
    #[must_use]
    pub fn reconnect_for(mut self, period: Duration) -> Self {
        self.reconnect_for = period;
        self
    }
}

/// What a consumer loop did, counted per delivery.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Deliveries received.
    pub delivered: u64,
    /// Effects applied (and acknowledged).
    pub applied: u64,
    /// Duplicates acknowledged without effect.
    pub duplicates: u64,
    /// Messages published to the dead-letter destination and acknowledged.
    pub dead_lettered: u64,
    /// Negative acknowledgements: nothing committed, the broker redelivers.
    pub returned: u64,
    /// Connections to the broker lost and made again.
    pub reconnects: u64,
}

impl Stats {
    /// Counts a decision that was carried out.
    pub fn count(&mut self, decision: &Decision) {
        match decision {
            Decision::Applied => self.applied += 1,
            Decision::Duplicate => self.duplicates += 1,
            Decision::DeadLetter { .. } => self.dead_lettered += 1,
            Decision::Redeliver { .. } => self.returned += 1,
        }
    }

    /// Deliveries acknowledged (applied, duplicates and dead-lettered).
    pub fn acknowledged(&self) -> u64 {
        self.applied + self.duplicates + self.dead_lettered
    }
}

impl std::ops::Add for Stats {
    type Output = Stats;

    /// The counts of two runs together.
    fn add(self, other: Stats) -> Stats {
        Stats {
            delivered: self.delivered + other.delivered,
            applied: self.applied + other.applied,
            duplicates: self.duplicates + other.duplicates,
            dead_lettered: self.dead_lettered + other.dead_lettered,
            returned: self.returned + other.returned,
            reconnects: self.reconnects + other.reconnects,
        }
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} deliveries: {} applied, {} duplicates, {} dead-lettered, {} returned for redelivery, {} reconnections",
            self.delivered,
            self.applied,
            self.duplicates,
            self.dead_lettered,
            self.returned,
            self.reconnects
        )
    }
}

/// A subscriber's handler with its idem instance: the part of a consumer that knows
/// nothing about brokers. The broker loops are [`crate::amqp::run`] and
/// [`crate::nats::run`].
pub struct Consumer<B, H> {
    idem: Idem<B>,
    subscriber: Subscriber,
    handler: H,
    options: Options,
}

impl<B: fmt::Debug, H> fmt::Debug for Consumer<B, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("idem", &self.idem)
            .field("subscriber", &self.subscriber)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<B: Backend, H: Handler<B>> Consumer<B, H> {
    /// A consumer applying `handler` once per message ID for `subscriber`.
    pub fn new(idem: Idem<B>, subscriber: Subscriber, handler: H) -> Self {
        Self {
            idem,
            subscriber,
            handler,
            options: Options::default(),
        }
    }

    /// Replaces the options.
    #[must_use]
    pub fn with_options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    /// The options.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The subscriber.
    pub fn subscriber(&self) -> &Subscriber {
        &self.subscriber
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// Decides one delivery: the broker's message ID (if any) and the body. Runs the
    /// effect through [`Idem::consume`]; the caller acknowledges, dead-letters or
    /// returns the message as the [`Decision`] says.
    pub async fn handle(&self, message_id: Option<&str>, body: &[u8]) -> Decision {
        let Some(raw) = message_id.filter(|id| !id.is_empty()) else {
            return Decision::dead_letter(
                DeadLetterReason::MissingMessageId,
                "the delivery carries no message ID",
            );
        };
        let id = match MessageId::new(raw) {
            Ok(id) => id,
            Err(e) => {
                return Decision::dead_letter(DeadLetterReason::InvalidMessageId, e.to_string());
            }
        };
        let (message, payload) = match self.handler.decode(body) {
            Ok(decoded) => decoded,
            Err(why) => return Decision::dead_letter(DeadLetterReason::MalformedBody, why),
        };
        if let Some(refused) = self.unstorable(&payload) {
            return refused;
        }
        let handler = &self.handler;
        let idem = &self.idem;
        let result = idem
            .consume(&self.subscriber, &id, Some(&payload), |tx| {
                handler.apply(tx, message.clone())
            })
            .await;
        classify(result, |e| {
            let kind = idem.classify_effect_error(e);
            match handler.on_effect_error(e, kind) {
                OnEffectError::Redeliver => Decision::redeliver(e.to_string()),
                OnEffectError::DeadLetter => {
                    Decision::dead_letter(DeadLetterReason::EffectRejected, e.to_string())
                }
            }
        })
    }

    /// A payload idem would refuse to store, decided before any SQL: nested too deeply
    /// (`Request::new` keeps no canonical text for it) or larger than the limit.
    fn unstorable(&self, payload: &Request) -> Option<Decision> {
        let text = payload.as_json();
        if text.is_empty() {
            return Some(Decision::dead_letter(
                DeadLetterReason::MalformedBody,
                format!("the decoded payload nests deeper than {MAX_JSON_DEPTH} levels"),
            ));
        }
        let limit = self.idem.max_request_bytes();
        if text.len() > limit {
            return Some(Decision::dead_letter(
                DeadLetterReason::PayloadTooLarge,
                format!(
                    "the decoded payload is {} bytes of canonical JSON, more than the limit of {limit} bytes",
                    text.len()
                ),
            ));
        }
        None
    }
}

/// Reconnection after a lost broker: pauses growing from 100 ms to 5 s, for at most
/// [`Options::reconnect_for`] since the loss.
#[derive(Debug)]
#[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(dead_code))]
pub(crate) struct Lost {
    since: tokio::time::Instant,
    attempts: u32,
}

#[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(dead_code))]
impl Lost {
    pub(crate) fn new() -> Self {
        Self {
            since: tokio::time::Instant::now(),
            attempts: 0,
        }
    }

    /// The error a loop stops with when the reconnection period ended: the broker
    /// stayed out of reach (the last failure as its source).
    #[cfg_attr(not(any(feature = "amqp", feature = "nats")), allow(dead_code))]
    pub(crate) fn gave_up(
        broker: &'static str,
        options: &Options,
        last: crate::ConsumerError,
    ) -> crate::ConsumerError {
        crate::ConsumerError::broker(
            broker,
            format!("get the broker back within {:?}", options.reconnect_for),
            last,
        )
    }

    /// The pause before the next attempt to reach the broker again, or `None` when the
    /// reconnection period is over.
    pub(crate) fn next_pause(&mut self, options: &Options) -> Option<Duration> {
        if self.since.elapsed() >= options.reconnect_for {
            return None;
        }
        self.attempts = self.attempts.saturating_add(1);
        Some(
            Backoff {
                base: Duration::from_millis(100),
                max: Duration::from_secs(5),
            }
            .delay(self.attempts),
        )
    }
}

/// Counts consecutive redeliveries to size the pause before the next negative
/// acknowledgement (for a loop over another broker, as in [`crate::amqp`]).
#[derive(Debug, Default)]
pub struct Failures(u32);

impl Failures {
    /// The pause before returning a message after `decision` (`None` after a success,
    /// which resets the count).
    pub fn after(&mut self, decision: &Decision, backoff: &Backoff) -> Option<Duration> {
        if let Decision::Redeliver { .. } = decision {
            self.0 = self.0.saturating_add(1);
            Some(backoff.delay(self.0))
        } else {
            self.0 = 0;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let b = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        for _ in 0..50 {
            let first = b.delay(1);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            let fourth = b.delay(4);
            assert!(fourth >= Duration::from_millis(400) && fourth <= Duration::from_millis(800));
            assert!(b.delay(40) <= Duration::from_secs(1));
            assert!(b.delay(40) >= Duration::from_millis(500));
        }
    }

    #[test]
    fn only_final_effect_errors_are_dead_lettered() {
        // The effect's own refusal and a conflict with stored data are final.
        assert_eq!(OnEffectError::for_kind(None), OnEffectError::DeadLetter);
        assert_eq!(
            OnEffectError::for_kind(Some(ErrorKind::UniqueViolation)),
            OnEffectError::DeadLetter
        );
        // Everything else the database says is not the message's fault.
        for kind in [
            ErrorKind::Connection,
            ErrorKind::Busy,
            ErrorKind::Deadlock,
            ErrorKind::SerializationFailure,
            ErrorKind::LockTimeout,
            ErrorKind::Transient,
            ErrorKind::Authentication,
            ErrorKind::MissingDatabase,
            ErrorKind::MissingTable,
            ErrorKind::ClientLibraryMissing,
            ErrorKind::CorruptRecord,
            ErrorKind::Configuration,
            ErrorKind::Other,
        ] {
            assert_eq!(
                OnEffectError::for_kind(Some(kind)),
                OnEffectError::Redeliver,
                "{kind}"
            );
        }
    }

    #[test]
    fn reconnection_stops_after_its_period() {
        let options = Options::default().reconnect_for(Duration::ZERO);
        assert_eq!(Lost::new().next_pause(&options), None);
        let options = Options::default().reconnect_for(Duration::from_secs(60));
        let mut lost = Lost::new();
        for _ in 0..20 {
            let pause = lost.next_pause(&options).unwrap();
            assert!(pause <= Duration::from_secs(5));
        }
    }

    #[test]
    fn a_success_resets_the_failures() {
        let b = Backoff::default();
        let mut f = Failures::default();
        assert!(f.after(&Decision::redeliver("down"), &b).is_some());
        assert!(f.after(&Decision::redeliver("down"), &b).is_some());
        assert_eq!(f.0, 2);
        assert_eq!(f.after(&Decision::Applied, &b), None);
        assert_eq!(f.0, 0);
    }

    #[test]
    fn stats_count_acknowledgements() {
        let mut s = Stats::default();
        s.count(&Decision::Applied);
        s.count(&Decision::Duplicate);
        s.count(&Decision::dead_letter(DeadLetterReason::MalformedBody, "x"));
        s.count(&Decision::redeliver("down"));
        assert_eq!(s.acknowledged(), 3);
        assert_eq!(s.returned, 1);
    }
}
