#!/usr/bin/env bash
# The whole test run: formatting, clippy with warnings denied, every test of every crate,
# the conformance suite on SQLite, PostgreSQL and MariaDB (required: unreachable fails the
# run), SQL Server and Oracle when IDEM_MSSQL_URL / IDEM_ORACLE_URL are set (skipped by
# name otherwise), `idem demo serve` through a real HTTP client on each required engine, the
# broker consumer tests (RabbitMQ and NATS JetStream, required unless IDEM_BROKERS=0) on each
# required engine, the external-effect tests (outbox relays, the card charge under SIGKILLs),
# the maintenance loop (three `idem maintain` processes per engine, the runner SIGKILLed),
# the README's walkthrough on each required engine, and the runnable examples (examples/)
# against their engines and brokers. It starts only the servers these steps need.
# The static checks that need no server (clippy, documentation, feature combinations, MSRV,
# packages: ci/checks.sh) run beside the build and the tests, and end the run with their
# output.
set -euo pipefail
cd "$(dirname "$0")/.."

export IDEM_POSTGRES_URL=${IDEM_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export IDEM_MYSQL_URL=${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
export IDEM_AMQP_URL=${IDEM_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
export IDEM_NATS_URL=${IDEM_NATS_URL:-nats://127.0.0.1:4222}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
# A clean run gains nothing from incremental caches, which take gigabytes of disk.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
# Which engines this run requires (the container matrix narrows it per job).
IDEM_ENGINES=${IDEM_ENGINES:-"sqlite postgres mysql"}
# The broker steps (RabbitMQ and NATS JetStream: consumers, outbox relays, the card charge)
# run unless IDEM_BROKERS=0; the private clusters (Galera, PostgreSQL failover) unless
# IDEM_CLUSTERS=0. What is left out is said by name.
IDEM_BROKERS=${IDEM_BROKERS:-1}
IDEM_CLUSTERS=${IDEM_CLUSTERS:-1}

# Each step's start; the summary at the end says how long each took (the run must stay
# well inside CI's limit).
steps=()
step() {
  checks_failed_early
  steps+=("$SECONDS $*")
  printf '\n==> [%ss] %s\n' "$SECONDS" "$*"
}
summary() {
  local i start next name
  printf '\n==> step durations (s)\n'
  for ((i = 0; i < ${#steps[@]}; i++)); do
    start=${steps[i]%% *}
    name=${steps[i]#* }
    if ((i + 1 < ${#steps[@]})); then next=${steps[i + 1]%% *}; else next=$SECONDS; fi
    printf '%6s  %s\n' "$((next - start))" "$name"
  done
  printf '%6s  total\n' "$SECONDS"
}
# The static checks (ci/checks.sh) run beside the build and the tests, started before the
# build: they need no server and build into target/checks, at the lowest CPU and I/O
# priority, so the tests' own build and servers come first and the checks mostly take what
# CPU and network they leave (the build's serial stretches, the tests' waits, the MSRV
# toolchains' download). Not entirely: even at the lowest priority they slow the build
# beside them (measured on 2 cores: 391-418 s against 324 s alone); the whole run took
# the same time as when they started after the build (1510-1517 s against 1523 s).
# Their output is printed when they end; a failure fails the run at the next step.
checks_dir=${CARGO_TARGET_DIR:-$PWD/target}/checks
checks_pid=
checks_failed_early() {
  if [ -n "$checks_pid" ] && [ -f "$checks_dir.rc" ] && [ "$(cat "$checks_dir.rc")" != 0 ]; then
    finish_checks
  fi
}
finish_checks() {
  local rc
  wait "$checks_pid" 2>/dev/null || true
  checks_pid=
  rc=$(cat "$checks_dir.rc" 2>/dev/null || echo 1)
  printf '\n==> the static checks (ci/checks.sh, run beside the tests), their output:\n'
  cat "$checks_dir.log"
  if [ "$rc" != 0 ]; then
    echo "the static checks (ci/checks.sh) failed with status $rc" >&2
    exit "$rc"
  fi
}
stop_checks() {
  # The run ended before the static checks did (a failure): stop them.
  if [ -n "$checks_pid" ]; then kill -TERM -- "-$checks_pid" 2>/dev/null || true; fi
}
on_exit() {
  stop_checks
  summary
}
trap on_exit EXIT
wants() { [[ " $IDEM_ENGINES " == *" $1 "* ]]; }
brokers() { [ "$IDEM_BROKERS" = 1 ]; }
clusters() { [ "$IDEM_CLUSTERS" = 1 ]; }

# Only the servers the selected steps need: none for IDEM_ENGINES=sqlite IDEM_BROKERS=0
# IDEM_CLUSTERS=0.
source ci/services.sh
step "services (engines: $IDEM_ENGINES; brokers: $(brokers && echo on || echo off); clusters: $(clusters && echo on || echo off))"
needed=0
if wants postgres; then ensure_postgres "$IDEM_POSTGRES_URL" && needed=1; fi
if wants mysql; then ensure_mariadb "$IDEM_MYSQL_URL" && needed=1; fi
if brokers; then
  ensure_rabbitmq "$IDEM_AMQP_URL"
  ensure_nats "$IDEM_NATS_URL"
  needed=1
else
  echo "RabbitMQ and NATS not needed: the broker steps are SKIPPED (IDEM_BROKERS=0)"
fi
# Programs of the private PostgreSQL instances (the broker tests, the failover pair) and of
# the Galera nodes.
if wants postgres && { brokers || clusters; }; then ensure_postgres_binaries; fi
if wants mysql && clusters; then ensure_galera_binaries; fi
[ "$needed" = 1 ] || echo "no server needed by the selected steps"

step "format"
cargo fmt --all --check

step "static checks started beside the build and the tests: clippy, documentation, feature combinations, MSRV, packages (ci/checks.sh, output at the end)"
rm -f "$checks_dir.rc"
mkdir -p "$(dirname "$checks_dir")"
# In a session of their own (setsid), so that a failure can stop them all. Where the kernel
# groups processes per session for scheduling (autogroup), `nice` ranks processes only
# inside their session and each session gets an equal share of the CPU: the checks would
# take half of it from the build. So their session's own priority is lowered too.
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true
  CARGO_TARGET_DIR="$1" nice -n 19 ionice -c 3 ci/checks.sh >"$1.log" 2>&1; echo $? >"$1.rc"' \
  checks "$checks_dir" &
checks_pid=$!

# Every test binary is built once, here, with the whole workspace's features. The test
# steps select their targets by name under `--workspace`: a `-p` selection resolves the
# dependencies' features anew for the packages it names and rebuilds them (minutes per
# selection), and would leave target/debug/idem built with other features.
step "build"
cargo build --workspace --all-targets --all-features --locked

# Test target names are unique across the workspace, so that `--workspace --test NAME`
# selects one target (the crates' tests/*.rs, and the [[test]] targets of tests/ and
# examples/).
crate_tests() {
  local crate file
  for crate; do
    for file in crates/"$crate"/tests/*.rs; do
      printf -- '--test\n%s\n' "$(basename "$file" .rs)"
    done
  done
}
duplicated=$({
  for file in crates/*/tests/*.rs; do basename "$file" .rs; done
  for manifest in tests/Cargo.toml examples/Cargo.toml; do
    awk '/^\[\[test\]\]/{t=1; next} /^\[/{t=0} t && /^name *=/{gsub(/.*= *"|".*/, ""); print}' "$manifest"
  done
} | sort | uniq -d)
if [ -n "$duplicated" ]; then
  echo "test targets of different crates share a name (rename one): $duplicated" >&2
  exit 1
fi

step "unit, snapshot, offline and doc tests; the integration tests of the facade, idem-axum, SQLite, SQL Server and Oracle crates"
mapfile -t offline_tests < <(crate_tests idem idem-axum idem-sqlite idem-mssql idem-oracle)
cargo test --workspace --all-features --locked --lib --bins "${offline_tests[@]}" --test workflows --test excerpts
# Every library's doc tests, the repository README's Rust examples among them.
cargo test --workspace --all-features --locked --doc

for engine in sqlite postgres mysql mssql oracle; do
  case $engine in
    mssql | oracle) ;; # optional: they run when their URL is set and report skips by name otherwise
    *) wants "$engine" || continue ;;
  esac
  step "conformance suite: $engine"
  cargo test --locked --workspace --all-features --test "$engine"
  case $engine in
    mssql | oracle)
      url_var="IDEM_$(echo "$engine" | tr a-z A-Z)_URL"
      if [ -n "${!url_var:-}" ]; then
        step "$engine: live engine tests (the crate's #[ignore]d tests, $url_var set)"
        mapfile -t engine_tests < <(crate_tests "idem-$engine")
        cargo test --locked --workspace --all-features "${engine_tests[@]}" -- --include-ignored
      else
        echo "$engine: the crate's live tests stay ignored ($url_var is not set): not verified live"
      fi
      ;;
    postgres)
      step "conformance suite: postgres with the placeholder claim (IDEM_POSTGRES_CLAIM_STYLE=placeholder, as on Citus)"
      IDEM_POSTGRES_CLAIM_STYLE=placeholder cargo test --locked --workspace --all-features --test postgres
      step "PostgreSQL: the crate's live tests (serialization failures retried with the same key, the key lock, traps)"
      mapfile -t engine_tests < <(crate_tests idem-postgres)
      cargo test --locked --workspace --all-features "${engine_tests[@]}"
      ;;
    mysql)
      step "MariaDB: the crate's live tests (deadlocks retried with the same key, traps)"
      mapfile -t engine_tests < <(crate_tests idem-mysql)
      cargo test --locked --workspace --all-features "${engine_tests[@]}"
      ;;
  esac
done

# The fault suite (tests/faults): sessions killed from a second connection and client
# processes SIGKILLed mid-transaction, retried with the same key, invariant checked after
# every run; and the least-privilege roles of crates/idem-<engine>/migrations/grants.sql. Bigger runs:
# IDEM_FAULT_SCALE=20 (or `-- --scale 20`).
export IDEM_FAULT_SCALE=${IDEM_FAULT_SCALE:-10}
for engine in sqlite postgres mysql; do
  wants "$engine" || continue
  step "fault suite: $engine (scale $IDEM_FAULT_SCALE)"
  cargo test --locked --workspace --all-features --test faults -- "$engine::"
  if [ "$engine" != sqlite ]; then
    step "least privilege: $engine writer and purger roles (grants.sql)"
    cargo test --locked --workspace --all-features --test least_privilege -- "$engine::"
  fi
done
step "least privilege: every engine's grants.sql names existing, non-key columns (offline)"
cargo test --locked --workspace --all-features --test least_privilege -- grants_scripts

# The network-fault suite (tests/net_faults): a proxy between idem and the server loses
# the replies of chosen statements (a COMMIT that ran), cuts connections mid-statement and
# delays replies, on every path that commits; each key retried until it gets a definite
# answer, then checked from the database. Bigger runs: IDEM_NETFAULT_SCALE=N.
export IDEM_NETFAULT_SCALE=${IDEM_NETFAULT_SCALE:-10}
for engine in postgres mysql; do
  wants "$engine" || continue
  step "network faults: lost replies, cuts and delays on $engine (scale $IDEM_NETFAULT_SCALE)"
  cargo test --locked --workspace --all-features --test net_faults -- "$engine::"
done

for engine in sqlite postgres mysql; do
  wants "$engine" || continue
  step "HTTP: idem demo serve through reqwest on $engine (docs/http.md)"
  cargo test --locked --workspace --all-features --test serve -- "${engine}_" --test-threads=2
done

if wants sqlite && wants postgres && wants mysql; then
  step "hostile input, property-based (IDEM_PROPTEST_CASES, default 48 per property and engine)"
  cargo test --locked --workspace --all-features --test hostile
  step "effect errors of every shape: a deadlock inside the effect retried with the same key"
  cargo test --locked --workspace --all-features --test effect_errors
  if brokers; then
    step "the idem command: exit codes per failure on every engine and broker, connect timeout, plain output"
    cargo test --locked --workspace --all-features --test cli
  else
    # Two cases reach a broker: the shared RabbitMQ and NATS, and private nats-servers.
    step "the idem command: exit codes per failure on every engine, connect timeout, plain output; a_broker_that_refuses_the_credentials_exits_9 and a_database_without_idems_tables_exits_13_on_every_engine SKIPPED (IDEM_BROKERS=0)"
    cargo test --locked --workspace --all-features --test cli -- \
      --skip a_broker_that_refuses_the_credentials_exits_9 \
      --skip a_database_without_idems_tables_exits_13_on_every_engine
  fi
fi
# The consumer processes under test are the `idem` binary built above.
for engine in sqlite postgres mysql; do
  wants "$engine" || continue
  if ! brokers; then
    step "idempotent consumers on RabbitMQ and NATS JetStream: $engine SKIPPED (IDEM_BROKERS=0)"
    continue
  fi
  step "idempotent consumers on RabbitMQ and NATS JetStream: $engine"
  cargo test --locked --workspace --all-features --test brokers -- "::$engine::"
done

# Broker faults (tests/broker_faults, docs/reliability.md): dead-letter destinations deleted or
# captured by the consumed stream, queues deleted and declared again under publishers and under
# the consumer, on the shared brokers; private RabbitMQ and NATS instances
# (ports 5682-5689 and 4232-4239, started and stopped by the test) restarted mid-stream and
# paused, with consumers and `idem relay` on every required engine; a listener that never speaks.
if wants sqlite && wants postgres && wants mysql; then
  if brokers; then
    step "broker faults: dead letters, queues deleted in flight and under the consumer, RabbitMQ and NATS restarted, paused and silent (sqlite, postgres, mysql)"
    ensure_broker_binaries
    cargo test --locked --workspace --all-features --test broker_faults
  else
    step "broker faults SKIPPED (IDEM_BROKERS=0)"
  fi
fi

# External effects (docs/external-effects.md): the outbox relay on both brokers, then the
# card charge with `idem demo serve` SIGKILLed between every pair of phases and during the
# provider call, under provider faults (bigger runs: IDEM_EXTERNAL_KEYS, default 12).
if wants sqlite && wants postgres && wants mysql; then
  if brokers; then
    step "transactional outbox: relays on RabbitMQ and NATS JetStream (sqlite, postgres, mysql)"
    cargo test --locked --workspace --all-features --test outbox
  else
    step "transactional outbox: relays on RabbitMQ and NATS JetStream SKIPPED (IDEM_BROKERS=0)"
  fi
  step "external effects: idem demo fake-provider, serve --provider, complete (every engine)"
  cargo test --locked --workspace --all-features --test orders
  if brokers; then
    step "external effects: the card charge under SIGKILLs and provider faults (sqlite, postgres, mysql)"
    cargo test --locked --workspace --all-features --test external
  else
    step "external effects: the card charge (relayed to RabbitMQ) SKIPPED (IDEM_BROKERS=0)"
  fi
fi

# Maintenance once per fleet (docs/operations.md): three `idem maintain` processes per
# engine, one runner at a time, a takeover after the runner is SIGKILLed; then the runner's
# relay task on RabbitMQ.
for engine in sqlite postgres mysql; do
  wants "$engine" || continue
  case $engine in mysql) name=mariadb ;; *) name=$engine ;; esac
  step "maintenance once per fleet: three idem maintain processes, the runner SIGKILLed ($engine)"
  cargo test --locked --workspace --all-features --test maintain -- "${name}_one_runner"
done
if wants sqlite; then
  if brokers; then
    step "maintenance: the relay task of idem maintain on RabbitMQ (sqlite)"
    cargo test --locked --workspace --all-features --test maintain -- sqlite_relay_task
  else
    step "maintenance: the relay task of idem maintain on RabbitMQ SKIPPED (IDEM_BROKERS=0)"
  fi
fi

# Citus (docs/scale-out.md): every PostgreSQL statement idem sends, and every migration
# that may run on distributed tables, checked offline against what Citus refuses; then,
# with IDEM_CITUS_URL naming a coordinator, the conformance cases with idem's tables
# distributed, a same-key storm and the distributed purge.
step "Citus rules, offline: every PostgreSQL statement and later migration (no server)"
cargo test --locked --workspace --all-features --lib citus_rules
step "distributed engines (optional: IDEM_COCKROACH_URL, IDEM_YUGABYTE_URL, IDEM_CITUS_URL, IDEM_TIDB_URL; skipped by name when unset)"
for target in cockroach yugabyte citus tidb; do
  cargo test --locked --workspace --all-features --test "$target"
done

if clusters; then
  # Private clusters on their own ports and temporary directories, stopped by the
  # scripts that start them (IDEM_CLUSTERS=0 skips them, visibly); each with its engine.
  if wants mysql; then
    step "MariaDB Galera, 3 nodes: conformance on one node, cross-node storms, a node SIGKILLed, network faults"
    ci/galera.sh run bash -c 'cargo test --locked --workspace --all-features --test galera &&
      cargo test --locked --workspace --all-features --test galera_cluster &&
      cargo test --locked --workspace --all-features --test net_faults -- galera::'
  else
    step "MariaDB Galera SKIPPED (mysql is not in IDEM_ENGINES)"
  fi
  for mode in sync async; do
    if wants postgres; then
      step "PostgreSQL failover, $mode replication: primary killed, standby promoted, every key retried"
      ci/pg-failover.sh run "$mode" cargo test --locked --workspace --all-features --test pg_failover
    else
      step "PostgreSQL failover, $mode replication SKIPPED (postgres is not in IDEM_ENGINES)"
    fi
  done
else
  step "cluster tests SKIPPED (IDEM_CLUSTERS=0): Galera and PostgreSQL failover not run"
fi

step "the README's walkthrough"
# The binary the build step made, and every step above used: every feature, and the
# dependencies' features as the test targets unify them. (`--bin idem` alone would resolve
# the dependencies without the dev-dependencies' features, tokio's among them, and rebuild
# them all: minutes for nothing.) Nothing is left to build here.
cargo build --locked --workspace --all-targets --all-features
demo_dir=$(mktemp -d)
trap 'rm -rf "$demo_dir"; on_exit' EXIT
idem="$PWD/target/debug/idem"
(cd "$demo_dir" && "$idem" demo)
if wants postgres; then
  "$idem" --url "$IDEM_POSTGRES_URL" demo >/dev/null
  echo "demo on PostgreSQL: ok"
fi
if wants mysql; then
  "$idem" --url "$IDEM_MYSQL_URL" demo >/dev/null
  echo "demo on MySQL/MariaDB: ok"
fi
if [ -n "$(ls -A "$demo_dir")" ]; then
  echo "the demo left files behind: $(ls -A "$demo_dir")" >&2
  exit 1
fi

# The runnable examples (examples/, docs/ and the README link to them): each against its
# engine or broker, those not selected by IDEM_ENGINES / IDEM_BROKERS skipped by name.
step "examples: each run against its engine or broker (ci/examples.sh)"
IDEM_ENGINES="$IDEM_ENGINES" IDEM_BROKERS="$IDEM_BROKERS" ci/examples.sh

step "criterion benchmarks in test mode (each benchmark once, nothing timed)"
cargo test --locked --workspace --all-features --bench "*"

step "idem bench: a short smoke run per engine (every path once per cell; fails on any failed operation), and the growth mode's fill and purge"
bench_dir=$(mktemp -d)
trap 'rm -rf "$demo_dir" "$bench_dir"; on_exit' EXIT
smoke=(bench --clients 1,2 --duration 200ms --rounds 1)
(cd "$bench_dir" && "$idem" --url sqlite://bench.db "${smoke[@]}" --json sqlite.json >/dev/null)
charted=(--with "$bench_dir/sqlite.json")
if wants postgres; then
  "$idem" --url "$IDEM_POSTGRES_URL" "${smoke[@]}" --json "$bench_dir/postgres.json" >/dev/null
  charted+=(--with "$bench_dir/postgres.json")
fi
if wants mysql; then
  "$idem" --url "$IDEM_MYSQL_URL" "${smoke[@]}" --json "$bench_dir/mysql.json" >/dev/null
  charted+=(--with "$bench_dir/mysql.json")
fi
"$idem" bench --chart-only --svg "$bench_dir/chart.svg" "${charted[@]}" >/dev/null
grep -q "<svg" "$bench_dir/chart.svg"
# The growth mode on its smallest fill (100 000 expired records): it fails unless the
# purge removes exactly the records it filled.
growth=(bench --clients 2 --duration 200ms --growth 1)
(cd "$bench_dir" && "$idem" --url sqlite://growth.db "${growth[@]}" | grep "^purge of 100000 expired records")
rm -f "$bench_dir"/growth.db*
if wants postgres; then
  "$idem" --url "$IDEM_POSTGRES_URL" "${growth[@]}" | grep "^purge of 100000 expired records"
fi
if wants mysql; then
  "$idem" --url "$IDEM_MYSQL_URL" "${growth[@]}" | grep "^purge of 100000 expired records"
fi
rm -f "$bench_dir"/*.json "$bench_dir"/chart.svg
if [ -n "$(ls -A "$bench_dir")" ]; then
  echo "idem bench left files behind: $(ls -A "$bench_dir")" >&2
  exit 1
fi
echo "idem bench on every required engine: ok"

step "the static checks (ci/checks.sh): waiting for them to end"
finish_checks

step "all checks passed"
