//! Running the cases: as a test target (one named trial per case) or as `idem check`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};

use idem::core::runs::{
    DueRow, NewRun, OutboxEntry, OutboxFilter, OutboxStats, RunGuard, RunProbe, RunRow, RunWrite,
    StalledRow,
};
use idem::core::{
    Backend, BoxFuture, Claim, Claimed, DbError, Finish, Key, Maintenance, OutboxStore, Outgoing,
    RunStore, Scope, Stored, Table,
};

use crate::bank::{Balance, Bank, BankError, Capabilities};
use crate::cases::{self, Case, CaseResult, Failure, Fixture};

/// Where a test target's engine is, or why it is skipped.
#[derive(Debug, Clone)]
pub enum Target {
    /// Run every case against this URL; an unreachable engine fails every case.
    Url(String),
    /// Report every case as ignored, by name, with this reason.
    Skip(String),
}

impl Target {
    /// A required engine: the URL from `var`, or `default`.
    pub fn required(var: &str, default: &str) -> Self {
        Self::Url(
            std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| default.to_owned()),
        )
    }

    /// An optional live engine: run when `var` is set, skipped visibly otherwise.
    pub fn optional(var: &str) -> Self {
        match std::env::var(var) {
            Ok(url) if !url.is_empty() => Self::Url(url),
            _ => Self::Skip(format!(
                "{var} is not set; no server to run against (not verified live)"
            )),
        }
    }
}

/// A namespace no other case or run uses.
pub fn namespace(case: &str) -> String {
    format!(
        "idem_t_{}_{}_{:06x}",
        &case[..case.len().min(24)],
        std::process::id(),
        fastrand::u32(..0xff_ffff)
    )
}

/// Runs one case on a fresh fixture in its own namespace, migrated unless the case asks
/// for an empty one ([`Fixture::Empty`]).
pub async fn run_case<K: Bank>(url: &str, case: &Case<K>) -> CaseResult {
    let ns = namespace(case.name);
    let bank = K::connect(url, Some(&ns))
        .await
        .map_err(|e| -> Failure { format!("cannot connect to {}: {e}", K::ENGINE).into() })?;
    let bank = Arc::new(bank);
    let setup = match case.fixture {
        Fixture::Migrated => bank.setup().await,
        Fixture::Empty => Ok(()),
    };
    let result = match setup {
        Ok(()) => (case.run)(Arc::clone(&bank)).await,
        Err(e) => Err(format!("setup failed: {e}").into()),
    };
    match Arc::try_unwrap(bank) {
        Ok(bank) => {
            if let Err(e) = bank.close().await {
                eprintln!("warning: {}::{}: cleanup failed: {e}", K::ENGINE, case.name);
            }
        }
        Err(_) => eprintln!(
            "warning: {}::{}: fixture still shared; namespace {ns} left behind",
            K::ENGINE,
            case.name
        ),
    }
    result
}

fn runtime() -> Arc<tokio::runtime::Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start tokio: {e}")),
    )
}

/// The `main` of a test target: one trial per case, named `engine::case`.
pub fn run_tests<K: Bank>(target: Target) -> ExitCode {
    let args = Arguments::from_args();
    let rt = runtime();
    let trials: Vec<Trial> = cases::all::<K>()
        .into_iter()
        .map(|case| {
            let name = format!("{}::{}", K::ENGINE, case.name);
            match &target {
                Target::Skip(reason) => {
                    eprintln!("SKIPPED {name}: {reason}");
                    Trial::test(name, || Ok(())).with_ignored_flag(true)
                }
                Target::Url(url) => {
                    let (url, rt) = (url.clone(), Arc::clone(&rt));
                    Trial::test(name, move || {
                        rt.block_on(run_case::<K>(&url, &case))
                            .map(|_| ())
                            .map_err(|e| Failed::from(e.to_string()))
                    })
                }
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// One case's row in a report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaseReport {
    /// The case's name.
    pub name: String,
    /// The promise it proves.
    pub promise: String,
    /// `None` when it passed, else why it failed.
    pub failure: Option<String>,
    /// How long it took, in milliseconds.
    pub millis: u64,
    /// What it observed.
    pub observations: Vec<(String, String)>,
}

/// The results of every case on one engine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The engine.
    pub engine: String,
    /// The server's version, as it reported it.
    pub server: String,
    /// The documented facts.
    pub capabilities: Vec<(String, String)>,
    /// Whether the results come from a live run (false: expected from documentation).
    pub live: bool,
    /// Each case.
    pub cases: Vec<CaseReport>,
}

impl Report {
    /// Whether every case passed.
    pub fn passed(&self) -> bool {
        self.live && self.cases.iter().all(|c| c.failure.is_none())
    }
}

/// The documented facts as report rows.
pub fn capability_rows(c: &Capabilities) -> Vec<(String, String)> {
    vec![
        ("versions".into(), c.versions.into()),
        ("claim".into(), c.claim.into()),
        ("key columns".into(), c.key_columns.into()),
        ("JSON storage".into(), c.json_storage.into()),
        ("retried with the same key".into(), c.retried.into()),
    ]
}

/// Runs every case against `url`, one after the other, for `idem check`.
pub async fn check<K: Bank>(url: &str, progress: impl Fn(&CaseReport)) -> Result<Report, Failure> {
    // Connect once first so an unreachable server fails fast with one clear error.
    let probe = K::connect(url, None)
        .await
        .map_err(|e| -> Failure { format!("cannot connect to {}: {e}", K::ENGINE).into() })?;
    let capabilities = capability_rows(&probe.capabilities());
    let server = probe.server_version().await?;
    probe.close().await?;
    let mut cases = Vec::new();
    for case in cases::all::<K>() {
        let start = Instant::now();
        let result = tokio::time::timeout(Duration::from_secs(120), run_case::<K>(url, &case))
            .await
            .unwrap_or_else(|_| Err("timed out after 120 s".into()));
        let (failure, observations) = match result {
            Ok(obs) => (
                None,
                obs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            ),
            Err(e) => (Some(e.to_string()), Vec::new()),
        };
        let row = CaseReport {
            name: case.name.into(),
            promise: case.promise.into(),
            failure,
            millis: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
            observations,
        };
        progress(&row);
        cases.push(row);
    }
    Ok(Report {
        engine: K::report_engine(&server).into(),
        server,
        capabilities,
        live: true,
        cases,
    })
}

/// A fixture type that is never constructed: lets documentation list the cases by name
/// without an engine.
#[derive(Debug)]
pub enum NoBank {}

impl Bank for NoBank {
    type B = NeverBackend;
    const ENGINE: &'static str = "none";

    async fn connect(_: &str, _: Option<&str>) -> Result<Self, DbError> {
        Err(DbError::new(
            "none",
            idem::core::ErrorKind::Configuration,
            "no engine",
        ))
    }
    fn backend(&self) -> &NeverBackend {
        match *self {}
    }
    const DOCUMENTED: Capabilities = Capabilities {
        claim: "",
        key_columns: "",
        json_storage: "",
        retried: "",
        concurrent_sessions: false,
        versions: "",
    };
    async fn server_version(&self) -> Result<String, DbError> {
        match *self {}
    }
    async fn setup(&self) -> Result<(), DbError> {
        match *self {}
    }
    async fn set_balance(&self, _: i64, _: i64) -> Result<(), DbError> {
        match *self {}
    }
    async fn balance(&self, _: i64) -> Result<i64, DbError> {
        match *self {}
    }
    async fn find_balance(&self, _: i64) -> Result<Option<i64>, DbError> {
        match *self {}
    }
    fn debit(tx: &mut NeverBackend, _: i64, _: i64) -> BoxFuture<'_, Result<Balance, BankError>> {
        match *tx {}
    }
    fn credit(tx: &mut NeverBackend, _: i64, _: i64) -> BoxFuture<'_, Result<Balance, BankError>> {
        match *tx {}
    }
    async fn insert_record_directly(
        &self,
        _: &str,
        _: &str,
        _: &str,
        _: &str,
        _: &str,
    ) -> Result<(), DbError> {
        match *self {}
    }
    fn create_order(
        tx: &mut NeverBackend,
        _: String,
        _: i64,
    ) -> BoxFuture<'_, Result<i64, BankError>> {
        match *tx {}
    }
    fn pay_order(tx: &mut NeverBackend, _: i64, _: String) -> BoxFuture<'_, Result<(), BankError>> {
        match *tx {}
    }
    fn fail_order(tx: &mut NeverBackend, _: i64) -> BoxFuture<'_, Result<(), BankError>> {
        match *tx {}
    }
    async fn count_orders(&self, _: &str) -> Result<u64, DbError> {
        match *self {}
    }
    async fn count_records(&self) -> Result<u64, DbError> {
        match *self {}
    }
    async fn close(self) -> Result<(), DbError> {
        match self {}
    }
}

/// The backend of [`NoBank`]: uninhabited.
#[derive(Debug, Clone)]
pub enum NeverBackend {}

impl Backend for NeverBackend {
    type Tx = NeverBackend;
    async fn lookup(&self, _: &Claim<'_>) -> Result<Option<Stored>, DbError> {
        match *self {}
    }
    async fn claim(&self, _: &Claim<'_>) -> Result<Claimed<NeverBackend>, DbError> {
        match *self {}
    }
    async fn finish(&self, tx: NeverBackend, _: &Claim<'_>, _: Finish<'_>) -> Result<(), DbError> {
        match tx {}
    }
    fn classify(&self, _: &(dyn std::error::Error + 'static)) -> Option<idem::core::ErrorKind> {
        match *self {}
    }
}

impl RunStore for NeverBackend {
    async fn begin_runs(&self, _: Option<Duration>) -> Result<NeverBackend, DbError> {
        match *self {}
    }
    async fn commit_runs(&self, tx: NeverBackend) -> Result<(), DbError> {
        match tx {}
    }
    async fn rollback_runs(&self, tx: NeverBackend) -> Result<(), DbError> {
        match tx {}
    }
    async fn insert_run(
        &self,
        tx: &mut NeverBackend,
        _: &Scope,
        _: &Key,
        _: &NewRun<'_>,
    ) -> Result<bool, DbError> {
        match *tx {}
    }
    async fn read_run(
        &self,
        tx: &mut NeverBackend,
        _: &Scope,
        _: &Key,
    ) -> Result<Option<RunRow>, DbError> {
        match *tx {}
    }
    async fn write_run(
        &self,
        tx: &mut NeverBackend,
        _: &Scope,
        _: &Key,
        _: &RunGuard<'_>,
        _: &RunWrite<'_>,
    ) -> Result<bool, DbError> {
        match *tx {}
    }
    async fn renew_lease(
        &self,
        tx: &mut NeverBackend,
        _: &Scope,
        _: &Key,
        _: &str,
        _: i64,
        _: Duration,
    ) -> Result<bool, DbError> {
        match *tx {}
    }
    async fn probe_run(
        &self,
        tx: &mut NeverBackend,
        _: &Scope,
        _: &Key,
    ) -> Result<RunProbe, DbError> {
        match *tx {}
    }
    async fn delete_run(
        &self,
        tx: &mut NeverBackend,
        _: &Scope,
        _: &Key,
        _: &str,
    ) -> Result<bool, DbError> {
        match *tx {}
    }
    async fn stalled_runs(&self, _: u32) -> Result<Vec<StalledRow>, DbError> {
        match *self {}
    }
}

impl OutboxStore for NeverBackend {
    async fn enqueue(&self, tx: &mut NeverBackend, _: &Outgoing) -> Result<(), DbError> {
        match *tx {}
    }
    async fn lock_due(&self, tx: &mut NeverBackend, _: u32) -> Result<Vec<DueRow>, DbError> {
        match *tx {}
    }
    async fn pending_ids(
        &self,
        tx: &mut NeverBackend,
        _: &str,
        _: i64,
    ) -> Result<Vec<i64>, DbError> {
        match *tx {}
    }
    async fn claim_due(
        &self,
        tx: &mut NeverBackend,
        _: &[i64],
        _: &str,
        _: Duration,
    ) -> Result<(), DbError> {
        match *tx {}
    }
    async fn release(&self, tx: &mut NeverBackend, _: &[i64], _: &str) -> Result<(), DbError> {
        match *tx {}
    }
    async fn mark_sent(&self, tx: &mut NeverBackend, _: &[i64], _: &str) -> Result<u64, DbError> {
        match *tx {}
    }
    async fn record_failure(
        &self,
        tx: &mut NeverBackend,
        _: i64,
        _: &str,
        _: &str,
        _: Option<Duration>,
    ) -> Result<bool, DbError> {
        match *tx {}
    }
    async fn outbox_stats(&self) -> Result<OutboxStats, DbError> {
        match *self {}
    }
    async fn list_outbox(&self, _: &OutboxFilter) -> Result<Vec<OutboxEntry>, DbError> {
        match *self {}
    }
    async fn retry_outbox(&self, _: &[i64], _: Option<&str>) -> Result<u64, DbError> {
        match *self {}
    }
    async fn drop_outbox(&self, _: &[i64], _: Option<&str>) -> Result<u64, DbError> {
        match *self {}
    }
}

impl Maintenance for NeverBackend {
    async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        match *self {}
    }
    async fn purge_batch(&self, _: Table, _: Duration, _: u32) -> Result<u64, DbError> {
        match *self {}
    }
}
