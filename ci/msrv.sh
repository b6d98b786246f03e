#!/usr/bin/env bash
# The minimum supported Rust versions hold, with the locked dependencies: the workspace's
# (Cargo.toml, 1.88) for every crate and feature but PostgreSQL, and idem-postgres' own
# (1.94, what sqlx 0.9 requires) for it and the crates that enable it. Fails when an API
# newer than that, or a dependency needing a newer compiler, slips in. Installs the
# toolchains with rustup (minimal profile) when missing.
# Run by ci/checks.sh; runnable alone: ci/msrv.sh (`ci/msrv.sh install` only installs the
# toolchains: ci/checks.sh does that first, while the tests' build keeps the CPU busy).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  install | "") ;;
  *)
    echo "usage: ci/msrv.sh [install]" >&2
    exit 2
    ;;
esac
msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)
pg_msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' crates/idem-postgres/Cargo.toml)
for toolchain in "$msrv" "$pg_msrv"; do
  rustup toolchain list | grep -q "^$toolchain-" ||
    rustup toolchain install "$toolchain" --profile minimal
done
[ "${1:-}" = install ] && exit 0
# Apart from the main build: another compiler's artifacts would only evict it.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/msrv"

printf -- '-- rustc %s: every crate, every feature but postgres\n' "$msrv"
cargo +"$msrv" check --locked --no-default-features \
  -p idem-core -p idem-sqlite -p idem-mysql -p idem-mssql -p idem-oracle -p idem-axum \
  -p idem-consumer -p idem-db -p idem-conformance -p idem-cli \
  --features "idem-core/metrics idem-consumer/amqp idem-consumer/nats
    idem-db/sqlite idem-db/mysql idem-db/mssql idem-db/oracle idem-db/axum idem-db/metrics
    idem-db/amqp idem-db/nats
    idem-conformance/sqlite idem-conformance/mysql idem-conformance/mssql idem-conformance/oracle
    idem-cli/sqlite idem-cli/mysql idem-cli/mssql idem-cli/oracle idem-cli/amqp idem-cli/nats
    idem-cli/http idem-cli/bench"

# The other crates' postgres features only route to idem-postgres (their code is checked by
# the step above); what needs the newer compiler is sqlx, through idem-postgres.
printf -- '-- rustc %s: idem-postgres, and the facade with its postgres feature\n' "$pg_msrv"
cargo +"$pg_msrv" check --locked -p idem-postgres -p idem-db --no-default-features --features idem-db/postgres
