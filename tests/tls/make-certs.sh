#!/usr/bin/env bash
# Writes a throwaway PKI for the internal-plane TLS tests into DIR (openssl CLI):
#   ca.pem                       the cluster CA
#   server.pem / server.key      a node certificate (SAN IP:127.0.0.1, DNS:localhost; server and
#                                client auth: workers serve and also dial etcd)
#   client.pem / client.key      a client-only certificate (the router)
#   other-ca.pem                 an unrelated CA
#   rogue.pem / rogue.key        a client certificate signed by the unrelated CA
#   named.pem / named.key        a node certificate with only DNS:tandem-internal (no IP SAN)
set -euo pipefail
dir=${1:?usage: make-certs.sh DIR}
mkdir -p "$dir"
cd "$dir"
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found (scripts/install-deps)" >&2; exit 1; }

ca() {  # ca NAME CN
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    2>/dev/null
}
leaf() {  # leaf NAME CN CA EXTENSIONS
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "tandem test CA"
ca other-ca "unrelated CA"
leaf server "tandem node" ca "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth,clientAuth"
leaf client "tandem router" ca "extendedKeyUsage=clientAuth"
leaf rogue "rogue" other-ca "subjectAltName=IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth"
leaf named "tandem node" ca "subjectAltName=DNS:tandem-internal
extendedKeyUsage=serverAuth,clientAuth"
