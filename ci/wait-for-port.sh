#!/usr/bin/env bash
# wait-for-port.sh HOST PORT SECONDS: waits until something listens (for containers
# without a health check, like SQL Server's).
set -euo pipefail
host=$1 port=$2 limit=${3:-120}
for _ in $(seq 1 "$limit"); do
  if timeout 2 bash -c "exec 3<>/dev/tcp/$host/$port" 2>/dev/null; then
    echo "$host:$port answers"
    exit 0
  fi
  sleep 1
done
echo "$host:$port did not answer within ${limit}s" >&2
exit 1
