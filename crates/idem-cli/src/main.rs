//! `idem`: the walkthrough, migrations, purges, conformance checks and benchmarks,
//! on an embedded SQLite by default and on any compiled-in engine by URL.

mod bench;
mod commands;
#[cfg(any(feature = "amqp", feature = "nats"))]
mod consume;
mod demo;
mod fail;
mod orders;
mod provider;
#[cfg(any(feature = "amqp", feature = "nats"))]
mod relay;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub(crate) use fail::Fail;

/// The default database: a SQLite file in the current directory.
const DEFAULT_URL: &str = "sqlite://idem.db";

/// The URL a command that works on existing data (`check`, `purge`, `bench`) needs: given
/// with `--url` or `IDEM_URL`, never the default, so that a forgotten URL does not
/// create an empty `idem.db` in the current directory and report on it.
fn explicit_url<'a>(url: Option<&'a str>, command: &str) -> Result<&'a str, Fail> {
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

#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Safe retries of database writes: idempotency records on five SQL engines",
    after_help = fail::EXIT_CODES_HELP
)]
struct Cli {
    /// Database URL: sqlite::memory:, sqlite://idem.db, sqlite:///abs/path.db,
    /// postgres://…, mysql://…, mariadb://…, mssql://…, oracle://… [default: sqlite://idem.db,
    /// except for check, purge, bench, complete and relay, which require it]
    #[arg(long, global = true, env = "IDEM_URL")]
    url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the walkthrough (debit twice, reused key, duplicate insert, failed debit,
    /// message consumer) in a private schema, database or file that is removed afterwards.
    Demo,
    /// Apply idem's migrations to the database.
    Migrate,
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
    /// Create an account or set its balance (the demo's `idem_demo_account` table), or show it.
    Account {
        /// The account's ID.
        #[arg(long)]
        id: i64,
        /// The balance to set; without it, the balance is shown.
        #[arg(long)]
        balance: Option<i64>,
    },
    /// One idempotent debit: prints the JSON response; says on stderr whether it executed or
    /// replayed. Exit codes: 3 key reused with a different request, 4 insufficient balance,
    /// 5 no such account, 2 invalid input (all codes: `idem --help`).
    Debit {
        /// The account to debit.
        #[arg(long)]
        account: i64,
        /// The client's idempotency key.
        #[arg(long)]
        key: String,
        /// A positive whole amount.
        #[arg(long, allow_negative_numbers = true)]
        amount: i64,
        /// The authenticated principal (default: `account-` followed by the account ID).
        #[arg(long)]
        principal: Option<String>,
    },
    /// The consumer variant: credit an account once per (subscriber, message ID).
    CreditMessage {
        /// The consumer's name.
        #[arg(long)]
        subscriber: String,
        /// The message's ID.
        #[arg(long)]
        message_id: String,
        /// The account to credit.
        #[arg(long)]
        account: i64,
        /// A positive whole amount.
        #[arg(long, allow_negative_numbers = true)]
        amount: i64,
    },
    /// Credit the demo account once per message from RabbitMQ (--amqp, --queue) or NATS
    /// JetStream (--nats, --stream, --consumer), acknowledging only after the commit.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    #[command(after_long_help = consume::MESSAGE_FORMAT)]
    Consume(consume::ConsumeArgs),
    /// Publish demo messages (chosen IDs, duplicates on purpose) to RabbitMQ or JetStream.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    #[command(after_long_help = consume::MESSAGE_FORMAT)]
    Publish(consume::PublishArgs),
    /// Publish the transactional outbox to RabbitMQ or NATS JetStream.
    ///
    /// Messages effects enqueued (such as the orders' `order.paid`) go to RabbitMQ
    /// (--amqp) or NATS JetStream (--nats), in order per destination, each marked sent
    /// once the broker confirmed it. --once: until a pass publishes nothing, then print
    /// `published N`; otherwise until SIGINT or SIGTERM.
    #[cfg(any(feature = "amqp", feature = "nats"))]
    #[command(after_long_help = relay::RELAY_HELP)]
    Relay(relay::RelayArgs),
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
        /// Instead of the paths: fill this many expired records (at least 1 000 000 for
        /// the documented figures), report bytes per record, and purge them while new
        /// requests run at the largest client count.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
        growth: Option<u64>,
    },
    /// Serve the demo bank over HTTP with Idempotency-Key (see docs/http.md): PUT/GET
    /// /accounts/{id}, POST /accounts/{id}/debits (bearer principal), POST
    /// /subscribers/{name}/messages/{message_id}, GET /openapi.json, and with --provider
    /// POST /orders (bearer principal; see docs/external-effects.md). Stops on SIGINT or
    /// SIGTERM after in-flight requests finish.
    Serve {
        /// The address to listen on (port 0 picks a free one; the address is printed).
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// Work in a private schema, database or file of this name, created now and removed
        /// at shutdown: for tests and throwaway demos. A lowercase letter, then lowercase
        /// letters, digits or `_`.
        #[arg(long, value_name = "NAME")]
        namespace: Option<String>,
        /// How long a request waits for a concurrent request with the same key before
        /// answering 409 with Retry-After.
        #[arg(long, default_value = "5s", value_parser = commands::parse_duration)]
        wait_timeout: std::time::Duration,
        /// Test aid: hold each debit's transaction open this long after its SQL ran
        /// (to show 409 for a concurrent retry, or a client disconnecting mid-request).
        #[arg(long, value_parser = commands::parse_duration)]
        debit_delay: Option<std::time::Duration>,
        /// The payment provider POST /orders charges (an http:// URL, such as the address
        /// `idem fake-provider` prints). Without it, POST /orders answers 404.
        #[arg(long, value_name = "URL")]
        provider: Option<String>,
        /// How long a charge request to the provider may take before POST /orders
        /// answers 502 (the retry with the same key resumes the order at once).
        #[arg(long, value_name = "MS", default_value_t = 2000,
            value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        provider_timeout_ms: u64,
        /// The lease of an order's run: while it lasts, a retry with the same key waits
        /// (then 409); once it has ended (the server died mid-order), the retry or
        /// `idem complete` takes the order over at its last recovery point.
        #[arg(long, value_name = "MS", default_value_t = 30_000,
            value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
        lease_ms: u64,
    },
    /// A stand-in card provider for `idem serve --provider`, with its own Idempotency-Key
    /// and faults on demand.
    ///
    /// POST /charges with `Idempotency-Key` and {"amount": N}: a new key is charged (201);
    /// the same key and amount return the first charge (200, nothing charged); another
    /// amount 422; no key or a bad body 400. GET /charges lists every charge, GET /stats
    /// counts them. State in memory; stops on SIGINT or SIGTERM.
    FakeProvider {
        /// The address to listen on (port 0 picks a free one; the address is printed).
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: std::net::SocketAddr,
        /// Probability (0 to 1) that a new charge answers 500 before anything is charged.
        #[arg(long, value_name = "P", default_value_t = 0.0, allow_negative_numbers = true,
            value_parser = provider::parse_probability)]
        fail_before_charge: f64,
        /// Probability (0 to 1) that a new charge is made, then answered with 500 or not at
        /// all (the connection held about 30 s), half each.
        #[arg(long, value_name = "P", default_value_t = 0.0, allow_negative_numbers = true,
            value_parser = provider::parse_probability)]
        fail_after_charge: f64,
        /// Milliseconds to wait after recording a new charge before answering it.
        #[arg(long, value_name = "MS", default_value_t = 0)]
        delay: u64,
        /// Seed of the fault draws, for a repeatable run.
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Finish orders an `idem serve` left halfway (it died mid-order), once their lease
    /// has ended.
    ///
    /// One pass over the phased runs whose owner stopped before their final answer: each
    /// is taken over and driven with its operation's step. order:v1 with --provider: driven
    /// to the end (the charge is repeated with its stable provider key, so never made
    /// twice); without --provider: runs that never reached the provider end failed, the
    /// others are left. Other operations are left. Prints one line per operation
    /// ("order:v1: succeeded 1, failed 0, busy 0, left 0", then the errors) or --json;
    /// exits 0 when the pass ran, even if some runs were left.
    Complete {
        /// The payment provider of order:v1 (an http:// URL).
        #[arg(long, value_name = "URL")]
        provider: Option<String>,
        /// How long a charge request to the provider may take.
        #[arg(long, value_name = "MS", default_value_t = 2000,
            value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        provider_timeout_ms: u64,
        /// The lease this completer holds on each run it takes over (as `serve
        /// --lease-ms`): longer than the provider timeout plus a phase.
        #[arg(long, value_name = "MS", default_value_t = 30_000,
            value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
        lease_ms: u64,
        /// At most this many stalled runs, the longest-stalled first.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
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
}

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
            other => Err(Fail::from(other.not_compiled())),
        }
    }};
}

async fn run(cli: Cli) -> Result<(), Fail> {
    let url = cli.url.as_deref().unwrap_or(DEFAULT_URL);
    match cli.command {
        Command::Demo => with_bank!(url, K => demo::run::<K>(url).await),
        Command::Migrate => commands::migrate(url).await,
        Command::Check { json } => {
            let url = explicit_url(cli.url.as_deref(), "check")?;
            with_bank!(url, K => commands::check::<K>(url, json.as_deref()).await)
        }
        Command::Purge { older_than, batch } => {
            let url = explicit_url(cli.url.as_deref(), "purge")?;
            commands::purge(url, older_than, batch).await
        }
        Command::Account { id, balance } => {
            with_bank!(url, K => commands::account::<K>(url, id, balance).await)
        }
        Command::Debit {
            account,
            key,
            amount,
            principal,
        } => {
            with_bank!(url, K => commands::debit::<K>(url, account, &key, amount, principal).await)
        }
        Command::CreditMessage {
            subscriber,
            message_id,
            account,
            amount,
        } => {
            with_bank!(url, K => commands::credit_message::<K>(url, &subscriber, &message_id, account, amount).await)
        }
        #[cfg(any(feature = "amqp", feature = "nats"))]
        Command::Consume(args) => {
            with_bank!(url, K => consume::consume::<K>(url, args).await)
        }
        #[cfg(any(feature = "amqp", feature = "nats"))]
        Command::Publish(args) => consume::publish(args).await,
        #[cfg(any(feature = "amqp", feature = "nats"))]
        Command::Relay(args) => {
            let url = explicit_url(cli.url.as_deref(), "relay")?;
            with_bank!(url, K => relay::relay::<K>(url, args).await)
        }
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
                chart_only,
                growth,
            };
            if opts.chart_only {
                return bench::chart_only(&opts);
            }
            let url = explicit_url(cli.url.as_deref(), "bench")?;
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
        Command::Serve {
            listen,
            namespace,
            wait_timeout,
            debit_delay,
            provider,
            provider_timeout_ms,
            lease_ms,
        } => {
            let options = serve::Options {
                listen,
                namespace,
                wait: wait_timeout,
                debit_delay,
                provider,
                provider_timeout: std::time::Duration::from_millis(provider_timeout_ms),
                lease: std::time::Duration::from_millis(lease_ms),
            };
            with_bank!(url, K => serve::run::<K>(url, options).await)
        }
        Command::FakeProvider {
            listen,
            fail_before_charge,
            fail_after_charge,
            delay,
            seed,
        } => {
            provider::run(provider::Options {
                listen,
                fail_before: fail_before_charge,
                fail_after: fail_after_charge,
                delay: std::time::Duration::from_millis(delay),
                seed,
            })
            .await
        }
        Command::Complete {
            provider,
            provider_timeout_ms,
            lease_ms,
            limit,
            json,
        } => {
            let url = explicit_url(cli.url.as_deref(), "complete")?;
            let timeout = std::time::Duration::from_millis(provider_timeout_ms);
            let lease = std::time::Duration::from_millis(lease_ms);
            with_bank!(url, K => orders::complete::<K>(url, provider.as_deref(), timeout, lease, limit, json).await)
        }
        Command::Docs { reports, out } => commands::docs(&reports, out.as_deref()),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
            eprintln!("error: {}", fail.message);
            ExitCode::from(fail.code)
        }
    }
}
