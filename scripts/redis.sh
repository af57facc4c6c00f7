# Sourced by scripts/test.sh and benches/redis.sh: a throwaway redis-server.
#
#   redis_start   installs Debian's redis-server if it is missing and starts one in a
#                 temporary directory, persistence off, on a free loopback port and a TLS
#                 port (a certificate for localhost / 127.0.0.1 signed by a test CA), with
#                 the default user open and a user `idem` with a password; exports
#                 IDEM_TEST_REDIS_URL, IDEM_TEST_REDIS_TLS_URL, IDEM_TEST_REDIS_CA and
#                 IDEM_TEST_REDIS_PASSWORD.
#   redis_stop    stops it and removes its directory.

source "$(dirname "${BASH_SOURCE[0]}")/certs.sh"

redis_start() {
  if ! command -v redis-server >/dev/null; then
    local as_root=""
    [ "$(id -u)" = 0 ] || as_root="sudo"
    $as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq redis-server >/dev/null
  fi
  REDIS_DIR="$(mktemp -d "${TMPDIR:-/tmp}/idem-redis.XXXXXX")"
  test_certificates "$REDIS_DIR"
  REDIS_PORT="$(free_port)"
  local tls_port
  tls_port="$(free_port)"
  IDEM_TEST_REDIS_PASSWORD="idem-test-redis-secret-never-printed"
  cat >"$REDIS_DIR/redis.conf" <<CONF
bind 127.0.0.1
port $REDIS_PORT
tls-port $tls_port
tls-cert-file $REDIS_DIR/server.crt
tls-key-file $REDIS_DIR/server.key
tls-ca-cert-file $REDIS_DIR/ca.crt
tls-auth-clients no
save ""
appendonly no
daemonize yes
pidfile $REDIS_DIR/redis.pid
logfile $REDIS_DIR/log
dir $REDIS_DIR
user default on nopass ~* &* +@all
user idem on >$IDEM_TEST_REDIS_PASSWORD ~* &* +@all
CONF
  redis-server "$REDIS_DIR/redis.conf"
  for _ in $(seq 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
    sleep 0.1
  done
  export IDEM_TEST_REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  export IDEM_TEST_REDIS_TLS_URL="rediss://127.0.0.1:$tls_port"
  export IDEM_TEST_REDIS_CA="$REDIS_DIR/ca.crt"
  export IDEM_TEST_REDIS_PASSWORD
}

redis_stop() {
  if [ -n "${REDIS_DIR:-}" ] && [ -d "$REDIS_DIR" ]; then
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
    rm -rf "$REDIS_DIR"
  fi
}
