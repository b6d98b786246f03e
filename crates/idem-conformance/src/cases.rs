//! The conformance cases: plain async functions every engine runs.
//!
//! Each case gets a fresh, migrated fixture (its own namespace), asserts the protocol's
//! promises, and returns observations of how the engine kept them.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::core::{
    Backend, Claim, Consumed, DbError, Error, ErrorKind, Idem, Identity, Key, MessageId, Operation,
    Outcome, Principal, Request, Scope, Subscriber,
};
use serde_json::{Value, json};

use crate::bank::{Balance, Bank, BankError};
use crate::external;

/// A case's failure: what was expected and what happened.
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

/// What a case saw, as `(what, how)` pairs for the report.
pub type Observations = Vec<(&'static str, String)>;

/// A case's result.
pub type CaseResult = Result<Observations, Failure>;

/// What a case's fixture holds when the case starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fixture {
    /// idem's migrations and the bank's tables, applied by [`Bank::setup`].
    Migrated,
    /// The private namespace alone: no table of idem's or the bank's (the case may call
    /// [`Bank::setup`] itself).
    Empty,
}

/// A registered case.
pub struct Case<K> {
    /// The test name's second part (`postgres::<name>`).
    pub name: &'static str,
    /// The promise it proves.
    pub promise: &'static str,
    /// What the fixture holds when the case starts.
    pub fixture: Fixture,
    /// The case.
    pub run: fn(Arc<K>) -> idem::core::BoxFuture<'static, CaseResult>,
}

impl<K> std::fmt::Debug for Case<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case").field("name", &self.name).finish()
    }
}

/// Every case, in the order of the promises they prove.
pub fn all<K: Bank>() -> Vec<Case<K>> {
    vec![
        Case {
            name: "effect_commits_with_record",
            promise: "record and effect commit in one transaction",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(effect_commits_with_record(k)),
        },
        Case {
            name: "replay_returns_stored_response",
            promise: "a retry returns the stored response, never a recomputed one",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(replay_returns_stored_response(k)),
        },
        Case {
            name: "different_request_rejected",
            promise: "same key, different request: rejected before any effect",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(different_request_rejected(k)),
        },
        Case {
            name: "failed_effect_rolls_back",
            promise: "a failed effect leaves no record; the key can be retried",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(failed_effect_rolls_back(k)),
        },
        Case {
            name: "concurrent_duplicates_execute_once",
            promise: "32 concurrent duplicates: one effect, losers wait and replay",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(concurrent_duplicates_execute_once(k)),
        },
        Case {
            name: "duplicates_arriving_at_commit_replay",
            promise: "duplicates arriving while the winner commits replay; none runs the effect again",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(duplicates_arriving_at_commit_replay(k)),
        },
        Case {
            name: "concurrent_takeover_after_rollback",
            promise: "a loser takes over when the winner rolls back",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(concurrent_takeover_after_rollback(k)),
        },
        Case {
            name: "scopes_are_independent",
            promise: "the same key under another principal or operation is independent",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(scopes_are_independent(k)),
        },
        Case {
            name: "keys_are_byte_exact",
            promise: "keys are 1-255 bytes, compared byte for byte; invalid keys write nothing",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(keys_are_byte_exact(k)),
        },
        Case {
            name: "canonical_request_and_response",
            promise: "key order never matters; stored JSON replays as stored",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(canonical_request_and_response(k)),
        },
        Case {
            name: "expired_record_no_longer_replays",
            promise: "after retention the key is accepted again",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(expired_record_no_longer_replays(k)),
        },
        Case {
            name: "effect_outliving_its_record_is_refused",
            promise: "a record that expires while its effect runs is not committed; nothing is stored",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(effect_outliving_its_record_is_refused(k)),
        },
        Case {
            name: "purge_deletes_only_expired_in_batches",
            promise: "purge deletes expired records in bounded batches, never a live one",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(purge_deletes_only_expired_in_batches(k)),
        },
        Case {
            name: "in_flight_answers_in_progress",
            promise: "a winner holding its key past the wait bound: losers get InProgress, then replay",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(in_flight_answers_in_progress(k)),
        },
        Case {
            name: "consumer_applies_once_per_subscriber",
            promise: "(subscriber, message_id) recorded with the effect, once per subscriber",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(consumer_applies_once_per_subscriber(k)),
        },
        Case {
            name: "consumer_payload_mismatch_rejected",
            promise: "a different payload under a known message ID is rejected",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(consumer_payload_mismatch_rejected(k)),
        },
        Case {
            name: "stored_rejection_is_opt_in",
            promise: "final rejections are stored only by explicit opt-in",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(stored_rejection_is_opt_in(k)),
        },
        Case {
            name: "primary_key_refuses_direct_insert",
            promise: "the schema's primary key refuses a second record",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(primary_key_refuses_direct_insert(k)),
        },
        Case {
            name: "calls_before_the_migrations_fail_as_missing_table",
            promise: "before the migrations a call fails as a missing table, runs no effect and creates nothing",
            fixture: Fixture::Empty,
            run: |k| Box::pin(calls_before_the_migrations_fail_as_missing_table(k)),
        },
        Case {
            name: "phased_run_resumes_at_its_recovery_point",
            promise: "a phased run whose owner died resumes at its last recovery point; one charge",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(external::phased_run_resumes_at_its_recovery_point(k)),
        },
        Case {
            name: "stale_owner_is_fenced",
            promise: "after a takeover the earlier owner's writes are refused and rolled back",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(external::stale_owner_is_fenced(k)),
        },
        Case {
            name: "lease_heartbeat_release_and_final_failure",
            promise: "a live lease answers InProgress, heartbeats renew it, release hands over",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(external::lease_heartbeat_release_and_final_failure(k)),
        },
        Case {
            name: "completer_finishes_stalled_runs",
            promise: "two completers at once finish every stalled run exactly once",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(external::completer_finishes_stalled_runs(k)),
        },
        Case {
            name: "run_rows_are_compare_and_set_by_owner_fence_and_point",
            promise: "a run's row changes only by compare-and-set on owner, fence and point; leases alone",
            fixture: Fixture::Migrated,
            run: |k| {
                Box::pin(crate::run_store::run_rows_are_compare_and_set_by_owner_fence_and_point(k))
            },
        },
        Case {
            name: "stalled_runs_are_unfinished_unexpired_and_lease_over",
            promise: "the completer lists only unfinished, unexpired runs whose lease ended",
            fixture: Fixture::Migrated,
            run: |k| {
                Box::pin(crate::run_store::stalled_runs_are_unfinished_unexpired_and_lease_over(k))
            },
        },
        Case {
            name: "purge_keeps_live_runs_and_unsent_messages",
            promise: "purge deletes expired runs and sent messages, never pending or dead ones",
            fixture: Fixture::Migrated,
            run: |k| {
                Box::pin(crate::run_store::purge_keeps_live_runs_and_unsent_messages(
                    k,
                ))
            },
        },
        Case {
            name: "a_start_held_up_by_its_run_answers_in_progress",
            promise: "a start whose wait bound ran out on its run's row answers InProgress",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(crate::run_store::a_start_held_up_by_its_run_answers_in_progress(k)),
        },
        Case {
            name: "phased_steps_may_repeat_a_point",
            promise: "a step that commits the same point and state again is progress; retention must outlive the lease",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(external::phased_steps_may_repeat_a_point(k)),
        },
        Case {
            name: "lost_commit_replies_never_move_a_run_back",
            promise: "a commit whose reply was lost: the run never moves back, effects once, same answer",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(crate::lost_reply::lost_commit_replies_never_move_a_run_back(k)),
        },
        Case {
            name: "outbox_drains_in_order_skipping_locked",
            promise: "outbox relays publish each committed message once, in order per destination",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(external::outbox_drains_in_order_skipping_locked(k)),
        },
        Case {
            name: "outbox_failures_back_off_then_die",
            promise: "a refused message is retried with backoff, then dead; its destination then goes on in order",
            fixture: Fixture::Migrated,
            run: |k| {
                Box::pin(
                    crate::outbox_cases::outbox_failures_back_off_then_die_and_the_destination_goes_on(k),
                )
            },
        },
        Case {
            name: "outbox_operators_list_retry_and_drop",
            promise: "operators list, retry and drop unsent messages",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(crate::outbox_cases::outbox_operators_list_retry_and_drop(k)),
        },
        Case {
            name: "outbox_relay_dying_after_publishing_publishes_again",
            promise: "a relay killed between publish and record: published again, the attempt counted",
            fixture: Fixture::Migrated,
            run: |k| {
                Box::pin(
                    crate::outbox_cases::outbox_relay_dying_after_publishing_publishes_again(k),
                )
            },
        },
        Case {
            name: "outbox_unconfirmed_publish_times_out",
            promise: "a broker that never confirms: the publish times out, counted, not marked sent",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(crate::outbox_cases::outbox_unconfirmed_publish_times_out(k)),
        },
        Case {
            name: "relay_holds_no_lock_while_publishing",
            promise: "no transaction is open while the relay waits for the broker",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(crate::outbox_cases::relay_holds_no_lock_while_publishing(k)),
        },
        Case {
            name: "completion_drives_known_operations_only",
            promise: "maintenance completes stalled runs it has a step for, and touches no other",
            fixture: Fixture::Migrated,
            run: |k| Box::pin(crate::maintain::completion_drives_known_operations_only(k)),
        },
    ]
}

// ---------------------------------------------------------------------------------------
// helpers

fn fail(msg: impl Into<String>) -> Failure {
    msg.into().into()
}

fn expect_eq<T: PartialEq + Debug>(what: &str, got: T, want: T) -> Result<(), Failure> {
    if got == want {
        Ok(())
    } else {
        Err(fail(format!("{what}: expected {want:?}, got {got:?}")))
    }
}

fn scope(principal: &str, operation: &str) -> Result<Scope, Failure> {
    Ok(Scope::new(
        Principal::new(principal)?,
        operation.parse::<Operation>()?,
    ))
}

fn amount(n: i64) -> Request {
    Request::new(json!({ "amount": n }))
}

fn idem<K: Bank>(bank: &K) -> Idem<K::B> {
    Idem::new(bank.backend().clone())
}

type DebitResult = Result<Outcome<Balance>, Error<BankError>>;

/// The worked example's `debit_once`: debits `n` from `account` under `key`, counting
/// effect runs.
async fn debit<K: Bank>(
    idem: &Idem<K::B>,
    scope: &Scope,
    key: &str,
    account: i64,
    n: i64,
    runs: &Arc<AtomicUsize>,
) -> Result<DebitResult, Failure> {
    let key = Key::new(key)?;
    let runs = Arc::clone(runs);
    Ok(idem
        .execute(scope, &key, &amount(n), move |tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            K::debit(tx, account, n)
        })
        .await)
}

fn executed(what: &str, r: DebitResult, want: i64) -> Result<(), Failure> {
    match r {
        Ok(Outcome::Executed(b)) => expect_eq(what, b.balance, want),
        other => Err(fail(format!(
            "{what}: expected Executed({want}), got {other:?}"
        ))),
    }
}

fn replayed(what: &str, r: DebitResult, want: i64) -> Result<(), Failure> {
    match r {
        Ok(Outcome::Replayed(b)) => expect_eq(what, b.balance, want),
        other => Err(fail(format!(
            "{what}: expected Replayed({want}), got {other:?}"
        ))),
    }
}

fn counter() -> Arc<AtomicUsize> {
    Arc::new(AtomicUsize::new(0))
}

// ---------------------------------------------------------------------------------------
// cases

/// (a) The effect runs in the engine's transaction: until commit, another session sees
/// neither its write nor the record; after commit it sees both. An engine without
/// concurrent sessions (in-memory SQLite) cannot show the first half, and says so.
pub async fn effect_commits_with_record<K: Bank>(bank: Arc<K>) -> CaseResult {
    let concurrent = bank.capabilities().concurrent_sessions;
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let key = Key::new("checkout-42")?;
    let inside = Arc::new(std::sync::Mutex::new(None::<(String, String)>));
    let (b2, s2, k2, seen) = (
        Arc::clone(&bank),
        scope.clone(),
        key.clone(),
        Arc::clone(&inside),
    );
    let out = idem
        .execute(&scope, &key, &amount(100), move |tx| {
            let (bank, scope, key, seen) =
                (Arc::clone(&b2), s2.clone(), k2.clone(), Arc::clone(&seen));
            Box::pin(async move {
                let b = K::debit(tx, 1, 100).await?;
                if !concurrent {
                    let why = "not observable: one connection (in-memory database)";
                    if let Ok(mut g) = seen.lock() {
                        *g = Some((why.to_owned(), why.to_owned()));
                    }
                    return Ok(b);
                }
                let wait = Duration::from_secs(1);
                let balance = match tokio::time::timeout(wait, bank.balance(1)).await {
                    Ok(Ok(1000)) => "no (another session reads the committed 1000)".to_owned(),
                    Ok(Ok(other)) => format!("DIRTY READ: another session saw {other}"),
                    Ok(Err(e)) => format!("error: {e}"),
                    Err(_) => "no (another session's read waits for the commit)".to_owned(),
                };
                let claim = Claim {
                    id: Identity::Request {
                        scope: &scope,
                        key: &key,
                    },
                    request: None,
                    retention: Duration::from_secs(3600),
                    wait: Duration::from_secs(1),
                };
                let record = match tokio::time::timeout(wait, bank.backend().lookup(&claim)).await {
                    Ok(Ok(None)) => "no (invisible until commit)".to_owned(),
                    Ok(Ok(Some(s))) => format!("UNFINISHED RECORD SEEN: {s:?}"),
                    Ok(Err(e)) => format!("error: {e}"),
                    Err(_) => "no (the lookup waits for the commit)".to_owned(),
                };
                if let Ok(mut g) = seen.lock() {
                    *g = Some((balance, record));
                }
                Ok(b)
            })
        })
        .await;
    executed("first debit", out, 900)?;
    expect_eq("balance after commit", bank.balance(1).await?, 900)?;
    expect_eq("records after commit", bank.count_records().await?, 1)?;
    let (balance, record) = inside
        .lock()
        .map_err(|_| fail("poisoned"))?
        .clone()
        .ok_or_else(|| fail("the effect never ran"))?;
    if balance.starts_with("DIRTY")
        || balance.starts_with("error")
        || record.starts_with("UNFINISHED")
        || record.starts_with("error")
    {
        return Err(fail(format!(
            "during the effect: balance {balance}; record {record}"
        )));
    }
    Ok(vec![
        ("effect visible to others before commit", balance),
        ("record visible to others before commit", record),
    ])
}

/// (b) A retry returns the stored response even after later operations changed the
/// account; the effect does not run again. Both the read-only fast path and the
/// in-transaction path replay.
pub async fn replay_returns_stored_response<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let runs = counter();
    executed(
        "debit checkout-42",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    executed(
        "debit another key",
        debit::<K>(&idem, &scope, "checkout-43", 1, 50, &runs).await?,
        850,
    )?;
    replayed(
        "retry (fast path)",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    let slow = idem.clone().with_fast_path(false);
    replayed(
        "retry (claim path)",
        debit::<K>(&slow, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    expect_eq("effect runs", runs.load(Ordering::SeqCst), 2)?;
    expect_eq("balance", bank.balance(1).await?, 850)?;
    Ok(vec![(
        "replay after the account changed",
        "stored {\"balance\":900} returned, balance stays 850".into(),
    )])
}

/// (c) The same key with a different request is rejected before any effect.
pub async fn different_request_rejected<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let runs = counter();
    executed(
        "debit 100",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    for (label, idem) in [
        ("fast path", idem.clone()),
        ("claim path", idem.clone().with_fast_path(false)),
    ] {
        match debit::<K>(&idem, &scope, "checkout-42", 1, 101, &runs).await? {
            Err(Error::KeyReused { stored, supplied }) => {
                expect_eq("stored request", stored, json!({"amount": 100}))?;
                expect_eq("supplied request", supplied, json!({"amount": 101}))?;
            }
            other => return Err(fail(format!("{label}: expected KeyReused, got {other:?}"))),
        }
    }
    expect_eq("effect runs", runs.load(Ordering::SeqCst), 1)?;
    expect_eq("balance", bank.balance(1).await?, 900)?;
    Ok(vec![])
}

/// (d) A failed effect rolls back with its record; the same key can then succeed.
pub async fn failed_effect_rolls_back<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 50).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let runs = counter();
    match debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await? {
        Err(Error::Effect(BankError::Insufficient)) => {}
        other => {
            return Err(fail(format!(
                "expected Effect(Insufficient), got {other:?}"
            )));
        }
    }
    expect_eq(
        "records after a failed effect",
        bank.count_records().await?,
        0,
    )?;
    // An effect that writes, then fails: its write rolls back too.
    let key = Key::new("partial")?;
    let out = idem
        .execute(&scope, &key, &amount(10), |tx| {
            Box::pin(async move {
                K::debit(tx, 1, 10).await?;
                Err::<Balance, _>(BankError::NoAccount(99))
            })
        })
        .await;
    if !matches!(out, Err(Error::Effect(BankError::NoAccount(99)))) {
        return Err(fail(format!(
            "expected the partial effect to fail, got {out:?}"
        )));
    }
    expect_eq("balance after failed effects", bank.balance(1).await?, 50)?;
    expect_eq(
        "records after failed effects",
        bank.count_records().await?,
        0,
    )?;
    bank.set_balance(1, 200).await?;
    executed(
        "retry after top-up",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        100,
    )?;
    Ok(vec![])
}

/// (e) 32 concurrent duplicates: exactly one effect commits; the others wait for the
/// winner and return its response.
pub async fn concurrent_duplicates_execute_once<K: Bank>(bank: Arc<K>) -> CaseResult {
    const N: usize = 32;
    const HOLD: Duration = Duration::from_millis(150);
    bank.set_balance(1, 1000).await?;
    let idem = Arc::new(idem(&*bank));
    let scope = Arc::new(scope("account-1", "debit:v1")?);
    let runs = counter();
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let (idem, scope, runs, barrier) = (
            Arc::clone(&idem),
            Arc::clone(&scope),
            Arc::clone(&runs),
            Arc::clone(&barrier),
        );
        tasks.push(tokio::spawn(async move {
            let key = Key::new("checkout-42")?;
            barrier.wait().await;
            let start = Instant::now();
            let out = idem
                .execute(&scope, &key, &amount(100), move |tx| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async move {
                        let b = K::debit(tx, 1, 100).await?;
                        tokio::time::sleep(HOLD).await;
                        Ok::<_, BankError>(b)
                    })
                })
                .await;
            Ok::<_, Failure>((out, start.elapsed()))
        }));
    }
    let (mut executed_n, mut replayed_n, mut slowest_loser) = (0, 0, Duration::ZERO);
    for t in tasks {
        let (out, took) = t.await.map_err(|e| fail(format!("task: {e}")))??;
        match out {
            Ok(Outcome::Executed(b)) => {
                expect_eq("winner's balance", b.balance, 900)?;
                executed_n += 1;
            }
            Ok(Outcome::Replayed(b)) => {
                expect_eq("loser's replayed balance", b.balance, 900)?;
                replayed_n += 1;
                slowest_loser = slowest_loser.max(took);
            }
            Err(e) => {
                return Err(fail(format!(
                    "a concurrent duplicate failed instead of replaying: {e}"
                )));
            }
        }
    }
    expect_eq("executed", executed_n, 1)?;
    expect_eq("replayed", replayed_n, N - 1)?;
    expect_eq("balance", bank.balance(1).await?, 900)?;
    expect_eq("records", bank.count_records().await?, 1)?;
    let waited = if slowest_loser >= HOLD {
        "yes: losers waited for the winner's commit, then replayed"
    } else {
        "no loser had to wait"
    };
    Ok(vec![
        (
            "concurrent duplicates (32)",
            format!("1 executed, {} replayed, 0 errors", N - 1),
        ),
        ("losers waited", waited.into()),
        (
            "effect invocations (committed: 1)",
            runs.load(Ordering::SeqCst).to_string(),
        ),
    ])
}

/// (d') Duplicates that arrive while the winner is committing, staggered so that some
/// read the key before the winner's commit and claim it after: each replays. The effect
/// debits the whole balance, so a duplicate that ran it again against the committed
/// debit would fail (insufficient balance) instead of replaying.
pub async fn duplicates_arriving_at_commit_replay<K: Bank>(bank: Arc<K>) -> CaseResult {
    const ROUNDS: usize = 40;
    const N: usize = 12;
    const STAGGER: Duration = Duration::from_micros(200);
    const HOLD: Duration = Duration::from_millis(1);
    let idem = Arc::new(idem(&*bank));
    let scope = Arc::new(scope("account-1", "debit:v1")?);
    let runs = counter();
    let mut replayed_n = 0;
    for round in 0..ROUNDS {
        bank.set_balance(1, 100).await?;
        let key = Arc::new(Key::new(format!("drain-{round}"))?);
        let mut tasks = Vec::new();
        for i in 0..N {
            let (idem, scope, key, runs) = (
                Arc::clone(&idem),
                Arc::clone(&scope),
                Arc::clone(&key),
                Arc::clone(&runs),
            );
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(STAGGER * u32::try_from(i).unwrap_or(0)).await;
                idem.execute(&scope, &key, &amount(100), move |tx| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async move {
                        let b = K::debit(tx, 1, 100).await?;
                        tokio::time::sleep(HOLD).await;
                        Ok::<_, BankError>(b)
                    })
                })
                .await
            }));
        }
        let mut executed_n = 0;
        for t in tasks {
            match t.await.map_err(|e| fail(format!("task: {e}")))? {
                Ok(Outcome::Executed(b)) => {
                    expect_eq("winner's balance", b.balance, 0)?;
                    executed_n += 1;
                }
                Ok(Outcome::Replayed(b)) => {
                    expect_eq("replayed balance", b.balance, 0)?;
                    replayed_n += 1;
                }
                Err(e) => {
                    return Err(fail(format!(
                        "round {round}: a duplicate failed instead of replaying the committed \
                         debit (it ran the effect again against it): {e}"
                    )));
                }
            }
        }
        expect_eq("executed per key", executed_n, 1)?;
        expect_eq("balance", bank.balance(1).await?, 0)?;
    }
    expect_eq("records", bank.count_records().await?, ROUNDS as u64)?;
    Ok(vec![
        (
            "keys, duplicates each (200 µs apart)",
            format!("{ROUNDS}, {N}"),
        ),
        (
            "outcomes",
            format!("{ROUNDS} executed, {replayed_n} replayed, 0 errors"),
        ),
        (
            "effect invocations (committed: one per key)",
            runs.load(Ordering::SeqCst).to_string(),
        ),
    ])
}

/// (e) When the winner rolls back, a waiting loser takes the key over and runs the effect.
pub async fn concurrent_takeover_after_rollback<K: Bank>(bank: Arc<K>) -> CaseResult {
    const N: usize = 8;
    bank.set_balance(1, 1000).await?;
    let idem = Arc::new(idem(&*bank));
    let scope = Arc::new(scope("account-1", "debit:v1")?);
    let first = Arc::new(AtomicBool::new(true));
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for _ in 0..N {
        let (idem, scope, first, barrier) = (
            Arc::clone(&idem),
            Arc::clone(&scope),
            Arc::clone(&first),
            Arc::clone(&barrier),
        );
        tasks.push(tokio::spawn(async move {
            let key = Key::new("checkout-42")?;
            barrier.wait().await;
            Ok::<_, Failure>(
                idem.execute(&scope, &key, &amount(100), move |tx| {
                    let fails = first.swap(false, Ordering::SeqCst);
                    Box::pin(async move {
                        let b = K::debit(tx, 1, 100).await?;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        if fails {
                            Err(BankError::NoAccount(-1))
                        } else {
                            Ok(b)
                        }
                    })
                })
                .await,
            )
        }));
    }
    let (mut failed, mut executed_n, mut replayed_n) = (0, 0, 0);
    for t in tasks {
        match t.await.map_err(|e| fail(format!("task: {e}")))?? {
            Err(Error::Effect(BankError::NoAccount(-1))) => failed += 1,
            Ok(Outcome::Executed(b)) => {
                expect_eq("taker's balance", b.balance, 900)?;
                executed_n += 1;
            }
            Ok(Outcome::Replayed(b)) => {
                expect_eq("replayed balance", b.balance, 900)?;
                replayed_n += 1;
            }
            Err(e) => return Err(fail(format!("unexpected error: {e}"))),
        }
    }
    expect_eq(
        "(failed, executed, replayed)",
        (failed, executed_n, replayed_n),
        (1, 1, N - 2),
    )?;
    expect_eq("balance", bank.balance(1).await?, 900)?;
    Ok(vec![(
        "winner rolled back",
        "a waiting loser took the key over and ran the effect once".into(),
    )])
}

/// (f) The same key under another principal or operation version is independent.
pub async fn scopes_are_independent<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    bank.set_balance(2, 1000).await?;
    let idem = idem(&*bank);
    let runs = counter();
    executed(
        "account-1 debit:v1",
        debit::<K>(
            &idem,
            &scope("account-1", "debit:v1")?,
            "shared",
            1,
            100,
            &runs,
        )
        .await?,
        900,
    )?;
    executed(
        "account-2 debit:v1",
        debit::<K>(
            &idem,
            &scope("account-2", "debit:v1")?,
            "shared",
            2,
            100,
            &runs,
        )
        .await?,
        900,
    )?;
    executed(
        "account-1 debit:v2",
        debit::<K>(
            &idem,
            &scope("account-1", "debit:v2")?,
            "shared",
            1,
            100,
            &runs,
        )
        .await?,
        800,
    )?;
    replayed(
        "account-2 retry",
        debit::<K>(
            &idem,
            &scope("account-2", "debit:v1")?,
            "shared",
            2,
            100,
            &runs,
        )
        .await?,
        900,
    )?;
    expect_eq("records", bank.count_records().await?, 3)?;
    Ok(vec![])
}

/// (g) Keys are compared byte for byte (`k`, `K`, `k `, NFC and NFD `é` are five keys);
/// invalid keys are refused before any SQL.
pub async fn keys_are_byte_exact<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let runs = counter();
    let long = "é".repeat(127) + "x"; // 255 bytes
    let keys = ["k", "K", "k ", "\u{e9}", "e\u{301}", long.as_str()];
    let mut balance = 1000;
    for key in keys {
        balance -= 10;
        executed(
            &format!("key {key:?}"),
            debit::<K>(&idem, &scope, key, 1, 10, &runs).await?,
            balance,
        )?;
    }
    let mut b = 1000;
    for key in keys {
        b -= 10;
        replayed(
            &format!("retry {key:?}"),
            debit::<K>(&idem, &scope, key, 1, 10, &runs).await?,
            b,
        )?;
    }
    for bad in [
        "",
        "a\0b",
        "tab\t",
        "x".repeat(256).as_str(),
        "é".repeat(128).as_str(),
    ] {
        if Key::new(bad).is_ok() {
            return Err(fail(format!("key {bad:?} was accepted")));
        }
    }
    expect_eq("records", bank.count_records().await?, keys.len() as u64)?;
    expect_eq("balance", bank.balance(1).await?, balance)?;
    Ok(vec![(
        "k, K, \"k \", NFC é, NFD é",
        "five distinct keys".into(),
    )])
}

/// Requests compare as canonical JSON values, and a rich response replays exactly.
pub async fn canonical_request_and_response<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "transfer:v1")?;
    let key = Key::new("t-1")?;
    let first =
        Request::parse(r#"{"amount":100,"to":{"iban":"DE00","name":"Zoë"},"currency":"EUR"}"#)?;
    let again =
        Request::parse(r#"{"currency":"EUR","to":{"name":"Zoë","iban":"DE00"},"amount":100}"#)?;
    let response = json!({
        "balance": 900, "note": "ünïcødé ✓ \"quoted\" \\ ", "ratio": 0.5, "big": 9_007_199_254_740_993_u64,
        "nested": {"z": [1, 2, 3], "a": null, "b": true}, "empty": {}
    });
    let r2 = response.clone();
    let out = idem
        .execute(&scope, &key, &first, move |tx| {
            let r = r2.clone();
            Box::pin(async move {
                K::debit(tx, 1, 100).await?;
                Ok::<Value, BankError>(r)
            })
        })
        .await;
    expect_eq(
        "first call",
        out.map_err(|e| e.to_string()),
        Ok(Outcome::Executed(response.clone())),
    )?;
    let out = idem
        .execute(&scope, &key, &again, |_| {
            Box::pin(async { Err::<Value, _>(BankError::NoAccount(0)) })
        })
        .await;
    expect_eq(
        "reordered retry",
        out.map_err(|e| e.to_string()),
        Ok(Outcome::Replayed(response)),
    )?;
    expect_eq("balance", bank.balance(1).await?, 900)?;
    Ok(vec![])
}

/// (h) A record older than its operation's retention no longer replays: the key is
/// accepted again.
pub async fn expired_record_no_longer_replays<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let op = Operation::new("debit", 1)?.with_retention(Duration::from_millis(1500));
    let scope = Scope::new(Principal::new("account-1")?, op);
    let runs = counter();
    executed(
        "first",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    replayed(
        "inside the window",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    tokio::time::sleep(Duration::from_millis(2000)).await;
    executed(
        "after the window",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        800,
    )?;
    replayed(
        "the new record replays",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        800,
    )?;
    expect_eq("records", bank.count_records().await?, 1)?;
    Ok(vec![])
}

/// (h) A record that expires while its effect still runs is refused at completion: the
/// effect rolls back with it and the call fails without a retry. Otherwise a retry that
/// took the expired key over meanwhile could run the effect a second time.
pub async fn effect_outliving_its_record_is_refused<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let op = Operation::new("debit", 1)?.with_retention(Duration::from_millis(1500));
    let scope = Scope::new(Principal::new("account-1")?, op);
    let request = Request::new(json!({ "account": 1, "amount": 100 }));
    let out = idem
        .execute(&scope, &Key::new("slow")?, &request, |tx| {
            Box::pin(async move {
                let balance = K::debit(tx, 1, 100).await?;
                // Outlive the record's 1.5 s window.
                tokio::time::sleep(Duration::from_millis(2500)).await;
                Ok::<_, BankError>(balance)
            })
        })
        .await;
    match out {
        Err(Error::Backend(e)) if !e.kind().is_retryable() => {}
        other => {
            return Err(format!("an effect that outlived its record committed: {other:?}").into());
        }
    }
    expect_eq("balance", bank.balance(1).await?, 1000)?;
    expect_eq("records", bank.count_records().await?, 0)?;
    Ok(vec![(
        "effect slower than its record's retention",
        "refused at completion; effect rolled back, no record".into(),
    )])
}

/// (h) Purge deletes expired records in bounded batches and never a live one: each
/// record's expiry is its own (set at the claim), so one purge is safe for operations
/// with different windows.
pub async fn purge_deletes_only_expired_in_batches<K: Bank>(bank: Arc<K>) -> CaseResult {
    const WINDOW: Duration = Duration::from_millis(1500);
    bank.set_balance(1, 100_000).await?;
    let idem = idem(&*bank).with_message_retention(WINDOW);
    let short = Scope::new(
        Principal::new("account-1")?,
        Operation::new("debit", 1)?.with_retention(WINDOW),
    );
    // A 24-hour operation: claimed as early as the short ones, never purged by them.
    let long = scope("account-1", "debit:v2")?;
    let runs = counter();
    for i in 0..25 {
        debit::<K>(&idem, &short, &format!("old-{i}"), 1, 1, &runs)
            .await?
            .map_err(|e| fail(e.to_string()))?;
    }
    executed(
        "long-lived",
        debit::<K>(&idem, &long, "long-lived", 1, 1, &runs).await?,
        100_000 - 26,
    )?;
    let sub = Subscriber::new("balance-projection")?;
    for i in 0..3 {
        let id = MessageId::new(format!("m-{i}"))?;
        idem.consume(&sub, &id, None, |tx| K::credit(tx, 1, 1))
            .await
            .map_err(|e| fail(e.to_string()))?;
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    executed(
        "fresh",
        debit::<K>(&idem, &short, "fresh", 1, 1, &runs).await?,
        100_000 - 27 + 3,
    )?;
    let report = idem.purge(WINDOW, 10).await?;
    expect_eq("requests purged", report.requests, 25)?;
    expect_eq("messages purged", report.messages, 3)?;
    if report.batches < 4 {
        return Err(fail(format!(
            "expected at least 3 request batches and 1 message batch, got {report:?}"
        )));
    }
    expect_eq("records left", bank.count_records().await?, 2)?;
    replayed(
        "the live record still replays",
        debit::<K>(&idem, &short, "fresh", 1, 1, &runs).await?,
        100_000 - 27 + 3,
    )?;
    replayed(
        "the 24-hour record, as old as the purged ones, still replays",
        debit::<K>(&idem, &long, "long-lived", 1, 1, &runs).await?,
        100_000 - 26,
    )?;
    Ok(vec![(
        "purge of 25 expired + 2 live (one with a 24 h window), batch 10",
        format!(
            "{} deleted in {} statements, live records kept",
            report.requests + report.messages,
            report.batches
        ),
    )])
}

/// (h2) A winner that holds its key longer than the wait bound: concurrent losers end
/// with [`Error::InProgress`] (not retried, not a hang, not a pool-wide failure); once
/// the winner commits, a retry replays its response; the effect ran once.
pub async fn in_flight_answers_in_progress<K: Bank>(bank: Arc<K>) -> CaseResult {
    const LOSERS: usize = 4;
    const WAIT: Duration = Duration::from_millis(500);
    // Generous: a guard against a hang, never a timing assertion.
    const HANG_GUARD: Duration = Duration::from_secs(60);
    bank.set_balance(1, 1000).await?;
    let idem = Arc::new(idem(&*bank).with_wait_timeout(WAIT));
    let scope = Arc::new(scope("account-1", "debit:v1")?);
    let runs = counter();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let winner = {
        let (idem, scope, runs) = (Arc::clone(&idem), Arc::clone(&scope), Arc::clone(&runs));
        let mut signals = Some((started_tx, release_rx));
        tokio::spawn(async move {
            let key = Key::new("checkout-42")?;
            Ok::<_, Failure>(
                idem.execute(&scope, &key, &amount(100), move |tx| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let signals = signals.take();
                    Box::pin(async move {
                        let b = K::debit(tx, 1, 100).await?;
                        if let Some((started, release)) = signals {
                            let _ = started.send(());
                            // Hold the key until every loser has answered.
                            let _ = tokio::time::timeout(HANG_GUARD, release).await;
                        }
                        Ok::<_, BankError>(b)
                    })
                })
                .await,
            )
        })
    };
    tokio::time::timeout(HANG_GUARD, started_rx)
        .await
        .map_err(|_| fail("the winner's effect never started"))?
        .map_err(|_| fail("the winner ended before its effect started"))?;
    let mut losers = Vec::new();
    for _ in 0..LOSERS {
        let (idem, scope, runs) = (Arc::clone(&idem), Arc::clone(&scope), Arc::clone(&runs));
        losers.push(tokio::spawn(async move {
            let key = Key::new("checkout-42")?;
            Ok::<_, Failure>(
                idem.execute(&scope, &key, &amount(100), move |tx| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    K::debit(tx, 1, 100)
                })
                .await,
            )
        }));
    }
    let mut in_progress = 0;
    for loser in losers {
        let out = tokio::time::timeout(HANG_GUARD, loser)
            .await
            .map_err(|_| fail("a loser hung instead of answering InProgress"))?
            .map_err(|e| fail(format!("task: {e}")))??;
        match out {
            Err(Error::InProgress { .. }) => in_progress += 1,
            other => {
                return Err(fail(format!(
                    "a loser of an in-flight key: expected InProgress, got {other:?}"
                )));
            }
        }
    }
    expect_eq("losers answered InProgress", in_progress, LOSERS)?;
    let _ = release_tx.send(());
    let won = tokio::time::timeout(HANG_GUARD, winner)
        .await
        .map_err(|_| fail("the winner hung"))?
        .map_err(|e| fail(format!("task: {e}")))??;
    executed("winner", won, 900)?;
    replayed(
        "a retry after the winner committed",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    expect_eq("effect invocations", runs.load(Ordering::SeqCst), 1)?;
    expect_eq("balance", bank.balance(1).await?, 900)?;
    expect_eq("records", bank.count_records().await?, 1)?;
    Ok(vec![(
        "4 losers of a key held past a 500 ms bound",
        "all answered InProgress; the retry after commit replayed; 1 effect".into(),
    )])
}

/// (i) The consumer records `(subscriber, message_id)` with its effect: applied once per
/// subscriber, independently per subscriber, also under concurrent redelivery.
pub async fn consumer_applies_once_per_subscriber<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 900).await?;
    let idem = Arc::new(idem(&*bank));
    let projection = Subscriber::new("balance-projection")?;
    let id = MessageId::new("00000000-0000-4000-8000-000000000001")?;
    let first = idem
        .consume(&projection, &id, None, |tx| K::credit(tx, 1, 50))
        .await;
    expect_eq(
        "first delivery",
        first.map_err(|e| e.to_string()),
        Ok(Consumed::Applied(crate::Balance { balance: 950 })),
    )?;
    let again = idem
        .consume(&projection, &id, None, |tx| K::credit(tx, 1, 50))
        .await;
    expect_eq(
        "redelivery",
        again.map_err(|e| e.to_string()),
        Ok(Consumed::Duplicate),
    )?;
    expect_eq("balance", bank.balance(1).await?, 950)?;
    // Another subscriber applies the same message independently, once, under 8
    // concurrent deliveries.
    let audit = Arc::new(Subscriber::new("audit-projection")?);
    let id = Arc::new(id);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (idem, audit, id) = (Arc::clone(&idem), Arc::clone(&audit), Arc::clone(&id));
        tasks.push(tokio::spawn(async move {
            idem.consume(&audit, &id, None, |tx| {
                Box::pin(async move {
                    let b = K::credit(tx, 1, 50).await?;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok::<_, BankError>(b)
                })
            })
            .await
        }));
    }
    let mut applied = 0;
    for t in tasks {
        match t.await.map_err(|e| fail(format!("task: {e}")))? {
            Ok(Consumed::Applied(_)) => applied += 1,
            Ok(Consumed::Duplicate) => {}
            Err(e) => return Err(fail(format!("a concurrent delivery failed: {e}"))),
        }
    }
    expect_eq("applied by the second subscriber", applied, 1)?;
    expect_eq("balance", bank.balance(1).await?, 1000)?;
    Ok(vec![(
        "consumer, 8 concurrent deliveries",
        "applied once, 7 duplicates".into(),
    )])
}

/// (i) With a payload fingerprint, a known message ID with a different payload is refused.
pub async fn consumer_payload_mismatch_rejected<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 900).await?;
    let idem = idem(&*bank);
    let sub = Subscriber::new("balance-projection")?;
    let id = MessageId::new("msg-7")?;
    let p50 = amount(50);
    let p60 = amount(60);
    let out = idem
        .consume(&sub, &id, Some(&p50), |tx| K::credit(tx, 1, 50))
        .await;
    expect_eq(
        "first",
        out.map_err(|e| e.to_string()),
        Ok(Consumed::Applied(Balance { balance: 950 })),
    )?;
    let out = idem
        .consume(&sub, &id, Some(&p50), |tx| K::credit(tx, 1, 50))
        .await;
    expect_eq(
        "same payload",
        out.map_err(|e| e.to_string()),
        Ok(Consumed::Duplicate),
    )?;
    match idem
        .consume(&sub, &id, Some(&p60), |tx| K::credit(tx, 1, 60))
        .await
    {
        Err(Error::PayloadMismatch { stored, supplied }) => {
            expect_eq("stored payload", stored, json!({"amount": 50}))?;
            expect_eq("supplied payload", supplied, json!({"amount": 60}))?;
        }
        other => return Err(fail(format!("expected PayloadMismatch, got {other:?}"))),
    }
    expect_eq("balance", bank.balance(1).await?, 950)?;
    Ok(vec![])
}

/// Storing final business rejections is an explicit opt-in (`execute_final`); by default
/// a failure stores nothing (see `failed_effect_rolls_back`).
pub async fn stored_rejection_is_opt_in<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 50).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let key = Key::new("checkout-42")?;
    let request = amount(100);
    let call = || {
        idem.execute_final(&scope, &key, &request, |tx| {
            Box::pin(async move {
                match K::debit(tx, 1, 100).await {
                    Ok(b) => Ok(Ok(b)),
                    Err(BankError::Insufficient) => Ok(Err("insufficient balance".to_owned())),
                    Err(e) => Err(e),
                }
            })
        })
    };
    expect_eq(
        "first",
        call().await.map_err(|e| e.to_string()),
        Ok(Outcome::Executed(Err("insufficient balance".to_owned()))),
    )?;
    expect_eq("records", bank.count_records().await?, 1)?;
    bank.set_balance(1, 500).await?;
    expect_eq(
        "retry after top-up",
        call().await.map_err(|e| e.to_string()),
        Ok(Outcome::Replayed(Err("insufficient balance".to_owned()))),
    )?;
    expect_eq("balance", bank.balance(1).await?, 500)?;
    let runs = counter();
    match debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await? {
        Err(Error::StoredRejection(v)) => {
            expect_eq("stored rejection", v, json!("insufficient balance"))?
        }
        other => return Err(fail(format!("expected StoredRejection, got {other:?}"))),
    }
    Ok(vec![])
}

/// (j) A direct insert of an existing identity is refused by the primary key.
pub async fn primary_key_refuses_direct_insert<K: Bank>(bank: Arc<K>) -> CaseResult {
    bank.set_balance(1, 1000).await?;
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    executed(
        "debit",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &counter()).await?,
        900,
    )?;
    let err = match bank
        .insert_record_directly(
            "account-1",
            "debit:v1",
            "checkout-42",
            r#"{"amount":100}"#,
            r#"{"balance":900}"#,
        )
        .await
    {
        Ok(()) => return Err(fail("the direct insert of an existing identity succeeded")),
        Err(e) => e,
    };
    expect_eq("error kind", err.kind(), ErrorKind::UniqueViolation)?;
    expect_eq("records", bank.count_records().await?, 1)?;
    Ok(vec![(
        "duplicate-key error code",
        err.code().unwrap_or("(none)").to_owned(),
    )])
}

/// A database where idem's migrations have not run: a call, a purge and the outbox's
/// statistics fail with [`ErrorKind::MissingTable`], decided from the engine's own code,
/// and the effect never runs. Nothing was created on the way: the record table is still
/// missing, and after the migrations the same call runs the effect once.
pub async fn calls_before_the_migrations_fail_as_missing_table<K: Bank>(
    bank: Arc<K>,
) -> CaseResult {
    let idem = idem(&*bank);
    let scope = scope("account-1", "debit:v1")?;
    let runs = counter();
    let missing = |what: &str, e: Option<&DbError>| match e {
        Some(e) if e.kind() == ErrorKind::MissingTable => {
            Ok(e.code().unwrap_or("(none)").to_owned())
        }
        other => Err(fail(format!(
            "{what} before the migrations: expected a missing table, got {other:?}"
        ))),
    };
    let call = match debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await? {
        Ok(outcome) => {
            return Err(fail(format!(
                "a call before the migrations succeeded: {outcome:?}"
            )));
        }
        Err(e) => missing("a call", e.db_error())?,
    };
    expect_eq(
        "effect runs before the migrations",
        runs.load(Ordering::SeqCst),
        0,
    )?;
    let purge = idem.purge(Duration::ZERO, 100).await;
    missing("a purge", purge.as_ref().err())?;
    let stats = idem.outbox_stats().await;
    missing("the outbox's statistics", stats.as_ref().err())?;
    let records = bank.count_records().await;
    missing("counting the records", records.as_ref().err())?;

    bank.setup().await?;
    bank.set_balance(1, 1000).await?;
    executed(
        "the same call after the migrations",
        debit::<K>(&idem, &scope, "checkout-42", 1, 100, &runs).await?,
        900,
    )?;
    expect_eq("effect runs", runs.load(Ordering::SeqCst), 1)?;
    Ok(vec![("missing-table error code", call)])
}
