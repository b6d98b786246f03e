//! Connection options and the `oracle://` URL.

use std::fmt;
use std::time::Duration;

use idem_core::blocking::{DEFAULT_ACQUIRE_TIMEOUT, PoolOptions};
use idem_core::{DbError, ErrorKind};

const ENGINE: &str = "oracle";

/// The default pool size.
pub const DEFAULT_MAX_CONNECTIONS: usize = 32;
/// The largest pool size accepted (each connection is a server session).
pub const MAX_CONNECTIONS_LIMIT: usize = 1024;
/// Oracle Net's default listener port.
pub const DEFAULT_PORT: u16 = 1521;

/// How to reach an Oracle database: credentials, an Easy Connect string and a pool size.
///
/// `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    user: String,
    password: String,
    connect_string: String,
    max_connections: usize,
    acquire_timeout: Duration,
}

impl fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .field("connect_string", &self.connect_string)
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .finish()
    }
}

fn bad(why: impl fmt::Display) -> DbError {
    DbError::new(
        ENGINE,
        ErrorKind::Configuration,
        format!(
            "invalid Oracle URL (expected oracle://user:password@host[:port]/service_name): {why}"
        ),
    )
}

/// Decodes `%XX` escapes. `what` names the part in errors; the value itself is never
/// echoed (it may be a password).
fn percent_decode(what: &str, s: &str) -> Result<String, DbError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad(format!("the {what} has a malformed %-escape")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad(format!("the {what} is not UTF-8 once %-decoded")))
}

impl ConnectOptions {
    /// Options from parts. `connect_string` is anything Oracle Client accepts: an Easy
    /// Connect string (`host:1521/FREEPDB1`), a TNS alias or a full descriptor.
    pub fn new(
        user: impl Into<String>,
        password: impl Into<String>,
        connect_string: impl Into<String>,
    ) -> Self {
        Self {
            user: user.into(),
            password: password.into(),
            connect_string: connect_string.into(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
        }
    }

    /// Parses `oracle://user:password@host[:port]/service_name[?max_connections=N]`.
    ///
    /// User and password are percent-decoded (`p%40ss` is `p@ss`); the port defaults
    /// to 1521; an IPv6 host goes in brackets (`[::1]`). The result is an Easy Connect
    /// string `host:port/service_name`. Errors never contain the password.
    pub fn from_url(url: &str) -> Result<Self, DbError> {
        let scheme_len = "oracle://".len();
        let rest = match url.get(..scheme_len) {
            Some(s) if s.eq_ignore_ascii_case("oracle://") => &url[scheme_len..],
            _ => return Err(bad("it must start with oracle://")),
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        if rest.contains('#') {
            return Err(bad("fragments (#…) are not allowed; %-encode '#' as %23"));
        }
        // The last '@' ends the user info: a password may contain an unencoded '@'.
        let (userinfo, address) = rest
            .rsplit_once('@')
            .ok_or_else(|| bad("no user:password@ before the host"))?;
        let (user, password) = userinfo
            .split_once(':')
            .ok_or_else(|| bad("no password (user:password@…)"))?;
        let user = percent_decode("user", user)?;
        let password = percent_decode("password", password)?;
        if user.is_empty() {
            return Err(bad("the user is empty"));
        }
        if password.is_empty() {
            return Err(bad("the password is empty"));
        }
        if user.chars().any(char::is_control) || password.chars().any(char::is_control) {
            return Err(bad("the user or password contains a control character"));
        }
        let (hostport, service) = address
            .split_once('/')
            .ok_or_else(|| bad("no /service_name after the host"))?;
        if service.is_empty() {
            return Err(bad("the service name is empty"));
        }
        if service
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '@')
        {
            return Err(bad(
                "the service name contains a space, '@' or a control character",
            ));
        }
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (inside, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("an IPv6 host is missing its closing ']'"))?;
            if inside.is_empty() {
                return Err(bad("the host is empty"));
            }
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| bad("unexpected text after the IPv6 host"))?,
                ),
            };
            (format!("[{inside}]"), port)
        } else {
            match hostport.split_once(':') {
                Some((h, p)) => (h.to_owned(), Some(p)),
                None => (hostport.to_owned(), None),
            }
        };
        if host.is_empty() {
            return Err(bad("the host is empty"));
        }
        if host
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '(' | ')' | '='))
        {
            return Err(bad(
                "the host contains a space, a control character or ( ) =",
            ));
        }
        let port = match port {
            None => DEFAULT_PORT,
            // Plain digits only: `u16::from_str` would also take a leading '+'.
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => n,
                _ => {
                    return Err(bad(format!(
                        "the port {p:?} is not a number from 1 to 65535"
                    )));
                }
            },
        };
        let mut options = Self::new(user, password, format!("{host}:{port}/{service}"));
        for param in query.split('&').filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("max_connections", n)) => match n.parse::<usize>() {
                    Ok(n) if (1..=MAX_CONNECTIONS_LIMIT).contains(&n) => {
                        options.max_connections = n;
                    }
                    _ => {
                        return Err(bad(format!(
                            "max_connections must be a number from 1 to {MAX_CONNECTIONS_LIMIT}, not {n:?}"
                        )));
                    }
                },
                _ => {
                    let name = param.split_once('=').map_or(param, |(k, _)| k);
                    return Err(bad(format!(
                        "unsupported parameter {name:?} (supported: max_connections)"
                    )));
                }
            }
        }
        Ok(options)
    }

    /// Sets the most connections the backend opens (clamped to 1 ..= 1024).
    #[must_use]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.clamp(1, MAX_CONNECTIONS_LIMIT);
        self
    }

    /// How long a call waits for a free pooled connection before it fails with a
    /// connection error naming the acquire timeout (default 30 s). The same option name
    /// on every engine.
    #[must_use]
    pub fn acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// The pool's settings: [`ConnectOptions::max_connections`] and
    /// [`ConnectOptions::acquire_timeout`].
    pub fn pool_options(&self) -> PoolOptions {
        PoolOptions::new(self.max_connections).acquire_timeout(self.acquire_timeout)
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The connect string handed to Oracle Client.
    pub fn connect_string(&self) -> &str {
        &self.connect_string
    }

    /// The pool size.
    pub fn pool_size(&self) -> usize {
        self.max_connections
    }

    pub(crate) fn password(&self) -> &str {
        &self.password
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<ConnectOptions, String> {
        ConnectOptions::from_url(url).map_err(|e| {
            assert_eq!(e.kind(), ErrorKind::Configuration, "{e}");
            e.to_string()
        })
    }

    fn ok(url: &str) -> ConnectOptions {
        parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn urls_become_easy_connect_strings() {
        let o = ok("oracle://app:secret@db.example.com:1522/FREEPDB1");
        assert_eq!(
            (o.user(), o.password(), o.connect_string(), o.pool_size()),
            ("app", "secret", "db.example.com:1522/FREEPDB1", 32)
        );
        assert_eq!(
            ok("oracle://app:secret@localhost/FREEPDB1").connect_string(),
            "localhost:1521/FREEPDB1"
        );
        assert_eq!(
            ok("ORACLE://app:secret@[::1]:1521/FREEPDB1").connect_string(),
            "[::1]:1521/FREEPDB1"
        );
        assert_eq!(
            ok("oracle://app:secret@[fe80::1]/svc.example.com").connect_string(),
            "[fe80::1]:1521/svc.example.com"
        );
        assert_eq!(
            ok("oracle://u:p@h:1/FREEPDB1?max_connections=4").pool_size(),
            4
        );
    }

    #[test]
    fn user_and_password_are_percent_decoded() {
        let o = ok("oracle://app%20user:p%40ss%3Aw%2Fo%25rd%C3%A9@h/FREEPDB1");
        assert_eq!((o.user(), o.password()), ("app user", "p@ss:w/o%rdé"));
        // An unencoded '@' in the password still works: the last '@' ends the user info.
        assert_eq!(ok("oracle://u:p@ss@h/svc").password(), "p@ss");
    }

    #[test]
    fn bad_urls_are_refused_clearly_without_the_password() {
        let cases = [
            ("postgres://u:hunter2@h/db", "must start with oracle://"),
            ("oracle://h:1521/FREEPDB1", "no user:password@"),
            ("oracle://u@h/FREEPDB1", "no password"),
            ("oracle://:hunter2@h/FREEPDB1", "the user is empty"),
            ("oracle://u:@h/FREEPDB1", "the password is empty"),
            ("oracle://u:hunter2@h", "no /service_name"),
            ("oracle://u:hunter2@h:1521/", "the service name is empty"),
            ("oracle://u:hunter2@:1521/svc", "the host is empty"),
            ("oracle://u:hunter2@h:0/svc", "not a number from 1 to 65535"),
            (
                "oracle://u:hunter2@h:65536/svc",
                "not a number from 1 to 65535",
            ),
            ("oracle://u:hunter2@h:x/svc", "not a number from 1 to 65535"),
            (
                "oracle://u:hunter2@h:+1521/svc",
                "not a number from 1 to 65535",
            ),
            ("oracle://u:hunter2@[::1/svc", "closing ']'"),
            (
                "oracle://u:hunter2@h/svc?mode=x",
                "unsupported parameter \"mode\"",
            ),
            (
                "oracle://u:hunter2@h/svc?max_connections=0",
                "from 1 to 1024",
            ),
            (
                "oracle://u:hunter2@h/svc?max_connections=99999999999999999999",
                "from 1 to 1024",
            ),
            (
                "oracle://u:hunt%zzer2@h/svc",
                "password has a malformed %-escape",
            ),
            (
                "oracle://u:hunter2%@h/svc",
                "password has a malformed %-escape",
            ),
            ("oracle://u:hunter%FF2@h/svc", "password is not UTF-8"),
            ("oracle://u:hunter2@h/s v c", "service name contains"),
            ("oracle://u:hunter2@h/svc#frag", "fragments"),
            ("oracle://u:hunter2@(DESCRIPTION=x)/svc", "( ) ="),
            ("", "must start with oracle://"),
        ];
        for (url, want) in cases {
            let err = parse(url)
                .err()
                .unwrap_or_else(|| panic!("{url} was accepted"));
            assert!(err.contains(want), "{url}: {err}");
            assert!(!err.contains("hunter"), "{url}: the password leaked: {err}");
        }
    }

    #[test]
    fn debug_redacts_the_password() {
        let text = format!("{:?}", ok("oracle://app:hunter2@h/FREEPDB1"));
        assert!(text.contains("app") && text.contains("<redacted>"));
        assert!(!text.contains("hunter2"));
    }

    #[test]
    fn pool_size_is_bounded() {
        let o = ConnectOptions::new("u", "p", "h/svc");
        assert_eq!(o.clone().max_connections(0).pool_size(), 1);
        assert_eq!(
            o.max_connections(usize::MAX).pool_size(),
            MAX_CONNECTIONS_LIMIT
        );
    }
}
