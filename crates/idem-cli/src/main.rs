//! `idem`: the operator's command for idem's tables (migrations, conformance checks,
//! purges, the outbox relay, benchmarks, the engine comparison) on any compiled-in engine
//! by URL, and `idem demo …`, a demo bank that shows the pattern.
//!
//! Each command lives in its own module and is one variant of [`Command`] plus one arm
//! in [`run`]; the demo's commands are in [`demo`].

// Every line goes through `say!` (module `out`), which ends quietly when stdout's
// reader has gone; `println!` would panic.
#![deny(clippy::print_stdout)]
// Built without any engine feature, only `docs` (and `bench --chart-only`) can run: the
// engine dispatch has no arms, so what it would pass on is unused.
#![cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "mssql",
        feature = "oracle"
    )),
    allow(unused_variables, dead_code, unused_imports, unreachable_code)
)]

/// Runs `$body` with `$K` bound to the test bank type of the URL's engine.
macro_rules! with_bank {
    ($url:expr, $K:ident => $body:expr) => {{
        match idem::Engine::from_url($url)? {
            #[cfg(feature = "sqlite")]
            idem::Engine::Sqlite => {
                type $K = idem_conformance::sqlite::SqliteBank;
                $body
            }
            #[cfg(feature = "postgres")]
            idem::Engine::Postgres => {
                type $K = idem_conformance::postgres::PgBank;
                $body
            }
            #[cfg(feature = "mysql")]
            idem::Engine::Mysql => {
                type $K = idem_conformance::mysql::MysqlBank;
                $body
            }
            #[cfg(feature = "mssql")]
            idem::Engine::Mssql => {
                type $K = idem_conformance::mssql::MssqlBank;
                $body
            }
            #[cfg(feature = "oracle")]
            idem::Engine::Oracle => {
                type $K = idem_conformance::oracle::OracleBank;
                $body
            }
            #[allow(unreachable_patterns)]
            other => Err(crate::Fail::from(other.not_compiled())),
        }
    }};
}

// First: the modules below print through its `say!`.
#[macro_use]
mod out;

#[cfg(feature = "bench")]
mod bench;
mod commands;
#[cfg(any(feature = "amqp", feature = "nats"))]
mod consume;
mod demo;
#[cfg(all(test, feature = "full"))]
mod doc_commands;
mod fail;
mod logging;
mod maintain;
mod outbox;
#[cfg(any(feature = "amqp", feature = "nats"))]
mod relay;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub(crate) use fail::Fail;

/// The URL an operator command needs: given with `--url` or `IDEM_URL`, never a default,
/// so that a forgotten URL does not create an empty `idem.db` in the current directory
/// and report on it.
pub(crate) fn explicit_url<'a>(url: Option<&'a str>, command: &str) -> Result<&'a str, Fail> {
    url.ok_or_else(|| {
        Fail::new(
            fail::INVALID_INPUT,
            format!(
                "`idem {command}` needs the database it works on: pass --url (or set IDEM_URL), \
                 for example --url postgres://user@host/db or --url sqlite://idem.db"
            ),
        )
    })
}

/// What `idem --help` shows before the commands.
const OVERVIEW: &str = "\
Safe retries of database writes: idempotency records on five SQL engines.

The commands below are for operators: they work on your database, named by --url or
IDEM_URL (required). `idem demo` runs a walkthrough of the pattern on a demo bank, and
`idem demo --help` lists the demo's own commands (debits, a consumer, an HTTP server).

Set RUST_LOG (for example RUST_LOG=info, or RUST_LOG=idem_core=debug,warn) for
diagnostics on stderr; the secrets of the URLs given are masked in them.";

#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Safe retries of database writes: idempotency records on five SQL engines",
    long_about = OVERVIEW,
    after_help = fail::EXIT_CODES_HELP,
    after_long_help = fail::exit_codes_and_build()
)]
pub(crate) struct Cli {
    /// Database URL: sqlite::memory:, sqlite://idem.db, sqlite:///abs/path.db,
    /// postgres://…, mysql://…, mariadb://…, mssql://… (or an ADO.NET string), oracle://….
    /// Required by every command except `idem demo …`, which defaults to sqlite://idem.db
    /// in the current directory.
    #[arg(long, global = true, env = "IDEM_URL", hide_env_values = true)]
    url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

/// The operator's commands, then `demo`.
#[derive(Debug, Subcommand)]
enum Command {
    /// Apply idem's migrations to the database.
    Migrate {
        /// Then place idem's tables on the Citus cluster this URL's coordinator runs:
        /// idem_request_result and idem_run distributed by principal, idem_processed_message
        /// by subscriber (co-located), idem_outbox kept on the coordinator as a Citus local
        /// table. Prints one line per table; running it again changes nothing.
        #[arg(long)]
        distribute_citus: bool,
    },
    /// Run the conformance checks against the database and print what held and what was seen.
    /// Each check creates and drops its own schema, database, file or user.
    Check {
        /// Also write the report as JSON (input for `idem docs`).
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Delete expired records in bounded batches. Each record expires by its own
    /// operation's retention, set by the database clock when it was written, so one purge
    /// is safe for every operation.
    Purge {
        /// Also keep records written less than this long ago, expired or not (for example
        /// 24h, 7d, 90m, 30s, 500ms). Without it, every expired record goes.
        #[arg(long, value_parser = commands::parse_duration)]
        older_than: Option<std::time::Duration>,
        /// Rows per DELETE statement.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
    },
    /// Publish the transactional outbox to RabbitMQ or NATS JetStream.
    ///
    /// Messages effects enqueued (such as the demo orders' `order.paid`) go to RabbitMQ
    /// (--amqp) or NATS JetStream (--nats), in order per destination, each marked sent
    /// once the broker confirmed it. --once: until a pass publishes nothing, then print
    /// `published N`; otherwise until SIGINT or SIGTERM.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    #[command(after_long_help = relay::RELAY_HELP)]
    Relay(relay::RelayArgs),
    /// List the outbox's unsent messages (pending and dead), retry or drop them.
    #[command(after_long_help = outbox::OUTBOX_HELP)]
    Outbox(outbox::OutboxArgs),
    #[cfg(feature = "bench")]
    /// Measure the protocol's paths beside the bare effect on this database (SQLite,
    /// PostgreSQL, MySQL/MariaDB), in a private schema, database or file removed afterwards: throughput,
    /// p50/p99 latency, the ratios new ÷ bare, replay ÷ read, new ÷ server-side function,
    /// and round trips per operation.
    Bench {
        /// Concurrent clients per cell, comma-separated; the pool holds the largest count.
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        clients: Vec<usize>,
        /// How long each cell runs, per round (for example 5s, 500ms).
        #[arg(long, default_value = "5s", value_parser = commands::parse_duration)]
        duration: std::time::Duration,
        /// Rounds: every cell runs once per round, in a rotated order.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
        rounds: u32,
        /// Accounts the debits pick from at random.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        accounts: i64,
        /// Also write the report as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw an SVG chart of ops/s per engine and path (this run plus `--with` reports).
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Earlier `--json` reports (other engines) to include in the chart.
        #[arg(long, requires = "svg")]
        with: Vec<PathBuf>,
        /// Measure nothing: only draw the `--svg` chart from the `--with` reports.
        #[arg(long, requires = "svg")]
        chart_only: bool,
        /// The pool's set-up: idem's `connect`; the driver's defaults (a ping per checkout on
        /// PostgreSQL, a session reset per return on MySQL); or lean (neither).
        #[arg(long, value_enum, default_value = "idem")]
        pool: bench::PoolMode,
        /// Skip counting round trips through the loopback proxy.
        #[arg(long)]
        no_round_trips: bool,
        /// Run the idem paths without the replay fast path (`Idem::with_fast_path(false)`).
        #[arg(long)]
        no_fast_path: bool,
        /// PostgreSQL: how claims keep concurrent calls apart (`PgBackend::with_claim_style`):
        /// auto (the key lock on a single server), key-lock or placeholder.
        #[arg(long, value_enum, default_value = "auto")]
        claim: bench::ClaimChoice,
        /// Only these paths, by letter (for example b,a); every path by default. The
        /// ratios need both of their paths.
        #[arg(long, value_delimiter = ',')]
        paths: Vec<char>,
        /// Instead of the paths: fill this many expired records (at least 1 000 000 for
        /// the documented figures), report bytes per record, and purge them while new
        /// requests run at the largest client count.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
        growth: Option<u64>,
    },
    /// Purge, relay and report stalled runs on a schedule, by one elected instance at a
    /// time: run it on every instance; the one holding the database's maintenance lock
    /// does the work, the others take over within one --interval when it dies.
    #[command(after_long_help = maintain::MAINTAIN_HELP)]
    Maintain(maintain::MaintainArgs),
    /// Generate the engine comparison (docs/engines.md) from `idem check --json` reports.
    Docs {
        /// Report files written by `idem check --json`.
        #[arg(long = "report", required = true)]
        reports: Vec<PathBuf>,
        /// Where to write the Markdown (the repository keeps it in docs/engines.md);
        /// without it, the Markdown goes to standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The demo bank (not for production): alone, the walkthrough; `idem demo --help`
    /// lists its commands.
    #[command(long_about = demo::DEMO_HELP)]
    Demo(demo::DemoArgs),
}

async fn run(cli: Cli) -> Result<(), Fail> {
    let url = cli.url.as_deref();
    match cli.command {
        Command::Migrate { distribute_citus } => {
            commands::migrate(explicit_url(url, "migrate")?, distribute_citus).await
        }
        Command::Check { json } => {
            let url = explicit_url(url, "check")?;
            with_bank!(url, K => commands::check::<K>(url, json.as_deref()).await)
        }
        Command::Purge { older_than, batch } => {
            commands::purge(explicit_url(url, "purge")?, older_than, batch).await
        }
        #[cfg(any(feature = "amqp", feature = "nats"))]
        Command::Relay(args) => {
            let url = explicit_url(url, "relay")?;
            with_bank!(url, K => relay::relay::<K>(url, args).await)
        }
        Command::Outbox(args) => {
            let url = explicit_url(url, "outbox")?;
            with_bank!(url, K => outbox::run::<K>(url, args).await)
        }
        #[cfg(feature = "bench")]
        Command::Bench {
            clients,
            duration,
            rounds,
            accounts,
            json,
            svg,
            with,
            pool,
            no_round_trips,
            no_fast_path,
            claim,
            paths,
            growth,
            chart_only,
        } => {
            let opts = bench::Options {
                clients,
                duration,
                rounds,
                accounts,
                json,
                svg,
                with,
                pool,
                round_trips: !no_round_trips,
                fast_path: !no_fast_path,
                claim,
                paths,
                chart_only,
                growth,
            };
            if opts.chart_only {
                return bench::chart_only(&opts);
            }
            let url = explicit_url(url, "bench")?;
            // A server that cannot be reached fails now with its own exit code. SQLite is
            // not probed: opening the URL's file would leave it behind; the bench works in
            // a private file of its own.
            if idem::Engine::from_url(url)? != idem::Engine::Sqlite {
                with_bank!(url, K => commands::probe::<K>(url).await)?;
            }
            match idem::Engine::from_url(url)? {
                #[cfg(feature = "sqlite")]
                idem::Engine::Sqlite => {
                    bench::run::<idem_conformance::sqlite::SqliteBank>(url, opts).await
                }
                #[cfg(feature = "postgres")]
                idem::Engine::Postgres => {
                    bench::run::<idem_conformance::postgres::PgBank>(url, opts).await
                }
                #[cfg(feature = "mysql")]
                idem::Engine::Mysql => {
                    bench::run::<idem_conformance::mysql::MysqlBank>(url, opts).await
                }
                #[allow(unreachable_patterns)]
                other @ (idem::Engine::Mssql | idem::Engine::Oracle) => Err(Fail::new(
                    fail::INVALID_INPUT,
                    format!(
                        "idem bench measures SQLite, PostgreSQL and MySQL/MariaDB, not {}",
                        other.name()
                    ),
                )),
                #[allow(unreachable_patterns)]
                other => Err(Fail::from(other.not_compiled())),
            }
        }
        Command::Maintain(args) => {
            let url = explicit_url(url, "maintain")?;
            with_bank!(url, K => maintain::run::<K>(url, args).await)
        }
        Command::Docs { reports, out } => commands::docs(&reports, out.as_deref()),
        Command::Demo(args) => demo::run(url, args).await,
    }
}

fn main() -> ExitCode {
    let secrets = logging::Secrets::of_command_line();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Usage errors may repeat an argument: scrubbed like every other line.
            let text = secrets.scrub(&e.render().to_string());
            if e.use_stderr() {
                eprint!("{text}");
            } else {
                out::write(format_args!("{text}"));
            }
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(fail::INVALID_INPUT));
        }
    };
    // rustls picks no process-wide crypto provider when more than one is compiled in, as
    // here (async-nats asks for ring, tiberius for aws-lc-rs), and async-nats builds a
    // `tls://` URL's connection with that default: it panicked. One is installed first
    // (tiberius uses an installed one too). Err only means one is installed already.
    #[cfg(feature = "nats")]
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Err(fail) = logging::init(&secrets) {
        eprintln!("error: {}", secrets.scrub(&fail.message));
        return ExitCode::from(fail.code);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(fail) => {
            eprintln!("error: {}", secrets.scrub(&fail.message));
            ExitCode::from(fail.code)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::Parser;
    use clap::error::ErrorKind;

    fn parse(args: &str) -> Result<Cli, ErrorKind> {
        Cli::try_parse_from(args.split_whitespace()).map_err(|e| e.kind())
    }

    /// An option of one broker (or of one selection) is refused beside the other, and a
    /// command that needs a broker says it needs one of the two. clap does not enforce a
    /// `requires` whose target conflicts with an option given, so such an option names
    /// the conflict too (without it, `--exchange` beside `--nats` was silently ignored,
    /// and so was `--destination` beside `--id`).
    #[test]
    #[cfg(all(feature = "amqp", feature = "nats"))]
    fn options_of_one_broker_or_selection_are_refused_with_the_other() {
        use ErrorKind::{ArgumentConflict, MissingRequiredArgument};
        for (args, kind) in [
            ("idem relay", MissingRequiredArgument),
            ("idem relay --amqp a --nats n", ArgumentConflict),
            ("idem relay --exchange e --nats n", ArgumentConflict),
            ("idem maintain --exchange e --nats n", ArgumentConflict),
            ("idem demo consume --subscriber s", MissingRequiredArgument),
            (
                "idem demo consume --subscriber s --amqp a",
                MissingRequiredArgument,
            ),
            (
                "idem demo consume --subscriber s --nats n --stream s",
                MissingRequiredArgument,
            ),
            (
                "idem demo consume --subscriber s --queue q --nats n --stream s --consumer c",
                ArgumentConflict,
            ),
            (
                "idem demo consume --subscriber s --amqp a --queue q --filter-subject f",
                ArgumentConflict,
            ),
            ("idem demo publish", MissingRequiredArgument),
            (
                "idem demo publish --queue q --nats n --subject s",
                ArgumentConflict,
            ),
            (
                "idem demo publish --amqp a --queue q --subject s",
                ArgumentConflict,
            ),
            ("idem outbox retry", MissingRequiredArgument),
            ("idem outbox drop --id 1 --dead", ArgumentConflict),
            ("idem outbox drop --id 1 --destination d", ArgumentConflict),
        ] {
            assert_eq!(parse(args).err(), Some(kind), "{args}");
        }
        for args in [
            "idem relay --nats n",
            "idem relay --amqp a --exchange e",
            "idem maintain",
            "idem maintain --amqp a --exchange e",
            "idem demo consume --subscriber s --amqp a --queue q",
            "idem demo consume --subscriber s --nats n --stream s --consumer c --filter-subject f",
            "idem demo publish --nats n --subject s",
            "idem outbox retry --id 1 --id 2",
            "idem outbox drop --dead --destination d",
        ] {
            assert!(parse(args).is_ok(), "{args}: {:?}", parse(args).err());
        }
    }
}
