#!/usr/bin/env bash
# The feature combinations a user is likely to pick compile without warnings (clippy,
# warnings denied): the facade with each engine and integration alone, and the CLI lean
# (its default), with no engine, per engine, and with its integrations beside SQLite.
# Run by ci/test.sh; runnable alone: ci/features.sh
set -euo pipefail
cd "$(dirname "$0")/.."

lint() {
  printf -- '-- cargo clippy %s\n' "$*"
  cargo clippy --locked "$@" -- -D warnings
}

# The facade (`idem-db`): nothing, its default (sqlite), each engine and integration alone.
# (Everything at once is the workspace's `clippy --all-features` step of ci/test.sh.)
lint -p idem-db --no-default-features
lint -p idem-db
for feature in postgres mysql mssql oracle axum metrics amqp nats; do
  lint -p idem-db --no-default-features --features "$feature"
done

# The CLI: its default (sqlite: the README's first command), no engine at all, each
# engine alone (which also builds the conformance suite with that engine alone), and the
# HTTP demo and the brokers beside SQLite.
lint -p idem-cli
lint -p idem-cli --no-default-features
for features in postgres mysql mssql oracle sqlite,http sqlite,amqp,nats; do
  lint -p idem-cli --no-default-features --features "$features"
done
