#!/usr/bin/env bash
# Builds every example of examples/ (package idem-examples) and runs each against its
# engine or broker: those whose engine is in IDEM_ENGINES (sqlite postgres mysql) and,
# for the consumers, only with IDEM_BROKERS=1; the others are SKIPPED by name. An example
# exits non-zero when something is not as expected; the SQLite debit's output must also be
# what README.md shows.
# Run by ci/test.sh (which starts the servers); runnable alone: ci/examples.sh
set -euo pipefail
cd "$(dirname "$0")/.."

export IDEM_POSTGRES_URL=${IDEM_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export IDEM_MYSQL_URL=${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
export IDEM_AMQP_URL=${IDEM_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
export IDEM_NATS_URL=${IDEM_NATS_URL:-nats://127.0.0.1:4222}
IDEM_ENGINES=${IDEM_ENGINES:-"sqlite postgres mysql"}
IDEM_BROKERS=${IDEM_BROKERS:-1}

wants() { [[ " $IDEM_ENGINES " == *" $1 "* ]]; }

# One build with every feature, as ci/test.sh built the workspace (a `-p` selection would
# resolve the dependencies' features anew and rebuild them): each example binary then holds
# only what it uses.
cargo build --locked --workspace --all-features --examples
bin="${CARGO_TARGET_DIR:-$PWD/target}/debug/examples"

# name, engine, broker (- for none)
examples=(
  "debit_sqlite sqlite -"
  "debit_postgres postgres -"
  "debit_mysql mysql -"
  "axum_service sqlite -"
  "consumer_rabbitmq postgres rabbitmq"
  "consumer_nats sqlite nats"
  "phased_outbox sqlite -"
)
ran=0
skipped=()
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for entry in "${examples[@]}"; do
  read -r name engine broker <<<"$entry"
  if ! wants "$engine"; then
    echo "-- $name SKIPPED ($engine is not in IDEM_ENGINES)"
    skipped+=("$name")
    continue
  fi
  if [ "$broker" != - ] && [ "$IDEM_BROKERS" != 1 ]; then
    echo "-- $name SKIPPED ($broker not used: IDEM_BROKERS=0)"
    skipped+=("$name")
    continue
  fi
  label=$engine
  if [ "$broker" != - ]; then label+=", $broker"; fi
  echo "-- $name ($label)"
  start=$SECONDS
  # A bound against a hang, not a timing assertion.
  if ! timeout 120 "$bin/$name" >"$out" 2>&1; then
    cat "$out"
    echo "example $name failed" >&2
    exit 1
  fi
  sed 's/^/   /' "$out"
  echo "   ok ($((SECONDS - start)) s)"
  if [ "$name" = debit_sqlite ]; then
    # README.md shows this output under the program.
    shown=$(awk '/--example debit_sqlite` prints:$/ {found = 1; next}
      found && /^```text$/ {on = 1; next}
      on && /^```$/ {exit}
      on' README.md)
    if [ "$shown" != "$(cat "$out")" ]; then
      echo "README.md shows another output for debit_sqlite:" >&2
      diff <(echo "$shown") "$out" >&2 || true
      exit 1
    fi
    echo "   the output README.md shows"
  fi
  ran=$((ran + 1))
done
echo "examples: $ran run, ${#skipped[@]} skipped${skipped[*]:+ (${skipped[*]})}"
