//! Records the byte streams the proxy's offline tests replay
//! (`crates/idem-conformance/src/proxy/testdata/`): sqlx and mysql_async through a
//! recording proxy, each on one connection, preparing a statement and executing it again
//! from the driver's cache, in a transaction that commits and one that rolls back.
//!
//! `cargo test -p idem-tests --features mysql --test net_faults -- --ignored
//! record_wire_fixtures` (the URLs must carry no password: the files are committed).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::str::FromStr;

use idem::mysql::mysql_async::prelude::Queryable;
use idem::mysql::mysql_async::{self, OptsBuilder, TxOpts};
use idem::postgres::sqlx::postgres::{PgConnectOptions, PgConnection, PgSslMode};
use idem::postgres::sqlx::{self, Connection};
use idem_conformance::proxy::{self, Direction, Proxy, Wire};

use crate::client::{Res, fail};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crates/idem-conformance/src/proxy/testdata")
}

fn no_password(url: &str) -> Res {
    let authority = url
        .split_once("://")
        .map(|(_, rest)| rest.split(['/', '?']).next().unwrap_or(""))
        .unwrap_or("");
    match authority.rsplit_once('@') {
        Some((user, _)) if user.contains(':') => Err(fail(
            "the URL carries a password; record the fixtures as a user without one",
        )),
        _ => Ok(()),
    }
}

fn render(title: &str, proxy: &Proxy) -> String {
    let mut out = format!(
        "# {title}\n# One chunk per line, as the proxy read it: connection, U (client to server) \
         or D (server to client), hex.\n"
    );
    for chunk in proxy.recording() {
        let (conn, bytes) = (chunk.conn, chunk.bytes);
        let d = match chunk.direction {
            Direction::Up => 'U',
            Direction::Down => 'D',
        };
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let _ = writeln!(out, "{conn} {d} {hex}");
    }
    out
}

async fn start(url: &str, wire: Wire, port: u16) -> Res<(Proxy, String)> {
    no_password(url)?;
    let loopback = "127.0.0.1:9".parse().map_err(|_| fail("loopback"))?;
    let (_, target) = proxy::through(url, loopback, port).ok_or_else(|| fail("bad URL"))?;
    let proxy = Proxy::start_recording(target, wire)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let (proxied, _) = proxy::through(url, proxy.addr(), port).ok_or_else(|| fail("bad URL"))?;
    Ok((proxy, proxied))
}

async fn postgres(url: &str) -> Res<String> {
    let (proxy, proxied) = start(url, Wire::Postgres, 5432).await?;
    let e = |e: sqlx::Error| fail(e.to_string());
    let options = PgConnectOptions::from_str(&proxied)
        .map_err(e)?
        .ssl_mode(PgSslMode::Disable);
    let mut conn = PgConnection::connect_with(&options).await.map_err(e)?;
    sqlx::raw_sql("CREATE TEMPORARY TABLE nf_wire (k text NOT NULL)")
        .execute(&mut conn)
        .await
        .map_err(e)?;
    let insert = "INSERT INTO nf_wire (k) VALUES ($1)";
    let mut tx = conn.begin().await.map_err(e)?;
    for k in ["wire-1", "wire-2"] {
        sqlx::query(insert)
            .bind(k)
            .execute(&mut *tx)
            .await
            .map_err(e)?;
    }
    tx.commit().await.map_err(e)?;
    let mut tx = conn.begin().await.map_err(e)?;
    sqlx::query(insert)
        .bind("wire-3")
        .execute(&mut *tx)
        .await
        .map_err(e)?;
    tx.rollback().await.map_err(e)?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .map_err(e)?;
    conn.close().await.map_err(e)?;
    Ok(render(
        &format!(
            "sqlx 0.9 on PostgreSQL {version}: a temporary table, INSERT … $1 (prepared, then from the cache) with wire-1 and wire-2, COMMIT; wire-3, ROLLBACK"
        ),
        &proxy,
    ))
}

async fn mysql(url: &str) -> Res<String> {
    let (proxy, proxied) = start(url, Wire::Mysql, 3306).await?;
    let e = |e: mysql_async::Error| fail(e.to_string());
    let opts = mysql_async::Opts::from_url(&proxied).map_err(|x| fail(x.to_string()))?;
    let mut conn = mysql_async::Conn::new(OptsBuilder::from_opts(opts).prefer_socket(false))
        .await
        .map_err(e)?;
    conn.query_drop("CREATE TEMPORARY TABLE nf_wire (k VARBINARY(64) NOT NULL)")
        .await
        .map_err(e)?;
    let insert = "INSERT INTO nf_wire (k) VALUES (?)";
    let mut tx = conn.start_transaction(TxOpts::default()).await.map_err(e)?;
    for k in ["wire-1", "wire-2"] {
        tx.exec_drop(insert, (k.as_bytes(),)).await.map_err(e)?;
    }
    tx.commit().await.map_err(e)?;
    let mut tx = conn.start_transaction(TxOpts::default()).await.map_err(e)?;
    tx.exec_drop(insert, ("wire-3".as_bytes(),))
        .await
        .map_err(e)?;
    tx.rollback().await.map_err(e)?;
    let version: Option<String> = conn.query_first("SELECT VERSION()").await.map_err(e)?;
    conn.disconnect().await.map_err(e)?;
    Ok(render(
        &format!(
            "mysql_async 0.37 on {}: a temporary table, INSERT … ? (prepared, then from the cache) with wire-1 and wire-2, COMMIT; wire-3, ROLLBACK",
            version.unwrap_or_default()
        ),
        &proxy,
    ))
}

/// Records both fixtures; returns what it wrote.
pub(crate) async fn fixtures(postgres_url: &str, mysql_url: &str) -> Res<String> {
    let dir = dir();
    std::fs::create_dir_all(&dir).map_err(|e| fail(e.to_string()))?;
    let mut written = Vec::new();
    for (name, text) in [
        ("postgres.txt", postgres(postgres_url).await?),
        ("mysql.txt", mysql(mysql_url).await?),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        written.push(path.display().to_string());
    }
    Ok(format!("wrote {}", written.join(", ")))
}
