#!/usr/bin/env bash
# Installs the real HTTP servers that tests/h2_servers.rs puts behind idemgate as its
# upstream, from Debian's packages: nginx (nginx-light), Caddy and Apache httpd (whose
# mod_http2 ships in the apache2 package). Idempotent: what is installed already is kept.
# The packages' own services are not started: the tests run each server on a free port
# with a configuration of their own.
set -euo pipefail
missing=()
command -v nginx >/dev/null 2>&1 || missing+=(nginx-light)
command -v caddy >/dev/null 2>&1 || missing+=(caddy)
{ command -v apache2 >/dev/null 2>&1 || [ -x /usr/sbin/apache2 ]; } || missing+=(apache2)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "h2_servers/install.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# No service starts at install (there is no init system to stop it again, and the
# packages' defaults would take port 80): a policy that forbids it, for this install only.
policy=/usr/sbin/policy-rc.d
made_policy=false
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  made_policy=true
fi
trap '$made_policy && rm -f "$policy"' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
