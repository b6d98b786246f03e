//! A loopback TCP proxy that counts round trips: every time the client starts sending
//! after the server has spoken (or on a connection's first bytes), one client→server
//! burst is counted. A burst is what the client sends before it waits for an answer,
//! whatever the number of TCP segments or protocol messages in it; pipelined messages
//! sent together count once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// A running proxy; stopped (with every connection through it) when dropped.
#[derive(Debug)]
pub(crate) struct Proxy {
    addr: SocketAddr,
    bursts: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `target`.
    pub(crate) async fn start(target: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let bursts = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&bursts);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let counter = Arc::clone(&counter);
                connections.spawn(async move {
                    if let Ok(server) = TcpStream::connect(&target).await {
                        relay(client, server, counter).await;
                    }
                });
            }
        });
        Ok(Self { addr, bursts, task })
    }

    /// The address clients connect to.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Client→server bursts counted so far, on every connection.
    pub(crate) fn bursts(&self) -> u64 {
        self.bursts.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, server: TcpStream, bursts: Arc<AtomicU64>) {
    // Nagle would merge or delay what the driver sends; forward bytes as they come.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_r, mut client_w) = client.into_split();
    let (mut server_r, mut server_w) = server.into_split();
    // true while the client is the last side that sent.
    let client_spoke = Arc::new(AtomicBool::new(false));
    let spoke = Arc::clone(&client_spoke);
    let up = async move {
        let mut buf = vec![0_u8; 64 * 1024];
        loop {
            let n = match client_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if !spoke.swap(true, Ordering::SeqCst) {
                bursts.fetch_add(1, Ordering::SeqCst);
            }
            if server_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_w.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0_u8; 64 * 1024];
        loop {
            let n = match server_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            client_spoke.store(false, Ordering::SeqCst);
            if client_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_w.shutdown().await;
    };
    tokio::join!(up, down);
}

/// Rewrites a server URL to go through `proxy`; returns the new URL and the original
/// `host:port`. `default_port` applies when the URL names none.
pub(crate) fn through(url: &str, proxy: SocketAddr, default_port: u16) -> Option<(String, String)> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hostport) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    if hostport.is_empty() {
        return None;
    }
    let target = match hostport.rsplit_once(':') {
        Some((_, port)) if !hostport.ends_with(']') && port.parse::<u16>().is_ok() => {
            hostport.to_owned()
        }
        _ => format!("{hostport}:{default_port}"),
    };
    Some((format!("{scheme}://{userinfo}{proxy}{tail}"), target))
}

#[cfg(test)]
mod tests {
    use super::through;

    #[test]
    fn urls_are_rewritten_to_the_proxy() {
        let proxy = "127.0.0.1:4000".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            through("postgres://postgres@127.0.0.1:5432/postgres", proxy, 5432),
            Some((
                "postgres://postgres@127.0.0.1:4000/postgres".into(),
                "127.0.0.1:5432".into()
            ))
        );
        assert_eq!(
            through("mysql://root:p%40ss@db/test?x=1", proxy, 3306),
            Some((
                "mysql://root:p%40ss@127.0.0.1:4000/test?x=1".into(),
                "db:3306".into()
            ))
        );
        assert_eq!(through("nonsense", proxy, 1), None);
    }
}
