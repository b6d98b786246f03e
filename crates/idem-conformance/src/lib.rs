//! The conformance suite every idem backend runs, and an account domain per engine to run
//! it on.
//!
//! - [`cases`]: the promises, as plain `async fn case<K: Bank>(bank)` functions;
//! - [`bank`]: the account domain each engine implements ([`Bank`]);
//! - [`harness`]: one named trial per case per engine (`postgres::keys_are_byte_exact`),
//!   and the report behind `idem check` and `docs/engines.md`;
//! - [`proxy`]: a loopback TCP proxy that counts round trips (`idem bench`) and injects
//!   network faults at chosen statements (the `net_faults` test target).

pub mod bank;
pub mod cases;
pub mod docs;
pub mod external;
pub mod harness;
pub mod lost_reply;
pub mod maintain;
pub mod outbox_cases;
pub mod proxy;
pub mod run_store;

#[cfg(feature = "mssql")]
pub mod mssql;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "oracle")]
pub mod oracle;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use bank::{Balance, Bank, BankError, Capabilities};
pub use harness::{Report, Target, run_tests};
