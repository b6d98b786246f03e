//! The trials: inject a fault at a known point, retry every key with the same key, then
//! check the invariant.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::core::{DbError, Error, Idem, Key, Operation, Outcome, Principal, Request, Scope};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout};
use tokio::sync::oneshot;
use tokio::time::timeout;

use crate::check::{Verdict, check};
use crate::child::{ChildSpec, Mode};
use crate::engines::{Ctx, Faulty, HANG_GUARD, Hook, fault};

/// A trial's run: its figures line, or why it failed.
pub(crate) type BoxRun = Pin<Box<dyn Future<Output = Result<String, String>> + Send>>;

/// The scope every debit uses.
pub(crate) fn scope() -> Scope {
    Scope::new(
        Principal::new("account-1").expect("valid principal"),
        Operation::new("debit", 1).expect("valid operation"),
    )
}

pub(crate) fn request(amount: i64) -> Request {
    Request::new(json!({"account": crate::engines::ACCOUNT, "amount": amount}))
}

/// One idem call of the correct protocol: the effect runs inside idem's transaction.
/// `hook` and `gate` apply to the first attempt only; `fail` makes the effect fail after
/// its writes (so idem rolls everything back).
pub(crate) async fn execute_once<K: Faulty>(
    idem: Arc<Idem<K::B>>,
    key: String,
    amount: i64,
    gate: bool,
    hook: Option<Hook>,
    fail: bool,
) -> Result<Outcome<Value>, Error<DbError>> {
    let id = Key::new(key.clone()).map_err(Error::InvalidInput)?;
    let hook = Mutex::new(hook);
    idem.execute(&scope(), &id, &request(amount), |tx| {
        let hook = hook.lock().ok().and_then(|mut h| h.take());
        let gate = gate && hook.is_some();
        let applied = K::apply(tx, key.clone(), amount, gate, hook);
        Box::pin(async move {
            let value = applied.await?;
            if fail {
                Err(fault("injected effect failure after the writes"))
            } else {
                Ok(value)
            }
        })
    })
    .await
}

/// One call of the deliberately BROKEN protocol: the record (with a response made up
/// before the effect) is committed by idem in a transaction of its own, and the effect
/// runs afterwards in a second transaction. A crash between the two loses the effect
/// while every retry replays the record.
pub(crate) async fn broken_once<K: Faulty>(
    idem: &Idem<K::B>,
    key: String,
    amount: i64,
    hang: bool,
) -> Result<Value, String> {
    let id = Key::new(key.clone()).map_err(|e| e.to_string())?;
    let accepted = json!({"accepted": key.clone()});
    let outcome = idem
        .execute(&scope(), &id, &request(amount), |_tx| {
            let accepted = accepted.clone();
            Box::pin(async move { Ok::<_, DbError>(accepted) })
        })
        .await
        .map_err(|e| e.to_string())?;
    if let Outcome::Executed(reply) = outcome {
        K::apply_alone(idem.backend(), key, amount, hang)
            .await
            .map_err(|e| e.to_string())?;
        Ok(reply)
    } else {
        Ok(outcome.into_inner())
    }
}

/// The other BROKEN protocol: the effect commits in a transaction of its own first,
/// then idem stores the record. A crash between the two leaves an effect without a
/// record, so the retry applies it again. With `hang`, prints `READY` between the two
/// and hangs until the process is killed.
pub(crate) async fn broken_effect_first<K: Faulty>(
    idem: &Idem<K::B>,
    key: String,
    amount: i64,
    hang: bool,
) -> Result<Value, String> {
    let id = Key::new(key.clone()).map_err(|e| e.to_string())?;
    let reply = K::apply_alone(idem.backend(), key, amount, false)
        .await
        .map_err(|e| e.to_string())?;
    if hang {
        crate::child::say("READY 0");
        tokio::time::sleep(HANG_GUARD).await;
    }
    let outcome = idem
        .execute(&scope(), &id, &request(amount), |_tx| {
            let reply = reply.clone();
            Box::pin(async move { Ok::<_, DbError>(reply) })
        })
        .await
        .map_err(|e| e.to_string())?;
    Ok(outcome.into_inner())
}

/// Figures of one trial.
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    kills: u64,
    failed: u64,
    executed: u64,
    replayed: u64,
}

/// An open trial: its private namespace, its client, what it planned and was told.
struct Run<K: Faulty> {
    ctx: Ctx,
    ns: String,
    bank: K,
    idem: Arc<Idem<K::B>>,
    plan: Vec<(String, i64)>,
    replies: Vec<(String, Value)>,
    tally: Tally,
}

fn text(e: impl fmt::Display) -> String {
    e.to_string()
}

async fn guard<T>(what: &str, fut: impl Future<Output = T>) -> Result<T, String> {
    timeout(HANG_GUARD, fut)
        .await
        .map_err(|_| format!("hang guard: {what} did not finish in {HANG_GUARD:?}"))
}

/// Polls `probe` every 10 ms until it yields a value (bounded by the hang guard).
async fn until<T, F, Fut>(what: &str, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, DbError>>,
{
    guard(what, async {
        loop {
            if let Some(v) = probe().await.map_err(text)? {
                return Ok(v);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await?
}

impl<K: Faulty> Run<K> {
    async fn open(ctx: Ctx) -> Result<Self, String> {
        let ns = format!(
            "idem_faults_{}_{}_{:08x}",
            ctx.trial,
            std::process::id(),
            fastrand::u32(..)
        );
        let bank = K::connect(&ctx.url, Some(&ns)).await.map_err(|e| {
            format!(
                "{} is required and unreachable at {}: {e}",
                K::ENGINE,
                ctx.url
            )
        })?;
        let ready = async {
            bank.setup().await?;
            bank.prepare().await
        }
        .await;
        if let Err(e) = ready {
            let _ = bank.close().await;
            return Err(format!("preparing {ns}: {e}"));
        }
        let idem = Arc::new(Idem::new(bank.backend().clone()));
        Ok(Self {
            ctx,
            ns,
            bank,
            idem,
            plan: Vec::new(),
            replies: Vec::new(),
            tally: Tally::default(),
        })
    }

    /// Plans a key (its amount is distinct enough that a doubled debit shows).
    fn key(&mut self, prefix: &str, i: u32) -> (String, i64) {
        let key = format!("{prefix}-{i}");
        let amount = 10 + i64::from(i % 13) + 100 * i64::from(self.plan.len() as u32 % 7);
        self.plan.push((key.clone(), amount));
        (key, amount)
    }

    /// Records a call's outcome.
    fn outcome(&mut self, key: &str, result: Result<Outcome<Value>, Error<DbError>>) {
        self.tally.requests += 1;
        match result {
            Ok(o) => {
                if o.is_replayed() {
                    self.tally.replayed += 1;
                } else {
                    self.tally.executed += 1;
                }
                self.replies.push((key.to_owned(), o.into_inner()));
            }
            Err(_) => self.tally.failed += 1,
        }
    }

    /// Retries `key` with the same key until it succeeds (bounded; the checker reports a
    /// key that never did).
    async fn settle(&mut self, key: &str, amount: i64) {
        for _ in 0..50 {
            let result = guard(
                "a retry",
                execute_once::<K>(
                    Arc::clone(&self.idem),
                    key.into(),
                    amount,
                    false,
                    None,
                    false,
                ),
            )
            .await;
            let ok = matches!(result, Ok(Ok(_)));
            match result {
                Ok(r) => self.outcome(key, r),
                Err(_) => self.tally.failed += 1,
            }
            if ok {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn kill(&mut self, session: i64) -> Result<(), String> {
        self.bank.kill(session).await.map_err(text)?;
        self.tally.kills += 1;
        Ok(())
    }

    fn spawn_call(
        &self,
        key: &str,
        amount: i64,
        gate: bool,
        hook: Option<Hook>,
        fail: bool,
    ) -> tokio::task::JoinHandle<Result<Outcome<Value>, Error<DbError>>> {
        tokio::spawn(execute_once::<K>(
            Arc::clone(&self.idem),
            key.into(),
            amount,
            gate,
            hook,
            fail,
        ))
    }

    async fn join(
        &mut self,
        key: &str,
        task: tokio::task::JoinHandle<Result<Outcome<Value>, Error<DbError>>>,
    ) -> Result<(), String> {
        let result = guard("a call", task).await?.map_err(text)?;
        self.outcome(key, result);
        Ok(())
    }

    /// Starts a child process running idem on this namespace.
    fn child(&self, mode: Mode, keys: Vec<(String, i64)>) -> Result<ChildProc, String> {
        let (url, ns) = self.bank.child_location(&self.ctx.url, &self.ns);
        let spec = ChildSpec {
            engine: K::ENGINE.into(),
            url,
            ns,
            mode,
            keys,
        };
        let exe = std::env::current_exe().map_err(text)?;
        let mut child = tokio::process::Command::new(exe)
            .env(
                crate::CHILD_ENV,
                serde_json::to_string(&spec).map_err(text)?,
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start a child client: {e}"))?;
        let stdout = child.stdout.take().ok_or("child has no stdout")?;
        Ok(ChildProc {
            child,
            lines: BufReader::new(stdout).lines(),
        })
    }

    /// SIGKILLs a child and waits for it to be gone.
    async fn sigkill(&mut self, mut proc: ChildProc) -> Result<(), String> {
        proc.child.start_kill().map_err(text)?;
        guard("a killed child", proc.child.wait())
            .await?
            .map_err(text)?;
        self.tally.kills += 1;
        Ok(())
    }

    /// Snapshot, check, drop the namespace; the figures line, or every violation.
    async fn finish(self) -> Result<(Verdict, String), String> {
        let snapshot = guard("the snapshot", self.bank.snapshot()).await;
        let closed = guard("dropping the namespace", self.bank.close()).await;
        let snapshot = snapshot?.map_err(text)?;
        closed?.map_err(text)?;
        let verdict = check(&self.plan, &self.replies, &snapshot);
        let t = &self.tally;
        let line = format!(
            "scale {}: {} keys, {} requests ({} executed, {} replayed, {} failed), {} kills; {verdict}",
            self.ctx.scale,
            self.plan.len(),
            t.requests,
            t.executed,
            t.replayed,
            t.failed,
            t.kills
        );
        Ok((verdict, line))
    }
}

/// Fails the trial when the checker found violations.
async fn verified<K: Faulty>(run: Run<K>) -> Result<String, String> {
    let (verdict, line) = run.finish().await?;
    if verdict.violations.is_empty() {
        Ok(line)
    } else {
        Err(line)
    }
}

/// Runs `body`, then always checks and drops the namespace.
macro_rules! trial {
    ($ctx:expr, |$run:ident| $body:block) => {{
        let mut $run = Run::<K>::open($ctx).await?;
        let result: Result<(), String> = async { $body }.await;
        match result {
            Ok(()) => verified($run).await,
            Err(e) => {
                let tail = $run.finish().await.map(|(_, l)| l).unwrap_or_else(|e| e);
                Err(format!("{e}\n  (state: {tail})"))
            }
        }
    }};
}

/// A session killed while its claim waits for a concurrent holder of the same key; the
/// holder then commits (even rounds) or fails (odd rounds).
pub(crate) async fn killed_in_claim<K: Faulty>(ctx: Ctx) -> Result<String, String> {
    let rounds = 4 * ctx.scale;
    trial!(ctx, |run| {
        for i in 0..rounds {
            let (key, amount) = run.key("claim", i);
            let (at, at_rx) = oneshot::channel();
            let (go, go_rx) = oneshot::channel();
            let hook = Hook::Pause {
                at,
                go: Some(go_rx),
            };
            let holder = run.spawn_call(&key, amount, false, Some(hook), i % 2 == 1);
            let holder_session = guard("the holder's effect", at_rx).await?.map_err(text)?;
            let mut victim = run.spawn_call(&key, amount, false, None, false);
            let bank = &run.bank;
            let waiting = until("a claim waiting for the holder", || {
                bank.lock_waiter(holder_session)
            });
            let waiter = tokio::select! {
                w = waiting => w?,
                done = &mut victim => {
                    return Err(format!("round {i}: the second claim did not wait for the holder: {done:?}"));
                }
            };
            run.kill(waiter).await?;
            run.join(&key, victim).await?;
            let _ = go.send(());
            run.join(&key, holder).await?;
            run.settle(&key, amount).await;
        }
        Ok(())
    })
}

/// A session killed between the effect's two statements.
pub(crate) async fn killed_in_effect<K: Faulty>(ctx: Ctx) -> Result<String, String> {
    let rounds = 4 * ctx.scale;
    trial!(ctx, |run| {
        for i in 0..rounds {
            let (key, amount) = run.key("effect", i);
            let (at, at_rx) = oneshot::channel();
            let (go, go_rx) = oneshot::channel();
            let hook = Hook::Pause {
                at,
                go: Some(go_rx),
            };
            let call = run.spawn_call(&key, amount, false, Some(hook), false);
            let session = guard("the effect", at_rx).await?.map_err(text)?;
            run.kill(session).await?;
            let _ = go.send(());
            run.join(&key, call).await?;
            run.settle(&key, amount).await;
        }
        Ok(())
    })
}

/// A session killed while stopped at the commit gate (even rounds), or just as the gate
/// opens, racing the commit (odd rounds).
pub(crate) async fn killed_at_commit<K: Faulty>(ctx: Ctx) -> Result<String, String> {
    let rounds = 4 * ctx.scale;
    trial!(ctx, |run| {
        for i in 0..rounds {
            let (key, amount) = run.key("commit", i);
            let gate = run.bank.close_gate().await.map_err(text)?;
            let (at, at_rx) = oneshot::channel();
            let hook = Hook::Pause { at, go: None };
            let call = run.spawn_call(&key, amount, true, Some(hook), false);
            let session = guard("the effect", at_rx).await?.map_err(text)?;
            // Whatever happens, the gate opens again: a waiter left behind it would
            // hold its transaction (and the namespace's drop) forever.
            let stopped = async {
                let bank = &run.bank;
                until("the commit gate", || async move {
                    Ok(bank.at_gate(session).await?.then_some(()))
                })
                .await?;
                if i % 2 == 0 {
                    run.kill(session).await?;
                }
                Ok::<_, String>(())
            }
            .await;
            let opened = gate.open().await.map_err(text);
            stopped?;
            opened?;
            if i % 2 == 1 {
                run.kill(session).await?;
            }
            run.join(&key, call).await?;
            run.settle(&key, amount).await;
        }
        Ok(())
    })
}

/// A child process running idem, and its stdout.
struct ChildProc {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl ChildProc {
    /// The next line the child prints (`None` when it exited).
    async fn line(&mut self) -> Result<Option<String>, String> {
        guard("a child's output", self.lines.next_line())
            .await?
            .map_err(text)
    }

    /// Waits for `READY <session>`.
    async fn ready(&mut self) -> Result<i64, String> {
        loop {
            match self.line().await? {
                Some(l) => {
                    if let Some(s) = l.strip_prefix("READY ") {
                        return s.trim().parse().map_err(text);
                    }
                }
                None => return Err("the child exited before it was ready".into()),
            }
        }
    }
}

fn parse_ok(line: &str) -> Option<(String, Value)> {
    let rest = line.strip_prefix("OK ")?;
    let (key, json) = rest.split_once(' ')?;
    Some((key.to_owned(), serde_json::from_str(json).ok()?))
}

/// Client processes SIGKILLed inside the effect, at the commit gate (engines with one),
/// and at a random point of a stream of debits.
pub(crate) async fn process_killed<K: Faulty>(ctx: Ctx) -> Result<String, String> {
    let rounds = 2 * ctx.scale;
    let stream = 20 * ctx.scale;
    trial!(ctx, |run| {
        for i in 0..rounds {
            let (key, amount) = run.key("proc-effect", i);
            let mut proc = run.child(Mode::HangInEffect, vec![(key.clone(), amount)])?;
            proc.ready().await?;
            run.sigkill(proc).await?;
            run.tally.requests += 1;
            run.tally.failed += 1;
            run.settle(&key, amount).await;
        }
        if K::SESSIONS_KILLABLE {
            for i in 0..rounds {
                let (key, amount) = run.key("proc-commit", i);
                let gate = run.bank.close_gate().await.map_err(text)?;
                let mut proc = run.child(Mode::AtGate, vec![(key.clone(), amount)])?;
                let stopped = async {
                    let session = proc.ready().await?;
                    let bank = &run.bank;
                    until("the child at the commit gate", || async move {
                        Ok(bank.at_gate(session).await?.then_some(()))
                    })
                    .await?;
                    run.sigkill(proc).await
                }
                .await;
                // The server goes on with a transaction whose client is gone.
                let opened = gate.open().await.map_err(text);
                stopped?;
                opened?;
                run.tally.requests += 1;
                run.tally.failed += 1;
                run.settle(&key, amount).await;
            }
        }
        let keys: Vec<(String, i64)> = (0..stream).map(|j| run.key("proc-stream", j)).collect();
        let kill_after = fastrand::usize(1..keys.len().max(2));
        let mut proc = run.child(Mode::Stream, keys.clone())?;
        let mut seen = 0;
        while seen < kill_after {
            match proc.line().await? {
                Some(l) => {
                    if let Some(reply) = parse_ok(&l) {
                        run.replies.push(reply);
                        run.tally.requests += 1;
                        run.tally.executed += 1;
                        seen += 1;
                    }
                }
                None => break,
            }
        }
        // Land somewhere inside the next call: claim, effect or commit.
        tokio::time::sleep(Duration::from_micros(fastrand::u64(0..3000))).await;
        run.sigkill(proc).await?;
        run.tally.requests += 1;
        run.tally.failed += 1;
        for (key, amount) in keys {
            run.settle(&key, amount).await;
        }
        Ok(())
    })
}

/// The broken protocols under the same fault (a client process killed between their
/// two transactions): the checker must report a lost effect for "record first" and a
/// doubled one for "effect first".
pub(crate) async fn broken_protocol<K: Faulty>(ctx: Ctx) -> Result<String, String> {
    let rounds = ctx.scale;
    let mut run = Run::<K>::open(ctx).await?;
    let body: Result<(), String> = async {
        for i in 0..rounds {
            for mode in [Mode::Broken, Mode::BrokenEffectFirst] {
                let prefix = match mode {
                    Mode::Broken => "record-first",
                    _ => "effect-first",
                };
                let (key, amount) = run.key(prefix, i);
                let mut proc = run.child(mode, vec![(key.clone(), amount)])?;
                proc.ready().await?;
                run.sigkill(proc).await?;
                run.tally.requests += 1;
                run.tally.failed += 1;
                // The broken client's retry with the same key.
                let retry = match mode {
                    Mode::Broken => {
                        guard(
                            "a broken retry",
                            broken_once::<K>(&run.idem, key.clone(), amount, false),
                        )
                        .await?
                    }
                    _ => {
                        guard(
                            "a broken retry",
                            broken_effect_first::<K>(&run.idem, key.clone(), amount, false),
                        )
                        .await?
                    }
                };
                let reply = retry?;
                run.tally.requests += 1;
                // "Record first" replays its record; "effect first" runs the effect again.
                match mode {
                    Mode::Broken => run.tally.replayed += 1,
                    _ => run.tally.executed += 1,
                }
                run.replies.push((key, reply));
            }
        }
        Ok(())
    }
    .await;
    let (verdict, line) = run.finish().await?;
    body?;
    let rounds = rounds as usize;
    if verdict.lost >= rounds && verdict.doubled >= rounds {
        Ok(format!(
            "the checker caught both broken protocols, as it must: {line}"
        ))
    } else {
        Err(format!(
            "the checker did NOT catch the broken protocols (expected {rounds} lost and {rounds} doubled): {line}"
        ))
    }
}
