//! One clear line and a distinct exit code for every failure.
//!
//! Database failures get their exit code from the error's kind, which every engine
//! decides from its own error code, so the same failure exits with the same code on
//! every engine.

use std::future::Future;
use std::time::Duration;

use idem::{DbError, Error, ErrorKind, InvalidInput};
use idem_conformance::BankError;

/// Exit code for a database or other error not listed below.
pub(crate) const OTHER: u8 = 1;
/// Exit code for invalid input (clap uses it for usage errors too).
pub(crate) const INVALID_INPUT: u8 = 2;
/// Exit code for a key reused with a different request (or a message ID with a different payload).
pub(crate) const KEY_REUSED: u8 = 3;
/// Exit code for an insufficient balance.
pub(crate) const INSUFFICIENT: u8 = 4;
/// Exit code for a missing account.
pub(crate) const NO_ACCOUNT: u8 = 5;
/// Exit code for a conformance check that found failures.
pub(crate) const CHECK_FAILED: u8 = 6;
/// Exit code for a refused, unreachable or lost connection, or a server that does not speak
/// the URL's protocol.
pub(crate) const CANNOT_CONNECT: u8 = 7;
/// Exit code for a server that did not answer within [`CONNECT_TIMEOUT`].
pub(crate) const TIMED_OUT: u8 = 8;
/// Exit code for refused credentials.
pub(crate) const AUTHENTICATION: u8 = 9;
/// Exit code for a database that does not exist or cannot be opened.
pub(crate) const MISSING_DATABASE: u8 = 10;
/// Exit code for a call with the same key still running past the wait bound.
pub(crate) const IN_PROGRESS: u8 = 11;
/// Exit code for a lock on idem's table held by another session (not a call with this
/// key) past the wait bound.
pub(crate) const LOCK_WAIT: u8 = 12;
/// Exit code for a table or column of idem's that the database does not have (the
/// migrations have not run there, or not all of them).
pub(crate) const MISSING_TABLE: u8 = 13;

/// How long a command waits for the database to accept a connection.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The exit codes, for `idem --help`.
pub(crate) const EXIT_CODES_HELP: &str = "\
Exit codes (the same on every engine):
  0   success
  1   other database error
  2   invalid input or usage
  3   key reused with a different request (or message ID with a different payload)
  4   insufficient balance
  5   no such account
  6   conformance checks failed
  7   cannot connect: refused, unreachable, lost, or not that engine's protocol on this port
  8   no answer from the server within 10 s
  9   authentication failed (PostgreSQL 28P01/28000, MySQL 1045/1044/1698,
      SQL Server 18456, Oracle ORA-01017; RabbitMQ 403 ACCESS_REFUSED, NATS
      authorization violation)
  10  database not found (PostgreSQL 3D000, MySQL 1049, SQL Server 4060,
      Oracle ORA-12514/ORA-12505, SQLite: the file cannot be opened)
  11  a call with the same key is still running (waited the wait bound); retry later
  12  a lock on idem's table held by another session (a schema change, LOCK TABLE,
      a purge) kept the call waiting past the wait bound; retry later
  13  idem's tables not found: run `idem migrate` with the same URL (PostgreSQL
      42P01/42703, MySQL 1146/1054, SQL Server 208/207, Oracle ORA-00942/ORA-00904,
      SQLite: no such table or column)
  141 the output's reader went away (`| head`): the command stopped at that line,
      as SIGPIPE stops a Unix tool";

/// The cargo features this binary was built with, as `idem --help` lists them.
pub(crate) fn built_features() -> Vec<&'static str> {
    [
        (cfg!(feature = "sqlite"), "sqlite"),
        (cfg!(feature = "postgres"), "postgres"),
        (cfg!(feature = "mysql"), "mysql"),
        (cfg!(feature = "mssql"), "mssql"),
        (cfg!(feature = "oracle"), "oracle"),
        (cfg!(feature = "amqp"), "amqp"),
        (cfg!(feature = "nats"), "nats"),
        (cfg!(feature = "http"), "http"),
        (cfg!(feature = "bench"), "bench"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect()
}

/// Every cargo feature of the CLI but `full`.
const FEATURES: [&str; 9] = [
    "sqlite", "postgres", "mysql", "mssql", "oracle", "amqp", "nats", "http", "bench",
];

/// `idem --help`'s closing text: the exit codes, then what this build contains.
pub(crate) fn exit_codes_and_build() -> String {
    let built = built_features();
    let missing: Vec<&str> = FEATURES
        .into_iter()
        .filter(|f| !built.contains(f))
        .collect();
    let build = if missing.is_empty() {
        "Built with every feature (engines, brokers, http, bench).".to_owned()
    } else {
        format!(
            "Built with the features: {}. Not in this build: {} (their engines and commands \
             need a build with them, for example `cargo install idem-cli --features full`).",
            if built.is_empty() {
                "none".to_owned()
            } else {
                built.join(", ")
            },
            missing.join(", ")
        )
    };
    format!("{EXIT_CODES_HELP}\n\n{build}")
}

/// A failure: the message printed after `error: ` and the exit code.
#[derive(Debug)]
pub(crate) struct Fail {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Fail {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// The exit code of a database error, from its kind.
pub(crate) fn code_of(e: &DbError) -> u8 {
    code_for(e.engine(), e.kind())
}

/// The exit code of an error of `kind` from `engine`.
pub(crate) fn code_for(engine: &str, kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Configuration => INVALID_INPUT,
        ErrorKind::Authentication => AUTHENTICATION,
        ErrorKind::MissingDatabase => MISSING_DATABASE,
        ErrorKind::MissingTable => MISSING_TABLE,
        // SQLite has no server: failing to connect is failing to open the file.
        ErrorKind::Connection if engine == "sqlite" => MISSING_DATABASE,
        ErrorKind::Connection => CANNOT_CONNECT,
        _ => OTHER,
    }
}

/// Runs `connect`, giving up with [`TIMED_OUT`] after [`CONNECT_TIMEOUT`]: a server that
/// never answers (another engine's port, a firewall dropping packets) fails fast.
pub(crate) async fn connect_within<T>(
    url: &str,
    connect: impl Future<Output = Result<T, DbError>>,
) -> Result<T, Fail> {
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(connected) => connected.map_err(Fail::from),
        Err(_) => Err(Fail::new(
            TIMED_OUT,
            format!(
                "no answer from {} within {} s: check that the server is up and that the \
                 port belongs to the engine the URL names",
                idem::redact(url),
                CONNECT_TIMEOUT.as_secs()
            ),
        )),
    }
}

impl From<DbError> for Fail {
    fn from(e: DbError) -> Self {
        Self::new(code_of(&e), message_of(&e))
    }
}

/// The line printed for a database error: the engine's words, and what to do when that
/// is clear from its kind.
pub(crate) fn message_of(e: &DbError) -> String {
    with_advice(e.to_string(), e.kind())
}

/// `message`, followed by what to do about an error of `kind` when that is clear.
pub(crate) fn with_advice(message: String, kind: ErrorKind) -> String {
    match kind {
        ErrorKind::MissingTable => format!(
            "{message}; run `idem migrate` with this URL first, or check that it names the \
             database, schema and user that hold idem's tables"
        ),
        _ => message,
    }
}

impl From<InvalidInput> for Fail {
    fn from(e: InvalidInput) -> Self {
        Self::new(INVALID_INPUT, e.to_string())
    }
}

impl From<Error<BankError>> for Fail {
    fn from(e: Error<BankError>) -> Self {
        let code = match &e {
            Error::InvalidInput(_) => INVALID_INPUT,
            Error::KeyReused { .. } | Error::PayloadMismatch { .. } => KEY_REUSED,
            Error::Effect(BankError::Insufficient) => INSUFFICIENT,
            Error::Effect(BankError::NoAccount(_)) => NO_ACCOUNT,
            Error::InProgress { .. } | Error::LeaseLost { .. } => IN_PROGRESS,
            Error::LockWait { .. } => LOCK_WAIT,
            Error::Backend(db) => code_of(db),
            _ => OTHER,
        };
        let message = match &e {
            Error::Backend(db) => message_of(db),
            Error::Effect(BankError::NoAccount(id)) => {
                format!(
                    "no account {id}: create it with `idem demo account --id {id} --balance 1000`"
                )
            }
            _ => e.to_string(),
        };
        Self::new(code, message)
    }
}

impl From<std::io::Error> for Fail {
    fn from(e: std::io::Error) -> Self {
        Self::new(OTHER, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_codes() {
        let code = |engine, kind| code_of(&DbError::new(engine, kind, "x"));
        assert_eq!(code("postgres", ErrorKind::Authentication), AUTHENTICATION);
        assert_eq!(code("mysql", ErrorKind::MissingDatabase), MISSING_DATABASE);
        assert_eq!(code("mysql", ErrorKind::Connection), CANNOT_CONNECT);
        assert_eq!(code("sqlite", ErrorKind::Connection), MISSING_DATABASE);
        assert_eq!(code("oracle", ErrorKind::Configuration), INVALID_INPUT);
        assert_eq!(code("mssql", ErrorKind::Deadlock), OTHER);
        assert_eq!(code("sqlite", ErrorKind::MissingTable), MISSING_TABLE);
        for c in [
            OTHER,
            INVALID_INPUT,
            CANNOT_CONNECT,
            TIMED_OUT,
            AUTHENTICATION,
        ] {
            assert!(EXIT_CODES_HELP.contains(&format!("\n  {c} ")), "{c}");
        }
        for c in [MISSING_DATABASE, IN_PROGRESS, LOCK_WAIT, MISSING_TABLE] {
            assert!(EXIT_CODES_HELP.contains(&format!("\n  {c}  ")), "{c}");
        }
    }
}
