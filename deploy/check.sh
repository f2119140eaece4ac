#!/usr/bin/env bash
# Checks the deployment files as far as one machine without a cluster allows:
# - `kubectl kustomize deploy/k8s` renders (when kubectl is on PATH);
# - `docker-compose config` accepts docker-compose.yml (when docker-compose is on PATH);
# - the k8s Redis (deploy/k8s/redis.yaml's redis.conf, the ACL file made as
#   secret.example.yaml says, a CA and certificate made here) runs in a local redis-server,
#   and the idemgate binary, configured by deploy/k8s/configmap.yaml's TOML with the password
#   in IDEMGATE_REDIS_PASSWORD, starts against it over TLS as the `idemgate` user and
#   records a request; the default user is refused.
# Needs redis-server, redis-cli, openssl, python3 and a built idemgate in
# ${CARGO_TARGET_DIR:-target}/debug.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh

if command -v kubectl >/dev/null; then kubectl kustomize deploy/k8s >/dev/null && echo "k8s: renders"; fi
if command -v docker-compose >/dev/null; then docker-compose -f docker-compose.yml config -q && echo "compose: valid"; fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
read -r p_redis p_proxy p_admin p_up < <(free_ports 4)

# A CA and a certificate for the Service name (and localhost, to reach it from here).
(cd "$work" &&
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=check-ca -keyout ca.key -out ca.crt \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null &&
  openssl req -newkey rsa:2048 -nodes -subj /CN=payments-redis -keyout tls.key -out tls.csr 2>/dev/null &&
  printf 'subjectAltName=DNS:payments-redis,DNS:localhost\n' > ext &&
  openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile ext -out tls.crt 2>/dev/null)

# The ACL file, exactly as secret.example.yaml's comment makes it.
PASSWORD="$(openssl rand -hex 32)"
cmd=$(sed -n 's/^#   printf /printf /p' deploy/k8s/secret.example.yaml)
cont=$(sed -n 's/^#     "\$(printf/"$(printf/p' deploy/k8s/secret.example.yaml | sed 's/ > users.acl$//')
eval "${cmd% \\} $cont" > "$work/users.acl"

# redis.conf from the ConfigMap, with the pod's paths and port mapped to this machine.
python3 - "$work" "$p_redis" <<'PY'
import re, sys
work, port = sys.argv[1], sys.argv[2]
text = open("deploy/k8s/redis.yaml").read()
conf = text.split("redis.conf: |\n", 1)[1].split("\n---", 1)[0]
conf = "\n".join(l[4:] for l in conf.splitlines())
conf = conf.replace("/tls/", work + "/").replace("/acl/", work + "/").replace("dir /data", "dir " + work)
conf = conf.replace("tls-port 6380", "tls-port " + port)
open(work + "/redis.conf", "w").write(conf + "\nbind 127.0.0.1\nlogfile " + work + "/redis.log\n")
toml = open("deploy/k8s/configmap.yaml").read().split("idemgate.toml: |\n", 1)[1]
toml = "\n".join(l[4:] for l in toml.splitlines())
toml = toml.replace("/etc/idemgate-redis-tls/", work + "/")
toml = re.sub(r'rediss://payments-redis:6380', "rediss://localhost:" + port, toml)
open(work + "/idemgate.toml", "w").write(toml + "\n")
PY
redis-server "$work/redis.conf" & pids+=($!)
wait_for "$p_redis" redis-server
cli() { redis-cli --tls --sni localhost --cacert "$work/ca.crt" -h localhost -p "$p_redis" "$@"; }
if cli ping 2>&1 | grep -q NOAUTH; then echo "redis: default user refused"; else echo "redis: default user NOT refused"; exit 1; fi

python3 -m http.server "$p_up" --bind 127.0.0.1 >/dev/null 2>&1 & pids+=($!)
wait_for "$p_up" upstream
# This Redis is the check's own: no running instance to wait for before making the secret.
IDEMGATE_SCOPE_SECRET_CREATE_DELAY=0s IDEMGATE_CONFIG="$work/idemgate.toml" IDEMGATE_REDIS_PASSWORD="$PASSWORD" \
  IDEMGATE_LISTEN="127.0.0.1:$p_proxy" IDEMGATE_ADMIN_LISTEN="127.0.0.1:$p_admin" \
  IDEMGATE_UPSTREAM="http://127.0.0.1:$p_up" IDEMGATE_ADMIN_TOKEN="$(openssl rand -hex 16)" \
  "${CARGO_TARGET_DIR:-target}"/debug/idemgate 2>"$work/idemgate.log" & pids+=($!)
wait_for "$p_proxy" idemgate
# The listener answers before the store is open (probes never wait on it): ready is /readyz.
for _ in $(seq 1 150); do
  curl -sf -o /dev/null "http://127.0.0.1:$p_admin/readyz" && break
  sleep 0.1
done
# The upstream answers 501 to a POST: any answer is recorded, and the retry replays it.
curl -s -o /dev/null -X POST -H 'Authorization: Bearer check' -H 'Idempotency-Key: check-1' "http://127.0.0.1:$p_proxy/transfers"
replayed=$(curl -s -D - -o /dev/null -X POST -H 'Authorization: Bearer check' -H 'Idempotency-Key: check-1' "http://127.0.0.1:$p_proxy/transfers" | tr -d '\r' | grep -i '^idempotent-replayed: true' || true)
# The user may not go beyond its commands: KEYS is not among them (listing uses SCAN).
denied=$(cli --user idemgate --pass "$PASSWORD" --no-auth-warning keys '*' 2>&1 || true)
if [ -n "$replayed" ] && [[ "$denied" == *NOPERM* ]]; then
  echo "k8s redis: idemgate over TLS as the ACL user: recorded and replayed; KEYS refused"
else
  echo "k8s redis: FAILED (replayed: '$replayed', keys: $denied)"; cat "$work/idemgate.log"; exit 1
fi
