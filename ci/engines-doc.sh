#!/usr/bin/env bash
# Regenerates docs/engines.md from live `idem check` runs on the engines this machine has,
# plus documentation-derived columns (marked not verified live) for the others. The
# MariaDB Galera column comes from a private 3-node cluster that ci/galera.sh starts.
# Set IDEM_MSSQL_URL / IDEM_ORACLE_URL to replace those columns with live results.
set -euo pipefail
cd "$(dirname "$0")/.."
export IDEM_POSTGRES_URL=${IDEM_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export IDEM_MYSQL_URL=${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
source ci/services.sh
ensure_postgres "$IDEM_POSTGRES_URL"
ensure_mariadb "$IDEM_MYSQL_URL"
cargo build -q -p idem-cli --all-features
idem="${CARGO_TARGET_DIR:-target}/debug/idem"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$idem" --url "sqlite://$out/check.db" check --json "$out/sqlite.json"
"$idem" --url "$IDEM_POSTGRES_URL" check --json "$out/postgres.json"
"$idem" --url "$IDEM_MYSQL_URL" check --json "$out/mysql.json"
# The Galera column: a private 3-node cluster (ci/galera.sh), checked through its first node.
ci/galera.sh run bash -c '"$1" --url "${IDEM_GALERA_URLS%% *}" check --json "$2"' _ "$idem" "$out/galera.json"
reports=(--report "$out/sqlite.json" --report "$out/postgres.json" --report "$out/mysql.json" --report "$out/galera.json")
if [ -n "${IDEM_MSSQL_URL:-}" ]; then "$idem" --url "$IDEM_MSSQL_URL" check --json "$out/mssql.json"; reports+=(--report "$out/mssql.json"); fi
if [ -n "${IDEM_ORACLE_URL:-}" ]; then "$idem" --url "$IDEM_ORACLE_URL" check --json "$out/oracle.json"; reports+=(--report "$out/oracle.json"); fi
"$idem" docs "${reports[@]}" --out docs/engines.md
