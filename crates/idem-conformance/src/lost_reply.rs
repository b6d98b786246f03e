//! "The COMMIT succeeded and the reply was lost": a backend wrapper that lets a chosen
//! commit happen and then reports a lost connection, and the conformance case that runs
//! every path that commits through it.
//!
//! The wrapper is [`LostReply`]: it delegates everything to the engine's backend and
//! counts the commits it passes on (`Backend::finish` with `Finish::Commit`, and
//! `RunStore::commit_runs`). Armed with [`LostReply::lose_commit`], the chosen commit is
//! sent to the server and committed there, and the caller then gets an error of kind
//! [`ErrorKind::Connection`], exactly what a driver reports when the connection breaks
//! before the server's answer arrives.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxStats, RunGuard, RunProbe, RunRow, RunWrite,
    StalledRow,
};
use idem::core::{
    Backend, Claim, Claimed, DbError, ErrorKind, Finish, Key, Maintenance, OutboxStore, Outgoing,
    RunStore, Scope, Stored, Table,
};

/// Which commit loses its reply, and how many did.
#[derive(Debug, Default)]
struct Plan {
    /// Commits passed on so far.
    commits: AtomicU64,
    /// The commit number (as counted by `commits`, from 1) whose reply is lost; 0: none.
    lose_at: AtomicU64,
    /// Replies lost so far.
    lost: AtomicU64,
}

/// A backend whose chosen commit happens on the server while its caller sees a lost
/// connection.
#[derive(Debug, Clone)]
pub struct LostReply<B> {
    inner: B,
    plan: Arc<Plan>,
}

impl<B: Backend> LostReply<B> {
    /// Wraps `inner`; nothing is lost until [`LostReply::lose_commit`].
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            plan: Arc::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Arms the wrapper: the `nth` commit from now (1: the next one) commits on the server
    /// and then reports a lost connection. Replaces an earlier arming.
    pub fn lose_commit(&self, nth: u64) {
        let now = self.plan.commits.load(Ordering::SeqCst);
        self.plan.lose_at.store(now + nth.max(1), Ordering::SeqCst);
    }

    /// Disarms the wrapper.
    pub fn disarm(&self) {
        self.plan.lose_at.store(0, Ordering::SeqCst);
    }

    /// How many replies were lost so far.
    pub fn lost(&self) -> u64 {
        self.plan.lost.load(Ordering::SeqCst)
    }

    /// Called after a commit the server acknowledged: the error the caller sees instead,
    /// when this is the armed commit.
    fn after_commit(&self) -> Result<(), DbError> {
        let n = self.plan.commits.fetch_add(1, Ordering::SeqCst) + 1;
        if self
            .plan
            .lose_at
            .compare_exchange(n, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.plan.lost.fetch_add(1, Ordering::SeqCst);
            return Err(DbError::new(
                self.inner.engine(),
                ErrorKind::Connection,
                "the connection was lost before the server's answer to COMMIT arrived \
                 (injected: the commit happened)",
            ));
        }
        Ok(())
    }
}

impl<B: Backend> Backend for LostReply<B> {
    type Tx = B::Tx;

    async fn lookup(&self, claim: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        self.inner.lookup(claim).await
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Claimed<B::Tx>, DbError> {
        self.inner.claim(claim).await
    }

    async fn finish(&self, tx: B::Tx, claim: &Claim<'_>, end: Finish<'_>) -> Result<(), DbError> {
        let commit = matches!(end, Finish::Commit { .. });
        self.inner.finish(tx, claim, end).await?;
        if commit {
            self.after_commit()?;
        }
        Ok(())
    }

    fn engine(&self) -> &'static str {
        self.inner.engine()
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
        self.inner.classify(error)
    }
}

impl<B: Maintenance> Maintenance for LostReply<B> {
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        self.inner.migrate().await
    }

    async fn purge_batch(
        &self,
        table: Table,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, DbError> {
        self.inner.purge_batch(table, older_than, limit).await
    }
}

impl<B: RunStore> RunStore for LostReply<B> {
    async fn begin_runs(&self, wait: Option<Duration>) -> Result<B::Tx, DbError> {
        self.inner.begin_runs(wait).await
    }

    async fn commit_runs(&self, tx: B::Tx) -> Result<(), DbError> {
        self.inner.commit_runs(tx).await?;
        self.after_commit()
    }

    async fn rollback_runs(&self, tx: B::Tx) -> Result<(), DbError> {
        self.inner.rollback_runs(tx).await
    }

    async fn insert_run(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
        run: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        self.inner.insert_run(tx, scope, key, run).await
    }

    async fn read_run(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        self.inner.read_run(tx, scope, key).await
    }

    async fn write_run(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
        expected: &RunGuard<'_>,
        write: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        self.inner.write_run(tx, scope, key, expected, write).await
    }

    async fn renew_lease(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
        owner: &str,
        fence: i64,
        lease: Duration,
    ) -> Result<bool, DbError> {
        self.inner
            .renew_lease(tx, scope, key, owner, fence, lease)
            .await
    }

    async fn delete_run(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
        expected: &str,
    ) -> Result<bool, DbError> {
        self.inner.delete_run(tx, scope, key, expected).await
    }

    async fn probe_run(
        &self,
        tx: &mut B::Tx,
        scope: &Scope,
        key: &Key,
    ) -> Result<RunProbe, DbError> {
        self.inner.probe_run(tx, scope, key).await
    }

    async fn stalled_runs(&self, limit: u32) -> Result<Vec<StalledRow>, DbError> {
        self.inner.stalled_runs(limit).await
    }
}

impl<B: OutboxStore> OutboxStore for LostReply<B> {
    async fn enqueue(&self, tx: &mut B::Tx, message: &Outgoing) -> Result<(), DbError> {
        self.inner.enqueue(tx, message).await
    }

    async fn lock_due(&self, tx: &mut B::Tx, limit: u32) -> Result<Vec<DueRow>, DbError> {
        self.inner.lock_due(tx, limit).await
    }

    async fn pending_ids(
        &self,
        tx: &mut B::Tx,
        destination: &str,
        up_to: i64,
    ) -> Result<Vec<i64>, DbError> {
        self.inner.pending_ids(tx, destination, up_to).await
    }

    async fn claim_due(
        &self,
        tx: &mut B::Tx,
        ids: &[i64],
        token: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        self.inner.claim_due(tx, ids, token, lease).await
    }

    async fn release(&self, tx: &mut B::Tx, ids: &[i64], token: &str) -> Result<(), DbError> {
        self.inner.release(tx, ids, token).await
    }

    async fn mark_sent(&self, tx: &mut B::Tx, ids: &[i64], token: &str) -> Result<u64, DbError> {
        self.inner.mark_sent(tx, ids, token).await
    }

    async fn record_failure(
        &self,
        tx: &mut B::Tx,
        id: i64,
        token: &str,
        error: &str,
        retry_in: Option<Duration>,
    ) -> Result<bool, DbError> {
        self.inner
            .record_failure(tx, id, token, error, retry_in)
            .await
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        self.inner.outbox_stats().await
    }

    async fn list_outbox(&self, filter: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        self.inner.list_outbox(filter).await
    }

    async fn retry_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        self.inner.retry_outbox(ids, destination).await
    }

    async fn drop_outbox(&self, ids: &[i64], destination: Option<&str>) -> Result<u64, DbError> {
        self.inner.drop_outbox(ids, destination).await
    }
}

/// A guard against a hang, never a timing assertion.
pub(crate) const HANG_GUARD: Duration = Duration::from_secs(60);

/// Runs `call` until it stops answering "in progress" (the owner's lease is live), within
/// the hang guard.
pub(crate) async fn until_not_in_progress<T, E, F, Fut>(
    mut call: F,
) -> Result<T, idem::core::Error<E>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, idem::core::Error<E>>>,
{
    let began = Instant::now();
    loop {
        match call().await {
            Err(idem::core::Error::InProgress { .. }) if began.elapsed() < HANG_GUARD => {
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            other => return other,
        }
    }
}

// ---------------------------------------------------------------------------------------
// the case

use idem::core::{
    BoxFuture, Consumed, Error, Idem, MessageId, Operation, Outcome, Principal, Request, Run,
    Started, Subscriber,
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

/// The lease of the case's runs: a retry after a lost reply waits for it.
const LEASE: Duration = Duration::from_millis(600);

/// The recovery points of the case's operation, in order.
const POINTS: [&str; 3] = ["started", "held", "charged"];

fn ship_scope() -> Result<Scope, Failure> {
    Ok(Scope::new(
        Principal::new("lost-reply")?,
        Operation::new("ship", 1)?,
    ))
}

/// The final answer: the balances each phase left, so an effect applied twice shows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Shipped {
    charged: i64,
    done: i64,
}

/// Three accounts per scenario: `base + 1` is debited 100 by phase `held`, `base + 2`
/// credited 1 by phase `charged`, `base + 3` credited 1 by the final answer.
fn accounts(request: &Value) -> (i64, i64, i64) {
    let base = request["base"].as_i64().unwrap_or(0);
    (base + 1, base + 2, base + 3)
}

/// `started` → phase `held` (debit) → phase `charged` (credit) → finish (or, with
/// `"fail": true`, fail), each with a local effect on its own account.
#[allow(clippy::type_complexity)] // the step signature `execute_phased` takes
fn ship_step<K: Bank>()
-> impl for<'r> FnMut(&'r mut Run<LostReply<K::B>>) -> BoxFuture<'r, Result<(), Error<BankError>>> + Send
{
    move |run| {
        Box::pin(async move {
            let (a1, a2, a3) = accounts(run.request());
            let fails = run.request()["fail"].as_bool().unwrap_or(false);
            match run.point() {
                "started" => {
                    run.phase("held", move |tx| K::debit(tx, a1, 100)).await?;
                }
                "held" => {
                    run.phase("charged", move |tx| K::credit(tx, a2, 1)).await?;
                }
                _ => {
                    let charged: Balance = run
                        .state()
                        .map_err(Error::Decode)?
                        .ok_or_else(|| Error::Effect(BankError::NoAccount(a2)))?;
                    if fails {
                        run.fail(move |tx| {
                            Box::pin(async move {
                                let b = K::credit(tx, a3, 1).await?;
                                Ok::<_, BankError>(json!({ "declined": true, "done": b.balance }))
                            })
                        })
                        .await?;
                    } else {
                        run.finish(move |tx| {
                            Box::pin(async move {
                                let b = K::credit(tx, a3, 1).await?;
                                Ok::<_, BankError>(Shipped {
                                    charged: charged.balance,
                                    done: b.balance,
                                })
                            })
                        })
                        .await?;
                    }
                }
            }
            Ok(())
        })
    }
}

/// The run's committed recovery point (its index in [`POINTS`], 3 once it has its final
/// answer), read in a transaction of its own.
async fn committed_point<B: RunStore>(backend: &B, key: &Key) -> Result<usize, Failure> {
    let mut tx = backend.begin_runs(None).await?;
    let row = backend.read_run(&mut tx, &ship_scope()?, key).await;
    backend.rollback_runs(tx).await?;
    let row = row?.ok_or_else(|| fail("the run's row is gone"))?;
    if row.status.is_some() {
        return Ok(POINTS.len());
    }
    POINTS
        .iter()
        .position(|p| *p == row.point)
        .ok_or_else(|| fail(format!("unknown point {:?}", row.point)))
}

fn is_lost<T: std::fmt::Debug, E: std::fmt::Debug>(
    what: &str,
    r: &Result<T, Error<E>>,
) -> Result<(), Failure> {
    match r {
        Err(Error::Backend(e)) if e.kind() == ErrorKind::Connection => Ok(()),
        other => Err(fail(format!(
            "{what}: expected the lost connection, got {other:?}"
        ))),
    }
}

struct Scenario<'a, K: Bank> {
    bank: &'a K,
    idem: &'a Idem<LostReply<K::B>>,
    wrapper: &'a LostReply<K::B>,
    base: i64,
    scope: Scope,
    key: Key,
    request: Request,
}

impl<'a, K: Bank> Scenario<'a, K> {
    async fn new(
        bank: &'a K,
        idem: &'a Idem<LostReply<K::B>>,
        name: &str,
        base: i64,
        fails: bool,
    ) -> Result<Self, Failure> {
        bank.set_balance(base + 1, 1000).await?;
        bank.set_balance(base + 2, 0).await?;
        bank.set_balance(base + 3, 0).await?;
        Ok(Self {
            bank,
            idem,
            wrapper: idem.backend(),
            base,
            scope: ship_scope()?,
            key: Key::new(name)?,
            request: Request::new(json!({ "base": base, "fail": fails })),
        })
    }

    async fn execute(&self) -> Result<Outcome<Shipped>, Error<BankError>> {
        self.idem
            .execute_phased::<Shipped, BankError, _>(
                &self.scope,
                &self.key,
                &self.request,
                ship_step::<K>(),
            )
            .await
    }

    async fn point(&self) -> Result<usize, Failure> {
        committed_point(self.wrapper, &self.key).await
    }

    /// Every effect applied exactly once.
    async fn applied_once(&self) -> Result<(), Failure> {
        expect_eq(
            "debited once (phase held)",
            self.bank.balance(self.base + 1).await?,
            900,
        )?;
        expect_eq(
            "credited once (phase charged)",
            self.bank.balance(self.base + 2).await?,
            1,
        )?;
        expect_eq(
            "credited once (final answer)",
            self.bank.balance(self.base + 3).await?,
            1,
        )
    }

    /// Retries (waiting out a live lease) until the run answers, then once more: both
    /// answers must be equal; every effect applied once.
    async fn retried(&self) -> Result<Result<Shipped, Value>, Failure> {
        let first = until_not_in_progress(|| self.execute()).await;
        let again = self.execute().await;
        let answer = |r: Result<Outcome<Shipped>, Error<BankError>>| match r {
            Ok(o) => Ok(Ok(o.into_inner())),
            Err(Error::StoredRejection(v)) => Ok(Err(v)),
            Err(e) => Err(fail(format!("a retry failed: {e:?}"))),
        };
        let (first, again) = (answer(first)?, answer(again)?);
        expect_eq("the answer of every retry", &again, &first)?;
        self.applied_once().await?;
        Ok(first)
    }
}

/// "The COMMIT succeeded, the reply was lost", on every path that commits: the run never
/// moves back to an earlier recovery point, every effect is applied once, the retry
/// resumes after the lost commit and every answer is the same.
pub async fn lost_commit_replies_never_move_a_run_back<K: Bank>(bank: Arc<K>) -> CaseResult {
    let wrapper = LostReply::new(bank.backend().clone());
    let idem = Idem::new(wrapper.clone())
        .with_lease(LEASE)
        .with_wait_timeout(Duration::from_millis(100));
    let mut seen = Vec::new();

    // execute_phased: the start's commit (1), phase held (2), phase charged (3), the
    // final answer (4); with "fail": the stored failure (4).
    for (i, (what, nth, fails)) in [
        ("start", 1, false),
        ("phase", 2, false),
        ("second phase", 3, false),
        ("finish", 4, false),
        ("fail", 4, true),
    ]
    .into_iter()
    .enumerate()
    {
        let s = Scenario::new(
            &*bank,
            &idem,
            &format!("lost-{i}"),
            100 * (i as i64 + 1),
            fails,
        )
        .await?;
        wrapper.lose_commit(nth);
        let lost = s.execute().await;
        is_lost(what, &lost)?;
        // The lost commit happened: the run is at least where it put it, and no
        // release or heartbeat after it moved it back.
        let at = s.point().await?;
        expect_eq(
            &format!("{what}: the committed point after the lost reply"),
            at,
            nth as usize - 1,
        )?;
        let answer = s.retried().await?;
        expect_eq(
            &format!("{what}: the run's final point"),
            s.point().await?,
            3,
        )?;
        if fails != answer.is_err() {
            return Err(fail(format!("{what}: unexpected answer {answer:?}")));
        }
        seen.push(format!("{what}: point kept, resumed, effects once"));
    }

    // heartbeat: the lease may or may not be renewed; the point is untouched and the
    // handle goes on.
    {
        let s = Scenario::new(&*bank, &idem, "lost-heartbeat", 700, false).await?;
        let scope = ship_scope()?;
        let mut run = match idem.start::<BankError>(&scope, &s.key, &s.request).await {
            Ok(Started::Run(run)) => run,
            other => return Err(fail(format!("heartbeat: start: {other:?}"))),
        };
        let mut step = ship_step::<K>();
        step(&mut run)
            .await
            .map_err(|e| fail(format!("held: {e}")))?;
        wrapper.lose_commit(1);
        let hb = run.heartbeat::<BankError>().await;
        is_lost("heartbeat", &hb)?;
        expect_eq("heartbeat: point", s.point().await?, 1)?;
        let went_on = async {
            step(&mut run).await?;
            step(&mut run).await
        }
        .await;
        if let Err(e) = went_on {
            // Refusing to go on is allowed; the retry then resumes the run.
            seen.push(format!("heartbeat: the handle refused to go on ({e})"));
        } else {
            seen.push("heartbeat: the handle went on".into());
        }
        drop(run);
        let _answer = s.retried().await?;
    }

    // release: the lease may or may not have ended; the point is untouched.
    {
        let s = Scenario::new(&*bank, &idem, "lost-release", 800, false).await?;
        let scope = ship_scope()?;
        let mut run = match idem.start::<BankError>(&scope, &s.key, &s.request).await {
            Ok(Started::Run(run)) => run,
            other => return Err(fail(format!("release: start: {other:?}"))),
        };
        let mut step = ship_step::<K>();
        step(&mut run)
            .await
            .map_err(|e| fail(format!("held: {e}")))?;
        wrapper.lose_commit(1);
        if let Err(e) = run.release().await {
            if e.kind() != ErrorKind::Connection {
                return Err(fail(format!(
                    "release: expected a lost connection, got {e}"
                )));
            }
        } else if wrapper.lost() == 0 {
            return Err(fail("release: committed nothing"));
        }
        expect_eq("release: point", s.point().await?, 1)?;
        drop(run);
        let _answer = s.retried().await?;
        seen.push("release: point kept, resumed at held".into());
    }

    // complete: the takeover's commit (1), then the phase the completer commits (2).
    for (what, nth, base) in [("complete takeover", 1, 900), ("complete phase", 2, 1000)] {
        let s = Scenario::new(&*bank, &idem, &format!("lost-{base}"), base, false).await?;
        let scope = ship_scope()?;
        let mut run = match idem.start::<BankError>(&scope, &s.key, &s.request).await {
            Ok(Started::Run(run)) => run,
            other => return Err(fail(format!("{what}: start: {other:?}"))),
        };
        let mut step = ship_step::<K>();
        step(&mut run)
            .await
            .map_err(|e| fail(format!("held: {e}")))?;
        // The owner dies here; its lease runs out.
        drop(run);
        tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
        wrapper.lose_commit(nth);
        let report = idem.complete(10, ship_step::<K>()).await?;
        let entry = report
            .operations
            .get("ship:v1")
            .cloned()
            .unwrap_or_default();
        expect_eq(&format!("{what}: runs left by the pass"), entry.left, 1)?;
        expect_eq(&format!("{what}: lost replies"), wrapper.lost() > 0, true)?;
        expect_eq(
            &format!("{what}: point after the lost reply"),
            s.point().await?,
            nth as usize,
        )?;
        // Later passes (once the lease the lost commit set has ended) finish it.
        let began = Instant::now();
        loop {
            let r = idem.complete(10, ship_step::<K>()).await?;
            let done = r.operations.get("ship:v1").map_or(0, |e| e.succeeded);
            if done == 1 {
                break;
            }
            if began.elapsed() > HANG_GUARD {
                return Err(fail(format!("{what}: never completed: {r:?}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _answer = s.retried().await?;
        seen.push(format!("{what}: point kept, completed once"));
    }

    // execute, execute_final and consume: the record's commit.
    let plain = Idem::new(wrapper.clone());
    let debit_scope = Scope::new(Principal::new("lost-reply")?, Operation::new("debit", 1)?);
    bank.set_balance(1, 1000).await?;
    {
        let key = Key::new("lost-execute")?;
        let request = Request::new(json!({ "amount": 100 }));
        let call = || plain.execute(&debit_scope, &key, &request, |tx| K::debit(tx, 1, 100));
        wrapper.lose_commit(1);
        is_lost("execute", &call().await)?;
        match call().await {
            Ok(Outcome::Replayed(b)) => expect_eq("execute: the replay", b.balance, 900)?,
            other => return Err(fail(format!("execute: the retry: {other:?}"))),
        }
        expect_eq("execute: debited once", bank.balance(1).await?, 900)?;
        seen.push("execute: the retry replayed, debited once".to_owned());
    }
    {
        let key = Key::new("lost-execute-final")?;
        let request = Request::new(json!({ "amount": 101 }));
        let call = || {
            plain.execute_final(&debit_scope, &key, &request, |tx| {
                Box::pin(async move {
                    let b = K::debit(tx, 1, 101).await?;
                    Ok::<_, BankError>(Err::<Balance, Value>(json!({ "saw": b.balance })))
                })
            })
        };
        wrapper.lose_commit(1);
        is_lost("execute_final", &call().await)?;
        match call().await {
            Ok(Outcome::Replayed(Err(v))) => {
                expect_eq("execute_final: the replay", v, json!({ "saw": 799 }))?
            }
            other => return Err(fail(format!("execute_final: the retry: {other:?}"))),
        }
        // A stored rejection rolls its effect back.
        expect_eq(
            "execute_final: nothing debited",
            bank.balance(1).await?,
            900,
        )?;
        seen.push("execute_final: the retry replayed the stored rejection".to_owned());
    }
    let subscriber = Subscriber::new("lost-reply")?;
    let message = MessageId::new("00000000-0000-4000-8000-00000000c0de")?;
    let before = bank.balance(1).await?;
    let consume = || {
        plain.consume(&subscriber, &message, None, |tx| {
            Box::pin(async move { K::credit(tx, 1, 50).await.map(drop) })
        })
    };
    wrapper.lose_commit(1);
    is_lost("consume", &consume().await)?;
    match consume().await {
        Ok(Consumed::Duplicate) => {}
        other => return Err(fail(format!("consume: the redelivery: {other:?}"))),
    }
    expect_eq(
        "consume: credited once",
        bank.balance(1).await?,
        before + 50,
    )?;
    seen.push("consume: the redelivery is a duplicate, credited once".into());

    expect_eq("replies lost", wrapper.lost(), 12)?;
    Ok(vec![("lost commit replies (12 commits)", seen.join("; "))])
}
