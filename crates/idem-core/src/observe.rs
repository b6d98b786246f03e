//! Observability: one `tracing` span per call and, with the `metrics` feature, counters
//! and histograms through the [`metrics`](https://docs.rs/metrics) facade.
//!
//! Every name and label idem emits is defined in this module (and listed in
//! `docs/operations.md`). Spans and events never carry the key, the request or the
//! response: only the engine, the principal, the operation, a short hash of the key, the
//! attempt number, the retry cause and the outcome.
//!
//! # Spans
//!
//! Each call of [`Idem::execute`](crate::Idem::execute),
//! [`Idem::execute_final`](crate::Idem::execute_final), [`Idem::consume`](crate::Idem::consume)
//! and [`Idem::purge`](crate::Idem::purge) runs inside an `INFO` span named
//! [`SPAN_NAME`] with the fields [`FIELD_CALL`], [`FIELD_ENGINE`], [`FIELD_PRINCIPAL`],
//! [`FIELD_OPERATION`], [`FIELD_KEY_HASH`], [`FIELD_ATTEMPT`] and [`FIELD_OUTCOME`] (for
//! messages, the principal is the subscriber and the key hash is the message ID's). A
//! retry emits an `INFO` event with the attempt that failed and its cause; giving up
//! emits a `WARN` event.
//!
//! # Metrics (feature `metrics`)
//!
//! | name | kind | labels |
//! |---|---|---|
//! | [`EXECUTED`] | counter | `call`, `engine` |
//! | [`REPLAYED`] | counter | `call`, `engine` |
//! | [`KEY_REUSED`] | counter | `call`, `engine` |
//! | [`IN_PROGRESS`] | counter | `call`, `engine` |
//! | [`RETRIED`] | counter | `engine`, `cause` |
//! | [`RETRIES_EXHAUSTED`] | counter | `call`, `engine` |
//! | [`EFFECT_FAILED`] | counter | `call`, `engine` |
//! | [`CALL_DURATION`] | histogram (seconds) | `call`, `engine`, `outcome` |
//! | [`RUNS_STARTED`] | counter | `engine` |
//! | [`RUN_TAKEOVERS`] | counter | `engine` |
//! | [`RUN_PHASES`] | counter | `engine` |
//! | [`RUN_LEASE_LOST`] | counter | `engine` |
//! | [`RUNS_FINISHED`] | counter | `engine`, `status` |
//! | [`RUN_UNKNOWN_COMMITS`] | counter | `engine` |
//! | [`RELAY_PUBLISHED`] | counter | `engine` |
//! | [`RELAY_FAILED`] | counter | `engine` |
//! | [`RELAY_DEAD`] | counter | `engine` |
//! | [`OUTBOX_PENDING`] | gauge | `engine` |
//! | [`OUTBOX_DEAD`] | gauge | `engine` |
//! | [`OUTBOX_OLDEST_PENDING_AGE`] | gauge (seconds) | `engine` |
//!
//! Principals, operations, keys, message IDs and outbox destinations are never labels:
//! their number is unbounded.
//!
//! Phased runs (`start`, `phase`, `finish`, `fail`, `complete`) run in `INFO` spans named
//! [`RUN_SPAN_NAME`] (fields `call`, `engine`, `principal`, `operation`, `key_hash`,
//! `point`, `fence`, `outcome`); a relay pass runs in [`RELAY_SPAN_NAME`] (fields
//! `engine`, `published`, `failed`, `dead`).

use std::fmt::Write as _;
use std::time::Instant;

use sha2::{Digest, Sha256};
use tracing::Span;
use tracing::field::Empty;

use crate::backend::Status;
use crate::error::{DbError, Error, ErrorKind};
use crate::ident::{Key, Scope};
use crate::outbox::RelayReport;
use crate::runs::OutboxStats;

/// The span every call runs in.
pub const SPAN_NAME: &str = "idem.call";
/// Span field and metric label: which call (`execute`, `execute_final`, `consume`, `purge`).
pub const FIELD_CALL: &str = "call";
/// Span field and metric label: the engine (`sqlite`, `postgres`, `mysql`, `mssql`, `oracle`).
pub const FIELD_ENGINE: &str = "engine";
/// Span field: the principal (for messages, the subscriber).
pub const FIELD_PRINCIPAL: &str = "principal";
/// Span field: the operation and its version (`debit:v1`); empty for messages and purges.
pub const FIELD_OPERATION: &str = "operation";
/// Span field: the first 8 bytes of SHA-256 over the key (or message ID), in hex.
pub const FIELD_KEY_HASH: &str = "key_hash";
/// Span and event field: the transaction attempt, from 1.
pub const FIELD_ATTEMPT: &str = "attempt";
/// Span field and metric label: how the call ended (see [`Outcome`]).
pub const FIELD_OUTCOME: &str = "outcome";
/// Event field and metric label: why an attempt is retried (an [`ErrorKind`] as
/// `snake_case`: `busy`, `deadlock`, `serialization_failure`, `lock_timeout`, `transient`).
pub const FIELD_CAUSE: &str = "cause";

/// Counter: effects that ran and committed with their record.
pub const EXECUTED: &str = "idem_executed_total";
/// Counter: calls answered from a stored record (a message already processed counts here).
pub const REPLAYED: &str = "idem_replayed_total";
/// Counter: keys refused because they came with a different request (or payload).
pub const KEY_REUSED: &str = "idem_key_reused_total";
/// Counter: calls refused because another call with the same key was still running.
pub const IN_PROGRESS: &str = "idem_in_progress_total";
/// Counter: transactions retried, by cause.
pub const RETRIED: &str = "idem_retried_total";
/// Counter: calls that gave up after the retry policy's last attempt.
pub const RETRIES_EXHAUSTED: &str = "idem_retries_exhausted_total";
/// Counter: calls whose effect failed (rolled back, nothing stored).
pub const EFFECT_FAILED: &str = "idem_effect_failed_total";
/// Histogram: a call's duration in seconds, by outcome.
pub const CALL_DURATION: &str = "idem_call_duration_seconds";

/// Which protocol call is observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallKind {
    Execute,
    ExecuteFinal,
    Consume,
    Purge,
}

impl CallKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Execute => "execute",
            Self::ExecuteFinal => "execute_final",
            Self::Consume => "consume",
            Self::Purge => "purge",
        }
    }
}

/// How a call ended: the values of the [`FIELD_OUTCOME`] field and label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// `executed`: the effect ran and committed (for `purge`: the purge finished).
    Executed,
    /// `replayed`: a stored response (or an already processed message) answered.
    Replayed,
    /// `key_reused`: the key (or message ID) came with a different request (or payload).
    KeyReused,
    /// `in_progress`: another call with the same key did not finish within the wait.
    InProgress,
    /// `effect_failed`: the effect returned an error; nothing was stored.
    EffectFailed,
    /// `retries_exhausted`: every attempt hit a retryable engine error.
    RetriesExhausted,
    /// `invalid_input`: refused before any SQL.
    InvalidInput,
    /// `error`: any other failure (engine, connection, decoding).
    Error,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::KeyReused => "key_reused",
            Self::InProgress => "in_progress",
            Self::EffectFailed => "effect_failed",
            Self::RetriesExhausted => "retries_exhausted",
            Self::InvalidInput => "invalid_input",
            Self::Error => "error",
        }
    }

    /// The outcome of a failed call.
    pub(crate) fn of_error<E>(e: &Error<E>) -> Self {
        match e {
            Error::InvalidInput(_) => Self::InvalidInput,
            Error::KeyReused { .. } | Error::PayloadMismatch { .. } => Self::KeyReused,
            Error::Effect(_) => Self::EffectFailed,
            Error::InProgress { .. } | Error::LeaseLost { .. } => Self::InProgress,
            Error::LockWait { .. } => Self::RetriesExhausted,
            // A stored final rejection is a replay, refused only by the caller's type.
            Error::StoredRejection(_) => Self::Replayed,
            Error::RetriesExhausted { .. } => Self::RetriesExhausted,
            Error::Decode(_) | Error::Backend(_) => Self::Error,
        }
    }

    /// The counter this outcome increments, if any.
    #[cfg(feature = "metrics")]
    fn counter(self) -> Option<&'static str> {
        match self {
            Self::Executed => Some(EXECUTED),
            Self::Replayed => Some(REPLAYED),
            Self::KeyReused => Some(KEY_REUSED),
            Self::InProgress => Some(IN_PROGRESS),
            Self::EffectFailed => Some(EFFECT_FAILED),
            Self::RetriesExhausted => Some(RETRIES_EXHAUSTED),
            Self::InvalidInput | Self::Error => None,
        }
    }
}

/// The cause label of a retry.
pub fn cause_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::UniqueViolation => "unique_violation",
        ErrorKind::Busy => "busy",
        ErrorKind::Deadlock => "deadlock",
        ErrorKind::SerializationFailure => "serialization_failure",
        ErrorKind::LockTimeout => "lock_timeout",
        ErrorKind::Transient => "transient",
        ErrorKind::Connection => "connection",
        ErrorKind::Authentication => "authentication",
        ErrorKind::MissingDatabase => "missing_database",
        ErrorKind::MissingTable => "missing_table",
        ErrorKind::ClientLibraryMissing => "client_library_missing",
        ErrorKind::CorruptRecord => "corrupt_record",
        ErrorKind::Configuration => "configuration",
        ErrorKind::Other => "other",
    }
}

/// A short, stable hash of a key for correlating log lines: the first 8 bytes of its
/// SHA-256, in hex. It identifies a key without showing it; a key with little entropy
/// (`order-42`) can still be guessed from it, so treat it like an internal identifier.
pub fn key_hash(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut out = String::with_capacity(16);
    for byte in &digest[..8] {
        // Writing to a String cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// One observed call: its span, its labels and its start.
#[derive(Debug)]
pub(crate) struct Call {
    span: Span,
    kind: CallKind,
    engine: &'static str,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    start: Instant,
}

impl Call {
    /// Opens the span of a call. The key hash is computed only when a subscriber listens.
    pub(crate) fn new(
        kind: CallKind,
        engine: &'static str,
        principal: &str,
        operation: Option<&str>,
        key: Option<&str>,
    ) -> Self {
        let span = tracing::info_span!(
            "idem.call",
            call = kind.as_str(),
            engine,
            principal,
            operation = Empty,
            key_hash = Empty,
            attempt = Empty,
            outcome = Empty,
        );
        if !span.is_disabled() {
            if let Some(op) = operation {
                span.record(FIELD_OPERATION, op);
            }
            if let Some(key) = key {
                span.record(FIELD_KEY_HASH, key_hash(key));
            }
        }
        Self {
            span,
            kind,
            engine,
            start: Instant::now(),
        }
    }

    /// The span, to instrument the call's future with.
    pub(crate) fn span(&self) -> Span {
        self.span.clone()
    }

    /// Records how the call ended: the span's outcome, its counter and its duration.
    pub(crate) fn finish(self, outcome: Outcome) {
        self.span.record(FIELD_OUTCOME, outcome.as_str());
        #[cfg(feature = "metrics")]
        {
            let call = self.kind.as_str();
            if let Some(name) = outcome.counter() {
                metrics::counter!(name, FIELD_CALL => call, FIELD_ENGINE => self.engine)
                    .increment(1);
            }
            metrics::histogram!(
                CALL_DURATION,
                FIELD_CALL => call,
                FIELD_ENGINE => self.engine,
                FIELD_OUTCOME => outcome.as_str()
            )
            .record(self.start.elapsed().as_secs_f64());
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (self.kind, self.engine);
    }

    /// Finishes the call from its result.
    pub(crate) fn finish_with<T, E>(
        self,
        result: &Result<T, Error<E>>,
        ok: impl Fn(&T) -> Outcome,
    ) {
        self.finish(match result {
            Ok(value) => ok(value),
            Err(e) => Outcome::of_error(e),
        });
    }
}

/// Records the transaction attempt now starting on the current call's span.
pub(crate) fn attempt(attempt: u32) {
    Span::current().record(FIELD_ATTEMPT, attempt);
}

/// A retryable engine error ended `attempt`; another attempt follows.
pub(crate) fn retrying(engine: &'static str, attempt: u32, cause: ErrorKind) {
    let cause = cause_label(cause);
    tracing::info!(
        attempt,
        cause,
        "idem: retrying after a retryable database error"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!(RETRIED, FIELD_ENGINE => engine, FIELD_CAUSE => cause).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// A retryable engine error ended the last attempt the policy allows.
pub(crate) fn giving_up(attempt: u32, cause: ErrorKind) {
    let cause = cause_label(cause);
    tracing::warn!(attempt, cause, "idem: retries exhausted");
}

// ---------------------------------------------------------------------------------------
// Phased runs and the outbox relay

/// The span of a phased run's call (`start`, `phase`, `finish`, `fail`, `complete`).
pub const RUN_SPAN_NAME: &str = "idem.run";
/// The span of a relay pass.
pub const RELAY_SPAN_NAME: &str = "idem.relay";
/// Span field: a run's recovery point (the one committed, for `phase`).
pub const FIELD_POINT: &str = "point";
/// Span field: a run's fencing generation.
pub const FIELD_FENCE: &str = "fence";
/// Metric label: how a run ended (`succeeded`, `failed`).
pub const FIELD_STATUS: &str = "status";

/// Counter: phased runs started (a new key's run committed).
pub const RUNS_STARTED: &str = "idem_runs_started_total";
/// Counter: runs taken over after their owner's lease ended (by a retry or the
/// completer).
pub const RUN_TAKEOVERS: &str = "idem_run_takeovers_total";
/// Counter: phases committed.
pub const RUN_PHASES: &str = "idem_run_phases_total";
/// Counter: writes of a run refused because another call had taken it over (fencing).
pub const RUN_LEASE_LOST: &str = "idem_run_lease_lost_total";
/// Counter: runs that stored their final answer, by `status`.
pub const RUNS_FINISHED: &str = "idem_runs_finished_total";
/// Counter: commits of a phase or an answer whose outcome is unknown (the connection
/// was lost around `COMMIT`).
pub const RUN_UNKNOWN_COMMITS: &str = "idem_run_unknown_commits_total";
/// Counter: outbox messages published and marked sent.
pub const RELAY_PUBLISHED: &str = "idem_relay_published_total";
/// Counter: failed publishing attempts (refused, or not confirmed in time).
pub const RELAY_FAILED: &str = "idem_relay_failed_total";
/// Counter: outbox messages that became dead (no attempts left).
pub const RELAY_DEAD: &str = "idem_relay_dead_total";
/// Gauge: outbox messages still to be published, after the last relay pass.
pub const OUTBOX_PENDING: &str = "idem_outbox_pending";
/// Gauge: dead outbox messages, after the last relay pass.
pub const OUTBOX_DEAD: &str = "idem_outbox_dead";
/// Gauge: the age in seconds of the oldest pending outbox message (0 when none).
pub const OUTBOX_OLDEST_PENDING_AGE: &str = "idem_outbox_oldest_pending_age_seconds";

/// Opens the span of a call on a phased run.
pub(crate) fn run_span(
    call: &'static str,
    engine: &'static str,
    scope: &Scope,
    key: &Key,
    point: &str,
    fence: i64,
) -> Span {
    let span = tracing::info_span!(
        "idem.run",
        call,
        engine,
        principal = scope.principal.as_str(),
        operation = scope.operation.as_str(),
        key_hash = Empty,
        point = Empty,
        fence,
        outcome = Empty,
    );
    if !span.is_disabled() {
        span.record(FIELD_KEY_HASH, key_hash(key.as_str()));
        if !point.is_empty() {
            span.record(FIELD_POINT, point);
        }
    }
    span
}

/// A call owns a run: a new one, or one taken over (`resumed`).
pub(crate) fn run_owned(span: &Span, engine: &'static str, resumed: bool, fence: i64, point: &str) {
    span.record(FIELD_FENCE, fence);
    span.record(FIELD_POINT, point);
    if resumed {
        span.record(FIELD_OUTCOME, "taken_over");
        tracing::info!(parent: span, fence, point, "idem: run taken over");
    } else {
        span.record(FIELD_OUTCOME, "started");
    }
    #[cfg(feature = "metrics")]
    metrics::counter!(if resumed { RUN_TAKEOVERS } else { RUNS_STARTED }, FIELD_ENGINE => engine)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// A start found the run's stored final answer.
pub(crate) fn run_replayed(span: &Span) {
    span.record(FIELD_OUTCOME, Outcome::Replayed.as_str());
}

/// A phase committed at `point`.
pub(crate) fn run_phase(span: &Span, engine: &'static str, point: &str) {
    span.record(FIELD_OUTCOME, "committed");
    span.record(FIELD_POINT, point);
    #[cfg(feature = "metrics")]
    metrics::counter!(RUN_PHASES, FIELD_ENGINE => engine).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// A run stored its final answer.
pub(crate) fn run_finished(span: &Span, engine: &'static str, status: Status) {
    let status = match status {
        Status::Succeeded => "succeeded",
        Status::Rejected => "failed",
    };
    span.record(FIELD_OUTCOME, status);
    #[cfg(feature = "metrics")]
    metrics::counter!(RUNS_FINISHED, FIELD_ENGINE => engine, FIELD_STATUS => status).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// A call on a run failed.
pub(crate) fn run_call_failed<E>(span: &Span, e: &Error<E>) {
    let outcome = match e {
        Error::LeaseLost { .. } => "lease_lost",
        e => Outcome::of_error(e).as_str(),
    };
    span.record(FIELD_OUTCOME, outcome);
}

/// A write of a run was refused: another call took it over.
pub(crate) fn run_lease_lost(engine: &'static str, fence: i64) {
    tracing::warn!(
        fence,
        "idem: run lease lost: another call took the run over; this write was refused"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!(RUN_LEASE_LOST, FIELD_ENGINE => engine).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// The commit of a phase or an answer ended with an unknown outcome.
pub(crate) fn run_unknown_commit(engine: &'static str, e: &DbError) {
    let cause = cause_label(e.kind());
    tracing::warn!(
        cause,
        "idem: the outcome of a run's commit is unknown; the handle writes nothing more"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!(RUN_UNKNOWN_COMMITS, FIELD_ENGINE => engine).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// What a relay pass did.
pub(crate) fn relayed(engine: &'static str, report: &RelayReport) {
    for failure in &report.failed {
        let message_hash = key_hash(&failure.message_id);
        if failure.dead {
            tracing::warn!(
                destination = failure.destination.as_str(),
                message_hash,
                attempts = failure.attempts,
                "idem: an outbox message is dead (no attempts left); retry or drop it"
            );
        } else {
            tracing::info!(
                destination = failure.destination.as_str(),
                message_hash,
                attempts = failure.attempts,
                "idem: publishing an outbox message failed; it will be tried again"
            );
        }
    }
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(RELAY_PUBLISHED, FIELD_ENGINE => engine).increment(report.published);
        metrics::counter!(RELAY_FAILED, FIELD_ENGINE => engine)
            .increment(report.failed.len() as u64);
        metrics::counter!(RELAY_DEAD, FIELD_ENGINE => engine).increment(report.dead);
    }
    backlog(engine, &report.backlog);
}

/// The outbox's backlog, as gauges.
pub(crate) fn backlog(engine: &'static str, stats: &OutboxStats) {
    #[cfg(feature = "metrics")]
    {
        // Gauges are f64: exact up to 2^53 messages.
        #[allow(clippy::cast_precision_loss)]
        {
            metrics::gauge!(OUTBOX_PENDING, FIELD_ENGINE => engine).set(stats.pending as f64);
            metrics::gauge!(OUTBOX_DEAD, FIELD_ENGINE => engine).set(stats.dead as f64);
        }
        metrics::gauge!(OUTBOX_OLDEST_PENDING_AGE, FIELD_ENGINE => engine).set(
            stats
                .oldest_pending_age
                .map_or(0.0, |age| age.as_secs_f64()),
        );
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (engine, stats);
}

/// Registers a description and unit for every metric with the installed recorder.
///
/// Optional: exporters such as Prometheus show the descriptions as `HELP` lines. Call it
/// once after installing the recorder.
#[cfg(feature = "metrics")]
pub fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        EXECUTED,
        "Effects that ran and committed with their idempotency record"
    );
    describe_counter!(REPLAYED, "Calls answered from a stored record");
    describe_counter!(
        KEY_REUSED,
        "Keys refused because they came with a different request"
    );
    describe_counter!(
        IN_PROGRESS,
        "Calls refused because the same key was still in progress"
    );
    describe_counter!(
        RETRIED,
        "Transactions retried after a retryable database error"
    );
    describe_counter!(
        RETRIES_EXHAUSTED,
        "Calls that gave up after the last allowed attempt"
    );
    describe_counter!(
        EFFECT_FAILED,
        "Calls whose effect failed; nothing was stored"
    );
    describe_histogram!(CALL_DURATION, Unit::Seconds, "Duration of an idem call");
    metrics::describe_counter!(RUNS_STARTED, "Phased runs started (a new key)");
    metrics::describe_counter!(
        RUN_TAKEOVERS,
        "Phased runs taken over after their owner's lease ended"
    );
    metrics::describe_counter!(RUN_PHASES, "Phases of phased runs committed");
    metrics::describe_counter!(
        RUN_LEASE_LOST,
        "Writes of a phased run refused because another call took it over"
    );
    metrics::describe_counter!(RUNS_FINISHED, "Phased runs that stored their final answer");
    metrics::describe_counter!(
        RUN_UNKNOWN_COMMITS,
        "Commits of a phase or answer whose outcome is unknown (connection lost)"
    );
    metrics::describe_counter!(RELAY_PUBLISHED, "Outbox messages published and marked sent");
    metrics::describe_counter!(
        RELAY_FAILED,
        "Failed publishing attempts (refused or not confirmed in time)"
    );
    metrics::describe_counter!(RELAY_DEAD, "Outbox messages that became dead");
    metrics::describe_gauge!(OUTBOX_PENDING, "Outbox messages still to be published");
    metrics::describe_gauge!(OUTBOX_DEAD, "Dead outbox messages");
    metrics::describe_gauge!(
        OUTBOX_OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest pending outbox message"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_hashes_are_short_stable_and_hide_the_key() {
        let h = key_hash("checkout-42");
        assert_eq!(h.len(), 16);
        assert!(h.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(h, key_hash("checkout-42"));
        assert_ne!(h, key_hash("checkout-43"));
        assert!(!h.contains("checkout"));
    }

    /// Every outcome, `in_progress` included (no engine answers `Claimed::InFlight` in a
    /// live test yet), lands on its documented counter and histogram label.
    #[cfg(feature = "metrics")]
    #[test]
    fn every_outcome_has_its_counter_and_histogram_label() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        let cases = [
            (Outcome::Executed, Some(EXECUTED)),
            (Outcome::Replayed, Some(REPLAYED)),
            (Outcome::KeyReused, Some(KEY_REUSED)),
            (Outcome::InProgress, Some(IN_PROGRESS)),
            (Outcome::EffectFailed, Some(EFFECT_FAILED)),
            (Outcome::RetriesExhausted, Some(RETRIES_EXHAUSTED)),
            (Outcome::InvalidInput, None),
            (Outcome::Error, None),
        ];
        let in_progress: Error<()> = Error::InProgress {
            waited: std::time::Duration::from_millis(5),
        };
        assert_eq!(Outcome::of_error(&in_progress), Outcome::InProgress);
        for (outcome, counter) in cases {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            metrics::with_local_recorder(&recorder, || {
                Call::new(CallKind::Execute, "sqlite", "p", Some("op:v1"), Some("k"))
                    .finish(outcome);
            });
            let snapshot = snapshotter.snapshot().into_vec();
            let names: Vec<&str> = snapshot.iter().map(|(k, ..)| k.key().name()).collect();
            let mut want = vec![CALL_DURATION];
            want.extend(counter);
            want.sort_unstable();
            let mut got = names.clone();
            got.sort_unstable();
            assert_eq!(got, want, "{outcome:?}");
            for (key, _, _, value) in &snapshot {
                let labels: Vec<(&str, &str)> =
                    key.key().labels().map(|l| (l.key(), l.value())).collect();
                assert!(labels.contains(&(FIELD_CALL, "execute")), "{labels:?}");
                assert!(labels.contains(&(FIELD_ENGINE, "sqlite")), "{labels:?}");
                match value {
                    DebugValue::Counter(n) => assert_eq!(*n, 1),
                    DebugValue::Histogram(samples) => {
                        assert_eq!(samples.len(), 1);
                        assert!(labels.contains(&(FIELD_OUTCOME, outcome.as_str())));
                    }
                    DebugValue::Gauge(_) => panic!("no gauges"),
                }
            }
        }
    }
}
