#!/usr/bin/env bash
# What the tests need from outside the crate, installed once per machine and shared by every
# clone and every test binary: Debian's packages (redis-server and redis-cli, openssl,
# PostgreSQL's initdb and pg_ctl, libfaketime, iproute2, promtool, nginx, Caddy, Apache
# httpd, Jetty, Puma with Rack), the real frameworks (npm and PyPI, pinned) and Stripe's SDKs (npm and PyPI,
# pinned). The packages go where Debian puts them (through sudo when the tests do not run as
# root); the rest under the cache directory, by default ~/.cache/idemgate-tests
# (IDEMGATE_TEST_CACHE overrides it), which this script prints on its last line.
#
# Usage: install.sh [COMPONENT...]      everything above, and each component named:
#        previous-release               the older idemgate that tests/mixed_version.rs runs
#                                       beside this one, built once from git history
#        browser                        Debian's chromium and Playwright (PyPI, pinned) for
#                                       tests/admin_browser.rs, about 360 MB (browser.sh)
#
# Two test binaries that start it at once install once: the second waits on a lock in the
# cache directory, then finds everything in place. What cannot be installed is an error that
# names the package and the command that installs it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${IDEMGATE_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/idemgate-tests}"
mkdir -p "$cache"
exec 9>"$cache/lock"
flock 9

# Debian's packages, each named by the command or file the tests use from it.
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have redis-server || need+=(redis-server)
have redis-cli || need+=(redis-tools)
have openssl || need+=(openssl)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || need+=(faketime)
{ have ss && have ip; } || need+=(iproute2)
{ have unshare && have flock; } || need+=(util-linux)
have promtool || need+=(prometheus)
have nginx || need+=(nginx-light)
have caddy || need+=(caddy)
{ have apache2 || [ -x /usr/sbin/apache2 ]; } || need+=(apache2)
{ [ -f /usr/share/java/jetty9-server.jar ] && [ -f /usr/share/java/servlet-api-3.1.jar ]; } \
  || need+=(libjetty9-java libservlet3.1-java)
have javac || need+=(default-jdk-headless)
have node || need+=(nodejs)
have npm || need+=(npm)
{ have puma && ls /usr/share/rubygems-integration/all/gems/rack-2*/lib/rack/method_override.rb >/dev/null 2>&1; } \
  || need+=(puma ruby-rack)
if [ ${#need[@]} -gt 0 ]; then
  echo "tests/setup/install.sh: installing from Debian: ${need[*]}" >&2
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif have sudo && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    echo "tests/setup/install.sh: the tests need ${need[*]}, and installing them needs root:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
    exit 1
  fi
  # No service starts at install: there is no init system to stop it again, and the
  # packages' defaults would take ports the tests or the machine use.
  policy=/usr/sbin/policy-rc.d
  made_policy=false
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${as_root[@]}" tee "$policy" >/dev/null
    "${as_root[@]}" chmod +x "$policy"
    made_policy=true
  fi
  trap '$made_policy && "${as_root[@]}" rm -f "$policy"' EXIT
  apt_get=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
  if ! "${apt_get[@]}" update -qq || ! "${apt_get[@]}" install -y -qq --no-install-recommends \
    "${need[@]}" >/dev/null; then
    echo "tests/setup/install.sh: could not install ${need[*]}; install them with:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
    exit 1
  fi
fi

# npm and PyPI, pinned; each script keeps what is in place at the pinned versions. A stamp of
# what they install from (scripts, lock files, apps) skips them when nothing changed.
stamp="$(cd "$repo" && find tests/setup tests/frameworks tests/sdks -type f -print0 | sort -z \
  | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$cache/installed" 2>/dev/null)" != "$stamp" ]; then
  rm -f "$cache/installed"
  bash "$repo/tests/frameworks/install.sh" "$cache/frameworks"
  bash "$repo/tests/sdks/install.sh" "$cache/sdks"
  echo "$stamp" > "$cache/installed"
fi

wants() { local c; for c in "${components[@]}"; do [ "$c" = "$1" ] && return 0; done; return 1; }
components=("$@")
for c in "${components[@]}"; do
  case "$c" in
    previous-release|browser) ;;
    *) echo "tests/setup/install.sh: no component $c (previous-release, browser)" >&2; exit 64 ;;
  esac
done

if wants browser; then
  bash "$here/browser.sh" "$cache/browser"
fi

if wants previous-release; then
  # The release tests/mixed_version.rs runs beside this one, built once per machine (no debug
  # information, no incremental cache) and kept for every later run and clone.
  previous="$(tr -d '[:space:]' < "$here/previous-release")"
  dir="$cache/previous-release/$previous"
  if [ ! -x "$dir/debug/idemgate" ]; then
    git -C "$repo" cat-file -e "$previous^{commit}" 2>/dev/null || {
      echo "tests/setup/install.sh: the release $previous is not in this clone's history (a shallow clone?); fetch it: git fetch --unshallow" >&2
      exit 1
    }
    echo "tests/setup/install.sh: building the release $previous for tests/mixed_version.rs (a few minutes, once)" >&2
    rm -rf "$dir"
    mkdir -p "$dir/src"
    git -C "$repo" archive "$previous" | tar -x -C "$dir/src"
    (cd "$dir/src" && env -u CARGO_TARGET_DIR CARGO_PROFILE_DEV_DEBUG=0 CARGO_INCREMENTAL=0 \
      "${CARGO:-cargo}" build --quiet --locked --bin idemgate --target-dir "$dir")
    rm -rf "$dir/src" "$dir/debug/deps" "$dir/debug/build" "$dir/debug/.fingerprint"
  fi
fi
echo "$cache"
