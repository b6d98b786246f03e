#!/usr/bin/env bash
# Makes the required engines answer: PostgreSQL and MariaDB; and the brokers of the
# consumer tests: RabbitMQ and NATS with JetStream.
# For a URL on this machine it starts the local server, and on a fresh Debian machine (as
# root) installs it with apt-get first. A URL elsewhere (a CI service container) is only
# waited for. An engine that still does not answer fails the run.
set -euo pipefail

log() { printf 'ci/services: %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

# host and port of a URL like scheme://user:pass@host:port/db
host_of() { sed -E 's#^[a-z]+://([^@/]*@)?(\[[^]]*\]|[^:/?]+).*#\2#' <<<"$1"; }
port_of() {
  local p
  p=$(sed -nE 's#^[a-z]+://([^@/]*@)?(\[[^]]*\]|[^:/?]+):([0-9]+).*#\3#p' <<<"$1")
  echo "${p:-$2}"
}
answers() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
is_local() { [[ "$1" == 127.* || "$1" == localhost || "$1" == "[::1]" ]]; }
wait_for() { # name host port
  for _ in $(seq 1 60); do answers "$2" "$3" && return 0; sleep 1; done
  return 1
}

apt_install() {
  [ "$(id -u)" = 0 ] || die "$* is not installed and this is not root; install it or set the URL to a running server"
  command -v apt-get >/dev/null || die "$* is not installed and apt-get is missing"
  log "installing $* with apt-get"
  if [ -z "${IDEM_APT_UPDATED:-}" ]; then apt-get update -qq >&2; IDEM_APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

ensure_postgres() {
  local url=$1 host port
  host=$(host_of "$url"); port=$(port_of "$url" 5432)
  answers "$host" "$port" && { log "PostgreSQL answers at $host:$port"; return; }
  is_local "$host" || { wait_for postgres "$host" "$port" || die "PostgreSQL at $host:$port does not answer"; return; }
  local installed=0
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then apt_install postgresql; installed=1; fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -1)
  if [ "$installed" = 1 ]; then
    # A test server only: trust loopback connections, as the test URL has no password.
    local hba="/etc/postgresql/$version/main/pg_hba.conf"
    sed -i -E 's#^(host\s+all\s+all\s+(127\.0\.0\.1/32|::1/128)\s+)\S+#\1trust#' "$hba"
  fi
  log "starting PostgreSQL $version"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
  wait_for postgres "$host" "$port" || die "PostgreSQL did not start on $host:$port"
  [ "$installed" = 1 ] && pg_ctlcluster --skip-systemctl-redirect "$version" main reload >&2 || true
  log "PostgreSQL answers at $host:$port"
}

ensure_mariadb() {
  local url=$1 host port
  host=$(host_of "$url"); port=$(port_of "$url" 3306)
  if ! answers "$host" "$port"; then
    is_local "$host" || { wait_for mariadb "$host" "$port" || die "MySQL/MariaDB at $host:$port does not answer"; return; }
    local installed=0
    if [ ! -x /usr/sbin/mariadbd ]; then apt_install mariadb-server mariadb-client; installed=1; fi
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
    log "starting MariaDB"
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd >&2
    wait_for mariadb "$host" "$port" || die "MariaDB did not start on $host:$port"
    if [ "$installed" = 1 ]; then
      # A test server only: root may log in over TCP without a password, as in the test URL.
      for _ in $(seq 1 30); do mariadb -uroot -e "SELECT 1" >/dev/null 2>&1 && break; sleep 1; done
      mariadb -uroot -e "ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket; FLUSH PRIVILEGES;" >&2
    fi
  fi
  # The URL's database must exist.
  local db
  db=$(sed -nE 's#^[a-z]+://[^/]*/([^?]+).*#\1#p' <<<"$url")
  if [ -n "$db" ] && is_local "$host" && command -v mariadb >/dev/null; then
    mariadb -h "$host" -P "$port" -uroot -e "CREATE DATABASE IF NOT EXISTS \`$db\`" >&2 || true
  fi
  log "MySQL/MariaDB answers at $host:$port"
}

ensure_rabbitmq() {
  local url=$1 host port
  host=$(host_of "$url"); port=$(port_of "$url" 5672)
  answers "$host" "$port" && { log "RabbitMQ answers at $host:$port"; return; }
  is_local "$host" || { wait_for rabbitmq "$host" "$port" || die "RabbitMQ at $host:$port does not answer"; return; }
  if [ ! -x /usr/sbin/rabbitmq-server ]; then apt_install rabbitmq-server; fi
  log "starting RabbitMQ"
  rabbitmq-server -detached >&2 || true
  # The first start of a fresh node takes a while.
  for _ in $(seq 1 120); do answers "$host" "$port" && break; sleep 1; done
  answers "$host" "$port" || die "RabbitMQ did not start on $host:$port"
  log "RabbitMQ answers at $host:$port"
}

ensure_nats() {
  local url=$1 host port
  host=$(host_of "$url"); port=$(port_of "$url" 4222)
  answers "$host" "$port" && { log "NATS answers at $host:$port"; return; }
  is_local "$host" || { wait_for nats "$host" "$port" || die "NATS at $host:$port does not answer"; return; }
  if [ ! -x /usr/sbin/nats-server ]; then apt_install nats-server; fi
  log "starting NATS with JetStream"
  mkdir -p /var/lib/nats-server
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p "$port" -js -sd /var/lib/nats-server -l /var/log/nats-server.log >&2
  wait_for nats "$host" "$port" || die "NATS did not start on $host:$port"
  log "NATS answers at $host:$port"
}

# PostgreSQL's server programs (initdb, pg_ctl), for the test that starts and stops a private
# instance on its own port (the shared server is never stopped).
ensure_postgres_binaries() {
  ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 && return
  apt_install postgresql
}
