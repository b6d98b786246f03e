#!/usr/bin/env bash
# Installs Oracle Instant Client Basic Light into /opt/oracle/instantclient, for the
# container matrix's Oracle job (GitHub runners reach Oracle's download site; the
# project's own machines do not, which is why Oracle is not verified live there).
set -euo pipefail
dest=/opt/oracle/instantclient
[ -e "$dest/libclntsh.so" ] && exit 0
apt-get update -qq && apt-get install -y -qq unzip libaio1t64 || apt-get install -y -qq unzip libaio1
ln -sf /usr/lib/x86_64-linux-gnu/libaio.so.1t64 /usr/lib/x86_64-linux-gnu/libaio.so.1 2>/dev/null || true
tmp=$(mktemp -d)
curl -fsSL -o "$tmp/ic.zip" https://download.oracle.com/otn_software/linux/instantclient/instantclient-basiclite-linuxx64.zip
unzip -q "$tmp/ic.zip" -d "$tmp"
mkdir -p /opt/oracle
mv "$tmp"/instantclient_* "$dest"
echo "$dest" > /etc/ld.so.conf.d/oracle-instantclient.conf
ldconfig
