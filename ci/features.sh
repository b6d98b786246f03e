#!/usr/bin/env bash
# Every feature combination a user is likely to pick compiles without warnings (clippy,
# warnings denied): the facade with each engine and integration alone, the conformance
# suite per engine, and the CLI lean (its default), per engine, per integration and full.
# Run by ci/test.sh; runnable alone: ci/features.sh
set -euo pipefail
cd "$(dirname "$0")/.."

lint() {
  printf -- '-- cargo clippy %s\n' "$*"
  cargo clippy --locked "$@" -- -D warnings
}

# The facade (`idem-db`): nothing, its default (sqlite), each engine and integration alone.
lint -p idem-db --no-default-features
lint -p idem-db
for feature in postgres mysql mssql oracle axum metrics amqp nats; do
  lint -p idem-db --no-default-features --features "$feature"
done

# The broker clients are opt-in: neither, either, or both.
lint -p idem-consumer --no-default-features
for feature in amqp nats; do
  lint -p idem-consumer --no-default-features --features "$feature"
done

# The conformance suite: no engine, then each engine alone.
lint -p idem-conformance --no-default-features
for feature in sqlite postgres mysql mssql oracle; do
  lint -p idem-conformance --no-default-features --features "$feature"
done

# The CLI: its default (sqlite: the README's first command), no engine at all, each engine
# alone, each integration beside SQLite, and everything.
lint -p idem-cli
lint -p idem-cli --no-default-features
for features in postgres mysql mssql oracle sqlite,amqp sqlite,nats sqlite,http sqlite,bench postgres,mysql,http,amqp,nats full; do
  lint -p idem-cli --no-default-features --features "$features"
done
