#!/usr/bin/env bash
# The real browser that tests/admin_browser.rs drives against the admin listener: Debian's
# `chromium` (Playwright cannot download its own browsers here, so it is pointed at this one)
# and Playwright for Python from PyPI, pinned, under DIR. Usage: browser.sh DIR. Idempotent:
# what is in place at the pinned version is kept. About 560 MB (see the README).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?usage: browser.sh DIR}"
playwright="1.65.2"
if ! command -v chromium >/dev/null 2>&1; then
  echo "tests/setup/browser.sh: installing from Debian: chromium" >&2
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    echo "tests/setup/browser.sh: the browser test needs chromium, and installing it needs root:" >&2
    echo "  sudo apt-get install -y --no-install-recommends chromium" >&2
    exit 1
  fi
  apt_get=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
  if ! "${apt_get[@]}" update -qq || ! "${apt_get[@]}" install -y -qq --no-install-recommends \
    chromium >/dev/null; then
    echo "tests/setup/browser.sh: could not install chromium; install it with:" >&2
    echo "  sudo apt-get install -y --no-install-recommends chromium" >&2
    exit 1
  fi
fi
mkdir -p "$dir"
if [ "$(cat "$dir/version" 2>/dev/null)" != "$playwright" ]; then
  rm -rf "$dir/site"
  mkdir -p "$dir/site"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --root-user-action=ignore --target "$dir/site" "playwright==$playwright"
  echo "$playwright" > "$dir/version"
fi
cp "$here/browser_attack.py" "$dir/browser_attack.py"
