//! Shared by the `brokers`, `outbox` and `external` test targets: private namespaces on the live
//! engines (reachable by URL from the `idem` binary), unique names, the `idem` binary,
//! and reading what reached RabbitMQ and NATS JetStream.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use idem::consumer::async_nats::{self, jetstream};
use idem::consumer::lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeleteOptions};
use idem::consumer::lapin::{self, Connection, ConnectionProperties};
use idem::consumer::nats::MSG_ID_HEADER;
use idem_conformance::Bank;
use idem_conformance::mysql::MysqlBank;
use idem_conformance::postgres::PgBank;
use idem_conformance::sqlite::SqliteBank;
use libtest_mimic::Failed;

/// A case's result.
pub type Res<T = ()> = Result<T, Failed>;

/// A failure with this message.
pub fn fail(msg: impl Into<String>) -> Failed {
    Failed::from(msg.into())
}

/// `Ok` when `cond` holds, else a failure with `msg()`.
pub fn check(cond: bool, msg: impl FnOnce() -> String) -> Res {
    if cond { Ok(()) } else { Err(fail(msg())) }
}

/// A name unique to this run and call: `idem_<tag>_<pid>_<n>_<random>`.
pub fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "idem_{tag}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        fastrand::u32(..10_000)
    )
}

/// `var`, or `default` when unset.
pub fn env_url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// RabbitMQ (`IDEM_AMQP_URL`, by default the local broker as guest).
pub fn amqp_url() -> String {
    env_url("IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// NATS with JetStream (`IDEM_NATS_URL`, by default the local server).
pub fn nats_url() -> String {
    env_url("IDEM_NATS_URL", "nats://127.0.0.1:4222")
}

/// The `idem` binary beside this test binary (build it with
/// `cargo build -p idem-cli --all-features`).
pub fn idem_binary() -> Res<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| fail(e.to_string()))?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("idem"))
        .ok_or_else(|| fail("no target directory"))?;
    check(bin.exists(), || {
        format!(
            "{} is missing: build it first with `cargo build -p idem-cli --all-features`",
            bin.display()
        )
    })?;
    Ok(bin)
}

// ---------------------------------------------------------------- engines

/// A live engine with private namespaces the `idem` binary can reach by URL.
pub trait Private: Bank {
    /// The engine's name in test names.
    const NAME: &'static str;
    /// Connects a fixture in a new private namespace (schema, database or file) and
    /// returns it with the URL of that namespace. The engine is required: unreachable
    /// is a failure.
    fn private(tag: &str) -> impl Future<Output = Res<(Self, String)>> + Send;
}

impl Private for PgBank {
    const NAME: &'static str = "postgres";
    async fn private(tag: &str) -> Res<(Self, String)> {
        let base = env_url(
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        );
        let ns = unique(tag);
        let bank = PgBank::connect(&base, Some(&ns))
            .await
            .map_err(|e| fail(format!("PostgreSQL at {}: {e}", idem::redact(&base))))?;
        let sep = if base.contains('?') { '&' } else { '?' };
        Ok((bank, format!("{base}{sep}options[search_path]={ns}")))
    }
}

impl Private for MysqlBank {
    const NAME: &'static str = "mysql";
    async fn private(tag: &str) -> Res<(Self, String)> {
        let base = env_url("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
        let ns = unique(tag);
        let bank = MysqlBank::connect(&base, Some(&ns))
            .await
            .map_err(|e| fail(format!("MariaDB at {}: {e}", idem::redact(&base))))?;
        let (head, query) = base.split_once('?').unwrap_or((&base, ""));
        let (server, _db) = head
            .rsplit_once('/')
            .filter(|(s, _)| s.contains("//"))
            .unwrap_or((head, ""));
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{query}")
        };
        Ok((bank, format!("{server}/{ns}{query}")))
    }
}

impl Private for SqliteBank {
    const NAME: &'static str = "sqlite";
    async fn private(tag: &str) -> Res<(Self, String)> {
        let dir = std::env::temp_dir().join("idem-relay-tests");
        std::fs::create_dir_all(&dir).map_err(|e| fail(e.to_string()))?;
        let url = idem::sqlite::url_for(&dir.join("base.db"));
        let ns = unique(tag);
        let bank = SqliteBank::connect(&url, Some(&ns))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let file = dir.join(format!("base-{ns}.db"));
        Ok((bank, idem::sqlite::url_for(&file)))
    }
}

// ---------------------------------------------------------------- brokers

/// One message as it reached a broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Got {
    /// The queue (RabbitMQ) or subject (NATS) it reached.
    pub destination: String,
    /// Its message ID (`message_id` property, `Nats-Msg-Id` header).
    pub message_id: Option<String>,
    /// Its body.
    pub payload: String,
}

/// A connection and channel to RabbitMQ.
pub async fn amqp_channel() -> Res<(Connection, lapin::Channel)> {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .map_err(|e| {
            fail(format!(
                "RabbitMQ at {}: {e}",
                idem::consumer::amqp::redact(&amqp_url())
            ))
        })?;
    let ch = conn
        .create_channel()
        .await
        .map_err(|e| fail(e.to_string()))?;
    Ok((conn, ch))
}

/// Takes every message in `queue`, in order (each acknowledged).
pub async fn drain_queue(ch: &lapin::Channel, queue: &str) -> Res<Vec<Got>> {
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions::default())
        .await
        .map_err(|e| fail(format!("basic.get from {queue:?}: {e}")))?
    {
        let d = m.delivery;
        out.push(Got {
            destination: queue.to_owned(),
            message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
            payload: String::from_utf8_lossy(&d.data).into_owned(),
        });
        d.acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(out)
}

/// Deletes queues, ignoring errors (cleanup).
pub async fn delete_queues(ch: &lapin::Channel, queues: &[String]) {
    for q in queues {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
}

/// A JetStream context on the local NATS.
pub async fn nats_js() -> Res<jetstream::Context> {
    let client = async_nats::connect(nats_url())
        .await
        .map_err(|e| fail(format!("NATS at {}: {e}", nats_url())))?;
    let mut js = jetstream::new(client);
    js.set_timeout(idem::consumer::nats::REQUEST_TIMEOUT);
    Ok(js)
}

/// Every message stored in `stream`, in stream order.
pub async fn read_stream(js: &jetstream::Context, stream: &str) -> Res<Vec<Got>> {
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| fail(format!("stream {stream}: {e}")))?;
    let state = s
        .info()
        .await
        .map_err(|e| fail(e.to_string()))?
        .state
        .clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    for seq in state.first_sequence..=state.last_sequence {
        let m = s
            .get_raw_message(seq)
            .await
            .map_err(|e| fail(format!("stream {stream} message {seq}: {e}")))?;
        out.push(Got {
            destination: m.subject.to_string(),
            message_id: m.headers.get(MSG_ID_HEADER).map(|v| v.as_str().to_owned()),
            payload: String::from_utf8_lossy(&m.payload).into_owned(),
        });
    }
    Ok(out)
}
