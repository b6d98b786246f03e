//! The built-in tasks: purge, relay and stalled-run completion, each bounded per tick.
//!
//! Each is a thin seam over the protocol's own calls, so that the calls can change
//! without the loop changing: [`Purge`] runs the engine's bounded delete
//! ([`Maintenance::purge_batch`], what `Idem::purge` runs until nothing is left) a fixed
//! number of times; [`Relay`] runs [`Idem::relay`] passes; [`Completion`] lists stalled
//! runs ([`RunStore::stalled_runs`]) and drives each run of a known operation with
//! [`Idem::execute_phased`] and that operation's step.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::time::Duration;

use tracing::Instrument;
use tracing::field::Empty;

use super::{Task, Work, signals};
use crate::backend::{Maintenance, Table};
use crate::error::{DbError, Error, ErrorKind};
use crate::ident::{Key, Operation, Principal, Scope};
use crate::outbox::{Publisher, RelayError};
use crate::phased::{OperationReport, Run};
use crate::protocol::{BoxFuture, Idem, Outcome};
use crate::request::Request;
use crate::runs::{OutboxStore, RunStore, StalledRow};

/// Deletes expired records, at most `max_batches` statements of `batch` rows per tick,
/// round-robin over the tables (request records, processed messages, phased runs, sent
/// outbox messages), so a large backlog in one table does not hold the others back.
/// A statement that meets a busy database, a deadlock or a lock timeout is run again
/// under the [`Idem`]'s retry policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purge {
    older_than: Duration,
    batch: u32,
    max_batches: u32,
}

impl Default for Purge {
    fn default() -> Self {
        Self::new()
    }
}

impl Purge {
    /// Every expired record, 1000 rows per statement, at most 10 statements per tick.
    pub fn new() -> Self {
        Self {
            older_than: Duration::ZERO,
            batch: 1000,
            max_batches: 10,
        }
    }

    /// Also keeps records claimed less than this long ago, expired or not (as
    /// `Idem::purge`'s `older_than`).
    #[must_use]
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = age;
        self
    }

    /// Rows per delete statement (at least 1).
    #[must_use]
    pub fn batch(mut self, rows: u32) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// Delete statements per tick (at least 1).
    #[must_use]
    pub fn max_batches(mut self, statements: u32) -> Self {
        self.max_batches = statements.max(1);
        self
    }

    async fn purge<B: Maintenance>(&self, idem: &Idem<B>) -> Result<Work, DbError> {
        let backend = idem.backend();
        let tables = [
            (Table::Requests, "requests"),
            (Table::Messages, "messages"),
            (Table::Runs, "runs"),
            (Table::Outbox, "outbox"),
        ];
        let mut deleted = [0u64; 4];
        let mut active = [true; 4];
        let mut budget = self.max_batches;
        while budget > 0 && active.iter().any(|a| *a) {
            for (i, (table, _)) in tables.iter().enumerate() {
                if budget == 0 || !active[i] {
                    continue;
                }
                budget -= 1;
                let mut attempt = 0;
                let n = loop {
                    attempt += 1;
                    match backend
                        .purge_batch(*table, self.older_than, self.batch)
                        .await
                    {
                        Ok(n) => break n,
                        Err(e) if e.kind().is_retryable() => {
                            idem.pause::<Infallible>(attempt, e)
                                .await
                                .map_err(last_db_error)?;
                        }
                        Err(e) => return Err(e),
                    }
                };
                deleted[i] += n;
                if n < u64::from(self.batch) {
                    active[i] = false;
                }
            }
        }
        Ok(Work {
            done: deleted.iter().sum(),
            more: active.iter().any(|a| *a),
            counts: tables
                .iter()
                .zip(deleted)
                .map(|((_, name), n)| (*name, n))
                .collect(),
            problems: Vec::new(),
        })
    }
}

/// The engine error behind a protocol error (a retry policy that gave up).
fn last_db_error<E: fmt::Display>(e: Error<E>) -> DbError {
    match e {
        Error::RetriesExhausted { last, .. } | Error::Backend(last) => last,
        other => DbError::new("idem", ErrorKind::Other, other.to_string()),
    }
}

impl<B: Maintenance> Task<B> for Purge {
    fn name(&self) -> &'static str {
        "purge"
    }

    fn run<'a>(&'a mut self, idem: &'a Idem<B>) -> BoxFuture<'a, Result<Work, DbError>> {
        Box::pin(self.purge(idem))
    }
}

/// Publishes the transactional outbox: at most `passes` relay passes of `batch`
/// messages per tick, stopping early at a pass that publishes less than a full batch
/// (the outbox is drained) or that a broker refused.
#[derive(Debug)]
pub struct Relay<P> {
    publisher: P,
    batch: u32,
    passes: u32,
}

impl<P: Publisher> Relay<P> {
    /// Relays with `publisher`: 100 messages per pass, at most 10 passes per tick.
    pub fn new(publisher: P) -> Self {
        Self {
            publisher,
            batch: 100,
            passes: 10,
        }
    }

    /// Messages per pass (1 to [`crate::runs::MAX_RELAY_BATCH`]).
    #[must_use]
    pub fn batch(mut self, messages: u32) -> Self {
        self.batch = messages.clamp(1, crate::runs::MAX_RELAY_BATCH);
        self
    }

    /// Passes per tick (at least 1).
    #[must_use]
    pub fn passes(mut self, passes: u32) -> Self {
        self.passes = passes.max(1);
        self
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    async fn relay<B: OutboxStore>(&self, idem: &Idem<B>) -> Result<Work, DbError> {
        let mut work = Work::default();
        let (mut deferred, mut refused) = (0u64, 0u64);
        for pass in 1..=self.passes {
            let report = idem
                .relay(&self.publisher, self.batch)
                .await
                .map_err(|e| match e {
                    RelayError::Db(db) => db,
                    #[allow(unreachable_patterns)]
                    other => DbError::new("idem", ErrorKind::Other, other.to_string()),
                })?;
            work.done += report.published;
            deferred += report.deferred;
            refused += report.failed.len() as u64;
            for failure in &report.failed {
                work.problems.push(failure.to_string());
            }
            let full = report.published >= u64::from(self.batch);
            if !full || !report.failed.is_empty() {
                break;
            }
            work.more = pass == self.passes;
        }
        work.counts = vec![
            ("published", work.done),
            ("deferred", deferred),
            ("refused", refused),
        ];
        Ok(work)
    }
}

impl<B: OutboxStore, P: Publisher + 'static> Task<B> for Relay<P> {
    fn name(&self) -> &'static str {
        "relay"
    }

    fn run<'a>(&'a mut self, idem: &'a Idem<B>) -> BoxFuture<'a, Result<Work, DbError>> {
        Box::pin(self.relay(idem))
    }
}

/// An operation's step, with its error as text.
type StepFn<B> =
    Box<dyn for<'r> FnMut(&'r mut Run<B>) -> BoxFuture<'r, Result<(), Error<String>>> + Send>;

/// Finishes phased runs whose owner's lease ended before they stored a final answer
/// (their owner crashed or gave up), with one step function per operation.
///
/// Each pass lists up to `scan` stalled runs, the longest-stalled first, and takes over
/// at most `limit` of them, each only if its operation has a step
/// ([`Completion::step`]): the run's stored request is read under its row lock (a run
/// that finished, was taken over or expired meanwhile is left alone), then the run is
/// resumed with [`Idem::execute_phased`], which takes it over and calls the step until
/// the run stores its final answer. A step that fails has the run's lease released, so a
/// later pass or the client's retry tries again.
///
/// **Runs of operations without a step are never touched**: not taken over, not
/// released, not failed. They are counted ([`CompletionReport::unhandled`],
/// [`signals::COMPLETE_UNHANDLED`]) so an operator can see them; a client's retry
/// with the same key still resumes them.
///
/// One window remains: a run whose retention ends between the read and the takeover
/// is replaced by a new run of the same request (what a client's retry arriving at that
/// moment would do). The completer notices (the run is not a takeover), does not drive
/// it, releases its lease and reports it as left.
pub struct Completion<B: RunStore> {
    limit: u32,
    scan: u32,
    steps: BTreeMap<String, StepFn<B>>,
}

impl<B: RunStore> fmt::Debug for Completion<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("limit", &self.limit)
            .field("scan", &self.scan)
            .field("operations", &self.steps.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<B: RunStore> Default for Completion<B> {
    fn default() -> Self {
        Self::new()
    }
}

/// What one completion pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompletionReport {
    /// Stalled runs listed (at most the scan size).
    pub found: u64,
    /// Per operation with a step (`name:vN`): what happened to its runs.
    pub operations: BTreeMap<String, OperationReport>,
    /// Per operation without a step: stalled runs found and left untouched.
    pub unhandled: BTreeMap<String, u64>,
    /// Runs of known operations past the limit, left for the next pass.
    pub deferred: u64,
}

impl CompletionReport {
    fn total(&self, f: impl Fn(&OperationReport) -> u64) -> u64 {
        self.operations.values().map(f).sum()
    }
}

/// How one stalled run ended.
enum Handled {
    Succeeded,
    Failed,
    Busy,
    Left(String),
}

impl Handled {
    fn label(&self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Busy => "busy",
            Self::Left(_) => "left",
        }
    }
}

impl<B: RunStore> Completion<B> {
    /// No operation yet; at most 100 runs taken over per pass, 1000 listed.
    pub fn new() -> Self {
        Self {
            limit: 100,
            scan: 1000,
            steps: BTreeMap::new(),
        }
    }

    /// Runs taken over per pass (at least 1).
    #[must_use]
    pub fn limit(mut self, runs: u32) -> Self {
        self.limit = runs.max(1);
        self
    }

    /// Stalled runs listed per pass, the longest-stalled first (at least the limit). Runs
    /// of operations without a step count against it: when more than this many of them
    /// are stalled, runs of known operations behind them wait.
    #[must_use]
    pub fn scan(mut self, runs: u32) -> Self {
        self.scan = runs.max(1);
        self
    }

    /// Drives the stalled runs of `operation` with `step` (the operation's own step
    /// function, as given to [`Idem::execute_phased`]: it moves a run one recovery point
    /// forward, or ends it with [`Run::finish`] or [`Run::fail`]). A second step for the
    /// same operation replaces the first.
    #[must_use]
    pub fn step<E, S>(mut self, operation: &Operation, mut step: S) -> Self
    where
        E: fmt::Display + Send + 'static,
        S: for<'r> FnMut(&'r mut Run<B>) -> BoxFuture<'r, Result<(), Error<E>>> + Send + 'static,
    {
        let boxed: StepFn<B> = Box::new(move |run| {
            let fut = step(run);
            Box::pin(async move {
                fut.await.map_err(|e| {
                    match e.try_map_effect(|e| Ok::<_, Infallible>(e.to_string())) {
                        Ok(e) => e,
                        Err(never) => match never {},
                    }
                })
            })
        });
        self.steps.insert(operation.as_str().to_owned(), boxed);
        self
    }

    /// The operations with a step (`name:vN`).
    pub fn operations(&self) -> Vec<&str> {
        self.steps.keys().map(String::as_str).collect()
    }

    /// One pass (what the task runs each tick).
    pub async fn pass(&mut self, idem: &Idem<B>) -> Result<CompletionReport, DbError> {
        let engine = idem.backend().engine();
        let rows = idem
            .backend()
            .stalled_runs(self.scan.max(self.limit))
            .await?;
        let mut report = CompletionReport {
            found: rows.len() as u64,
            ..CompletionReport::default()
        };
        let mut taken = 0u32;
        for row in rows {
            let Some(step) = self.steps.get_mut(&row.operation) else {
                *report.unhandled.entry(row.operation).or_default() += 1;
                continue;
            };
            if taken >= self.limit {
                report.deferred += 1;
                continue;
            }
            taken += 1;
            let span = tracing::info_span!(
                "idem.complete.run",
                engine,
                operation = row.operation.as_str(),
                key_hash = crate::observe::key_hash(&row.key),
                point = row.point.as_str(),
                result = Empty
            );
            let handled = handle(idem, step, &row).instrument(span.clone()).await;
            span.record(signals::FIELD_RESULT, handled.label());
            signals::run_result(engine, handled.label());
            let entry = report.operations.entry(row.operation.clone()).or_default();
            match handled {
                Handled::Succeeded => entry.succeeded += 1,
                Handled::Failed => entry.failed += 1,
                Handled::Busy => entry.busy += 1,
                Handled::Left(why) => {
                    entry.left += 1;
                    entry.errors.push(format!("{}: {why}", row.key));
                }
            }
        }
        signals::stalled(engine, report.found, report.unhandled.values().sum());
        Ok(report)
    }
}

/// The stored request of a stalled run, read under its row lock (bounded by the wait
/// bound); `None` when it is no longer a stalled run (finished, taken over, expired or
/// gone).
async fn stalled_request<B: RunStore>(
    idem: &Idem<B>,
    scope: &Scope,
    key: &Key,
) -> Result<Option<Request>, DbError> {
    let backend = idem.backend();
    let mut tx = backend.begin_runs(Some(idem.wait_timeout())).await?;
    let row = backend.read_run(&mut tx, scope, key).await;
    let _ = backend.rollback_runs(tx).await;
    let Some(row) = row? else {
        return Ok(None);
    };
    if row.expired || row.status.is_some() || !row.lease_over {
        return Ok(None);
    }
    let value = serde_json::from_str(&row.request).map_err(|e| {
        DbError::new(
            "idem",
            ErrorKind::CorruptRecord,
            format!("a run's stored request is unreadable: {e}"),
        )
    })?;
    Ok(Some(Request::new(value)))
}

async fn handle<B: RunStore>(idem: &Idem<B>, step: &mut StepFn<B>, row: &StalledRow) -> Handled {
    let (Ok(principal), Ok(operation), Ok(key)) = (
        Principal::new(row.principal.as_str()),
        row.operation.parse::<Operation>(),
        Key::new(row.key.as_str()),
    ) else {
        return Handled::Left("the stored identity is not valid".into());
    };
    let scope = Scope::new(principal, operation);
    let request = match stalled_request(idem, &scope, &key).await {
        Ok(Some(request)) => request,
        Ok(None) => return Handled::Busy,
        // Its row is locked by another session (a client's retry taking it over), or the
        // database is busy: another pass (or that retry) handles it.
        Err(e) if e.kind() == ErrorKind::LockTimeout || e.kind().is_retryable() => {
            return Handled::Busy;
        }
        Err(e) => return Handled::Left(e.to_string()),
    };
    let mut first = true;
    let mut fresh = false;
    let outcome = idem
        .execute_phased::<serde::de::IgnoredAny, String, _>(
            &scope,
            &key,
            &request,
            |run: &mut Run<B>| {
                if first {
                    first = false;
                    if !run.resumed() {
                        // Not a takeover: the stalled run expired in between and this
                        // is a new run of its request. Not ours to drive.
                        fresh = true;
                        return Box::pin(async {
                            Err(Error::InvalidInput(crate::InvalidInput::new(
                                "stalled run",
                                "its retention ended while it was being taken over",
                            )))
                        });
                    }
                }
                step(run)
            },
        )
        .await;
    let took_over = !first && !fresh;
    match outcome {
        Ok(Outcome::Executed(_)) => Handled::Succeeded,
        Err(Error::StoredRejection(_)) if took_over => Handled::Failed,
        Ok(Outcome::Replayed(_))
        | Err(Error::StoredRejection(_) | Error::InProgress { .. } | Error::LeaseLost { .. }) => {
            Handled::Busy
        }
        Err(e) if fresh => Handled::Left(format!(
            "{e}; a new run of its request was started and released, not driven"
        )),
        Err(e) => Handled::Left(e.to_string()),
    }
}

impl<B: RunStore> Task<B> for Completion<B> {
    fn name(&self) -> &'static str {
        "complete"
    }

    fn run<'a>(&'a mut self, idem: &'a Idem<B>) -> BoxFuture<'a, Result<Work, DbError>> {
        Box::pin(async move {
            let report = self.pass(idem).await?;
            let succeeded = report.total(|r| r.succeeded);
            let failed = report.total(|r| r.failed);
            let mut problems: Vec<String> = report
                .operations
                .iter()
                .flat_map(|(op, r)| r.errors.iter().map(move |e| format!("{op} {e}")))
                .collect();
            for (op, n) in &report.unhandled {
                problems.push(format!(
                    "{op}: {n} stalled run(s) of an operation without a step, left untouched"
                ));
            }
            Ok(Work {
                done: succeeded + failed,
                more: report.deferred > 0,
                counts: vec![
                    ("found", report.found),
                    ("succeeded", succeeded),
                    ("failed", failed),
                    ("busy", report.total(|r| r.busy)),
                    ("left", report.total(|r| r.left)),
                    ("unhandled", report.unhandled.values().sum()),
                ],
                problems,
            })
        })
    }
}
