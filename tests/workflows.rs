//! The container matrix stays valid YAML, runs `ci/test.sh` in every job, and covers
//! every engine version the README promises; `ci/compose.yml` offers the same images.

use std::path::Path;

use serde_yaml_ng::Value;

const PROMISED: [&str; 8] = [
    "postgres:15",
    "postgres:18",
    "mysql:8.4",
    "mariadb:10.11",
    "mariadb:11",
    "mcr.microsoft.com/mssql/server:2022-latest",
    "mcr.microsoft.com/mssql/server:2025-latest",
    "gvenzl/oracle-free:23-slim",
];

fn load(relative: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{relative} is not valid YAML: {e}"))
}

fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Sequence(items) => items.iter().for_each(|i| strings(i, out)),
        Value::Mapping(m) => m.values().for_each(|i| strings(i, out)),
        _ => {}
    }
}

#[test]
fn workflow_runs_the_suite_on_every_promised_engine() {
    let wf = load(".github/workflows/ci.yml");
    let jobs = wf
        .get("jobs")
        .and_then(Value::as_mapping)
        .unwrap_or_else(|| panic!("no jobs"));
    let mut engines_seen = Vec::new();
    for (name, job) in jobs {
        let mut texts = Vec::new();
        strings(
            job.get("steps")
                .unwrap_or_else(|| panic!("job {name:?} has no steps")),
            &mut texts,
        );
        assert!(
            texts.iter().any(|t| t.contains("bash ci/test.sh")),
            "job {name:?} does not run ci/test.sh"
        );
        strings(job, &mut engines_seen);
    }
    for image in PROMISED {
        assert!(
            engines_seen.iter().any(|s| s == image),
            "the matrix lacks {image}"
        );
    }
    assert!(
        format!("{wf:?}").contains("IDEM_MSSQL_URL"),
        "the SQL Server job must set IDEM_MSSQL_URL"
    );
    assert!(
        format!("{wf:?}").contains("IDEM_ORACLE_URL"),
        "the Oracle job must set IDEM_ORACLE_URL"
    );
}

#[test]
fn compose_offers_the_same_images() {
    let compose = load("ci/compose.yml");
    let services = compose
        .get("services")
        .and_then(Value::as_mapping)
        .unwrap_or_else(|| panic!("no services"));
    let images: Vec<&str> = services
        .values()
        .filter_map(|s| s.get("image").and_then(Value::as_str))
        .collect();
    for image in PROMISED {
        assert!(images.contains(&image), "ci/compose.yml lacks {image}");
    }
    let mut ports = Vec::new();
    for s in services.values() {
        let mut p = Vec::new();
        strings(s.get("ports").unwrap_or(&Value::Null), &mut p);
        ports.extend(
            p.into_iter()
                .map(|p| p.split(':').next().unwrap_or_default().to_owned()),
        );
    }
    let before = ports.len();
    ports.sort();
    ports.dedup();
    assert_eq!(
        ports.len(),
        before,
        "two services publish the same host port"
    );
}
