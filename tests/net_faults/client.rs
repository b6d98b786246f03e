//! The client side: a private namespace reached through the fault proxy, and a caller
//! that retries with the same key until it gets a definite answer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idem::core::{DbError, Error, ErrorKind, Idem};
use idem_conformance::harness::namespace;
use idem_conformance::proxy::{self, Proxy};
use libtest_mimic::Failed;
use serde_json::Value;

use crate::engines::Net;

/// A trial's result.
pub(crate) type Res<T = ()> = Result<T, Failed>;

pub(crate) fn fail(msg: impl Into<String>) -> Failed {
    Failed::from(msg.into())
}

/// Every phased run's lease: short, so that a run whose owner vanished (a lost reply,
/// a cut) is taken over soon.
pub(crate) const LEASE: Duration = Duration::from_millis(500);
/// How long a call waits for a concurrent holder of its key (or a live lease).
pub(crate) const WAIT: Duration = Duration::from_secs(3);
/// A call that has not answered after this long is abandoned (and counted as an
/// indeterminate outcome): a hang guard, generous on a loaded machine.
pub(crate) const PATIENCE: Duration = Duration::from_secs(20);
/// Calls per key before the trial gives up on a definite answer.
const MAX_CALLS: u32 = 60;
/// Keys running at once in a trial.
pub(crate) const CONCURRENCY: usize = 6;
/// Connections in the pool behind the proxy.
const POOL: u32 = 8;
/// The error code of the simulated outage of an external system (the step fails, the
/// run's lease is released, the client retries).
pub(crate) const PROVIDER_DOWN: &str = "provider-down";

/// A trial's database: a private namespace, reached directly (setup, checks) and
/// through the proxy (everything under test).
pub(crate) struct Env<K: Net> {
    pub(crate) bank: K,
    pub(crate) proxy: Arc<Proxy>,
    /// Through the proxy.
    pub(crate) idem: Idem<K::B>,
    /// Straight to the server (setting up runs whose client crashed).
    pub(crate) direct: Idem<K::B>,
}

impl<K: Net> Env<K> {
    pub(crate) async fn open(url: &str, trial: &str) -> Res<Self> {
        let ns = namespace(&format!("nf_{trial}"));
        let bank = K::connect(url, Some(&ns))
            .await
            .map_err(|e| fail(format!("{} at {}: {e}", K::ENGINE, idem::redact(url))))?;
        let env = async {
            bank.setup().await.map_err(|e| fail(e.to_string()))?;
            bank.prepare().await.map_err(|e| fail(e.to_string()))?;
            let loopback = "127.0.0.1:9".parse().map_err(|_| fail("loopback"))?;
            let (_, target) = proxy::through(url, loopback, K::DEFAULT_PORT)
                .ok_or_else(|| fail("cannot find the server's host and port in the URL"))?;
            let proxy = Proxy::start(target, K::WIRE)
                .await
                .map_err(|e| fail(format!("cannot start the proxy: {e}")))?;
            let (proxied, _) = proxy::through(url, proxy.addr(), K::DEFAULT_PORT)
                .ok_or_else(|| fail("cannot rewrite the URL"))?;
            let backend = K::through(&proxied, &ns, POOL)
                .await
                .map_err(|e| fail(format!("through the proxy: {e}")))?;
            let configure = |b: K::B| Idem::new(b).with_lease(LEASE).with_wait_timeout(WAIT);
            Ok::<_, Failed>((
                Arc::new(proxy),
                configure(backend),
                configure(bank.backend().clone()),
            ))
        }
        .await;
        match env {
            Ok((proxy, idem, direct)) => Ok(Self {
                bank,
                proxy,
                idem,
                direct,
            }),
            Err(e) => {
                let _ = bank.close().await;
                Err(e)
            }
        }
    }

    pub(crate) async fn close(self) -> Res {
        let Self {
            bank,
            proxy,
            idem,
            direct,
        } = self;
        drop((idem, direct, proxy));
        bank.close().await.map_err(|e| fail(e.to_string()))
    }
}

/// What one key's client saw.
#[derive(Debug, Default, Clone)]
pub(crate) struct KeyLog {
    pub(crate) key: String,
    /// Calls made.
    pub(crate) calls: u32,
    /// Calls that ended without a definite answer (lost connection, abandoned, busy).
    pub(crate) indefinite: u32,
    /// Definite answers that were replays (or duplicates).
    pub(crate) replays: u32,
    /// Executions this client was told about (`Executed`, `Applied`).
    pub(crate) executed: u32,
    /// Every definite answer's JSON (a stored rejection included).
    pub(crate) answers: Vec<Value>,
    /// A definite answer that is neither success nor the expected rejection.
    pub(crate) unexpected: Option<String>,
}

/// Whether a call's failure leaves the outcome unknown (or just unfinished): the client
/// retries with the same key.
pub(crate) fn indefinite(e: &Error<DbError>) -> bool {
    match e {
        Error::Backend(db) => db.kind() == ErrorKind::Connection || db.kind().is_retryable(),
        // The effect's own statement lost its connection (nothing committed), or the
        // simulated outage: not an answer, so the client tries again.
        Error::Effect(db) => db.kind() == ErrorKind::Connection || db.code() == Some(PROVIDER_DOWN),
        Error::InProgress { .. }
        | Error::LockWait { .. }
        | Error::LeaseLost { .. }
        | Error::RetriesExhausted { .. } => true,
        _ => false,
    }
}

/// Calls `call` until it gives a definite answer (anything [`indefinite`] does not
/// retry), each call bounded by `patience`; returns that answer.
pub(crate) async fn until_definite<T, F, Fut>(
    log: &mut KeyLog,
    patience: Duration,
    mut call: F,
) -> Res<Result<T, Error<DbError>>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error<DbError>>>,
{
    let mut last = String::new();
    for _ in 0..MAX_CALLS {
        log.calls += 1;
        match tokio::time::timeout(patience, call()).await {
            Err(_) => last = format!("no answer within {patience:?} (abandoned)"),
            Ok(Err(e)) if indefinite(&e) => last = e.to_string(),
            Ok(definite) => return Ok(definite),
        }
        log.indefinite += 1;
        tokio::time::sleep(Duration::from_millis(fastrand::u64(20..=60))).await;
    }
    Err(fail(format!(
        "key {}: no definite answer after {MAX_CALLS} calls; the last: {last}",
        log.key
    )))
}

/// The trial's figures.
#[derive(Debug, Default, Clone)]
pub(crate) struct Figures {
    pub(crate) keys: u64,
    pub(crate) calls: u64,
    pub(crate) indefinite: u64,
    pub(crate) replays: u64,
    pub(crate) lost_replies: u64,
    pub(crate) cuts: u64,
    pub(crate) delays: u64,
    pub(crate) unanswered: u64,
    pub(crate) lost: u64,
    pub(crate) doubled: u64,
    pub(crate) moved_back: u64,
    pub(crate) messages_lost: u64,
    /// Hits per planned fault (its name: the path's statement and what was done).
    pub(crate) hits: std::collections::BTreeMap<&'static str, u64>,
    /// Free text added by the trial (relay passes, publishes, …).
    pub(crate) extra: Vec<String>,
}

impl Figures {
    pub(crate) fn add_keys(&mut self, logs: &[KeyLog]) {
        for log in logs {
            self.keys += 1;
            self.calls += u64::from(log.calls);
            self.indefinite += u64::from(log.indefinite);
            self.replays += u64::from(log.replays);
        }
    }

    pub(crate) fn add_proxy(&mut self, proxy: &Proxy) {
        let s = proxy.stats();
        self.lost_replies = s.lost_replies;
        self.cuts = s.cuts;
        self.delays = s.delays;
        self.unanswered = s.unanswered;
    }
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} keys, {} calls ({} indeterminate, retried; {} replays); proxy: {} replies lost, \
             {} connections cut mid-statement, {} replies delayed{}; effects lost {}, doubled {}, \
             runs moved back {}, messages lost {}",
            self.keys,
            self.calls,
            self.indefinite,
            self.replays,
            self.lost_replies,
            self.cuts,
            self.delays,
            if self.unanswered > 0 {
                format!(" ({} lost replies never answered)", self.unanswered)
            } else {
                String::new()
            },
            self.lost,
            self.doubled,
            self.moved_back,
            self.messages_lost
        )?;
        for extra in &self.extra {
            write!(f, "; {extra}")?;
        }
        if !self.hits.is_empty() {
            let hits: Vec<String> = self
                .hits
                .iter()
                .map(|(name, n)| format!("{name} ×{n}"))
                .collect();
            write!(f, "\n    faults hit: {}", hits.join(", "))?;
        }
        Ok(())
    }
}
