//! The conformance cases on PostgreSQL (required): one schema per case.

use std::process::ExitCode;

use idem_conformance::postgres::PgBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<PgBank>(Target::required(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    ))
}
