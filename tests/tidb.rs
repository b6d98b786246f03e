//! The conformance cases on TiDB: optional, and not verified live on the
//! project's machines. Set `IDEM_TIDB_URL` to run them against a server (the
//! container workflow does where an official image exists); unset, every case is
//! reported as skipped, by name. See `docs/scale-out.md`.

use std::process::ExitCode;

use idem_conformance::mysql::MysqlBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<MysqlBank>(Target::optional("IDEM_TIDB_URL"))
}
