//! One clear line and a distinct exit code for every failure.

use idem::{DbError, Error, ErrorKind, InvalidInput};
use idem_conformance::BankError;

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

impl From<DbError> for Fail {
    fn from(e: DbError) -> Self {
        let code = if e.kind() == ErrorKind::Configuration {
            INVALID_INPUT
        } else {
            1
        };
        Self::new(code, e.to_string())
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
            _ => 1,
        };
        let message = match &e {
            Error::Effect(BankError::NoAccount(id)) => {
                format!("no account {id}: create it with `idem account --id {id} --balance 1000`")
            }
            _ => e.to_string(),
        };
        Self::new(code, message)
    }
}

impl From<std::io::Error> for Fail {
    fn from(e: std::io::Error) -> Self {
        Self::new(1, e.to_string())
    }
}
