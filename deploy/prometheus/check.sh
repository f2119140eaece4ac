#!/usr/bin/env bash
# The alert rules load (`promtool check rules`) and behave as their unit tests say
# (`promtool test rules alerts_test.yaml`). Installs Debian's `prometheus` package, which
# ships promtool, when promtool is missing. tests/observability.rs runs promtool as well
# (the dashboard's expressions must parse), so .ci/run calls this before the tests.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v promtool >/dev/null 2>&1; then
  echo "prometheus/check: installing prometheus (for promtool)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq prometheus >/dev/null
fi

promtool check rules alerts.yaml
promtool test rules alerts_test.yaml
echo "prometheus/check: alerts.yaml ok ($(promtool --version 2>&1 | head -n 1))"
