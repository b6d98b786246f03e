//! The relay's retries, dead messages, operator calls and faults, on every engine: a
//! scripted in-process publisher stands in for the broker (the real brokers are in
//! `tests/outbox.rs`); the engines are real.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::core::runs::{OutboxEntry, OutboxFilter, OutboxRow, OutboxState};
use idem::core::{
    Idem, Key, Operation, OutboxStore, Outgoing, Principal, Publisher, RelayOptions, Request, Scope,
};
use serde_json::json;

use crate::bank::{Bank, BankError};
use crate::cases::{CaseResult, Failure};
use crate::lost_reply::HANG_GUARD;

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

/// What the scripted broker does with one message ID.
#[derive(Debug, Clone)]
enum Behaviour {
    /// Refuses it (with a URL carrying a password in the error, which must never be
    /// stored as it is).
    Refuse,
    /// Refuses it this many more times, then takes it.
    RefuseTimes(u32),
    /// Takes it, then never confirms.
    Hang,
}

/// A broker stand-in: records every message it confirmed, in order, and refuses or
/// never confirms the message IDs it was told to.
#[derive(Debug, Clone, Default)]
pub struct Script {
    confirmed: Arc<Mutex<Vec<(String, String)>>>,
    received: Arc<Mutex<Vec<String>>>,
    behaviour: Arc<Mutex<HashMap<String, Behaviour>>>,
    hold: Arc<tokio::sync::Mutex<Option<Hold>>>,
}

/// "I am publishing" and "go on".
type Hold = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

impl Script {
    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Refuses `message_id` on every attempt.
    pub fn fail_always(&self, message_id: &str) {
        Self::lock(&self.behaviour).insert(message_id.to_owned(), Behaviour::Refuse);
    }

    /// Refuses `message_id` `times` times, then takes it.
    pub fn fail_times(&self, message_id: &str, times: u32) {
        Self::lock(&self.behaviour).insert(message_id.to_owned(), Behaviour::RefuseTimes(times));
    }

    /// Takes `message_id` and never confirms it.
    pub fn hang(&self, message_id: &str) {
        Self::lock(&self.behaviour).insert(message_id.to_owned(), Behaviour::Hang);
    }

    /// Behaves normally for `message_id` again.
    pub fn heal(&self, message_id: &str) {
        Self::lock(&self.behaviour).remove(message_id);
    }

    /// Holds the next publish until the returned sender fires; the receiver fires when
    /// that publish has begun.
    async fn hold_next(
        &self,
    ) -> (
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel();
        *self.hold.lock().await = Some((started_tx, release_rx));
        (started_rx, release_tx)
    }

    /// The confirmed messages of `destination`, in order.
    pub fn confirmed(&self, destination: &str) -> Vec<String> {
        Self::lock(&self.confirmed)
            .iter()
            .filter(|(d, _)| d == destination)
            .map(|(_, m)| m.clone())
            .collect()
    }

    /// How many times the broker received `message_id` (confirmed or not).
    pub fn received(&self, message_id: &str) -> usize {
        Self::lock(&self.received)
            .iter()
            .filter(|m| *m == message_id)
            .count()
    }
}

impl Publisher for Script {
    type Error = std::io::Error;

    async fn publish(&self, message: &OutboxRow) -> Result<(), std::io::Error> {
        // The broker has the message from here on; the confirmation may never come back.
        Self::lock(&self.received).push(message.message_id.clone());
        let hold = self.hold.lock().await.take();
        if let Some((started, release)) = hold {
            let _ = started.send(());
            let _ = tokio::time::timeout(HANG_GUARD, release).await;
        }
        let behaviour = Self::lock(&self.behaviour)
            .get(&message.message_id)
            .cloned();
        match behaviour {
            Some(Behaviour::Refuse) => {
                return Err(std::io::Error::other(
                    "refused by amqp://relay:s3cret-pw@broker.example:5672/%2f (no route)",
                ));
            }
            Some(Behaviour::RefuseTimes(n)) if n > 0 => {
                Self::lock(&self.behaviour)
                    .insert(message.message_id.clone(), Behaviour::RefuseTimes(n - 1));
                return Err(std::io::Error::other("the broker is busy"));
            }
            Some(Behaviour::Hang) => std::future::pending::<()>().await,
            _ => {}
        }
        Self::lock(&self.confirmed).push((message.destination.clone(), message.message_id.clone()));
        Ok(())
    }
}

fn scope() -> Result<Scope, Failure> {
    Ok(Scope::new(
        Principal::new("outbox")?,
        Operation::new("enqueue", 1)?,
    ))
}

/// Enqueues `messages` (destination, ID), each in its own committed `Idem::execute`.
async fn enqueued<K: Bank>(bank: &K, messages: &[(&str, &str)]) -> Result<(), Failure> {
    let idem = Idem::new(bank.backend().clone());
    for (destination, id) in messages {
        let message = Outgoing::new(destination, id, &json!({ "id": id }))?;
        let backend = bank.backend().clone();
        idem.execute(
            &scope()?,
            &Key::new(format!("enqueue-{id}"))?,
            &Request::new(json!({ "id": id })),
            move |tx| {
                let (backend, message) = (backend.clone(), message.clone());
                Box::pin(async move {
                    backend.enqueue(tx, &message).await?;
                    Ok::<_, BankError>(json!({}))
                })
            },
        )
        .await
        .map_err(|e| fail(format!("enqueue {id}: {e}")))?;
    }
    Ok(())
}

/// Quick retries for the cases: 3 attempts, pauses of 30 to 60 ms.
fn quick() -> RelayOptions {
    RelayOptions {
        batch: 10,
        max_attempts: 3,
        base_delay: Duration::from_millis(30),
        max_delay: Duration::from_millis(60),
        publish_timeout: Duration::from_secs(10),
        claim_lease: Duration::from_secs(30),
    }
}

async fn entry<B: OutboxStore>(
    idem: &Idem<B>,
    message_id: &str,
) -> Result<Option<OutboxEntry>, Failure> {
    Ok(idem
        .outbox_list(&OutboxFilter {
            limit: 1000,
            ..OutboxFilter::default()
        })
        .await?
        .into_iter()
        .find(|e| e.message_id == message_id))
}

/// Relay passes until `done` holds (with a pause between passes), within the hang guard.
async fn relay_until<B: OutboxStore>(
    idem: &Idem<B>,
    publisher: &Script,
    options: &RelayOptions,
    mut done: impl FnMut(&Script) -> bool,
) -> Result<u32, Failure> {
    let began = Instant::now();
    let mut passes = 0;
    while !done(publisher) {
        if began.elapsed() > HANG_GUARD {
            return Err(fail("the relay never got there (hang guard)"));
        }
        idem.relay_with(publisher, options).await?;
        passes += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(passes)
}

/// A message the broker keeps refusing is tried again after growing pauses (attempts
/// counted, the error kept with its password masked), holds its destination back
/// meanwhile (the later messages wait, in order; other destinations go on), and is dead
/// after the last attempt: its destination then goes on, in order.
pub async fn outbox_failures_back_off_then_die_and_the_destination_goes_on<K: Bank>(
    bank: Arc<K>,
) -> CaseResult {
    enqueued(
        &*bank,
        &[
            ("a", "a1"),
            ("a", "a2"),
            ("b", "b1"),
            ("a", "a3"),
            ("b", "b2"),
        ],
    )
    .await?;
    let idem = Idem::new(bank.backend().clone());
    let broker = Script::default();
    broker.fail_always("a1");
    // The first failure backs off long enough for the pass right after it to find a1 not
    // yet due, however slow the machine; the later ones back off briefly.
    let options = RelayOptions {
        base_delay: Duration::from_secs(1),
        max_delay: Duration::from_secs(1),
        ..quick()
    };

    let first = idem.relay_with(&broker, &options).await?;
    expect_eq("published in the first pass (b1, b2)", first.published, 2)?;
    expect_eq("failed attempts", first.failed.len(), 1)?;
    let failure = &first.failed[0];
    expect_eq(
        "the failure",
        (failure.message_id.as_str(), failure.attempts, failure.dead),
        ("a1", 1, false),
    )?;
    expect_eq(
        "a2 and a3 held back",
        broker.confirmed("a"),
        Vec::<String>::new(),
    )?;
    let a1 = entry(&idem, "a1").await?.ok_or_else(|| fail("a1 listed"))?;
    expect_eq("a1's attempts", a1.attempts, 1)?;
    expect_eq("a1 pending", a1.dead, false)?;
    let error = a1.last_error.clone().unwrap_or_default();
    if !error.contains("no route") || error.contains("s3cret-pw") {
        return Err(fail(format!(
            "the stored error must be kept with its password masked: {error:?}"
        )));
    }
    if a1.next_attempt_in.is_none_or(|d| d > options.max_delay) {
        return Err(fail(format!(
            "a1's next attempt must wait at most {:?}: {:?}",
            options.max_delay, a1.next_attempt_in
        )));
    }
    // A pass right away finds nothing due for a (its head waits for its backoff).
    let at_once = idem.relay_with(&broker, &options).await?;
    expect_eq(
        "an immediate pass (a1 not due, a2/a3 behind it)",
        (at_once.published, at_once.failed.len()),
        (0, 0),
    )?;

    // Until a1 is dead, nothing of a is published; then a2 and a3, in order.
    let mut dead_reports = 0;
    let began = Instant::now();
    while broker.confirmed("a").len() < 2 {
        if began.elapsed() > HANG_GUARD {
            return Err(fail("a2 and a3 were never published"));
        }
        let report = idem.relay_with(&broker, &quick()).await?;
        dead_reports += report.dead;
        if broker.received("a1") < 3 && !broker.confirmed("a").is_empty() {
            return Err(fail("a2 was published while a1 was still pending"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    expect_eq("attempts of a1", broker.received("a1"), 3)?;
    expect_eq("dead in the reports", dead_reports, 1)?;
    expect_eq(
        "a in order after a1 died",
        broker.confirmed("a"),
        vec!["a2".to_owned(), "a3".to_owned()],
    )?;
    expect_eq(
        "b",
        broker.confirmed("b"),
        vec!["b1".to_owned(), "b2".to_owned()],
    )?;
    let a1 = entry(&idem, "a1").await?.ok_or_else(|| fail("a1 listed"))?;
    expect_eq(
        "a1 dead after 3 attempts",
        (a1.dead, a1.attempts),
        (true, 3),
    )?;
    let stats = idem.outbox_stats().await?;
    expect_eq("backlog", (stats.pending, stats.dead), (0, 1))?;
    Ok(vec![(
        "a refused head",
        format!(
            "3 attempts with backoff, dead; a2, a3 waited then went on in order; b unaffected; stored error: {error}"
        ),
    )])
}

/// An operator lists unsent messages (by state, destination, page), retries them (back to
/// pending, due now, attempts reset) and drops them (never published).
pub async fn outbox_operators_list_retry_and_drop<K: Bank>(bank: Arc<K>) -> CaseResult {
    enqueued(
        &*bank,
        &[
            ("a", "x1"),
            ("b", "y1"),
            ("b", "y2"),
            ("c", "z1"),
            ("c", "z2"),
        ],
    )
    .await?;
    let idem = Idem::new(bank.backend().clone());
    let broker = Script::default();
    for dead in ["x1", "y1", "z1"] {
        broker.fail_always(dead);
    }
    broker.hang("z2");
    let options = RelayOptions {
        max_attempts: 1,
        publish_timeout: Duration::from_millis(200),
        claim_lease: Duration::from_secs(5),
        ..quick()
    };
    // x1, y1, z1 die at once; y2 and z2 are then due: y2 goes, z2 never confirms.
    relay_until(&idem, &broker, &options, |b| b.received("z2") >= 1).await?;
    let all = idem.outbox_list(&OutboxFilter::default()).await?;
    let listed: Vec<(&str, bool)> = all
        .iter()
        .map(|e| (e.message_id.as_str(), e.dead))
        .collect();
    expect_eq(
        "unsent",
        listed,
        vec![("x1", true), ("y1", true), ("z1", true), ("z2", true)],
    )?;
    broker.heal("z2");
    let dead_b = idem
        .outbox_list(&OutboxFilter {
            state: OutboxState::Dead,
            destination: Some("b".into()),
            ..OutboxFilter::default()
        })
        .await?;
    expect_eq(
        "dead of b",
        dead_b
            .iter()
            .map(|e| e.message_id.as_str())
            .collect::<Vec<_>>(),
        vec!["y1"],
    )?;
    let page = idem
        .outbox_list(&OutboxFilter {
            after_id: all[0].id,
            limit: 2,
            ..OutboxFilter::default()
        })
        .await?;
    expect_eq(
        "a page after x1",
        page.iter()
            .map(|e| e.message_id.as_str())
            .collect::<Vec<_>>(),
        vec!["y1", "z1"],
    )?;
    let pending = idem
        .outbox_list(&OutboxFilter {
            state: OutboxState::Pending,
            ..OutboxFilter::default()
        })
        .await?;
    expect_eq("pending", pending.len(), 0)?;

    // Retry one by id and every dead message of c; drop x1.
    let y1 = dead_b[0].id;
    expect_eq("retried by id", idem.outbox_retry(&[y1], None).await?, 1)?;
    let retried = entry(&idem, "y1").await?.ok_or_else(|| fail("y1"))?;
    expect_eq(
        "y1 after retry",
        (retried.dead, retried.attempts, retried.next_attempt_in),
        (false, 0, None),
    )?;
    expect_eq(
        "retried dead of c",
        idem.outbox_retry(&[], Some("c")).await?,
        2,
    )?;
    expect_eq("dropped x1", idem.outbox_drop(&[all[0].id], None).await?, 1)?;
    broker.heal("y1");
    broker.heal("z1");
    relay_until(&idem, &broker, &quick(), |b| {
        b.confirmed("b").len() == 2 && b.confirmed("c").len() == 2
    })
    .await?;
    expect_eq(
        "b",
        broker.confirmed("b"),
        vec!["y2".to_owned(), "y1".to_owned()],
    )?;
    expect_eq(
        "c in order",
        broker.confirmed("c"),
        vec!["z1".to_owned(), "z2".to_owned()],
    )?;
    expect_eq(
        "x1 never published",
        broker.confirmed("a"),
        Vec::<String>::new(),
    )?;
    // Drop every dead message: none is left after the retries; a new dead one goes.
    enqueued(&*bank, &[("a", "x2")]).await?;
    broker.fail_always("x2");
    relay_until(&idem, &broker, &options, |b| b.received("x2") >= 1).await?;
    expect_eq("dropped dead", idem.outbox_drop(&[], None).await?, 1)?;
    let left = idem.outbox_list(&OutboxFilter::default()).await?;
    expect_eq("unsent after the drops", left.len(), 0)?;
    Ok(vec![(
        "operators",
        "list by state, destination and page; retry by id and by destination; drop by id and dead"
            .into(),
    )])
}

/// A relay that dies between the broker's confirmation and recording it: its claim runs
/// out, the message is published again (at least once) and the lost attempt is counted.
pub async fn outbox_relay_dying_after_publishing_publishes_again<K: Bank>(
    bank: Arc<K>,
) -> CaseResult {
    enqueued(&*bank, &[("a", "m1")]).await?;
    let idem = Idem::new(bank.backend().clone());
    let broker = Script::default();
    let options = RelayOptions {
        publish_timeout: Duration::from_millis(300),
        claim_lease: Duration::from_millis(800),
        ..quick()
    };
    // The relay publishes m1 (the broker has it) and dies before recording it.
    let (started, _release) = broker.hold_next().await;
    let dying = {
        let (idem, broker) = (idem.clone(), broker.clone());
        tokio::spawn(async move { idem.relay_with(&broker, &options).await })
    };
    tokio::time::timeout(HANG_GUARD, started)
        .await
        .map_err(|_| fail("the relay never published"))?
        .map_err(|_| fail("the relay stopped early"))?;
    dying.abort();
    let _ = dying.await;
    expect_eq("the broker received it", broker.received("m1"), 1)?;
    let claimed = entry(&idem, "m1").await?.ok_or_else(|| fail("m1 listed"))?;
    expect_eq(
        "claimed by the dead relay",
        (claimed.claimed, claimed.attempts),
        (true, 1),
    )?;
    // While the claim lasts, nobody publishes it again.
    let during = idem.relay_with(&broker, &options).await?;
    expect_eq("published during the claim", during.published, 0)?;
    // Once it ran out, the next pass publishes it again (a failed attempt here shows the
    // count: the dead relay's attempt, then this one).
    tokio::time::sleep(options.claim_lease + Duration::from_millis(100)).await;
    broker.fail_times("m1", 1);
    let retried = idem.relay_with(&broker, &options).await?;
    expect_eq("failed", retried.failed.len(), 1)?;
    expect_eq("the failed attempt's number", retried.failed[0].attempts, 2)?;
    relay_until(&idem, &broker, &options, |b| b.confirmed("a").len() == 1).await?;
    expect_eq("sent", entry(&idem, "m1").await?.is_none(), true)?;
    expect_eq("received by the broker", broker.received("m1"), 3)?;
    Ok(vec![(
        "a relay killed after publishing",
        "claim ran out; published again with the same ID; the lost attempt counted".into(),
    )])
}

/// A broker that never confirms: the publish times out, the attempt is counted and the
/// message is not marked sent; it is tried again later.
pub async fn outbox_unconfirmed_publish_times_out<K: Bank>(bank: Arc<K>) -> CaseResult {
    enqueued(&*bank, &[("a", "m1"), ("b", "n1")]).await?;
    let idem = Idem::new(bank.backend().clone());
    let broker = Script::default();
    broker.hang("m1");
    let options = RelayOptions {
        publish_timeout: Duration::from_millis(200),
        claim_lease: Duration::from_secs(5),
        ..quick()
    };
    let report = tokio::time::timeout(HANG_GUARD, idem.relay_with(&broker, &options))
        .await
        .map_err(|_| fail("the relay hung on a silent broker"))??;
    expect_eq("published (n1)", report.published, 1)?;
    expect_eq("failed (m1)", report.failed.len(), 1)?;
    let text = report.failed[0].to_string();
    if !text.contains("did not confirm") {
        return Err(fail(format!("the failure should say it timed out: {text}")));
    }
    let m1 = entry(&idem, "m1").await?.ok_or_else(|| fail("m1 listed"))?;
    expect_eq(
        "m1 not sent, attempt counted",
        (m1.dead, m1.attempts, m1.claimed),
        (false, 1, false),
    )?;
    broker.heal("m1");
    relay_until(&idem, &broker, &options, |b| b.confirmed("a").len() == 1).await?;
    Ok(vec![(
        "a silent broker",
        format!("timed out after 200 ms: {text}"),
    )])
}

/// No transaction is open while a relay waits for the broker: an `execute` on the same
/// database (one that enqueues a message, too) finishes while a publish is still in
/// progress. On SQLite this is the database's only write lock.
pub async fn relay_holds_no_lock_while_publishing<K: Bank>(bank: Arc<K>) -> CaseResult {
    enqueued(&*bank, &[("a", "m1")]).await?;
    bank.set_balance(1, 1000).await?;
    let idem = Idem::new(bank.backend().clone());
    let broker = Script::default();
    let (started, release) = broker.hold_next().await;
    // A publish timeout longer than the writer's bound: the relay cannot give up first.
    let patient = RelayOptions {
        publish_timeout: Duration::from_secs(50),
        claim_lease: Duration::from_secs(120),
        ..quick()
    };
    let relay = {
        let (idem, broker) = (idem.clone(), broker.clone());
        tokio::spawn(async move { idem.relay_with(&broker, &patient).await })
    };
    tokio::time::timeout(HANG_GUARD, started)
        .await
        .map_err(|_| fail("the relay never published"))?
        .map_err(|_| fail("the relay stopped early"))?;
    // The publisher is inside publish(), and stays there until released.
    let backend = bank.backend().clone();
    let message = Outgoing::new("a", "m2", &json!({}))?;
    let debit_scope = Scope::new(Principal::new("account-1")?, Operation::new("debit", 1)?);
    let key = Key::new("while-publishing")?;
    let request = Request::new(json!({ "amount": 10 }));
    let writer = idem.execute(&debit_scope, &key, &request, move |tx| {
        let (backend, message) = (backend.clone(), message.clone());
        Box::pin(async move {
            let b = K::debit(tx, 1, 10).await?;
            backend.enqueue(tx, &message).await?;
            Ok::<_, BankError>(b)
        })
    });
    let written = tokio::time::timeout(Duration::from_secs(20), writer).await;
    let still_publishing = !relay.is_finished();
    let _ = release.send(());
    let report = tokio::time::timeout(HANG_GUARD, relay)
        .await
        .map_err(|_| fail("the relay hung"))?
        .map_err(|e| fail(format!("relay task: {e}")))??;
    match written {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(fail(format!("the execute during publishing failed: {e}"))),
        Err(_) => {
            return Err(fail(
                "the execute did not finish while the relay was publishing: the relay held a lock",
            ));
        }
    }
    expect_eq("the relay was still publishing", still_publishing, true)?;
    expect_eq("published", report.published, 1)?;
    expect_eq("balance", bank.balance(1).await?, 990)?;
    relay_until(&idem, &broker, &quick(), |b| b.confirmed("a").len() == 2).await?;
    Ok(vec![(
        "a publish in progress",
        "an execute that enqueues committed before the publisher returned".into(),
    )])
}
