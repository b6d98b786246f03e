//! `idem bench`: the protocol's paths beside the bare effect, in one run, with cells
//! interleaved and rotated across rounds so that machine noise falls on every path alike.
// Built without SQLite, PostgreSQL and MySQL, only `--chart-only` remains.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code, unused_imports)
)]

mod chart;
mod engines;
mod growth;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{
    Consumed, Idem, Key, MessageId, Operation, Outcome, Principal, Request, Scope, Subscriber,
};
use idem_conformance::harness::namespace;
use idem_conformance::proxy;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::task::JoinSet;

pub(crate) use engines::{BenchEngine, ClaimChoice, PoolMode};

use crate::fail::Fail;

/// No single operation may take longer than this; the cell stops and reports it.
const HANG_GUARD: Duration = Duration::from_secs(60);
/// Sequential operations per path when counting round trips.
const RT_OPS: u32 = 20;
/// Keys written once before the run, replayed by path (c).
const REPLAY_KEYS: usize = 200;

/// One measured path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Path {
    /// (a) the demo bank's debit statements in an explicit transaction, no idem.
    Bare,
    /// (b) an idempotent debit with a new key.
    New,
    /// (c) the same call with a key already stored.
    Replay,
    /// (d) a primary-key read of a balance, no idem.
    Read,
    /// (e) every client sends the same new key at once.
    Storm,
    /// (f) `Idem::consume` with a new message ID (a credit).
    Consumer,
    /// (g) the seed's `debit_once` as a server-side function, with a new key.
    Function,
    /// (h) an idempotent debit with a new key whose effect is synchronous code, the
    /// whole call in one trip to the blocking pool (SQLite's `execute_blocking`).
    NewSync,
    /// (i) the floor: the bare debit and a plain `INSERT` of a finished record in the same
    /// transaction, no idem code.
    Floor,
    /// (j) the primary-key read of a stored record (idem's replay read), no idem code.
    RecordRead,
}

impl Path {
    const ALL: [Path; 10] = [
        Path::Bare,
        Path::New,
        Path::Replay,
        Path::Read,
        Path::Storm,
        Path::Consumer,
        Path::Function,
        Path::NewSync,
        Path::Floor,
        Path::RecordRead,
    ];

    pub(crate) fn letter(self) -> char {
        match self {
            Path::Bare => 'a',
            Path::New => 'b',
            Path::Replay => 'c',
            Path::Read => 'd',
            Path::Storm => 'e',
            Path::Consumer => 'f',
            Path::Function => 'g',
            Path::NewSync => 'h',
            Path::Floor => 'i',
            Path::RecordRead => 'j',
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Path::Bare => "bare debit, own transaction",
            Path::New => "idem new request",
            Path::Replay => "idem replay",
            Path::Read => "bare primary-key read",
            Path::Storm => "same-key storm",
            Path::Consumer => "consumer (new message)",
            Path::Function => "server-side debit_once",
            Path::NewSync => "idem new request, synchronous effect",
            Path::Floor => "floor: bare debit + record INSERT",
            Path::RecordRead => "record primary-key read, no idem",
        }
    }

    pub(crate) fn short(self) -> &'static str {
        match self {
            Path::Bare => "bare debit",
            Path::New => "idem new",
            Path::Replay => "idem replay",
            Path::Read => "PK read",
            Path::Storm => "storm",
            Path::Consumer => "consumer",
            Path::Function => "debit_once",
            Path::NewSync => "idem new (sync)",
            Path::Floor => "floor",
            Path::RecordRead => "record read",
        }
    }
}

/// What `idem bench` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) clients: Vec<usize>,
    pub(crate) duration: Duration,
    pub(crate) rounds: u32,
    pub(crate) accounts: i64,
    pub(crate) json: Option<PathBuf>,
    pub(crate) svg: Option<PathBuf>,
    pub(crate) with: Vec<PathBuf>,
    pub(crate) pool: PoolMode,
    pub(crate) round_trips: bool,
    pub(crate) fast_path: bool,
    pub(crate) claim: ClaimChoice,
    pub(crate) paths: Vec<char>,
    pub(crate) growth: Option<u64>,
    pub(crate) chart_only: bool,
}

/// One path at one client count, summed over the rounds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Cell {
    pub(crate) path: Path,
    pub(crate) clients: usize,
    pub(crate) ops: u64,
    pub(crate) errors: u64,
    pub(crate) seconds: f64,
    pub(crate) ops_per_s: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) first_error: Option<String>,
}

/// The ratios at one client count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Ratios {
    pub(crate) clients: usize,
    /// (b)/(a): idem new request over the bare debit.
    pub(crate) new_over_bare: Option<f64>,
    /// (c)/(d): idem replay over the bare primary-key read.
    pub(crate) replay_over_read: Option<f64>,
    /// (b)/(g): idem new request over the seed's server-side function.
    pub(crate) new_over_function: Option<f64>,
    /// (h)/(a): idem new request with a synchronous effect over the bare debit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) new_sync_over_bare: Option<f64>,
    /// (i)/(a): the floor over the bare debit: what writing one record row in the
    /// effect's transaction costs, before any protocol runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) floor_over_bare: Option<f64>,
    /// (b)/(i): idem new request over the floor: what idem's protocol costs above it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) new_over_floor: Option<f64>,
    /// (h)/(i): idem new request with a synchronous effect over the floor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) new_sync_over_floor: Option<f64>,
    /// (j)/(d): the record's read over the account's read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) record_read_over_read: Option<f64>,
    /// (c)/(j): idem replay over the record's own read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) replay_over_record_read: Option<f64>,
}

/// Client→server round trips per operation, counted through the proxy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RoundTrips {
    pub(crate) path: Path,
    pub(crate) per_op: f64,
}

/// A whole run, as `--json` writes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Report {
    pub(crate) engine: String,
    pub(crate) server: String,
    pub(crate) build: String,
    pub(crate) pool: String,
    #[serde(default = "yes")]
    pub(crate) fast_path: bool,
    /// PostgreSQL's claim style (`--claim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) claim: Option<String>,
    pub(crate) clients: Vec<usize>,
    pub(crate) seconds_per_cell: f64,
    pub(crate) rounds: u32,
    pub(crate) accounts: i64,
    pub(crate) load_before: String,
    pub(crate) load_after: String,
    pub(crate) cells: Vec<Cell>,
    pub(crate) ratios: Vec<Ratios>,
    pub(crate) round_trips: Vec<RoundTrips>,
    pub(crate) round_trip_method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) round_trip_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) growth: Option<growth::Growth>,
}

/// The shared state of every client task.
struct Ctx<K: BenchEngine> {
    backend: K::B,
    idem: Idem<K::B>,
    scope: Scope,
    request: Request,
    subscriber: Subscriber,
    replay_keys: Vec<Key>,
    run: String,
    next: AtomicU64,
    storm: AtomicU64,
    accounts: i64,
}

impl<K: BenchEngine> Ctx<K> {
    fn new(backend: K::B, run: String, accounts: i64, fast_path: bool) -> Result<Self, Fail> {
        Ok(Self {
            idem: Idem::new(backend.clone()).with_fast_path(fast_path),
            backend,
            scope: Scope::new(Principal::new("bench")?, Operation::new("debit", 1)?),
            request: Request::new(json!({ "amount": 1 })),
            subscriber: Subscriber::new("bench-projection")?,
            replay_keys: Vec::new(),
            run,
            next: AtomicU64::new(0),
            storm: AtomicU64::new(0),
            accounts,
        })
    }

    /// The record identity of `key` in the bench's scope, as idem stores it.
    fn id<'a>(&'a self, key: &'a str) -> [&'a str; 3] {
        [
            self.scope.principal.as_str(),
            self.scope.operation.as_str(),
            key,
        ]
    }

    fn fresh(&self, prefix: char) -> String {
        format!(
            "{prefix}-{}-{}",
            self.run,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// One operation of `path`.
async fn op<K: BenchEngine>(ctx: &Ctx<K>, path: Path, clients: usize) -> Result<(), String> {
    let account = fastrand::i64(1..=ctx.accounts);
    let text = |e: &dyn std::fmt::Display| e.to_string();
    match path {
        Path::Bare => K::bare_debit(&ctx.backend, account)
            .await
            .map_err(|e| text(&e)),
        Path::Read => K::bare_read(&ctx.backend, account)
            .await
            .map(drop)
            .map_err(|e| text(&e)),
        Path::Function => K::call_function(&ctx.backend, account, &ctx.fresh('f'))
            .await
            .map_err(|e| text(&e)),
        Path::Floor => K::floor_debit(&ctx.backend, account, ctx.id(&ctx.fresh('i')))
            .await
            .map_err(|e| text(&e)),
        Path::RecordRead => {
            let key = &ctx.replay_keys[fastrand::usize(..ctx.replay_keys.len())];
            match K::record_read(&ctx.backend, ctx.id(key.as_str())).await {
                Ok(true) => Ok(()),
                Ok(false) => Err(format!(
                    "the stored record of {} was not found",
                    key.as_str()
                )),
                Err(e) => Err(text(&e)),
            }
        }
        Path::New | Path::Replay | Path::Storm => {
            let key = match path {
                Path::New => Key::new(ctx.fresh('n')).map_err(|e| text(&e))?,
                Path::Replay => ctx.replay_keys[fastrand::usize(..ctx.replay_keys.len())].clone(),
                _ => {
                    // Groups of `clients` consecutive calls share a key: they arrive together.
                    let group = ctx.storm.fetch_add(1, Ordering::Relaxed) / clients as u64;
                    Key::new(format!("s-{}-{group}", ctx.run)).map_err(|e| text(&e))?
                }
            };
            let out = ctx
                .idem
                .execute(&ctx.scope, &key, &ctx.request, |tx| {
                    K::debit(tx, account, 1)
                })
                .await
                .map_err(|e| text(&e))?;
            match (path, out) {
                (Path::New, Outcome::Executed(_))
                | (Path::Replay, Outcome::Replayed(_))
                | (Path::Storm, _) => Ok(()),
                (_, other) => Err(format!("unexpected outcome {other:?}")),
            }
        }
        Path::NewSync => {
            let key = Key::new(ctx.fresh('h')).map_err(|e| text(&e))?;
            match K::new_sync(&ctx.idem, &ctx.scope, &key, &ctx.request, account).await? {
                true => Ok(()),
                false => Err("unexpected outcome: replayed".into()),
            }
        }
        Path::Consumer => {
            let id = MessageId::new(ctx.fresh('m')).map_err(|e| text(&e))?;
            match ctx
                .idem
                .consume(&ctx.subscriber, &id, None, |tx| K::credit(tx, account, 1))
                .await
            {
                Ok(Consumed::Applied(_)) => Ok(()),
                Ok(other) => Err(format!("unexpected outcome {other:?}")),
                Err(e) => Err(text(&e)),
            }
        }
    }
}

/// What one cell measured.
#[derive(Debug, Default)]
struct Sample {
    latencies_us: Vec<u32>,
    errors: u64,
    first_error: Option<String>,
    seconds: f64,
}

impl Sample {
    fn absorb(&mut self, other: Sample) {
        self.latencies_us.extend(other.latencies_us);
        self.errors += other.errors;
        self.first_error = self.first_error.take().or(other.first_error);
        self.seconds += other.seconds;
    }

    fn ops_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.latencies_us.len() as f64 / self.seconds
        } else {
            0.0
        }
    }

    fn percentile(&mut self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        self.latencies_us.sort_unstable();
        let last = self.latencies_us.len() - 1;
        let i = ((last as f64) * p).round() as usize;
        f64::from(self.latencies_us[i.min(last)])
    }
}

/// `clients` tasks run `path` back to back until `duration` has passed.
async fn run_cell<K: BenchEngine>(
    ctx: &Arc<Ctx<K>>,
    path: Path,
    clients: usize,
    duration: Duration,
) -> Sample {
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = JoinSet::new();
    for _ in 0..clients {
        let ctx = Arc::clone(ctx);
        tasks.spawn(async move {
            let mut sample = Sample::default();
            while Instant::now() < deadline {
                let t = Instant::now();
                match tokio::time::timeout(HANG_GUARD, op::<K>(&ctx, path, clients)).await {
                    Ok(Ok(())) => sample
                        .latencies_us
                        .push(u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX)),
                    Ok(Err(e)) => {
                        sample.errors += 1;
                        sample.first_error.get_or_insert(e);
                    }
                    Err(_) => {
                        sample.errors += 1;
                        sample
                            .first_error
                            .get_or_insert(format!("an operation took over {HANG_GUARD:?}"));
                        break;
                    }
                }
            }
            sample
        });
    }
    let mut total = Sample::default();
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(s) => total.absorb(Sample { seconds: 0.0, ..s }),
            Err(e) => {
                total.errors += 1;
                total
                    .first_error
                    .get_or_insert(format!("client task failed: {e}"));
            }
        }
    }
    total.seconds = start.elapsed().as_secs_f64();
    total
}

fn yes() -> bool {
    true
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn run_tag() -> String {
    format!("{:x}{:04x}", std::process::id(), fastrand::u16(..))
}

pub(crate) async fn run<K: BenchEngine>(url: &str, opts: Options) -> Result<(), Fail> {
    if opts.clients.is_empty() || opts.clients.contains(&0) {
        return Err(Fail::new(
            crate::fail::INVALID_INPUT,
            "--clients needs one or more positive counts, such as 1,16,64",
        ));
    }
    if opts.claim != ClaimChoice::Auto && K::ENGINE != "postgres" {
        return Err(Fail::new(
            crate::fail::INVALID_INPUT,
            format!(
                "--claim chooses PostgreSQL's claim style; {} has one claim",
                K::ENGINE
            ),
        ));
    }
    if let Some(bad) = opts
        .paths
        .iter()
        .find(|c| !Path::ALL.iter().any(|p| p.letter() == **c))
    {
        return Err(Fail::new(
            crate::fail::INVALID_INPUT,
            format!("--paths: no path ({bad}); the paths are a to j (see docs/performance.md)"),
        ));
    }
    let ns = namespace("bench");
    let bank = K::connect(url, Some(&ns)).await?;
    let result = async {
        bank.setup().await?;
        let pool = opts.clients.iter().copied().max().unwrap_or(1);
        let backend = K::attach(url, &ns, pool, opts.pool, opts.claim).await?;
        let outcome = measure::<K>(&bank, backend.clone(), url, &ns, &opts).await;
        K::release(backend).await;
        outcome
    }
    .await;
    let closed = bank.close().await;
    let report = result?;
    closed?;
    // Figures with failed operations in them are no measurement: say so in the exit code.
    let failed: u64 = report.cells.iter().map(|c| c.errors).sum();
    let errors = if let Some(e) = &report.round_trip_error {
        Err(Fail::new(1, format!("counting round trips failed: {e}")))
    } else if failed == 0 {
        Ok(())
    } else {
        Err(Fail::new(
            1,
            format!("{failed} operation(s) failed during the run (see \"first error\" above)"),
        ))
    };
    if let Some(path) = &opts.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Fail::new(1, format!("cannot encode the report: {e}")))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| Fail::new(1, format!("cannot write {}: {e}", path.display())))?;
        say!("report written to {}", path.display());
    }
    if let Some(svg) = &opts.svg {
        let mut reports = read_reports(&opts.with)?;
        reports.push(report);
        chart::draw(&reports, svg)?;
        say!("chart written to {}", svg.display());
    }
    errors
}

/// `--chart-only`: draws the `--svg` chart from the `--with` reports, measuring nothing.
pub(crate) fn chart_only(opts: &Options) -> Result<(), Fail> {
    let Some(svg) = &opts.svg else {
        return Err(Fail::new(
            crate::fail::INVALID_INPUT,
            "--chart-only needs --svg FILE and the --with reports to draw",
        ));
    };
    chart::draw(&read_reports(&opts.with)?, svg)?;
    say!("chart written to {}", svg.display());
    Ok(())
}

fn read_reports(paths: &[PathBuf]) -> Result<Vec<Report>, Fail> {
    paths
        .iter()
        .map(|path| {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Fail::new(1, format!("cannot read {}: {e}", path.display())))?;
            serde_json::from_str(&text).map_err(|e| {
                Fail::new(
                    crate::fail::INVALID_INPUT,
                    format!(
                        "{} is not an `idem bench --json` report: {e}",
                        path.display()
                    ),
                )
            })
        })
        .collect()
}

async fn measure<K: BenchEngine>(
    bank: &K,
    backend: K::B,
    url: &str,
    ns: &str,
    opts: &Options,
) -> Result<Report, Fail> {
    let server = bank.server_version().await?;
    let load_before = load_average();
    let run = run_tag();
    let mut ctx = Ctx::<K>::new(backend, run.clone(), opts.accounts, opts.fast_path)?;
    for account in 1..=opts.accounts {
        bank.set_balance(account, i64::MAX / 4).await?;
    }
    let mut report = Report {
        engine: K::ENGINE.into(),
        server,
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
        .into(),
        pool: opts.pool.describe(K::ENGINE).into(),
        fast_path: opts.fast_path,
        claim: (K::ENGINE == "postgres").then(|| opts.claim.describe().to_owned()),
        clients: opts.clients.clone(),
        seconds_per_cell: opts.duration.as_secs_f64(),
        rounds: opts.rounds,
        accounts: opts.accounts,
        load_before,
        load_after: String::new(),
        cells: Vec::new(),
        ratios: Vec::new(),
        round_trips: Vec::new(),
        round_trip_method: String::new(),
        round_trip_error: None,
        growth: None,
    };
    if let Some(records) = opts.growth {
        let ctx = Arc::new(ctx);
        report.growth = Some(growth::run::<K>(&ctx, records, opts).await?);
        report.load_after = load_average();
        growth::print(&report);
        return Ok(report);
    }

    if K::FUNCTION.is_some() {
        K::install_function(&ctx.backend, opts.accounts).await?;
    }
    // Keys for the replay path, written once through idem.
    for i in 0..REPLAY_KEYS {
        let key = Key::new(format!("r-{run}-{i}"))?;
        ctx.idem
            .execute(&ctx.scope, &key, &ctx.request, |tx| K::debit(tx, 1, 1))
            .await
            .map_err(|e| Fail::new(1, format!("cannot prepare the replay keys: {e}")))?;
        ctx.replay_keys.push(key);
    }
    let ctx = Arc::new(ctx);
    let paths: Vec<Path> = Path::ALL
        .into_iter()
        .filter(|p| *p != Path::Function || K::FUNCTION.is_some())
        .filter(|p| *p != Path::NewSync || K::SYNC_EFFECT)
        .filter(|p| opts.paths.is_empty() || opts.paths.contains(&p.letter()))
        .collect();
    let mut cells: Vec<(Path, usize)> = opts
        .clients
        .iter()
        .flat_map(|&c| paths.iter().map(move |&p| (p, c)))
        .collect();
    // Warm-up: every path once, briefly, at the largest client count.
    let warm = Duration::from_millis(200);
    let bar = progress(u64::from(opts.rounds) * cells.len() as u64 + paths.len() as u64);
    for &p in &paths {
        bar.set_message(format!("warm-up ({}) {}", p.letter(), p.label()));
        run_cell(
            &ctx,
            p,
            opts.clients.iter().copied().max().unwrap_or(1),
            warm,
        )
        .await;
        bar.inc(1);
    }
    let mut samples: std::collections::BTreeMap<(usize, Path), Sample> = Default::default();
    let step = (cells.len() / opts.rounds.max(1) as usize).max(1);
    for round in 0..opts.rounds {
        if round > 0 {
            cells.rotate_left(step);
        }
        for &(path, clients) in &cells {
            bar.set_message(format!(
                "round {}/{}: ({}) {}, {clients} clients",
                round + 1,
                opts.rounds,
                path.letter(),
                path.label()
            ));
            let s = run_cell(&ctx, path, clients, opts.duration).await;
            samples.entry((clients, path)).or_default().absorb(s);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    for ((clients, path), mut s) in samples {
        report.cells.push(Cell {
            path,
            clients,
            ops: s.latencies_us.len() as u64,
            errors: s.errors,
            seconds: s.seconds,
            ops_per_s: s.ops_per_s(),
            p50_us: s.percentile(0.50),
            p99_us: s.percentile(0.99),
            first_error: s.first_error.take(),
        });
    }
    for &clients in &opts.clients {
        let ops = |p: Path| {
            report
                .cells
                .iter()
                .find(|c| c.path == p && c.clients == clients)
                .map(|c| c.ops_per_s)
                .filter(|v| *v > 0.0)
        };
        let ratio = |a: Path, b: Path| Some(ops(a)? / ops(b)?);
        report.ratios.push(Ratios {
            clients,
            new_over_bare: ratio(Path::New, Path::Bare),
            replay_over_read: ratio(Path::Replay, Path::Read),
            new_over_function: ratio(Path::New, Path::Function),
            new_sync_over_bare: ratio(Path::NewSync, Path::Bare),
            floor_over_bare: ratio(Path::Floor, Path::Bare),
            new_over_floor: ratio(Path::New, Path::Floor),
            new_sync_over_floor: ratio(Path::NewSync, Path::Floor),
            record_read_over_read: ratio(Path::RecordRead, Path::Read),
            replay_over_record_read: ratio(Path::Replay, Path::RecordRead),
        });
    }
    report.load_after = load_average();
    if K::NETWORK && opts.round_trips {
        report.round_trip_method = format!(
            "a loopback TCP proxy counts client-to-server bursts (bytes the client sends before the server answers), \
             over {RT_OPS} sequential operations per path on a pool of one connection, pool pings and resets included"
        );
        // A failure here must not throw away the measured cells: it is reported, and the
        // run still exits with an error.
        match count_round_trips::<K>(&ctx, url, ns, &paths, opts).await {
            Ok(counted) => report.round_trips = counted,
            Err(e) => report.round_trip_error = Some(e.message),
        }
    } else if !K::NETWORK && opts.round_trips {
        report.round_trip_method = format!(
            "SQLite runs in process: trips to tokio's blocking pool (idem_core::blocking::trips), \
             over {RT_OPS} sequential operations per path on a pool of one connection"
        );
        match count_trips::<K>(&ctx, url, ns, &paths, opts).await {
            Ok(counted) => report.round_trips = counted,
            Err(e) => report.round_trip_error = Some(e.message),
        }
    }
    print(&report);
    Ok(report)
}

async fn count_round_trips<K: BenchEngine>(
    ctx: &Arc<Ctx<K>>,
    url: &str,
    ns: &str,
    paths: &[Path],
    opts: &Options,
) -> Result<Vec<RoundTrips>, Fail> {
    let default_port = if K::ENGINE == "postgres" { 5432 } else { 3306 };
    let Some((_, target)) = proxy::through(
        url,
        "127.0.0.1:1"
            .parse()
            .map_err(|_| Fail::new(1, "loopback"))?,
        default_port,
    ) else {
        return Err(Fail::new(
            1,
            "cannot find the server's host and port in the URL",
        ));
    };
    // Counting needs no protocol knowledge: bytes are forwarded as they come.
    let proxy = proxy::Proxy::start(target, proxy::Wire::Opaque)
        .await
        .map_err(|e| Fail::new(1, format!("cannot start the counting proxy: {e}")))?;
    let Some((mut proxied, _)) = proxy::through(url, proxy.addr(), default_port) else {
        return Err(Fail::new(1, "cannot rewrite the URL"));
    };
    if K::ENGINE == "mysql" {
        // mysql_async would move a loopback connection to the server's Unix socket.
        proxied.push(if proxied.contains('?') { '&' } else { '?' });
        proxied.push_str("prefer_socket=false");
    }
    // The pool's asynchronous return work (a ping, a reset) belongs to the operation.
    let settle = Duration::from_millis(100);
    count_per_op::<K>(ctx, &proxied, ns, paths, opts, "p", settle, || {
        proxy.bursts()
    })
    .await
}

/// The blocking engines' round trips: closures handed to tokio's blocking pool per
/// operation, sequential, on a pool of one connection (nothing else runs meanwhile).
async fn count_trips<K: BenchEngine>(
    ctx: &Arc<Ctx<K>>,
    url: &str,
    ns: &str,
    paths: &[Path],
    opts: &Options,
) -> Result<Vec<RoundTrips>, Fail> {
    count_per_op::<K>(
        ctx,
        url,
        ns,
        paths,
        opts,
        "t",
        Duration::ZERO,
        idem::core::blocking::trips,
    )
    .await
}

/// Runs every path but the storm [`RT_OPS`] times in a row (after 3 warm-up calls) on a
/// backend of one connection at `url`, and reads `count` before and after (waiting
/// `settle` after the warm-up and after the operations): its growth per operation.
#[allow(clippy::too_many_arguments)]
async fn count_per_op<K: BenchEngine>(
    ctx: &Arc<Ctx<K>>,
    url: &str,
    ns: &str,
    paths: &[Path],
    opts: &Options,
    run_suffix: &str,
    settle: Duration,
    count: impl Fn() -> u64,
) -> Result<Vec<RoundTrips>, Fail> {
    let backend = K::attach(url, ns, 1, opts.pool, opts.claim).await?;
    let mut counted = Ctx::<K>::new(
        backend.clone(),
        format!("{}{run_suffix}", ctx.run),
        ctx.accounts,
        opts.fast_path,
    )?;
    counted.replay_keys = ctx.replay_keys.clone();
    let counted = Arc::new(counted);
    let failed = |path: Path, e: String| {
        Fail::new(1, format!("({}) counting round trips: {e}", path.letter()))
    };
    let mut out = Vec::new();
    for &path in paths.iter().filter(|p| **p != Path::Storm) {
        for _ in 0..3 {
            op::<K>(&counted, path, 1)
                .await
                .map_err(|e| failed(path, e))?;
        }
        tokio::time::sleep(settle).await;
        let before = count();
        for _ in 0..RT_OPS {
            op::<K>(&counted, path, 1)
                .await
                .map_err(|e| failed(path, e))?;
        }
        tokio::time::sleep(settle).await;
        let counted_now = count() - before;
        out.push(RoundTrips {
            path,
            per_op: counted_now as f64 / f64::from(RT_OPS),
        });
    }
    drop(counted);
    K::release(backend).await;
    Ok(out)
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "–".into(), |v| format!("{v:.2}"))
}

fn print(report: &Report) {
    say!(
        "idem bench on {} ({}), {} build; pool: {}; fast path {}{}",
        report.engine,
        report.server,
        report.build,
        report.pool,
        if report.fast_path { "on" } else { "off" },
        report
            .claim
            .as_deref()
            .map(|c| format!("; claim: {c}"))
            .unwrap_or_default()
    );
    say!(
        "{} round(s) x {:.1} s per cell, cells interleaved and rotated; {} accounts; load average before {}, after {}",
        report.rounds,
        report.seconds_per_cell,
        report.accounts,
        report.load_before,
        report.load_after
    );
    let rt = |p: Path| {
        report
            .round_trips
            .iter()
            .find(|r| r.path == p)
            .map_or_else(|| "–".into(), |r| format!("{:.2}", r.per_op))
    };
    for &clients in &report.clients {
        say!();
        say!("{clients} client(s)");
        say!(
            "{:<38} {:>10} {:>9} {:>9} {:>7} {:>12}",
            "path",
            "ops/s",
            "p50 µs",
            "p99 µs",
            "errors",
            "round trips"
        );
        for c in report.cells.iter().filter(|c| c.clients == clients) {
            say!(
                "({}) {:<34} {:>10.1} {:>9.0} {:>9.0} {:>7} {:>12}",
                c.path.letter(),
                c.path.label(),
                c.ops_per_s,
                c.p50_us,
                c.p99_us,
                c.errors,
                rt(c.path)
            );
            if let Some(e) = &c.first_error {
                say!("    first error: {e}");
            }
        }
        if let Some(r) = report.ratios.iter().find(|r| r.clients == clients) {
            say!(
                "ratios: (b)/(a) new ÷ bare {}   (c)/(d) replay ÷ read {}   (b)/(g) new ÷ function {}",
                fmt_ratio(r.new_over_bare),
                fmt_ratio(r.replay_over_read),
                fmt_ratio(r.new_over_function)
            );
            if r.new_sync_over_bare.is_some() {
                say!(
                    "        (h)/(a) new, synchronous effect ÷ bare {}",
                    fmt_ratio(r.new_sync_over_bare)
                );
            }
            if r.floor_over_bare.is_some() || r.record_read_over_read.is_some() {
                say!(
                    "floor:  (i)/(a) floor ÷ bare {}   (b)/(i) new ÷ floor {}   (j)/(d) record read ÷ read {}   (c)/(j) replay ÷ record read {}",
                    fmt_ratio(r.floor_over_bare),
                    fmt_ratio(r.new_over_floor),
                    fmt_ratio(r.record_read_over_read),
                    fmt_ratio(r.replay_over_record_read)
                );
            }
            if r.new_sync_over_floor.is_some() {
                say!(
                    "        (h)/(i) new, synchronous effect ÷ floor {}",
                    fmt_ratio(r.new_sync_over_floor)
                );
            }
        }
    }
    if !report.round_trip_method.is_empty() {
        say!();
        say!("round trips: {}", report.round_trip_method);
    }
    if let Some(e) = &report.round_trip_error {
        say!("round trips not counted: {e}");
    }
    if report.build == "debug" {
        say!(
            "(this is a debug build: `cargo build --release -p idem-cli` for representative figures)"
        );
    }
}
