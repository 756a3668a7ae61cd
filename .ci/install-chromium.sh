#!/usr/bin/env bash
# Chromium for the dashboard's browser test (tests/test_dashboard.py drives it with Playwright's
# Python package and executable_path=/usr/bin/chromium; `playwright install` is never needed).
# Idempotent: does nothing when chromium is already there. Debian/Ubuntu, as root or with sudo.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium  # with its recommended fonts: screenshots need them
command -v chromium
