//! The conformance case of the maintenance loop's completion task
//! ([`idem::core::maintain::Completion`]): what it drives, and what it leaves alone.

use std::sync::Arc;
use std::time::Duration;

use idem::core::maintain::Completion;
use idem::core::runs::RunRow;
use idem::core::{
    BoxFuture, Error, Idem, Key, Operation, Outcome, Principal, Request, Run, RunStore, Scope,
    Started,
};
use serde_json::{Value, json};

use crate::bank::{Bank, BankError};
use crate::cases::{CaseResult, Failure};

const LEASE: Duration = Duration::from_millis(600);

fn fail(msg: impl Into<String>) -> Failure {
    msg.into().into()
}

fn scope(operation: &str) -> Result<Scope, Failure> {
    Ok(Scope::new(
        Principal::new("account-1")?,
        operation.parse::<Operation>()?,
    ))
}

/// `order:v1`: `started` → debit 10 (phase `held`) → finish with the balance.
fn order_step<K: Bank>()
-> impl for<'r> FnMut(&'r mut Run<K::B>) -> BoxFuture<'r, Result<(), Error<BankError>>> + Send {
    |run| {
        Box::pin(async move {
            if run.point() == "started" {
                run.phase("held", |tx| K::debit(tx, 1, 10)).await?;
            } else {
                let held: Value = run.state().map_err(Error::Decode)?.unwrap_or(Value::Null);
                run.finish(move |_tx| {
                    let held = held.clone();
                    Box::pin(async move { Ok::<_, BankError>(json!({ "held": held })) })
                })
                .await?;
            }
            Ok(())
        })
    }
}

/// `void:v1`: ends every run with a stored final failure.
fn void_step<K: Bank>()
-> impl for<'r> FnMut(&'r mut Run<K::B>) -> BoxFuture<'r, Result<(), Error<BankError>>> + Send {
    |run| {
        Box::pin(async move {
            run.fail(|_tx| Box::pin(async { Ok::<_, BankError>(json!({"voided": true})) }))
                .await?;
            Ok(())
        })
    }
}

/// A completion task that knows `order:v1` and `void:v1`.
fn completion<K: Bank>() -> Result<Completion<K::B>, Failure> {
    Ok(Completion::new()
        .step(&"order:v1".parse::<Operation>()?, order_step::<K>())
        .step(&"void:v1".parse::<Operation>()?, void_step::<K>()))
}

async fn row<B: RunStore>(backend: &B, scope: &Scope, key: &Key) -> Result<RunRow, Failure> {
    let mut tx = backend.begin_runs(None).await?;
    let row = backend.read_run(&mut tx, scope, key).await;
    backend.rollback_runs(tx).await?;
    row?.ok_or_else(|| fail("the run is gone"))
}

/// Two completion passes at once, over stalled runs of two operations with a step and
/// one without: each run of a known operation ends exactly once (succeeded or failed),
/// and the runs of the unknown operation are reported and left exactly as they were
/// (same owner, fence, point and lease), so a client's retry still resumes them.
pub async fn completion_drives_known_operations_only<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = Idem::new(bank.backend().clone())
        .with_lease(LEASE)
        .with_wait_timeout(Duration::from_millis(100));
    let stalled = [
        ("order:v1", "o-1"),
        ("order:v1", "o-2"),
        ("order:v1", "o-3"),
        ("void:v1", "v-1"),
        ("ghost:v1", "g-1"),
        ("ghost:v1", "g-2"),
    ];
    for (operation, key) in stalled {
        let started = idem
            .start::<BankError>(
                &scope(operation)?,
                &Key::new(key)?,
                &Request::new(json!({})),
            )
            .await;
        let Ok(Started::Run(mut run)) = started else {
            return Err(fail(format!(
                "{operation} {key}: expected a new run, got {started:?}"
            )));
        };
        if key == "o-2" {
            run.phase("held", |tx| K::debit(tx, 1, 10))
                .await
                .map_err(|e| fail(format!("phase: {e}")))?;
        }
        // The owner dies here: the run stalls once its lease ends.
    }
    let ghost = scope("ghost:v1")?;
    let mut before = Vec::new();
    for key in ["g-1", "g-2"] {
        before.push(row(idem.backend(), &ghost, &Key::new(key)?).await?);
    }
    tokio::time::sleep(LEASE + Duration::from_millis(300)).await;

    let (mut one, mut two) = (completion::<K>()?, completion::<K>()?);
    let (a, b) = tokio::join!(one.pass(&idem), two.pass(&idem));
    let (a, b) = (a?, b?);
    let total = |op: &str, f: fn(&idem::core::OperationReport) -> u64| {
        a.operations.get(op).map_or(0, f) + b.operations.get(op).map_or(0, f)
    };
    for r in [&a, &b] {
        for (op, report) in &r.operations {
            if !report.errors.is_empty() || report.left > 0 {
                return Err(fail(format!(
                    "{op}: left {}: {:?}",
                    report.left, report.errors
                )));
            }
        }
        if r.unhandled.get("ghost:v1") != Some(&2) {
            return Err(fail(format!("ghost:v1 not reported as unhandled: {r:?}")));
        }
    }
    if total("order:v1", |r| r.succeeded) != 3 || total("void:v1", |r| r.failed) != 1 {
        return Err(fail(format!("each known run must end once: {a:?} {b:?}")));
    }
    let debited = 1000 - bank.balance(1).await?;
    if debited != 30 {
        return Err(fail(format!(
            "three orders debit 30 once each, not {debited}"
        )));
    }
    for (key, was) in ["g-1", "g-2"].iter().zip(&before) {
        let now = row(idem.backend(), &ghost, &Key::new(*key)?).await?;
        if (&now.owner, now.fence, &now.point, now.status.is_some())
            != (&was.owner, was.fence, &was.point, false)
            || !now.lease_over
        {
            return Err(fail(format!("ghost {key} was touched: {was:?} → {now:?}")));
        }
    }
    // The client's retries: known runs replay their answer; the ghost run resumes.
    for key in ["o-1", "o-2", "o-3"] {
        let out = idem
            .execute_phased::<Value, BankError, _>(
                &scope("order:v1")?,
                &Key::new(key)?,
                &Request::new(json!({})),
                order_step::<K>(),
            )
            .await;
        if !matches!(out, Ok(Outcome::Replayed(_))) {
            return Err(fail(format!("retry of {key}: {out:?}")));
        }
    }
    let resumed = idem
        .start::<BankError>(&ghost, &Key::new("g-1")?, &Request::new(json!({})))
        .await;
    match resumed {
        Ok(Started::Run(run)) if run.resumed() && run.fence() == before[0].fence + 1 => {}
        other => return Err(fail(format!("a client's retry of g-1: {other:?}"))),
    }
    Ok(vec![(
        "two completion passes at once",
        format!(
            "order:v1 3 succeeded ({} + {}), void:v1 1 failed, ghost:v1 2 reported and untouched",
            a.operations.get("order:v1").map_or(0, |r| r.succeeded),
            b.operations.get("order:v1").map_or(0, |r| r.succeeded),
        ),
    )])
}
