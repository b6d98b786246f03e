#!/usr/bin/env bash
# Proves that ci/services.sh works on a fresh Debian 12 machine without systemd.
#
#   sudo ci/fresh-debian.sh
#
# 1. builds a Debian 12 (bookworm) root with debootstrap (minbase, like a container image;
#    debootstrap is apt-installed first when missing), with the package-script policy of
#    Debian's container images: installing a package starts no service;
# 2. downloads every package ci/services.sh may install (`ci/services.sh packages`): the only
#    step that uses the network;
# 3. in namespaces of its own (network: loopback only, so the servers of this machine are not
#    seen; processes; mounts), runs ci/services.sh on the fresh root, which installs, sets up
#    and starts PostgreSQL, MariaDB, RabbitMQ and NATS with JetStream;
# 4. runs it again: it must succeed and change nothing;
# 5. breaks what a failed or interrupted run leaves half done (MariaDB stopped, its test
#    database dropped and root's TCP login gone; PostgreSQL stopped and loopback logins back
#    to passwords; RabbitMQ's guest user deleted; NATS stopped and uninstalled, its store
#    owned by root), and runs it a third time: it must repair all of it;
# 6. makes MariaDB unable to start (its data directory unreadable): ci/services.sh must fail
#    and show the server's own log; then starts it again;
# 7. checks each service with its own client (psql, mariadb, rabbitmqctl and an AMQP
#    handshake, a JetStream request over the NATS protocol) and the user each server runs as;
# 8. starts the private 3-node Galera cluster of ci/galera.sh and the PostgreSQL pair of
#    ci/pg-failover.sh in the fresh root, from the programs ci/services.sh installed.
# Every process it started is killed (with its process namespace) and its mounts go with
# its mount namespace; the root is removed unless IDEM_FRESH_KEEP=1.
#
# Environment: IDEM_FRESH_DIR (work directory; default a new one under /var/tmp),
# IDEM_FRESH_CACHE (keeps downloaded packages between runs; default none),
# IDEM_DEBIAN_MIRROR (default http://deb.debian.org/debian), IDEM_FRESH_KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."

mirror=${IDEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
step() { printf '\n==> [%ss] %s\n' "$SECONDS" "$*"; }
fail() {
  printf 'ci/fresh-debian: FAILED: %s\n' "$*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "run it as root (debootstrap, chroot and namespaces need it)"
for tool in unshare nsenter chroot; do command -v "$tool" >/dev/null || fail "$tool is missing"; done

work=${IDEM_FRESH_DIR:-$(mktemp -d /var/tmp/idem-fresh-debian.XXXXXX)}
mkdir -p "$work"
root=$work/root
[ ! -e "$root" ] || fail "$root exists already; remove it or set IDEM_FRESH_DIR"
holder=""
ns_pid=""

cleanup() {
  local rc=$?
  trap - EXIT
  if [ -n "$ns_pid" ]; then
    # When the first process of the process namespace ends, the kernel kills every process
    # in it; the namespace's mounts go with its last process.
    kill -TERM "$ns_pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$holder" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$ns_pid" 2>/dev/null || true
  fi
  if [ -n "$holder" ]; then wait "$holder" 2>/dev/null || true; fi
  local left=0 p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && left=$((left + 1))
  done
  if grep -qF " $root" /proc/self/mountinfo; then
    echo "ci/fresh-debian: mounts left under $root:" >&2
    grep -F " $root" /proc/self/mountinfo >&2
    rc=1
  fi
  if [ "$left" = 0 ]; then
    grep -qF " $root" /proc/self/mountinfo || echo "ci/fresh-debian: cleaned up: no process and no mount left in $root"
  else
    echo "ci/fresh-debian: $left processes still run in $root" >&2
    rc=1
  fi
  if [ "${IDEM_FRESH_KEEP:-0}" = 1 ]; then
    echo "ci/fresh-debian: kept $root"
  elif [ "$left" = 0 ] && [ -d "$root" ] && ! grep -qF " $root" /proc/self/mountinfo; then
    rm -rf "$root"
    [ -n "${IDEM_FRESH_DIR:-}" ] || rmdir "$work" 2>/dev/null || true
  fi
  exit "$rc"
}
trap cleanup EXIT

in_root() { # command... in the fresh root, in the isolated namespaces, with a clean environment
  nsenter --target "$ns_pid" --net --pid --mount -- chroot "$root" /usr/bin/env -i \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb "$@"
}

step "debootstrap (host: $(. /etc/os-release && echo "$PRETTY_NAME"), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
if ! command -v debootstrap >/dev/null; then
  apt-get install -y -qq debootstrap >/dev/null || fail "apt-get install debootstrap"
fi
cache_args=()
if [ -n "${IDEM_FRESH_CACHE:-}" ]; then
  mkdir -p "$IDEM_FRESH_CACHE/debootstrap" "$IDEM_FRESH_CACHE/apt"
  cache_args=(--cache-dir="$IDEM_FRESH_CACHE/debootstrap")
fi
debootstrap --variant=minbase "${cache_args[@]}" bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 ||
  { tail -n 30 "$work/debootstrap.log" >&2; fail "debootstrap"; }
echo "Debian $(cat "$root/etc/debian_version") in $root ($(du -sh "$root" | cut -f1))"

step "the fresh machine's settings"
# As the Debian installer writes them; RabbitMQ names its node after the host name.
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' "$(hostname)" >"$root/etc/hosts"
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
# As in Debian's container images: package scripts start no service.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
mkdir -p "$root/idem"
cp -r ci "$root/idem/ci"
echo "/etc/hosts, apt sources (bookworm, -updates, -security), policy-rc.d (no service starts), /idem/ci"

step "download the packages ci/services.sh may install (the only step with a network)"
packages=$(bash ci/services.sh packages)
echo "packages: $packages"
if [ -n "${IDEM_FRESH_CACHE:-}" ]; then
  find "$IDEM_FRESH_CACHE/apt" -name '*.deb' -exec cp -n -t "$root/var/cache/apt/archives" {} +
fi
debs_before=$(find "$root/var/cache/apt/archives" -name '*.deb' | wc -l)
unshare --mount --propagation private -- bash -c '
  set -e
  mount -t proc proc "$1/proc"
  chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root DEBIAN_FRONTEND=noninteractive \
    bash -c "apt-get update && apt-get install -y --download-only --no-install-recommends $2"
' _ "$root" "$packages" >"$work/download.log" 2>&1 || { tail -n 30 "$work/download.log" >&2; fail "download"; }
if [ -n "${IDEM_FRESH_CACHE:-}" ]; then
  find "$root/var/cache/apt/archives" -name '*.deb' -exec cp -n -t "$IDEM_FRESH_CACHE/apt" {} +
fi
echo "$(($(find "$root/var/cache/apt/archives" -name '*.deb' | wc -l) - debs_before)) packages downloaded; $(grep -E '^Fetched' "$work/download.log" || echo "all from the cache")"

step "isolated namespaces: network (loopback only), processes, mounts"
# The first process of the new process namespace holds the namespaces and reaps orphans.
unshare --net --pid --mount --fork --propagation private -- bash -c '
  set -e
  ip link set lo up
  mount -t proc proc "$1/proc"
  mount -t sysfs sysfs "$1/sys"
  mount -t tmpfs -o mode=755 tmpfs "$1/run"
  mount -t tmpfs -o mode=1777 tmpfs "$1/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666 devpts "$1/dev/pts"
  mkdir -p "$1/run/lock"
  touch "$2/ns-ready"
  trap "exit 0" TERM
  while :; do sleep 3600 & wait $!; done
' _ "$root" "$work" &
holder=$!
for _ in $(seq 1 50); do [ -e "$work/ns-ready" ] && break; sleep 0.1; done
[ -e "$work/ns-ready" ] || fail "the namespaces did not come up"
ns_pid=$(cat "/proc/$holder/task/$holder/children")
ns_pid=${ns_pid%% *}
in_root bash -c '
  echo "network interfaces: $(ls /sys/class/net | paste -sd" " -)"
  for port in 5432 3306 5672 4222; do
    if timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port" 2>/dev/null; then
      echo "127.0.0.1:$port answers: this machine'\''s servers are visible"; exit 1
    fi
  done
  echo "127.0.0.1:5432, 3306, 5672 and 4222: nothing answers (the machine'\''s servers are not seen)"
  echo "processes: $(ls -d /proc/[0-9]* | wc -l); mariadbd, postgres, rabbitmq-server, nats-server installed: $(ls /usr/sbin/mariadbd /usr/lib/postgresql /usr/sbin/rabbitmq-server /usr/sbin/nats-server 2>/dev/null | wc -l)"
' || fail "the namespace is not isolated"

run_services() { # label
  local start=$SECONDS
  in_root bash /idem/ci/services.sh 2>&1 | tee "$work/services-$1.log"
  local rc=${PIPESTATUS[0]}
  echo "ci/services.sh ($1): exit $rc after $((SECONDS - start)) s"
  return "$rc"
}
# What ci/services.sh says when it changes something.
changes='installing|starting|creating|initializing|setting|letting|adding|granting|dpkg was'

step "ci/services.sh, first run on the fresh root"
run_services first || fail "the first run"

step "ci/services.sh, second run: nothing to do"
run_services second || fail "the second run"
if grep -E "$changes" "$work/services-second.log"; then fail "the second run changed something"; fi
echo "the second run changed nothing"

step "break it: what a failed or interrupted run leaves half done"
in_root bash -c '
  set -e
  mariadb -uroot -e "DROP DATABASE test; ALTER USER root@localhost IDENTIFIED VIA unix_socket;
    DROP USER IF EXISTS root@\"127.0.0.1\", root@\"::1\"; FLUSH PRIVILEGES;"
  mariadb-admin -uroot shutdown
  echo "MariaDB: database test dropped, root logs in only over the socket, server stopped"
  hba=/etc/postgresql/15/main/pg_hba.conf
  sed -i -E "s#^(host\s+all\s+all\s+(127\.0\.0\.1/32|::1/128)\s+)trust#\1scram-sha-256#" "$hba"
  pg_ctlcluster --skip-systemctl-redirect 15 main stop
  echo "PostgreSQL: loopback logins need a password again, server stopped"
  rabbitmqctl -s delete_user guest
  echo "RabbitMQ: user guest deleted"
  kill "$(cat /run/nats-server/nats-server.pid)"
  for _ in $(seq 1 50); do timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/4222" 2>/dev/null || break; sleep 0.2; done
  DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq nats-server >/dev/null
  chown -R root:root /var/lib/nats-server
  echo "NATS: server stopped, package removed, its store owned by root"
' || fail "breaking it"

step "ci/services.sh, third run: repairs what the break left"
run_services third || fail "the third run"
for what in "starting PostgreSQL" "setting loopback logins to trust" "installing nats-server" \
  "starting MariaDB" "letting root log in" "creating the database test" "adding the user guest" \
  "starting NATS"; do
  grep -qF "$what" "$work/services-third.log" || fail "the third run did not say: $what"
done
echo "the third run repaired each broken part"

step "a server that cannot start: ci/services.sh shows the server's log and fails"
mode=$(in_root stat -c %a /var/lib/mysql)
in_root bash -c 'set -e; mariadb-admin -uroot shutdown; chmod 000 /var/lib/mysql
  echo "MariaDB stopped; its data directory /var/lib/mysql made unreadable (mode 000)"' || fail "breaking MariaDB"
if run_services fourth; then fail "the fourth run succeeded with MariaDB unable to start"; fi
grep -qF -- "---- last lines of" "$work/services-fourth.log" || fail "the fourth run showed no server log"
in_root chmod "$mode" /var/lib/mysql
echo "the fourth run failed and showed MariaDB's own log; data directory mode $mode restored"

step "ci/services.sh, fifth run: starts MariaDB again"
run_services fifth || fail "the fifth run"

step "each service answers its own client"
in_root bash -c '
  set -e
  echo "--- PostgreSQL (psql, over TCP, no password)"
  psql -X -w -h 127.0.0.1 -U postgres -d postgres -Atc "SELECT version()"
  echo "--- MariaDB (mariadb, over TCP, root without a password, database test)"
  mariadb --no-defaults --protocol=tcp -h 127.0.0.1 -uroot test -N -B -e "SELECT VERSION(), DATABASE()"
  echo "--- RabbitMQ (rabbitmqctl; then an AMQP 0-9-1 handshake as guest on /)"
  rabbitmqctl -s status | grep -E "RabbitMQ version|Node name|Uptime" || true
  rabbitmqctl -s authenticate_user guest guest
  bash /idem/ci/services.sh _amqp-open 127.0.0.1 5672 guest guest / && echo "AMQP: guest opened the virtual host /"
  echo "--- NATS (the INFO line; a JetStream account-info request)"
  timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/4222; head -n1 <&3" | grep -o "\"version\":\"[^\"]*\"\|\"jetstream\":true"
  bash /idem/ci/services.sh _jetstream-info 127.0.0.1 4222 "" ""
  echo "--- who runs each server"
  for comm in postgres mariadbd beam.smp nats-server; do
    users=$(ps -C "$comm" -o user= | sort -u | paste -sd, -)
    echo "$comm: ${users:-not running}"
    case "$comm:$users" in
      postgres:postgres | mariadbd:mysql | beam.smp:rabbitmq | nats-server:nats) ;;
      *) echo "$comm runs as ${users:-nobody}"; exit 1 ;;
    esac
  done
' || fail "a client check"

step "private instances from the installed programs: ci/galera.sh (3 nodes) and ci/pg-failover.sh"
in_root bash -c 'cd /idem && ci/galera.sh run bash -c "echo \"Galera URLs: \$IDEM_GALERA_URLS\""' 2>&1 ||
  fail "ci/galera.sh in the fresh root"
in_root bash -c 'cd /idem && ci/pg-failover.sh run sync bash -c "echo \"primary \$IDEM_PGFO_PRIMARY_URL, standby \$IDEM_PGFO_STANDBY_URL\""' 2>&1 ||
  fail "ci/pg-failover.sh in the fresh root"

step "fresh Debian root: every check passed"
