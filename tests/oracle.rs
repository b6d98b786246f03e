//! The conformance cases on Oracle (optional): one private user per case.
//!
//! Set `IDEM_ORACLE_URL` (for example `oracle://system:secret@127.0.0.1:1521/FREEPDB1`,
//! a user allowed to create and drop users) and install Oracle Instant Client to run
//! them live. Without it every case is listed as ignored, by name, with the reason.

use std::process::ExitCode;

use idem_conformance::oracle::OracleBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<OracleBank>(Target::optional("IDEM_ORACLE_URL"))
}
