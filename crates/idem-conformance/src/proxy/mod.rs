//! A loopback TCP proxy in front of a real database server, for tests and `idem bench`.
//!
//! Every connection to [`Proxy::addr`] is forwarded to the server. Two uses:
//!
//! - **Counting round trips** ([`Proxy::bursts`]): every time the client starts sending
//!   after the server has spoken (or on a connection's first bytes), one client→server
//!   burst is counted, whatever the number of TCP segments or protocol messages in it.
//! - **Network faults** ([`Proxy::arm`]): with [`Wire::Postgres`] or [`Wire::Mysql`] the
//!   proxy follows the protocol ([`wire`]) and finds the statement a [`Fault`]'s
//!   [`Trigger`] names (by markers in its SQL text or bound parameters, in order: "the
//!   `COMMIT` after a statement containing X"); there it loses the reply (the statement
//!   ran, the client sees a broken connection), cuts the connection mid-statement, or
//!   delays the reply.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use idem_conformance::proxy::{Fault, Marker, Proxy, Trigger, Wire};
//! let proxy = Proxy::start("127.0.0.1:5432", Wire::Postgres).await?;
//! // Connect the code under test to `proxy.addr()` (with `sslmode=disable`), then:
//! let lost = proxy.arm(Fault::lose_reply(Trigger::commit_after(
//!     Marker::containing("idem_run").with("order-17"),
//! )));
//! // … run the client …
//! assert_eq!(proxy.hits(lost), 1);
//! # Ok(()) }
//! ```
//!
//! Delivery stays byte-exact: the proxy only forwards whole messages (an incomplete one
//! waits for its remaining bytes), never changes one, and a fault only withholds bytes.

mod fault;
pub mod wire;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

pub use fault::{Action, Fault, FaultId, Faults, Marker, Trigger};
pub use wire::{Statement, Wire};

/// How long a lost reply is waited for before the connection is cut anyway (the
/// statement may then not have run: counted in [`Stats::unanswered`]).
pub const REPLY_GUARD: Duration = Duration::from_secs(30);

/// What the proxy did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Connections accepted.
    pub connections: u64,
    /// Replies lost after the server answered (the statement ran).
    pub lost_replies: u64,
    /// Connections cut mid-statement.
    pub cuts: u64,
    /// Replies delayed.
    pub delays: u64,
    /// Lost replies the server never sent within [`REPLY_GUARD`]: cut anyway.
    pub unanswered: u64,
}

/// One fault that hit, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    /// The fault.
    pub fault: FaultId,
    /// What it did.
    pub action: Action,
    /// The statement it hit ([`Statement::summary`]).
    pub statement: String,
}

/// One chunk of bytes as the proxy read it ([`Proxy::recording`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The connection, numbered from 1 in the order they were accepted.
    pub conn: u64,
    /// Which way the bytes went.
    pub direction: Direction,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// Which way bytes went, in a recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

#[derive(Debug)]
struct Shared {
    wire: Wire,
    bursts: AtomicU64,
    next_conn: AtomicU64,
    faults: Mutex<Faults>,
    stats: Mutex<Stats>,
    hits: Mutex<Vec<Hit>>,
    /// Chunks as read, per connection, when recording.
    recording: Option<Mutex<Vec<Chunk>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A running proxy; stopped (with every connection through it) when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `target`
    /// (`host:port`), following `wire`.
    pub async fn start(target: impl Into<String>, wire: Wire) -> std::io::Result<Self> {
        Self::launch(target.into(), wire, false).await
    }

    /// Like [`Proxy::start`], also keeping every chunk read in either direction
    /// ([`Proxy::recording`]): test fixtures for the protocol decoders.
    pub async fn start_recording(target: impl Into<String>, wire: Wire) -> std::io::Result<Self> {
        Self::launch(target.into(), wire, true).await
    }

    async fn launch(target: String, wire: Wire, record: bool) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            wire,
            bursts: AtomicU64::new(0),
            next_conn: AtomicU64::new(0),
            faults: Mutex::new(Faults::default()),
            stats: Mutex::new(Stats::default()),
            hits: Mutex::new(Vec::new()),
            recording: record.then(|| Mutex::new(Vec::new())),
        });
        let accepting = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let shared = Arc::clone(&accepting);
                let conn = shared.next_conn.fetch_add(1, Ordering::SeqCst) + 1;
                lock(&shared.stats).connections += 1;
                connections.spawn(async move {
                    if let Ok(server) = TcpStream::connect(&target).await {
                        serve(client, server, &shared, conn).await;
                    }
                    lock(&shared.faults).forget(conn);
                });
                // Reap finished connections as we go.
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Self { addr, shared, task })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Client→server bursts counted so far, on every connection.
    pub fn bursts(&self) -> u64 {
        self.shared.bursts.load(Ordering::SeqCst)
    }

    /// Arms a fault; it applies to every connection, new or open.
    pub fn arm(&self, fault: Fault) -> FaultId {
        lock(&self.shared.faults).arm(fault)
    }

    /// Disarms a fault.
    pub fn disarm(&self, id: FaultId) {
        lock(&self.shared.faults).disarm(id);
    }

    /// Disarms every fault.
    pub fn disarm_all(&self) {
        lock(&self.shared.faults).disarm_all();
    }

    /// How many times a fault hit.
    pub fn hits(&self, id: FaultId) -> u32 {
        lock(&self.shared.faults).hits(id)
    }

    /// Faults armed and not spent.
    pub fn armed(&self) -> usize {
        lock(&self.shared.faults).armed()
    }

    /// Every fault that hit so far, in order.
    pub fn hit_log(&self) -> Vec<Hit> {
        lock(&self.shared.hits).clone()
    }

    /// What the proxy did so far.
    pub fn stats(&self) -> Stats {
        *lock(&self.shared.stats)
    }

    /// Every chunk read so far, in order (empty unless started with
    /// [`Proxy::start_recording`]).
    pub fn recording(&self) -> Vec<Chunk> {
        self.shared
            .recording
            .as_ref()
            .map(|r| lock(r).clone())
            .unwrap_or_default()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What one connection's two directions share.
#[derive(Debug)]
struct Link {
    session: Mutex<wire::Session>,
    /// True while the client is the last side that sent.
    client_spoke: AtomicBool,
    /// Lose the server's frames from now on, and cut once it answered this reply.
    lose: Mutex<Option<(u64, Instant, FaultId, String)>>,
    /// Hold the next reply back this long.
    delay: Mutex<Option<Duration>>,
}

#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The side closed (or failed): let the other side finish.
    Closed,
    /// A fault cut the connection: close both sides now.
    Cut,
}

async fn serve(client: TcpStream, server: TcpStream, shared: &Shared, conn: u64) {
    // Nagle would merge or delay what the driver sends; forward bytes as they come.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_r, client_w) = client.into_split();
    let (server_r, server_w) = server.into_split();
    let link = Link {
        session: Mutex::new(wire::Session::new(shared.wire)),
        client_spoke: AtomicBool::new(false),
        lose: Mutex::new(None),
        delay: Mutex::new(None),
    };
    let up = upstream(client_r, server_w, shared, &link, conn);
    let down = downstream(server_r, client_w, shared, &link, conn);
    tokio::pin!(up, down);
    // A cut on either side ends both at once: returning drops (closes) every half.
    tokio::select! {
        end = &mut up => if end == End::Closed { down.await; },
        end = &mut down => if end == End::Closed { up.await; },
    }
}

fn record(shared: &Shared, conn: u64, direction: Direction, bytes: &[u8]) {
    if let Some(r) = &shared.recording {
        lock(r).push(Chunk {
            conn,
            direction,
            bytes: bytes.to_vec(),
        });
    }
}

async fn upstream(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    link: &Link,
    conn: u64,
) -> End {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        record(shared, conn, Direction::Up, &buf[..n]);
        if !link.client_spoke.swap(true, Ordering::SeqCst) {
            shared.bursts.fetch_add(1, Ordering::SeqCst);
        }
        let frames = lock(&link.session).client(&buf[..n]);
        for frame in frames {
            let decided = frame
                .statement
                .as_ref()
                .and_then(|st| lock(&shared.faults).decide(conn, st).map(|d| (d, st)));
            if let Some(((id, action), statement)) = decided {
                let summary = statement.summary();
                match action {
                    Action::Cut => {
                        let half = frame.bytes.len() / 2;
                        let _ = to.write_all(&frame.bytes[..half]).await;
                        let _ = to.flush().await;
                        lock(&shared.stats).cuts += 1;
                        lock(&shared.hits).push(Hit {
                            fault: id,
                            action,
                            statement: summary,
                        });
                        return End::Cut;
                    }
                    Action::LoseReply => {
                        // Set before the statement leaves: its answer cannot arrive first.
                        *lock(&link.lose) = Some((frame.answered_by, Instant::now(), id, summary));
                    }
                    Action::Delay(by) => {
                        *lock(&link.delay) = Some(by);
                        lock(&shared.stats).delays += 1;
                        lock(&shared.hits).push(Hit {
                            fault: id,
                            action,
                            statement: summary,
                        });
                    }
                }
            }
            if to.write_all(&frame.bytes).await.is_err() {
                return End::Closed;
            }
        }
    }
    let _ = to.shutdown().await;
    End::Closed
}

async fn downstream(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    link: &Link,
    conn: u64,
) -> End {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        // Wake up now and then while a lost reply is awaited, to honour its guard.
        let read = tokio::time::timeout(Duration::from_millis(500), from.read(&mut buf)).await;
        let n = match read {
            Err(_) => {
                let lose = lock(&link.lose).clone();
                if let Some((_, since, id, statement)) = lose
                    && since.elapsed() >= REPLY_GUARD
                {
                    lock(&shared.stats).unanswered += 1;
                    lock(&shared.hits).push(Hit {
                        fault: id,
                        action: Action::LoseReply,
                        statement,
                    });
                    return End::Cut;
                }
                continue;
            }
            Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => n,
        };
        record(shared, conn, Direction::Down, &buf[..n]);
        link.client_spoke.store(false, Ordering::SeqCst);
        let frames = lock(&link.session).server(&buf[..n]);
        for frame in frames {
            let lose = lock(&link.lose).clone();
            if let Some((answered_by, _, id, statement)) = lose {
                if frame.replies >= answered_by {
                    // The server ran the statement and answered; the client never hears.
                    lock(&shared.stats).lost_replies += 1;
                    lock(&shared.hits).push(Hit {
                        fault: id,
                        action: Action::LoseReply,
                        statement,
                    });
                    return End::Cut;
                }
                continue;
            }
            let delay = lock(&link.delay).take();
            if let Some(by) = delay {
                tokio::time::sleep(by).await;
            }
            if to.write_all(&frame.bytes).await.is_err() {
                return End::Closed;
            }
        }
    }
    let _ = to.shutdown().await;
    End::Closed
}

/// Rewrites a server URL to go through `proxy`; returns the new URL and the original
/// `host:port`. `default_port` applies when the URL names none.
pub fn through(url: &str, proxy: SocketAddr, default_port: u16) -> Option<(String, String)> {
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
mod tests;
