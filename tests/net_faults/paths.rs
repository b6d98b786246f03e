//! One trial per group of paths that commit. Each key of a trial gets one planned fault
//! (or none), armed on the proxy by markers that name the key, so keys run
//! concurrently without hitting each other's faults; its client then retries with the
//! same key until it gets a definite answer, and the checker reads the database.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt, stream};
use idem::core::runs::OutboxRow as Relayed;
use idem::core::{
    BoxFuture, Consumed, DbError, Error, ErrorKind, Key, MessageId, Operation, OutboxStore,
    Outcome, Outgoing, Principal, Publisher, RelayOptions, Request, Run, Scope, Started,
    Subscriber,
};
use idem_conformance::proxy::{Fault, FaultId, Marker, Proxy, Trigger};
use serde_json::{Value, json};

use crate::check::{self, Verdict};
use crate::client::{
    CONCURRENCY, Env, Figures, KeyLog, LEASE, PATIENCE, PROVIDER_DOWN, Res, fail, until_definite,
};
use crate::engines::{Net, Tx};

/// A reply delay the client waits out.
const SHORT_DELAY: Duration = Duration::from_millis(300);
/// A reply delay past the client's patience in that variant ([`IMPATIENT`]).
const LONG_DELAY: Duration = Duration::from_millis(2500);
const IMPATIENT: Duration = Duration::from_secs(1);
/// No trial's background loop (the completer, the relay) runs longer than this.
const LOOP_GUARD: Duration = Duration::from_secs(120);

fn scope(operation: &str) -> Res<Scope> {
    Ok(Scope::new(
        Principal::new("nf-client").map_err(|e| fail(e.to_string()))?,
        Operation::new(operation, 1).map_err(|e| fail(e.to_string()))?,
    ))
}

fn key(k: &str) -> Res<Key> {
    Key::new(k).map_err(|e| fail(e.to_string()))
}

fn nonce() -> u64 {
    fastrand::u64(..)
}

/// `INSERT`/`UPDATE` … `table` … with `key` bound.
fn stmt(kind: &str, table: &str, key: &str) -> Marker {
    Marker::kind(kind).with(table).with(key)
}

/// Which of an engine's statements claim a key and write its record's answer, found by
/// the proxy by their words, a table and the key: what the claim and completion
/// variants below aim at.
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    /// The statement that claims the key in its transaction: a placeholder `INSERT`, or,
    /// with PostgreSQL's key lock, the re-read after the lock (`… LEFT JOIN …`).
    pub(crate) claim: fn(&str, &str) -> Marker,
    /// The statement that writes the answer before `COMMIT`: the placeholder's `UPDATE`,
    /// or, with the key lock, the complete record's `INSERT` (sent with `COMMIT`).
    pub(crate) complete: fn(&str, &str) -> Marker,
}

impl Shape {
    /// A placeholder claim: `INSERT`, then `UPDATE` (MySQL/MariaDB, PostgreSQL's
    /// `ClaimStyle::Placeholder`).
    pub(crate) const PLACEHOLDER: Self = Self {
        claim: |table, key| stmt("INSERT", table, key),
        complete: |table, key| stmt("UPDATE", table, key),
    };
    /// PostgreSQL's key lock: the re-read claims; the session's prepared completion
    /// (`EXECUTE idem_cr_…` for requests, `idem_cm_…` for messages) completes.
    pub(crate) const KEY_LOCK: Self = Self {
        claim: |table, key| stmt("SELECT", table, key).with("LEFT JOIN"),
        complete: |table, key| {
            let name = if table == "idem_request_result" {
                "idem_cr_"
            } else {
                "idem_cm_"
            };
            Marker::kind("EXECUTE").with(name).with(key)
        },
    };
}

/// A fault for a key, given the engine's [`Shape`].
type FaultFor = fn(&str, Shape) -> Option<Fault>;

/// A planned fault: its name (for reports) and the fault for a key.
#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    fault: FaultFor,
    patience: Duration,
}

const fn variant(name: &'static str, fault: FaultFor) -> Variant {
    Variant {
        name,
        fault,
        patience: PATIENCE,
    }
}

/// Runs `each` for every key, [`CONCURRENCY`] at a time.
async fn run_keys<T, F, Fut>(items: Vec<T>, each: F) -> Res<Vec<KeyLog>>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = Res<KeyLog>>,
{
    stream::iter(items.into_iter().map(each))
        .buffer_unordered(CONCURRENCY)
        .try_collect()
        .await
}

/// Faults armed for keys, and whether each hit.
#[derive(Default)]
struct Planned {
    armed: Mutex<Vec<(String, &'static str, FaultId)>>,
}

impl Planned {
    fn arm(&self, proxy: &Proxy, key: &str, name: &'static str, fault: Option<Fault>) {
        if let Some(f) = fault {
            let id = proxy.arm(f);
            self.armed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((key.to_owned(), name, id));
        }
    }

    /// Hits per fault name.
    fn hits(&self, proxy: &Proxy) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for (_, name, id) in self.armed.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            *out.entry(*name).or_insert(0) += u64::from(proxy.hits(*id));
        }
        out
    }

    /// Every planned fault must have hit: a marker that finds nothing tests nothing.
    fn check(&self, proxy: &Proxy, verdict: &mut Verdict) {
        for (key, name, id) in self.armed.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            if proxy.hits(*id) == 0 {
                verdict.violation(format!("key {key}: the planned fault \"{name}\" never hit"));
            }
        }
    }
}

fn records_by_key(
    snapshot: &crate::engines::Snapshot,
) -> BTreeMap<&str, Vec<&crate::engines::RequestRow>> {
    let mut out: BTreeMap<&str, Vec<_>> = BTreeMap::new();
    for r in &snapshot.requests {
        out.entry(r.key.as_str()).or_default().push(r);
    }
    out
}

// ---------------------------------------------------------------- execute

fn execute_effect<K: Net>(tx: &mut Tx<K>, key: String) -> BoxFuture<'_, Result<Value, DbError>> {
    Box::pin(async move {
        K::ledger(tx, key.clone(), "execute").await?;
        Ok(json!({ "key": key, "nonce": nonce() }))
    })
}

const EXECUTE: [Variant; 7] = [
    variant("commit: reply lost", |k, _| {
        Some(Fault::lose_reply(Trigger::commit_after(
            Marker::containing("nf_ledger").with(k),
        )))
    }),
    variant("claim: reply lost", |k, s| {
        Some(Fault::lose_reply(Trigger::on((s.claim)(
            "idem_request_result",
            k,
        ))))
    }),
    variant("completion: cut", |k, s| {
        Some(Fault::cut(Trigger::on((s.complete)(
            "idem_request_result",
            k,
        ))))
    }),
    variant("commit: cut", |k, _| {
        Some(Fault::cut(Trigger::commit_after(
            Marker::containing("nf_ledger").with(k),
        )))
    }),
    variant("commit: reply delayed", |k, _| {
        Some(Fault::delay(
            SHORT_DELAY,
            Trigger::commit_after(Marker::containing("nf_ledger").with(k)),
        ))
    }),
    Variant {
        name: "commit: reply delayed past the client's patience",
        fault: |k, _| {
            Some(Fault::delay(
                LONG_DELAY,
                Trigger::commit_after(Marker::containing("nf_ledger").with(k)),
            ))
        },
        patience: IMPATIENT,
    },
    variant("none", |_, _| None),
];

/// `Idem::execute`: the effect and the record commit together.
pub(crate) async fn execute<K: Net>(env: &Env<K>, scale: u32) -> Res<Figures> {
    let scope = scope("nf-execute")?;
    let planned = Planned::default();
    let n = EXECUTE.len() * 2 * scale as usize;
    let items: Vec<(String, Variant)> = (0..n)
        .map(|i| (format!("nf-ex-{i:04}"), EXECUTE[i % EXECUTE.len()]))
        .collect();
    let logs = run_keys(items, |(k, v)| {
        let (scope, planned) = (&scope, &planned);
        async move {
            let mut log = KeyLog {
                key: k.clone(),
                ..KeyLog::default()
            };
            planned.arm(&env.proxy, &k, v.name, (v.fault)(&k, K::shape()));
            let key = key(&k)?;
            let request = Request::new(json!({ "key": k }));
            let answer = until_definite(&mut log, v.patience, || {
                env.idem.execute(scope, &key, &request, |tx| {
                    execute_effect::<K>(tx, k.clone())
                })
            })
            .await?;
            match answer {
                Ok(Outcome::Executed(v)) => {
                    log.executed += 1;
                    log.answers.push(v);
                }
                Ok(Outcome::Replayed(v)) => {
                    log.replays += 1;
                    log.answers.push(v);
                }
                Err(e) => log.unexpected = Some(e.to_string()),
            }
            Ok(log)
        }
    })
    .await?;
    let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
    let mut verdict = Verdict::default();
    planned.check(&env.proxy, &mut verdict);
    let ledger = check::ledger_counts(&snapshot);
    let records = records_by_key(&snapshot);
    for log in &logs {
        let got = ledger
            .get(&(log.key.clone(), "execute".to_owned()))
            .copied()
            .unwrap_or(0);
        verdict.applications(&log.key, "execute", got, 1);
        let mine = records.get(log.key.as_str()).cloned().unwrap_or_default();
        if mine.len() != 1 || mine[0].status != Some(0) {
            verdict.violation(format!("key {}: records {mine:?}", log.key));
        }
        verdict.answers(log, mine.first().and_then(|r| r.response.as_deref()));
    }
    let keys: BTreeSet<String> = logs.iter().map(|l| l.key.clone()).collect();
    check::strays(&mut verdict, &snapshot, &keys);
    let mut figures = Figures::default();
    figures.add_keys(&logs);
    figures.add_proxy(&env.proxy);
    figures.hits = planned.hits(&env.proxy);
    verdict.conclude(&mut figures).map_err(fail)?;
    Ok(figures)
}

// ---------------------------------------------------------------- execute_final

fn final_effect<K: Net>(
    tx: &mut Tx<K>,
    key: String,
    reject: bool,
) -> BoxFuture<'_, Result<Result<Value, Value>, DbError>> {
    Box::pin(async move {
        K::ledger(tx, key.clone(), "final").await?;
        let answer = json!({ "key": key, "nonce": nonce() });
        Ok(if reject { Err(answer) } else { Ok(answer) })
    })
}

/// `(name, fault for an accepted key, fault for a rejected key)`.
type FinalVariant = (&'static str, FaultFor, FaultFor);

const FINAL: [FinalVariant; 5] = [
    (
        "answer stored: reply lost",
        |k, s| {
            Some(Fault::lose_reply(Trigger::commit_after((s.complete)(
                "idem_request_result",
                k,
            ))))
        },
        |k, s| {
            Some(Fault::lose_reply(Trigger::commit_after((s.complete)(
                "idem_request_result",
                k,
            ))))
        },
    ),
    (
        "answer stored: cut",
        |k, s| {
            Some(Fault::cut(Trigger::on((s.complete)(
                "idem_request_result",
                k,
            ))))
        },
        |k, s| {
            Some(Fault::cut(Trigger::on((s.complete)(
                "idem_request_result",
                k,
            ))))
        },
    ),
    (
        "claim: reply lost; rejected: the rollback's reply lost",
        |k, s| {
            Some(Fault::lose_reply(Trigger::on((s.claim)(
                "idem_request_result",
                k,
            ))))
        },
        |k, _| {
            Some(Fault::lose_reply(
                Trigger::on(Marker::containing("nf_ledger").with(k)).then(Marker::kind("ROLLBACK")),
            ))
        },
    ),
    (
        "answer stored: reply delayed",
        |k, s| {
            Some(Fault::delay(
                SHORT_DELAY,
                Trigger::commit_after((s.complete)("idem_request_result", k)),
            ))
        },
        |k, s| {
            Some(Fault::delay(
                SHORT_DELAY,
                Trigger::commit_after((s.complete)("idem_request_result", k)),
            ))
        },
    ),
    ("none", |_, _| None, |_, _| None),
];

/// `Idem::execute_final`: accepted keys commit their effect; rejected keys roll it back
/// and store the rejection in a transaction of its own.
pub(crate) async fn execute_final<K: Net>(env: &Env<K>, scale: u32) -> Res<Figures> {
    let scope = scope("nf-final")?;
    let planned = Planned::default();
    let n = FINAL.len() * 2 * scale as usize;
    let items: Vec<(String, bool, FinalVariant)> = (0..n)
        .map(|i| {
            let reject = (i / FINAL.len()) % 2 == 1;
            (format!("nf-fi-{i:04}"), reject, FINAL[i % FINAL.len()])
        })
        .collect();
    let rejected: BTreeSet<String> = items
        .iter()
        .filter(|(_, r, _)| *r)
        .map(|(k, _, _)| k.clone())
        .collect();
    let logs = run_keys(items, |(k, reject, (name, accepted, refused))| {
        let (scope, planned) = (&scope, &planned);
        async move {
            let mut log = KeyLog {
                key: k.clone(),
                ..KeyLog::default()
            };
            let fault = if reject {
                refused(&k, K::shape())
            } else {
                accepted(&k, K::shape())
            };
            planned.arm(&env.proxy, &k, name, fault);
            let key = key(&k)?;
            let request = Request::new(json!({ "key": k }));
            let answer = until_definite(&mut log, PATIENCE, || {
                env.idem.execute_final(scope, &key, &request, |tx| {
                    final_effect::<K>(tx, k.clone(), reject)
                })
            })
            .await?;
            match answer {
                Ok(Outcome::Executed(r)) => {
                    log.executed += 1;
                    log.answers.push(r.unwrap_or_else(|j| j));
                }
                Ok(Outcome::Replayed(r)) => {
                    log.replays += 1;
                    log.answers.push(r.unwrap_or_else(|j| j));
                }
                Err(e) => log.unexpected = Some(e.to_string()),
            }
            Ok(log)
        }
    })
    .await?;
    let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
    let mut verdict = Verdict::default();
    planned.check(&env.proxy, &mut verdict);
    let ledger = check::ledger_counts(&snapshot);
    let records = records_by_key(&snapshot);
    for log in &logs {
        let reject = rejected.contains(&log.key);
        let got = ledger
            .get(&(log.key.clone(), "final".to_owned()))
            .copied()
            .unwrap_or(0);
        // A rejection's writes are rolled back: its effect leaves no row.
        verdict.applications(&log.key, "final", got, usize::from(!reject));
        let mine = records.get(log.key.as_str()).cloned().unwrap_or_default();
        let status = Some(i64::from(reject));
        if mine.len() != 1 || mine[0].status != status {
            verdict.violation(format!(
                "key {}: expected one record with status {status:?}, found {mine:?}",
                log.key
            ));
        }
        verdict.answers(log, mine.first().and_then(|r| r.response.as_deref()));
    }
    let keys: BTreeSet<String> = logs.iter().map(|l| l.key.clone()).collect();
    check::strays(&mut verdict, &snapshot, &keys);
    let mut figures = Figures::default();
    figures.add_keys(&logs);
    figures.add_proxy(&env.proxy);
    figures.hits = planned.hits(&env.proxy);
    figures.extra.push(format!(
        "{} keys rejected (stored), {} accepted",
        rejected.len(),
        logs.len() - rejected.len()
    ));
    verdict.conclude(&mut figures).map_err(fail)?;
    Ok(figures)
}

// ---------------------------------------------------------------- consume

fn consume_effect<K: Net>(tx: &mut Tx<K>, key: String) -> BoxFuture<'_, Result<(), DbError>> {
    K::ledger(tx, key, "consume")
}

const CONSUME: [Variant; 6] = [
    variant("commit: reply lost", |k, _| {
        Some(Fault::lose_reply(Trigger::commit_after(
            Marker::containing("nf_ledger").with(k),
        )))
    }),
    variant("claim: reply lost", |k, s| {
        Some(Fault::lose_reply(Trigger::on((s.claim)(
            "idem_processed_message",
            k,
        ))))
    }),
    variant("claim: cut", |k, s| {
        Some(Fault::cut(Trigger::on((s.claim)(
            "idem_processed_message",
            k,
        ))))
    }),
    variant("commit: cut", |k, _| {
        Some(Fault::cut(Trigger::commit_after(
            Marker::containing("nf_ledger").with(k),
        )))
    }),
    variant("commit: reply delayed", |k, _| {
        Some(Fault::delay(
            SHORT_DELAY,
            Trigger::commit_after(Marker::containing("nf_ledger").with(k)),
        ))
    }),
    variant("none", |_, _| None),
];

/// `Idem::consume`: the message ID commits with the effect; a redelivery is a
/// duplicate.
pub(crate) async fn consume<K: Net>(env: &Env<K>, scale: u32) -> Res<Figures> {
    let subscriber = Subscriber::new("nf-projection").map_err(|e| fail(e.to_string()))?;
    let planned = Planned::default();
    let n = CONSUME.len() * 2 * scale as usize;
    let items: Vec<(String, Variant)> = (0..n)
        .map(|i| (format!("nf-co-{i:04}"), CONSUME[i % CONSUME.len()]))
        .collect();
    let logs = run_keys(items, |(k, v)| {
        let (subscriber, planned) = (&subscriber, &planned);
        async move {
            let mut log = KeyLog {
                key: k.clone(),
                ..KeyLog::default()
            };
            planned.arm(&env.proxy, &k, v.name, (v.fault)(&k, K::shape()));
            let id = MessageId::new(k.as_str()).map_err(|e| fail(e.to_string()))?;
            let payload = Request::new(json!({ "message": k }));
            let answer = until_definite(&mut log, v.patience, || {
                env.idem.consume(subscriber, &id, Some(&payload), |tx| {
                    consume_effect::<K>(tx, k.clone())
                })
            })
            .await?;
            match answer {
                Ok(Consumed::Applied(())) => log.executed += 1,
                Ok(Consumed::Duplicate) => log.replays += 1,
                Err(e) => log.unexpected = Some(e.to_string()),
            }
            Ok(log)
        }
    })
    .await?;
    let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
    let mut verdict = Verdict::default();
    planned.check(&env.proxy, &mut verdict);
    let ledger = check::ledger_counts(&snapshot);
    let processed: BTreeSet<&str> = snapshot.messages.iter().map(String::as_str).collect();
    for log in &logs {
        let got = ledger
            .get(&(log.key.clone(), "consume".to_owned()))
            .copied()
            .unwrap_or(0);
        verdict.applications(&log.key, "consume", got, 1);
        if !processed.contains(log.key.as_str()) {
            verdict.violation(format!("message {}: not recorded as processed", log.key));
        }
        if log.executed == 0 && log.indefinite == 0 {
            verdict.violation(format!(
                "message {}: a duplicate on its first delivery",
                log.key
            ));
        }
        if let Some(e) = &log.unexpected {
            verdict.violation(format!("message {}: unexpected answer: {e}", log.key));
        }
    }
    let keys: BTreeSet<String> = logs.iter().map(|l| l.key.clone()).collect();
    check::strays(&mut verdict, &snapshot, &keys);
    let mut figures = Figures::default();
    figures.add_keys(&logs);
    figures.add_proxy(&env.proxy);
    figures.hits = planned.hits(&env.proxy);
    verdict.conclude(&mut figures).map_err(fail)?;
    Ok(figures)
}

// ---------------------------------------------------------------- phased runs

/// Where in a run a planned fault is armed (just before that call, so that the
/// fault's markers can name the run's key and its table without telling the calls
/// apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Moment {
    Start,
    FirstPhase,
    /// The step fails once at `reserved` (the provider is down): `execute_phased`
    /// releases the lease.
    Release,
    Heartbeat,
    SecondPhase,
    /// `finish` (even keys) or `fail` (odd keys).
    End,
    /// The completer takes the stalled run over.
    Takeover,
    Never,
}

#[derive(Clone, Copy)]
struct PhasedVariant {
    name: &'static str,
    moment: Moment,
    fault: fn(&str) -> Option<Fault>,
}

const fn at(name: &'static str, moment: Moment, fault: fn(&str) -> Option<Fault>) -> PhasedVariant {
    PhasedVariant {
        name,
        moment,
        fault,
    }
}

fn run_write(k: &str) -> Marker {
    stmt("UPDATE", "idem_run", k)
}

fn phase_write(k: &str, point: &str) -> Marker {
    Marker::containing("nf_history").with(k).with(point)
}

const PHASED: [PhasedVariant; 12] = [
    at("start: reply lost", Moment::Start, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(stmt(
            "INSERT", "idem_run", k,
        ))))
    }),
    at("start: cut", Moment::Start, |k| {
        Some(Fault::cut(Trigger::on(stmt("INSERT", "idem_run", k))))
    }),
    at("first phase: reply lost", Moment::FirstPhase, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(phase_write(
            k, "reserved",
        ))))
    }),
    at("second phase: reply lost", Moment::SecondPhase, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(phase_write(
            k, "charged",
        ))))
    }),
    at(
        "second phase: cut at the run's write",
        Moment::SecondPhase,
        |k| Some(Fault::cut(Trigger::on(run_write(k)))),
    ),
    at("heartbeat: reply lost", Moment::Heartbeat, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(run_write(k))))
    }),
    at("heartbeat: cut", Moment::Heartbeat, |k| {
        Some(Fault::cut(Trigger::on(run_write(k))))
    }),
    at("release: reply lost", Moment::Release, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(run_write(k))))
    }),
    at("finish/fail: reply lost", Moment::End, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(run_write(k))))
    }),
    at("finish/fail: cut at the run's write", Moment::End, |k| {
        Some(Fault::cut(Trigger::on(run_write(k))))
    }),
    at("first phase: reply delayed", Moment::FirstPhase, |k| {
        Some(Fault::delay(
            SHORT_DELAY,
            Trigger::commit_after(phase_write(k, "reserved")),
        ))
    }),
    at("none", Moment::Never, |_| None),
];

const COMPLETE: [PhasedVariant; 6] = [
    at("takeover: reply lost", Moment::Takeover, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(run_write(k))))
    }),
    at("takeover: cut", Moment::Takeover, |k| {
        Some(Fault::cut(Trigger::on(run_write(k))))
    }),
    at("second phase: reply lost", Moment::SecondPhase, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(phase_write(
            k, "charged",
        ))))
    }),
    at("heartbeat: reply lost", Moment::Heartbeat, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(run_write(k))))
    }),
    at("finish/fail: reply lost", Moment::End, |k| {
        Some(Fault::lose_reply(Trigger::commit_after(run_write(k))))
    }),
    at("none", Moment::Never, |_| None),
];

struct Plan {
    variant: PhasedVariant,
    armed: bool,
    provider_down: bool,
    /// The outbox message the run's end enqueues.
    message: Option<String>,
}

/// The phased trials' shared state: each key's plan, armed from inside the step.
struct Steps {
    proxy: Arc<Proxy>,
    planned: Planned,
    plans: Mutex<HashMap<String, Plan>>,
}

impl Steps {
    fn new(proxy: Arc<Proxy>, plans: impl IntoIterator<Item = (String, PhasedVariant)>) -> Self {
        Self {
            proxy,
            planned: Planned::default(),
            plans: Mutex::new(
                plans
                    .into_iter()
                    .map(|(k, variant)| {
                        (
                            k,
                            Plan {
                                variant,
                                armed: false,
                                provider_down: false,
                                message: None,
                            },
                        )
                    })
                    .collect(),
            ),
        }
    }

    fn with_plan<T>(&self, key: &str, f: impl FnOnce(&mut Plan) -> T) -> Option<T> {
        self.plans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(key)
            .map(f)
    }

    /// Arms the key's fault if it belongs at `moment` and was not armed yet.
    fn arm(&self, key: &str, moment: Moment) {
        let due = self.with_plan(key, |p| {
            if p.variant.moment == moment && !p.armed {
                p.armed = true;
                Some(p.variant)
            } else {
                None
            }
        });
        if let Some(Some(v)) = due {
            self.planned.arm(&self.proxy, key, v.name, (v.fault)(key));
        }
    }

    /// Whether the provider is down for this key now (once, for the release variant).
    fn provider_down(&self, key: &str) -> bool {
        self.with_plan(key, |p| {
            let down = p.variant.moment == Moment::Release && !p.provider_down;
            p.provider_down = true;
            down
        })
        .unwrap_or(false)
    }

    fn note_message(&self, key: &str, id: &str) {
        self.with_plan(key, |p| p.message = Some(id.to_owned()));
    }

    fn message(&self, key: &str) -> Option<String> {
        self.with_plan(key, |p| p.message.clone()).flatten()
    }
}

/// A phased key's name says how its run ends: `…-ok` finishes, `…-no` fails.
fn phased_key(prefix: &str, i: usize, variants: usize) -> String {
    let ends = if (i / variants).is_multiple_of(2) {
        "ok"
    } else {
        "no"
    };
    format!("{prefix}-{i:04}-{ends}")
}

fn succeeds(key: &str) -> bool {
    key.ends_with("-ok")
}

fn end_effect<'t, K: Net>(
    tx: &'t mut Tx<K>,
    backend: K::B,
    key: String,
    message: Outgoing,
    step: &'static str,
) -> BoxFuture<'t, Result<Value, DbError>> {
    Box::pin(async move {
        K::ledger(tx, key.clone(), step).await?;
        backend.enqueue(tx, &message).await?;
        Ok(json!({ "key": key, "status": step, "nonce": nonce() }))
    })
}

/// The operation's step: `started` → phase `reserved` → (heartbeat) phase `charged` →
/// finish (`…-ok` keys) or fail (`…-no` keys), each end enqueueing one outbox message.
fn order_step<K: Net>(
    steps: Arc<Steps>,
) -> impl for<'r> FnMut(&'r mut Run<K::B>) -> BoxFuture<'r, Result<(), Error<DbError>>> + Send + 'static
{
    move |run| {
        let steps = Arc::clone(&steps);
        Box::pin(async move {
            let k = run.key().as_str().to_owned();
            let principal = run.scope().principal.as_str().to_owned();
            let operation = run.scope().operation.as_str().to_owned();
            match run.point() {
                "started" => {
                    steps.arm(&k, Moment::FirstPhase);
                    run.phase("reserved", |tx| {
                        K::phase_effect(
                            tx,
                            principal.clone(),
                            operation.clone(),
                            k.clone(),
                            "reserved",
                        )
                    })
                    .await?;
                }
                "reserved" => {
                    if steps.provider_down(&k) {
                        steps.arm(&k, Moment::Release);
                        return Err(Error::Effect(
                            DbError::new("net_faults", ErrorKind::Other, "the provider is down")
                                .with_code(PROVIDER_DOWN),
                        ));
                    }
                    steps.arm(&k, Moment::Heartbeat);
                    run.heartbeat::<DbError>().await?;
                    steps.arm(&k, Moment::SecondPhase);
                    run.phase("charged", |tx| {
                        K::phase_effect(
                            tx,
                            principal.clone(),
                            operation.clone(),
                            k.clone(),
                            "charged",
                        )
                    })
                    .await?;
                }
                _ => {
                    steps.arm(&k, Moment::End);
                    let backend = run.backend().clone();
                    if succeeds(&k) {
                        let id = run.message_id("order.paid");
                        steps.note_message(&k, &id);
                        let message = Outgoing::new("nf.orders", &id, &json!({ "key": k }))?;
                        run.finish(|tx| {
                            end_effect::<K>(
                                tx,
                                backend.clone(),
                                k.clone(),
                                message.clone(),
                                "finish",
                            )
                        })
                        .await?;
                    } else {
                        let id = run.message_id("order.failed");
                        steps.note_message(&k, &id);
                        let message = Outgoing::new("nf.orders", &id, &json!({ "key": k }))?;
                        run.fail(|tx| {
                            end_effect::<K>(tx, backend.clone(), k.clone(), message.clone(), "fail")
                        })
                        .await?;
                    }
                }
            }
            Ok(())
        })
    }
}

/// A client's call of a phased run until it gets a definite answer.
async fn phased_client<K: Net>(
    env: &Env<K>,
    steps: &Arc<Steps>,
    scope: &Scope,
    k: String,
) -> Res<KeyLog> {
    let mut log = KeyLog {
        key: k.clone(),
        ..KeyLog::default()
    };
    steps.arm(&k, Moment::Start);
    let key = key(&k)?;
    let request = Request::new(json!({ "key": k }));
    let answer = until_definite(&mut log, PATIENCE, || {
        env.idem.execute_phased::<Value, DbError, _>(
            scope,
            &key,
            &request,
            order_step::<K>(Arc::clone(steps)),
        )
    })
    .await?;
    let want_success = succeeds(&k);
    match answer {
        Ok(Outcome::Executed(v)) if want_success => {
            log.executed += 1;
            log.answers.push(v);
        }
        Ok(Outcome::Replayed(v)) if want_success => {
            log.replays += 1;
            log.answers.push(v);
        }
        Err(Error::StoredRejection(v)) if !want_success => log.answers.push(v),
        other => log.unexpected = Some(format!("{other:?}")),
    }
    Ok(log)
}

/// Checks the runs of a phased trial: each ended as planned at `charged`, each phase
/// and each end applied once, the point never moved back, every answer the stored one,
/// one outbox message per run.
fn check_runs(
    steps: &Steps,
    logs: &[KeyLog],
    snapshot: &crate::engines::Snapshot,
    verdict: &mut Verdict,
) {
    steps.planned.check(&steps.proxy, verdict);
    let ledger = check::ledger_counts(snapshot);
    check::history(verdict, snapshot);
    let runs: BTreeMap<&str, &crate::engines::RunRow> =
        snapshot.runs.iter().map(|r| (r.key.as_str(), r)).collect();
    let mut outbox: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &snapshot.outbox {
        *outbox.entry(m.message_id.as_str()).or_insert(0) += 1;
    }
    for log in logs {
        let k = log.key.as_str();
        let success = succeeds(k);
        let Some(run) = runs.get(k) else {
            verdict.violation(format!("key {k}: no run"));
            continue;
        };
        let want_status = Some(i64::from(!success));
        if run.status != want_status || run.point != "charged" {
            verdict.violation(format!(
                "key {k}: the run ended at point {} with status {:?}, expected charged with {want_status:?}",
                run.point, run.status
            ));
        }
        let (end, other) = if success {
            ("finish", "fail")
        } else {
            ("fail", "finish")
        };
        for (step, want) in [("reserved", 1), ("charged", 1), (end, 1), (other, 0)] {
            let got = ledger
                .get(&(log.key.clone(), step.to_owned()))
                .copied()
                .unwrap_or(0);
            verdict.applications(k, step, got, want);
        }
        verdict.answers(log, run.response.as_deref());
        match steps.message(k) {
            Some(id) => {
                let n = outbox.get(id.as_str()).copied().unwrap_or(0);
                if n != 1 {
                    verdict.violation(format!(
                        "key {k}: its end's outbox message {id} is stored {n} times"
                    ));
                }
            }
            None => verdict.violation(format!("key {k}: the run never reached its end")),
        }
    }
    let keys: BTreeSet<String> = logs.iter().map(|l| l.key.clone()).collect();
    check::strays(verdict, snapshot, &keys);
}

/// Phased runs driven by their clients (`Idem::execute_phased`): `start`, both phases,
/// `heartbeat`, `release` (after a failed step), `finish` and `fail`, each with its
/// commit's reply lost, its write cut or its reply delayed.
pub(crate) async fn phased<K: Net>(env: &Env<K>, scale: u32) -> Res<Figures> {
    let scope = scope("nf-order")?;
    let n = PHASED.len() * 2 * scale as usize;
    let keys: Vec<String> = (0..n)
        .map(|i| phased_key("nf-ph", i, PHASED.len()))
        .collect();
    let steps = Arc::new(Steps::new(
        Arc::clone(&env.proxy),
        keys.iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), PHASED[i % PHASED.len()])),
    ));
    let logs = run_keys(keys, |k| phased_client(env, &steps, &scope, k)).await?;
    let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
    let mut verdict = Verdict::default();
    check_runs(&steps, &logs, &snapshot, &mut verdict);
    let mut figures = Figures::default();
    figures.add_keys(&logs);
    figures.add_proxy(&env.proxy);
    figures.hits = steps.planned.hits(&env.proxy);
    verdict.conclude(&mut figures).map_err(fail)?;
    Ok(figures)
}

/// The completer (`Idem::complete`): runs whose client vanished after the first phase
/// are taken over and driven to their end through the proxy, with the takeover's, a
/// phase's, a heartbeat's and the end's commit replies lost; then each client retries
/// and must get the stored answer.
pub(crate) async fn complete<K: Net>(env: &Env<K>, scale: u32) -> Res<Figures> {
    let scope = scope("nf-order")?;
    let n = COMPLETE.len() * 2 * scale as usize;
    let keys: Vec<String> = (0..n)
        .map(|i| phased_key("nf-cp", i, COMPLETE.len()))
        .collect();
    let steps = Arc::new(Steps::new(
        Arc::clone(&env.proxy),
        keys.iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), COMPLETE[i % COMPLETE.len()])),
    ));
    // The clients start their runs straight at the server, commit the first phase and
    // vanish (no release: their leases run out).
    let (principal, operation) = (
        scope.principal.as_str().to_owned(),
        scope.operation.as_str().to_owned(),
    );
    for k in &keys {
        let request = Request::new(json!({ "key": k }));
        let mut run = match env
            .direct
            .start::<DbError>(&scope, &key(k)?, &request)
            .await
        {
            Ok(Started::Run(run)) => run,
            other => return Err(fail(format!("starting {k}: {other:?}"))),
        };
        run.phase("reserved", |tx| {
            K::phase_effect(
                tx,
                principal.clone(),
                operation.clone(),
                k.clone(),
                "reserved",
            )
        })
        .await
        .map_err(|e| fail(format!("first phase of {k}: {e}")))?;
    }
    for k in &keys {
        steps.arm(k, Moment::Takeover);
    }
    let began = Instant::now();
    let (mut passes, mut completer_errors, mut left) = (0_u32, 0_u32, 0_u64);
    loop {
        tokio::time::sleep(LEASE).await;
        passes += 1;
        match env
            .idem
            .complete(100, order_step::<K>(Arc::clone(&steps)))
            .await
        {
            Ok(report) => left += report.operations.values().map(|o| o.left).sum::<u64>(),
            Err(_) => completer_errors += 1,
        }
        let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
        if snapshot.runs.iter().all(|r| r.status.is_some()) {
            break;
        }
        if began.elapsed() > LOOP_GUARD {
            return Err(fail(format!(
                "the completer left runs unfinished after {passes} passes: {:?}",
                snapshot
                    .runs
                    .iter()
                    .filter(|r| r.status.is_none())
                    .map(|r| (&r.key, &r.point))
                    .collect::<Vec<_>>()
            )));
        }
    }
    // The clients come back and retry: the stored answer.
    let logs = run_keys(keys, |k| phased_client(env, &steps, &scope, k)).await?;
    let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
    let mut verdict = Verdict::default();
    check_runs(&steps, &logs, &snapshot, &mut verdict);
    for log in &logs {
        if log.executed > 0 {
            verdict.violation(format!(
                "key {}: the client's retry ran the run again instead of replaying it",
                log.key
            ));
        }
    }
    let mut figures = Figures::default();
    figures.add_keys(&logs);
    figures.add_proxy(&env.proxy);
    figures.hits = steps.planned.hits(&env.proxy);
    figures.extra.push(format!(
        "completer: {passes} passes, {left} drives handed back to a later pass by a fault, {completer_errors} passes failed"
    ));
    verdict.conclude(&mut figures).map_err(fail)?;
    Ok(figures)
}

// ---------------------------------------------------------------- outbox

/// A publisher that keeps every message it got (a broker that never refuses).
#[derive(Default)]
struct Recorder {
    got: Mutex<Vec<String>>,
}

impl Publisher for Recorder {
    type Error = Infallible;
    async fn publish(&self, message: &Relayed) -> Result<(), Infallible> {
        self.got
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(message.message_id.clone());
        Ok(())
    }
}

fn enqueue_effect<K: Net>(
    tx: &mut Tx<K>,
    backend: K::B,
    key: String,
    messages: Vec<Outgoing>,
    refuse: bool,
) -> BoxFuture<'_, Result<Value, DbError>> {
    Box::pin(async move {
        K::ledger(tx, key.clone(), "enqueue").await?;
        for m in &messages {
            backend.enqueue(tx, m).await?;
        }
        if refuse {
            return Err(DbError::new(
                "net_faults",
                ErrorKind::Other,
                "refused after enqueueing",
            ));
        }
        Ok(json!({ "key": key, "nonce": nonce() }))
    })
}

fn msg(k: &str) -> String {
    format!("m-{k}")
}

const ENQUEUE: [Variant; 6] = [
    variant("enqueue: cut", |k, _| {
        Some(Fault::cut(Trigger::on(stmt(
            "INSERT",
            "idem_outbox",
            &msg(k),
        ))))
    }),
    variant("enqueue: reply lost", |k, _| {
        Some(Fault::lose_reply(Trigger::on(stmt(
            "INSERT",
            "idem_outbox",
            &msg(k),
        ))))
    }),
    variant("commit after enqueue: reply lost", |k, _| {
        Some(Fault::lose_reply(Trigger::commit_after(stmt(
            "INSERT",
            "idem_outbox",
            &msg(k),
        ))))
    }),
    variant("commit after enqueue: cut", |k, _| {
        Some(Fault::cut(Trigger::commit_after(stmt(
            "INSERT",
            "idem_outbox",
            &msg(k),
        ))))
    }),
    // The effect fails after enqueueing: its messages must never be published.
    variant("refused", |_, _| None),
    variant("none", |_, _| None),
];

/// The relay's faults, one armed per pass in turn.
fn relay_fault(i: usize) -> (&'static str, Fault) {
    let claim = || Marker::containing("idem_outbox").with("FOR UPDATE");
    let mark = || {
        Marker::kind("UPDATE")
            .with("idem_outbox")
            .with("SET sent_at")
    };
    match i % 5 {
        0 => (
            "relay claim: reply lost",
            Fault::lose_reply(Trigger::commit_after(claim())),
        ),
        1 => (
            "relay mark-sent: reply lost",
            Fault::lose_reply(Trigger::commit_after(mark())),
        ),
        2 => ("relay mark-sent: cut", Fault::cut(Trigger::on(mark()))),
        3 => ("relay claim: cut", Fault::cut(Trigger::on(claim()))),
        _ => (
            "relay mark-sent: reply delayed",
            Fault::delay(SHORT_DELAY, Trigger::commit_after(mark())),
        ),
    }
}

/// `enqueue` inside an effect, then the relay (its claim and its mark-sent) through the
/// proxy: every committed message published at least once, none of a rolled-back
/// effect ever.
pub(crate) async fn outbox<K: Net>(env: &Env<K>, scale: u32) -> Res<Figures> {
    let scope = scope("nf-enqueue")?;
    let planned = Planned::default();
    let n = ENQUEUE.len() * 2 * scale as usize;
    let items: Vec<(String, Variant)> = (0..n)
        .map(|i| (format!("nf-ob-{i:04}"), ENQUEUE[i % ENQUEUE.len()]))
        .collect();
    let refused: BTreeSet<String> = items
        .iter()
        .filter(|(_, v)| v.name == "refused")
        .map(|(k, _)| k.clone())
        .collect();
    // Every third key also sends a second message to a second destination.
    let messages = |i_key: &str| -> Res<Vec<Outgoing>> {
        let mut out = vec![
            Outgoing::new("nf.a", &msg(i_key), &json!({ "key": i_key }))
                .map_err(|e| fail(e.to_string()))?,
        ];
        let number = i_key.rsplit('-').next().and_then(|n| n.parse::<u32>().ok());
        if number.is_some_and(|n| n.is_multiple_of(3)) {
            out.push(
                Outgoing::new("nf.b", &format!("m2-{i_key}"), &json!({ "key": i_key }))
                    .map_err(|e| fail(e.to_string()))?,
            );
        }
        Ok(out)
    };
    let logs = run_keys(items, |(k, v)| {
        let (scope, planned, refused) = (&scope, &planned, &refused);
        async move {
            let mut log = KeyLog {
                key: k.clone(),
                ..KeyLog::default()
            };
            planned.arm(&env.proxy, &k, v.name, (v.fault)(&k, K::shape()));
            let key = key(&k)?;
            let request = Request::new(json!({ "key": k }));
            let out = messages(&k)?;
            let refuse = refused.contains(&k);
            let backend = env.idem.backend().clone();
            let answer = until_definite(&mut log, v.patience, || {
                env.idem.execute(scope, &key, &request, |tx| {
                    enqueue_effect::<K>(tx, backend.clone(), k.clone(), out.clone(), refuse)
                })
            })
            .await?;
            match answer {
                Ok(Outcome::Executed(v)) if !refuse => {
                    log.executed += 1;
                    log.answers.push(v);
                }
                Ok(Outcome::Replayed(v)) if !refuse => {
                    log.replays += 1;
                    log.answers.push(v);
                }
                Err(Error::Effect(_)) if refuse => {}
                other => log.unexpected = Some(format!("{other:?}")),
            }
            Ok(log)
        }
    })
    .await?;
    // The relay, through the proxy, with one fault armed per pass (for the first
    // passes), in small batches so that it takes several passes.
    let recorder = Recorder::default();
    let began = Instant::now();
    let (mut passes, mut relay_errors, mut relay_hits) = (0_usize, 0_u32, 0_u32);
    let mut relay_by_name: BTreeMap<&'static str, u64> = BTreeMap::new();
    let faulted_passes = 10 * scale as usize;
    // Short claims and retry pauses: a claim whose reply was lost (or whose relay pass
    // failed) runs out in a second instead of the production minute, so the trial
    // measures the protocol, not the lease.
    let relay_options = RelayOptions {
        claim_lease: Duration::from_secs(1),
        publish_timeout: Duration::from_millis(500),
        base_delay: Duration::from_millis(50),
        max_delay: Duration::from_millis(200),
        max_attempts: 1000,
        ..RelayOptions::with_batch(2)
    };
    loop {
        let armed = (passes < faulted_passes).then(|| {
            let (name, fault) = relay_fault(passes);
            (name, env.proxy.arm(fault))
        });
        passes += 1;
        let pass = env.idem.relay_with(&recorder, &relay_options).await;
        if let Some((name, id)) = armed {
            let hits = env.proxy.hits(id);
            relay_hits += hits;
            *relay_by_name.entry(name).or_insert(0) += u64::from(hits);
            env.proxy.disarm(id);
        }
        let published = match pass {
            Ok(report) => report.published,
            Err(_) => {
                relay_errors += 1;
                1
            }
        };
        if published == 0 && env.bank.unsent().await.map_err(|e| fail(e.to_string()))? == 0 {
            break;
        }
        if began.elapsed() > LOOP_GUARD {
            return Err(fail(format!(
                "the relay left messages unsent after {passes} passes"
            )));
        }
        if published == 0 {
            // Rows another pass claimed (or a lock still held): give it a moment.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let got = recorder
        .got
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let snapshot = env.bank.snapshot().await.map_err(|e| fail(e.to_string()))?;
    let mut verdict = Verdict::default();
    planned.check(&env.proxy, &mut verdict);
    let ledger = check::ledger_counts(&snapshot);
    let records = records_by_key(&snapshot);
    let mut stored: BTreeMap<&str, (usize, bool)> = BTreeMap::new();
    for m in &snapshot.outbox {
        let e = stored.entry(m.message_id.as_str()).or_insert((0, true));
        e.0 += 1;
        e.1 &= m.sent;
    }
    let mut published: BTreeMap<&str, usize> = BTreeMap::new();
    for id in &got {
        *published.entry(id.as_str()).or_insert(0) += 1;
    }
    for log in &logs {
        let refuse = refused.contains(&log.key);
        let got = ledger
            .get(&(log.key.clone(), "enqueue".to_owned()))
            .copied()
            .unwrap_or(0);
        verdict.applications(&log.key, "enqueue", got, usize::from(!refuse));
        let mine = records.get(log.key.as_str()).cloned().unwrap_or_default();
        if refuse {
            if !mine.is_empty() {
                verdict.violation(format!("key {}: a refused effect left a record", log.key));
            }
            if let Some(e) = &log.unexpected {
                verdict.violation(format!("key {}: unexpected answer: {e}", log.key));
            }
        } else {
            verdict.answers(log, mine.first().and_then(|r| r.response.as_deref()));
        }
        for m in messages(&log.key)? {
            let id = m.message_id();
            let (rows, sent) = stored.get(id).copied().unwrap_or((0, false));
            let times = published.get(id).copied().unwrap_or(0);
            if refuse {
                if rows > 0 || times > 0 {
                    verdict.violation(format!(
                        "message {id} of a refused effect: stored {rows} times, published {times} times"
                    ));
                }
                continue;
            }
            if rows != 1 {
                verdict.violation(format!("message {id}: stored {rows} times, expected once"));
            }
            if !sent {
                verdict.violation(format!("message {id}: not marked sent"));
            }
            if times == 0 {
                verdict.messages_lost += 1;
                verdict.violation(format!("message {id}: never published (lost)"));
            }
        }
    }
    for id in published.keys() {
        if !stored.contains_key(id) {
            verdict.violation(format!("message {id}: published but not in the outbox"));
        }
    }
    let keys: BTreeSet<String> = logs.iter().map(|l| l.key.clone()).collect();
    check::strays(&mut verdict, &snapshot, &keys);
    let mut figures = Figures::default();
    figures.add_keys(&logs);
    figures.add_proxy(&env.proxy);
    figures.hits = planned.hits(&env.proxy);
    figures.hits.extend(relay_by_name);
    figures.extra.push(format!(
        "relay: {passes} passes ({faulted_passes} with a fault armed, {relay_hits} hit, \
         {relay_errors} failed), {} publishes of {} messages",
        got.len(),
        published.len()
    ));
    verdict.conclude(&mut figures).map_err(fail)?;
    Ok(figures)
}
