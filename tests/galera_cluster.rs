//! Exactly-once across a 3-node MariaDB Galera cluster: cross-node storms, certification
//! failures retried with the same key, the replay fast path on a lagging node, an
//! effect that ends idem's transaction, and a node killed (SIGKILL) mid-storm.
//!
//! Run it through `ci/galera.sh run cargo test -p idem-tests --features cluster,mysql
//! --test galera_cluster`: the script starts the private cluster and sets
//! `IDEM_GALERA_URLS` and `IDEM_GALERA_PIDS`; without them every trial fails. The trials
//! run one at a time, in order, and the node kill comes last (it leaves two nodes).
//! Each prints its counts.

#![allow(clippy::unwrap_used)]

#[path = "cluster_support.rs"]
mod support;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::core::{Backend, Claim, Idem, Identity, Key, Outcome, Request, RetryPolicy, Scope};
use idem::core::{Error, Operation, Principal};
use idem::mysql::mysql_async::prelude::Queryable;
use idem::mysql::mysql_async::{Opts, OptsBuilder, Pool, Row};
use idem::mysql::{MysqlBackend, galera, parse_url};
use idem_conformance::mysql::MysqlBank;
use idem_conformance::{Balance, Bank, BankError};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::json;
use support::{Counted, Stats, count_effect_error, guarded, lost_server};

type Node = Idem<Counted<MysqlBackend>>;
type Res = Result<Outcome<Balance>, Error<BankError>>;

/// The cluster the script started.
#[derive(Debug, Clone)]
struct Cluster {
    urls: Vec<String>,
    pids: Vec<u32>,
}

fn cluster() -> Result<Cluster, String> {
    let hint = "run this target through `ci/galera.sh run cargo test …`, which starts the cluster";
    let urls: Vec<String> = std::env::var("IDEM_GALERA_URLS")
        .map_err(|_| format!("IDEM_GALERA_URLS is not set: {hint}"))?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let pids: Vec<u32> = std::env::var("IDEM_GALERA_PIDS")
        .map_err(|_| format!("IDEM_GALERA_PIDS is not set: {hint}"))?
        .split_whitespace()
        .map(|p| p.parse().map_err(|_| format!("bad PID {p:?}")))
        .collect::<Result<_, _>>()?;
    if urls.len() != 3 || pids.len() != 3 {
        return Err(format!(
            "expected 3 node URLs and 3 PIDs, got {urls:?} and {pids:?}"
        ));
    }
    Ok(Cluster { urls, pids })
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The node's URL with another database.
fn with_db(url: &str, db: &str) -> Result<Opts, String> {
    let opts = parse_url(url).map_err(err)?;
    Ok(OptsBuilder::from_opts(opts).db_name(Some(db)).into())
}

/// A private database on the cluster, an idem per node, and causal read pools for checks.
struct Fixture {
    main: MysqlBank,
    db: String,
    nodes: Vec<Arc<Node>>,
    backends: Vec<MysqlBackend>,
    /// Causal (`wsrep_sync_wait = 1`) pools, one per node, for the final checks.
    verify: Vec<Pool>,
    stats: Arc<Stats>,
}

impl Fixture {
    async fn new(c: &Cluster, name: &str, accounts: i64, balance: i64) -> Result<Self, String> {
        let db = idem_conformance::harness::namespace(name);
        let main = MysqlBank::connect(&c.urls[0], Some(&db))
            .await
            .map_err(|e| format!("cannot reach Galera node 1 ({}): {e}", c.urls[0]))?;
        main.setup().await.map_err(err)?;
        for account in 1..=accounts {
            main.set_balance(account, balance).await.map_err(err)?;
        }
        // DDL is replicated in total order, but the other nodes apply it after node 1
        // returns: wait (bounded) until every node has the tables and the accounts.
        for (i, url) in c.urls.iter().enumerate().skip(1) {
            let pool = Pool::new(with_db(url, &db)?);
            let mut ready = false;
            for _ in 0..200 {
                if let Ok(mut conn) = pool.get_conn().await {
                    let n: Result<Option<i64>, _> = conn
                        .query_first("SELECT COUNT(*) FROM idem_demo_account")
                        .await;
                    if matches!(n, Ok(Some(n)) if n == accounts) {
                        ready = true;
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = pool.disconnect().await;
            if !ready {
                return Err(format!("node {} never showed the fixture's tables", i + 1));
            }
        }
        let stats = Arc::new(Stats::default());
        let retry = RetryPolicy {
            max_attempts: 40,
            base_delay: Duration::from_millis(2),
            max_delay: Duration::from_millis(100),
        };
        let (mut nodes, mut backends, mut verify) = (Vec::new(), Vec::new(), Vec::new());
        for (i, url) in c.urls.iter().enumerate() {
            let opts = with_db(url, &db)?;
            let backend = if i == 0 {
                main.backend().clone()
            } else {
                MysqlBackend::connect_with(opts.clone())
                    .await
                    .map_err(|e| format!("cannot reach Galera node {}: {e}", i + 1))?
            };
            backends.push(backend.clone());
            nodes.push(Arc::new(
                Idem::new(Counted {
                    inner: backend,
                    stats: Arc::clone(&stats),
                })
                .with_retry(retry),
            ));
            verify.push(Pool::new(galera::causal_reads(opts)));
        }
        Ok(Self {
            main,
            db,
            nodes,
            backends,
            verify,
            stats,
        })
    }

    /// `(total balance, request records)` read causally on node `i`.
    async fn totals(&self, i: usize) -> Result<(i64, u64), String> {
        let mut conn = self.verify[i].get_conn().await.map_err(err)?;
        let row: Option<Row> = conn
            .query_first(
                "SELECT CAST(SUM(balance) AS SIGNED), (SELECT COUNT(*) FROM idem_request_result) \
                 FROM idem_demo_account",
            )
            .await
            .map_err(err)?;
        let mut row = row.ok_or("no totals row")?;
        let sum: i64 = row.take_opt(0).ok_or("no sum")?.map_err(err)?;
        let count: u64 = row.take_opt(1).ok_or("no count")?.map_err(err)?;
        Ok((sum, count))
    }

    async fn close(self, dead: Option<usize>) {
        for (i, pool) in self.verify.into_iter().enumerate() {
            if Some(i) != dead {
                let _ = pool.disconnect().await;
            }
        }
        drop(self.nodes);
        for (i, b) in self.backends.into_iter().enumerate().skip(1) {
            if Some(i) != dead {
                let _ = b.disconnect().await;
            }
        }
        if let Err(e) = self.main.close().await {
            eprintln!("warning: database {} left behind: {e}", self.db);
        }
    }
}

fn scope() -> Scope {
    Scope::new(
        Principal::new("galera-client").unwrap(),
        Operation::new("debit", 1).unwrap(),
    )
}

fn request(account: i64, amount: i64) -> Request {
    Request::new(json!({ "account": account, "amount": amount }))
}

/// One idempotent debit through `node`.
async fn debit(node: &Node, stats: &Arc<Stats>, key: &str, account: i64, amount: i64) -> Res {
    let key = Key::new(key)?;
    let stats = Arc::clone(stats);
    node.execute(&scope(), &key, &request(account, amount), move |tx| {
        let stats = Arc::clone(&stats);
        Box::pin(async move {
            let r = MysqlBank::debit(tx, account, amount).await;
            if let Err(e) = &r {
                count_effect_error(&stats, e);
            }
            r
        })
    })
    .await
}

/// Calls that failed with an engine error the client retried itself (same key, same
/// node). On Galera these are transactions a replicated write set aborted ("brute-force
/// abort") between statements, which the backend reports as "the idem transaction ended
/// inside the effect": nothing of that attempt committed.
static CLIENT_RETRIES: AtomicU64 = AtomicU64::new(0);

/// [`debit`], retried by the client (at most 5 times) after a backend error that is not
/// a lost server.
async fn debit_retrying(
    node: &Node,
    stats: &Arc<Stats>,
    key: &str,
    account: i64,
    amount: i64,
) -> Res {
    let mut tries = 0;
    loop {
        tries += 1;
        match debit(node, stats, key, account, amount).await {
            Err(Error::Backend(_)) if tries < 5 => {
                CLIENT_RETRIES.fetch_add(1, Ordering::SeqCst);
            }
            other => return other,
        }
    }
}

fn client_retries() -> String {
    format!(
        "calls failed with another engine error (on Galera: a transaction brute-force aborted between statements) and retried by the client with the same key: {}",
        CLIENT_RETRIES.swap(0, Ordering::SeqCst)
    )
}

async fn cluster_has_three_nodes(c: Cluster) -> Result<String, String> {
    let mut sizes = Vec::new();
    for url in &c.urls {
        let pool = Pool::new(parse_url(url).map_err(err)?);
        let mut conn = pool
            .get_conn()
            .await
            .map_err(|e| format!("cannot reach Galera node {url}: {e}"))?;
        let row: Option<(String, String)> = conn
            .query_first("SHOW STATUS LIKE 'wsrep_cluster_size'")
            .await
            .map_err(err)?;
        drop(conn);
        let _ = pool.disconnect().await;
        sizes.push(row.map(|r| r.1).unwrap_or_default());
    }
    if sizes.iter().any(|s| s != "3") {
        return Err(format!(
            "wsrep_cluster_size per node: {sizes:?}, expected 3"
        ));
    }
    Ok("wsrep_cluster_size = 3 on every node".into())
}

async fn same_key_storm(c: Cluster) -> Result<String, String> {
    const N: usize = 64;
    const START: i64 = 1_000_000;
    let f = Fixture::new(&c, "g_same_key", 1, START).await?;
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (node, stats, barrier) = (
            Arc::clone(&f.nodes[i % 3]),
            Arc::clone(&f.stats),
            Arc::clone(&barrier),
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            (
                i % 3,
                debit_retrying(&node, &stats, "checkout-42", 1, 100).await,
            )
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.map_err(err)?);
    }
    let check = async {
        let mut winner = None;
        for (node, r) in &results {
            match r {
                Ok(Outcome::Executed(b)) => {
                    if winner.replace((*node, *b)).is_some() {
                        return Err("two calls executed the effect".to_owned());
                    }
                }
                Ok(Outcome::Replayed(_)) => {}
                Err(e) => return Err(format!("a call on node {} failed: {e}", node + 1)),
            }
        }
        let (wnode, wresp) = winner.ok_or("no call executed the effect")?;
        let mut other_nodes = 0;
        for (node, r) in &results {
            let got = r.as_ref().map(|o| *o.response()).map_err(err)?;
            if got != wresp {
                return Err(format!("node {} answered {got:?}, the winner {wresp:?}", node + 1));
            }
            if matches!(r, Ok(Outcome::Replayed(_))) && *node != wnode {
                other_nodes += 1;
            }
        }
        for i in 0..3 {
            let (sum, records) = f.totals(i).await?;
            if sum != START - 100 || records != 1 {
                return Err(format!(
                    "node {}: balance {sum} (expected {}), {records} records (expected 1)",
                    i + 1,
                    START - 100
                ));
            }
        }
        Ok(format!(
            "{N} concurrent requests with one key over 3 nodes: 1 executed (node {}), {} replayed \
             ({other_nodes} of them on another node than the winner's), balance moved by exactly 100 \
             on every node, 1 record; {}; {}",
            wnode + 1,
            N - 1,
            f.stats.line(),
            client_retries()
        ))
    }
    .await;
    f.close(None).await;
    check
}

/// Per key: executions, the executing node, and every response with its node.
type KeySeen = (u32, usize, Vec<(usize, Balance)>);

async fn many_keys_with_duplicates(c: Cluster) -> Result<String, String> {
    const KEYS: usize = 2000;
    const ACCOUNTS: i64 = 50;
    const START: i64 = 100_000_000;
    const WORKERS: usize = 48;
    let f = Fixture::new(&c, "g_many_keys", ACCOUNTS, START).await?;
    let account_of = |k: usize| (k as i64 % ACCOUNTS) + 1;
    let amount_of = |k: usize| (k as i64 % 7) + 1;
    let mut requests: Vec<usize> = (0..KEYS).flat_map(|k| vec![k; 1 + k % 3]).collect();
    fastrand::shuffle(&mut requests);
    let total = requests.len();
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (nodes, stats, requests, next) = (
            f.nodes.clone(),
            Arc::clone(&f.stats),
            Arc::clone(&requests),
            Arc::clone(&next),
        );
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(&k) = requests.get(i) else { break };
                let node = fastrand::usize(0..3);
                let r = debit_retrying(
                    &nodes[node],
                    &stats,
                    &format!("order-{k}"),
                    account_of(k),
                    amount_of(k),
                )
                .await;
                out.push((k, node, r));
            }
            out
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.map_err(err)?);
    }
    let check = async {
        // key -> (executions, executing node, responses with their nodes)
        let mut by_key: HashMap<usize, KeySeen> = HashMap::new();
        for (k, node, r) in &results {
            let e = by_key.entry(*k).or_insert((0, usize::MAX, Vec::new()));
            match r {
                Ok(Outcome::Executed(b)) => {
                    e.0 += 1;
                    e.1 = *node;
                    e.2.push((*node, *b));
                }
                Ok(Outcome::Replayed(b)) => e.2.push((*node, *b)),
                Err(err) => return Err(format!("order-{k} on node {} failed: {err}", node + 1)),
            }
        }
        let mut cross_node = 0;
        for (k, (runs, wnode, responses)) in &by_key {
            if *runs != 1 {
                return Err(format!("order-{k} executed {runs} times"));
            }
            let first = responses[0].1;
            if responses.iter().any(|(_, b)| *b != first) {
                return Err(format!("order-{k} got different responses: {responses:?}"));
            }
            cross_node += responses.iter().filter(|(n, _)| n != wnode).count();
        }
        let expected: i64 = (0..KEYS).map(amount_of).sum();
        for i in 0..3 {
            let (sum, records) = f.totals(i).await?;
            let moved = START * ACCOUNTS - sum;
            if moved != expected || records != KEYS as u64 {
                return Err(format!(
                    "node {}: balance moved by {moved} (expected the distinct keys' sum {expected}), \
                     {records} records (expected {KEYS})",
                    i + 1
                ));
            }
        }
        Ok(format!(
            "{total} requests for {KEYS} keys ({} duplicates, {cross_node} of them answered on another \
             node than the one that executed) over 3 nodes, {WORKERS} concurrent clients: every key \
             executed once, every duplicate got its key's response, balance moved by exactly the \
             distinct keys' sum {expected} on every node; {}; {}",
            total - KEYS,
            f.stats.line(),
            client_retries()
        ))
    }
    .await;
    f.close(None).await;
    check
}

async fn lagging_node_fast_path(c: Cluster) -> Result<String, String> {
    const ROUNDS: usize = 300;
    let f = Fixture::new(&c, "g_lag", 1, 1_000_000_000).await?;
    let causal = MysqlBackend::connect_with(galera::causal_reads(with_db(&c.urls[1], &f.db)?))
        .await
        .map_err(err)?;
    let plain = &f.backends[1];
    let scope = scope();
    let check = async {
        let (mut plain_misses, mut causal_misses) = (0usize, 0usize);
        let (mut plain_time, mut causal_time) = (Duration::ZERO, Duration::ZERO);
        for i in 0..ROUNDS {
            for causal_read in [false, true] {
                let key = format!("lag-{i}-{causal_read}");
                let first = debit_retrying(&f.nodes[0], &f.stats, &key, 1, 1)
                    .await
                    .map_err(err)?;
                let key = Key::new(key.as_str()).map_err(err)?;
                let text = request(1, 1).to_json();
                let claim = Claim {
                    id: Identity::Request {
                        scope: &scope,
                        key: &key,
                    },
                    request: Some(&text),
                    retention: scope.operation.retention(),
                    wait: Duration::from_secs(5),
                };
                let backend = if causal_read { &causal } else { plain };
                let start = Instant::now();
                let found = backend.lookup(&claim).await.map_err(err)?;
                let took = start.elapsed();
                if causal_read {
                    causal_time += took;
                    causal_misses += usize::from(found.is_none());
                } else {
                    plain_time += took;
                    plain_misses += usize::from(found.is_none());
                }
                // Whatever the fast path saw, the full call on node 2 replays. Both calls
                // retry an error with the same key, as a client does and as every other
                // test here does: a replicated write set can abort a transaction between
                // two statements without the server reporting it (a brute-force abort,
                // docs/scale-out.md); idem's pre-commit check then fails the call and
                // nothing of it commits. CI met one in this test on 2026-12-05.
                let again = debit_retrying(&f.nodes[1], &f.stats, key.as_str(), 1, 1)
                    .await
                    .map_err(err)?;
                if !again.is_replayed() || again.response() != first.response() {
                    return Err(format!(
                        "{} on node 2 after node 1 committed it: {again:?}, expected a replay of {first:?}",
                        key.as_str()
                    ));
                }
            }
        }
        let micros = |d: Duration| d.as_micros() / ROUNDS as u128;
        Ok(format!(
            "fast path on node 2 right after node 1 committed, {ROUNDS} rounds each: \
             wsrep_sync_wait = 0 missed {plain_misses} (mean lookup {} µs), wsrep_sync_wait = 1 \
             missed {causal_misses} (mean lookup {} µs); every following call on node 2 replayed the stored \
             response; {}; {}",
            micros(plain_time),
            micros(causal_time),
            f.stats.line(),
            client_retries()
        ))
    }
    .await;
    let _ = causal.disconnect().await;
    f.close(None).await;
    check
}

/// An effect that ends idem's transaction on a Galera node (here a `ROLLBACK`, which
/// leaves the session as an unreported brute-force abort does: no transaction, later
/// statements autocommitted) is refused before anything is stored, with an error that
/// names the brute-force abort and says a retry with the same key is safe after one;
/// the call's debit is gone, no record exists on any node, and a retry executes once.
async fn transaction_ended_inside_effect(c: Cluster) -> Result<String, String> {
    let f = Fixture::new(&c, "g_end", 1, 1_000).await?;
    let check = async {
        let key = Key::new("ended-inside").map_err(err)?;
        let out: Res = f.nodes[0]
            .execute(&scope(), &key, &request(1, 7), |tx| {
                Box::pin(async move {
                    let balance = MysqlBank::debit(tx, 1, 7).await?;
                    tx.query_drop("ROLLBACK")
                        .await
                        .map_err(|e| BankError::Db(idem::mysql::error_codes::db_error(e)))?;
                    Ok(balance)
                })
            })
            .await;
        let message = match &out {
            Err(Error::Backend(e)) => e.to_string(),
            other => return Err(format!("expected the backend's refusal, got {other:?}")),
        };
        for part in ["ended inside the effect", "brute-force abort", "retry with the same key"] {
            if !message.contains(part) {
                return Err(format!("the refusal does not say {part:?}: {message}"));
            }
        }
        for node in 0..3 {
            if f.totals(node).await? != (1_000, 0) {
                return Err(format!(
                    "node {}: expected balance 1000 and no record after the refusal, got {:?}",
                    node + 1,
                    f.totals(node).await?
                ));
            }
        }
        let again = debit(&f.nodes[0], &f.stats, key.as_str(), 1, 7)
            .await
            .map_err(err)?;
        if again.is_replayed() || again.response().balance != 993 {
            return Err(format!("the retry should execute once (993), got {again:?}"));
        }
        Ok(format!(
            "an effect that ended the transaction (ROLLBACK, then autocommit) was refused with \"{message}\"; \
             balance 1000 and no record on all 3 nodes; the retry with the same key executed once"
        ))
    }
    .await;
    f.close(None).await;
    check
}

/// What one key went through in the kill storm.
#[derive(Debug, Default, Clone)]
struct KeyLog {
    acked: Option<(usize, Balance, bool)>,
    interrupted: bool,
}

async fn node_killed_mid_storm(c: Cluster) -> Result<String, String> {
    const CLIENTS: usize = 12;
    const KEYS_PER_CLIENT: usize = 50;
    const KILL_AFTER: u64 = 200;
    const VICTIM: usize = 2;
    const START: i64 = 100_000_000;
    let f = Fixture::new(&c, "g_kill", CLIENTS as i64, START).await?;
    let acked = Arc::new(AtomicU64::new(0));
    let amount_of = |i: usize| (i as i64 % 9) + 1;
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let (nodes, stats, acked) = (f.nodes.clone(), Arc::clone(&f.stats), Arc::clone(&acked));
        tasks.push(tokio::spawn(async move {
            let mut node = client % 3;
            let mut log = Vec::new();
            for i in 0..KEYS_PER_CLIENT {
                let key = format!("kill-{client}-{i}");
                let mut entry = KeyLog::default();
                let mut tries = 0;
                loop {
                    tries += 1;
                    match debit_retrying(
                        &nodes[node],
                        &stats,
                        &key,
                        client as i64 + 1,
                        amount_of(i),
                    )
                    .await
                    {
                        Ok(o) => {
                            entry.acked = Some((node, *o.response(), o.is_replayed()));
                            acked.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        Err(e) if lost_server(&e) && tries < 20 => {
                            // The outcome is unknown: the same key, on the next node.
                            entry.interrupted = true;
                            node = (node + 1) % 3;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(e) => {
                            return Err(format!("{key} on node {} failed: {e}", node + 1));
                        }
                    }
                }
                log.push((key, client as i64 + 1, amount_of(i), entry));
            }
            Ok(log)
        }));
    }
    let killer = {
        let acked = Arc::clone(&acked);
        let pid = c.pids[VICTIM];
        tokio::spawn(async move {
            for _ in 0..6000 {
                if acked.load(Ordering::SeqCst) >= KILL_AFTER {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let at = acked.load(Ordering::SeqCst);
            let status = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            (at, status.map(|s| s.success()).unwrap_or(false))
        })
    };
    let mut logs = Vec::new();
    let mut failure = None;
    for t in tasks {
        match t.await.map_err(err)? {
            Ok(log) => logs.extend(log),
            Err(e) => failure = Some(e),
        }
    }
    let (killed_at, killed) = killer.await.map_err(err)?;
    let check = async {
        if let Some(e) = failure {
            return Err(e);
        }
        if !killed {
            return Err(format!("could not SIGKILL node {} (PID {})", VICTIM + 1, c.pids[VICTIM]));
        }
        let interrupted: Vec<_> = logs.iter().filter(|l| l.3.interrupted).collect();
        if interrupted.is_empty() {
            return Err("no client saw the node die: the kill came too late".into());
        }
        // Every acknowledged key replays its acknowledged response from a survivor.
        let mut expected = 0i64;
        for (key, account, amount, entry) in &logs {
            expected += amount;
            let (_, response, _) = entry.acked.ok_or(format!("{key} never acknowledged"))?;
            let again = debit(&f.nodes[0], &f.stats, key, *account, *amount)
                .await
                .map_err(err)?;
            if !again.is_replayed() || *again.response() != response {
                return Err(format!(
                    "{key}: acknowledged {response:?}, a later retry gave {again:?}"
                ));
            }
        }
        for i in [0, 1] {
            let (sum, records) = f.totals(i).await?;
            let moved = START * CLIENTS as i64 - sum;
            if moved != expected || records != logs.len() as u64 {
                return Err(format!(
                    "node {}: balance moved by {moved} (expected {expected}), {records} records \
                     (expected {})",
                    i + 1,
                    logs.len()
                ));
            }
        }
        let replayed = interrupted.iter().filter(|l| l.3.acked.is_some_and(|a| a.2)).count();
        Ok(format!(
            "{} keys from {CLIENTS} clients, node {} SIGKILLed after {killed_at} acknowledgements: \
             {} calls interrupted and retried with the same key on another node ({replayed} of them \
             replayed a commit the dead node had replicated, {} executed there); 0 lost, 0 doubled: \
             every key replays its acknowledged response, balance moved by exactly {expected}, {} \
             records on both survivors; {}; {}",
            logs.len(),
            VICTIM + 1,
            interrupted.len(),
            interrupted.len() - replayed,
            logs.len(),
            f.stats.line(),
            client_retries()
        ))
    }
    .await;
    f.close(Some(VICTIM)).await;
    check
}

type Step =
    fn(
        Cluster,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<String, String>> + Send>>;

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    // In order, one at a time: the node kill comes last.
    args.test_threads = Some(1);
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap(),
    );
    let steps: [(&str, Step, u64); 6] = [
        (
            "cluster_has_three_nodes",
            |c| Box::pin(cluster_has_three_nodes(c)),
            60,
        ),
        (
            "same_key_storm_over_three_nodes",
            |c| Box::pin(same_key_storm(c)),
            300,
        ),
        (
            "many_keys_with_duplicates_over_nodes",
            |c| Box::pin(many_keys_with_duplicates(c)),
            600,
        ),
        (
            "lagging_node_fast_path",
            |c| Box::pin(lagging_node_fast_path(c)),
            300,
        ),
        (
            "transaction_ended_inside_effect",
            |c| Box::pin(transaction_ended_inside_effect(c)),
            120,
        ),
        (
            "node_killed_mid_storm",
            |c| Box::pin(node_killed_mid_storm(c)),
            600,
        ),
    ];
    let trials = steps
        .into_iter()
        .map(|(name, step, secs)| {
            let rt = Arc::clone(&rt);
            Trial::test(format!("galera::{name}"), move || {
                let c = cluster().map_err(Failed::from)?;
                let line = guarded(&rt, name, secs, step(c)).map_err(Failed::from)?;
                println!("galera::{name}: {line}");
                Ok(())
            })
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
