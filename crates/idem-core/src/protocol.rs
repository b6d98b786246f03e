//! The protocol, written once for every engine.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tracing::Instrument;

use crate::backend::{
    Backend, Claim, Claimed, Finish, Identity, Maintenance, Status, Stored, Table,
};
use crate::effect::{EffectError, find_in_chain};
use crate::error::{DbError, Error, ErrorKind, InvalidInput};
use crate::ident::{DEFAULT_RETENTION, Key, MessageId, Scope, Subscriber};
use crate::observe::{self, Call, CallKind};
use crate::request::Request;

/// A boxed, sendable future: what an effect returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What an idempotent call did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<R> {
    /// The effect ran in this call and its response was stored with it.
    Executed(R),
    /// An earlier call with the same key and request committed; this is its stored
    /// response (never recomputed from today's state).
    Replayed(R),
}

impl<R> Outcome<R> {
    /// The response, whichever way it was obtained.
    pub fn into_inner(self) -> R {
        match self {
            Self::Executed(r) | Self::Replayed(r) => r,
        }
    }

    /// The response by reference.
    pub fn response(&self) -> &R {
        match self {
            Self::Executed(r) | Self::Replayed(r) => r,
        }
    }

    /// Whether this call replayed a stored response.
    pub fn is_replayed(&self) -> bool {
        matches!(self, Self::Replayed(_))
    }
}

/// What consuming a message did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumed<R> {
    /// The effect ran and the message ID was recorded with it: acknowledge now.
    Applied(R),
    /// This subscriber already processed the message: acknowledge without effect.
    Duplicate,
}

/// Bounded retries of whole transactions, with full-jitter exponential backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Transactions tried at most, the first included.
    pub max_attempts: u32,
    /// The first backoff's upper bound.
    pub base_delay: Duration,
    /// No backoff exceeds this.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            base_delay: Duration::from_millis(2),
            max_delay: Duration::from_millis(250),
        }
    }
}

impl RetryPolicy {
    /// The pause before attempt `attempt + 1`: uniform in `0..=min(max, base·2^(attempt-1))`.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .base_delay
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let cap = exp.min(self.max_delay);
        let micros = u64::try_from(cap.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(fastrand::u64(0..=micros))
    }
}

/// An uninhabited response type: `execute` never stores rejections.
#[derive(Debug)]
enum Never {}

impl Serialize for Never {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        match *self {}
    }
}

enum Done<R, J> {
    Executed(Result<R, J>),
    /// The stored response's JSON text, decoded straight into the caller's type so that
    /// numbers replay exactly (no detour through `serde_json::Value`).
    Replayed(Status, String),
}

enum Step<E> {
    /// A retryable engine error: back off, then a new attempt (counted).
    Retry(DbError),
    /// The effect returned a final rejection: store it in a fresh transaction now
    /// (not a failure, so not counted and no backoff).
    StoreRejection,
    /// Give up with this error.
    Fail(Error<E>),
}

impl<E> From<DbError> for Step<E> {
    fn from(e: DbError) -> Self {
        if e.kind().is_retryable() {
            Step::Retry(e)
        } else {
            Step::Fail(Error::Backend(e))
        }
    }
}

/// What a purge deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Request records deleted.
    pub requests: u64,
    /// Processed-message records deleted.
    pub messages: u64,
    /// Phased runs deleted.
    pub runs: u64,
    /// Sent outbox messages deleted.
    pub outbox: u64,
    /// Delete statements run.
    pub batches: u32,
    /// Batches that hit a busy database, a deadlock or a lock timeout and were run again
    /// under the retry policy.
    pub retried: u32,
}

/// The idempotency client: a backend plus the protocol.
///
/// ```no_run
/// # async fn demo<B: idem_core::Backend>(idem: idem_core::Idem<B>) -> Result<(), Box<dyn std::error::Error>> {
/// use idem_core::{Key, Operation, Outcome, Principal, Request, Scope};
/// let scope = Scope::new(Principal::new("account-1")?, Operation::new("debit", 1)?);
/// let key = Key::new("checkout-42")?;
/// let request = Request::new(serde_json::json!({"amount": 100}));
/// # Ok(()) }
/// ```
pub struct Idem<B> {
    backend: B,
    retry: RetryPolicy,
    message_retention: Duration,
    fast_path: bool,
    wait: Duration,
    max_request_bytes: usize,
    max_response_bytes: usize,
    lease: Duration,
}

/// The default limit on a request's (or message payload's) canonical JSON, and on a
/// stored response: 1 MiB.
pub const DEFAULT_MAX_JSON_BYTES: usize = 1 << 20;

/// The default bound on how long a call waits for a concurrent call with the same key
/// before it answers [`Error::InProgress`].
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

impl<B: fmt::Debug> fmt::Debug for Idem<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idem")
            .field("backend", &self.backend)
            .field("retry", &self.retry)
            .field("message_retention", &self.message_retention)
            .field("fast_path", &self.fast_path)
            .field("wait", &self.wait)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("lease", &self.lease)
            .finish()
    }
}

impl<B: Clone> Clone for Idem<B> {
    fn clone(&self) -> Self {
        Self {
            backend: self.backend.clone(),
            ..*self
        }
    }
}

impl<B: Backend> Idem<B> {
    /// Wraps a backend with the default retry policy and a 24-hour message retention.
    pub fn new(backend: B) -> Self {
        Self {
            backend,
            retry: RetryPolicy::default(),
            message_retention: DEFAULT_RETENTION,
            fast_path: true,
            wait: DEFAULT_WAIT,
            max_request_bytes: DEFAULT_MAX_JSON_BYTES,
            max_response_bytes: DEFAULT_MAX_JSON_BYTES,
            lease: crate::phased::DEFAULT_LEASE,
        }
    }

    /// Sets the lease of a phased run's owner (default
    /// [`crate::phased::DEFAULT_LEASE`], at least [`crate::phased::MIN_LEASE`]): while
    /// it lasts, retries of the key get [`Error::InProgress`]; once it has ended, the
    /// next retry takes the run over. Every committed phase renews it; renew it during a
    /// long external call with [`crate::Run::heartbeat`].
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The lease of a phased run's owner.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The wait bound ([`Idem::with_wait_timeout`]).
    pub fn wait_timeout(&self) -> Duration {
        self.wait
    }

    /// The request size limit ([`Idem::with_max_request_bytes`]).
    pub fn max_request_bytes(&self) -> usize {
        self.max_request_bytes
    }

    /// The response size limit ([`Idem::with_max_response_bytes`]).
    pub fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// Sleeps before attempt `attempt + 1` after the retryable `last`, or gives up.
    pub(crate) async fn pause<E>(&self, attempt: u32, last: DbError) -> Result<(), Error<E>> {
        self.next_attempt(Step::Retry(last), attempt).await
    }

    /// An effect's error: the engine error to retry after (a deadlock inside it), or
    /// the call's final error.
    pub(crate) fn effect_retry<E: EffectError<M>, M>(&self, e: E) -> Result<DbError, Error<E>> {
        match self.classify_chain(e.as_std_error()) {
            Some(kind) if kind.is_retryable() => {
                let msg = e.to_string();
                Ok(DbError::new("effect", kind, msg).with_boxed_source(e.into_std_error()))
            }
            _ => Err(Error::Effect(e)),
        }
    }

    /// Refuses requests (and message payloads) whose canonical JSON is larger than
    /// `bytes` with [`Error::InvalidInput`], before any SQL (default
    /// [`DEFAULT_MAX_JSON_BYTES`]).
    #[must_use]
    pub fn with_max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }

    /// Refuses to store responses whose JSON is larger than `bytes`: the effect is rolled
    /// back and the call ends with [`Error::InvalidInput`] (default
    /// [`DEFAULT_MAX_JSON_BYTES`]).
    #[must_use]
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Bounds how long a call waits for a concurrent call with the same key (or message
    /// ID) that claimed it first (default [`DEFAULT_WAIT`]). When it elapses the call
    /// ends with [`Error::InProgress`], which is not retried: the client retries later
    /// with the same key. Each engine enforces it with its own lock-wait mechanism.
    #[must_use]
    pub fn with_wait_timeout(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the retry policy for busy databases, deadlocks and serialization failures.
    #[must_use]
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sets how long processed message IDs are remembered (the longest redelivery window).
    #[must_use]
    pub fn with_message_retention(mut self, retention: Duration) -> Self {
        self.message_retention = retention;
        self
    }

    /// Turns the read-only replay fast path on (default) or off: the option that trades
    /// replay cost against new-request cost. On, [`Idem::execute`] first reads the record
    /// without a write transaction, so a replay costs one read (as many round trips as a
    /// bare primary-key read) and a new request pays that read before its claim (one
    /// round trip on PostgreSQL, where both run on one pooled connection, and on
    /// MariaDB). Off, a new request saves that round trip, and a replay goes through the
    /// claim: a write transaction whose `INSERT` finds the record (PostgreSQL: 3 more
    /// round trips than the read). Choose off when nearly every key is new. Measured in
    /// `docs/performance.md`.
    #[must_use]
    pub fn with_fast_path(mut self, on: bool) -> Self {
        self.fast_path = on;
        self
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Runs `effect` once per `(scope, key)`: the first call runs it in the engine's
    /// transaction and commits its response with the record; a retry with an equal
    /// request gets the stored response; a different request is refused with
    /// [`Error::KeyReused`]. An effect error rolls everything back and stores nothing.
    pub async fn execute<R, E, M, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        mut effect: F,
    ) -> Result<Outcome<R>, Error<E>>
    where
        R: Serialize + DeserializeOwned + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<R, E>> + Send,
    {
        let call = self.request_call(CallKind::Execute, scope, key);
        // Each call awaits its future where it builds it. Kept in a local, or handed to an
        // `async fn` that awaits it, the future would be stored again beside the one that
        // awaits it: `execute`'s future was three times its size that way
        // (`crates/idem/tests/future_sizes.rs`).
        let result = async move {
            let done = self
                .run_request::<R, Never, E, M, _>(scope, key, request, |tx| {
                    let fut = effect(tx);
                    Box::pin(async move { fut.await.map(Ok) })
                })
                .await?;
            match done {
                Done::Executed(Ok(r)) => Ok(Outcome::Executed(r)),
                Done::Executed(Err(never)) => match never {},
                Done::Replayed(Status::Succeeded, text) => {
                    decode_stored(&text).map(Outcome::Replayed)
                }
                Done::Replayed(Status::Rejected, text) => {
                    Err(Error::StoredRejection(decode_stored(&text)?))
                }
            }
        }
        .instrument(call.span())
        .await;
        call.finish_with(&result, Outcome::observed);
        result
    }

    /// Like [`Idem::execute`], with the explicit policy of storing final business
    /// rejections: the effect returns `Ok(Err(rejection))` for a final answer that must
    /// replay (its own writes are rolled back, the rejection is stored), and `Err(e)` for
    /// a failure that stores nothing.
    pub async fn execute_final<R, J, E, M, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        effect: F,
    ) -> Result<Outcome<Result<R, J>>, Error<E>>
    where
        R: Serialize + DeserializeOwned + Send + 'static,
        J: Serialize + DeserializeOwned + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<Result<R, J>, E>> + Send,
    {
        let call = self.request_call(CallKind::ExecuteFinal, scope, key);
        let result = async move {
            match self.run_request(scope, key, request, effect).await? {
                Done::Executed(r) => Ok(Outcome::Executed(r)),
                Done::Replayed(Status::Succeeded, text) => {
                    decode_stored(&text).map(|r| Outcome::Replayed(Ok(r)))
                }
                Done::Replayed(Status::Rejected, text) => {
                    decode_stored(&text).map(|j| Outcome::Replayed(Err(j)))
                }
            }
        }
        .instrument(call.span())
        .await;
        call.finish_with(&result, Outcome::observed);
        result
    }

    /// Applies a message's effect once per `(subscriber, message_id)`, recording the ID
    /// in the effect's transaction. Acknowledge to the broker only after this returns
    /// `Ok`. With `payload`, a known ID carrying a different payload is refused with
    /// [`Error::PayloadMismatch`] (compared only when both deliveries carried one).
    pub async fn consume<R, E, M, F>(
        &self,
        subscriber: &Subscriber,
        message_id: &MessageId,
        payload: Option<&Request>,
        effect: F,
    ) -> Result<Consumed<R>, Error<E>>
    where
        R: Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<R, E>> + Send,
    {
        let call = Call::new(
            CallKind::Consume,
            self.backend.engine(),
            subscriber.as_str(),
            None,
            Some(message_id.as_str()),
        );
        let result = self
            .run_consume(subscriber, message_id, payload, effect)
            .instrument(call.span())
            .await;
        call.finish_with(&result, |c| match c {
            Consumed::Applied(_) => observe::Outcome::Executed,
            Consumed::Duplicate => observe::Outcome::Replayed,
        });
        result
    }

    async fn run_consume<R, E, M, F>(
        &self,
        subscriber: &Subscriber,
        message_id: &MessageId,
        payload: Option<&Request>,
        mut effect: F,
    ) -> Result<Consumed<R>, Error<E>>
    where
        R: Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<R, E>> + Send,
    {
        if let Some(payload) = payload {
            payload.check("message payload", self.max_request_bytes)?;
        }
        check_retention("message retention", self.message_retention)?;
        let claim = Claim {
            id: Identity::Message {
                subscriber,
                message_id,
            },
            request: payload.map(Request::as_json),
            retention: self.message_retention,
            wait: self.wait,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            observe::attempt(attempt);
            let step = async {
                let tx = match self.backend.claim(&claim).await? {
                    Claimed::Found(stored) => {
                        if let (Some(supplied), Some(stored)) = (payload, stored.request.as_deref())
                            && !same_request(stored, supplied).map_err(Step::Fail)?
                        {
                            return Err(Step::Fail(Error::PayloadMismatch {
                                stored: parse_stored(stored).map_err(Step::Fail)?,
                                supplied: supplied.value().clone(),
                            }));
                        }
                        return Ok(Consumed::Duplicate);
                    }
                    Claimed::InFlight => {
                        return Err(Step::Fail(Error::InProgress { waited: self.wait }));
                    }
                    Claimed::Won(tx) => tx,
                };
                let r = self.run_effect(tx, &claim, &mut effect).await?;
                let (tx, r) = r;
                self.backend
                    .finish(
                        tx,
                        &claim,
                        Finish::Commit {
                            response: None,
                            status: Status::Succeeded,
                        },
                    )
                    .await?;
                Ok(Consumed::Applied(r))
            };
            match step.await {
                Ok(done) => return Ok(done),
                Err(step) => self.next_attempt(step, attempt).await?,
            }
        }
    }

    async fn run_request<R, J, E, M, F>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        mut effect: F,
    ) -> Result<Done<R, J>, Error<E>>
    where
        R: Serialize + Send + 'static,
        J: Serialize + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<Result<R, J>, E>> + Send,
    {
        request.check("request", self.max_request_bytes)?;
        check_retention("operation retention", scope.operation.retention())?;
        let claim = Claim {
            id: Identity::Request { scope, key },
            request: Some(request.as_json()),
            retention: scope.operation.retention(),
            wait: self.wait,
        };
        let mut rejection: Option<J> = None;
        // The fast path runs with the first claim (on one connection where the engine
        // can); a retry claims directly, and the claim replays a record it finds.
        let mut fast_path = self.fast_path;
        let mut attempt = 0;
        loop {
            attempt += 1;
            observe::attempt(attempt);
            let first = std::mem::take(&mut fast_path);
            let step = async {
                let claimed = if first {
                    self.backend.lookup_or_claim(&claim).await?
                } else {
                    self.backend.claim(&claim).await?
                };
                let tx = match claimed {
                    Claimed::Found(stored) => return replay(stored, request).map_err(Step::Fail),
                    Claimed::InFlight => {
                        return Err(Step::Fail(Error::InProgress { waited: self.wait }));
                    }
                    Claimed::Won(tx) => tx,
                };
                // A rejection the effect returned earlier is stored on its own, without
                // running the effect again.
                if let Some(j) = rejection.take() {
                    let json = to_json(&j, self.max_response_bytes)?;
                    self.backend
                        .finish(
                            tx,
                            &claim,
                            Finish::Commit {
                                response: Some(&json),
                                status: Status::Rejected,
                            },
                        )
                        .await?;
                    return Ok(Done::Executed(Err(j)));
                }
                let (tx, result) = self.run_effect(tx, &claim, &mut effect).await?;
                match result {
                    Ok(r) => {
                        let json = match to_json(&r, self.max_response_bytes) {
                            Ok(json) => json,
                            Err(e) => {
                                self.backend.finish(tx, &claim, Finish::Rollback).await?;
                                return Err(e);
                            }
                        };
                        self.backend
                            .finish(
                                tx,
                                &claim,
                                Finish::Commit {
                                    response: Some(&json),
                                    status: Status::Succeeded,
                                },
                            )
                            .await?;
                        Ok(Done::Executed(Ok(r)))
                    }
                    Err(j) => {
                        // Final rejection: drop the effect's writes, then store the
                        // rejection in a transaction of its own.
                        self.backend.finish(tx, &claim, Finish::Rollback).await?;
                        rejection = Some(j);
                        Err(Step::StoreRejection)
                    }
                }
            };
            match step.await {
                Ok(done) => return Ok(done),
                Err(Step::StoreRejection) => {}
                Err(step) => self.next_attempt(step, attempt).await?,
            }
        }
    }

    /// Runs the effect in a won transaction. On failure the transaction is rolled back
    /// and the error classified: retryable engine errors start a new attempt.
    async fn run_effect<T, E, M, F>(
        &self,
        mut tx: B::Tx,
        claim: &Claim<'_>,
        effect: &mut F,
    ) -> Result<(B::Tx, T), Step<E>>
    where
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<T, E>> + Send,
    {
        match effect(&mut tx).await {
            Ok(r) => Ok((tx, r)),
            Err(e) => {
                // The effect's error is the one to report. If the rollback fails too
                // (a dead connection), the server rolls the transaction back anyway and
                // the backend discards the connection.
                let _ = self.backend.finish(tx, claim, Finish::Rollback).await;
                match self.effect_retry(e) {
                    Ok(db) => Err(Step::Retry(db)),
                    Err(e) => Err(Step::Fail(e)),
                }
            }
        }
    }

    /// The kind of the first database error in `error`'s chain of sources (itself
    /// included): an [`DbError`], or a driver error the backend classifies by its code.
    /// `None` when the chain holds none. This is how idem decides whether an effect's
    /// error is retried; consumers use it to tell a lost connection from a final
    /// refusal.
    pub fn classify_effect_error(&self, error: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        self.classify_chain(error)
    }

    fn classify_chain(&self, e: &(dyn StdError + 'static)) -> Option<ErrorKind> {
        find_in_chain(e, |err| match err.downcast_ref::<DbError>() {
            Some(db) => Some(db.kind()),
            None => self.backend.classify(err),
        })
    }

    /// The observed call of a request.
    fn request_call(&self, kind: CallKind, scope: &Scope, key: &Key) -> Call {
        Call::new(
            kind,
            self.backend.engine(),
            scope.principal.as_str(),
            Some(scope.operation.as_str()),
            Some(key.as_str()),
        )
    }

    /// Sleeps before the next attempt, or turns the step into the final error.
    async fn next_attempt<E>(&self, step: Step<E>, attempt: u32) -> Result<(), Error<E>> {
        match step {
            Step::Fail(e) => Err(e),
            Step::StoreRejection => Ok(()),
            Step::Retry(last) if attempt >= self.retry.max_attempts => {
                observe::giving_up(attempt, last.kind());
                Err(Error::RetriesExhausted {
                    attempts: attempt,
                    last,
                })
            }
            Step::Retry(last) => {
                observe::retrying(self.backend.engine(), attempt, last.kind());
                tokio::time::sleep(self.retry.backoff(attempt)).await;
                Ok(())
            }
        }
    }
}

impl<B: Maintenance> Idem<B> {
    /// Applies the backend's embedded migrations; returns the versions applied now.
    pub async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        self.backend.migrate().await
    }

    /// Deletes expired records in batches of at most `batch` rows, each its own
    /// statement, until none is left. A record expires by its own operation's retention,
    /// set by the database clock when it was claimed, so one purge is safe for every
    /// operation whatever its window. `older_than` additionally keeps records claimed less
    /// than that long ago (pass `Duration::ZERO` to delete every expired record). A batch
    /// that meets a busy database, a deadlock or a lock timeout is run again under the
    /// retry policy ([`PurgeReport::retried`]).
    pub async fn purge(&self, older_than: Duration, batch: u32) -> Result<PurgeReport, DbError> {
        self.purge_with_progress(older_than, batch, |_| {}).await
    }

    /// Like [`Idem::purge`], calling `progress` with the running totals after every
    /// statement (for a progress display).
    pub async fn purge_with_progress(
        &self,
        older_than: Duration,
        batch: u32,
        progress: impl FnMut(&PurgeReport) + Send,
    ) -> Result<PurgeReport, DbError> {
        let call = Call::new(CallKind::Purge, self.backend.engine(), "", None, None);
        let result = self
            .run_purge(older_than, batch, progress)
            .instrument(call.span())
            .await;
        call.finish(match &result {
            Ok(_) => observe::Outcome::Executed,
            Err(e) if e.kind().is_retryable() => observe::Outcome::RetriesExhausted,
            Err(e) if e.kind() == ErrorKind::Configuration => observe::Outcome::InvalidInput,
            Err(_) => observe::Outcome::Error,
        });
        result
    }

    async fn run_purge(
        &self,
        older_than: Duration,
        batch: u32,
        mut progress: impl FnMut(&PurgeReport) + Send,
    ) -> Result<PurgeReport, DbError> {
        if batch == 0 {
            return Err(DbError::new(
                "idem",
                ErrorKind::Configuration,
                "purge batch size must be at least 1",
            ));
        }
        let mut report = PurgeReport::default();
        for table in [Table::Requests, Table::Messages, Table::Runs, Table::Outbox] {
            loop {
                let mut attempt = 0;
                let n = loop {
                    attempt += 1;
                    match self.backend.purge_batch(table, older_than, batch).await {
                        Ok(n) => break n,
                        Err(e) if e.kind().is_retryable() && attempt < self.retry.max_attempts => {
                            report.retried += 1;
                            observe::retrying(self.backend.engine(), attempt, e.kind());
                            tokio::time::sleep(self.retry.backoff(attempt)).await;
                        }
                        Err(e) => {
                            if e.kind().is_retryable() {
                                observe::giving_up(attempt, e.kind());
                            }
                            return Err(e);
                        }
                    }
                };
                report.batches += 1;
                match table {
                    Table::Requests => report.requests += n,
                    Table::Messages => report.messages += n,
                    Table::Runs => report.runs += n,
                    Table::Outbox => report.outbox += n,
                }
                progress(&report);
                if n < u64::from(batch) {
                    break;
                }
            }
        }
        Ok(report)
    }
}

impl<R> Outcome<R> {
    fn observed(&self) -> observe::Outcome {
        match self {
            Self::Executed(_) => observe::Outcome::Executed,
            Self::Replayed(_) => observe::Outcome::Replayed,
        }
    }
}

/// Serializes the effect's response (or rejection) for storage. A value JSON cannot
/// represent (a map with non-string keys, say), one larger than the configured limit, or
/// one nested deeper than a retry could read back is the caller's input error.
fn to_json<T: Serialize, E>(value: &T, max_bytes: usize) -> Result<String, Step<E>> {
    let bad =
        |problem: String| Step::Fail(Error::InvalidInput(InvalidInput::new("response", problem)));
    let text =
        serde_json::to_string(value).map_err(|e| bad(format!("cannot be stored as JSON: {e}")))?;
    if text.len() > max_bytes {
        return Err(bad(format!(
            "is {} bytes of JSON, more than the limit of {max_bytes} (Idem::with_max_response_bytes)",
            text.len()
        )));
    }
    // What is stored must parse again on replay: serde_json refuses nesting deeper than
    // 128 levels, so such a response is refused now rather than found unreadable later.
    serde_json::from_str::<serde::de::IgnoredAny>(&text)
        .map_err(|e| bad(format!("cannot be read back from its JSON: {e}")))?;
    Ok(text)
}

/// [`to_json`] for phased runs: the value's JSON, or the caller's input error.
pub(crate) fn response_json<T: Serialize>(
    value: &T,
    max_bytes: usize,
) -> Result<String, InvalidInput> {
    match to_json::<T, ()>(value, max_bytes) {
        Ok(text) => Ok(text),
        Err(Step::Fail(Error::InvalidInput(e))) => Err(e),
        Err(_) => Err(InvalidInput::new("response", "cannot be stored")),
    }
}

/// The shortest retention a call accepts.
pub const MIN_RETENTION: Duration = Duration::from_secs(1);

/// Refuses a retention window too short to be safe.
pub(crate) fn check_retention(what: &'static str, retention: Duration) -> Result<(), InvalidInput> {
    if retention < MIN_RETENTION {
        return Err(InvalidInput::new(
            what,
            format!(
                "{retention:?} is shorter than the minimum of {MIN_RETENTION:?}: a record must outlive \
                 the retries of its own call, or a retry arriving moments later runs the effect again"
            ),
        ));
    }
    Ok(())
}

fn corrupt<E>(what: String) -> Error<E> {
    Error::Backend(DbError::new("idem", ErrorKind::CorruptRecord, what))
}

fn parse_stored<E>(text: &str) -> Result<Value, Error<E>> {
    serde_json::from_str::<Value>(text)
        .map_err(|e| corrupt(format!("stored JSON is unreadable: {e}")))
}

/// Whether a stored request (or payload) is the supplied one: the same canonical text.
/// The stored text is canonicalized again first when it differs byte for byte, for
/// records written by older versions or reformatted by an engine.
fn same_request<E>(stored: &str, supplied: &Request) -> Result<bool, Error<E>> {
    if stored == supplied.as_json() {
        return Ok(true);
    }
    Ok(Request::new(parse_stored(stored)?).as_json() == supplied.as_json())
}

/// Decodes a stored response (or rejection) into the caller's type: text that is not
/// JSON is a corrupt record; JSON that does not fit the type is [`Error::Decode`]. One
/// parse when it decodes; which failure it was is told by a second parse only then
/// (a type mismatch can stop the first before the text's end).
fn decode_stored<T: DeserializeOwned, E>(text: &str) -> Result<T, Error<E>> {
    serde_json::from_str(text).map_err(|e| match serde_json::from_str::<Value>(text) {
        Ok(_) => Error::Decode(e),
        Err(_) => corrupt("stored response is unreadable".into()),
    })
}

/// A found record's answer for `supplied`: its response, still to be decoded by the
/// caller ([`decode_stored`]), or [`Error::KeyReused`].
fn replay<R, J, E>(stored: Stored, supplied: &Request) -> Result<Done<R, J>, Error<E>> {
    let Some(stored_request) = stored.request.as_deref() else {
        return Err(corrupt("stored record has no request".into()));
    };
    if !same_request(stored_request, supplied)? {
        return Err(Error::KeyReused {
            stored: parse_stored(stored_request)?,
            supplied: supplied.value().clone(),
        });
    }
    let Some(response) = stored.response else {
        return Err(corrupt(
            "a record without its response was visible outside its transaction".into(),
        ));
    };
    Ok(Done::Replayed(stored.status, response))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_grows() {
        let p = RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::from_millis(4),
            max_delay: Duration::from_millis(50),
        };
        for attempt in 1..40 {
            assert!(p.backoff(attempt) <= Duration::from_millis(50));
        }
        assert!(p.backoff(1) <= Duration::from_millis(4));
    }
}
