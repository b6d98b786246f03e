//! What `idem` prints besides its results: diagnostics on stderr when `RUST_LOG` asks for
//! them (`RUST_LOG=debug`, `RUST_LOG=idem_core=trace,warn`), and the final error line.
//!
//! URLs are redacted where idem prints them ([`idem::redact`]); as a second net, every line
//! written here has the secrets of the command line's URLs (`--url`, `IDEM_URL`, broker
//! and provider URLs) masked, so that a driver that logs a URL or a parameter of its own
//! cannot show them either.

use std::io::{self, Write};
use std::sync::Arc;

use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::fail::{self, Fail};

/// Shorter secrets are left to the structural redaction: masking every occurrence of a
/// two-letter string would garble every line.
const MIN_SCRUBBED: usize = 4;

/// The secrets of the command line's URLs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Secrets(Arc<Vec<String>>);

impl Secrets {
    /// The secrets in the arguments (`--opt URL` and `--opt=URL`) and in `IDEM_URL`.
    pub(crate) fn of_command_line() -> Self {
        let args = std::env::args_os().map(|a| a.to_string_lossy().into_owned());
        let env = std::env::var("IDEM_URL").ok();
        Self::of(args.chain(env))
    }

    fn of(texts: impl IntoIterator<Item = String>) -> Self {
        let mut all: Vec<String> = Vec::new();
        for text in texts {
            let value = match text.strip_prefix("--").and_then(|t| t.split_once('=')) {
                Some((_, value)) => value.to_owned(),
                None => text,
            };
            // Only URLs and connection strings: a command name or an option is not a secret
            // (the redaction masks any text it cannot read as either).
            let url_like = value.contains("://")
                || (value.contains('=') && value.contains(';'))
                || value.split_once(':').is_some_and(|(scheme, _)| {
                    !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphabetic())
                });
            if !url_like {
                continue;
            }
            for secret in idem::url_secrets(&value) {
                if secret.chars().count() >= MIN_SCRUBBED && !all.contains(&secret) {
                    all.push(secret);
                }
            }
        }
        // Longest first, so that a secret holding another is masked whole.
        all.sort_by_key(|s| std::cmp::Reverse(s.len()));
        Self(Arc::new(all))
    }

    /// `text` with every secret replaced by `***`.
    pub(crate) fn scrub(&self, text: &str) -> String {
        self.0.iter().fold(text.to_owned(), |t, secret| {
            t.replace(secret.as_str(), "***")
        })
    }
}

/// Installs the diagnostics subscriber when `RUST_LOG` is set: lines on stderr, secrets
/// masked. Without `RUST_LOG`, nothing is logged.
pub(crate) fn init(secrets: &Secrets) -> Result<(), Fail> {
    let Some(filter) = std::env::var("RUST_LOG")
        .ok()
        .filter(|f| !f.trim().is_empty())
    else {
        return Ok(());
    };
    let targets: Targets = filter.parse().map_err(|e| {
        Fail::new(
            fail::INVALID_INPUT,
            format!(
                "RUST_LOG={filter:?} is not a log filter ({e}); use a level such as `info` or \
                 targets such as `idem_core=debug,warn`"
            ),
        )
    })?;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(Scrubbing(secrets.clone()))
        .with_ansi(false);
    tracing_subscriber::registry()
        .with(layer)
        .with(targets)
        .try_init()
        .map_err(|e| Fail::new(fail::OTHER, format!("cannot start logging: {e}")))
}

/// Stderr, every write scrubbed.
#[derive(Debug, Clone)]
struct Scrubbing(Secrets);

impl<'a> MakeWriter<'a> for Scrubbing {
    type Writer = ScrubbingWriter;

    fn make_writer(&'a self) -> Self::Writer {
        ScrubbingWriter(self.0.clone())
    }
}

/// One event's line, scrubbed on its way to stderr.
#[derive(Debug)]
struct ScrubbingWriter(Secrets);

impl Write for ScrubbingWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        io::stderr().write_all(self.0.scrub(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_a_command_line_secret_is_scrubbed() {
        let secrets = Secrets::of([
            "idem".to_owned(),
            "--url".to_owned(),
            "postgres://app:pa%24%24word@127.0.0.1:1/db?token=tok-1234".to_owned(),
            "--amqp=amqp://guest:rabbit-pw@127.0.0.1:2/%2f".to_owned(),
            "nats://nats-token-9@127.0.0.1:3".to_owned(),
            "Server=tcp:h,1433;User Id=sa;Password={ado;pw}".to_owned(),
            "mysql://root:abc@h/db".to_owned(),
        ]);
        let line = "connect postgres://app:pa%24%24word@h?token=tok-1234 (pa$$word) \
                    amqp rabbit-pw nats nats-token-9 ado ado;pw {ado;pw} abc";
        let scrubbed = secrets.scrub(line);
        for secret in [
            "pa%24%24word",
            "pa$$word",
            "tok-1234",
            "rabbit-pw",
            "nats-token-9",
            "ado;pw",
        ] {
            assert!(!scrubbed.contains(secret), "{secret} in {scrubbed}");
        }
        // Secrets shorter than four characters are left to the structural redaction.
        assert!(scrubbed.ends_with(" abc"), "{scrubbed}");
        // Command names, options and values are not secrets.
        let plain = Secrets::of(
            [
                "idem",
                "maintain",
                "--ticks",
                "1",
                "demo",
                "--listen=127.0.0.1:0",
            ]
            .map(String::from),
        );
        assert_eq!(
            plain.scrub("maintain --ticks demo 127.0.0.1"),
            "maintain --ticks demo 127.0.0.1"
        );
    }
}
