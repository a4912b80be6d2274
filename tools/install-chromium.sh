#!/usr/bin/env bash
# Installs headless Chromium from the distribution's packages when it is missing: the report
# page's browser test (crates/pipewright-cli/tests/report.rs) renders the page with it.
# Debian/Ubuntu; runs apt-get as root or through sudo.
set -euo pipefail
if command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null; then
  exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium-headless-shell ||
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium
