#!/usr/bin/env bash
# Chromium for the dashboard's browser test (tests/test_dashboard.py drives it with Playwright's
# Python package; `playwright install` is never needed). `make test` runs this script.
#
# Does nothing when a Chromium is already there: $CHROMIUM (an executable; the test uses it too),
# or `chromium` on PATH. Otherwise installs Debian's `chromium` package SYSTEM-WIDE with apt-get
# (as root, or through sudo): on Debian 12 about 155 MB to download and 480 MB on disk (115
# packages with fonts and libraries, measured with `apt-get install --print-uris chromium`).
# Without a Chromium the browser test is skipped and everything else still runs.
set -euo pipefail
if [ -n "${CHROMIUM:-}" ]; then
  if [ -x "$CHROMIUM" ]; then
    echo "chromium: using CHROMIUM=$CHROMIUM"
    exit 0
  fi
  echo "CHROMIUM=$CHROMIUM is not an executable" >&2
  exit 1
fi
if found=$(command -v chromium); then
  echo "chromium: already installed at $found"
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi
echo "chromium: installing Debian's chromium system-wide with apt-get (~155 MB download, ~480 MB on disk);" \
  "to skip, install a Chromium yourself or set CHROMIUM=/path/to/chromium" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium  # with its recommended fonts: screenshots need them
command -v chromium
