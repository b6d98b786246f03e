//! Validated identifiers: keys, principals, subscribers, message IDs and versioned operations.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::InvalidInput;

/// The longest key, principal, subscriber or message ID accepted, in bytes of UTF-8.
pub const MAX_IDENT_BYTES: usize = 255;

/// The retention window used when an [`Operation`] does not set one: 24 hours, the
/// minimum Stripe's API v1 promises for its idempotency keys.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// Checks the rules every stored identifier follows: 1 to 255 bytes of UTF-8 and no
/// control characters (NUL included: PostgreSQL `text` cannot hold it, and SQL Server's
/// `varbinary` comparison ignores trailing `0x00`).
fn validate(what: &'static str, value: &str) -> Result<(), InvalidInput> {
    if value.is_empty() {
        return Err(InvalidInput::new(what, "must not be empty"));
    }
    if value.len() > MAX_IDENT_BYTES {
        return Err(InvalidInput::new(
            what,
            format!(
                "is {} bytes long; at most {MAX_IDENT_BYTES} bytes of UTF-8 are allowed",
                value.len()
            ),
        ));
    }
    if let Some((at, c)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(InvalidInput::new(
            what,
            format!(
                "contains the control character U+{:04X} at byte {at}",
                u32::from(c)
            ),
        ));
    }
    Ok(())
}

fn from_utf8(what: &'static str, bytes: &[u8]) -> Result<String, InvalidInput> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|e| InvalidInput::new(what, format!("is not valid UTF-8 ({e})")))
}

macro_rules! ident {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            #[doc = concat!("Validates and wraps a ", $what, ": 1 to 255 bytes of UTF-8 without control characters.")]
            pub fn new(value: impl Into<String>) -> Result<Self, InvalidInput> {
                let value = value.into();
                validate($what, &value)?;
                Ok(Self(value))
            }

            #[doc = concat!("Validates raw bytes (for example an HTTP header) as a ", $what, ".")]
            pub fn from_bytes(bytes: &[u8]) -> Result<Self, InvalidInput> {
                Self::new(from_utf8($what, bytes)?)
            }

            /// The validated text, compared byte for byte by every backend.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = InvalidInput;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = InvalidInput;
            fn try_from(s: &str) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidInput;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }
    };
}

ident!(
    /// The client's idempotency key. `k`, `K` and `k ` are three different keys on
    /// every engine: backends store keys byte-exact.
    Key,
    "idempotency key"
);
ident!(
    /// The authenticated principal that owns a key: take it from trusted authentication,
    /// never from the request body.
    Principal,
    "principal"
);
ident!(
    /// A message consumer's name. Part of the processed message's identity, so
    /// independent projections each apply a message once.
    Subscriber,
    "subscriber"
);
ident!(
    /// The transport's ID of a message.
    MessageId,
    "message ID"
);

/// A versioned operation contract such as `debit:v1`, with its retention window.
///
/// The version belongs to the identity: changing what a request means (defaults, units,
/// fields) is a new version, so old keys never replay against a new contract.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Operation {
    name: String,
    version: u32,
    text: String,
    retention: Duration,
}

impl Operation {
    /// `name` is 1 to 64 characters of `[A-Za-z0-9_.-]`; `version` starts at 1.
    pub fn new(name: &str, version: u32) -> Result<Self, InvalidInput> {
        let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
        if name.is_empty() || name.len() > 64 || !name.chars().all(ok_char) {
            return Err(InvalidInput::new(
                "operation",
                format!(
                    "name {name:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' or '-'"
                ),
            ));
        }
        if version == 0 {
            return Err(InvalidInput::new("operation", "version must be 1 or more"));
        }
        Ok(Self {
            name: name.to_owned(),
            version,
            text: format!("{name}:v{version}"),
            retention: DEFAULT_RETENTION,
        })
    }

    /// Sets how long a retry counts as the same operation. Choose it from the longest
    /// promised retry, redelivery and recovery window; after it the key is accepted again.
    /// Calls refuse a retention shorter than [`crate::MIN_RETENTION`] (1 s) before any SQL.
    #[must_use]
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The operation's name without the version.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The contract version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The stored form, `name:vN`.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The retention window (default [`DEFAULT_RETENTION`]).
    pub fn retention(&self) -> Duration {
        self.retention
    }
}

impl fmt::Debug for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Operation({:?}, retention {:?})",
            self.text, self.retention
        )
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Operation {
    type Err = InvalidInput;

    /// Parses `name:vN`, for example `debit:v1`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            InvalidInput::new(
                "operation",
                format!("{s:?} is not of the form name:vN (for example debit:v1)"),
            )
        };
        let (name, version) = s.rsplit_once(":v").ok_or_else(bad)?;
        let version = version.parse::<u32>().map_err(|_| bad())?;
        Self::new(name, version)
    }
}

/// Where a key lives: the authenticated principal and the versioned operation.
/// Equal keys in different scopes are independent.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scope {
    /// Who sent the request, from trusted authentication.
    pub principal: Principal,
    /// Which contract the request follows.
    pub operation: Operation,
}

impl Scope {
    /// A scope for `principal` calling `operation`.
    pub fn new(principal: Principal, operation: Operation) -> Self {
        Self {
            principal,
            operation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_rules() {
        assert!(Key::new("checkout-42").is_ok());
        assert!(Key::new("k ").is_ok());
        assert_ne!(
            Key::new("k").unwrap_or_else(|e| panic!("{e}")),
            Key::new("K").unwrap_or_else(|e| panic!("{e}"))
        );
        assert!(
            Key::new("")
                .unwrap_err()
                .to_string()
                .contains("must not be empty")
        );
        assert!(
            Key::new("a\0b")
                .unwrap_err()
                .to_string()
                .contains("U+0000 at byte 1")
        );
        assert!(Key::new("line\n").is_err());
        assert!(Key::new("\u{85}").is_err(), "C1 controls are rejected");
        assert!(Key::new("x".repeat(255)).is_ok());
        assert!(
            Key::new("x".repeat(256))
                .unwrap_err()
                .to_string()
                .contains("256 bytes")
        );
        assert!(
            Key::new("é".repeat(128)).is_err(),
            "the limit counts bytes, not characters"
        );
        assert!(
            Key::from_bytes(&[0xff, 0x41])
                .unwrap_err()
                .to_string()
                .contains("UTF-8")
        );
    }

    #[test]
    fn operations_are_versioned() {
        let op: Operation = "debit:v1".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (op.name(), op.version(), op.as_str()),
            ("debit", 1, "debit:v1")
        );
        assert_eq!(op.retention(), DEFAULT_RETENTION);
        assert!("debit".parse::<Operation>().is_err());
        assert!("debit:v0".parse::<Operation>().is_err());
        assert!("deb it:v1".parse::<Operation>().is_err());
        assert!(":v1".parse::<Operation>().is_err());
    }
}
