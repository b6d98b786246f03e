//! Maintenance once per fleet: purge, relay and stalled-run completion on a schedule,
//! done by one elected instance at a time.
//!
//! Every instance of an application runs the same [`Maintainer`]. On each tick an
//! instance that is not the runner tries the engine's own lock, without waiting
//! ([`LeaderLock::try_acquire`]); the one that holds it is the **runner** and does a
//! bounded amount of each task, then sleeps for a jittered interval. The lock lives on a
//! session of its own, so it ends with that session: when the runner's process dies
//! (even with `SIGKILL`) the database server ends the session, the lock is free, and
//! another instance takes it at its next tick, within one interval.
//!
//! ```text
//!            ┌──────────── every interval × (1 − jitter … 1) ────────────┐
//!            ▼                                                           │
//!  standby ── try the lock ──(taken by another)──────────────────────────┤
//!            │ (got it)                                                  │
//!            ▼                                                           │
//!  runner ── is it still mine? ──(no: session gone, or taken)──▶ standby ┤
//!            │ (yes)                                                     │
//!            ▼                                                           │
//!          task 1 (bounded) ── is it still mine? ── task 2 … ────────────┘
//! ```
//!
//! | engine | lock | held by |
//! |---|---|---|
//! | PostgreSQL | `pg_try_advisory_lock` (session level) | a dedicated connection |
//! | MySQL / MariaDB | `GET_LOCK(name, 0)` | a dedicated connection |
//! | SQL Server | `sp_getapplock` with `@LockOwner = 'Session'`, `@LockTimeout = 0` | a dedicated connection |
//! | Oracle | `DBMS_LOCK.REQUEST` in exclusive mode, `release_on_commit => FALSE` | a dedicated connection |
//! | SQLite | an exclusive transaction on a sidecar database file (an OS file lock) | a dedicated connection |
//!
//! # Fencing, and the window that remains
//!
//! The runner checks that it still holds the lock ([`LeaderLock::is_held`]) before each
//! task and stops at the first "no" (or error, or a check slower than the lock timeout).
//! A lock can be lost between that check and the end of the task (the lock's session
//! is cut while the task runs on other connections), so for at most the duration of
//! one task two instances may both work. Every built-in task is safe under that
//! overlap: purges delete expired rows only, relays lock the rows they publish and
//! deliver at least once, and the completer takes runs over through their leases, so a
//! second completer finds them busy. The election saves work and contention; it is
//! not what keeps the data correct. Tasks of your own ([`Task`]) must be safe to run
//! twice at once too.
//!
//! # Bounded work per tick
//!
//! [`Purge`] runs at most `max_batches` delete statements per tick (round-robin over the
//! tables), [`Relay`] at most `passes` relay passes of `batch` messages, and
//! [`Completion`] takes over at most `limit` stalled runs. What is left is picked up
//! at the next tick ([`Work::more`]).
//!
//! # Shutdown
//!
//! [`Maintainer::run`] takes a future that completes on shutdown (a signal, a
//! cancellation token). It is checked between tasks: the task in hand finishes, the
//! runner releases the lock (so a standby takes over at its next tick instead of
//! waiting for the session to end), and `run` returns.

pub mod signals;
mod tasks;

use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::time::{Duration, Instant};

use tracing::Instrument;
use tracing::field::Empty;

use crate::backend::Backend;
use crate::error::{DbError, ErrorKind};
use crate::protocol::{BoxFuture, Idem};

pub use tasks::{Completion, CompletionReport, Purge, Relay};

/// An engine's single-runner lock: held by at most one session at a time, and released
/// by the server when that session ends (the process died, the connection broke).
///
/// Engines implement three steps; the loop around them is [`Maintainer`]'s. None of
/// them may wait for another holder: the lock is tried, never queued for.
pub trait LeaderLock: Send + Sync {
    /// The held lock: the dedicated session that holds it. Dropping it closes the
    /// session, which releases the lock on the server (no I/O in `Drop`).
    type Held: Send;

    /// Tries to take the lock once, without waiting: `Some` when this instance now holds
    /// it, `None` when another session does.
    fn try_acquire(&self) -> impl Future<Output = Result<Option<Self::Held>, DbError>> + Send;

    /// Whether `held` still holds the lock: its session is alive and the lock is still
    /// that session's. An error counts as "no".
    fn is_held(&self, held: &mut Self::Held) -> impl Future<Output = Result<bool, DbError>> + Send;

    /// Releases the lock and closes its session.
    fn release(&self, held: Self::Held) -> impl Future<Output = Result<(), DbError>> + Send;
}

/// What one task did in one tick.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Work {
    /// Units of work done: rows purged, messages published, runs driven to their end.
    pub done: u64,
    /// The task stopped at its bound with work left; the next tick goes on.
    pub more: bool,
    /// Named counts for reports (`requests`, `published`, `busy`, …).
    pub counts: Vec<(&'static str, u64)>,
    /// Problems that did not fail the task (a destination the broker refused, a stalled
    /// run left for later), one line each.
    pub problems: Vec<String>,
}

/// One unit of maintenance the runner does on each tick. It must be bounded (stop after
/// a fixed amount of work and report [`Work::more`]) and safe to run on two instances at
/// once (see the module documentation on fencing).
pub trait Task<B>: Send {
    /// The task's name in reports, spans and metric labels: a short, fixed word.
    fn name(&self) -> &'static str;

    /// Does one tick's share of the work.
    fn run<'a>(&'a mut self, idem: &'a Idem<B>) -> BoxFuture<'a, Result<Work, DbError>>;
}

/// How one task of a tick ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskReport {
    /// The task's name.
    pub name: &'static str,
    /// What it did (empty when it failed).
    pub work: Work,
    /// Why it failed; the next tick tries again.
    pub error: Option<TaskError>,
    /// How long it took.
    pub took: Duration,
}

/// Why a task failed in one tick: the error's kind, which every engine decides from its
/// own code (a scheduler can tell "the migrations have not run" from "the database is
/// unreachable" on every engine alike), and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskError {
    /// The error's kind.
    pub kind: ErrorKind,
    /// The error, as [`DbError`]'s `Display` gives it (engine, kind, code, message).
    pub message: String,
}

impl From<&DbError> for TaskError {
    fn from(e: &DbError) -> Self {
        Self {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

impl fmt::Display for TaskError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// One tick of the loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickReport {
    /// The tick's number, from 1.
    pub number: u64,
    /// Whether this instance was the runner at the start of the tick's work.
    pub runner: bool,
    /// The tasks it ran, in order.
    pub tasks: Vec<TaskReport>,
    /// Tasks not run because the lock was lost or shutdown began.
    pub skipped: usize,
}

/// What the loop reports to [`Maintainer::on_event`], as it happens.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// This instance took the lock: it is the runner from now on.
    Acquired,
    /// The runner found it no longer holds the lock, and stopped working.
    Lost {
        /// What the check saw.
        reason: &'a str,
    },
    /// Shutdown: the runner has stopped working and is about to release the lock.
    Releasing,
    /// Trying or checking the lock failed (the database is unreachable); the next tick
    /// tries again.
    LockError {
        /// The error.
        error: &'a DbError,
    },
    /// A tick ended.
    Tick(&'a TickReport),
}

/// What [`Maintainer::run`] did before it returned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Ticks run.
    pub ticks: u64,
    /// Of those, ticks as the runner.
    pub runner_ticks: u64,
    /// Times this instance became the runner.
    pub acquired: u64,
    /// Times it found the lock lost.
    pub lost: u64,
}

type Observer = Box<dyn FnMut(&Event<'_>) + Send>;

/// The lock's name when none is given: instances elect one runner per name (and, on
/// every engine, per schema or database), so two deployments sharing a server do not
/// elect each other.
pub const DEFAULT_LOCK_NAME: &str = "idem-maintain";

/// Checks a lock name: 1 to 64 characters of `A-Z`, `a-z`, `0-9`, `.`, `_` or `-`
/// (every engine's lock namespace accepts them, and SQLite uses the name in a file name).
pub fn check_lock_name(name: &str) -> Result<(), crate::InvalidInput> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > 64 || !name.chars().all(ok) || name.starts_with('.') {
        return Err(crate::InvalidInput::new(
            "maintenance lock name",
            format!(
                "{name:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-', not \
                 starting with '.'"
            ),
        ));
    }
    Ok(())
}

/// The default interval between ticks: 10 s.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// The default jitter: each pause is the interval shortened by up to 20 %.
pub const DEFAULT_JITTER: f64 = 0.2;
/// The default bound on one lock operation (try, check, release): 5 s.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The maintenance loop: an [`Idem`], an engine's [`LeaderLock`] and the tasks the runner
/// does on each tick, in the order they were added.
///
/// ```no_run
/// # async fn demo<B, L>(
/// #     idem: idem_core::Idem<B>,
/// #     lock: L,
/// #     shutdown: tokio::sync::oneshot::Receiver<()>,
/// # ) -> Result<(), Box<dyn std::error::Error>>
/// # where B: idem_core::RunStore + idem_core::Maintenance, L: idem_core::maintain::LeaderLock {
/// use std::time::Duration;
/// use idem_core::maintain::{Completion, Maintainer, Purge};
/// let summary = Maintainer::new(idem, lock)
///     .with_interval(Duration::from_secs(30))
///     .with_task(Completion::new().limit(50)) // add .step(&operation, step) per operation
///     .with_task(Purge::new().batch(1000).max_batches(20))
///     // Any future that completes on shutdown: a signal, a cancellation token, a channel.
///     .run(async { let _ = shutdown.await; })
///     .await;
/// println!("{} ticks, {} as the runner", summary.ticks, summary.runner_ticks);
/// # Ok(()) }
/// ```
pub struct Maintainer<B: Backend, L: LeaderLock> {
    idem: Idem<B>,
    lock: L,
    tasks: Vec<Box<dyn Task<B>>>,
    interval: Duration,
    jitter: f64,
    lock_timeout: Duration,
    observer: Option<Observer>,
}

impl<B: Backend + fmt::Debug, L: LeaderLock + fmt::Debug> fmt::Debug for Maintainer<B, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tasks: Vec<&str> = self.tasks.iter().map(|t| t.name()).collect();
        f.debug_struct("Maintainer")
            .field("idem", &self.idem)
            .field("lock", &self.lock)
            .field("tasks", &tasks)
            .field("interval", &self.interval)
            .field("jitter", &self.jitter)
            .field("lock_timeout", &self.lock_timeout)
            .finish_non_exhaustive()
    }
}

/// Polls `shutdown` once: whether it has completed.
async fn fired<F: Future<Output = ()>>(shutdown: &mut Pin<&mut F>) -> bool {
    tokio::select! {
        biased;
        () = shutdown.as_mut() => true,
        () = std::future::ready(()) => false,
    }
}

impl<B: Backend, L: LeaderLock> Maintainer<B, L> {
    /// A loop over `idem` elected by `lock`, with no task yet, a 10 s interval, 20 %
    /// jitter and a 5 s lock timeout.
    pub fn new(idem: Idem<B>, lock: L) -> Self {
        Self {
            idem,
            lock,
            tasks: Vec::new(),
            interval: DEFAULT_INTERVAL,
            jitter: DEFAULT_JITTER,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            observer: None,
        }
    }

    /// The pause between ticks (at least 10 ms). It also bounds the takeover: a standby
    /// tries the lock at least once per interval, so after the runner dies another
    /// instance runs within one interval plus the time the server takes to end the dead
    /// runner's session.
    #[must_use]
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(10));
        self
    }

    /// How much of the interval each pause may be shortened by at random, from 0 (every
    /// instance ticks in step) to 1 (default 0.2), so instances started together do not
    /// try the lock in lockstep. Pauses are never longer than the interval.
    #[must_use]
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            DEFAULT_JITTER
        };
        self
    }

    /// The bound on one lock operation (default 5 s). A check slower than this counts as
    /// a lost lock: the runner stops working and drops its session.
    #[must_use]
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Adds a task; tasks run in the order they were added.
    #[must_use]
    pub fn with_task<T: Task<B> + 'static>(mut self, task: T) -> Self {
        self.tasks.push(Box::new(task));
        self
    }

    /// Calls `observer` with every [`Event`] as it happens (for logs, a status line or a
    /// test). It runs inside the loop: keep it quick.
    #[must_use]
    pub fn on_event(mut self, observer: impl FnMut(&Event<'_>) + Send + 'static) -> Self {
        self.observer = Some(Box::new(observer));
        self
    }

    /// The tasks' names, in order.
    pub fn task_names(&self) -> Vec<&'static str> {
        self.tasks.iter().map(|t| t.name()).collect()
    }

    fn emit(&mut self, event: &Event<'_>) {
        if let Some(observer) = self.observer.as_mut() {
            observer(event);
        }
    }

    /// The next pause: the interval shortened by up to `jitter` of it.
    fn pause(&self) -> Duration {
        let cut = self.jitter * fastrand::f64();
        self.interval.mul_f64(1.0 - cut)
    }

    /// Runs ticks until `shutdown` completes; then the runner releases the lock. See the
    /// module documentation for what a tick does.
    pub async fn run<F: Future<Output = ()> + Send>(mut self, shutdown: F) -> Summary {
        let engine = self.idem.backend().engine();
        let mut shutdown = pin!(shutdown);
        let mut held: Option<L::Held> = None;
        let mut summary = Summary::default();
        loop {
            if fired(&mut shutdown).await {
                break;
            }
            summary.ticks += 1;
            let number = summary.ticks;
            let span =
                tracing::info_span!("idem.maintain.tick", engine, tick = number, role = Empty);
            let (report, stop) = self
                .tick(number, &mut held, &mut summary, &mut shutdown)
                .instrument(span.clone())
                .await;
            span.record(
                signals::FIELD_ROLE,
                if report.runner { "runner" } else { "standby" },
            );
            if report.runner {
                summary.runner_ticks += 1;
            }
            signals::tick(engine, report.runner);
            self.emit(&Event::Tick(&report));
            if stop {
                break;
            }
            let pause = self.pause();
            tokio::select! {
                () = shutdown.as_mut() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        if let Some(h) = held.take() {
            self.emit(&Event::Releasing);
            signals::releasing(engine);
            match tokio::time::timeout(self.lock_timeout, self.lock.release(h)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => signals::lock_error(engine, &e.to_string()),
                Err(_) => signals::lock_error(engine, "releasing timed out"),
            }
        }
        summary
    }

    /// One tick: the election, then (as the runner) the tasks. Returns the report and
    /// whether shutdown began during it.
    async fn tick<F: Future<Output = ()>>(
        &mut self,
        number: u64,
        held: &mut Option<L::Held>,
        summary: &mut Summary,
        shutdown: &mut Pin<&mut F>,
    ) -> (TickReport, bool) {
        let engine = self.idem.backend().engine();
        if held.is_none() {
            signals::standby(engine);
            match tokio::time::timeout(self.lock_timeout, self.lock.try_acquire()).await {
                Ok(Ok(Some(h))) => {
                    *held = Some(h);
                    summary.acquired += 1;
                    signals::acquired(engine);
                    self.emit(&Event::Acquired);
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => {
                    signals::lock_error(engine, &e.to_string());
                    self.emit(&Event::LockError { error: &e });
                }
                Err(_) => {
                    let e = DbError::new(
                        engine,
                        ErrorKind::Connection,
                        format!(
                            "trying the maintenance lock took longer than {:?}",
                            self.lock_timeout
                        ),
                    );
                    signals::lock_error(engine, &e.to_string());
                    self.emit(&Event::LockError { error: &e });
                }
            }
        }
        let mut report = TickReport {
            number,
            runner: held.is_some(),
            tasks: Vec::new(),
            skipped: 0,
        };
        let mut stop = false;
        let total = self.tasks.len();
        for i in 0..total {
            if held.is_none() {
                report.skipped = total - i;
                break;
            }
            if fired(shutdown).await {
                stop = true;
                report.skipped = total - i;
                break;
            }
            // Fencing: the lock must still be ours before each task.
            if let Some(reason) = self.check(held).await {
                summary.lost += 1;
                signals::lost(engine, &reason);
                self.emit(&Event::Lost { reason: &reason });
                report.skipped = total - i;
                break;
            }
            let task = &mut self.tasks[i];
            let name = task.name();
            let span = tracing::info_span!(
                "idem.maintain.task",
                engine,
                task = name,
                outcome = Empty,
                work = Empty
            );
            let began = Instant::now();
            let result = task.run(&self.idem).instrument(span.clone()).await;
            let took = began.elapsed();
            let (work, error) = match result {
                Ok(work) => (work, None),
                Err(e) => (Work::default(), Some(TaskError::from(&e))),
            };
            span.record(
                crate::observe::FIELD_OUTCOME,
                if error.is_some() { "error" } else { "ok" },
            );
            span.record("work", work.done);
            signals::task(
                engine,
                name,
                work.done,
                error.as_ref().map(|e| e.message.as_str()),
                took,
            );
            report.tasks.push(TaskReport {
                name,
                work,
                error,
                took,
            });
        }
        (report, stop)
    }

    /// `None` while the lock is still held; otherwise why not (and the session is
    /// dropped, which ends it on the server).
    async fn check(&mut self, held: &mut Option<L::Held>) -> Option<String> {
        let h = held.as_mut()?;
        let reason = match tokio::time::timeout(self.lock_timeout, self.lock.is_held(h)).await {
            Ok(Ok(true)) => return None,
            Ok(Ok(false)) => "the lock belongs to another session now".to_owned(),
            Ok(Err(e)) => format!("the lock's session failed: {e}"),
            Err(_) => format!("checking the lock took longer than {:?}", self.lock_timeout),
        };
        if let Some(h) = held.take() {
            // Best effort: the session may be gone already; dropping it ends it.
            let _ = tokio::time::timeout(self.lock_timeout, self.lock.release(h)).await;
        }
        Some(reason)
    }
}

#[cfg(test)]
mod tests;
