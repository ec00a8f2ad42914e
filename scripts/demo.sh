#!/usr/bin/env bash
# Set the machine up (scripts/setup.sh: packages, Rust, release build), then run `unbroken demo`
# (checkpoint mode, embedded default). The demo builds network namespaces, so the binary runs as
# root: directly when we are root, through sudo otherwise. Extra arguments go to the demo
# (e.g. --json, --crashes app,host,guard, --ipv6).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" >&2   # keep stdout for the demo (one JSON object with --json)
BIN="$ROOT/target/release/unbroken"
if [ "$(id -u)" -eq 0 ]; then
    exec "$BIN" demo "$@"
elif command -v sudo >/dev/null 2>&1; then
    exec sudo "$BIN" demo "$@"
else
    echo "[demo] needs root (network namespaces) and there is no sudo: run this script as root" >&2
    exit 1
fi
