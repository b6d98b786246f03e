#!/usr/bin/env bash
# Makes the servers the tests need answer, in the state the tests expect: PostgreSQL and
# MariaDB (the required engines), RabbitMQ and NATS with JetStream (the brokers of the
# consumer tests), and the server programs of the private instances that some tests start
# themselves (PostgreSQL's initdb and pg_ctl; MariaDB with galera-4 and rsync; rabbitmq-server
# and nats-server for the broker faults).
#
#   ci/services.sh [SERVICE...]  SERVICE: postgres mysql rabbitmq nats pg-binaries
#                                galera-binaries broker-binaries (no argument: all of them),
#                                at the URLs of IDEM_POSTGRES_URL, IDEM_MYSQL_URL,
#                                IDEM_AMQP_URL, IDEM_NATS_URL (the same defaults as ci/test.sh)
#   ci/services.sh packages      the Debian packages it may install (to download them first)
#   source ci/services.sh        defines ensure_postgres URL, ensure_mariadb URL,
#                                ensure_rabbitmq URL, ensure_nats URL, ensure_postgres_binaries,
#                                ensure_galera_binaries, ensure_broker_binaries (what ci/test.sh
#                                calls)
#
# For a URL on this machine (127.x, localhost, ::1) it checks the actual state, not what an
# earlier run did, and repairs what is missing, so a run after a failed or interrupted one
# finishes the job:
# - the Debian package is fully installed (apt-get, as root; an interrupted dpkg is finished);
# - the server runs, started as its own user (postgres, mysql, rabbitmq, nats), never as
#   root; if it does not come up, the server's own log is shown;
# - PostgreSQL: the URL's user logs in over TCP without a password (loopback set to trust)
#   and the URL's database exists;
# - MariaDB: the URL's user logs in over TCP without a password and the database exists;
# - RabbitMQ: an AMQP handshake as the URL's user opens the URL's virtual host;
# - NATS: JetStream answers an account-info request (its store in /var/lib/nats-server).
# These are test servers: passwordless logins are what the test URLs use. A server on another
# host (a CI service container) is only waited for. A step that fails fails the run, with what
# went wrong; a check that cannot be made here (no client program, not root) is said by name.
# A running server is never stopped or restarted.
set -euo pipefail

IDEM_SERVICES_SH=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

log() { printf 'ci/services: %s\n' "$*" >&2; }
die() {
  log "FAILED: $*"
  exit 1
}

# --- URLs: scheme://user:pass@host:port/path -------------------------------------------------
url_decode() { printf '%b' "${1//%/\\x}"; }
host_of() { sed -E 's#^[a-z]+://([^@/]*@)?(\[[^]]*\]|[^:/?]+).*#\2#' <<<"$1"; }
port_of() {
  local p
  p=$(sed -nE 's#^[a-z]+://([^@/]*@)?(\[[^]]*\]|[^:/?]+):([0-9]+).*#\3#p' <<<"$1")
  echo "${p:-$2}"
}
user_of() { # url default
  local u
  u=$(sed -nE 's#^[a-z]+://([^:@/]*)(:[^@/]*)?@.*#\1#p' <<<"$1")
  url_decode "${u:-$2}"
}
pass_of() { url_decode "$(sed -nE 's#^[a-z]+://[^:@/]*:([^@/]*)@.*#\1#p' <<<"$1")"; }
# The path without its slash and query ("" when there is none).
path_of() { sed -nE 's#^[a-z]+://[^/]*/([^?]*).*#\1#p' <<<"$1"; }
is_local() { [[ "$1" == 127.* || "$1" == localhost || "$1" == "[::1]" || "$1" == ::1 ]]; }

# --- waiting ---------------------------------------------------------------------------------
answers() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
wait_for() { # host port seconds [pid]: until the port answers; stops early when pid exits
  local i
  for ((i = 0; i < $3; i++)); do
    answers "$1" "$2" && return 0
    if [ -n "${4:-}" ] && ! kill -0 "$4" 2>/dev/null; then return 1; fi
    sleep 1
  done
  answers "$1" "$2"
}
show_log() { # file...: the end of each server log that exists
  local f
  for f in "$@"; do
    [ -s "$f" ] || continue
    printf 'ci/services: ---- last lines of %s ----\n' "$f" >&2
    tail -n 40 "$f" >&2
    printf 'ci/services: ---- end of %s ----\n' "$f" >&2
  done
}

# --- packages and processes ------------------------------------------------------------------
need_root() { # what: fails unless root, which installing and starting servers needs
  [ "$(id -u)" = 0 ] || die "$1; this is not root, so it is neither installed nor started here: start it, or set its URL to a running server"
}

# The packages the functions below may install (ci/fresh-debian.sh downloads them first).
services_packages() {
  echo postgresql postgresql-client mariadb-server mariadb-client rabbitmq-server nats-server galera-4 rsync
}

apt_install() {
  command -v apt-get >/dev/null || die "$* must be installed, and apt-get is missing"
  local apt_log
  apt_log=$(mktemp -t idem-services-apt.XXXXXX)
  export DEBIAN_FRONTEND=noninteractive
  # A run killed during an earlier install leaves dpkg half done: finish it first.
  if [ -n "$(dpkg --audit 2>/dev/null)" ]; then
    log "dpkg was interrupted earlier: dpkg --configure -a"
    dpkg --configure -a >"$apt_log" 2>&1 || { show_log "$apt_log"; die "dpkg --configure -a"; }
  fi
  # Update the package lists only when they lack a package (a fresh machine) or when the
  # install fails on them (stale lists), so a machine whose packages were downloaded
  # beforehand installs without a network.
  local p updated=0
  for p in "$@"; do
    if ! apt-cache show "$p" >/dev/null 2>&1; then
      log "apt-get update (package lists lack $p)"
      apt-get update >"$apt_log" 2>&1 || { show_log "$apt_log"; die "apt-get update"; }
      updated=1
      break
    fi
  done
  log "installing $* with apt-get"
  local start=$SECONDS
  # A PostgreSQL cluster made by the package takes its encoding from the locale: without
  # one (a fresh container) it would be SQL_ASCII.
  if [ "$(locale charmap 2>/dev/null)" != UTF-8 ]; then local -x LANG=C.UTF-8 LC_ALL=C.UTF-8; fi
  if ! apt-get install -y --no-install-recommends "$@" >"$apt_log" 2>&1; then
    [ "$updated" = 0 ] || { show_log "$apt_log"; die "apt-get install $*"; }
    log "apt-get install failed; apt-get update, then once more"
    apt-get update >"$apt_log" 2>&1 || { show_log "$apt_log"; die "apt-get update"; }
    apt-get install -y --no-install-recommends "$@" >"$apt_log" 2>&1 || { show_log "$apt_log"; die "apt-get install $*"; }
  fi
  log "installed $* ($((SECONDS - start)) s)"
  rm -f "$apt_log"
}

# Installs those of the packages that are not fully installed (dpkg status "ii").
ensure_packages() {
  local p missing=()
  for p in "$@"; do
    [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null)" = "ii " ] || missing+=("$p")
  done
  [ ${#missing[@]} = 0 ] && return 0
  need_root "${missing[*]} not installed"
  apt_install "${missing[@]}"
}

# Starts a server as its own user in a session of its own, its output (of this start only)
# in a log. Sets started_pid.
start_as() { # user log command...
  local user=$1 out=$2 home
  shift 2
  home=$(getent passwd "$user" | cut -d: -f6) || die "there is no user $user to run $1 as"
  : >"$out"
  chown "$user:" "$out"
  (cd / && exec setsid setpriv --reuid="$user" --regid="$user" --init-groups -- \
    env HOME="$home" USER="$user" LOGNAME="$user" "$@") >>"$out" 2>&1 </dev/null &
  started_pid=$!
}

# --- PostgreSQL ------------------------------------------------------------------------------
pg_cluster_on() { # port: "version name logfile" of the cluster set to that port
  command -v pg_lsclusters >/dev/null || return 0
  pg_lsclusters -h 2>/dev/null | awk -v p="$1" '$3 == p { print $1, $2, $7; exit }'
}
pg_local() { # port sql: as the postgres user over the local socket (peer login)
  runuser -u postgres -- psql -X -w -q -At -p "$1" -d postgres -c "$2"
}

ensure_postgres() {
  local url=$1 host port user pass db
  host=$(host_of "$url")
  port=$(port_of "$url" 5432)
  user=$(user_of "$url" postgres)
  pass=$(pass_of "$url")
  db=$(path_of "$url")
  db=$(url_decode "${db:-$user}")
  if ! is_local "$host"; then
    wait_for "$host" "$port" 60 || die "PostgreSQL at $host:$port does not answer"
    log "PostgreSQL answers at $host:$port (another host: only waited for)"
    return
  fi
  local cluster version name logfile
  if ! answers "$host" "$port"; then
    need_root "PostgreSQL does not answer at $host:$port"
    ensure_packages postgresql postgresql-client
    cluster=$(pg_cluster_on "$port")
    if [ -z "$cluster" ]; then
      [ -z "$(pg_lsclusters -h 2>/dev/null)" ] ||
        die "no PostgreSQL cluster is set to port $port; the clusters here: $(pg_lsclusters -h | awk '{print $1 "/" $2 " on " $3}' | paste -sd, -)"
      version=$(ls /usr/lib/postgresql | sort -V | tail -1)
      log "creating the PostgreSQL cluster $version/main on port $port"
      if [ "$(locale charmap 2>/dev/null)" != UTF-8 ]; then local -x LANG=C.UTF-8 LC_ALL=C.UTF-8; fi
      pg_createcluster --port "$port" "$version" main >&2 || die "pg_createcluster $version main"
      cluster=$(pg_cluster_on "$port")
    fi
    read -r version name logfile <<<"$cluster"
    if pg_ctlcluster --skip-systemctl-redirect "$version" "$name" status >/dev/null 2>&1; then
      log "PostgreSQL $version/$name runs but does not answer at $host:$port yet"
    else
      log "starting PostgreSQL $version/$name (as postgres)"
      pg_ctlcluster --skip-systemctl-redirect "$version" "$name" start >&2 ||
        { show_log "$logfile"; die "PostgreSQL $version/$name did not start"; }
    fi
    wait_for "$host" "$port" 30 || { show_log "$logfile"; die "PostgreSQL $version/$name does not answer at $host:$port"; }
  fi
  if ! command -v psql >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
      log "PostgreSQL answers at $host:$port; the login and database are NOT checked (no psql here)"
      return
    fi
    ensure_packages postgresql-client
  fi
  pg_tcp() { # database sql: as the URL's user over TCP, no password prompt
    PGCONNECT_TIMEOUT=5 PGPASSWORD="$pass" psql -X -w -q -At -h "$host" -p "$port" -U "$user" -d "$1" -c "$2"
  }
  local err
  if ! err=$(pg_tcp postgres "SELECT 1" 2>&1 >/dev/null); then
    log "$user cannot log in at $host:$port: $err"
    cluster=$(pg_cluster_on "$port")
    [ "$(id -u)" = 0 ] && [ -n "$cluster" ] || die "PostgreSQL at $host:$port refuses $user (and this script cannot change its settings here)"
    read -r version name logfile <<<"$cluster"
    local hba quoted
    hba=$(pg_local "$port" "SHOW hba_file") || die "cannot read the settings of PostgreSQL $version/$name as postgres"
    log "setting loopback logins to trust in $hba (a test server: the test URL has no password)"
    sed -i -E 's#^(host\s+all\s+all\s+(127\.0\.0\.1/32|::1/128)\s+)\S+#\1trust#' "$hba"
    grep -qE '^host\s+all\s+all\s+127\.0\.0\.1/32\s+trust' "$hba" ||
      sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    quoted=${user//\'/\'\'}
    if [ -z "$(pg_local "$port" "SELECT 1 FROM pg_roles WHERE rolname = '$quoted'")" ]; then
      log "creating the role $user (superuser, as the tests create schemas and roles)"
      pg_local "$port" "CREATE ROLE \"${user//\"/\"\"}\" LOGIN SUPERUSER" >&2
    fi
    pg_local "$port" "SELECT pg_reload_conf()" >/dev/null
    err=$(pg_tcp postgres "SELECT 1" 2>&1 >/dev/null) || { show_log "$logfile"; die "$user still cannot log in at $host:$port: $err"; }
  fi
  if [ -z "$(pg_tcp postgres "SELECT 1 FROM pg_database WHERE datname = '${db//\'/\'\'}'")" ]; then
    log "creating the database $db"
    pg_tcp postgres "CREATE DATABASE \"${db//\"/\"\"}\"" || die "CREATE DATABASE $db"
  fi
  log "PostgreSQL $(pg_tcp "$db" "SHOW server_version") answers at $host:$port ($user logs in without a password; database $db, encoding $(pg_tcp "$db" "SHOW server_encoding"))"
}

# PostgreSQL's server programs (initdb, pg_ctl, pg_basebackup), for the tests that start a
# private instance on a port of their own (the shared server is never stopped).
ensure_postgres_binaries() {
  local bin
  for bin in /usr/lib/postgresql/*/bin; do
    [ -x "$bin/initdb" ] && [ -x "$bin/pg_ctl" ] && [ -x "$bin/pg_basebackup" ] &&
      { log "PostgreSQL server programs: $bin"; return; }
  done
  ensure_packages postgresql
  log "PostgreSQL server programs: $(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
}

# --- MariaDB ---------------------------------------------------------------------------------
mysql_client() { command -v mariadb || command -v mysql || true; }
mariadbd_option() { # name: the value mariadbd reads from its option files
  /usr/sbin/mariadbd --print-defaults 2>/dev/null | tr ' ' '\n' | sed -nE "s#^--$1=##p" | tail -1
}

ensure_mariadb() {
  local url=$1 host port user pass db
  host=$(host_of "$url")
  port=$(port_of "$url" 3306)
  user=$(user_of "$url" root)
  pass=$(pass_of "$url")
  db=$(url_decode "$(path_of "$url")")
  if ! is_local "$host"; then
    wait_for "$host" "$port" 60 || die "MySQL/MariaDB at $host:$port does not answer"
    log "MySQL/MariaDB answers at $host:$port (another host: only waited for)"
    return
  fi
  local socket="" errlog="" out=/var/log/mysql/mariadbd-start.log
  if ! answers "$host" "$port"; then
    need_root "MariaDB does not answer at $host:$port"
    ensure_packages mariadb-server mariadb-client
    local datadir pidfile
    datadir=$(mariadbd_option datadir)
    socket=$(mariadbd_option socket)
    pidfile=$(mariadbd_option pid-file)
    errlog=$(mariadbd_option log-error)
    [ -n "$datadir" ] || datadir=/var/lib/mysql
    install -d -o mysql -g mysql "$(dirname "${socket:-/run/mysqld/mysqld.sock}")" "$(dirname "${pidfile:-/run/mysqld/x}")"
    install -d -o mysql -g adm /var/log/mysql
    if [ ! -d "$datadir/mysql" ]; then
      log "initializing MariaDB's data directory $datadir (as mysql)"
      mariadb-install-db --user=mysql --datadir="$datadir" --skip-test-db >"$out" 2>&1 ||
        { show_log "$out"; die "mariadb-install-db"; }
    fi
    # Debian's server refuses to run as root (its `user = mysql` is commented out), so it
    # runs as mysql from the start; its messages go to its log-error file, else to $out.
    log "starting MariaDB (as mysql)"
    start_as mysql "$out" /usr/sbin/mariadbd
    wait_for "$host" "$port" 60 "$started_pid" ||
      { show_log "$out" "$errlog"; die "MariaDB did not start at $host:$port (its log is above)"; }
  fi
  local client
  client=$(mysql_client)
  if [ -z "$client" ]; then
    if [ "$(id -u)" != 0 ]; then
      log "MySQL/MariaDB answers at $host:$port; the login and database are NOT checked (no mariadb or mysql client here)"
      return
    fi
    ensure_packages mariadb-client
    client=$(mysql_client)
  fi
  my_tcp() { # sql: as the URL's user over TCP, no option files (they could hold a password)
    "$client" --no-defaults --protocol=tcp -h "$host" -P "$port" -u "$user" ${pass:+"--password=$pass"} \
      --connect-timeout=5 -N -B -e "$1"
  }
  local err
  if ! err=$(my_tcp "SELECT 1" 2>&1 >/dev/null); then
    log "$user cannot log in at $host:$port without a password: $err"
    [ -n "$socket" ] || socket=$(mariadbd_option socket)
    [ "$(id -u)" = 0 ] && [ -S "${socket:-/run/mysqld/mysqld.sock}" ] ||
      die "MySQL/MariaDB at $host:$port refuses $user (and this script cannot change its accounts here)"
    # As root over the local socket (unix_socket login), let the URL's user in over TCP from
    # loopback, whether or not the server resolves 127.0.0.1 to localhost.
    local u=${user//\'/\'\'} p=${pass//\'/\'\'} h sql=""
    for h in localhost 127.0.0.1 ::1; do
      if [ "$user" = root ] && [ "$h" = localhost ]; then
        sql+="ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('$p') OR unix_socket;"
      else
        sql+="CREATE USER IF NOT EXISTS '$u'@'$h'; ALTER USER '$u'@'$h' IDENTIFIED BY '$p';"
        sql+="GRANT ALL PRIVILEGES ON *.* TO '$u'@'$h' WITH GRANT OPTION;"
      fi
    done
    log "letting $user log in over TCP from loopback (a test server: the test URL has no password)"
    "$client" --no-defaults --protocol=socket -S "${socket:-/run/mysqld/mysqld.sock}" -uroot -e "$sql FLUSH PRIVILEGES;" ||
      die "changing the accounts of $user as root over ${socket:-/run/mysqld/mysqld.sock}"
    err=$(my_tcp "SELECT 1" 2>&1 >/dev/null) || die "$user still cannot log in at $host:$port: $err"
  fi
  if [ -n "$db" ] && [ -z "$(my_tcp "SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = '${db//\'/\'\'}'")" ]; then
    log "creating the database $db"
    my_tcp "CREATE DATABASE \`${db//\`/\`\`}\`" || die "CREATE DATABASE $db"
  fi
  log "MySQL/MariaDB $(my_tcp "SELECT VERSION()") answers at $host:$port ($user logs in without a password${db:+; database $db})"
}

# MariaDB with the Galera provider and rsync (its state transfers), for ci/galera.sh.
ensure_galera_binaries() {
  local provider=${IDEM_GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}
  if [ -x /usr/sbin/mariadbd ] && [ -f "$provider" ] && command -v rsync >/dev/null; then
    log "Galera: $provider, rsync and mariadbd are installed"
    return
  fi
  ensure_packages mariadb-server mariadb-client galera-4 rsync
  log "Galera: $provider, rsync and mariadbd are installed"
}

# The broker programs themselves, for the broker-fault suite's private instances (each test
# starts and stops its own, on ports of its own), also when the shared brokers run elsewhere.
ensure_broker_binaries() {
  if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && [ -x /usr/sbin/nats-server ]; then
    log "broker programs: rabbitmq-server and nats-server are installed"
    return
  fi
  ensure_packages rabbitmq-server nats-server
  log "broker programs: rabbitmq-server and nats-server are installed"
}

# --- RabbitMQ --------------------------------------------------------------------------------
hex_of() { printf '%s' "$1" | od -An -v -tx1 | tr -d ' \n'; }
shortstr_hex() { # an AMQP short string: its length in one byte, then its bytes
  local h
  h=$(hex_of "$1")
  printf '%02x%s' $((${#h} / 2)) "$h"
}
send_frame() { # payload-hex: one AMQP method frame on channel 0, to fd 3
  local hex
  hex=$(printf '010000%08x%sce' $((${#1} / 2)) "$1")
  printf "$(sed 's/../\\x&/g' <<<"$hex")" >&3
}
read_hex() { dd bs=1 count="$1" status=none <&3 2>/dev/null | od -An -v -tx1 | tr -d ' \n'; }
read_method() { # the next frame: its class and method (8 hex digits) in frame_method
  local head size
  head=$(read_hex 7)
  [ ${#head} = 14 ] || return 1
  size=$((16#${head:6:8}))
  frame_payload=$(read_hex "$size")
  [ "$(read_hex 1)" = ce ] || return 1
  frame_method=${frame_payload:0:8}
}
# An AMQP 0-9-1 handshake as a client makes it (PLAIN login, then opening the virtual host).
amqp_open() { # host port user pass vhost
  exec 3<>"/dev/tcp/$1/$2"
  printf 'AMQP\x00\x00\x09\x01' >&3
  read_method && [ "$frame_method" = 000a000a ] || { echo "no AMQP 0-9-1 Connection.Start from $1:$2"; return 1; }
  local response
  response="00$(hex_of "$3")00$(hex_of "$4")"
  send_frame "000a000b00000000$(shortstr_hex PLAIN)$(printf '%08x' $((${#response} / 2)))${response}$(shortstr_hex en_US)"
  read_method || { echo "the broker closed the connection: it refused the login of $3"; return 1; }
  [ "$frame_method" = 000a001e ] || { echo "the broker refused the login of $3"; return 1; }
  send_frame "000a001f${frame_payload:8:16}"
  send_frame "000a0028$(shortstr_hex "$5")0000"
  read_method || { echo "the broker closed the connection when $3 opened the virtual host $5"; return 1; }
  [ "$frame_method" = 000a0029 ] || { echo "$3 may not open the virtual host $5"; return 1; }
  send_frame "000a003200c8$(shortstr_hex "")00000000"
  read_method || true
}

ensure_rabbitmq() {
  local url=$1 host port user pass vhost
  host=$(host_of "$url")
  port=$(port_of "$url" 5672)
  user=$(user_of "$url" guest)
  pass=$(pass_of "$url")
  [ -n "$pass" ] || pass=guest
  if [[ "$url" =~ ^[a-z]+://[^/]*/ ]]; then vhost=$(url_decode "$(path_of "$url")"); else vhost=/; fi
  if ! is_local "$host"; then
    wait_for "$host" "$port" 120 || die "RabbitMQ at $host:$port does not answer"
    log "RabbitMQ answers at $host:$port (another host: only waited for)"
    return
  fi
  local logs=(/var/log/rabbitmq/idem-start.log /var/log/rabbitmq/startup_log /var/log/rabbitmq/startup_err)
  if ! answers "$host" "$port"; then
    need_root "RabbitMQ does not answer at $host:$port"
    ensure_packages rabbitmq-server
    local node
    node=$(hostname -s)
    logs+=("/var/log/rabbitmq/rabbit@$node.log")
    getent hosts "$node" >/dev/null ||
      die "RabbitMQ names its node rabbit@$node, and $node does not resolve: add it to /etc/hosts (e.g. 127.0.1.1 $node)"
    install -d -o rabbitmq -g rabbitmq /var/log/rabbitmq
    log "starting RabbitMQ (as rabbitmq; a new node takes a while)"
    start_as rabbitmq /var/log/rabbitmq/idem-start.log /usr/sbin/rabbitmq-server
    wait_for "$host" "$port" 180 "$started_pid" ||
      { show_log "${logs[@]}"; die "RabbitMQ did not start at $host:$port (its logs are above)"; }
  fi
  local err
  if ! err=$(timeout 15 bash "$IDEM_SERVICES_SH" _amqp-open "$host" "$port" "$user" "$pass" "$vhost" 2>&1); then
    log "AMQP login of $user to $vhost at $host:$port: ${err:-no answer}"
    [ "$(id -u)" = 0 ] && command -v rabbitmqctl >/dev/null ||
      die "RabbitMQ at $host:$port refuses $user on $vhost (and this script cannot change its users here)"
    if ! rabbitmqctl -s list_vhosts name | grep -qxF -- "$vhost"; then
      log "adding the virtual host $vhost"
      rabbitmqctl -s add_vhost "$vhost" >&2 || die "rabbitmqctl add_vhost $vhost"
    fi
    if ! rabbitmqctl -s list_users | cut -f1 | grep -qxF -- "$user"; then
      log "adding the user $user (a test broker: the password of the test URL)"
      rabbitmqctl -s add_user "$user" "$pass" >&2 || die "rabbitmqctl add_user $user"
      rabbitmqctl -s set_user_tags "$user" administrator >&2 || die "rabbitmqctl set_user_tags $user"
    elif ! rabbitmqctl -s authenticate_user "$user" "$pass" >/dev/null 2>&1; then
      die "RabbitMQ's user $user has another password than the URL's; change the URL or the password"
    fi
    log "granting $user everything on $vhost"
    rabbitmqctl -s set_permissions -p "$vhost" "$user" '.*' '.*' '.*' >&2 || die "rabbitmqctl set_permissions"
    err=$(timeout 15 bash "$IDEM_SERVICES_SH" _amqp-open "$host" "$port" "$user" "$pass" "$vhost" 2>&1) ||
      die "the AMQP login of $user to $vhost at $host:$port still fails: ${err:-no answer}"
  fi
  log "RabbitMQ answers at $host:$port ($user opens the virtual host $vhost over AMQP)"
}

# --- NATS ------------------------------------------------------------------------------------
# A JetStream account-info request over the NATS protocol; prints the reply.
nats_jetstream_info() { # host port user pass
  exec 3<>"/dev/tcp/$1/$2"
  local line auth=""
  IFS= read -r -t 5 line <&3 && [[ "$line" == INFO* ]] || { echo "no INFO from $1:$2"; return 1; }
  [ -z "$3" ] || auth=",\"user\":\"$3\",\"pass\":\"$4\""
  printf 'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true%s}\r\n' "$auth" >&3
  printf 'SUB _INBOX.idem-services 1\r\nPUB $JS.API.INFO _INBOX.idem-services 0\r\n\r\nPING\r\n' >&3
  while IFS= read -r -t 5 line <&3; do
    line=${line%$'\r'}
    case $line in
      MSG\ *)
        IFS= read -r -t 5 line <&3
        line=${line%$'\r'}
        echo "$line"
        [[ "$line" == *account_info_response* && "$line" != *'"error"'* ]]
        return
        ;;
      HMSG\ *) echo "no JetStream: nothing answers its API (the server runs without -js)"; return 1 ;;
      -ERR*) echo "$line"; return 1 ;;
      PING) printf 'PONG\r\n' >&3 ;;
    esac
  done
  echo "no answer from JetStream's API"
  return 1
}

ensure_nats() {
  local url=$1 host port user pass
  host=$(host_of "$url")
  port=$(port_of "$url" 4222)
  user=$(user_of "$url" "")
  pass=$(pass_of "$url")
  if ! is_local "$host"; then
    wait_for "$host" "$port" 60 || die "NATS at $host:$port does not answer"
    log "NATS answers at $host:$port (another host: only waited for)"
    return
  fi
  local out=/var/log/nats-server/nats-server.log store=/var/lib/nats-server
  if ! answers "$host" "$port"; then
    need_root "NATS does not answer at $host:$port"
    ensure_packages nats-server
    # The store may have been made by a server run as root (as earlier versions of this
    # script did): the nats user must own it.
    install -d -o nats -g nats -m 750 "$store" /var/log/nats-server /run/nats-server
    [ -z "$(find "$store" ! -user nats -print -quit)" ] || chown -R nats:nats "$store"
    log "starting NATS with JetStream (as nats; store $store)"
    local bind=${host#[}
    start_as nats "$out" /usr/sbin/nats-server -a "${bind%]}" -p "$port" -js -sd "$store" \
      -P /run/nats-server/nats-server.pid
    wait_for "$host" "$port" 30 "$started_pid" ||
      { show_log "$out"; die "NATS did not start at $host:$port (its log is above)"; }
  fi
  local info
  info=$(timeout 15 bash "$IDEM_SERVICES_SH" _jetstream-info "$host" "$port" "$user" "$pass" 2>&1) || {
    show_log "$out"
    die "NATS at $host:$port answers, but JetStream does not ($info); it must run with JetStream (nats-server -js -sd DIR): stop it, and this script starts one"
  }
  log "NATS answers at $host:$port with JetStream (account info: $(sed -E 's/.*"storage":([0-9]+).*"streams":([0-9]+).*/storage \1 bytes, streams: \2/' <<<"$info"))"
}

# --- run as a script -------------------------------------------------------------------------
services_main() {
  local what=("$@") s start
  [ ${#what[@]} -gt 0 ] || what=(postgres mysql rabbitmq nats pg-binaries galera-binaries broker-binaries)
  for s in "${what[@]}"; do
    start=$SECONDS
    case $s in
      postgres) ensure_postgres "${IDEM_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/postgres}" ;;
      mysql) ensure_mariadb "${IDEM_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}" ;;
      rabbitmq) ensure_rabbitmq "${IDEM_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}" ;;
      nats) ensure_nats "${IDEM_NATS_URL:-nats://127.0.0.1:4222}" ;;
      pg-binaries) ensure_postgres_binaries ;;
      galera-binaries) ensure_galera_binaries ;;
      broker-binaries) ensure_broker_binaries ;;
      *) die "unknown service $s (postgres mysql rabbitmq nats pg-binaries galera-binaries broker-binaries, or packages)" ;;
    esac
    log "$s: ready ($((SECONDS - start)) s)"
  done
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  case ${1:-} in
    packages) services_packages ;;
    _amqp-open) shift && amqp_open "$@" ;;
    _jetstream-info) shift && nats_jetstream_info "$@" ;;
    *) services_main "$@" ;;
  esac
fi
