#!/usr/bin/env bash
# A private PostgreSQL primary and streaming standby, for the failover test.
#
#   ci/pg-failover.sh run sync|async CMD...   start the pair, run CMD, stop it and remove it
#   ci/pg-failover.sh failover DIR            kill the primary (pg_ctl stop -m immediate)
#                                             and promote the standby
#
# Both servers come from the PostgreSQL 15 binaries (IDEM_PG_BIN, default
# /usr/lib/postgresql/15/bin), live in a fresh temporary directory, listen on 127.0.0.1
# only, on IDEM_PGFO_PORT (default 25432) and the port after it. They never touch the
# shared server on 5432. The standby is made with `pg_basebackup -R` and streams from the
# primary; with `sync` the primary has synchronous_standby_names = 'standby1' and
# synchronous_commit = on (a commit returns once the standby has flushed it), with
# `async` it does not wait for the standby. As root, the servers run as `postgres`.
# On a fresh Debian machine (as root) PostgreSQL is apt-installed first.
#
# CMD sees IDEM_PGFO_PRIMARY_URL, IDEM_PGFO_STANDBY_URL, IDEM_PGFO_MODE and
# IDEM_PGFO_FAILOVER (the command that fails over).
set -euo pipefail

log() { printf 'ci/pg-failover: %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

# The PostgreSQL 15 binaries, else the newest installed major version.
bin=${IDEM_PG_BIN:-/usr/lib/postgresql/15/bin}
if [ -z "${IDEM_PG_BIN:-}" ] && [ ! -x "$bin/initdb" ]; then
  newest=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
  [ -n "$newest" ] && bin=$newest
fi
port=${IDEM_PGFO_PORT:-25432}
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"

as_owner() { # run a server binary as the data directory's owner
  if [ "$(id -u)" = 0 ]; then setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"; else "$@"; fi
}

port_free() { ! timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

ensure_binaries() {
  [ -x "$bin/initdb" ] && [ -x "$bin/pg_basebackup" ] && return
  [ "$(id -u)" = 0 ] || die "$bin/initdb is missing and this is not root"
  log "installing postgresql with apt-get"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
}

psql_at() { # port sql
  "$bin/psql" -X -q -t -A -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2"
}

start() { # dir mode
  local dir=$1 mode=$2
  ensure_binaries
  port_free "$port" && port_free $((port + 1)) || die "port $port or $((port + 1)) is in use; set IDEM_PGFO_PORT"
  if [ "$(id -u)" = 0 ]; then chown postgres: "$dir"; fi
  as_owner "$bin/initdb" -D "$dir/primary" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
    || { cat "$dir/initdb.log" >&2; die "initdb"; }
  {
    echo "listen_addresses = '127.0.0.1'"
    echo "port = $port"
    echo "unix_socket_directories = '$dir'"
    echo "wal_level = replica"
    echo "max_wal_senders = 4"
    echo "synchronous_commit = on"
    echo "fsync = on"
    echo "shared_buffers = 32MB"
    echo "max_connections = 100"
    if [ "$mode" = sync ]; then echo "synchronous_standby_names = 'standby1'"; fi
  } >>"$dir/primary/postgresql.conf"
  as_owner "$bin/pg_ctl" -D "$dir/primary" -l "$dir/primary.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/primary.log" >&2; die "the primary did not start"; }
  as_owner "$bin/pg_basebackup" -h 127.0.0.1 -p "$port" -U postgres -D "$dir/standby" -R -X stream \
    >"$dir/basebackup.log" 2>&1 || { cat "$dir/basebackup.log" >&2; die "pg_basebackup"; }
  {
    echo "port = $((port + 1))"
    echo "primary_conninfo = 'host=127.0.0.1 port=$port user=postgres application_name=standby1'"
    # The copy of the primary's configuration names the standby as its own synchronous
    # standby: once promoted, with no standby of its own, every commit would wait forever.
    echo "synchronous_standby_names = ''"
  } >>"$dir/standby/postgresql.auto.conf"
  as_owner "$bin/pg_ctl" -D "$dir/standby" -l "$dir/standby.log" -w -t 60 start >/dev/null \
    || { tail -20 "$dir/standby.log" >&2; die "the standby did not start"; }
  local want=async state=""
  [ "$mode" = sync ] && want=sync
  for _ in $(seq 1 60); do
    state=$(psql_at "$port" "SELECT state || '/' || sync_state FROM pg_stat_replication WHERE application_name = 'standby1'" 2>/dev/null || true)
    [ "$state" = "streaming/$want" ] && break
    sleep 1
  done
  [ "$state" = "streaming/$want" ] || die "the standby is '${state:-not connected}', expected streaming/$want"
  log "primary on $port, standby on $((port + 1)): streaming, $want ($("$bin/postgres" --version))"
}

stop() { # dir
  local dir=$1
  for node in standby primary; do
    if [ -f "$dir/$node/postmaster.pid" ]; then
      as_owner "$bin/pg_ctl" -D "$dir/$node" -m immediate -w -t 60 stop >/dev/null 2>&1 || true
    fi
  done
  log "servers under $dir stopped"
}

failover() { # dir
  local dir=$1
  as_owner "$bin/pg_ctl" -D "$dir/primary" -m immediate -w -t 60 stop >/dev/null
  as_owner "$bin/pg_ctl" -D "$dir/standby" -w -t 60 promote >/dev/null
  log "primary stopped (-m immediate), standby promoted"
}

case ${1:-} in
  run)
    [ $# -ge 3 ] || die "usage: $0 run sync|async CMD..."
    mode=$2
    shift 2
    case $mode in sync | async) ;; *) die "mode must be sync or async, not $mode" ;; esac
    run_dir=$(mktemp -d -t idem-pgfo.XXXXXX)
    trap 'stop "$run_dir"; rm -rf "$run_dir"' EXIT
    trap 'exit 130' INT TERM
    start "$run_dir" "$mode"
    export IDEM_PGFO_MODE=$mode
    export IDEM_PGFO_PRIMARY_URL="postgres://postgres@127.0.0.1:$port/postgres"
    export IDEM_PGFO_STANDBY_URL="postgres://postgres@127.0.0.1:$((port + 1))/postgres"
    export IDEM_PGFO_FAILOVER="$self failover $run_dir"
    "$@"
    ;;
  failover) [ $# = 2 ] || die "usage: $0 failover DIR"; failover "$2" ;;
  *) die "usage: $0 run sync|async CMD... | failover DIR" ;;
esac
