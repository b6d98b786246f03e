//! The conformance cases on one node of a MariaDB Galera cluster (required when built
//! with the `cluster` feature): `ci/galera.sh run cargo test -p idem-tests --features
//! cluster,mysql --test galera` starts the private 3-node cluster and sets
//! `IDEM_GALERA_URLS`; the cases run against its first node, one database per case.

use std::process::ExitCode;

use idem_conformance::mysql::MysqlBank;
use idem_conformance::{Target, run_tests};

fn main() -> ExitCode {
    let first = std::env::var("IDEM_GALERA_URLS")
        .ok()
        .and_then(|urls| urls.split_whitespace().next().map(str::to_owned));
    let Some(url) = first else {
        eprintln!(
            "IDEM_GALERA_URLS is not set: run this target through `ci/galera.sh run cargo test …`, \
             which starts the 3-node cluster"
        );
        return ExitCode::FAILURE;
    };
    run_tests::<MysqlBank>(Target::Url(url))
}
