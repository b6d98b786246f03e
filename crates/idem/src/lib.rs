#![doc = include_str!("../README.md")]

pub use idem_core as core;
pub use idem_core::{
    Backend, BoxFuture, CompleteReport, Consumed, DbError, Error, ErrorKind, Finished, Idem,
    InvalidInput, Key, Maintenance, MessageId, Operation, OutboxStore, Outcome, Outgoing,
    PoolChecks, PoolOptions, Principal, Publisher, PurgeReport, RelayError, RelayFailure,
    RelayOptions, RelayReport, Request, RetryPolicy, Run, RunStore, Scope, Started, Subscriber,
};

/// HTTP `Idempotency-Key` for axum (feature `axum`): see `docs/http.md`.
#[cfg(feature = "axum")]
pub use idem_axum as axum;
/// Idempotent consumers on RabbitMQ (feature `amqp`) and NATS JetStream (feature `nats`).
#[cfg(any(feature = "amqp", feature = "nats"))]
pub use idem_consumer as consumer;
#[cfg(feature = "mssql")]
pub use idem_mssql as mssql;
#[cfg(feature = "mysql")]
pub use idem_mysql as mysql;
#[cfg(feature = "oracle")]
pub use idem_oracle as oracle;
#[cfg(feature = "postgres")]
pub use idem_postgres as postgres;
#[cfg(feature = "sqlite")]
pub use idem_sqlite as sqlite;

use std::time::Duration;

/// The engines idem supports, chosen from a URL's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `sqlite:` (feature `sqlite`, default).
    Sqlite,
    /// `postgres://`, `postgresql://` (feature `postgres`).
    Postgres,
    /// `mysql://`, `mariadb://` (feature `mysql`).
    Mysql,
    /// `mssql://`, `sqlserver://`, or an ADO.NET connection string (feature `mssql`).
    Mssql,
    /// `oracle://` (feature `oracle`).
    Oracle,
}

impl Engine {
    /// Picks the engine from a URL's scheme.
    pub fn from_url(url: &str) -> Result<Self, DbError> {
        let scheme = url
            .split(':')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        Ok(match scheme.as_str() {
            "sqlite" => Self::Sqlite,
            "postgres" | "postgresql" => Self::Postgres,
            "mysql" | "mariadb" => Self::Mysql,
            "mssql" | "sqlserver" => Self::Mssql,
            "oracle" => Self::Oracle,
            _ if url.contains(';') && {
                let lower = url.to_ascii_lowercase();
                lower.contains("server=") || lower.contains("data source=")
            } =>
            {
                Self::Mssql
            }
            _ => {
                return Err(DbError::new(
                    "idem",
                    ErrorKind::Configuration,
                    format!(
                        "unknown database URL {:?}: expected sqlite:, postgres://, mysql://, mariadb://, mssql:// or oracle://",
                        redact(url)
                    ),
                ));
            }
        })
    }

    /// The engine's name and cargo feature.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::Mysql => "mysql",
            Self::Mssql => "mssql",
            Self::Oracle => "oracle",
        }
    }

    /// An error saying this build lacks the engine's feature.
    pub fn not_compiled(self) -> DbError {
        DbError::new(
            "idem",
            ErrorKind::Configuration,
            format!(
                "this build has no {0} support: enable the cargo feature `{0}`",
                self.name()
            ),
        )
    }
}

/// A URL or connection string with every secret replaced by `***`, for messages, logs and
/// spans (passwords, lone tokens, secret query parameters, ADO.NET `Password=`): the one
/// redaction function every idem crate uses.
pub use idem_core::redact;
/// The secrets [`redact`] masks in a URL, as written and percent-decoded: for scrubbing
/// text that may repeat them in another form (a driver's own log line).
pub use idem_core::url_secrets;

/// Any compiled-in backend, connected by URL: for migrations and purges when the
/// engine is only known at run time. Effects need the engine's own transaction type,
/// so run them through [`Idem`] with the concrete backend.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyBackend {
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(idem_sqlite::SqliteBackend),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(idem_postgres::PgBackend),
    /// MySQL or MariaDB.
    #[cfg(feature = "mysql")]
    Mysql(idem_mysql::MysqlBackend),
    /// SQL Server.
    #[cfg(feature = "mssql")]
    Mssql(idem_mssql::MssqlBackend),
    /// Oracle.
    #[cfg(feature = "oracle")]
    Oracle(idem_oracle::OracleBackend),
}

macro_rules! each {
    // Matches on the value (not the reference) so that a build with no engine feature,
    // where `AnyBackend` has no variants, still compiles.
    ($self:expr, $b:ident => $body:expr) => {
        match *$self {
            #[cfg(feature = "sqlite")]
            AnyBackend::Sqlite(ref $b) => $body,
            #[cfg(feature = "postgres")]
            AnyBackend::Postgres(ref $b) => $body,
            #[cfg(feature = "mysql")]
            AnyBackend::Mysql(ref $b) => $body,
            #[cfg(feature = "mssql")]
            AnyBackend::Mssql(ref $b) => $body,
            #[cfg(feature = "oracle")]
            AnyBackend::Oracle(ref $b) => $body,
        }
    };
}

impl AnyBackend {
    /// Connects to the engine the URL's scheme names.
    pub async fn connect(url: &str) -> Result<Self, DbError> {
        let engine = Engine::from_url(url)?;
        match engine {
            #[cfg(feature = "sqlite")]
            Engine::Sqlite => idem_sqlite::SqliteBackend::connect(url)
                .await
                .map(Self::Sqlite),
            #[cfg(feature = "postgres")]
            Engine::Postgres => idem_postgres::PgBackend::connect(url)
                .await
                .map(Self::Postgres),
            #[cfg(feature = "mysql")]
            Engine::Mysql => idem_mysql::MysqlBackend::connect(url)
                .await
                .map(Self::Mysql),
            #[cfg(feature = "mssql")]
            Engine::Mssql => idem_mssql::MssqlBackend::connect(url)
                .await
                .map(Self::Mssql),
            #[cfg(feature = "oracle")]
            Engine::Oracle => idem_oracle::OracleBackend::connect(url)
                .await
                .map(Self::Oracle),
            #[allow(unreachable_patterns)]
            other => Err(other.not_compiled()),
        }
    }

    /// Applies the embedded migrations; returns the versions applied now.
    pub async fn migrate(&self) -> Result<Vec<u32>, DbError> {
        each!(self, b => b.migrate().await)
    }

    /// Deletes records older than `older_than` in batches of `batch`.
    #[cfg_attr(
        not(any(
            feature = "sqlite",
            feature = "postgres",
            feature = "mysql",
            feature = "mssql",
            feature = "oracle"
        )),
        allow(unused_variables)
    )]
    pub async fn purge(&self, older_than: Duration, batch: u32) -> Result<PurgeReport, DbError> {
        self.purge_with_progress(older_than, batch, |_| {}).await
    }

    /// Like [`AnyBackend::purge`], calling `progress` with the running totals after every
    /// statement.
    #[cfg_attr(
        not(any(
            feature = "sqlite",
            feature = "postgres",
            feature = "mysql",
            feature = "mssql",
            feature = "oracle"
        )),
        allow(unused_variables, unused_mut)
    )]
    pub async fn purge_with_progress(
        &self,
        older_than: Duration,
        batch: u32,
        mut progress: impl FnMut(&PurgeReport) + Send,
    ) -> Result<PurgeReport, DbError> {
        each!(self, b => Idem::new(b.clone()).purge_with_progress(older_than, batch, &mut progress).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_pick_engines() {
        assert_eq!(
            Engine::from_url("sqlite::memory:").ok(),
            Some(Engine::Sqlite)
        );
        assert_eq!(
            Engine::from_url("postgresql://u@h/db").ok(),
            Some(Engine::Postgres)
        );
        assert_eq!(
            Engine::from_url("mariadb://root@h/test").ok(),
            Some(Engine::Mysql)
        );
        assert_eq!(
            Engine::from_url("Server=tcp:h,1433;User Id=sa;Password=x").ok(),
            Some(Engine::Mssql)
        );
        assert_eq!(
            Engine::from_url("oracle://u:p@h/FREEPDB1").ok(),
            Some(Engine::Oracle)
        );
        assert_eq!(
            Engine::from_url("Data Source=tcp:h,1433;Pwd=x").ok(),
            Some(Engine::Mssql)
        );
        let err = Engine::from_url("redis://u:secret@h")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown database URL") && !err.contains("secret"),
            "{err}"
        );
    }
}
