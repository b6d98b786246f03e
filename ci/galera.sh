#!/usr/bin/env bash
# A private 3-node MariaDB Galera cluster on loopback, for the cluster tests.
#
#   ci/galera.sh run CMD...   start the cluster, run CMD with its URLs in the environment,
#                             stop the cluster and remove its files (also on failure)
#   ci/galera.sh start DIR    start it with its files under DIR (writes DIR/env)
#   ci/galera.sh stop DIR     stop the nodes started under DIR (SIGTERM, then SIGKILL)
#
# Each node is the installed `mariadbd` with the `galera-4` provider, its own data
# directory under DIR, its own ports (IDEM_GALERA_PORT, default 24306: SQL on +0..+2,
# group communication on +10..+12, IST on +20..+22, rsync SST on +30..+32), bound to
# 127.0.0.1 only. It never touches the shared MariaDB on 3306. Node 1 bootstraps the
# cluster; nodes 2 and 3 join it by rsync SST; start returns once wsrep_cluster_size=3.
# On a fresh Debian machine (as root) galera-4, rsync and MariaDB are apt-installed first.
#
# CMD sees IDEM_GALERA_URLS (three space-separated mysql:// URLs, database `test`) and
# IDEM_GALERA_PIDS (the three server PIDs, same order).
set -euo pipefail

log() { printf 'ci/galera: %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

base_port=${IDEM_GALERA_PORT:-24306}
provider=${IDEM_GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}

port_free() { ! timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

install_missing() {
  local missing=()
  [ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server mariadb-client)
  [ -f "$provider" ] || missing+=(galera-4)
  command -v rsync >/dev/null || missing+=(rsync)
  [ ${#missing[@]} = 0 ] && return
  [ "$(id -u)" = 0 ] || die "${missing[*]} missing and this is not root"
  command -v apt-get >/dev/null || die "${missing[*]} missing and apt-get is missing"
  log "installing ${missing[*]} with apt-get"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
}

sql() { # node statement
  mariadb --no-defaults -uroot -S "$dir/node$1/mysqld.sock" -N -B -e "$2"
}

write_config() { # node
  local n=$1 i=$(($1 - 1)) gcomm=""
  for j in 0 1 2; do gcomm+="${gcomm:+,}127.0.0.1:$((base_port + 10 + j))"; done
  mkdir -p "$dir/node$n/data"
  cat >"$dir/node$n/my.cnf" <<EOF
[mysqld]
user=$run_user
datadir=$dir/node$n/data
socket=$dir/node$n/mysqld.sock
pid-file=$dir/node$n/mysqld.pid
log-error=$dir/node$n/error.log
port=$((base_port + i))
bind-address=127.0.0.1
skip-name-resolve
innodb_buffer_pool_size=64M
innodb_log_file_size=16M
innodb_flush_log_at_trx_commit=2
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
max_connections=300
wsrep_on=ON
wsrep_provider=$provider
wsrep_cluster_name=idem_ci_$$
wsrep_cluster_address=gcomm://$gcomm
wsrep_node_name=node$n
wsrep_node_address=127.0.0.1:$((base_port + 10 + i))
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:$((base_port + 10 + i));ist.recv_addr=127.0.0.1:$((base_port + 20 + i));gcache.size=64M"
wsrep_sst_method=rsync
wsrep_sst_receive_address=127.0.0.1:$((base_port + 30 + i))
EOF
}

start_node() { # node [extra args]
  local n=$1
  shift
  mariadbd --defaults-file="$dir/node$n/my.cnf" "$@" >/dev/null 2>&1 &
  echo $! >"$dir/node$n/server.pid"
}

wait_ready() { # node what
  local n=$1
  for _ in $(seq 1 120); do
    if ! kill -0 "$(cat "$dir/node$n/server.pid")" 2>/dev/null; then
      tail -30 "$dir/node$n/error.log" >&2 || true
      die "node $n exited while $2"
    fi
    if [ "$(sql "$n" "SHOW STATUS LIKE 'wsrep_ready'" 2>/dev/null | cut -f2)" = ON ]; then return 0; fi
    sleep 1
  done
  tail -30 "$dir/node$n/error.log" >&2 || true
  die "node $n not ready after 120 s ($2)"
}

cmd_start() {
  dir=$1
  install_missing
  for off in 0 1 2 10 11 12 20 21 22 30 31 32; do
    port_free $((base_port + off)) || die "port $((base_port + off)) is in use; set IDEM_GALERA_PORT"
  done
  mkdir -p "$dir"
  # As root the servers run as `mysql`: the rsync daemon of an SST would otherwise drop
  # to `nobody` and fail to write the joiner's data directory.
  run_user=$(id -un)
  if [ "$(id -u)" = 0 ]; then run_user=mysql; fi
  for n in 1 2 3; do write_config "$n"; done
  if [ "$(id -u)" = 0 ]; then chown -R mysql: "$dir"; chmod 755 "$dir"; fi
  log "initializing node 1 in $dir"
  mariadb-install-db --defaults-file="$dir/node1/my.cnf" --auth-root-authentication-method=normal \
    --skip-test-db >"$dir/install.log" 2>&1 || { cat "$dir/install.log" >&2; die "mariadb-install-db"; }
  start_node 1 --wsrep-new-cluster
  wait_ready 1 "bootstrapping"
  # The tests connect over TCP as root without a password, like the shared server's URL.
  sql 1 "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; CREATE DATABASE IF NOT EXISTS test"
  for n in 2 3; do
    log "node $n joins (rsync SST)"
    start_node "$n"
    wait_ready "$n" "joining"
  done
  local size=""
  for _ in $(seq 1 60); do
    size=$(sql 1 "SHOW STATUS LIKE 'wsrep_cluster_size'" | cut -f2)
    [ "$size" = 3 ] && break
    sleep 1
  done
  [ "$size" = 3 ] || die "wsrep_cluster_size is ${size:-unknown}, not 3"
  local urls="" pids=""
  for n in 1 2 3; do
    urls+="${urls:+ }mysql://root@127.0.0.1:$((base_port + n - 1))/test"
    pids+="${pids:+ }$(cat "$dir/node$n/server.pid")"
  done
  printf 'export IDEM_GALERA_URLS=%q\nexport IDEM_GALERA_PIDS=%q\n' "$urls" "$pids" >"$dir/env"
  log "3-node cluster up (wsrep_cluster_size=3, $(sql 1 "SELECT VERSION()"), galera $(sql 1 "SHOW STATUS LIKE 'wsrep_provider_version'" | cut -f2)): $urls"
}

cmd_stop() {
  dir=$1
  local pids=()
  for n in 3 2 1; do
    [ -f "$dir/node$n/server.pid" ] || continue
    local pid
    pid=$(cat "$dir/node$n/server.pid")
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    pids+=("$pid")
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { log "node $pid ignored SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
  done
  log "cluster under $dir stopped"
}

case ${1:-} in
  start) [ $# = 2 ] || die "usage: $0 start DIR"; cmd_start "$2" ;;
  stop) [ $# = 2 ] || die "usage: $0 stop DIR"; cmd_stop "$2" ;;
  run)
    shift
    [ $# -ge 1 ] || die "usage: $0 run CMD..."
    run_dir=$(mktemp -d -t idem-galera.XXXXXX)
    trap 'cmd_stop "$run_dir"; rm -rf "$run_dir"' EXIT
    trap 'exit 130' INT TERM
    cmd_start "$run_dir"
    # shellcheck disable=SC1091
    source "$run_dir/env"
    "$@"
    ;;
  *) die "usage: $0 run CMD... | start DIR | stop DIR" ;;
esac
