//! The conformance cases on Citus (PostgreSQL with the citus extension; idem's tables local to the coordinator unless distributed as docs/scale-out.md shows): optional, and not verified live on the
//! project's machines. Set `IDEM_CITUS_URL` to run them against a server (the
//! container workflow does where an official image exists); unset, every case is
//! reported as skipped, by name. See `docs/scale-out.md`.

use std::process::ExitCode;

use idem_conformance::postgres::PgBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<PgBank>(Target::optional("IDEM_CITUS_URL"))
}
