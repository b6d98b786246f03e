//! The conformance cases on SQL Server (optional): one database per case.
//!
//! Runs when `IDEM_MSSQL_URL` is set, for example
//! `mssql://sa:Passw0rd!@127.0.0.1:1433/master?trust_server_certificate=true` (the login
//! needs CREATE DATABASE). Without it every case is listed as ignored, by name, with
//! the reason: nothing here pretends a server answered.

use std::process::ExitCode;

use idem_conformance::mssql::MssqlBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<MssqlBank>(Target::optional("IDEM_MSSQL_URL"))
}
