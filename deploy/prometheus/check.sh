#!/usr/bin/env bash
# The alert rules load (`promtool check rules`), link to sections of docs/runbook.md that
# exist, and behave as their unit tests say (`promtool test rules alerts_test.yaml`). Installs Debian's `prometheus` package, which
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
# Every alert's runbook_url names a section of docs/runbook.md (`## AlertName`, whose
# anchor is the name in lower case).
alerts=$(grep -c '^ *- alert:' alerts.yaml)
anchors=$(grep -o 'runbook\.md#[a-z0-9-]*' alerts.yaml | cut -d'#' -f2)
if [ "$(echo "$anchors" | wc -l)" -ne "$alerts" ]; then
  echo "prometheus/check: $alerts alerts but $(echo "$anchors" | wc -l) runbook_url annotations" >&2
  exit 1
fi
for anchor in $anchors; do
  grep -qix "## $anchor" ../../docs/runbook.md \
    || { echo "prometheus/check: docs/runbook.md has no section for #$anchor" >&2; exit 1; }
done
promtool test rules alerts_test.yaml
echo "prometheus/check: alerts.yaml ok ($(promtool --version 2>&1 | head -n 1))"
