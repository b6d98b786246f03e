//! Shared by the live tests: a private database on the server `IDEM_MYSQL_URL` names.

use std::time::{SystemTime, UNIX_EPOCH};

use idem_core::Maintenance;
use idem_mysql::mysql_async::prelude::Queryable;
use idem_mysql::mysql_async::{Opts, OptsBuilder, Pool, Row};
use idem_mysql::{MysqlBackend, parse_url};

/// The server under test (the same default as the conformance target).
pub(crate) fn url() -> String {
    std::env::var("IDEM_MYSQL_URL")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A database of its own, migrated, that `drop_database` removes.
pub(crate) struct PrivateDb {
    pub(crate) backend: MysqlBackend,
    pub(crate) name: String,
    base: Opts,
}

async fn run_on(opts: &Opts, statement: String) {
    let pool = Pool::new(opts.clone());
    let mut conn = pool.get_conn().await.unwrap_or_else(|e| {
        panic!(
            "cannot connect to {} (set IDEM_MYSQL_URL; the server must be running): {e}",
            url()
        )
    });
    conn.query_drop(&statement)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
    drop(conn);
    pool.disconnect().await.expect("disconnect");
}

impl PrivateDb {
    /// Creates the database, connects a backend to it and runs idem's migrations.
    pub(crate) async fn create(prefix: &str) -> Self {
        let db = Self::create_unmigrated(prefix).await;
        db.backend.migrate().await.expect("migrate");
        db
    }

    /// Creates the database and connects a backend to it.
    pub(crate) async fn create_unmigrated(prefix: &str) -> Self {
        let base = parse_url(&url()).expect("IDEM_MYSQL_URL");
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!("idem_{prefix}_{}_{nanos}", std::process::id());
        run_on(&base, format!("CREATE DATABASE {name}")).await;
        let backend =
            MysqlBackend::connect_with(OptsBuilder::from_opts(base.clone()).db_name(Some(&name)))
                .await
                .expect("connect to the private database");
        Self {
            backend,
            name,
            base,
        }
    }

    /// Runs one statement on the private database.
    pub(crate) async fn exec(&self, statement: &str) {
        let mut conn = self.backend.pool().get_conn().await.expect("connection");
        conn.query_drop(statement)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }

    /// The first column of the first row, as an integer.
    pub(crate) async fn scalar(&self, query: &str) -> i64 {
        let mut conn = self.backend.pool().get_conn().await.expect("connection");
        let row: Option<Row> = conn
            .query_first(query)
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"));
        row.and_then(|mut r| r.take_opt::<i64, usize>(0))
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("{query}: no integer"))
    }

    /// Closes the pool and drops the database.
    pub(crate) async fn drop_database(self) {
        self.backend.disconnect().await.expect("disconnect");
        run_on(&self.base, format!("DROP DATABASE {}", self.name)).await;
    }
}
