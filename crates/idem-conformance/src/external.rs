//! The conformance cases of external effects: phased runs (leases, takeover, fencing,
//! recovery points), the completer, and the transactional outbox's skip-locked drain.
//!
//! The external system is [`Provider`]: an in-process payment provider that honours its
//! own idempotency key, like a real one. The engines are real.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::core::runs::OutboxRow;
use idem::core::{
    BoxFuture, Error, Idem, Key, OutboxStore, Outcome, Outgoing, Publisher, Request, Run, Started,
};
use serde_json::{Value, json};

use crate::bank::{Balance, Bank, BankError};
use crate::cases::{CaseResult, Failure};

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

fn order_scope() -> Result<idem::core::Scope, Failure> {
    Ok(idem::core::Scope::new(
        idem::core::Principal::new("account-1")?,
        idem::core::Operation::new("order", 1)?,
    ))
}

fn amount(n: i64) -> Request {
    Request::new(json!({ "amount": n }))
}

/// A payment provider that honours its own idempotency key: a repeated key returns the
/// first charge instead of charging again.
#[derive(Debug, Default, Clone)]
pub struct Provider {
    charges: Arc<Mutex<HashMap<String, String>>>,
    calls: Arc<Mutex<u64>>,
}

impl Provider {
    /// Charges once per idempotency key; returns the charge id.
    pub fn charge(&self, idempotency_key: &str) -> String {
        *self.calls.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let mut charges = self.charges.lock().unwrap_or_else(|e| e.into_inner());
        let n = charges.len();
        charges
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| format!("ch_{n}"))
            .clone()
    }

    /// Charges made.
    pub fn charges(&self) -> usize {
        self.charges.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Calls received.
    pub fn calls(&self) -> u64 {
        *self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }
}

const LEASE: Duration = Duration::from_millis(600);
/// A guard against a hang, never a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);

fn phased_idem<K: Bank>(bank: &K) -> Idem<K::B> {
    Idem::new(bank.backend().clone())
        .with_lease(LEASE)
        .with_wait_timeout(Duration::from_millis(100))
}

async fn start<K: Bank>(
    idem: &Idem<K::B>,
    key: &str,
    request: &Request,
) -> Result<Result<Started<K::B>, Error<BankError>>, Failure> {
    Ok(idem.start(&order_scope()?, &Key::new(key)?, request).await)
}

/// Starts until the run is ours (after the earlier owner's lease ran out).
async fn take_over<K: Bank>(
    idem: &Idem<K::B>,
    key: &str,
    request: &Request,
) -> Result<Run<K::B>, Failure> {
    let began = Instant::now();
    loop {
        match start::<K>(idem, key, request).await? {
            Ok(Started::Run(run)) => return Ok(run),
            Err(Error::InProgress { .. }) if began.elapsed() < HANG_GUARD => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return Err(fail(format!("taking over {key}: got {other:?}"))),
        }
    }
}

fn owned<B: idem::core::RunStore + std::fmt::Debug, E: std::fmt::Debug>(
    what: &str,
    started: Result<Started<B>, Error<E>>,
) -> Result<Run<B>, Failure> {
    match started {
        Ok(Started::Run(run)) => Ok(run),
        other => Err(fail(format!(
            "{what}: expected a run to own, got {other:?}"
        ))),
    }
}

/// The receipt a finished order run answers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    charge_id: String,
    balance: i64,
}

/// The order's step: `started` → debit (phase `held`) → charge at the provider → finish.
fn order_step<K: Bank>(
    provider: Provider,
) -> impl for<'r> FnMut(&'r mut Run<K::B>) -> BoxFuture<'r, Result<(), Error<BankError>>> + Send {
    move |run| {
        let provider = provider.clone();
        Box::pin(async move {
            match run.point() {
                "started" => {
                    let n = run.request()["amount"].as_i64().unwrap_or(0);
                    run.phase("held", move |tx| K::debit(tx, 1, n)).await?;
                }
                _ => {
                    let charge_id = provider.charge(&run.external_key("charge"));
                    let held: Balance = run
                        .state()
                        .map_err(Error::Decode)?
                        .ok_or_else(|| Error::Effect(BankError::NoAccount(1)))?;
                    run.finish(move |_tx| {
                        let receipt = Receipt {
                            charge_id: charge_id.clone(),
                            balance: held.balance,
                        };
                        Box::pin(async move { Ok::<_, BankError>(receipt) })
                    })
                    .await?;
                }
            }
            Ok(())
        })
    }
}

/// A run that lost its owner resumes at its last recovery point: the committed phase
/// is not repeated, the external call is repeated with the same idempotency key (one
/// charge), and the final answer replays.
pub async fn phased_run_resumes_at_its_recovery_point<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = phased_idem(&*bank);
    let provider = Provider::default();
    let request = amount(100);
    let mut first = owned("a new key", start::<K>(&idem, "order-1", &request).await?)?;
    expect_eq("a new run's point", first.point(), "started")?;
    expect_eq("a new run's fence", first.fence(), 0)?;
    first
        .phase("held", |tx| K::debit(tx, 1, 100))
        .await
        .map_err(|e| fail(format!("phase held: {e}")))?;
    let charge = provider.charge(&first.external_key("charge"));
    // The owner "crashes" here: after its phase and its provider call, before finishing.
    drop(first);
    match start::<K>(&idem, "order-1", &request).await? {
        Err(Error::InProgress { .. }) => {}
        other => {
            return Err(fail(format!(
                "a retry while the owner's lease is live: expected InProgress, got {other:?}"
            )));
        }
    }
    let mut run = take_over::<K>(&idem, "order-1", &request).await?;
    expect_eq("resumed", run.resumed(), true)?;
    expect_eq("resumed at", run.point(), "held")?;
    expect_eq("the taker's fence", run.fence(), 1)?;
    expect_eq(
        "the state committed with the point",
        run.state::<Balance>()?,
        Some(Balance { balance: 900 }),
    )?;
    let mut step = order_step::<K>(provider.clone());
    step(&mut run)
        .await
        .map_err(|e| fail(format!("finish: {e}")))?;
    expect_eq("provider calls", provider.calls(), 2)?;
    expect_eq("charges at the provider", provider.charges(), 1)?;
    let finished = run
        .finished()
        .ok_or_else(|| fail("the run has no final answer"))?
        .decode::<Receipt, Value>()?;
    expect_eq(
        "final answer",
        finished,
        Ok(Receipt {
            charge_id: charge.clone(),
            balance: 900,
        }),
    )?;
    let replay = idem
        .execute_phased::<Receipt, BankError, _>(
            &order_scope()?,
            &Key::new("order-1")?,
            &request,
            order_step::<K>(provider.clone()),
        )
        .await;
    match replay {
        Ok(Outcome::Replayed(r)) => expect_eq("replayed charge", r.charge_id, charge)?,
        other => return Err(fail(format!("a retry after finish: got {other:?}"))),
    }
    expect_eq("balance (the phase ran once)", bank.balance(1).await?, 900)?;
    expect_eq("charges after the replay", provider.charges(), 1)?;
    Ok(vec![(
        "owner lost after phase + provider call",
        "retry in lease: InProgress; after: resumed at 'held', fence 1, 1 debit, 1 charge, replay equal".into(),
    )])
}

/// Once a retry took the run over, the earlier owner's phases, answer and heartbeats
/// are refused and rolled back (fencing), never silently applied.
pub async fn stale_owner_is_fenced<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = phased_idem(&*bank);
    let request = amount(100);
    let mut stale = owned("a new key", start::<K>(&idem, "order-2", &request).await?)?;
    stale
        .phase("held", |tx| K::debit(tx, 1, 100))
        .await
        .map_err(|e| fail(format!("phase held: {e}")))?;
    let mut taker = take_over::<K>(&idem, "order-2", &request).await?;
    expect_eq("the taker's fence", taker.fence(), stale.fence() + 1)?;
    match stale.phase("charged", |tx| K::debit(tx, 1, 50)).await {
        Err(Error::LeaseLost { fence: 0 }) => {}
        other => return Err(fail(format!("the stale owner's phase: got {other:?}"))),
    }
    expect_eq(
        "balance after the refused phase",
        bank.balance(1).await?,
        900,
    )?;
    match stale.heartbeat::<BankError>().await {
        Err(Error::LeaseLost { .. }) => {}
        other => return Err(fail(format!("the stale owner's heartbeat: got {other:?}"))),
    }
    match stale.finish(|tx| K::debit(tx, 1, 1)).await {
        Err(Error::LeaseLost { .. }) => {}
        other => return Err(fail(format!("the stale owner's finish: got {other:?}"))),
    }
    stale
        .release()
        .await
        .map_err(|e| fail(format!("a stale release must be harmless: {e}")))?;
    taker
        .finish(|tx| K::debit(tx, 1, 50))
        .await
        .map_err(|e| fail(format!("the taker's finish: {e}")))?;
    match start::<K>(&idem, "order-2", &request).await? {
        Ok(Started::Finished(f)) => expect_eq(
            "stored answer",
            f.decode::<Balance, Value>()?,
            Ok(Balance { balance: 850 }),
        )?,
        other => return Err(fail(format!("a retry after finish: got {other:?}"))),
    }
    expect_eq("balance", bank.balance(1).await?, 850)?;
    Ok(vec![(
        "stale owner after a takeover",
        "phase, heartbeat and finish refused (LeaseLost), its writes rolled back".into(),
    )])
}

/// A live lease answers InProgress; a heartbeat extends it; a release hands the run
/// over at once; a different request is refused; a final failure is stored and replays.
pub async fn lease_heartbeat_release_and_final_failure<K: Bank>(bank: Arc<K>) -> CaseResult {
    const LONG: Duration = Duration::from_secs(2);
    bank.set_balance(1, 1000).await?;
    let idem = phased_idem(&*bank).with_lease(LONG);
    let request = amount(100);
    let mut run = owned("a new key", start::<K>(&idem, "order-3", &request).await?)?;
    tokio::time::sleep(LONG * 3 / 5).await;
    run.heartbeat::<BankError>()
        .await
        .map_err(|e| fail(format!("heartbeat: {e}")))?;
    tokio::time::sleep(LONG * 3 / 5).await;
    // 1.2 lease lengths after the start, 0.6 after the heartbeat: still owned.
    match start::<K>(&idem, "order-3", &request).await? {
        Err(Error::InProgress { .. }) => {}
        other => {
            return Err(fail(format!(
                "a retry within a renewed lease: expected InProgress, got {other:?}"
            )));
        }
    }
    match start::<K>(&idem, "order-3", &amount(101)).await? {
        Err(Error::KeyReused { .. }) => {}
        other => return Err(fail(format!("a different request: got {other:?}"))),
    }
    run.release()
        .await
        .map_err(|e| fail(format!("release: {e}")))?;
    let mut next = owned(
        "a retry after a release",
        start::<K>(&idem, "order-3", &request).await?,
    )?;
    expect_eq("resumed after release", next.resumed(), true)?;
    next.fail(|_tx| {
        Box::pin(async { Ok::<_, BankError>(json!({"status": "failed", "reason": "declined"})) })
    })
    .await
    .map_err(|e| fail(format!("fail: {e}")))?;
    let replay = idem
        .execute_phased::<Value, BankError, _>(
            &order_scope()?,
            &Key::new("order-3")?,
            &request,
            order_step::<K>(Provider::default()),
        )
        .await;
    match replay {
        Err(Error::StoredRejection(v)) => {
            expect_eq("stored failure", v["reason"].clone(), json!("declined"))?
        }
        other => {
            return Err(fail(format!(
                "a retry after a final failure: got {other:?}"
            )));
        }
    }
    expect_eq("balance", bank.balance(1).await?, 1000)?;
    Ok(vec![(
        "lease",
        "live: InProgress; heartbeat renews; release hands over at once; failure replays".into(),
    )])
}

/// The completer drives every stalled run to its end exactly once, even with two
/// completers at once.
pub async fn completer_finishes_stalled_runs<K: Bank>(bank: Arc<K>) -> CaseResult {
    const RUNS: usize = 6;
    bank.set_balance(1, 1000).await?;
    let idem = phased_idem(&*bank);
    let provider = Provider::default();
    for i in 0..RUNS {
        let mut run = owned(
            "a new key",
            start::<K>(&idem, &format!("stalled-{i}"), &amount(10)).await?,
        )?;
        if i % 3 != 0 {
            run.phase("held", |tx| K::debit(tx, 1, 10))
                .await
                .map_err(|e| fail(format!("phase: {e}")))?;
        }
        // Crash: the run stays at its point until its lease ends.
    }
    tokio::time::sleep(LEASE + Duration::from_millis(300)).await;
    let (a, b) = tokio::join!(
        idem.complete(100, order_step::<K>(provider.clone())),
        idem.complete(100, order_step::<K>(provider.clone())),
    );
    let (a, b) = (a?, b?);
    let op = "order:v1";
    let succeeded = a.operations.get(op).map_or(0, |r| r.succeeded)
        + b.operations.get(op).map_or(0, |r| r.succeeded);
    for r in [&a, &b] {
        if let Some(report) = r.operations.get(op)
            && !report.errors.is_empty()
        {
            return Err(fail(format!("completer errors: {:?}", report.errors)));
        }
    }
    expect_eq("runs completed", succeeded, RUNS as u64)?;
    expect_eq("charges", provider.charges(), RUNS)?;
    expect_eq("balance", bank.balance(1).await?, 1000 - 10 * RUNS as i64)?;
    let again = idem
        .complete(100, order_step::<K>(provider.clone()))
        .await?;
    expect_eq("stalled runs after completion", again.found, 0)?;
    for i in 0..RUNS {
        let out = idem
            .execute_phased::<Receipt, BankError, _>(
                &order_scope()?,
                &Key::new(format!("stalled-{i}"))?,
                &amount(10),
                order_step::<K>(provider.clone()),
            )
            .await;
        if !matches!(out, Ok(Outcome::Replayed(_))) {
            return Err(fail(format!("client retry of stalled-{i}: got {out:?}")));
        }
    }
    Ok(vec![(
        "6 stalled runs, two completers at once",
        format!(
            "each completed once ({} + {}), 6 charges, replays after",
            a.operations.get(op).map_or(0, |r| r.succeeded),
            b.operations.get(op).map_or(0, |r| r.succeeded)
        ),
    )])
}

/// Three batches at the same point and state (a debit each), then the answer.
fn batch_step<K: Bank>(
    rounds: Arc<Mutex<u32>>,
) -> impl for<'r> FnMut(&'r mut Run<K::B>) -> BoxFuture<'r, Result<(), Error<BankError>>> + Send {
    move |run| {
        let rounds = Arc::clone(&rounds);
        Box::pin(async move {
            let n = {
                let mut n = rounds.lock().unwrap_or_else(|e| e.into_inner());
                *n += 1;
                *n
            };
            if n <= 3 {
                run.phase("batch", |tx| {
                    Box::pin(async move {
                        K::debit(tx, 1, 10).await?;
                        Ok::<_, BankError>(json!({ "cursor": "same" }))
                    })
                })
                .await?;
            } else {
                run.finish(|_tx| Box::pin(async { Ok::<_, BankError>(json!({ "done": true })) }))
                    .await?;
            }
            Ok(())
        })
    }
}

/// A step that commits nothing.
fn idle_step<B: idem::core::RunStore>(
    _run: &mut Run<B>,
) -> BoxFuture<'_, Result<(), Error<BankError>>> {
    Box::pin(async { Ok(()) })
}

/// A step that commits the same recovery point and state again (a batch loop) is
/// progress, not a stall; a step that commits nothing is refused. A retention shorter
/// than the lease is refused before any SQL.
pub async fn phased_steps_may_repeat_a_point<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = phased_idem(&*bank);
    let batch = batch_step::<K>(Arc::new(Mutex::new(0u32)));
    let out = idem
        .execute_phased::<Value, BankError, _>(
            &order_scope()?,
            &Key::new("batch-1")?,
            &amount(10),
            batch,
        )
        .await;
    match out {
        Ok(Outcome::Executed(v)) => expect_eq("answer", v, json!({ "done": true }))?,
        other => return Err(fail(format!("a batch loop: got {other:?}"))),
    }
    expect_eq("three batches", bank.balance(1).await?, 970)?;
    // A step that commits nothing is still refused.
    let idle = idem
        .execute_phased::<Value, BankError, _>(
            &order_scope()?,
            &Key::new("idle-1")?,
            &amount(10),
            idle_step::<K::B>,
        )
        .await;
    if !matches!(idle, Err(Error::InvalidInput(_))) {
        return Err(fail(format!("a step that commits nothing: got {idle:?}")));
    }
    // A retention shorter than the lease is refused before any SQL.
    let short = idem::core::Scope::new(
        idem::core::Principal::new("account-1")?,
        idem::core::Operation::new("order", 1)?.with_retention(Duration::from_millis(1500)),
    );
    let long_lease = phased_idem(&*bank).with_lease(Duration::from_secs(2));
    match long_lease
        .start::<BankError>(&short, &Key::new("short-1")?, &amount(10))
        .await
    {
        Err(Error::InvalidInput(e)) if e.what() == "operation retention" => {}
        other => {
            return Err(fail(format!(
                "a retention shorter than the lease: got {other:?}"
            )));
        }
    }
    Ok(vec![(
        "phased steps",
        "the same point and state committed 3 times: progress; nothing committed: refused; \
         retention 1.5 s under a 2 s lease: refused"
            .into(),
    )])
}

/// "I started publishing" and "go on".
type Hold = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

/// Records what it publishes; optionally holds its first publish until released.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<(String, String)>>>,
    hold: Arc<tokio::sync::Mutex<Option<Hold>>>,
}

impl Publisher for Recorder {
    type Error = std::io::Error;

    async fn publish(&self, message: &OutboxRow) -> Result<(), std::io::Error> {
        let hold = self.hold.lock().await.take();
        if let Some((started, release)) = hold {
            let _ = started.send(());
            let _ = tokio::time::timeout(HANG_GUARD, release).await;
        }
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((message.destination.clone(), message.message_id.clone()));
        Ok(())
    }
}

/// Messages enqueued in effects are published once each, in order per destination, by
/// relays sharing the outbox: a relay skips the rows another holds and defers a
/// destination whose older message the other holds. A rolled-back effect's message is
/// never published.
pub async fn outbox_drains_in_order_skipping_locked<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = Idem::new(bank.backend().clone());
    let scope = idem::core::Scope::new(
        idem::core::Principal::new("account-1")?,
        idem::core::Operation::new("debit", 1)?,
    );
    let plan = [
        ("a", "a1"),
        ("a", "a2"),
        ("b", "b1"),
        ("a", "a3"),
        ("b", "b2"),
        ("b", "b3"),
    ];
    for (i, (destination, id)) in plan.iter().enumerate() {
        let message = Outgoing::new(destination, id, &json!({ "i": i }))?;
        let backend = bank.backend().clone();
        idem.execute(
            &scope,
            &Key::new(format!("m-{i}"))?,
            &amount(1),
            move |tx| {
                let (backend, message) = (backend.clone(), message.clone());
                Box::pin(async move {
                    let b = K::debit(tx, 1, 1).await?;
                    backend.enqueue(tx, &message).await?;
                    Ok::<_, BankError>(b)
                })
            },
        )
        .await
        .map_err(|e| fail(format!("enqueue {id}: {e}")))?;
    }
    // An effect that enqueues and then fails: its message must never be published.
    let ghost = Outgoing::new("a", "ghost", &json!({}))?;
    let backend = bank.backend().clone();
    let failed = idem
        .execute(&scope, &Key::new("m-ghost")?, &amount(1), move |tx| {
            let (backend, ghost) = (backend.clone(), ghost.clone());
            Box::pin(async move {
                backend.enqueue(tx, &ghost).await?;
                Err::<Balance, _>(BankError::Insufficient)
            })
        })
        .await;
    if !matches!(failed, Err(Error::Effect(BankError::Insufficient))) {
        return Err(fail(format!("the failing effect: got {failed:?}")));
    }
    let recorder = Recorder::default();
    let mut observation = String::new();
    // The first relay claims a1 and a2 (limit 2) and is held while publishing a1: it
    // holds no transaction then, only its claim.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel();
    *recorder.hold.lock().await = Some((started_tx, release_rx));
    let holder = {
        let (idem, recorder) = (idem.clone(), recorder.clone());
        tokio::spawn(async move { idem.relay(&recorder, 2).await })
    };
    tokio::time::timeout(HANG_GUARD, started_rx)
        .await
        .map_err(|_| fail("the first relay never published"))?
        .map_err(|_| fail("the first relay ended early"))?;
    // The second relay never waits for the first: it publishes b1-b3, and leaves a3
    // behind a1 and a2 (claimed by the first).
    let other = tokio::time::timeout(HANG_GUARD, idem.relay(&recorder, 10))
        .await
        .map_err(|_| fail("the second relay waited for the first"))??;
    expect_eq("second relay published (b1, b2, b3)", other.published, 3)?;
    let _ = release_tx.send(());
    let first = tokio::time::timeout(HANG_GUARD, holder)
        .await
        .map_err(|_| fail("the first relay hung"))?
        .map_err(|e| fail(format!("task: {e}")))??;
    expect_eq("first relay published (a1, a2)", first.published, 2)?;
    observation.push_str("a relay publishing a1,a2: the other published b1-b3, left a3; ");
    idem.relay(&recorder, 10).await?;
    let again = idem.relay(&recorder, 10).await?;
    let seen = recorder
        .seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let per = |d: &str| -> Vec<String> {
        seen.iter()
            .filter(|(dest, _)| dest == d)
            .map(|(_, id)| id.clone())
            .collect()
    };
    expect_eq(
        "published in order for a",
        per("a"),
        vec!["a1".into(), "a2".into(), "a3".into()],
    )?;
    expect_eq(
        "published in order for b",
        per("b"),
        vec!["b1".into(), "b2".into(), "b3".into()],
    )?;
    expect_eq("messages published", seen.len(), 6)?;
    expect_eq("a pass with nothing left", again.published, 0)?;
    observation.push_str(
        "each of 6 published once, in order per destination; the rolled-back message never",
    );
    Ok(vec![("outbox drain", observation)])
}
