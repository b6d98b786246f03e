//! The `idem` binary as users run it: exit codes per failure on every live engine and
//! broker, the connect timeout on a wrong-protocol port, no stray `idem.db`, `idem docs`
//! outside the repository, plain output when not on a terminal, a closed or full stdout,
//! `idem maintain --ticks`'s exit code, the help text, the operator's commands apart from
//! the demo's, and no secret of a URL printed by any command (against ports nothing
//! listens on, with `RUST_LOG=trace`).
//!
//! PostgreSQL and MariaDB/MySQL are required (`IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`, with
//! the defaults of `ci/test.sh`); an unreachable server fails these tests. Two cases also
//! need the brokers (`IDEM_AMQP_URL`, `IDEM_NATS_URL` and the `nats-server` program);
//! `ci/test.sh` skips them by name when `IDEM_BROKERS=0`.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A hang guard, not a timing assertion: far above the CLI's 10 s connect timeout.
const HANG_GUARD: Duration = Duration::from_secs(90);

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// `scheme://[user[:password]@]host:port/db` split into its parts (the test URLs' form).
struct Parts {
    scheme: String,
    user: String,
    host_port: String,
    db: String,
}

fn parts(url: &str) -> Parts {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (authority, db) = rest.split_once('/').unwrap_or((rest, ""));
    let db = db.split('?').next().unwrap_or_default();
    let (user, host_port) = match authority.rsplit_once('@') {
        Some((userinfo, host_port)) => (userinfo.split(':').next().unwrap_or_default(), host_port),
        None => ("", authority),
    };
    Parts {
        scheme: scheme.into(),
        user: user.into(),
        host_port: host_port.into(),
        db: db.into(),
    }
}

/// `idem args` in `dir`, without `IDEM_URL` and stdin, its output piped to the test.
fn command(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
    command
        .args(args)
        .current_dir(dir)
        .env_remove("IDEM_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A SQLite file `file` in `dir` with idem's migrations applied: its URL.
fn migrated_sqlite(dir: &Path, file: &str) -> String {
    let url = format!("sqlite://{}", dir.join(file).display());
    let out = idem(dir, &["--url", &url, "migrate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    url
}

/// Runs `idem` in `dir` without `IDEM_URL`, killing it if it outlives the hang guard.
fn idem(dir: &Path, args: &[&str]) -> Output {
    let mut child = command(dir, args).spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > HANG_GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idem {args:?} still ran after {HANG_GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `idem --url URL migrate` and checks the exit code and the one-line message.
fn exits_with(dir: &Path, url: &str, code: i32, what: &str) {
    let out = idem(dir, &["--url", url, "migrate"]);
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what} ({url}): stdout {} stderr {stderr}",
        text(&out.stdout)
    );
    assert!(
        stderr.starts_with("error: ") && stderr.trim_end().lines().count() == 1,
        "{what}: one line on stderr, got {stderr:?}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        !stderr.contains("idem-wrong-password"),
        "the password is never printed: {stderr}"
    );
    // The engine's code beside the server's words, never a source line of the server.
    assert!(!stderr.contains(" at line "), "{what}: {stderr}");
}

#[test]
fn the_same_failure_exits_with_the_same_code_on_every_engine() {
    let dir = tempfile_dir("codes");
    let pg = parts(&postgres_url());
    let my = parts(&mysql_url());

    // 9: credentials refused. The PostgreSQL here trusts local users, so an unknown role
    // (28000) stands for a refused login; MySQL refuses a wrong password (1045).
    exits_with(
        &dir,
        &format!(
            "{}://idem_no_such_role:idem-wrong-password@{}/{}",
            pg.scheme, pg.host_port, pg.db
        ),
        9,
        "PostgreSQL authentication",
    );
    exits_with(
        &dir,
        &format!(
            "{}://{}:idem-wrong-password@{}/{}",
            my.scheme, my.user, my.host_port, my.db
        ),
        9,
        "MySQL authentication",
    );

    // 10: the database does not exist (or, for SQLite, cannot be opened).
    exits_with(
        &dir,
        &format!(
            "{}://{}@{}/idem_no_such_database",
            pg.scheme, pg.user, pg.host_port
        ),
        10,
        "PostgreSQL missing database",
    );
    exits_with(
        &dir,
        &format!(
            "{}://{}@{}/idem_no_such_database",
            my.scheme, my.user, my.host_port
        ),
        10,
        "MySQL missing database",
    );
    let missing_dir = dir.join("no-such-directory").join("x.db");
    exits_with(
        &dir,
        &format!("sqlite://{}", missing_dir.display()),
        10,
        "SQLite file that cannot be opened",
    );

    // 7: nothing listens on the port.
    let closed = closed_port();
    exits_with(
        &dir,
        &format!("postgres://postgres@127.0.0.1:{closed}/postgres"),
        7,
        "PostgreSQL refused",
    );
    exits_with(
        &dir,
        &format!("mysql://root@127.0.0.1:{closed}/test"),
        7,
        "MySQL refused",
    );
    assert_empty(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// 13 on every engine: a database without idem's tables (the migrations never ran there)
/// answers the operator's commands with the same code and the same advice, and none of
/// them creates a table on the way (the relay once created idem's and the demo's).
#[test]
fn a_database_without_idems_tables_exits_13_on_every_engine() {
    let dir = tempfile_dir("unmigrated");
    let pg = parts(&postgres_url());
    let my = parts(&mysql_url());
    let sqlite = dir.join("unmigrated.db");
    let urls = [
        // A schema that does not exist, alone on the search path.
        format!(
            "{}://{}@{}/{}?options=-c%20search_path%3Didem_no_such_schema",
            pg.scheme, pg.user, pg.host_port, pg.db
        ),
        // MySQL's own system database, which every server has and idem never writes.
        format!("{}://{}@{}/mysql", my.scheme, my.user, my.host_port),
        format!("sqlite://{}", sqlite.display()),
    ];
    // The relay reaches its broker (the shared NATS server), then finds no outbox.
    let nats = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let relay = ["relay", "--nats", nats.as_str(), "--once"];
    // One elected maintenance pass: the lock is taken, every task fails.
    let maintain = ["maintain", "--ticks", "1"];
    for url in &urls {
        for command in [&["outbox", "list"][..], &["purge"], &relay, &maintain] {
            let mut args = vec!["--url", url.as_str()];
            args.extend_from_slice(command);
            let out = idem(&dir, &args);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(13), "{args:?}: {stderr}");
            assert!(
                stderr.starts_with("error: ")
                    && stderr.trim_end().lines().count() == 1
                    && stderr.contains("table or column not found")
                    && stderr.contains("run `idem migrate` with this URL first"),
                "{args:?}: {stderr:?}"
            );
            if command == maintain {
                // Both tasks failed; the tick's line on stdout says so too.
                let stdout = text(&out.stdout);
                assert!(
                    stderr.starts_with(
                        "error: maintain: 2 failure(s) in 1 tick(s); the last: tick 1: purge: "
                    ) && stdout.contains("tick 1 (runner): complete: failed: ")
                        && stdout.contains("maintain: stopped after 1 tick(s), 1 as the runner"),
                    "{stdout}{stderr}"
                );
            }
        }
    }
    // Nothing was created on the way: every migration is still to apply, and then the
    // same command succeeds.
    let out = idem(&dir, &["--url", &urls[2], "migrate"]);
    assert!(
        text(&out.stdout).contains("applied migrations: [1, "),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let out = idem(&dir, &["--url", &urls[2], "outbox", "list"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `--ticks` run's exit code says whether its work failed: 0 on a standby (another
/// process is the runner, nothing was done), the failure's code when the lock cannot even
/// be tried. (Failed tasks: `a_database_without_idems_tables_exits_13_on_every_engine`.)
#[test]
fn a_maintain_ticks_run_exits_with_its_work() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile_dir("maintain-ticks");
    let url = migrated_sqlite(&dir, "m.db");

    // A runner that holds the lock until it is killed.
    let mut runner = command(&dir, &["--url", &url, "maintain", "--interval", "60s"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (lines, seen) = std::sync::mpsc::channel();
    let stdout = runner.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = lines.send(line);
        }
    });
    let start = Instant::now();
    while !seen
        .recv_timeout(HANG_GUARD)
        .is_ok_and(|l| l.contains("this instance is now the runner"))
    {
        assert!(
            start.elapsed() < HANG_GUARD,
            "the runner never took the lock"
        );
    }
    let standby = idem(&dir, &["--url", &url, "maintain", "--ticks", "1"]);
    let _ = runner.kill();
    let _ = runner.wait();
    let (stdout, stderr) = (text(&standby.stdout), text(&standby.stderr));
    assert_eq!(standby.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains("maintain: stopped after 1 tick(s), 0 as the runner") && stderr.is_empty(),
        "{stdout}{stderr}"
    );

    // The lock's sidecar file cannot be opened (a directory has its name): a lock error,
    // a file that cannot be opened (10).
    std::fs::create_dir(dir.join("m.db.blocked.lock")).unwrap();
    let lock = idem(
        &dir,
        &[
            "--url",
            &url,
            "maintain",
            "--ticks",
            "1",
            "--lock-name",
            "blocked",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
    let (stdout, stderr) = (text(&lock.stdout), text(&lock.stderr));
    assert_eq!(lock.status.code(), Some(10), "{stdout}{stderr}");
    assert!(
        stderr.starts_with(
            "error: maintain: 1 failure(s) in 1 tick(s); the last: tick 1: the lock could not be tried: "
        ) && stderr.trim_end().lines().count() == 1
            && stdout.contains("maintain: the lock could not be tried: "),
        "{stdout}{stderr}"
    );
}

/// A private `nats-server` on a port the system picks, with `auth` (its login options);
/// killed on drop.
struct PrivateNats {
    child: std::process::Child,
    port: u16,
    store: std::path::PathBuf,
}

impl PrivateNats {
    fn start(auth: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let program = std::env::var("IDEM_NATS_SERVER").unwrap_or_else(|_| {
            ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
                .into_iter()
                .find(|p| Path::new(p).exists())
                .unwrap_or("nats-server")
                .to_owned()
        });
        let store = tempfile_dir(&format!("nats-{port}"));
        let child = Command::new(program)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&store)
            .args(auth)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nats-server (IDEM_NATS_SERVER) must be installed: ci/services.sh installs it");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < HANG_GUARD,
                "nats-server never listened on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, port, store }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// A broker that refuses the credentials exits 9, as a database that does: RabbitMQ's
/// `ACCESS_REFUSED` (403, the shared server) and NATS's authorization violation (private
/// `nats-server`s, one with a user and password, one with a token). The right
/// credentials in the URL log in (async-nats reads none from the URL; idem passes them
/// on): the relay publishes nothing and exits 0, also from a list of a cluster's URLs whose
/// first server is down. A `tls://` URL to a server without TLS is a connection error,
/// not a panic.
#[test]
fn a_broker_that_refuses_the_credentials_exits_9() {
    let dir = tempfile_dir("broker-auth");
    let db = migrated_sqlite(&dir, "b.db");
    let amqp = parts(
        &std::env::var("IDEM_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
    );
    let password = PrivateNats::start(&["--user", "idem", "--pass", "p@ss"]);
    let token = PrivateNats::start(&["--auth", "s3cr3t"]);
    let refused = [
        (
            "--amqp",
            format!("amqp://{}:wrong-password@{}/%2f", amqp.user, amqp.host_port),
        ),
        (
            "--nats",
            format!("nats://idem:wrong@127.0.0.1:{}", password.port),
        ),
        ("--nats", format!("nats://wrong@127.0.0.1:{}", token.port)),
    ];
    for (flag, url) in &refused {
        let (consume_from, publish_to): (&[&str], &[&str]) = if *flag == "--nats" {
            (&["--stream", "S", "--consumer", "C"], &["--subject", "s"])
        } else {
            (&["--queue", "q"], &["--queue", "q"])
        };
        let mut consume = vec![
            "--url",
            &db,
            "demo",
            "consume",
            flag,
            url,
            "--subscriber",
            "s",
        ];
        consume.extend_from_slice(consume_from);
        let mut publish = vec!["demo", "publish", flag, url];
        publish.extend_from_slice(publish_to);
        let relay = vec!["--url", &db, "relay", flag, url, "--once"];
        for args in [consume, publish, relay] {
            let out = idem(&dir, &args);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(9), "{args:?}: {stderr}");
            assert!(
                stderr.starts_with("error: ")
                    && stderr.contains("cannot connect to")
                    && stderr.trim_end().lines().count() == 1
                    && !stderr.contains("wrong"),
                "{args:?}: {stderr:?}"
            );
        }
    }
    // TLS to a server that speaks none: the handshake fails, a connection error (7). It
    // panicked: two rustls providers are compiled in and async-nats asked for the default.
    let nats = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let tls = format!("tls://{}", nats.split_once("://").unwrap().1);
    let out = idem(&dir, &["--url", &db, "relay", "--nats", &tls, "--once"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(
        stderr.starts_with("error: nats: cannot connect to tls://")
            && stderr.trim_end().lines().count() == 1,
        "{stderr}"
    );
    // The right credentials, percent-encoded where the URL needs it; also in a cluster's
    // list whose first server is down (nothing listens on port 1), the login in the second.
    for url in [
        format!("nats://idem:p%40ss@127.0.0.1:{}", password.port),
        format!("nats://s3cr3t@127.0.0.1:{}", token.port),
        format!(
            "nats://127.0.0.1:1,nats://idem:p%40ss@127.0.0.1:{}",
            password.port
        ),
    ] {
        let out = idem(&dir, &["--url", &db, "relay", "--nats", &url, "--once"]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{url}: {stdout}{stderr}");
        assert!(stdout.contains("published 0"), "{url}: {stdout}");
    }
    // A list of servers none of which is up: a connection error.
    let out = idem(
        &dir,
        &[
            "--url",
            &db,
            "relay",
            "--nats",
            "nats://127.0.0.1:1,nats://127.0.0.1:2",
            "--once",
        ],
    );
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Output whose reader has gone ends the command quietly, as SIGPIPE ends a Unix tool
/// (141, nothing on stderr), instead of `println!`'s panic (101 and a panic message);
/// output that cannot be written otherwise (a full device) is one error line and 1.
#[test]
fn a_closed_or_full_stdout_ends_the_command_without_a_panic() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile_dir("stdout");
    let url = format!("sqlite://{}", dir.join("o.db").display());
    // `idem check` prints a line per case for a few seconds: read the first, then close.
    let mut check = command(&dir, &["--url", &url, "check"]).spawn().unwrap();
    let mut first = String::new();
    BufReader::new(check.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("idem check: sqlite at "), "{first}");
    // The reader is dropped here: the pipe is closed.
    let out = check.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");

    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = command(&dir, &["--url", &url, "migrate"])
        .stdout(full)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        "error: cannot write to stdout: No space left on device (os error 28)\n"
    );
}

#[test]
fn a_wrong_protocol_port_fails_within_the_connect_timeout() {
    let dir = tempfile_dir("protocol");
    let pg = parts(&postgres_url());
    let my = parts(&mysql_url());
    // A MySQL client waits for a greeting that PostgreSQL never sends: the connect
    // timeout ends it (8) instead of PostgreSQL's 60 s authentication timeout.
    exits_with(
        &dir,
        &format!("mysql://root@{}/test", pg.host_port),
        8,
        "mysql:// on PostgreSQL's port",
    );
    // A PostgreSQL client gets MySQL's greeting: not its protocol, a connection failure (7).
    exits_with(
        &dir,
        &format!("postgres://postgres@{}/postgres", my.host_port),
        7,
        "postgres:// on MySQL's port",
    );
    assert_empty(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn operator_commands_require_a_url_and_create_no_file() {
    let dir = tempfile_dir("no-url");
    for args in [
        &["migrate"][..],
        &["check"][..],
        &["purge", "--older-than", "24h"][..],
        &["bench", "--clients", "1"][..],
        &["relay", "--nats", "nats://127.0.0.1:1", "--once"][..],
        &["outbox", "list"][..],
        &["maintain", "--ticks", "1"][..],
        &["demo", "complete"][..],
    ] {
        let out = idem(&dir, args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("--url") && stderr.contains("IDEM_URL"),
            "{stderr}"
        );
        assert!(stderr.trim_end().lines().count() == 1, "{stderr}");
        assert_empty(&dir);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_commands_live_under_demo_and_keep_their_sqlite_default() {
    let dir = tempfile_dir("demo");
    // The demo's commands are no longer top-level commands.
    for command in [
        "account",
        "debit",
        "credit-message",
        "consume",
        "publish",
        "serve",
        "fake-provider",
        "complete",
    ] {
        let out = idem(&dir, &[command, "--help"]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "idem {command} is not a command"
        );
        let out = idem(&dir, &["demo", command, "--help"]);
        assert_eq!(out.status.code(), Some(0), "idem demo {command}");
    }
    assert_empty(&dir);
    // Without a URL the demo works on ./idem.db.
    let out = idem(&dir, &["demo", "account", "--id", "1", "--balance", "1000"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = idem(
        &dir,
        &[
            "demo",
            "debit",
            "--account",
            "1",
            "--key",
            "k-1",
            "--amount",
            "100",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), r#"{"balance":900}"#);
    assert!(dir.join("idem.db").exists());
    // `idem demo` alone runs the walkthrough in a private file, removed afterwards.
    std::fs::remove_file(dir.join("idem.db")).unwrap();
    let out = idem(&dir, &["demo"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("the walkthrough gave the expected figures"),
        "{}",
        text(&out.stdout)
    );
    assert_empty(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_docs_and_purge_work_outside_the_repository_with_plain_output() {
    let dir = tempfile_dir("sqlite");
    let url = format!("sqlite://{}", dir.join("app.db").display());
    let report = dir.join("report.json");

    let out = idem(
        &dir,
        &["--url", &url, "check", "--json", report.to_str().unwrap()],
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    assert!(stdout.lines().filter(|l| l.starts_with("  pass ")).count() >= 10);
    // Progress is drawn only on a terminal: piped output has no control sequences.
    assert!(!out.stdout.contains(&0x1b) && !out.stderr.contains(&0x1b));
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));

    // `idem docs` from a directory that is not the repository: Markdown on stdout, or
    // the file named by --out.
    let elsewhere = tempfile_dir("docs");
    let out = idem(&elsewhere, &["docs", "--report", report.to_str().unwrap()]);
    let markdown = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        markdown.starts_with('#') && markdown.contains("SQLite"),
        "{markdown}"
    );
    assert_empty(&elsewhere);
    let out = idem(
        &elsewhere,
        &[
            "docs",
            "--report",
            report.to_str().unwrap(),
            "--out",
            "engines.md",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(elsewhere.join("engines.md")).unwrap(),
        markdown
    );

    let out = idem(&dir, &["--url", &url, "migrate"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = idem(&dir, &["--url", &url, "purge", "--older-than", "1h"]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        stdout.starts_with("deleted 0 expired request records and 0 expired processed messages"),
        "{stdout}"
    );
    assert!(!out.stdout.contains(&0x1b) && out.stderr.is_empty());
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

#[test]
fn help_lists_the_exit_codes_in_plain_words() {
    let dir = tempfile_dir("help");
    let out = idem(&dir, &["--help"]);
    let help = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    for line in [
        "Exit codes",
        "  7   cannot connect",
        "  8   no answer from the server within 10 s",
        "  9   authentication failed",
        "28P01",
        "1045",
        "18456",
        "ORA-01017",
        "  10  database not found",
        "  13  idem's tables not found",
        "  141 the output's reader went away",
        "42P01",
        "1146",
        "3D000",
        "1049",
        "4060",
        "ORA-12514",
    ] {
        assert!(help.contains(line), "{line:?} missing in:\n{help}");
    }
    // The top-level list holds the operator's commands and `demo`, nothing of the demo's.
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        commands,
        [
            "migrate", "check", "purge", "relay", "outbox", "bench", "maintain", "docs", "demo",
            "help"
        ],
        "{help}"
    );
    assert!(help.contains("IDEM_URL"), "{help}");
    let mut all = help.clone();
    for command in [
        &["demo"][..],
        &["migrate"],
        &["check"],
        &["purge"],
        &["relay"],
        &["outbox"],
        &["outbox", "list"],
        &["outbox", "retry"],
        &["outbox", "drop"],
        &["bench"],
        &["maintain"],
        &["docs"],
        &["demo", "account"],
        &["demo", "debit"],
        &["demo", "credit-message"],
        &["demo", "consume"],
        &["demo", "publish"],
        &["demo", "serve"],
        &["demo", "fake-provider"],
        &["demo", "complete"],
    ] {
        let mut args = command.to_vec();
        args.push("--help");
        let out = idem(&dir, &args);
        assert_eq!(out.status.code(), Some(0), "{command:?}");
        all.push_str(&text(&out.stdout));
    }
    let demo = text(&idem(&dir, &["demo", "--help"]).stdout);
    assert!(demo.contains("not for production"), "{demo}");
    // Option names aside (`demo fake-provider --seed`, `demo serve --namespace`), no
    // internal word and no bare engine code.
    let words = all.replace("--seed", "").replace("--namespace", "");
    for jargon in ["seed", "fixture", "namespace", "SQLSTATE 22023"] {
        assert!(!words.contains(jargon), "{jargon:?} in the help:\n{all}");
    }
    assert_empty(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `idem migrate --distribute-citus` on an engine that cannot be Citus: the migrations
/// run, then a usage error says why nothing was distributed. (A PostgreSQL server without
/// Citus is refused by the library: crates/idem-postgres/tests/distributed.rs.)
#[test]
fn distribute_citus_needs_postgresql() {
    let dir = tempfile_dir("citus");
    let url = format!("sqlite://{}", dir.join("app.db").display());
    let out = idem(&dir, &["--url", &url, "migrate", "--distribute-citus"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(stdout.starts_with("applied migrations: "), "{stdout}");
    assert!(
        stderr.contains("--distribute-citus needs a PostgreSQL URL"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Environment variables for one run.
type Env<'a> = Vec<(&'a str, &'a str)>;

/// Runs `idem` in `dir` with `env`, as [`idem`] does.
fn idem_with_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = command(dir, args);
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > HANG_GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!("idem {args:?} still ran after {HANG_GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn no_command_prints_a_secret_of_its_urls() {
    const SECRET: &str = "Sup3r-S3cret-7f3a";
    let dir = tempfile_dir("secrets");
    let port = closed_port();
    let databases = [
        format!("postgres://app:{SECRET}@127.0.0.1:{port}/db"),
        format!("postgres://app@127.0.0.1:{port}/db?password={SECRET}"),
        format!("postgres://app@127.0.0.1:{port}/db?token={SECRET}"),
        format!("mysql://app:{SECRET}@127.0.0.1:{port}/db"),
        format!("Server=tcp:127.0.0.1,{port};User Id=sa;Password={SECRET}"),
        format!("oracle://app:{SECRET}@127.0.0.1:{port}/FREEPDB1"),
    ];
    let brokers = [
        (
            "--amqp",
            format!("amqp://app:{SECRET}@127.0.0.1:{port}/%2f"),
        ),
        ("--nats", format!("nats://app:{SECRET}@127.0.0.1:{port}")),
        ("--nats", format!("nats://{SECRET}@127.0.0.1:{port}")),
        ("--nats", format!("nats://127.0.0.1:{port}?token={SECRET}")),
    ];
    let provider = format!("http://app:{SECRET}@127.0.0.1:{port}");
    let on_database: [&[&str]; 14] = [
        &["migrate"],
        &["check"],
        &["purge"],
        &["outbox", "list"],
        &["outbox", "retry", "--dead"],
        &["maintain", "--ticks", "1"],
        &[
            "bench",
            "--clients",
            "1",
            "--duration",
            "100ms",
            "--rounds",
            "1",
        ],
        &["demo"],
        &["demo", "account", "--id", "1"],
        &[
            "demo",
            "debit",
            "--account",
            "1",
            "--key",
            "k",
            "--amount",
            "1",
        ],
        &[
            "demo",
            "credit-message",
            "--subscriber",
            "s",
            "--message-id",
            "m",
            "--account",
            "1",
            "--amount",
            "1",
        ],
        &[
            "demo",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--provider",
            &provider,
        ],
        &["demo", "complete", "--provider", &provider],
        &["relay", "--nats", "nats://127.0.0.1:1", "--once"],
    ];
    let mut runs: Vec<Vec<String>> = Vec::new();
    for url in &databases {
        for command in on_database {
            let mut args = vec!["--url".to_owned(), url.clone()];
            args.extend(command.iter().map(|a| (*a).to_owned()));
            runs.push(args);
        }
    }
    // The broker commands, with a secret-bearing database URL too.
    for (flag, broker) in &brokers {
        let db = &databases[0];
        let stream: &[&str] = if *flag == "--nats" {
            &["--stream", "S", "--consumer", "C"]
        } else {
            &["--queue", "q"]
        };
        let subject: &[&str] = if *flag == "--nats" {
            &["--subject", "s"]
        } else {
            &["--queue", "q"]
        };
        let mut consume = vec!["--url", db, "demo", "consume", flag, broker];
        consume.extend_from_slice(stream);
        consume.extend_from_slice(&["--subscriber", "s"]);
        let mut publish = vec!["demo", "publish", flag, broker];
        publish.extend_from_slice(subject);
        let relay = vec!["--url", db, "relay", flag, broker, "--once"];
        // The broker is reached first where the database is a local file.
        let file = format!("sqlite://{}", dir.join("relay.db").display());
        let relay_first = vec!["--url", &file, "relay", flag, broker, "--once"];
        for args in [consume, publish, relay, relay_first] {
            runs.push(args.into_iter().map(str::to_owned).collect());
        }
        // The maintenance loop's relay: a broker it cannot reach fails the tick's relay
        // task, and so the --ticks run, with its error on stderr.
        let maintain = vec!["--url", &file, "maintain", "--ticks", "1", flag, broker];
        runs.push(maintain.into_iter().map(str::to_owned).collect());
    }
    // A secret in a usage error.
    runs.push(vec![
        "migrate".into(),
        "--no-such-option".into(),
        databases[0].clone(),
    ]);
    let mut with_env: Vec<(Vec<String>, Env<'_>)> = runs
        .into_iter()
        .map(|args| (args, vec![("RUST_LOG", "trace")]))
        .collect();
    // Secrets given in IDEM_URL.
    for url in &databases {
        for command in [&["migrate"][..], &["demo", "account", "--id", "1"]] {
            let args = command.iter().map(|a| (*a).to_owned()).collect();
            with_env.push((
                args,
                vec![("RUST_LOG", "trace"), ("IDEM_URL", url.as_str())],
            ));
        }
    }
    for (args, env) in &with_env {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = idem_with_env(&dir, &args, env);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_ne!(
            out.status.code(),
            Some(0),
            "{args:?} succeeded: {stdout}{stderr}"
        );
        assert!(!stderr.is_empty(), "{args:?}: nothing said");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            !stdout.contains(SECRET) && !stderr.contains(SECRET),
            "{args:?} printed the secret:\n{stdout}{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fresh private directory under the system's temporary directory.
fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idem-cli-{name}-{}-{}",
        std::process::id(),
        unique_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn unique_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn assert_empty(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "files left in {}: {left:?}", dir.display());
}

/// A local port nothing listens on: bound, then released.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}
