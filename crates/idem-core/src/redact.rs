//! Secrets out of URLs and connection strings before they are printed, logged or put in
//! an error or a span: one function for every engine and broker.

/// What a secret is replaced with.
const MASK: &str = "***";

/// Schemes whose lone userinfo (`scheme://name@host`) is a user name, not a secret.
const USER_NAME_SCHEMES: [&str; 11] = [
    "postgres",
    "postgresql",
    "mysql",
    "mariadb",
    "mssql",
    "sqlserver",
    "oracle",
    "amqp",
    "amqps",
    "redis",
    "rediss",
];

/// `url` with every secret it may carry replaced by `***`, for messages, logs and spans.
///
/// - `scheme://user:password@host…`: the password (the user name stays);
/// - `scheme://token@host…`: a lone token in the userinfo (NATS' token form), except where
///   a lone userinfo is a user name (database, AMQP and Redis URLs: `postgres://app@host`);
/// - query parameters (`?…&…`, and `;…` pairs) whose name says secret: any name containing
///   `pass`, `pwd`, `token`, `secret`, `key`, `auth`, `credential` or `sig`;
/// - an ADO.NET connection string (`Server=…;User Id=…;Password=…`): the value of every
///   key whose name says secret (`Password`, `Pwd`, …), quoted or braced values included;
/// - a comma-separated list of URLs (`nats://a@h1,nats://b@h2`): each one;
/// - text that is neither a URL (`scheme:…`) nor a connection string: all of it.
///
/// ```
/// use idem_core::redact;
/// assert_eq!(redact("postgres://app:pw@db:5432/bank"), "postgres://app:***@db:5432/bank");
/// assert_eq!(redact("nats://s3cr3t@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(redact("postgres://db/bank?user=app&password=pw"), "postgres://db/bank?user=app&password=***");
/// assert_eq!(redact("Server=db;User Id=sa;Password={p;w}"), "Server=db;User Id=sa;Password=***");
/// ```
pub fn redact(url: &str) -> String {
    scan(url, &mut Vec::new())
}

/// The secrets [`redact`] masks in `url`, as written and percent-decoded (empty ones
/// left out): for scrubbing text that may repeat them in another form, such as a
/// driver's own log line.
///
/// ```
/// let secrets = idem_core::url_secrets("postgres://app:p%40ss@db/bank?token=t0k");
/// assert_eq!(secrets, ["p%40ss", "p@ss", "t0k"]);
/// ```
pub fn url_secrets(url: &str) -> Vec<String> {
    let mut found = Vec::new();
    scan(url, &mut found);
    let mut all: Vec<String> = Vec::new();
    for secret in found {
        let decoded = percent_decoded(&secret);
        for s in [Some(secret), decoded].into_iter().flatten() {
            if !s.is_empty() && !all.contains(&s) {
                all.push(s);
            }
        }
    }
    all
}

/// The redacted text; the masked secrets go to `found`.
fn scan(url: &str, found: &mut Vec<String>) -> String {
    if url.matches("://").count() > 1 && url.contains(',') {
        return url
            .split(',')
            .map(|one| redact_one(one, found))
            .collect::<Vec<_>>()
            .join(",");
    }
    redact_one(url, found)
}

/// `text` with `%XX` escapes decoded, if it has any and the result is UTF-8.
fn percent_decoded(text: &str) -> Option<String> {
    if !text.contains('%') {
        return None;
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok().filter(|d| d != text)
}

fn redact_one(text: &str, found: &mut Vec<String>) -> String {
    match text.find("://") {
        Some(at) if is_scheme(&text[..at]) => {
            let scheme = &text[..at];
            let rest = &text[at + 3..];
            format!("{scheme}://{}", redact_after_scheme(scheme, rest, found))
        }
        _ if is_ado(text) => redact_ado(text, found),
        // `sqlite:file.db?key=…`, `sqlite::memory:` and other forms without an authority.
        _ if text
            .split_once(':')
            .is_some_and(|(scheme, _)| is_scheme(scheme)) =>
        {
            redact_pairs(text, found)
        }
        // Neither a URL nor a connection string (a typo, or a password given in its
        // place): nothing in it can be told safe to show.
        _ if text.is_empty() => String::new(),
        _ => {
            found.push(text.to_owned());
            MASK.to_owned()
        }
    }
}

fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// `Key=value;Key=value` with a first key made of letters and spaces.
fn is_ado(text: &str) -> bool {
    let first = text.split(';').next().unwrap_or_default();
    match first.split_once('=') {
        Some((key, _)) => {
            let key = key.trim();
            text.contains(';')
                && !key.is_empty()
                && key.chars().all(|c| c.is_ascii_alphabetic() || c == ' ')
        }
        None => false,
    }
}

/// Whether a parameter or key name names a secret.
fn is_secret_name(name: &str) -> bool {
    let name = name.trim().to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "token",
        "secret",
        "key",
        "auth",
        "credential",
        "sig",
    ]
    .iter()
    .any(|s| name.contains(s))
}

/// The part after `scheme://`: userinfo, then the pairs of the query.
fn redact_after_scheme(scheme: &str, rest: &str, found: &mut Vec<String>) -> String {
    // The userinfo ends at the last `@` before the query: a password may hold `/` or `@`.
    let region_end = rest.find(['?', '#']).unwrap_or(rest.len());
    let (authority_and_path, tail) = rest.split_at(region_end);
    let head = match authority_and_path.rfind('@') {
        Some(at) => {
            let (userinfo, host) = authority_and_path.split_at(at);
            if !userinfo.contains(':') && userinfo.contains('/') {
                // `sqlite:///dir/a@b.db`: an `@` in a path, not a userinfo.
                let path = redact_pairs(authority_and_path, found);
                return format!("{path}{}", redact_pairs(tail, found));
            }
            let userinfo = match userinfo.split_once(':') {
                Some((user, password)) => {
                    found.push(password.to_owned());
                    format!("{user}:{MASK}")
                }
                None if USER_NAME_SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()) => {
                    userinfo.to_owned()
                }
                None => {
                    found.push(userinfo.to_owned());
                    MASK.to_owned()
                }
            };
            format!("{userinfo}{}", redact_pairs(host, found))
        }
        None => redact_pairs(authority_and_path, found),
    };
    format!("{head}{}", redact_pairs(tail, found))
}

/// Masks the values of `name=value` pairs whose name says secret, where a pair starts
/// after `?`, `&` or `;`.
fn redact_pairs(text: &str, found: &mut Vec<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut in_pair = false;
    while !rest.is_empty() {
        let end = rest.find(['?', '&', ';', '#']).unwrap_or(rest.len());
        let (segment, after) = rest.split_at(end);
        match segment.split_once('=') {
            Some((name, value)) if in_pair && is_secret_name(name) => {
                found.push(value.to_owned());
                out.push_str(name);
                out.push('=');
                out.push_str(MASK);
            }
            _ => out.push_str(segment),
        }
        match after.chars().next() {
            Some(sep) => {
                out.push(sep);
                in_pair = sep != '#';
                rest = &after[sep.len_utf8()..];
            }
            None => rest = after,
        }
    }
    out
}

/// An ADO.NET connection string with the value of every secret key masked; `'…'`, `"…"`
/// and `{…}` values may hold `;`.
fn redact_ado(text: &str, found: &mut Vec<String>) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        // The key, up to `=` (or a segment without one, kept as it is).
        let start = i;
        while i < chars.len() && chars[i] != '=' && chars[i] != ';' {
            i += 1;
        }
        let key: String = chars[start..i].iter().collect();
        out.push_str(&key);
        if i >= chars.len() {
            break;
        }
        if chars[i] == ';' {
            out.push(';');
            i += 1;
            continue;
        }
        out.push('=');
        i += 1;
        // The value: quoted, braced, or up to the next `;`.
        let value_start = i;
        while i < chars.len() && chars[i] == ' ' {
            i += 1;
        }
        match chars.get(i).copied() {
            Some(open @ ('\'' | '"' | '{')) => {
                let close = if open == '{' { '}' } else { open };
                i += 1;
                while i < chars.len() {
                    if chars[i] == close {
                        // A doubled closing character stands for itself.
                        if chars.get(i + 1) == Some(&close) {
                            i += 2;
                            continue;
                        }
                        i += 1;
                        break;
                    }
                    i += 1;
                }
                while i < chars.len() && chars[i] != ';' {
                    i += 1;
                }
            }
            _ => {
                while i < chars.len() && chars[i] != ';' {
                    i += 1;
                }
            }
        }
        if is_secret_name(&key) {
            let value: String = chars[value_start..i].iter().collect();
            let value = value.trim();
            found.push(value.to_owned());
            // The value as the driver reads it, without its quotes or braces.
            let inner = value
                .strip_prefix('{')
                .and_then(|v| v.strip_suffix('}'))
                .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .or_else(|| value.strip_prefix('"').and_then(|v| v.strip_suffix('"')));
            if let Some(inner) = inner {
                found.push(inner.to_owned());
            }
            out.push_str(MASK);
        } else {
            out.extend(&chars[value_start..i]);
        }
        if i < chars.len() {
            out.push(';');
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact;

    const SECRET: &str = "Sup3r-S3cret";

    #[test]
    fn passwords_in_the_userinfo() {
        assert_eq!(redact("postgres://u:pw@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("mysql://root@h/test"), "mysql://root@h/test");
        assert_eq!(
            redact("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact("redis://:pw@h:6379"), "redis://:***@h:6379");
        // A password holding `@`, `/` or `:` is masked whole.
        assert_eq!(
            redact("postgres://u:a@b/c:d@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(
            redact("mssql://sa:Sup3r-S3cret@h:1433/db?x=1"),
            "mssql://sa:***@h:1433/db?x=1"
        );
    }

    #[test]
    fn lone_tokens() {
        assert_eq!(redact("nats://s3cr3t@h:4222"), "nats://***@h:4222");
        assert_eq!(redact("tls://s3cr3t@h:4222"), "tls://***@h:4222");
        assert_eq!(redact("ws://s3cr3t@h"), "ws://***@h");
        // Database and AMQP URLs: a lone userinfo is the user name.
        assert_eq!(redact("postgres://app@h/db"), "postgres://app@h/db");
        assert_eq!(redact("oracle://app@h/svc"), "oracle://app@h/svc");
        assert_eq!(redact("nats://h:4222"), "nats://h:4222");
        assert_eq!(
            redact("nats://t1@a:4222,nats://u:p@b:4222"),
            "nats://***@a:4222,nats://u:***@b:4222"
        );
    }

    #[test]
    fn query_parameters() {
        assert_eq!(
            redact("postgres://h/db?user=app&password=pw&sslmode=require"),
            "postgres://h/db?user=app&password=***&sslmode=require"
        );
        assert_eq!(
            redact("nats://h:4222?token=t&auth_token=t2&x=1"),
            "nats://h:4222?token=***&auth_token=***&x=1"
        );
        assert_eq!(
            redact("amqp://h/%2f?api_key=k&client_secret=s"),
            "amqp://h/%2f?api_key=***&client_secret=***"
        );
        assert_eq!(
            redact("sqlite:app.db?key=k&mode=ro"),
            "sqlite:app.db?key=***&mode=ro"
        );
        assert_eq!(redact("sqlite::memory:"), "sqlite::memory:");
        // Neither a URL nor a connection string: shown as nothing but its mask.
        assert_eq!(redact("Sup3r-S3cret"), "***");
        assert_eq!(redact("postgres//u:pw@h/db"), "***");
        assert_eq!(redact(""), "");
        assert_eq!(redact("sqlite:///tmp/a@b.db"), "sqlite:///tmp/a@b.db");
        assert_eq!(
            redact("sqlite:///tmp/a.db?mode=rwc"),
            "sqlite:///tmp/a.db?mode=rwc"
        );
        assert_eq!(
            redact("sqlserver://h;user=sa;password=pw;database=db"),
            "sqlserver://h;user=sa;password=***;database=db"
        );
    }

    #[test]
    fn ado_net_strings() {
        assert_eq!(
            redact("Server=h;Password=pw;User Id=sa"),
            "Server=h;Password=***;User Id=sa"
        );
        assert_eq!(redact("Data Source=h;Pwd=pw"), "Data Source=h;Pwd=***");
        assert_eq!(
            redact("Server=h;Password={Sup3r;S3cret};User Id=sa"),
            "Server=h;Password=***;User Id=sa"
        );
        assert_eq!(
            redact("Server=h; password = 'a;''b' ;Database=d"),
            "Server=h; password =***;Database=d"
        );
        assert_eq!(
            redact("Server=tcp:h,1433;User Id=sa;Password=\"x;y\";TrustServerCertificate=true"),
            "Server=tcp:h,1433;User Id=sa;Password=***;TrustServerCertificate=true"
        );
    }

    #[test]
    fn the_secrets_masked_are_listed() {
        use super::url_secrets;
        assert_eq!(url_secrets("postgres://u:pw@h/db"), ["pw"]);
        assert_eq!(url_secrets("postgres://u@h/db"), Vec::<String>::new());
        assert_eq!(
            url_secrets("nats://t0k@h,nats://u:p%2Fw@h2"),
            ["t0k", "p%2Fw", "p/w"]
        );
        assert_eq!(
            url_secrets("Server=h;Password={a;b};Pwd='c'"),
            ["{a;b}", "a;b", "'c'", "c"]
        );
        assert_eq!(url_secrets("mysql://h/db?password=x&token="), ["x"]);
    }

    #[test]
    fn no_secret_survives_any_form() {
        for text in [
            format!("postgres://u:{SECRET}@h/db"),
            format!("nats://{SECRET}@h:4222"),
            format!("nats://h:4222?token={SECRET}"),
            format!("amqp://u:{SECRET}@h:5672/%2f?heartbeat=10"),
            format!("mysql://u@h/db?password={SECRET}"),
            format!("Server=tcp:h,1433;User Id=sa;Password={SECRET}"),
            format!("Server=tcp:h,1433;PWD={{{SECRET}}}"),
            format!("oracle://u:{SECRET}@h:1521/FREEPDB1"),
            format!("nats://a@h1,nats://{SECRET}@h2"),
        ] {
            let shown = redact(&text);
            assert!(!shown.contains(SECRET), "{text} -> {shown}");
            assert!(shown.contains("***"), "{text} -> {shown}");
        }
    }
}
