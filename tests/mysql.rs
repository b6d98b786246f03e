//! The conformance cases on MySQL/MariaDB (required): one database per case.

use std::process::ExitCode;

use idem_conformance::mysql::MysqlBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    run_tests::<MysqlBank>(Target::required(
        "IDEM_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ))
}
