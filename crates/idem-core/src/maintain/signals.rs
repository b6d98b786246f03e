//! The maintenance loop's and the completer's spans, events and metrics, with the
//! conventions of [`crate::observe`]: every name is defined here (and listed in
//! `docs/operations.md`), metrics need the `metrics` feature, and no label carries a
//! principal, an operation or a key (their number is unbounded; spans may carry the
//! operation and a key hash).
//!
//! # Spans
//!
//! | span | level | fields |
//! |---|---|---|
//! | [`TICK_SPAN`] | `INFO` | `engine`, `tick` (from 1), `role` (`runner` or `standby`) |
//! | [`TASK_SPAN`] | `INFO` | `engine`, `task`, `outcome` (`ok` or `error`), `work` |
//! | [`RUN_SPAN`] | `INFO` | `engine`, `operation`, `key_hash`, `point`, `result` |
//!
//! # Events
//!
//! | level | message | fields |
//! |---|---|---|
//! | `INFO` | `idem: this instance is now the maintenance runner` | `engine` |
//! | `WARN` | `idem: the maintenance lock was lost` | `engine`, `reason` |
//! | `INFO` | `idem: releasing the maintenance lock` | `engine` |
//! | `WARN` | `idem: the maintenance lock could not be tried` | `engine`, `error` |
//! | `WARN` | `idem: a maintenance task failed` | `engine`, `task`, `error` |
//!
//! # Metrics (feature `metrics`)
//!
//! | name | kind | labels |
//! |---|---|---|
//! | [`RUNNER`] | gauge | `engine` |
//! | [`TICKS`] | counter | `engine`, `role` |
//! | [`ACQUIRED`] | counter | `engine` |
//! | [`LOCK_LOST`] | counter | `engine` |
//! | [`LAST_RUN`] | gauge (Unix seconds) | `engine` |
//! | [`WORK`] | counter | `engine`, `task` |
//! | [`TASK_DURATION`] | histogram (seconds) | `engine`, `task`, `outcome` |
//! | [`ERRORS`] | counter | `engine`, `task` |
//! | [`COMPLETE_STALLED`] | gauge | `engine` |
//! | [`COMPLETE_UNHANDLED`] | gauge | `engine` |
//! | [`COMPLETE_RUNS`] | counter | `engine`, `result` |

use std::time::Duration;

/// The span of one tick of the maintenance loop.
pub const TICK_SPAN: &str = "idem.maintain.tick";
/// The span of one task (purge, relay, complete, or your own) inside a runner's tick.
pub const TASK_SPAN: &str = "idem.maintain.task";
/// The span of one stalled run the completer handled.
pub const RUN_SPAN: &str = "idem.complete.run";

/// Span field and metric label: `runner` (this instance holds the lock and works) or
/// `standby` (it only tried the lock).
pub const FIELD_ROLE: &str = "role";
/// Span field and metric label: the task's name (`purge`, `relay`, `complete`, or the
/// name of a task of your own; `lock` for failures of the lock itself in [`ERRORS`]).
pub const FIELD_TASK: &str = "task";
/// Span field and metric label: `ok` or `error` for a task; a stalled run's result for
/// [`COMPLETE_RUNS`] (`succeeded`, `failed`, `busy`, `left`).
pub const FIELD_RESULT: &str = "result";

/// Gauge: 1 while this instance holds the maintenance lock (is the runner), else 0.
/// Summed over a fleet it is 1; 0 for longer than the interval means nobody maintains.
pub const RUNNER: &str = "idem_maintain_runner";
/// Counter: ticks of the loop, by role.
pub const TICKS: &str = "idem_maintain_ticks_total";
/// Counter: times this instance became the runner.
pub const ACQUIRED: &str = "idem_maintain_acquired_total";
/// Counter: times the runner found, before a task, that it no longer held the lock (its
/// session ended, or the lock went to another session).
pub const LOCK_LOST: &str = "idem_maintain_lock_lost_total";
/// Gauge: the Unix time (seconds) at which this instance last finished a tick as the
/// runner. The fleet's maximum is the last time anyone maintained.
pub const LAST_RUN: &str = "idem_maintain_last_run_timestamp_seconds";
/// Counter: units of work done, by task: rows purged, messages published, runs driven to
/// their end (succeeded or failed).
pub const WORK: &str = "idem_maintain_work_total";
/// Histogram: a task's duration in seconds, by outcome.
pub const TASK_DURATION: &str = "idem_maintain_task_duration_seconds";
/// Counter: tasks that failed (the next tick tries again), and failures to try or check
/// the lock (`task="lock"`).
pub const ERRORS: &str = "idem_maintain_errors_total";
/// Gauge: stalled runs (lease ended, no final answer) the last completion pass found,
/// at most its scan size.
pub const COMPLETE_STALLED: &str = "idem_complete_stalled";
/// Gauge: of those, runs of operations the completer has no step for: never touched,
/// only counted. Non-zero means a deployment that lost the code of an operation, or a
/// completer configured without it.
pub const COMPLETE_UNHANDLED: &str = "idem_complete_unhandled";
/// Counter: stalled runs the completer handled, by `result`: `succeeded` and `failed`
/// (driven to that final answer), `busy` (someone else had it first, or its row was
/// locked or the database busy: a later pass handles it), `left` (its step could not move
/// it now; its lease was released for a later pass or a retry).
pub const COMPLETE_RUNS: &str = "idem_complete_runs_total";

/// The values of [`FIELD_RESULT`] in [`COMPLETE_RUNS`].
pub const COMPLETE_RESULTS: [&str; 4] = ["succeeded", "failed", "busy", "left"];

/// This instance became the runner.
pub(crate) fn acquired(engine: &'static str) {
    tracing::info!(engine, "idem: this instance is now the maintenance runner");
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(ACQUIRED, crate::observe::FIELD_ENGINE => engine).increment(1);
        metrics::gauge!(RUNNER, crate::observe::FIELD_ENGINE => engine).set(1.0);
    }
}

/// The runner found it no longer holds the lock.
pub(crate) fn lost(engine: &'static str, reason: &str) {
    tracing::warn!(engine, reason, "idem: the maintenance lock was lost");
    #[cfg(feature = "metrics")]
    {
        metrics::counter!(LOCK_LOST, crate::observe::FIELD_ENGINE => engine).increment(1);
        metrics::gauge!(RUNNER, crate::observe::FIELD_ENGINE => engine).set(0.0);
    }
}

/// The runner releases the lock at shutdown.
pub(crate) fn releasing(engine: &'static str) {
    tracing::info!(engine, "idem: releasing the maintenance lock");
    #[cfg(feature = "metrics")]
    metrics::gauge!(RUNNER, crate::observe::FIELD_ENGINE => engine).set(0.0);
}

/// A standby's tick: the gauge says so even before the first lock attempt answers.
pub(crate) fn standby(engine: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::gauge!(RUNNER, crate::observe::FIELD_ENGINE => engine).set(0.0);
    #[cfg(not(feature = "metrics"))]
    let _ = engine;
}

/// Trying or checking the lock failed.
pub(crate) fn lock_error(engine: &'static str, error: &str) {
    tracing::warn!(
        engine,
        error,
        "idem: the maintenance lock could not be tried"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!(ERRORS, crate::observe::FIELD_ENGINE => engine, FIELD_TASK => "lock")
        .increment(1);
}

/// One tick ended.
pub(crate) fn tick(engine: &'static str, runner: bool) {
    #[cfg(feature = "metrics")]
    {
        let role = if runner { "runner" } else { "standby" };
        metrics::counter!(TICKS, crate::observe::FIELD_ENGINE => engine, FIELD_ROLE => role)
            .increment(1);
        if runner {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            metrics::gauge!(LAST_RUN, crate::observe::FIELD_ENGINE => engine).set(now);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (engine, runner);
}

/// One task ended.
pub(crate) fn task(
    engine: &'static str,
    task: &'static str,
    done: u64,
    error: Option<&str>,
    took: Duration,
) {
    if let Some(error) = error {
        tracing::warn!(engine, task, error, "idem: a maintenance task failed");
    }
    #[cfg(feature = "metrics")]
    {
        let outcome = if error.is_some() { "error" } else { "ok" };
        let e = crate::observe::FIELD_ENGINE;
        if done > 0 {
            metrics::counter!(WORK, e => engine, FIELD_TASK => task).increment(done);
        }
        if error.is_some() {
            metrics::counter!(ERRORS, e => engine, FIELD_TASK => task).increment(1);
        }
        metrics::histogram!(
            TASK_DURATION,
            e => engine,
            FIELD_TASK => task,
            crate::observe::FIELD_OUTCOME => outcome
        )
        .record(took.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (engine, task, done, took);
}

/// A completion pass: what it found.
pub(crate) fn stalled(engine: &'static str, found: u64, unhandled: u64) {
    #[cfg(feature = "metrics")]
    {
        let e = crate::observe::FIELD_ENGINE;
        metrics::gauge!(COMPLETE_STALLED, e => engine).set(found as f64);
        metrics::gauge!(COMPLETE_UNHANDLED, e => engine).set(unhandled as f64);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (engine, found, unhandled);
}

/// A stalled run handled with `result` (one of [`COMPLETE_RESULTS`]).
pub(crate) fn run_result(engine: &'static str, result: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        COMPLETE_RUNS,
        crate::observe::FIELD_ENGINE => engine,
        FIELD_RESULT => result
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (engine, result);
}

/// Registers a description and unit for every metric of this module with the installed
/// recorder (as [`crate::observe::describe_metrics`] does for the calls' metrics).
#[cfg(feature = "metrics")]
pub fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(RUNNER, "1 while this instance holds the maintenance lock");
    describe_counter!(TICKS, "Ticks of the maintenance loop, by role");
    describe_counter!(
        ACQUIRED,
        "Times this instance became the maintenance runner"
    );
    describe_counter!(
        LOCK_LOST,
        "Times the runner found it had lost the maintenance lock"
    );
    describe_gauge!(
        LAST_RUN,
        Unit::Seconds,
        "Unix time of this instance's last tick as the maintenance runner"
    );
    describe_counter!(
        WORK,
        "Rows purged, messages published, runs completed, by task"
    );
    describe_histogram!(
        TASK_DURATION,
        Unit::Seconds,
        "Duration of a maintenance task"
    );
    describe_counter!(ERRORS, "Maintenance tasks (and lock attempts) that failed");
    describe_gauge!(
        COMPLETE_STALLED,
        "Stalled runs found by the last completion pass"
    );
    describe_gauge!(
        COMPLETE_UNHANDLED,
        "Stalled runs of operations the completer has no step for"
    );
    describe_counter!(
        COMPLETE_RUNS,
        "Stalled runs handled by the completer, by result"
    );
}
