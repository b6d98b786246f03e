//! The statements behind phased runs and the outbox, called directly through the
//! engine's [`RunStore`] and [`OutboxStore`] (what every engine's crate tested on its own
//! before): compare-and-set writes, lease-only renewals, the completer's list, purges,
//! and the bounded wait of a start.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::core::runs::{NewRun, OutboxFilter, OutboxState, RunGuard, RunWrite, STARTED};
use idem::core::{
    Error, Idem, Key, Maintenance, Operation, OutboxStore, Outgoing, Principal, Request, RunStore,
    Scope, Status, Table,
};
use serde_json::json;

use crate::bank::{Bank, BankError};
use crate::cases::{CaseResult, Failure};

const HOUR: Duration = Duration::from_secs(3600);

fn fail(msg: impl Into<String>) -> Failure {
    msg.into().into()
}

fn expect_eq<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), Failure> {
    if got == want {
        Ok(())
    } else {
        Err(fail(format!("{what}: expected {want:?}, got {got:?}")))
    }
}

fn scope() -> Result<Scope, Failure> {
    Ok(Scope::new(
        Principal::new("user-7")?,
        Operation::new("charge", 1)?,
    ))
}

fn new_run(owner: &str, lease: Duration, retention: Duration) -> NewRun<'_> {
    NewRun {
        request: r#"{"amount":5}"#,
        owner,
        fence: 0,
        point: STARTED,
        lease,
        retention,
    }
}

fn write<'a>(owner: &'a str, fence: i64, point: &'a str, lease: Duration) -> RunWrite<'a> {
    RunWrite {
        owner,
        fence,
        point,
        state: Some(r#"{"order":1}"#),
        status: None,
        response: None,
        lease,
    }
}

fn guard<'a>(owner: &'a str, fence: i64, point: &'a str) -> RunGuard<'a> {
    RunGuard {
        owner,
        fence,
        point,
    }
}

/// Inserts and commits a run.
async fn committed_run<B: RunStore>(
    b: &B,
    key: &str,
    owner: &str,
    lease: Duration,
    retention: Duration,
) -> Result<(), Failure> {
    let mut tx = b.begin_runs(None).await?;
    let inserted = b
        .insert_run(
            &mut tx,
            &scope()?,
            &Key::new(key)?,
            &new_run(owner, lease, retention),
        )
        .await;
    match inserted {
        Ok(true) => Ok(b.commit_runs(tx).await?),
        other => {
            let _ = b.rollback_runs(tx).await;
            Err(fail(format!("inserting run {key}: {other:?}")))
        }
    }
}

/// Runs `f` in a run transaction, committed when it succeeds.
macro_rules! in_tx {
    ($b:expr, |$tx:ident| $body:expr) => {{
        let mut $tx = $b.begin_runs(None).await?;
        let out: Result<_, Failure> = async { $body }.await;
        match out {
            Ok(v) => {
                $b.commit_runs($tx).await?;
                v
            }
            Err(e) => {
                let _ = $b.rollback_runs($tx).await;
                return Err(e);
            }
        }
    }};
}

/// A run is inserted once; its row reads back as written, its lease and expiry judged by
/// the database clock; every write is a compare-and-set on owner, fence and point (and
/// no final answer), a lease renewal touches the lease alone, and a delete is guarded
/// by the owner.
pub async fn run_rows_are_compare_and_set_by_owner_fence_and_point<K: Bank>(
    bank: Arc<K>,
) -> CaseResult {
    let b = bank.backend();
    let s = scope()?;
    let k = Key::new("k-1")?;
    committed_run(b, "k-1", "owner-a", HOUR, HOUR).await?;
    let row = in_tx!(b, |tx| {
        let again = b
            .insert_run(&mut tx, &s, &k, &new_run("owner-b", HOUR, HOUR))
            .await?;
        expect_eq("a second insert of the identity", again, false)?;
        // The transaction goes on after the conflict.
        let row = b
            .read_run(&mut tx, &s, &k)
            .await?
            .ok_or_else(|| fail("the run's row"))?;
        let missing = b.read_run(&mut tx, &s, &Key::new("missing")?).await?;
        expect_eq("a missing run", missing.is_none(), true)?;
        Ok(row)
    });
    expect_eq("owner", row.owner.as_str(), "owner-a")?;
    expect_eq("request", row.request.as_str(), r#"{"amount":5}"#)?;
    expect_eq(
        "fence and point",
        (row.fence, row.point.as_str()),
        (0, STARTED),
    )?;
    expect_eq(
        "state, status, response",
        (row.state.clone(), row.status, row.response.clone()),
        (None, None, None),
    )?;
    expect_eq(
        "lease over, expired",
        (row.lease_over, row.expired),
        (false, false),
    )?;

    // The lease and the expiry, by the database clock.
    committed_run(b, "lease-ended", "o", Duration::ZERO, HOUR).await?;
    committed_run(b, "expired", "o", HOUR, Duration::ZERO).await?;
    let flags = in_tx!(b, |tx| {
        let mut flags = Vec::new();
        for key in ["lease-ended", "expired"] {
            let row = b
                .read_run(&mut tx, &s, &Key::new(key)?)
                .await?
                .ok_or_else(|| fail(key))?;
            flags.push((row.lease_over, row.expired));
        }
        Ok(flags)
    });
    expect_eq(
        "(lease over, expired)",
        flags,
        vec![(true, false), (false, true)],
    )?;

    // Refused: a stale owner, a wrong fence, a wrong point; a delete by a stale owner.
    in_tx!(b, |tx| {
        for (what, g) in [
            ("a stale owner", guard("owner-x", 0, STARTED)),
            ("a wrong fence", guard("owner-a", 1, STARTED)),
            (
                "a point the writer does not know",
                guard("owner-a", 0, "p0"),
            ),
        ] {
            let w = write("owner-a", 0, "p1", HOUR);
            expect_eq(what, b.write_run(&mut tx, &s, &k, &g, &w).await?, false)?;
        }
        expect_eq(
            "a stale owner's lease",
            b.renew_lease(&mut tx, &s, &k, "owner-x", 0, HOUR).await?,
            false,
        )?;
        expect_eq(
            "a stale fence's lease",
            b.renew_lease(&mut tx, &s, &k, "owner-a", 1, HOUR).await?,
            false,
        )?;
        expect_eq(
            "a stale owner's delete",
            b.delete_run(&mut tx, &s, &k, "owner-x").await?,
            false,
        )?;
        let same = b.read_run(&mut tx, &s, &k).await?;
        expect_eq("the row after refused writes", same.as_ref(), Some(&row))?;
        Ok(())
    });

    // The owner's writes: a phase, the same point again (a batch loop), a lease-only
    // release, a takeover, and the final answer.
    let row = in_tx!(b, |tx| {
        let w = write("owner-a", 0, "p1", HOUR);
        expect_eq(
            "the owner's phase",
            b.write_run(&mut tx, &s, &k, &guard("owner-a", 0, STARTED), &w)
                .await?,
            true,
        )?;
        for _ in 0..2 {
            expect_eq(
                "the same point again",
                b.write_run(&mut tx, &s, &k, &guard("owner-a", 0, "p1"), &w)
                    .await?,
                true,
            )?;
        }
        expect_eq(
            "a release (lease only)",
            b.renew_lease(&mut tx, &s, &k, "owner-a", 0, Duration::ZERO)
                .await?,
            true,
        )?;
        b.read_run(&mut tx, &s, &k)
            .await?
            .ok_or_else(|| fail("the run's row"))
    });
    expect_eq(
        "after the phase and the release",
        (
            row.point.as_str(),
            row.state.as_deref(),
            row.lease_over,
            row.fence,
        ),
        ("p1", Some(r#"{"order":1}"#), true, 0),
    )?;
    let row = in_tx!(b, |tx| {
        let takeover = write("owner-b", 1, "p1", HOUR);
        expect_eq(
            "a takeover",
            b.write_run(&mut tx, &s, &k, &guard("owner-a", 0, "p1"), &takeover)
                .await?,
            true,
        )?;
        let late = write("owner-a", 0, "p2", HOUR);
        expect_eq(
            "the earlier owner after the takeover",
            b.write_run(&mut tx, &s, &k, &guard("owner-a", 0, "p1"), &late)
                .await?,
            false,
        )?;
        expect_eq(
            "the new owner's heartbeat",
            b.renew_lease(&mut tx, &s, &k, "owner-b", 1, HOUR).await?,
            true,
        )?;
        let finish = RunWrite {
            status: Some(Status::Rejected),
            response: Some(r#""declined""#),
            ..write("owner-b", 1, "p1", HOUR)
        };
        expect_eq(
            "the final answer",
            b.write_run(&mut tx, &s, &k, &guard("owner-b", 1, "p1"), &finish)
                .await?,
            true,
        )?;
        expect_eq(
            "a write after the final answer",
            b.write_run(&mut tx, &s, &k, &guard("owner-b", 1, "p1"), &finish)
                .await?,
            false,
        )?;
        expect_eq(
            "a lease after the final answer",
            b.renew_lease(&mut tx, &s, &k, "owner-b", 1, HOUR).await?,
            false,
        )?;
        b.read_run(&mut tx, &s, &k)
            .await?
            .ok_or_else(|| fail("the run's row"))
    });
    expect_eq(
        "the finished run",
        (
            row.owner.as_str(),
            row.fence,
            row.point.as_str(),
            row.status,
            row.response.as_deref(),
            row.state.as_deref(),
        ),
        (
            "owner-b",
            1,
            "p1",
            Some(Status::Rejected),
            Some(r#""declined""#),
            Some(r#"{"order":1}"#),
        ),
    )?;

    // An expired run is deleted by its owner and inserted again in one transaction, as
    // a start replaces it.
    in_tx!(b, |tx| {
        let key = Key::new("expired")?;
        expect_eq(
            "the expired run's delete",
            b.delete_run(&mut tx, &s, &key, "o").await?,
            true,
        )?;
        let mut again = new_run("o2", HOUR, HOUR);
        again.fence = 1;
        expect_eq(
            "its replacement",
            b.insert_run(&mut tx, &s, &key, &again).await?,
            true,
        )?;
        Ok(())
    });
    // A huge lease and retention are clamped, not an overflow.
    committed_run(b, "forever", "o", Duration::MAX, Duration::MAX).await?;
    Ok(vec![(
        "run rows",
        "insert once; CAS on owner, fence and point; lease-only renewals; guarded delete".into(),
    )])
}

/// The completer's list: unexpired runs without a final answer whose lease ended.
pub async fn stalled_runs_are_unfinished_unexpired_and_lease_over<K: Bank>(
    bank: Arc<K>,
) -> CaseResult {
    let b = bank.backend();
    let s = scope()?;
    committed_run(b, "live", "o1", HOUR, HOUR).await?;
    committed_run(b, "stalled", "o2", Duration::ZERO, HOUR).await?;
    committed_run(b, "expired", "o3", Duration::ZERO, Duration::ZERO).await?;
    committed_run(b, "finished", "o4", Duration::ZERO, HOUR).await?;
    in_tx!(b, |tx| {
        let finish = RunWrite {
            owner: "o4",
            fence: 0,
            point: STARTED,
            state: None,
            status: Some(Status::Succeeded),
            response: Some("1"),
            lease: Duration::ZERO,
        };
        let k = Key::new("finished")?;
        expect_eq(
            "finishing",
            b.write_run(&mut tx, &s, &k, &guard("o4", 0, STARTED), &finish)
                .await?,
            true,
        )?;
        Ok(())
    });
    let stalled = b.stalled_runs(10).await?;
    let listed: Vec<(&str, &str, &str, &str)> = stalled
        .iter()
        .map(|r| {
            (
                r.principal.as_str(),
                r.operation.as_str(),
                r.key.as_str(),
                r.point.as_str(),
            )
        })
        .collect();
    expect_eq(
        "stalled runs",
        listed,
        vec![("user-7", "charge:v1", "stalled", STARTED)],
    )?;
    Ok(vec![(
        "stalled runs",
        "only the unfinished, unexpired run whose lease ended".into(),
    )])
}

/// Purges delete expired runs and sent messages, in bounded batches; never a live or
/// stalled run, a pending message or a dead one.
pub async fn purge_keeps_live_runs_and_unsent_messages<K: Bank>(bank: Arc<K>) -> CaseResult {
    let b = bank.backend();
    let idem = Idem::new(b.clone());
    committed_run(b, "stalled", "o1", Duration::ZERO, HOUR).await?;
    committed_run(b, "expired", "o2", HOUR, Duration::ZERO).await?;
    in_tx!(b, |tx| {
        for (d, m) in [("a", "m1"), ("a", "m2"), ("b", "m3"), ("b", "dead")] {
            b.enqueue(&mut tx, &Outgoing::new(d, m, &json!({ "m": m }))?)
                .await?;
        }
        Ok(())
    });
    // Send m1 and m2; make "dead" dead.
    let recorder = crate::outbox_cases::Script::default();
    recorder.fail_always("dead");
    let options = idem::core::RelayOptions {
        max_attempts: 1,
        ..idem::core::RelayOptions::with_batch(2)
    };
    let report = idem.relay_with(&recorder, &options).await?;
    expect_eq("published (m1, m2 are the oldest)", report.published, 2)?;
    let report = idem.relay_with(&recorder, &options).await?;
    expect_eq("published (m3)", report.published, 1)?;
    expect_eq("dead", report.dead, 1)?;

    expect_eq(
        "sent messages younger than an hour",
        b.purge_batch(Table::Outbox, HOUR, 100).await?,
        0,
    )?;
    expect_eq(
        "runs started less than an hour ago",
        b.purge_batch(Table::Runs, HOUR, 100).await?,
        0,
    )?;
    expect_eq(
        "a batch of one",
        b.purge_batch(Table::Outbox, Duration::ZERO, 1).await?,
        1,
    )?;
    expect_eq(
        "the rest of the sent messages",
        b.purge_batch(Table::Outbox, Duration::ZERO, 100).await?,
        2,
    )?;
    expect_eq(
        "expired runs",
        b.purge_batch(Table::Runs, Duration::ZERO, 100).await?,
        1,
    )?;
    let left = idem
        .outbox_list(&OutboxFilter {
            state: OutboxState::Unsent,
            ..OutboxFilter::default()
        })
        .await?;
    let ids: Vec<(&str, bool)> = left
        .iter()
        .map(|e| (e.message_id.as_str(), e.dead))
        .collect();
    expect_eq("messages kept", ids, vec![("dead", true)])?;
    let stalled = b.stalled_runs(10).await?;
    expect_eq("runs kept", stalled.len(), 1)?;
    Ok(vec![(
        "purge",
        "expired runs and sent messages in batches; the stalled run and the dead message kept"
            .into(),
    )])
}

/// A start whose wait bound runs out on the run's row, held by another transaction,
/// answers InProgress (a short probe found the row held); the bound is never exceeded
/// by much. On SQLite, which has no row locks, the held write lock is something else:
/// LockWait.
pub async fn a_start_held_up_by_its_run_answers_in_progress<K: Bank>(bank: Arc<K>) -> CaseResult {
    if !bank.capabilities().concurrent_sessions {
        return Ok(vec![(
            "held run",
            "not observable: one connection (in-memory database)".into(),
        )]);
    }
    let b = bank.backend();
    let s = scope()?;
    let k = Key::new("held")?;
    committed_run(b, "held", "o1", Duration::ZERO, HOUR).await?;
    let idem = Idem::new(b.clone()).with_wait_timeout(Duration::from_millis(300));
    let mut holder = b.begin_runs(None).await?;
    let held = b.read_run(&mut holder, &s, &k).await;
    let began = Instant::now();
    let started = tokio::time::timeout(
        crate::lost_reply::HANG_GUARD,
        idem.start::<BankError>(&s, &k, &Request::new(json!({ "amount": 5 }))),
    )
    .await;
    let _ = b.rollback_runs(holder).await;
    held?.ok_or_else(|| fail("the held run"))?;
    let started = started.map_err(|_| fail("the start's wait is bounded"))?;
    let waited = began.elapsed();
    let want_row_locks = K::SKIP_LOCKED;
    match (started, want_row_locks) {
        (Err(Error::InProgress { .. }), true) | (Err(Error::LockWait { .. }), false) => {}
        (other, _) => {
            return Err(fail(format!(
                "a start held up by a transaction holding its run: got {other:?}"
            )));
        }
    }
    // Once the holder is gone, the start takes the run over.
    match idem
        .start::<BankError>(&s, &k, &Request::new(json!({ "amount": 5 })))
        .await
    {
        Ok(idem::core::Started::Run(run)) => expect_eq("taken over", run.resumed(), true)?,
        other => return Err(fail(format!("after the holder: got {other:?}"))),
    }
    Ok(vec![(
        "held run",
        format!(
            "{} after {} ms (bound 300 ms)",
            if want_row_locks {
                "InProgress"
            } else {
                "LockWait (no row locks: the write lock)"
            },
            waited.as_millis()
        ),
    )])
}
