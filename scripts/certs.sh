# Sourced by scripts/postgres.sh and scripts/redis.sh: certificates for a throwaway server.
#
#   test_certificates DIR   writes DIR/ca.crt (a test CA) and DIR/server.crt, DIR/server.key
#                           (a certificate for localhost / 127.0.0.1 that the CA signs; a CA
#                           certificate cannot serve itself: rustls refuses one as the
#                           server's), valid for 3 days.

test_certificates() {
  local dir="$1"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3 -subj /CN=idem-test-ca \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj /CN=localhost \
    -keyout "$dir/server.key" -out "$dir/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    >"$dir/server.ext"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 3 -extfile "$dir/server.ext" -out "$dir/server.crt" >/dev/null 2>&1
  chmod 600 "$dir/server.key"
  chmod 644 "$dir/server.crt" "$dir/ca.crt"
}

# A free TCP port on the loopback interface.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
