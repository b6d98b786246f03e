//! Connection options: `mssql://` / `sqlserver://` URLs and ADO.NET connection strings.
//!
//! Passwords never appear in error messages or in `Debug` output.

use std::fmt;
use std::time::Duration;

use idem_core::{DbError, ErrorKind};
use tiberius::{AuthMethod, Config, EncryptionLevel};

use crate::ENGINE;

/// The isolation level of idem's claim transactions (and so of your effect's SQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// READ COMMITTED (default): with locking reads, or with row versions when the
    /// database has `READ_COMMITTED_SNAPSHOT ON`. The re-read after a duplicate key
    /// always sees the winner.
    #[default]
    ReadCommitted,
    /// REPEATABLE READ.
    RepeatableRead,
    /// SERIALIZABLE.
    Serializable,
    /// SNAPSHOT (needs `ALLOW_SNAPSHOT_ISOLATION ON`). The re-read after a duplicate
    /// key may not see the winner's row (committed after the snapshot began): the claim
    /// then ends with [`ErrorKind::Transient`] and idem retries it in a new
    /// transaction, whose snapshot includes the row.
    Snapshot,
}

impl Isolation {
    /// Parses `read_committed`, `repeatable_read`, `serializable` or `snapshot`
    /// (case-insensitive, `-` or space for `_`).
    pub fn parse(text: &str) -> Option<Self> {
        match text
            .trim()
            .to_ascii_lowercase()
            .replace(['-', ' '], "_")
            .as_str()
        {
            "read_committed" => Some(Self::ReadCommitted),
            "repeatable_read" => Some(Self::RepeatableRead),
            "serializable" => Some(Self::Serializable),
            "snapshot" => Some(Self::Snapshot),
            _ => None,
        }
    }

    pub(crate) fn begin_sql(self) -> &'static str {
        match self {
            Self::ReadCommitted => crate::sql::BEGIN_READ_COMMITTED,
            Self::RepeatableRead => crate::sql::BEGIN_REPEATABLE_READ,
            Self::Serializable => crate::sql::BEGIN_SERIALIZABLE,
            Self::Snapshot => crate::sql::BEGIN_SNAPSHOT,
        }
    }
}

/// How to reach SQL Server, and the pool's limits.
///
/// Build it from a URL or ADO.NET string with [`MssqlOptions::parse`], or from a
/// tiberius [`Config`] with [`MssqlOptions::from_config`].
#[derive(Clone)]
pub struct MssqlOptions {
    pub(crate) config: Config,
    /// Where the TCP connection goes.
    host: String,
    port: u16,
    database: Option<String>,
    user: Option<String>,
    pub(crate) max_connections: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) acquire_timeout: Duration,
    pub(crate) isolation: Isolation,
}

impl fmt::Debug for MssqlOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MssqlOptions")
            .field("addr", &self.addr())
            .field("database", &self.database)
            .field("user", &self.user)
            .field("max_connections", &self.max_connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("isolation", &self.isolation)
            .finish_non_exhaustive()
    }
}

/// Pool size when none is given.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// Bound on TCP connect plus TLS and login, when none is given.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a caller waits for a free pooled connection.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

const URL_PARAMETERS: &str = "encrypt, trust_server_certificate, hostname_in_certificate, \
     application_name, connect_timeout, command_timeout, max_connections, isolation";

fn config_error(message: String) -> DbError {
    DbError::new(ENGINE, ErrorKind::Configuration, message)
}

impl MssqlOptions {
    /// Parses `mssql://user:password@host:port/database?…` (also `sqlserver://`), or
    /// an ADO.NET connection string such as
    /// `Server=tcp:host,1433;Database=app;User Id=app;Password=…;TrustServerCertificate=true`.
    ///
    /// URL parameters: `encrypt` (`true`/`required` (default), `false` (login only),
    /// `danger_plaintext`), `trust_server_certificate`, `hostname_in_certificate`,
    /// `application_name`, `connect_timeout` and `command_timeout` (seconds; `0`
    /// disables the command timeout), `max_connections`, `isolation`
    /// (`read_committed`, `repeatable_read`, `serializable`, `snapshot`). User,
    /// password and database are percent-decoded. Unknown parameters are refused.
    ///
    /// ADO.NET strings are parsed by tiberius; idem also reads `Connect Timeout`
    /// (`Connection Timeout`), `Command Timeout` and `Max Pool Size`. Named instances
    /// (`host\instance` without a port) are refused: they need the SQL Browser
    /// service, which this build does not query; give the instance's TCP port.
    pub fn parse(url: &str) -> Result<Self, DbError> {
        let trimmed = url.trim();
        let lower = trimmed.to_ascii_lowercase();
        if let Some(rest) = ["mssql://", "sqlserver://"]
            .iter()
            .find_map(|scheme| lower.starts_with(scheme).then(|| &trimmed[scheme.len()..]))
        {
            return parse_url(url, rest);
        }
        if trimmed.contains('=') && !trimmed.contains("://") {
            return parse_ado(trimmed);
        }
        Err(config_error(format!(
            "unsupported SQL Server address {:?}: expected mssql://user:password@host:port/database, \
             sqlserver://…, or an ADO.NET connection string (Server=tcp:host,1433;Database=…;User Id=…;Password=…)",
            redact_url(url)
        )))
    }

    /// Uses a tiberius [`Config`] as is (for authentication methods or TLS settings the
    /// URL does not cover), with the default pool limits.
    pub fn from_config(config: Config) -> Self {
        let (host, port) = split_addr(&config.get_addr());
        Self {
            host,
            port,
            config,
            database: None,
            user: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            acquire_timeout: DEFAULT_ACQUIRE_TIMEOUT,
            isolation: Isolation::default(),
        }
    }

    /// Connects to another database on the same server.
    #[must_use]
    pub fn database(mut self, name: &str) -> Self {
        self.config.database(name);
        self.database = Some(name.to_owned());
        self
    }

    /// The pool's size (at least 1).
    #[must_use]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Bounds TCP connect plus TLS and login of each new connection.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self.config.handshake_timeout(Some(timeout));
        self
    }

    /// Bounds each server round trip (tiberius' command timeout; `None`: no bound).
    /// A lock wait longer than this fails as a connection error and the connection is
    /// discarded; prefer `SET LOCK_TIMEOUT` (error 1222, retried) for lock waits.
    #[must_use]
    pub fn command_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.command_timeout(timeout);
        self
    }

    /// How long a caller waits for a free pooled connection.
    #[must_use]
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// The isolation level of claim transactions.
    #[must_use]
    pub fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// `host:port` (`[v6]:port`), as idem connects to it: for messages.
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The host and port idem opens TCP connections to.
    pub fn endpoint(&self) -> (&str, u16) {
        (&self.host, self.port)
    }

    /// The database named in the URL, if any.
    pub fn database_name(&self) -> Option<&str> {
        self.database.as_deref()
    }

    /// The login name, if the URL gave one.
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The configured pool size.
    pub fn pool_size(&self) -> usize {
        self.max_connections
    }

    /// The configured isolation level.
    pub fn isolation_level(&self) -> Isolation {
        self.isolation
    }

    /// The tiberius configuration (its `Debug` output redacts the password).
    pub fn tiberius_config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn redirect(&mut self, host: &str, port: u16) {
        self.config.host(host);
        self.config.port(port);
        (self.host, self.port) = split_addr(&self.config.get_addr());
    }
}

/// Splits tiberius' `host:port` (an IPv6 host is not bracketed there).
fn split_addr(addr: &str) -> (String, u16) {
    match addr.rsplit_once(':') {
        Some((host, port)) => (
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            port.parse().unwrap_or(1433),
        ),
        None => (addr.to_owned(), 1433),
    }
}

/// `mssql://user:***@host…`: the URL (or ADO.NET string) without its password, for
/// messages ([`idem_core::redact`]).
pub fn redact_url(url: &str) -> String {
    idem_core::redact(url)
}

fn percent_decode(what: &str, text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match hex {
                Some(b) => {
                    out.push(b);
                    i += 3;
                }
                None => return Err(format!("the {what} has an invalid %-escape")),
            }
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("the {what} is not UTF-8 once %-decoded"))
}

fn parse_bool(key: &str, value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" => Ok(true),
        "false" | "no" | "0" => Ok(false),
        other => Err(format!("{key} must be true or false, not {other:?}")),
    }
}

fn parse_seconds(key: &str, value: &str) -> Result<Duration, String> {
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("{key} must be a whole number of seconds, not {value:?}"))
}

fn parse_count(key: &str, value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "{key} must be a number of at least 1, not {value:?}"
        )),
    }
}

fn parse_url(original: &str, rest: &str) -> Result<MssqlOptions, DbError> {
    let bad = |why: String| {
        config_error(format!(
            "invalid SQL Server URL {:?}: {why}",
            redact_url(original)
        ))
    };
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = before_query.split_once('/').unwrap_or((before_query, ""));
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let (user, password) = match userinfo {
        None => return Err(bad("no user name (mssql://user:password@host…)".into())),
        Some(info) => {
            let (u, p) = info.split_once(':').unwrap_or((info, ""));
            (
                percent_decode("user name", u).map_err(&bad)?,
                percent_decode("password", p).map_err(&bad)?,
            )
        }
    };
    if user.is_empty() {
        return Err(bad("the user name is empty".into()));
    }
    let (host, port) = split_host_port(hostport).map_err(&bad)?;
    if host.contains('\\') {
        return Err(bad(
            "named instances need the SQL Browser, which idem does not query: give the instance's TCP port (host:port)"
                .into(),
        ));
    }
    let database = percent_decode("database", path.trim_end_matches('/')).map_err(&bad)?;
    if database.contains('/') {
        return Err(bad(format!(
            "{database:?} is not a database name (one path segment expected)"
        )));
    }

    let mut config = Config::new();
    config.host(&host);
    config.port(port);
    config.authentication(AuthMethod::sql_server(&user, &password));
    config.application_name("idem");
    config.encryption(EncryptionLevel::Required);
    let mut options = MssqlOptions::from_config(config).connect_timeout(DEFAULT_CONNECT_TIMEOUT);
    options.user = Some(user);
    if !database.is_empty() {
        options = options.database(&database);
    }
    let mut trust = false;
    let mut hostname_in_certificate = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode("parameter name", key)
            .map_err(&bad)?
            .to_ascii_lowercase()
            .replace('-', "_");
        let value = percent_decode("parameter value", value).map_err(&bad)?;
        match key.as_str() {
            "encrypt" => {
                let level = match value.trim().to_ascii_lowercase().as_str() {
                    "true" | "yes" | "required" | "mandatory" => EncryptionLevel::Required,
                    "false" | "no" | "off" | "optional" => EncryptionLevel::Off,
                    "danger_plaintext" | "not_supported" => EncryptionLevel::NotSupported,
                    other => {
                        return Err(bad(format!(
                            "encrypt must be true, false or danger_plaintext, not {other:?} (strict needs TDS 8.0, which this build does not enable)"
                        )));
                    }
                };
                options.config.encryption(level);
            }
            "trust_server_certificate" | "trustservercertificate" => {
                trust = parse_bool(&key, &value).map_err(&bad)?;
            }
            "hostname_in_certificate" | "hostnameincertificate" => {
                hostname_in_certificate = Some(value);
            }
            "application_name" | "applicationname" | "app_name" => {
                options.config.application_name(value);
            }
            "connect_timeout" | "connecttimeout" => {
                let timeout = parse_seconds(&key, &value).map_err(&bad)?;
                options = options.connect_timeout(timeout);
            }
            "command_timeout" | "commandtimeout" => {
                let timeout = parse_seconds(&key, &value).map_err(&bad)?;
                options = options.command_timeout((!timeout.is_zero()).then_some(timeout));
            }
            "max_connections" | "pool_max" | "max_pool_size" => {
                options = options.max_connections(parse_count(&key, &value).map_err(&bad)?);
            }
            "isolation" => {
                let level = Isolation::parse(&value).ok_or_else(|| {
                    bad(format!(
                        "isolation must be read_committed, repeatable_read, serializable or snapshot, not {value:?}"
                    ))
                })?;
                options = options.isolation(level);
            }
            "instance" | "instance_name" => {
                return Err(bad(
                    "named instances need the SQL Browser, which idem does not query: give the instance's TCP port (host:port)"
                        .into(),
                ));
            }
            other => {
                return Err(bad(format!(
                    "unknown parameter {other:?} (supported: {URL_PARAMETERS})"
                )));
            }
        }
    }
    if trust && hostname_in_certificate.is_some() {
        return Err(bad(
            "trust_server_certificate=true skips certificate validation, so hostname_in_certificate has no effect"
                .into(),
        ));
    }
    if trust {
        options.config.trust_cert();
    }
    if let Some(name) = hostname_in_certificate {
        options.config.hostname_in_certificate(name);
    }
    Ok(options)
}

fn split_host_port(hostport: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = hostport.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "an IPv6 address needs its closing ]".to_owned())?;
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(format!("unexpected {after:?} after the IPv6 address")),
        }
    } else {
        match hostport.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    let port = match port {
        None => 1433,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => return Err(format!("port {p:?} is not a number from 1 to 65535")),
        },
    };
    Ok((host.to_owned(), port))
}

/// Splits an ADO.NET connection string into `(lower-case key, value)` pairs, leniently
/// (tiberius does the authoritative parse): values may be quoted with `'…'` or `"…"`
/// (a doubled quote is literal) or `{…}`.
fn ado_pairs(s: &str) -> Vec<(String, String)> {
    let chars: Vec<char> = s.chars().collect();
    let mut pairs = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        while i < chars.len() && (chars[i] == ';' || chars[i].is_whitespace()) {
            i += 1;
        }
        let key_start = i;
        while i < chars.len() && chars[i] != '=' && chars[i] != ';' {
            i += 1;
        }
        let key: String = chars[key_start..i].iter().collect();
        let key = key.trim().to_ascii_lowercase();
        if i >= chars.len() || chars[i] == ';' {
            continue;
        }
        i += 1; // '='
        while i < chars.len() && chars[i] == ' ' {
            i += 1;
        }
        let mut value = String::new();
        match chars.get(i).copied() {
            Some(q @ ('\'' | '"')) => {
                i += 1;
                while i < chars.len() {
                    if chars[i] == q {
                        if chars.get(i + 1) == Some(&q) {
                            value.push(q);
                            i += 2;
                            continue;
                        }
                        i += 1;
                        break;
                    }
                    value.push(chars[i]);
                    i += 1;
                }
                while i < chars.len() && chars[i] != ';' {
                    i += 1;
                }
            }
            Some('{') => {
                i += 1;
                while i < chars.len() && chars[i] != '}' {
                    value.push(chars[i]);
                    i += 1;
                }
                while i < chars.len() && chars[i] != ';' {
                    i += 1;
                }
            }
            _ => {
                while i < chars.len() && chars[i] != ';' {
                    value.push(chars[i]);
                    i += 1;
                }
                value = value.trim().to_owned();
            }
        }
        if !key.is_empty() {
            pairs.push((key, value));
        }
    }
    pairs
}

fn parse_ado(s: &str) -> Result<MssqlOptions, DbError> {
    let pairs = ado_pairs(s);
    let get = |names: &[&str]| {
        pairs
            .iter()
            .rev()
            .find(|(k, _)| names.contains(&k.as_str()))
            .map(|(_, v)| v.clone())
    };
    let secret = get(&["password", "pwd"]).filter(|p| !p.is_empty());
    let scrub = |text: String| match &secret {
        Some(p) => text.replace(p.as_str(), "***"),
        None => text,
    };
    let bad = |why: String| {
        config_error(scrub(format!(
            "invalid ADO.NET connection string {:?}: {why}",
            redact_url(s)
        )))
    };
    let Some(server) = get(&["server", "data source"]) else {
        return Err(bad(
            "no Server= (or Data Source=) key; expected for example Server=tcp:host,1433".into(),
        ));
    };
    let server_addr = server.strip_prefix("tcp:").unwrap_or(&server);
    if server_addr.contains('\\') && !server_addr.contains(',') {
        return Err(bad(
            "named instances need the SQL Browser, which idem does not query: give the instance's TCP port (Server=tcp:host,port)"
                .into(),
        ));
    }
    let config = Config::from_ado_string(s).map_err(|e| bad(e.to_string()))?;
    let mut options = MssqlOptions::from_config(config).connect_timeout(DEFAULT_CONNECT_TIMEOUT);
    options.user = get(&["user id", "uid", "user", "username"]);
    options.database =
        get(&["database", "initial catalog", "databasename"]).filter(|d| !d.is_empty());
    if get(&["application name", "applicationname"]).is_none() {
        options.config.application_name("idem");
    }
    if let Some(v) = get(&["connect timeout", "connection timeout", "timeout"]) {
        let timeout = parse_seconds("Connect Timeout", &v).map_err(&bad)?;
        options = options.connect_timeout(timeout);
    }
    if let Some(v) = get(&["command timeout"]) {
        let timeout = parse_seconds("Command Timeout", &v).map_err(&bad)?;
        options = options.command_timeout((!timeout.is_zero()).then_some(timeout));
    }
    if let Some(v) = get(&["max pool size"]) {
        options = options.max_connections(parse_count("Max Pool Size", &v).map_err(&bad)?);
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "Sup3r-S3cret";

    fn ok(url: &str) -> MssqlOptions {
        MssqlOptions::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn err(url: &str) -> String {
        match MssqlOptions::parse(url) {
            Ok(o) => panic!("{url} was accepted: {o:?}"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Configuration, "{e}");
                let text = e.to_string();
                assert!(!text.contains(SECRET), "password leaked: {text}");
                text
            }
        }
    }

    #[test]
    fn urls_parse() {
        let o = ok("mssql://sa:Sup3r-S3cret@db.example:14330/app");
        assert_eq!(o.addr(), "db.example:14330");
        assert_eq!(o.database_name(), Some("app"));
        assert_eq!(o.user(), Some("sa"));
        assert_eq!(o.pool_size(), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(o.isolation_level(), Isolation::ReadCommitted);
        assert_eq!(o.connect_timeout, DEFAULT_CONNECT_TIMEOUT);

        let o = ok("sqlserver://sa:x@localhost");
        assert_eq!(o.addr(), "localhost:1433");
        assert_eq!(o.database_name(), None);

        let o = ok("MSSQL://sa:x@127.0.0.1/master/");
        assert_eq!(o.addr(), "127.0.0.1:1433");
        assert_eq!(o.database_name(), Some("master"));

        let o = ok("mssql://sa:x@[::1]:1434/db");
        assert_eq!(o.addr(), "[::1]:1434");
        assert_eq!(o.endpoint(), ("::1", 1434));

        let o = ok(
            "mssql://app%40corp:p%40ss%3Aw%2Frd@h:1433/my%20db?encrypt=false&trust_server_certificate=true\
             &application_name=billing&connect_timeout=2&command_timeout=0&max_connections=4&isolation=snapshot",
        );
        assert_eq!(o.user(), Some("app@corp"));
        assert_eq!(o.database_name(), Some("my db"));
        assert_eq!(o.pool_size(), 4);
        assert_eq!(o.connect_timeout, Duration::from_secs(2));
        assert_eq!(o.tiberius_config().get_command_timeout(), None);
        assert_eq!(o.isolation_level(), Isolation::Snapshot);

        // An unescaped '@' in the password: the last '@' ends the user info.
        let o = ok("mssql://sa:p@ss@h:1/db");
        assert_eq!(o.addr(), "h:1");
    }

    #[test]
    fn bad_urls_are_refused_clearly_without_the_password() {
        let e = err("mssql://sa:Sup3r-S3cret@h:notaport/db");
        assert!(e.contains("port \"notaport\""), "{e}");
        assert!(e.contains("mssql://sa:***@h:notaport/db"), "{e}");
        assert!(err("mssql://sa:Sup3r-S3cret@h:0").contains("from 1 to 65535"));
        assert!(err("mssql://sa:Sup3r-S3cret@h:70000").contains("from 1 to 65535"));
        assert!(err("mssql://sa:Sup3r-S3cret@/db").contains("no host"));
        assert!(err("mssql://h:1433/db").contains("no user name"));
        assert!(err("mssql://:Sup3r-S3cret@h/db").contains("user name is empty"));
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?pool=3").contains("unknown parameter \"pool\""));
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?encrypt=strict").contains("strict"));
        assert!(
            err("mssql://sa:Sup3r-S3cret@h/db?trust_server_certificate=maybe")
                .contains("true or false")
        );
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?max_connections=0").contains("at least 1"));
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?connect_timeout=soon").contains("seconds"));
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?isolation=chaos").contains("isolation"));
        assert!(err("mssql://sa:Sup3r-S3cret@h/a/b").contains("one path segment"));
        assert!(err("mssql://sa:Sup3r-S3cret@h\\SQLEXPRESS/db").contains("SQL Browser"));
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?instance=X").contains("SQL Browser"));
        assert!(err("mssql://sa:Sup3r-S3cret@[::1/db").contains("closing ]"));
        assert!(err("mssql://sa:Sup%zzS3cret@h/db").contains("invalid %-escape"));
        assert!(err("mssql://sa:Sup3r-S3cret@h/db?%ff=1").contains("not UTF-8"));
        assert!(err("postgres://sa:Sup3r-S3cret@h/db").contains("unsupported SQL Server address"));
        assert!(err("").contains("unsupported SQL Server address"));
        assert!(err("Sup3r-S3cret").contains("unsupported SQL Server address"));
    }

    #[test]
    fn ado_strings_parse() {
        let o = ok(
            "Server=tcp:db.example,1433;Database=app;User Id=app;Password=Sup3r-S3cret;TrustServerCertificate=true",
        );
        assert_eq!(o.addr(), "db.example:1433");
        assert_eq!(o.database_name(), Some("app"));
        assert_eq!(o.user(), Some("app"));
        assert_eq!(o.pool_size(), DEFAULT_MAX_CONNECTIONS);

        let o = ok(
            "Data Source=tcp:10.0.0.5,14333;Initial Catalog=ledger;uid=sa;pwd='a;b''c';Connect Timeout=3;Max Pool Size=8;Command Timeout=60",
        );
        assert_eq!(o.addr(), "10.0.0.5:14333");
        assert_eq!(o.database_name(), Some("ledger"));
        assert_eq!(o.connect_timeout, Duration::from_secs(3));
        assert_eq!(o.pool_size(), 8);
        assert_eq!(
            o.tiberius_config().get_command_timeout(),
            Some(Duration::from_secs(60))
        );

        // A named instance with an explicit port needs no SQL Browser.
        let o = ok("Server=tcp:h\\SQLEXPRESS,1500;User Id=sa;Password=x");
        assert_eq!(o.addr(), "h:1500");
    }

    #[test]
    fn bad_ado_strings_are_refused_clearly_without_the_password() {
        let e = err("Database=app;User Id=sa;Password=Sup3r-S3cret");
        assert!(e.contains("no Server="), "{e}");
        assert!(
            e.contains("Password=***") || e.contains("password=***"),
            "{e}"
        );
        assert!(
            err("Server=tcp:h\\SQLEXPRESS;User Id=sa;Password=Sup3r-S3cret")
                .contains("SQL Browser")
        );
        assert!(
            err("Server=tcp:h,1433;User Id=sa;Password=Sup3r-S3cret;Max Pool Size=none")
                .contains("Max Pool Size")
        );
        assert!(
            err("Server=tcp:h,1433;User Id=sa;Password=Sup3r-S3cret;Connect Timeout=x")
                .contains("Connect Timeout")
        );
        // tiberius refuses these; the message must still hide the password.
        err("Server=tcp:h,notaport;User Id=sa;Password=Sup3r-S3cret");
        err("Server=tcp:h,1433;User Id=sa;Password=Sup3r-S3cret;TrustServerCertificate=perhaps");
        err("Server=tcp:h,1433;User Id=sa;Password='Sup3r-S3cret");
    }

    #[test]
    fn debug_and_redaction_hide_the_password() {
        let o = ok("mssql://sa:Sup3r-S3cret@h:1433/db");
        let debug = format!("{o:?}");
        assert!(!debug.contains(SECRET), "{debug}");
        let o = ok("Server=tcp:h,1433;User Id=sa;Password=Sup3r-S3cret");
        assert!(!format!("{o:?}").contains(SECRET));
        assert_eq!(
            redact_url("mssql://sa:Sup3r-S3cret@h:1433/db?x=1"),
            "mssql://sa:***@h:1433/db?x=1"
        );
        assert_eq!(redact_url("mssql://h:1433/db"), "mssql://h:1433/db");
        assert_eq!(
            redact_url("Server=h;Password={Sup3r;S3cret};User Id=sa"),
            "Server=h;Password=***;User Id=sa"
        );
    }

    #[test]
    fn isolation_names_parse() {
        assert_eq!(
            Isolation::parse("READ COMMITTED"),
            Some(Isolation::ReadCommitted)
        );
        assert_eq!(
            Isolation::parse("repeatable-read"),
            Some(Isolation::RepeatableRead)
        );
        assert_eq!(
            Isolation::parse("serializable"),
            Some(Isolation::Serializable)
        );
        assert_eq!(Isolation::parse("Snapshot"), Some(Isolation::Snapshot));
        assert_eq!(Isolation::parse("read_uncommitted"), None);
    }
}
