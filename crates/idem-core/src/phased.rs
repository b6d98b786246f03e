//! Phased runs: effects outside the database (a card charge at a provider), made safe
//! to retry with a lease, recovery points and fencing.
//!
//! ```text
//!  start ─▶ [started] ─phase─▶ [order_created] ─(provider call, stable key)─▶ finish ─▶ response
//!    │         each arrow is one local transaction that commits its writes with the
//!    │         new recovery point, guarded by "I am still the owner"
//!    └─ a retry: finished → the stored answer; lease live → InProgress;
//!       lease over → take over (new owner, fence + 1) and resume at the last point
//! ```
//!
//! The record of a run is committed **first** (unlike [`Idem::execute`]'s record, which
//! commits with the effect): a run spans several transactions and calls to other
//! systems between them. Its owner holds a lease (an owner token and an expiry set by
//! the database clock). Every later write of the run is guarded by the owner token, so
//! once a retry has taken over after the lease ended, the previous owner's writes change
//! nothing and its transaction is rolled back ([`Error::LeaseLost`]).

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::Instrument;

use crate::backend::Status;
use crate::effect::EffectError;
use crate::error::{DbError, Error, ErrorKind, InvalidInput};
use crate::ident::{Key, Principal, Scope};
use crate::observe;
use crate::protocol::{BoxFuture, Idem, Outcome};
use crate::request::Request;
use crate::runs::{NewRun, RunGuard, RunProbe, RunStore, RunWrite, STARTED};

/// The default lease of a run's owner: 30 s. Choose it longer than the slowest phase
/// plus the slowest external call between two phases (or renew it with
/// [`Run::heartbeat`]).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The shortest lease a run accepts.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The bound of the probe that follows a start's lock timeout (at most the wait bound).
const PROBE_WAIT: Duration = Duration::from_millis(500);

/// A recovery point's name: 1 to 64 characters of `[A-Za-z0-9_.-]`.
fn check_point(point: &str) -> Result<(), InvalidInput> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    if point.is_empty() || point.len() > 64 || !point.chars().all(ok) {
        return Err(InvalidInput::new(
            "recovery point",
            format!("{point:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' or '-'"),
        ));
    }
    Ok(())
}

/// A fresh owner token: 128 random bits, hex.
fn new_owner() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// How [`Idem::start`] found the key.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // moved once per call; a box would only add an allocation
pub enum Started<B: RunStore> {
    /// This call owns the run: continue it from [`Run::point`].
    Run(Run<B>),
    /// The run ended earlier; its stored final answer.
    Finished(Finished),
}

/// A run's stored final answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    status: Status,
    response: String,
}

impl Finished {
    /// How the run ended.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The stored answer, JSON text.
    pub fn json(&self) -> &str {
        &self.response
    }

    /// Decodes the answer: `Ok(r)` for a success, `Err(j)` for a stored final failure.
    pub fn decode<R: DeserializeOwned, J: DeserializeOwned>(
        &self,
    ) -> Result<Result<R, J>, serde_json::Error> {
        Ok(match self.status {
            Status::Succeeded => Ok(serde_json::from_str(&self.response)?),
            Status::Rejected => Err(serde_json::from_str(&self.response)?),
        })
    }

    fn outcome<R: DeserializeOwned, E>(&self, executed: bool) -> Result<Outcome<R>, Error<E>> {
        match self.status {
            Status::Succeeded => {
                let r = serde_json::from_str(&self.response).map_err(Error::Decode)?;
                Ok(if executed {
                    Outcome::Executed(r)
                } else {
                    Outcome::Replayed(r)
                })
            }
            Status::Rejected => Err(Error::StoredRejection(
                serde_json::from_str(&self.response).map_err(Error::Decode)?,
            )),
        }
    }
}

/// The run this call owns: its recovery point and state, and the calls that move it
/// forward. Every write is guarded by this owner's token.
pub struct Run<B: RunStore> {
    idem: Idem<B>,
    scope: Scope,
    key: Key,
    request: Value,
    owner: String,
    fence: i64,
    point: String,
    state: Option<String>,
    resumed: bool,
    finished: Option<Finished>,
    /// A commit of a phase or an answer ended with an unknown outcome (a lost
    /// connection): this handle no longer knows the run's point, so it writes nothing
    /// more (phases, answers, heartbeats refused; a release skipped).
    unknown: bool,
    /// Phases and answers this handle committed.
    commits: u64,
}

impl<B: RunStore> fmt::Debug for Run<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Run")
            .field("scope", &self.scope)
            .field("fence", &self.fence)
            .field("point", &self.point)
            .field("resumed", &self.resumed)
            .field("finished", &self.finished.is_some())
            .finish_non_exhaustive()
    }
}

impl<B: RunStore> Run<B> {
    /// The backend, for statements of your own inside a phase (say
    /// [`crate::OutboxStore::enqueue`]): clone it into the phase's effect.
    pub fn backend(&self) -> &B {
        self.idem.backend()
    }

    /// The principal and operation.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The client's key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The request stored at the run's start (canonical).
    pub fn request(&self) -> &Value {
        &self.request
    }

    /// The last committed recovery point ([`STARTED`] for a new run).
    pub fn point(&self) -> &str {
        &self.point
    }

    /// The state committed with the recovery point, decoded; `None` before the first
    /// phase.
    pub fn state<T: DeserializeOwned>(&self) -> Result<Option<T>, serde_json::Error> {
        self.state.as_deref().map(serde_json::from_str).transpose()
    }

    /// The fencing generation: 0 for the first owner, raised by every takeover.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// Whether this call took the run over from an earlier owner whose lease ended.
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// The final answer, once [`Run::finish`] or [`Run::fail`] stored it.
    pub fn finished(&self) -> Option<&Finished> {
        self.finished.as_ref()
    }

    /// A stable idempotency key for an external call made at `step` (say `"charge"`):
    /// the same for every owner and every retry of this `(scope, key)`, different for
    /// every other. Send it as the provider's own `Idempotency-Key`, so a call repeated
    /// after a crash finds the first one's result instead of charging twice.
    pub fn external_key(&self, step: &str) -> String {
        derived("idem", &self.scope, &self.key, step)
    }

    /// A stable message ID for an outbox message named `name` (say `"order.paid"`).
    pub fn message_id(&self, name: &str) -> String {
        derived("msg", &self.scope, &self.key, name)
    }

    /// Extends the lease by the configured length from now (for a long external call).
    /// Only the lease is written (never the point or the state), guarded by this owner's
    /// token and fence. [`Error::LeaseLost`] when another call has taken the run over. A
    /// handle whose last phase or answer ended with an unknown outcome refuses
    /// ([`Error::InvalidInput`]): start the run again to learn where it stands. A
    /// heartbeat whose own commit reply was lost leaves the lease unknown and nothing
    /// else: the handle goes on.
    pub async fn heartbeat<E>(&mut self) -> Result<(), Error<E>> {
        self.not_unknown()?;
        if self.finished.is_some() {
            return Ok(());
        }
        let lease = self.idem.lease();
        self.lease_alone(lease).await
    }

    /// Ends the lease now, so the next retry resumes the run at once instead of waiting
    /// for the lease to run out. Call it when the run cannot go on now (an external
    /// system is down). Only the lease is written, guarded by this owner's token and
    /// fence. Harmless when the run was taken over or finished. After a phase or answer
    /// whose commit outcome is unknown it writes nothing (the retry then waits for the
    /// lease to run out, and resumes where the run really is).
    pub async fn release(&mut self) -> Result<(), DbError> {
        if self.finished.is_some() || self.unknown {
            return Ok(());
        }
        match self
            .lease_alone::<std::convert::Infallible>(Duration::ZERO)
            .await
        {
            Ok(()) | Err(Error::LeaseLost { .. }) => Ok(()),
            Err(Error::Backend(e)) => Err(e),
            Err(e) => Err(DbError::new(
                "idem",
                ErrorKind::Other,
                format!("releasing the lease: {e}"),
            )),
        }
    }

    /// Commits one phase: `effect`'s writes, the new recovery point `point` and the
    /// state it returns (stored as JSON) in one local transaction, guarded by this
    /// owner's token. Retryable engine errors run the phase again (its writes were
    /// rolled back); [`Error::LeaseLost`] when another call took the run over (nothing
    /// of this phase is kept). A commit whose outcome is unknown (a lost connection) is
    /// [`Error::Backend`], and this handle then refuses further phases: start the run
    /// again ([`Idem::start`]) to learn where it stands.
    pub async fn phase<S, E, M, F>(&mut self, point: &str, mut effect: F) -> Result<S, Error<E>>
    where
        S: Serialize + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<S, E>> + Send,
    {
        check_point(point)?;
        self.not_finished()?;
        let span = self.span("phase");
        let (state, json) = self
            .commit_with(&mut effect, point, None)
            .instrument(span.clone())
            .await
            .inspect_err(|e| observe::run_call_failed(&span, e))?;
        self.point = point.to_owned();
        self.state = Some(json);
        observe::run_phase(&span, self.idem.backend().engine(), point);
        Ok(state)
    }

    /// Ends the run with success: `effect`'s writes and its response, stored as the
    /// run's final answer, in one guarded transaction. Retries replay it.
    pub async fn finish<R, E, M, F>(&mut self, effect: F) -> Result<R, Error<E>>
    where
        R: Serialize + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<R, E>> + Send,
    {
        self.end(Status::Succeeded, effect).await
    }

    /// Ends the run with a final failure (the operation's policy): `effect`'s writes
    /// (say, the order marked failed) and its answer, stored as a final rejection that
    /// retries replay ([`Error::StoredRejection`] through [`Idem::execute_phased`]).
    pub async fn fail<J, E, M, F>(&mut self, effect: F) -> Result<J, Error<E>>
    where
        J: Serialize + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<J, E>> + Send,
    {
        self.end(Status::Rejected, effect).await
    }

    async fn end<R, E, M, F>(&mut self, status: Status, mut effect: F) -> Result<R, Error<E>>
    where
        R: Serialize + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<R, E>> + Send,
    {
        self.not_finished()?;
        let point = self.point.clone();
        let span = self.span(match status {
            Status::Succeeded => "finish",
            Status::Rejected => "fail",
        });
        let (r, json) = self
            .commit_with(&mut effect, &point, Some(status))
            .instrument(span.clone())
            .await
            .inspect_err(|e| observe::run_call_failed(&span, e))?;
        self.finished = Some(Finished {
            status,
            response: json,
        });
        observe::run_finished(&span, self.idem.backend().engine(), status);
        Ok(r)
    }

    /// The span of one call on this run.
    fn span(&self, call: &'static str) -> tracing::Span {
        observe::run_span(
            call,
            self.idem.backend().engine(),
            &self.scope,
            &self.key,
            &self.point,
            self.fence,
        )
    }

    fn not_unknown<E>(&self) -> Result<(), Error<E>> {
        if self.unknown {
            return Err(Error::InvalidInput(InvalidInput::new(
                "run",
                "an earlier commit of this run ended with an unknown outcome; start the run \
                 again (Idem::start) to learn its recovery point",
            )));
        }
        Ok(())
    }

    fn not_finished<E>(&self) -> Result<(), Error<E>> {
        self.not_unknown()?;
        if self.finished.is_some() {
            return Err(Error::InvalidInput(InvalidInput::new(
                "run",
                "has already stored its final answer; nothing can follow it",
            )));
        }
        Ok(())
    }

    /// One guarded transaction: the effect, then the run's row: at `point` with the
    /// effect's value as its state, or (with `end`) the value as the final answer.
    /// Returns the value and its JSON.
    async fn commit_with<T, E, M, F>(
        &mut self,
        effect: &mut F,
        point: &str,
        end: Option<Status>,
    ) -> Result<(T, String), Error<E>>
    where
        T: Serialize + Send + 'static,
        E: EffectError<M>,
        F: for<'t> FnMut(&'t mut B::Tx) -> BoxFuture<'t, Result<T, E>> + Send,
    {
        let idem = &self.idem;
        let backend = idem.backend();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut tx = match backend.begin_runs(None).await {
                Ok(tx) => tx,
                Err(e) if e.kind().is_retryable() => {
                    idem.pause(attempt, e).await?;
                    continue;
                }
                Err(e) => return Err(Error::Backend(e)),
            };
            let value = match effect(&mut tx).await {
                Ok(v) => v,
                Err(e) => {
                    let _ = backend.rollback_runs(tx).await;
                    let db = idem.effect_retry(e)?;
                    idem.pause(attempt, db).await?;
                    continue;
                }
            };
            let json = match crate::protocol::response_json(&value, idem.max_response_bytes()) {
                Ok(j) => j,
                Err(e) => {
                    let _ = backend.rollback_runs(tx).await;
                    return Err(e.into());
                }
            };
            let write = RunWrite {
                owner: &self.owner,
                fence: self.fence,
                point,
                state: if end.is_some() {
                    self.state.as_deref()
                } else {
                    Some(&json)
                },
                status: end,
                response: end.map(|_| json.as_str()),
                lease: idem.lease(),
            };
            let guard = RunGuard {
                owner: &self.owner,
                fence: self.fence,
                point: &self.point,
            };
            let written = backend
                .write_run(&mut tx, &self.scope, &self.key, &guard, &write)
                .await;
            match written {
                Ok(true) => {}
                Ok(false) => {
                    let _ = backend.rollback_runs(tx).await;
                    observe::run_lease_lost(backend.engine(), self.fence);
                    return Err(Error::LeaseLost { fence: self.fence });
                }
                Err(e) => {
                    let _ = backend.rollback_runs(tx).await;
                    if e.kind().is_retryable() {
                        idem.pause(attempt, e).await?;
                        continue;
                    }
                    return Err(Error::Backend(e));
                }
            }
            match backend.commit_runs(tx).await {
                Ok(()) => {
                    self.commits += 1;
                    return Ok((value, json));
                }
                Err(e) if e.kind().is_retryable() => idem.pause(attempt, e).await?,
                Err(e) => {
                    // The commit may have happened: this handle no longer knows the
                    // run's point, so it writes nothing more (its phase could apply
                    // twice, or a write of the old point could move the run back).
                    self.unknown = true;
                    observe::run_unknown_commit(backend.engine(), &e);
                    return Err(Error::Backend(e));
                }
            }
        }
    }

    /// The lease alone (heartbeat, release), guarded by this owner's token and fence.
    async fn lease_alone<E>(&mut self, lease: Duration) -> Result<(), Error<E>> {
        let backend = self.idem.backend();
        let mut tx = backend.begin_runs(None).await?;
        match backend
            .renew_lease(
                &mut tx,
                &self.scope,
                &self.key,
                &self.owner,
                self.fence,
                lease,
            )
            .await
        {
            Ok(true) => backend.commit_runs(tx).await.map_err(Error::Backend),
            Ok(false) => {
                let _ = backend.rollback_runs(tx).await;
                observe::run_lease_lost(backend.engine(), self.fence);
                Err(Error::LeaseLost { fence: self.fence })
            }
            Err(e) => {
                let _ = backend.rollback_runs(tx).await;
                Err(Error::Backend(e))
            }
        }
    }
}

/// `prefix-` + 32 hex digits of SHA-256 over the scope, the key and the name.
fn derived(prefix: &str, scope: &Scope, key: &Key, name: &str) -> String {
    let mut h = Sha256::new();
    for part in [
        scope.principal.as_str(),
        scope.operation.as_str(),
        key.as_str(),
        name,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// What [`Idem::complete`] did, per operation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompleteReport {
    /// Stalled runs found.
    pub found: u64,
    /// Per operation (`name:vN`).
    pub operations: BTreeMap<String, OperationReport>,
}

/// What [`Idem::complete`] did with one operation's stalled runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OperationReport {
    /// Driven forward to a success.
    pub succeeded: u64,
    /// Driven to their final failed state.
    pub failed: u64,
    /// Taken by someone else first (a retry or another completer): left alone.
    pub busy: u64,
    /// The step could not move them now (its error is in `errors`); their lease was
    /// released so a later pass (or a retry) tries again.
    pub left: u64,
    /// The errors, one line each.
    pub errors: Vec<String>,
}

impl<B: RunStore> Idem<B> {
    /// Starts or resumes the phased run of `(scope, key)`:
    ///
    /// - a new key: its record is committed at once at [`STARTED`], with this call as
    ///   owner under a lease of [`Idem::with_lease`];
    /// - a run that stored its final answer: [`Started::Finished`] (with an equal
    ///   request; a different one is [`Error::KeyReused`]);
    /// - a run whose owner's lease is live: waited for up to the wait bound
    ///   ([`Idem::with_wait_timeout`]), then [`Error::InProgress`];
    /// - a run whose owner's lease ended: taken over (a new owner token, the fence
    ///   raised), resumed at its last recovery point. The earlier owner's later writes
    ///   are refused.
    pub async fn start<E>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
    ) -> Result<Started<B>, Error<E>> {
        let span = observe::run_span("start", self.backend().engine(), scope, key, "", 0);
        let result = self
            .start_bounded(scope, key, request)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(Started::Run(run)) => {
                observe::run_owned(
                    &span,
                    self.backend().engine(),
                    run.resumed,
                    run.fence,
                    &run.point,
                );
            }
            Ok(Started::Finished(_)) => observe::run_replayed(&span),
            Err(e) => observe::run_call_failed(&span, e),
        }
        result
    }

    async fn start_bounded<E>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
    ) -> Result<Started<B>, Error<E>> {
        request.check("request", self.max_request_bytes())?;
        crate::protocol::check_retention("operation retention", scope.operation.retention())?;
        self.check_lease()?;
        self.check_lease_within(scope.operation.retention())?;
        let text = request.to_json();
        let began = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.start_once(scope, key, Some(&text)).await {
                Ok(Some(started)) => return Ok(started),
                Ok(None) => {
                    // The owner's lease is live: wait for it to finish, within the bound.
                    let waited = began.elapsed();
                    if waited >= self.wait_timeout() {
                        return Err(Error::InProgress { waited });
                    }
                    let left = self.wait_timeout() - waited;
                    let nap = Duration::from_millis(fastrand::u64(20..=80)).min(left);
                    tokio::time::sleep(nap).await;
                    attempt = 0;
                }
                Err(StartError::Reused(stored)) => {
                    return Err(Error::KeyReused {
                        stored,
                        supplied: request.value().clone(),
                    });
                }
                Err(StartError::Db(e)) if e.kind() == ErrorKind::LockTimeout => {
                    // The wait bound ran out on a lock: the run's holder, or something
                    // else holding idem's table? A short probe tells them apart.
                    return Err(match self.who_held(scope, key).await {
                        RunProbe::Held => Error::InProgress {
                            waited: began.elapsed(),
                        },
                        RunProbe::Free => Error::LockWait {
                            waited: began.elapsed(),
                        },
                    });
                }
                Err(StartError::Db(e))
                    if e.kind() == ErrorKind::Busy && began.elapsed() >= self.wait_timeout() =>
                {
                    // SQLite: another writer held the database's only write lock past
                    // the bound. idem's own run transactions are short, and a live owner
                    // is found from its lease, not from a lock: something else held it.
                    return Err(Error::LockWait {
                        waited: began.elapsed(),
                    });
                }
                Err(StartError::Db(e)) if e.kind().is_retryable() => {
                    self.pause(attempt, e).await?;
                }
                Err(StartError::Db(e)) => return Err(Error::Backend(e)),
                Err(StartError::Corrupt(what)) => {
                    return Err(Error::Backend(DbError::new(
                        "idem",
                        ErrorKind::CorruptRecord,
                        what,
                    )));
                }
            }
        }
    }

    /// After a lock wait of a start ran out: whether another transaction holds the run's
    /// row ([`RunProbe::Held`]) or something else kept the start waiting. The probe has a
    /// short bound of its own; a probe that waits too, or fails, means something else.
    async fn who_held(&self, scope: &Scope, key: &Key) -> RunProbe {
        let bound = self.wait_timeout().min(PROBE_WAIT);
        let backend = self.backend();
        let Ok(mut tx) = backend.begin_runs(Some(bound)).await else {
            return RunProbe::Free;
        };
        let probe = backend.probe_run(&mut tx, scope, key).await;
        let _ = backend.rollback_runs(tx).await;
        probe.unwrap_or(RunProbe::Free)
    }

    /// One start transaction: `Ok(None)` when the owner's lease is live.
    async fn start_once(
        &self,
        scope: &Scope,
        key: &Key,
        request: Option<&str>,
    ) -> Result<Option<Started<B>>, StartError> {
        let backend = self.backend();
        let mut tx = backend.begin_runs(Some(self.wait_timeout())).await?;
        let result = self.decide_start(&mut tx, scope, key, request).await;
        match result {
            Ok(Decision::Commit(run)) => {
                backend.commit_runs(tx).await?;
                Ok(Some(Started::Run(*run)))
            }
            Ok(Decision::Finished(f)) => {
                let _ = backend.rollback_runs(tx).await;
                Ok(Some(Started::Finished(f)))
            }
            Ok(Decision::Live) => {
                let _ = backend.rollback_runs(tx).await;
                Ok(None)
            }
            Err(e) => {
                let _ = backend.rollback_runs(tx).await;
                Err(e)
            }
        }
    }

    async fn decide_start(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
        request: Option<&str>,
    ) -> Result<Decision<B>, StartError> {
        let backend = self.backend();
        let owner = new_owner();
        let fresh = |fence: i64, request: &str| -> Result<Decision<B>, StartError> {
            Ok(Decision::Commit(Box::new(Run {
                idem: self.clone(),
                scope: scope.clone(),
                key: key.clone(),
                request: parse(request)?,
                owner: owner.clone(),
                fence,
                point: STARTED.to_owned(),
                state: None,
                resumed: false,
                finished: None,
                unknown: false,
                commits: 0,
            })))
        };
        fn new_run<'r>(
            request: &'r str,
            owner: &'r str,
            fence: i64,
            lease: Duration,
            scope: &Scope,
        ) -> NewRun<'r> {
            NewRun {
                request,
                owner,
                fence,
                point: STARTED,
                lease,
                retention: scope.operation.retention(),
            }
        }
        let lease = self.lease();
        if let Some(request) = request
            && backend
                .insert_run(tx, scope, key, &new_run(request, &owner, 0, lease, scope))
                .await?
        {
            return fresh(0, request);
        }
        let Some(row) = backend.read_run(tx, scope, key).await? else {
            // Purged between the two statements (or, resuming, never there).
            return match request {
                Some(_) => Err(StartError::Db(DbError::new(
                    "idem",
                    ErrorKind::Transient,
                    "the run vanished between its insert and its read; trying again",
                ))),
                None => Ok(Decision::Live),
            };
        };
        if row.expired {
            let Some(request) = request else {
                return Ok(Decision::Live);
            };
            if !backend.delete_run(tx, scope, key, &row.owner).await?
                || !backend
                    .insert_run(
                        tx,
                        scope,
                        key,
                        &new_run(request, &owner, row.fence + 1, lease, scope),
                    )
                    .await?
            {
                return Err(StartError::Db(DbError::new(
                    "idem",
                    ErrorKind::Transient,
                    "an expired run changed while it was replaced; trying again",
                )));
            }
            return fresh(row.fence + 1, request);
        }
        if let Some(request) = request
            && row.request != request
            && Request::new(parse(&row.request)?).to_json() != request
        {
            return Err(StartError::Reused(parse(&row.request)?));
        }
        if let Some(status) = row.status {
            let Some(response) = row.response else {
                return Err(StartError::Corrupt(
                    "a finished run has no stored answer".into(),
                ));
            };
            return Ok(Decision::Finished(Finished { status, response }));
        }
        if !row.lease_over {
            return Ok(Decision::Live);
        }
        let fence = row.fence + 1;
        let write = RunWrite {
            owner: &owner,
            fence,
            point: &row.point,
            state: row.state.as_deref(),
            status: None,
            response: None,
            lease: self.lease(),
        };
        if !backend
            .write_run(
                tx,
                scope,
                key,
                &RunGuard {
                    owner: &row.owner,
                    fence: row.fence,
                    point: &row.point,
                },
                &write,
            )
            .await?
        {
            return Err(StartError::Db(DbError::new(
                "idem",
                ErrorKind::Transient,
                "a run changed owner during its takeover; trying again",
            )));
        }
        Ok(Decision::Commit(Box::new(Run {
            idem: self.clone(),
            scope: scope.clone(),
            key: key.clone(),
            request: parse(&row.request)?,
            owner,
            fence,
            point: row.point,
            state: row.state,
            resumed: true,
            finished: None,
            unknown: false,
            commits: 0,
        })))
    }

    /// Runs a phased operation to its end: [`Idem::start`], then `step` again and again
    /// until the run stores its final answer ([`Run::finish`] or [`Run::fail`]); a
    /// finished run replays its answer. When `step` fails, the lease is released (so the
    /// client's retry resumes at once) and the error returned; a step that returns
    /// without committing anything is an error too (it would loop forever).
    pub async fn execute_phased<R, E, S>(
        &self,
        scope: &Scope,
        key: &Key,
        request: &Request,
        mut step: S,
    ) -> Result<Outcome<R>, Error<E>>
    where
        R: DeserializeOwned,
        S: for<'r> FnMut(&'r mut Run<B>) -> BoxFuture<'r, Result<(), Error<E>>> + Send,
    {
        match self.start(scope, key, request).await? {
            Started::Finished(f) => f.outcome(false),
            Started::Run(mut run) => {
                drive(&mut run, &mut step).await?;
                match run.finished.take() {
                    Some(f) => f.outcome(true),
                    None => Err(stalled_error()),
                }
            }
        }
    }

    /// The completer: finds up to `limit` runs whose owner's lease ended before they
    /// stored a final answer (their owner crashed, or gave up), takes each over and
    /// drives it with `step` (the operation's own step function, which may also end it
    /// with [`Run::fail`]). Safe to run from several hosts at once: a run is taken over
    /// by one of them; the others count it as busy.
    pub async fn complete<E, S>(&self, limit: u32, mut step: S) -> Result<CompleteReport, DbError>
    where
        E: fmt::Display,
        S: for<'r> FnMut(&'r mut Run<B>) -> BoxFuture<'r, Result<(), Error<E>>> + Send,
    {
        let stalled = self.backend().stalled_runs(limit.max(1)).await?;
        let mut report = CompleteReport {
            found: stalled.len() as u64,
            ..CompleteReport::default()
        };
        for row in stalled {
            let entry = report.operations.entry(row.operation.clone()).or_default();
            let (Ok(principal), Ok(operation), Ok(key)) = (
                Principal::new(row.principal.as_str()),
                row.operation.parse::<crate::ident::Operation>(),
                Key::new(row.key.as_str()),
            ) else {
                entry.left += 1;
                entry
                    .errors
                    .push(format!("{}: the stored identity is not valid", row.key));
                continue;
            };
            let scope = Scope::new(principal, operation);
            let mut run = match self.start_once(&scope, &key, None).await {
                Ok(Some(Started::Run(run))) => {
                    let span = observe::run_span(
                        "complete",
                        self.backend().engine(),
                        &scope,
                        &key,
                        &run.point,
                        run.fence,
                    );
                    observe::run_owned(&span, self.backend().engine(), true, run.fence, &run.point);
                    run
                }
                Ok(_) => {
                    entry.busy += 1;
                    continue;
                }
                Err(StartError::Db(e)) if e.kind() == ErrorKind::LockTimeout => {
                    entry.busy += 1;
                    continue;
                }
                Err(e) => {
                    entry.left += 1;
                    entry.errors.push(format!("{}: {e}", row.key));
                    continue;
                }
            };
            match drive(&mut run, &mut step).await {
                Ok(()) => match run.finished.as_ref().map(Finished::status) {
                    Some(Status::Succeeded) => entry.succeeded += 1,
                    Some(Status::Rejected) => entry.failed += 1,
                    None => entry.left += 1,
                },
                Err(Error::LeaseLost { .. }) => entry.busy += 1,
                Err(e) => {
                    entry.left += 1;
                    entry.errors.push(format!("{}: {e}", row.key));
                }
            }
        }
        Ok(report)
    }

    /// A run's record must outlive its owner's lease: an expired run is replaced by the
    /// next start, so a retention shorter than the lease would let a retry start the
    /// whole run again while its owner is still working.
    fn check_lease_within(&self, retention: Duration) -> Result<(), InvalidInput> {
        if retention < self.lease() {
            return Err(InvalidInput::new(
                "operation retention",
                format!(
                    "{retention:?} is shorter than the lease of a phased run ({:?}): the \
                     record would expire while its owner may still be working, and a \
                     retry would start the run again (choose a retention far longer than \
                     the lease)",
                    self.lease()
                ),
            ));
        }
        Ok(())
    }

    fn check_lease(&self) -> Result<(), InvalidInput> {
        if self.lease() < MIN_LEASE {
            return Err(InvalidInput::new(
                "lease",
                format!(
                    "{:?} is shorter than the minimum of {MIN_LEASE:?}",
                    self.lease()
                ),
            ));
        }
        Ok(())
    }
}

/// Calls `step` until the run has its final answer. On an error the lease is released
/// (unless it was lost, or the handle no longer knows the run's point) so the next retry
/// resumes at once. A step that commits nothing is an error (it would be called forever);
/// a step that commits the same point and state again (a batch loop) is fine.
async fn drive<B, E, S>(run: &mut Run<B>, step: &mut S) -> Result<(), Error<E>>
where
    B: RunStore,
    S: for<'r> FnMut(&'r mut Run<B>) -> BoxFuture<'r, Result<(), Error<E>>> + Send,
{
    while run.finished.is_none() {
        let before = run.commits;
        if let Err(e) = step(run).await {
            if !matches!(e, Error::LeaseLost { .. }) {
                let _ = run.release().await;
            }
            return Err(e);
        }
        if run.finished.is_none() && run.commits == before {
            let _ = run.release().await;
            return Err(stalled_error());
        }
    }
    Ok(())
}

fn stalled_error<E>() -> Error<E> {
    Error::InvalidInput(InvalidInput::new(
        "phased step",
        "returned without committing a phase or an answer; it would be called forever",
    ))
}

enum Decision<B: RunStore> {
    Commit(Box<Run<B>>),
    Finished(Finished),
    Live,
}

#[derive(Debug)]
enum StartError {
    Db(DbError),
    Reused(Value),
    Corrupt(String),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Db(e) => write!(f, "{e}"),
            Self::Reused(_) => f.write_str("the key was reused with a different request"),
            Self::Corrupt(what) => f.write_str(what),
        }
    }
}

impl From<DbError> for StartError {
    fn from(e: DbError) -> Self {
        Self::Db(e)
    }
}

fn parse(text: &str) -> Result<Value, StartError> {
    serde_json::from_str(text)
        .map_err(|e| StartError::Corrupt(format!("a run's stored request is unreadable: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ident::Operation;

    #[test]
    fn derived_keys_are_stable_and_distinct() {
        let scope = Scope::new(
            Principal::new("p").unwrap(),
            Operation::new("order", 1).unwrap(),
        );
        let key = Key::new("k").unwrap();
        let a = derived("idem", &scope, &key, "charge");
        assert_eq!(a, derived("idem", &scope, &key, "charge"));
        assert_eq!(a.len(), "idem-".len() + 32);
        assert_ne!(a, derived("idem", &scope, &key, "refund"));
        assert_ne!(
            a,
            derived("idem", &scope, &Key::new("k2").unwrap(), "charge")
        );
        // Length-prefixed parts: moving a character between parts changes the key.
        let other = Scope::new(
            Principal::new("pk").unwrap(),
            Operation::new("order", 1).unwrap(),
        );
        assert_ne!(
            derived("idem", &scope, &Key::new("kx").unwrap(), "charge"),
            derived("idem", &other, &Key::new("x").unwrap(), "charge")
        );
    }

    #[test]
    fn points_are_checked() {
        assert!(check_point("order_created").is_ok());
        assert!(check_point("").is_err());
        assert!(check_point("a b").is_err());
        assert!(check_point(&"a".repeat(65)).is_err());
    }
}
