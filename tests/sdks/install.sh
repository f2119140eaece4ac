#!/usr/bin/env bash
# Installs Stripe's SDKs that tests/sdks.rs drives through idemgate, pinned: stripe-node
# (npm, with its lock file) and stripe-python (PyPI). Usage: install.sh DIR. Idempotent:
# what DIR already holds at the pinned versions is kept.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?usage: install.sh DIR}"
mkdir -p "$dir"
if [ ! -f "$dir/node/node_modules/stripe/package.json" ] \
  || ! cmp -s "$here/node/package-lock.json" "$dir/node/package-lock.json"; then
  rm -rf "$dir/node"
  mkdir -p "$dir/node"
  cp "$here/node/package.json" "$here/node/package-lock.json" "$dir/node/"
  (cd "$dir/node" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
cp "$here/node/run.js" "$dir/node/run.js"
if [ ! -f "$dir/python/requirements.txt" ] \
  || ! cmp -s "$here/python/requirements.txt" "$dir/python/requirements.txt"; then
  rm -rf "$dir/python"
  mkdir -p "$dir/python/site"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --root-user-action=ignore --target "$dir/python/site" -r "$here/python/requirements.txt"
  cp "$here/python/requirements.txt" "$dir/python/requirements.txt"
fi
cp "$here/python/run.py" "$dir/python/run.py"
