//! The conformance cases on CockroachDB: optional, and not verified live on the
//! project's machines. Set `IDEM_COCKROACH_URL` to run them against a server (the
//! container workflow does where an official image exists); unset, every case is
//! reported as skipped, by name. See `docs/scale-out.md`.

use std::process::ExitCode;

use idem_conformance::postgres::PgBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<PgBank>(Target::optional("IDEM_COCKROACH_URL"))
}
