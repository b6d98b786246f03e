//! The transactional outbox: messages stored in the effect's transaction, published
//! later by a relay ([`crate::Idem::relay`]), at least once, in order per destination.
//!
//! ```text
//!  claim (tx 1, short) ──▶ publish (no transaction, each with a timeout) ──▶ record (tx 2, short)
//!  lock due rows, skip       the broker's confirm, or a failed attempt      sent / retry later /
//!  locked ones; keep the                                                    dead / given back,
//!  order per destination;                                                   guarded by the pass's
//!  claim: token + lease                                                     claim token
//! ```
//!
//! No transaction is open while the relay waits for a broker: a slow or silent broker
//! never holds a lock a producer needs (on SQLite, the database's only write lock).

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{DbError, ErrorKind, InvalidInput};
use crate::ident::MAX_IDENT_BYTES;
use crate::observe;
use crate::runs::{
    DueRow, MAX_RELAY_BATCH, OutboxEntry, OutboxFilter, OutboxRow, OutboxStats, OutboxStore,
};

/// The default limit on an outbox message's payload (its JSON text): 1 MiB, like a
/// request's.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// The most characters of a failed attempt's error kept in `last_error`.
pub const MAX_ERROR_CHARS: usize = 1000;

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
    /// without control characters; the payload must serialize to JSON of at most
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`] (see [`Outgoing::with_limit`]).
    pub fn new<T: Serialize + ?Sized>(
        destination: &str,
        message_id: &str,
        payload: &T,
    ) -> Result<Self, InvalidInput> {
        Self::with_limit(destination, message_id, payload, DEFAULT_MAX_PAYLOAD_BYTES)
    }

    /// Like [`Outgoing::new`], with the payload limited to `max_bytes` of JSON instead of
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`] (brokers have their own limits: RabbitMQ's
    /// `max_message_size`, NATS's `max_payload`, 1 MiB by default).
    pub fn with_limit<T: Serialize + ?Sized>(
        destination: &str,
        message_id: &str,
        payload: &T,
        max_bytes: usize,
    ) -> Result<Self, InvalidInput> {
        check_name("outbox destination", destination)?;
        check_name("outbox message id", message_id)?;
        let payload = serde_json::to_string(payload).map_err(|e| {
            InvalidInput::new("outbox payload", format!("cannot be stored as JSON: {e}"))
        })?;
        if payload.len() > max_bytes {
            return Err(InvalidInput::new(
                "outbox payload",
                format!(
                    "is {} bytes of JSON, more than the limit of {max_bytes} \
                     (Outgoing::with_limit)",
                    payload.len()
                ),
            ));
        }
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

    /// Publishes `message`; `Ok` only when the broker has it. The relay bounds each call
    /// by [`RelayOptions::publish_timeout`]: a call still waiting then is a failed
    /// attempt (the broker may still store the message: it is published again later,
    /// with the same message ID).
    fn publish(&self, message: &OutboxRow) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// How a relay pass claims, publishes and retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayOptions {
    /// Messages claimed per pass (1 to [`MAX_RELAY_BATCH`]; default 100).
    pub batch: u32,
    /// Attempts per message before it is dead (default 10). A dead message is no longer
    /// published and no longer holds its destination back; an operator retries or drops
    /// it ([`crate::Idem::outbox_retry`], [`crate::Idem::outbox_drop`]).
    pub max_attempts: u32,
    /// The pause after a message's first failed attempt (default 1 s); it doubles with
    /// every further failure up to `max_delay`, with jitter (each pause is drawn between
    /// half and all of its value).
    pub base_delay: Duration,
    /// The longest pause between two attempts of a message (default 5 min).
    pub max_delay: Duration,
    /// How long one publish may wait for the broker's confirmation (default 10 s):
    /// after it, the attempt has failed.
    pub publish_timeout: Duration,
    /// How long a pass's claim lasts (default 60 s, longer than `publish_timeout`). A
    /// relay that dies mid-pass leaves its claims to run out; the messages are then
    /// published again (each expired claim counted as an attempt). A pass starts no
    /// publish it could not finish within its claim.
    pub claim_lease: Duration,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch: 100,
            max_attempts: 10,
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            publish_timeout: Duration::from_secs(10),
            claim_lease: Duration::from_secs(60),
        }
    }
}

impl RelayOptions {
    /// The default options with `batch` messages per pass.
    pub fn with_batch(batch: u32) -> Self {
        Self {
            batch,
            ..Self::default()
        }
    }

    fn check(&self) -> Result<(), InvalidInput> {
        if self.max_attempts == 0 {
            return Err(InvalidInput::new(
                "relay max_attempts",
                "must be at least 1",
            ));
        }
        if self.publish_timeout.is_zero() {
            return Err(InvalidInput::new(
                "relay publish_timeout",
                "must be more than zero",
            ));
        }
        if self.claim_lease <= self.publish_timeout {
            return Err(InvalidInput::new(
                "relay claim_lease",
                format!(
                    "{:?} must be longer than the publish timeout ({:?}), or a claim could \
                     run out while its message is being published",
                    self.claim_lease, self.publish_timeout
                ),
            ));
        }
        if self.base_delay > self.max_delay {
            return Err(InvalidInput::new(
                "relay base_delay",
                format!(
                    "{:?} is longer than max_delay ({:?})",
                    self.base_delay, self.max_delay
                ),
            ));
        }
        Ok(())
    }

    /// The pause before the next attempt after `attempts` attempts, the last one failed:
    /// `base · 2^(attempts-1)` capped at `max_delay`, drawn between half and all of it.
    pub fn backoff(&self, attempts: i64) -> Duration {
        let shift = u32::try_from(attempts.saturating_sub(1).clamp(0, 30)).unwrap_or(30);
        let full = self
            .base_delay
            .saturating_mul(1u32 << shift)
            .min(self.max_delay);
        let micros = u64::try_from(full.as_micros()).unwrap_or(u64::MAX);
        let half = micros / 2;
        Duration::from_micros(half + fastrand::u64(0..=micros - half))
    }
}

/// What one relay pass did.
#[derive(Debug, Default)]
pub struct RelayReport {
    /// Messages published and marked sent.
    pub published: u64,
    /// Messages due but left for a later pass, to keep the order per destination: an
    /// older message of their destination is held by another relay, or one failed in
    /// this pass, or the pass ran out of claim time.
    pub deferred: u64,
    /// The failed attempts of this pass, one per destination at most (a destination
    /// stops at its first failure; the others go on).
    pub failed: Vec<RelayFailure>,
    /// Messages that became dead in this pass (their last attempt failed, or its relay
    /// stopped before recording it).
    pub dead: u64,
    /// The backlog after the pass.
    pub backlog: OutboxStats,
}

/// A failed attempt: the broker refused the message, or did not confirm it in time.
#[derive(Debug, thiserror::Error)]
#[error(
    "publishing outbox message {message_id} to {destination} failed (attempt {attempts}{}): {source}",
    if *dead { ", no attempts left: dead" } else { "" }
)]
pub struct RelayFailure {
    /// The destination.
    pub destination: String,
    /// The message that failed.
    pub message_id: String,
    /// Its attempts so far, this one included.
    pub attempts: i64,
    /// `true` when this was its last attempt: the message is dead.
    pub dead: bool,
    /// The broker's error, or the timeout.
    pub source: Box<dyn StdError + Send + Sync>,
}

/// Why a relay pass failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The database failed. What was claimed and not recorded is published again once the
    /// claim runs out (consumers deduplicate by message ID).
    #[error("outbox: {0}")]
    Db(#[from] DbError),
    /// The options were refused before any SQL.
    #[error(transparent)]
    InvalidInput(#[from] InvalidInput),
}

/// A publish that outlived [`RelayOptions::publish_timeout`].
#[derive(Debug)]
struct PublishTimedOut(Duration);

impl fmt::Display for PublishTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the broker did not confirm within {} ms (the publish timeout); the message may \
             still have reached it",
            self.0.as_millis()
        )
    }
}

impl StdError for PublishTimedOut {}

/// A claim token: 128 random bits, hex.
fn new_token() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// The error text kept in `last_error`: every `scheme://user:secret@` masked, at most
/// [`MAX_ERROR_CHARS`] characters.
pub(crate) fn error_text(e: &(dyn StdError + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    let masked = mask_userinfo(&text);
    match masked.char_indices().nth(MAX_ERROR_CHARS) {
        Some((cut, _)) => format!("{}…", &masked[..cut]),
        None => masked,
    }
}

/// Replaces the user information of every `scheme://user:password@host` (and
/// `scheme://token@host`) in free text by `***`.
fn mask_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | ')'))
            .unwrap_or(tail.len());
        let (authority_and_more, after) = tail.split_at(end);
        let authority_end = authority_and_more
            .find('/')
            .unwrap_or(authority_and_more.len());
        match authority_and_more[..authority_end].rfind('@') {
            Some(userinfo_end) => {
                out.push_str("***");
                out.push_str(&authority_and_more[userinfo_end..]);
            }
            None => out.push_str(authority_and_more),
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// How a claimed message's attempt ended.
enum Attempt {
    Sent,
    Failed(Box<dyn StdError + Send + Sync>),
    NotTried,
}

impl<B: OutboxStore> crate::Idem<B> {
    /// One relay pass with the default [`RelayOptions`] and `limit` messages at most
    /// (capped at [`MAX_RELAY_BATCH`]); see [`Idem::relay_with`](crate::Idem::relay_with).
    pub async fn relay<P: Publisher>(
        &self,
        publisher: &P,
        limit: u32,
    ) -> Result<RelayReport, RelayError> {
        self.relay_with(publisher, &RelayOptions::with_batch(limit))
            .await
    }

    /// One relay pass, in two short transactions with the publishing between them:
    ///
    /// 1. **claim**: the oldest due messages are locked with the engine's skip-locked
    ///    read (so several relays share the work); per destination, only the run of
    ///    them that starts at the destination's oldest pending message is claimed (a
    ///    claim token and a lease, `claimed_until`); commit;
    /// 2. **publish**, outside any transaction, each within the publish timeout, in
    ///    order per destination; a destination stops at its first failure (the others
    ///    go on), and no publish starts that could not end within the claim;
    /// 3. **record**, guarded by the claim token: sent; or a failed attempt (the error
    ///    kept, the next attempt after an exponential backoff with jitter, or dead after
    ///    the last attempt); or given back (not tried). Commit.
    ///
    /// Delivery is at least once: a relay that dies after publishing and before step 3
    /// leaves its claims to run out, and the messages are published again (the expired
    /// claim counted as an attempt); consumers deduplicate by message ID. Order per
    /// destination: a message is published only when no older message of its
    /// destination is still pending (unsent and not dead), so a failing message holds
    /// its destination back until it is sent or dead; a dead message no longer does,
    /// and the ones after it go on in their order.
    ///
    /// A claim or record transaction that meets a busy database, a deadlock or a lock
    /// timeout is run again under the retry policy ([`crate::Idem::with_retry`]).
    pub async fn relay_with<P: Publisher>(
        &self,
        publisher: &P,
        options: &RelayOptions,
    ) -> Result<RelayReport, RelayError> {
        options.check()?;
        let engine = self.backend().engine();
        let span = tracing::info_span!(
            "idem.relay",
            engine,
            published = tracing::field::Empty,
            failed = tracing::field::Empty,
            dead = tracing::field::Empty
        );
        let result =
            tracing::Instrument::instrument(self.relay_pass(publisher, options), span.clone())
                .await;
        if let Ok(report) = &result {
            span.record("published", report.published);
            span.record("failed", report.failed.len());
            span.record("dead", report.dead);
            observe::relayed(engine, report);
        }
        result
    }

    async fn relay_pass<P: Publisher>(
        &self,
        publisher: &P,
        options: &RelayOptions,
    ) -> Result<RelayReport, RelayError> {
        let began = Instant::now();
        let token = new_token();
        let limit = options.batch.clamp(1, MAX_RELAY_BATCH);
        let mut report = RelayReport::default();
        let claimed = self
            .with_retries(|| self.claim_pass(limit, &token, options))
            .await?;
        report.deferred += claimed.deferred;
        report.dead += claimed.buried;

        // Publish, per destination in order, outside any transaction.
        let mut outcomes: Vec<(DueRow, Attempt)> = Vec::new();
        for rows in claimed.destinations {
            let mut stopped = false;
            for due in rows {
                let room = options.claim_lease.saturating_sub(options.publish_timeout);
                if stopped || began.elapsed() >= room {
                    outcomes.push((due, Attempt::NotTried));
                    continue;
                }
                let attempt = match tokio::time::timeout(
                    options.publish_timeout,
                    publisher.publish(&due.row),
                )
                .await
                {
                    Ok(Ok(())) => Attempt::Sent,
                    Ok(Err(e)) => Attempt::Failed(Box::new(e)),
                    Err(_) => Attempt::Failed(Box::new(PublishTimedOut(options.publish_timeout))),
                };
                if matches!(attempt, Attempt::Failed(_)) {
                    stopped = true;
                }
                outcomes.push((due, attempt));
            }
        }

        // Record what happened, guarded by the claim token.
        let sent: Vec<i64> = outcomes
            .iter()
            .filter(|(_, a)| matches!(a, Attempt::Sent))
            .map(|(d, _)| d.row.id)
            .collect();
        let untried: Vec<i64> = outcomes
            .iter()
            .filter(|(_, a)| matches!(a, Attempt::NotTried))
            .map(|(d, _)| d.row.id)
            .collect();
        let mut failures = Vec::new();
        for (due, attempt) in outcomes {
            if let Attempt::Failed(source) = attempt {
                let dead = due.attempts >= i64::from(options.max_attempts);
                let retry_in = (!dead).then(|| options.backoff(due.attempts));
                failures.push((due, source, retry_in));
            }
        }
        let recorded = if sent.is_empty() && untried.is_empty() && failures.is_empty() {
            0
        } else {
            self.with_retries(|| self.record_pass(&token, &sent, &untried, &failures))
                .await?
        };
        report.published = recorded;
        report.deferred += untried.len() as u64;
        for (due, source, retry_in) in failures {
            let dead = retry_in.is_none();
            if dead {
                report.dead += 1;
            }
            report.failed.push(RelayFailure {
                destination: due.row.destination,
                message_id: due.row.message_id,
                attempts: due.attempts,
                dead,
                source,
            });
        }
        report.backlog = self.backend().outbox_stats().await?;
        Ok(report)
    }

    /// Runs `pass` again under the retry policy while it fails with a retryable error.
    async fn with_retries<T, F, Fut>(&self, mut pass: F) -> Result<T, RelayError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, DbError>>,
    {
        let mut attempt = 0;
        loop {
            attempt += 1;
            match pass().await {
                Err(e) if e.kind().is_retryable() => {
                    self.pause::<std::convert::Infallible>(attempt, e)
                        .await
                        .map_err(|e| match e {
                            crate::Error::RetriesExhausted { last, .. } => RelayError::Db(last),
                            other => RelayError::Db(DbError::new(
                                "idem",
                                ErrorKind::Other,
                                other.to_string(),
                            )),
                        })?;
                }
                Err(e) => return Err(e.into()),
                Ok(v) => return Ok(v),
            }
        }
    }

    /// Transaction 1: lock the due rows, keep per destination the run that starts at its
    /// oldest pending message, bury the ones whose last attempt's relay died, claim the
    /// rest; commit.
    async fn claim_pass(
        &self,
        limit: u32,
        token: &str,
        options: &RelayOptions,
    ) -> Result<Claimed, DbError> {
        let backend = self.backend();
        let mut tx = backend.begin_runs(None).await?;
        let result = async {
            let rows = backend.lock_due(&mut tx, limit).await?;
            let mut claimed = Claimed::default();
            // Destinations in the order of their oldest locked message.
            let mut seen = BTreeSet::new();
            let order: Vec<String> = rows
                .iter()
                .filter(|r| seen.insert(r.row.destination.clone()))
                .map(|r| r.row.destination.clone())
                .collect();
            let mut per: BTreeMap<String, Vec<DueRow>> = BTreeMap::new();
            for r in rows {
                per.entry(r.row.destination.clone()).or_default().push(r);
            }
            let mut ids = Vec::new();
            let mut buried = Vec::new();
            for destination in order {
                let mine = per.remove(&destination).unwrap_or_default();
                let up_to = mine.last().map_or(0, |r| r.row.id);
                let pending = backend.pending_ids(&mut tx, &destination, up_to).await?;
                // The longest run of our rows that starts at the destination's oldest
                // pending message, with no row of another relay in between.
                let ready = mine
                    .iter()
                    .zip(pending.iter())
                    .take_while(|(row, id)| row.row.id == **id)
                    .count();
                let total = mine.len();
                let mut run = Vec::new();
                let mut buried_here = 0;
                for due in mine.into_iter().take(ready) {
                    if due.attempts >= i64::from(options.max_attempts) {
                        // Its last attempt's relay stopped before recording it: dead.
                        // The rest of the destination waits for the next pass (the
                        // order holds: this one is no longer pending then).
                        buried.push(due.row.id);
                        buried_here = 1;
                        break;
                    }
                    ids.push(due.row.id);
                    let counted = DueRow {
                        attempts: due.attempts + 1,
                        ..due
                    };
                    run.push(counted);
                }
                claimed.deferred += (total - run.len() - buried_here) as u64;
                if !run.is_empty() {
                    claimed.destinations.push(run);
                }
            }
            for id in &buried {
                backend
                    .record_failure(
                        &mut tx,
                        *id,
                        token,
                        "no attempts left: the relay of the last attempt stopped before it \
                         recorded the outcome (its claim ran out)",
                        None,
                    )
                    .await?;
            }
            claimed.buried = buried.len() as u64;
            if !ids.is_empty() {
                backend
                    .claim_due(&mut tx, &ids, token, options.claim_lease)
                    .await?;
            }
            Ok::<_, DbError>(claimed)
        }
        .await;
        match result {
            Ok(claimed) => {
                backend.commit_runs(tx).await?;
                Ok(claimed)
            }
            Err(e) => {
                let _ = backend.rollback_runs(tx).await;
                Err(e)
            }
        }
    }

    /// Transaction 2: what the pass did, guarded by its claim token. Returns how many
    /// messages were marked sent.
    async fn record_pass(
        &self,
        token: &str,
        sent: &[i64],
        untried: &[i64],
        failures: &[(DueRow, Box<dyn StdError + Send + Sync>, Option<Duration>)],
    ) -> Result<u64, DbError> {
        let backend = self.backend();
        let mut tx = backend.begin_runs(None).await?;
        let result = async {
            let marked = if sent.is_empty() {
                0
            } else {
                backend.mark_sent(&mut tx, sent, token).await?
            };
            if !untried.is_empty() {
                backend.release(&mut tx, untried, token).await?;
            }
            for (due, source, retry_in) in failures {
                let text = error_text(source.as_ref());
                backend
                    .record_failure(&mut tx, due.row.id, token, &text, *retry_in)
                    .await?;
            }
            Ok::<_, DbError>(marked)
        }
        .await;
        match result {
            Ok(marked) => {
                backend.commit_runs(tx).await?;
                Ok(marked)
            }
            Err(e) => {
                let _ = backend.rollback_runs(tx).await;
                Err(e)
            }
        }
    }

    /// The outbox's backlog: pending and dead messages, and the oldest pending one's age.
    pub async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        let stats = self.backend().outbox_stats().await?;
        observe::backlog(self.backend().engine(), &stats);
        Ok(stats)
    }

    /// Lists unsent messages (pending, dead, or both), oldest first.
    pub async fn outbox_list(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        let filter = OutboxFilter {
            limit: filter.limit.clamp(1, MAX_RELAY_BATCH),
            ..filter.clone()
        };
        self.backend().list_outbox(&filter).await
    }

    /// Puts messages back to pending, due now, with a fresh set of attempts: the given
    /// ids (pending or dead; sent ones are left alone), or, with no ids, every dead
    /// message (of `destination`, when given). Returns how many changed.
    pub async fn outbox_retry(
        &self,
        ids: &[i64],
        destination: Option<&str>,
    ) -> Result<u64, DbError> {
        let mut n = 0;
        if ids.is_empty() {
            return self.backend().retry_outbox(&[], destination).await;
        }
        for chunk in ids.chunks(MAX_RELAY_BATCH as usize) {
            n += self.backend().retry_outbox(chunk, None).await?;
        }
        Ok(n)
    }

    /// Deletes unsent messages so they are never published: the given ids (pending or
    /// dead), or, with no ids, every dead message (of `destination`, when given).
    /// Returns how many it deleted. A message a relay is publishing right now may still
    /// reach the broker.
    pub async fn outbox_drop(
        &self,
        ids: &[i64],
        destination: Option<&str>,
    ) -> Result<u64, DbError> {
        let mut n = 0;
        if ids.is_empty() {
            return self.backend().drop_outbox(&[], destination).await;
        }
        for chunk in ids.chunks(MAX_RELAY_BATCH as usize) {
            n += self.backend().drop_outbox(chunk, None).await?;
        }
        Ok(n)
    }
}

/// What a pass claimed: per destination, the rows to publish in order (their attempts
/// counting this one).
#[derive(Default)]
struct Claimed {
    destinations: Vec<Vec<DueRow>>,
    deferred: u64,
    buried: u64,
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

    #[test]
    fn payloads_are_limited_before_any_sql() {
        let big = "x".repeat(DEFAULT_MAX_PAYLOAD_BYTES);
        let e = Outgoing::new("d", "m", &big).unwrap_err();
        assert_eq!(e.what(), "outbox payload");
        assert!(e.problem().contains("limit"), "{e}");
        assert!(Outgoing::with_limit("d", "m", &"abc", 5).is_ok());
        assert!(Outgoing::with_limit("d", "m", &"abcd", 5).is_err());
    }

    #[test]
    fn backoff_doubles_with_jitter_and_is_capped() {
        let o = RelayOptions {
            base_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(10),
            ..RelayOptions::default()
        };
        for _ in 0..100 {
            let first = o.backoff(1);
            assert!(first >= Duration::from_millis(500) && first <= Duration::from_secs(1));
            let third = o.backoff(3);
            assert!(third >= Duration::from_secs(2) && third <= Duration::from_secs(4));
            assert!(o.backoff(60) <= Duration::from_secs(10));
            assert!(o.backoff(60) >= Duration::from_secs(5));
        }
        assert!(o.backoff(0) <= Duration::from_secs(1));
    }

    #[test]
    fn options_are_checked() {
        assert!(RelayOptions::default().check().is_ok());
        let bad = RelayOptions {
            claim_lease: Duration::from_secs(5),
            ..RelayOptions::default()
        };
        assert!(bad.check().is_err());
        let none = RelayOptions {
            max_attempts: 0,
            ..RelayOptions::default()
        };
        assert!(none.check().is_err());
    }

    #[test]
    fn error_texts_are_masked_and_bounded() {
        let e = std::io::Error::other(
            "cannot reach amqp://guest:s3cret@broker:5672/%2f or nats://tok3n@n:4222 (x)",
        );
        let t = error_text(&e);
        assert!(!t.contains("s3cret") && !t.contains("tok3n"), "{t}");
        assert!(t.contains("amqp://***@broker:5672/%2f"), "{t}");
        assert!(t.contains("nats://***@n:4222"), "{t}");
        let long = std::io::Error::other("é".repeat(5000));
        assert_eq!(error_text(&long).chars().count(), MAX_ERROR_CHARS + 1);
    }
}
