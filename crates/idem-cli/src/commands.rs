//! The operator's commands on the database (`migrate`, `check`, `purge`, `docs`) and
//! what the other commands share.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idem::{AnyBackend, InvalidInput};
use idem_conformance::harness::{self, Report};
use idem_conformance::{Bank, cases, docs};
use indicatif::{ProgressBar, ProgressStyle};

use crate::fail::{self, Fail, connect_within};

/// Parses `500ms`, `30s`, `90m`, `24h`, `7d` (a positive whole number and a unit).
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 24h, 7d, 90m, 30s or 500ms"))?;
    let secs = |mult: u64| n.checked_mul(mult).map(Duration::from_secs);
    let d = match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => secs(1),
        "m" => secs(60),
        "h" => secs(3600),
        "d" => secs(86_400),
        "" => return Err(format!("{s:?} needs a unit: ms, s, m, h or d")),
        other => {
            return Err(format!(
                "unknown unit {other:?} in {s:?}: use ms, s, m, h or d"
            ));
        }
    }
    .ok_or_else(|| format!("{s:?} is too long"))?;
    if d.is_zero() {
        return Err("the duration must be more than zero".into());
    }
    Ok(d)
}

/// The demo's rule: amounts are positive whole numbers.
pub(crate) fn positive(amount: i64) -> Result<(), InvalidInput> {
    if amount <= 0 {
        return Err(InvalidInput::new(
            "amount",
            format!("{amount} is not a positive whole number"),
        ));
    }
    Ok(())
}

pub(crate) async fn migrate(url: &str, distribute_citus: bool) -> Result<(), Fail> {
    let backend = connect_within(url, AnyBackend::connect(url)).await?;
    let applied = backend.migrate().await?;
    if applied.is_empty() {
        say!("schema is up to date");
    } else {
        say!("applied migrations: {applied:?}");
    }
    if distribute_citus {
        distribute(&backend).await?;
    }
    Ok(())
}

/// `idem migrate --distribute-citus`: one line per table.
async fn distribute(backend: &AnyBackend) -> Result<(), Fail> {
    match backend {
        #[cfg(feature = "postgres")]
        AnyBackend::Postgres(pg) => {
            for placement in pg.distribute().await? {
                say!("{placement}");
            }
            Ok(())
        }
        #[allow(unreachable_patterns)]
        _ => Err(Fail::new(
            fail::INVALID_INPUT,
            "--distribute-citus needs a PostgreSQL URL: Citus is PostgreSQL with the citus \
             extension (the migrations above were applied)",
        )),
    }
}

pub(crate) async fn purge(url: &str, older_than: Option<Duration>, batch: u32) -> Result<(), Fail> {
    let backend = connect_within(url, AnyBackend::connect(url)).await?;
    // Drawn on stderr, and only when it is a terminal: piped output stays plain.
    let spinner = ProgressBar::new_spinner().with_message("purging");
    spinner.enable_steady_tick(Duration::from_millis(120));
    let report = backend
        .purge_with_progress(older_than.unwrap_or(Duration::ZERO), batch, |r| {
            spinner.set_message(format!(
                "deleted {} request records and {} processed messages so far",
                r.requests, r.messages
            ));
        })
        .await;
    spinner.finish_and_clear();
    let report = report?;
    let kept = older_than.map_or(String::new(), |d| {
        format!(" (records written less than {}s ago kept)", d.as_secs_f64())
    });
    say!(
        "deleted {} expired request records and {} expired processed messages in {} statements{kept}",
        report.requests,
        report.messages,
        report.batches
    );
    if report.runs > 0 || report.outbox > 0 {
        say!(
            "deleted {} expired phased runs and {} sent outbox messages",
            report.runs,
            report.outbox
        );
    }
    Ok(())
}

/// Connects once and disconnects, so that an unreachable or silent server fails with
/// its own exit code before a long command starts.
pub(crate) async fn probe<K: Bank>(url: &str) -> Result<(), Fail> {
    let bank = connect_within(url, K::connect(url, None)).await?;
    bank.close().await?;
    Ok(())
}

pub(crate) async fn connected<K: Bank>(url: &str) -> Result<K, Fail> {
    let bank = connect_within(url, K::connect(url, None)).await?;
    bank.setup().await?;
    Ok(bank)
}

pub(crate) async fn check<K: Bank>(url: &str, json_out: Option<&Path>) -> Result<(), Fail> {
    say!("idem check: {} at {}", K::ENGINE, idem::redact(url));
    probe::<K>(url).await?;
    let total = cases::all::<K>().len();
    // Drawn on stderr, and only when it is a terminal: piped output stays plain.
    let bar = ProgressBar::new(u64::try_from(total).unwrap_or(u64::MAX));
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} checks, {elapsed}") {
        bar.set_style(style);
    }
    let report = harness::check::<K>(url, |row| {
        bar.suspend(|| match &row.failure {
            None => say!("  pass  {:<40} {:>6} ms", row.name, row.millis),
            Some(why) => say!("  FAIL  {:<40} {:>6} ms  {why}", row.name, row.millis),
        });
        bar.inc(1);
    })
    .await;
    bar.finish_and_clear();
    let report = report.map_err(|e| Fail::new(fail::OTHER, e.to_string()))?;
    say!("server: {}", report.server);
    say!("documented behaviour:");
    for (what, how) in &report.capabilities {
        say!("  {what}: {how}");
    }
    say!("observed:");
    for (what, how) in report.cases.iter().flat_map(|c| c.observations.iter()) {
        say!("  {what}: {how}");
    }
    let failed = report.cases.iter().filter(|c| c.failure.is_some()).count();
    say!(
        "check: {} passed, {failed} failed",
        report.cases.len() - failed
    );
    if let Some(path) = json_out {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| Fail::new(1, e.to_string()))?;
        std::fs::write(path, text)
            .map_err(|e| Fail::new(1, format!("cannot write {}: {e}", path.display())))?;
    }
    if failed > 0 {
        return Err(Fail::new(
            fail::CHECK_FAILED,
            format!("{failed} conformance case(s) failed on {}", K::ENGINE),
        ));
    }
    Ok(())
}

/// Writes the Markdown to `out`, or to standard output without it.
pub(crate) fn docs(paths: &[PathBuf], out: Option<&Path>) -> Result<(), Fail> {
    let mut reports = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Fail::new(1, format!("cannot read {}: {e}", path.display())))?;
        let report: Report = serde_json::from_str(&text).map_err(|e| {
            Fail::new(
                fail::INVALID_INPUT,
                format!(
                    "{} is not an `idem check --json` report: {e}",
                    path.display()
                ),
            )
        })?;
        reports.push(report);
    }
    let markdown = docs::engines_markdown(&reports);
    match out {
        Some(out) => {
            std::fs::write(out, markdown)
                .map_err(|e| Fail::new(1, format!("cannot write {}: {e}", out.display())))?;
            say!("wrote {}", out.display());
        }
        None => crate::out::write(format_args!("{markdown}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("10").unwrap_err().contains("needs a unit"));
        assert!(parse_duration("10w").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("-1h").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
    }
}
