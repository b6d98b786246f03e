//! The conformance cases on SQLite: one database file per case under the temp directory.

use std::process::ExitCode;

use idem_conformance::sqlite::SqliteBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    let dir = std::env::temp_dir().join("idem-conformance");
    run_tests::<SqliteBank>(Target::required(
        "IDEM_SQLITE_URL",
        &format!("sqlite://{}/case.db", dir.display()),
    ))
}
