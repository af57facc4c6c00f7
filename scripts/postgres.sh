# Sourced by scripts/test.sh and benches/postgres.sh: a throwaway PostgreSQL cluster.
#
#   pg_start [fsync]   installs Debian's postgresql if it is missing, makes a cluster in a
#                      temporary directory (as the `postgres` user when run as root: the
#                      server refuses to run as root), with TLS on (a certificate for
#                      localhost / 127.0.0.1 signed by a test CA), trust for the superuser,
#                      TLS-only trust for a role idem_tls, scram-sha-256 for every other
#                      role, on a free loopback port, and exports IDEM_TEST_PG_URL,
#                      IDEM_TEST_PG_PORT, IDEM_TEST_PG_CA (the CA's certificate).
#                      fsync is off unless the first argument is `fsync`.
#   pg_stop            stops it and removes its directory.

source "$(dirname "${BASH_SOURCE[0]}")/certs.sh"

pg_start() {
  local fsync=off
  [ "${1:-}" = fsync ] && fsync=on
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    local as_root=""
    [ "$(id -u)" = 0 ] || as_root="sudo"
    $as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq postgresql >/dev/null
  fi
  PG_BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
  PG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/idem-pg.XXXXXX")"
  chmod 755 "$PG_DIR"
  test_certificates "$PG_DIR"
  if [ "$(id -u)" = 0 ]; then
    chown postgres "$PG_DIR" "$PG_DIR/server.key" "$PG_DIR/server.crt"
    PG_AS=(su postgres -s /bin/sh -c)
  else
    PG_AS=(sh -c)
  fi
  "${PG_AS[@]}" "$PG_BIN/initdb -D $PG_DIR/data -A trust -U postgres" >"$PG_DIR/initdb.log" 2>&1
  cat >"$PG_DIR/data/pg_hba.conf" <<'HBA'
local all all trust
hostnossl all idem_tls 127.0.0.1/32 reject
hostssl all idem_tls 127.0.0.1/32 trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
HBA
  IDEM_TEST_PG_PORT="$(free_port)"
  "${PG_AS[@]}" "$PG_BIN/pg_ctl -D $PG_DIR/data -w -t 60 -l $PG_DIR/log -o \"-p $IDEM_TEST_PG_PORT -k $PG_DIR \
    -c listen_addresses=127.0.0.1 -c fsync=$fsync -c ssl=on -c ssl_cert_file=$PG_DIR/server.crt \
    -c ssl_key_file=$PG_DIR/server.key -c max_connections=200\" start" >/dev/null
  export IDEM_TEST_PG_PORT
  export IDEM_TEST_PG_URL="postgres://postgres@127.0.0.1:$IDEM_TEST_PG_PORT/postgres"
  export IDEM_TEST_PG_CA="$PG_DIR/ca.crt"
}

pg_stop() {
  if [ -n "${PG_DIR:-}" ] && [ -d "$PG_DIR/data" ]; then
    "${PG_AS[@]}" "$PG_BIN/pg_ctl -D $PG_DIR/data -m immediate stop" >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
  fi
}
