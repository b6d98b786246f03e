//! `docs/engines.md`, generated from `idem check --json` reports: one column per engine.
//!
//! Engines without a live report (SQL Server and Oracle on the project's machines) get a
//! column of behaviour *expected from their documentation*, marked as not verified live.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::harness::{CaseReport, Report};

/// The column order.
pub const ENGINES: [(&str, &str); 5] = [
    ("sqlite", "SQLite"),
    ("postgres", "PostgreSQL"),
    ("mysql", "MySQL / MariaDB"),
    ("mssql", "SQL Server"),
    ("oracle", "Oracle"),
];

fn row(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

/// What the engine's documentation says, for engines not run live here.
pub fn documented(engine: &str) -> Option<Report> {
    let (capabilities, observations) = match engine {
        "mssql" => (
            row(&[
                (
                    "versions",
                    "SQL Server 2019–2025: expected from documentation, not verified live here",
                ),
                (
                    "claim",
                    "plain `INSERT`, duplicate classified by 2627/2601, then a re-read; no `MERGE`, no `IGNORE_DUP_KEY`",
                ),
                (
                    "key columns",
                    "`varbinary(255)` (string comparison pads trailing spaces even under BIN2)",
                ),
                (
                    "JSON storage",
                    "`nvarchar(max)`, compared as values in Rust",
                ),
                (
                    "retried with the same key",
                    "1205 deadlock victim, 1222 lock timeout, 3960 snapshot conflict",
                ),
            ]),
            row(&[
                (
                    "duplicate-key error code",
                    "2627 (PRIMARY KEY) or 2601 (unique index), per documentation",
                ),
                (
                    "losers waited",
                    "yes, on the winner's exclusive key lock (documented locking behaviour)",
                ),
                (
                    "effect visible to others before commit",
                    "no: READ COMMITTED readers block, or read the last committed version with READ_COMMITTED_SNAPSHOT",
                ),
                ("record visible to others before commit", "no (same reason)"),
            ]),
        ),
        "oracle" => (
            row(&[
                (
                    "versions",
                    "Oracle Database 19c–23ai Free: expected from documentation, not verified live here",
                ),
                (
                    "claim",
                    "plain `INSERT`, duplicate classified by ORA-00001, then a re-read",
                ),
                (
                    "key columns",
                    "`RAW(255)`: byte comparison whatever NLS_COMP / NLS_SORT; empty keys refused before SQL ('' is NULL)",
                ),
                ("JSON storage", "`CLOB`, compared as values in Rust"),
                (
                    "retried with the same key",
                    "ORA-08177 serialization failure, ORA-00060 deadlock",
                ),
            ]),
            row(&[
                ("duplicate-key error code", "ORA-00001, per documentation"),
                (
                    "losers waited",
                    "yes, an INSERT of a duplicate key waits for the uncommitted winner (documented)",
                ),
                (
                    "effect visible to others before commit",
                    "no: readers see the last committed version (multiversion read consistency)",
                ),
                ("record visible to others before commit", "no (same reason)"),
            ]),
        ),
        _ => return None,
    };
    let cases = crate::cases::all::<crate::harness::NoBank>()
        .into_iter()
        .map(|c| CaseReport {
            name: c.name.into(),
            promise: c.promise.into(),
            failure: None,
            millis: 0,
            observations: if c.name == "effect_commits_with_record" {
                observations.clone()
            } else {
                Vec::new()
            },
        })
        .collect();
    Some(Report {
        engine: engine.into(),
        server: "not run here".into(),
        capabilities,
        live: false,
        cases,
    })
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// Renders the comparison. Later reports for the same engine replace earlier ones.
pub fn engines_markdown(reports: &[Report]) -> String {
    let columns: Vec<(&str, Report)> = ENGINES
        .iter()
        .filter_map(|(id, title)| {
            reports
                .iter()
                .rev()
                .find(|r| r.engine == *id)
                .cloned()
                .or_else(|| documented(id))
                .map(|r| (*title, r))
        })
        .collect();
    let mut out = String::new();
    let _ = writeln!(out, "# Engine behaviours\n");
    let _ = writeln!(
        out,
        "Generated by `idem docs` from `idem check --json` reports (`ci/engines-doc.sh`); do not edit by hand.\n\
         A column marked **live** holds what the conformance cases asserted and observed against that server.\n\
         A column marked **documentation** was not run here: it states what the engine's documentation \
         promises, and it is **not verified live** until someone runs `idem check --url …` against that engine \
         (see the README's container matrix).\n"
    );
    let header: Vec<String> = columns.iter().map(|(t, _)| (*t).to_owned()).collect();
    let _ = writeln!(out, "| | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(columns.len()));
    let source: Vec<String> = columns
        .iter()
        .map(|(_, r)| {
            if r.live {
                format!("**live**: {}", cell(&r.server))
            } else {
                "**documentation** (not verified live)".into()
            }
        })
        .collect();
    let _ = writeln!(out, "| source | {} |", source.join(" | "));
    let facts: Vec<String> = columns[0]
        .1
        .capabilities
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    for fact in &facts {
        let cells: Vec<String> = columns
            .iter()
            .map(|(_, r)| {
                r.capabilities
                    .iter()
                    .find(|(k, _)| k == fact)
                    .map_or("–".into(), |(_, v)| cell(v))
            })
            .collect();
        let _ = writeln!(out, "| {fact} | {} |", cells.join(" | "));
    }
    let _ = writeln!(out, "\n## Conformance cases\n");
    let _ = writeln!(out, "| case | promise | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|---|{}", "---|".repeat(columns.len()));
    for case in &columns[0].1.cases {
        let cells: Vec<String> = columns
            .iter()
            .map(
                |(_, r)| match r.cases.iter().find(|c| c.name == case.name) {
                    _ if !r.live => "not run".into(),
                    Some(CaseReport { failure: None, .. }) => "pass".into(),
                    Some(CaseReport {
                        failure: Some(f), ..
                    }) => format!("**FAIL**: {}", cell(f)),
                    None => "–".into(),
                },
            )
            .collect();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} |",
            case.name,
            cell(&case.promise),
            cells.join(" | ")
        );
    }
    let _ = writeln!(out, "\n## Observed behaviour\n");
    let _ = writeln!(out, "| | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(columns.len()));
    let mut seen = BTreeSet::new();
    let names: Vec<String> = columns
        .iter()
        .flat_map(|(_, r)| {
            r.cases
                .iter()
                .flat_map(|c| c.observations.iter().map(|(k, _)| k.clone()))
        })
        .filter(|k| seen.insert(k.clone()))
        .collect();
    for name in names {
        let cells: Vec<String> = columns
            .iter()
            .map(|(_, r)| {
                r.cases
                    .iter()
                    .flat_map(|c| c.observations.iter())
                    .find(|(k, _)| *k == name)
                    .map_or("–".into(), |(_, v)| cell(v))
            })
            .collect();
        let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undocumented_engines_are_marked_not_live() {
        let md = engines_markdown(&[]);
        assert!(md.contains("| | SQL Server | Oracle |"), "{md}");
        assert_eq!(
            md.matches("**documentation** (not verified live)").count(),
            2
        );
        assert!(!md.contains("**live**:"), "no column may claim a live run");
        assert!(md.contains("`keys_are_byte_exact`"));
    }
}
