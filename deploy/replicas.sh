#!/usr/bin/env bash
# N `mlxcel serve` replicas on one machine behind HAProxy (deploy/haproxy.cfg).
#
#   deploy/replicas.sh run N [FRONT_PORT] -- SERVE_ARGS...
#       start N replicas on 127.0.0.1:(FRONT_PORT+1 ... FRONT_PORT+N), then HAProxy on
#       FRONT_PORT (default 8080) in the foreground; Ctrl-C stops HAProxy and drains the
#       replicas (SIGTERM: in-flight requests finish).
#   deploy/replicas.sh config FRONT_PORT HOST:PORT...
#       print deploy/haproxy.cfg for these replicas (to run HAProxy yourself, or on
#       another machine in front of replicas on several Macs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
template="$here/haproxy.cfg"

config() {
  local front="$1"; shift
  local servers="" tracked="" i=0
  for address in "$@"; do
    i=$((i + 1))
    servers+="    server r$i $address check"$'\n'
    tracked+="    server r$i $address track mlxcel_replicas/r$i"$'\n'
  done
  SERVERS="$servers" TRACKED="$tracked" FRONT="$front" awk '
    /# BEGIN SERVERS/ { print; printf "%s", ENVIRON["SERVERS"]; skip = 1; next }
    /# BEGIN TRACKED/ { print; printf "%s", ENVIRON["TRACKED"]; skip = 1; next }
    /# END (SERVERS|TRACKED)/ { skip = 0 }
    skip { next }
    /^    bind :8080$/ { print "    bind 127.0.0.1:" ENVIRON["FRONT"]; next }
    { print }
  ' "$template"
}

case "${1:-}" in
  config)
    shift
    [ $# -ge 2 ] || { echo "usage: $0 config FRONT_PORT HOST:PORT..." >&2; exit 2; }
    config "$@"
    ;;
  run)
    shift
    n="${1:?usage: $0 run N [FRONT_PORT] -- SERVE_ARGS...}"; shift
    front=8080
    if [ $# -gt 0 ] && [ "$1" != "--" ]; then front="$1"; shift; fi
    [ "${1:-}" = "--" ] && shift
    command -v haproxy >/dev/null || { echo "haproxy is not installed (apt-get install haproxy)" >&2; exit 1; }
    pids=() addresses=()
    cleanup() { for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done; wait; }
    trap cleanup EXIT INT TERM
    for i in $(seq 1 "$n"); do
      port=$((front + i))
      mlxcel serve "$@" --host 127.0.0.1 --port "$port" &
      pids+=("$!")
      addresses+=("127.0.0.1:$port")
    done
    cfg="$(mktemp -t mlxcel-haproxy.XXXXXX.cfg)"
    config "$front" "${addresses[@]}" > "$cfg"
    echo "mlxcel: HAProxy on http://127.0.0.1:$front in front of ${addresses[*]}" >&2
    haproxy -db -f "$cfg"
    ;;
  *)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
