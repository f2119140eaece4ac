#!/usr/bin/env bash
# Installs the real frameworks that tests/frameworks.rs puts behind idemgate, pinned, from
# the registries: Express 5, Fastify 5, Koa 3 and Koa 2 with @koa/router 13 (npm, with their
# lock files), Flask 3.1 and Starlette 1.10 under uvicorn, uvicorn with httptools and Tornado
# (PyPI), and Debian's Jetty 9.4 (libjetty9-java, the library half of the jetty9 package).
# Node's own `http` and Debian's Puma with Rack (tests/setup/install.sh) need nothing here
# but their apps, under wire/. Usage: install.sh DIR.
# Idempotent: what DIR already holds at the pinned versions is kept.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?usage: install.sh DIR}"
mkdir -p "$dir"

if [ ! -f "$dir/express/node_modules/express/package.json" ] \
  || ! cmp -s "$here/express/package-lock.json" "$dir/express/package-lock.json"; then
  rm -rf "$dir/express"
  mkdir -p "$dir/express"
  cp "$here/express/package.json" "$here/express/package-lock.json" "$dir/express/"
  (cd "$dir/express" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
cp "$here/express/app.js" "$dir/express/app.js"

if [ ! -f "$dir/flask/requirements.txt" ] \
  || ! cmp -s "$here/flask/requirements.txt" "$dir/flask/requirements.txt"; then
  rm -rf "$dir/flask"
  mkdir -p "$dir/flask/site"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --root-user-action=ignore --target "$dir/flask/site" -r "$here/flask/requirements.txt"
  cp "$here/flask/requirements.txt" "$dir/flask/requirements.txt"
fi
cp "$here/flask/app.py" "$dir/flask/app.py"

if [ ! -f /usr/share/java/jetty9-server.jar ] || [ ! -f /usr/share/java/servlet-api-3.1.jar ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends libjetty9-java libservlet3.1-java >/dev/null
fi
command -v javac >/dev/null || {
  echo "install.sh: javac (a JDK) is needed to build the Jetty servlet" >&2
  exit 1
}
jars=""
for j in jetty9-server jetty9-servlet jetty9-http jetty9-io jetty9-util jetty9-security servlet-api-3.1; do
  jars="$jars:/usr/share/java/$j.jar"
done
jars="${jars#:}"
mkdir -p "$dir/jetty/classes"
javac -nowarn -cp "$jars" -d "$dir/jetty/classes" "$here/jetty/Transfers.java"
echo "$dir/jetty/classes:$jars" > "$dir/jetty/classpath"

# Fastify 5 and Koa 3 (npm, with their lock files) and Starlette 1.10 under uvicorn (PyPI):
# the parameterised handlers of tests/frameworks.rs.
for app in fastify koa koa2; do
  if [ ! -d "$dir/$app/node_modules" ] \
    || ! cmp -s "$here/$app/package-lock.json" "$dir/$app/package-lock.json"; then
    rm -rf "$dir/$app"
    mkdir -p "$dir/$app"
    cp "$here/$app/package.json" "$here/$app/package-lock.json" "$dir/$app/"
    (cd "$dir/$app" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
  fi
  cp "$here/$app/app.js" "$dir/$app/app.js"
done

if [ ! -f "$dir/starlette/requirements.txt" ] \
  || ! cmp -s "$here/starlette/requirements.txt" "$dir/starlette/requirements.txt"; then
  rm -rf "$dir/starlette"
  mkdir -p "$dir/starlette/site"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --root-user-action=ignore --no-deps --target "$dir/starlette/site" \
    -r "$here/starlette/requirements.txt"
  cp "$here/starlette/requirements.txt" "$dir/starlette/requirements.txt"
fi
cp "$here/starlette/app.py" "$dir/starlette/app.py"

# The peers of tests/peers_wire.rs: uvicorn with httptools and Tornado (PyPI, pinned), and the
# apps for them, Node's own `http` and Puma.
if [ ! -f "$dir/wire/requirements.txt" ] \
  || ! cmp -s "$here/wire/requirements.txt" "$dir/wire/requirements.txt"; then
  rm -rf "$dir/wire"
  mkdir -p "$dir/wire/site"
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --root-user-action=ignore --no-deps --target "$dir/wire/site" \
    -r "$here/wire/requirements.txt"
  cp "$here/wire/requirements.txt" "$dir/wire/requirements.txt"
fi
cp "$here/wire/node_framing.js" "$here/wire/uvicorn_framing.py" "$here/wire/tornado_app.py" \
  "$here/wire/config.ru" "$dir/wire/"
