//! Private broker instances for the fault suite: a RabbitMQ node or a NATS server with
//! JetStream of its own, on the ports set aside for this suite, in a temporary directory,
//! started, restarted, paused (SIGSTOP) and stopped by the test. The shared brokers are
//! never touched.
//!
//! Ports: RabbitMQ AMQP 5682–5689 (Erlang distribution on the port + 20000, node
//! `idem-c-<port>@localhost`; the machine's epmd on 4369 is shared), NATS 4232–4239.
//! Programs: `IDEM_RABBITMQ_SERVER` (default `/usr/lib/rabbitmq/bin/rabbitmq-server`, the
//! Debian package's) and `IDEM_NATS_SERVER` (default `nats-server` on the `PATH`, else
//! `/usr/sbin/nats-server`); `ci/services.sh` installs both. Run as root, each server runs
//! as its package's user (`rabbitmq`, `nats`; through `setpriv`, which keeps the process
//! ID, so the test's signals reach the server itself), as `ci/services.sh` runs the shared
//! ones; otherwise as the current user.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use idem::consumer::async_nats;
use idem::consumer::lapin::{Connection, ConnectionProperties};
use tokio::process::{Child, Command};

use crate::support::{Res, check, fail, unique};

/// Which broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Rabbit,
    Nats,
}

/// Ports handed out in this process (each port once).
static TAKEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// A free port of `range` not handed out before in this process.
fn take_port(range: std::ops::RangeInclusive<u16>) -> Res<u16> {
    let mut taken = TAKEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for port in range.clone() {
        if taken.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            taken.push(port);
            return Ok(port);
        }
    }
    Err(fail(format!(
        "no free port in {range:?} for a private broker (another run still holding them?)"
    )))
}

fn give_back(port: u16) {
    let mut taken = TAKEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    taken.retain(|p| *p != port);
}

/// How long one start of a broker, or a stop, may take (a hang guard). A start that does
/// not answer in time, or exits, is killed and made once more: the cases test the clients
/// against a broker that went away and came back, not the broker's own start, and CI saw a
/// RabbitMQ restart answer nothing for 120 s once in many runs (its output ended at the
/// first start's banner). Each failed attempt is printed with the server's logs.
const START_GUARD: Duration = Duration::from_secs(60);

/// A private broker. Dropping it kills the process and removes its directory.
pub(crate) struct PrivateBroker {
    kind: Kind,
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
    paused: bool,
    /// The user the server runs as, when the test runs as root.
    run_as: Option<&'static str>,
}

/// As root: `user`, if it exists (the package's own user); otherwise `None` (the current
/// user).
fn server_user(user: &'static str) -> Option<&'static str> {
    let out = |args: &[&str]| {
        std::process::Command::new("id")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    (out(&["-u"]).as_deref() == Some("0") && out(&["-u", user]).is_some()).then_some(user)
}

fn program(var: &str, candidates: &[&str]) -> Res<PathBuf> {
    if let Ok(p) = std::env::var(var) {
        return Ok(PathBuf::from(p));
    }
    for c in candidates {
        let p = Path::new(c);
        if p.is_absolute() {
            if p.exists() {
                return Ok(p.to_owned());
            }
        } else if let Some(found) = std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(c))
                .find(|f| f.exists())
        }) {
            return Ok(found);
        }
    }
    Err(fail(format!(
        "none of {candidates:?} is installed (set {var}); ci/services.sh installs it"
    )))
}

impl PrivateBroker {
    /// A RabbitMQ node of its own, started.
    pub(crate) async fn rabbitmq() -> Res<Self> {
        Self::rabbitmq_with("", &[]).await
    }

    /// A RabbitMQ node of its own, started, with `conf` (`rabbitmq.conf` lines) added and
    /// `rabbit` application settings that `rabbitmq.conf` has no key for (`advanced.config`
    /// terms such as `{channel_tick_interval, 250}`).
    pub(crate) async fn rabbitmq_with(conf: &str, rabbit: &[&str]) -> Res<Self> {
        let port = take_port(5682..=5689)?;
        let advanced = format!("[{{rabbit, [{}]}}].\n", rabbit.join(", "));
        Self::create(Kind::Rabbit, port, (conf, &advanced)).await
    }

    /// A NATS server with JetStream of its own, started.
    pub(crate) async fn nats() -> Res<Self> {
        let port = take_port(4232..=4239)?;
        Self::create(Kind::Nats, port, ("", "")).await
    }

    /// `rabbit`: the added `rabbitmq.conf` lines and the whole `advanced.config`.
    async fn create(kind: Kind, port: u16, rabbit: (&str, &str)) -> Res<Self> {
        let (conf, advanced) = rabbit;
        let dir = std::env::temp_dir().join(unique("broker"));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            give_back(port);
            return Err(fail(format!("cannot create {}: {e}", dir.display())));
        }
        let mut broker = Self {
            kind,
            port,
            dir,
            child: None,
            paused: false,
            run_as: server_user(match kind {
                Kind::Rabbit => "rabbitmq",
                Kind::Nats => "nats",
            }),
        };
        if kind == Kind::Rabbit {
            let files = [
                ("enabled_plugins", "[].\n".to_owned()),
                (
                    "rabbitmq.conf",
                    format!(
                        "listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n{conf}"
                    ),
                ),
                ("env.conf", String::new()),
                ("advanced.config", advanced.to_owned()),
            ];
            for (name, text) in files {
                std::fs::write(broker.dir.join(name), text)
                    .map_err(|e| fail(format!("cannot write {name}: {e}")))?;
            }
        }
        if let Some(user) = broker.run_as {
            let owned = std::process::Command::new("chown")
                .arg("-R")
                .arg(format!("{user}:"))
                .arg(&broker.dir)
                .status()
                .map_err(|e| fail(format!("chown: {e}")))?;
            check(owned.success(), || {
                format!("chown of {} to {user} failed", broker.dir.display())
            })?;
        }
        broker.start().await?;
        Ok(broker)
    }

    /// The broker's URL.
    pub(crate) fn url(&self) -> String {
        match self.kind {
            Kind::Rabbit => format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port),
            Kind::Nats => format!("nats://127.0.0.1:{}", self.port),
        }
    }

    /// The process ID of the running broker.
    fn pid(&self) -> Res<u32> {
        self.child
            .as_ref()
            .and_then(Child::id)
            .ok_or_else(|| fail("the private broker is not running"))
    }

    fn command(&self) -> Res<Command> {
        let dir = &self.dir;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .map_err(|e| fail(e.to_string()))?;
        let err = out.try_clone().map_err(|e| fail(e.to_string()))?;
        let launch = |server: PathBuf| match self.run_as {
            Some(user) => {
                let mut c = Command::new("setpriv");
                c.args(["--reuid", user, "--regid", user, "--init-groups", "--"])
                    .arg(server);
                c
            }
            None => Command::new(server),
        };
        let mut cmd = match self.kind {
            Kind::Rabbit => {
                let mut c = launch(program(
                    "IDEM_RABBITMQ_SERVER",
                    &["/usr/lib/rabbitmq/bin/rabbitmq-server"],
                )?);
                let port = self.port;
                c.current_dir(dir)
                    // The Erlang cookie goes to a private home.
                    .env("HOME", dir)
                    // Replace the shell by the VM: the child's PID is the broker's, so
                    // SIGTERM stops it cleanly and SIGSTOP pauses it.
                    .env("RUNNING_UNDER_SYSTEMD", "1")
                    .env("RABBITMQ_CONF_ENV_FILE", dir.join("env.conf"))
                    .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
                    .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
                    .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
                    .env("RABBITMQ_NODENAME", format!("idem-c-{port}@localhost"))
                    .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
                    .env("RABBITMQ_NODE_PORT", port.to_string())
                    .env("RABBITMQ_DIST_PORT", (u32::from(port) + 20_000).to_string())
                    .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
                    .env("RABBITMQ_LOG_BASE", dir.join("log"))
                    .env("RABBITMQ_PID_FILE", dir.join("pid"))
                    .env("ERL_EPMD_ADDRESS", "127.0.0.1");
                c
            }
            Kind::Nats => {
                let mut c = launch(program(
                    "IDEM_NATS_SERVER",
                    &["nats-server", "/usr/sbin/nats-server"],
                )?);
                c.args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-js",
                    "-sd",
                ])
                .arg(dir.join("js"));
                c
            }
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// Starts the broker and waits until it answers its protocol; a start that fails is
    /// killed and made once more (see [`START_GUARD`]).
    pub(crate) async fn start(&mut self) -> Res {
        let Err(first) = self.start_once().await else {
            return Ok(());
        };
        let first = first.message().unwrap_or("failed").to_owned();
        println!(
            "[private broker] port {}: the start failed, killed and made once more: {first}",
            self.port
        );
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
        self.start_once().await.map_err(|second| {
            let second = second.message().unwrap_or("failed");
            fail(format!("{second}\n(the first attempt: {first})"))
        })
    }

    async fn start_once(&mut self) -> Res {
        check(self.child.is_none(), || "already running".into())?;
        let child = self
            .command()?
            .spawn()
            .map_err(|e| fail(format!("cannot start the private broker: {e}")))?;
        self.child = Some(child);
        let url = self.url();
        let kind = self.kind;
        let mut last = String::new();
        let began = std::time::Instant::now();
        let ready = tokio::time::timeout(START_GUARD, async {
            loop {
                if let Some(child) = self.child.as_mut()
                    && let Ok(Some(status)) = child.try_wait()
                {
                    return Err(format!("exited at start ({status})"));
                }
                let up = match kind {
                    Kind::Rabbit => {
                        match Connection::connect(&url, ConnectionProperties::default()).await {
                            Ok(c) => {
                                let _ = c.close(200, "ready".into()).await;
                                Ok(())
                            }
                            Err(e) => Err(e.to_string()),
                        }
                    }
                    Kind::Nats => match async_nats::connect(&url).await {
                        Ok(client) => {
                            // JetStream answers once it can create (and remove) a stream.
                            let js = async_nats::jetstream::new(client);
                            match js.get_or_create_stream("IDEM_READY").await {
                                Ok(_) => js
                                    .delete_stream("IDEM_READY")
                                    .await
                                    .map(drop)
                                    .map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            }
                        }
                        Err(e) => Err(e.to_string()),
                    },
                };
                match up {
                    Ok(()) => return Ok(()),
                    Err(e) => last = e,
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        let log = || self.diagnostics();
        match ready {
            Ok(Ok(())) => {
                let took = began.elapsed();
                if took > Duration::from_secs(10) {
                    println!(
                        "[private broker] port {} answered after {took:.1?} (slow start)",
                        self.port
                    );
                }
                Ok(())
            }
            Ok(Err(why)) => Err(fail(format!(
                "private broker on port {}: {why}; its log ends:\n{}",
                self.port,
                log()
            ))),
            Err(_) => Err(fail(format!(
                "private broker on port {} did not answer within {START_GUARD:?} (last: {last}); its log ends:\n{}",
                self.port,
                log()
            ))),
        }
    }

    /// What a failed start shows: the ends of the server's output and, for RabbitMQ, of
    /// the node's own log (the output stops at the banner; the log goes on through boot),
    /// and the server process's state.
    fn diagnostics(&self) -> String {
        let tail = |path: PathBuf, n: usize| {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()));
            let lines: Vec<&str> = text.lines().collect();
            format!(
                "{}:\n{}",
                path.display(),
                lines[lines.len().saturating_sub(n)..].join("\n")
            )
        };
        let mut parts = vec![tail(self.dir.join("server.log"), 15)];
        if self.kind == Kind::Rabbit {
            parts.push(tail(
                self.dir
                    .join("log")
                    .join(format!("idem-c-{}@localhost.log", self.port)),
                25,
            ));
        }
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .map(|s| {
                    s.lines()
                        .filter(|l| l.starts_with("State:") || l.starts_with("Threads:"))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_else(|e| format!("no /proc entry ({e})"));
            parts.push(format!("process {pid}: {status}"));
        }
        parts.join("\n")
    }

    /// Stops the broker cleanly (SIGTERM) and waits until it exited; its data stays.
    pub(crate) async fn stop(&mut self) -> Res {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if self.paused {
            signal(child.id(), "CONT")?;
            self.paused = false;
        }
        signal(child.id(), "TERM")?;
        match tokio::time::timeout(START_GUARD, child.wait()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(fail(e.to_string())),
            Err(_) => {
                let _ = child.kill().await;
                Err(fail(format!(
                    "the private broker did not stop within {START_GUARD:?} (killed)"
                )))
            }
        }
    }

    /// Stops and starts the broker again (durable queues, persistent messages and
    /// JetStream's file storage survive).
    pub(crate) async fn restart(&mut self) -> Res {
        self.stop().await?;
        self.start().await
    }

    /// Pauses the broker (SIGSTOP): connections stay open, nothing is answered.
    pub(crate) fn pause(&mut self) -> Res {
        signal(Some(self.pid()?), "STOP")?;
        self.paused = true;
        Ok(())
    }

    /// Resumes a paused broker (SIGCONT).
    pub(crate) fn resume(&mut self) -> Res {
        signal(Some(self.pid()?), "CONT")?;
        self.paused = false;
        Ok(())
    }

    /// The process ID, to pause the broker from inside a handler.
    pub(crate) fn process_id(&self) -> Res<u32> {
        self.pid()
    }

    /// Stops the broker and removes its directory.
    pub(crate) async fn remove(mut self) {
        let _ = self.stop().await;
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        // A failed case: kill the process (a paused one is resumed first, so it dies).
        if let Some(child) = self.child.as_mut() {
            if self.paused {
                let _ = signal(child.id(), "CONT");
            }
            let _ = child.start_kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        give_back(self.port);
    }
}

/// Sends `SIG<name>` to `pid` (synchronously: usable from a handler's `decode`).
pub(crate) fn signal(pid: Option<u32>, name: &str) -> Res {
    let pid = pid.ok_or_else(|| fail("no process"))?;
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .map_err(|e| fail(format!("kill -{name} {pid}: {e}")))?;
    check(status.success(), || format!("kill -{name} {pid} failed"))
}
