#!/usr/bin/env bash
# Installs pulsar-tap with everything it needs into ./.venv (safe to run again).
#   bash scripts/setup.sh
# Python packages come pinned from pyproject.toml; system tools (a Java runtime
# for Spark) come from Debian's packages when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi

stamp=.venv/.pulsar-tap-installed
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing Python packages into .venv" >&2
    # (pip's notes about unused local package folders are noise here: filtered)
    .venv/bin/python -m pip install --quiet -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -c "import proxy, pulsar, pyspark" || { echo "setup: installation failed" >&2; exit 1; }
    echo "$want" > "$stamp"
fi

apt_install() {
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
            echo "setup: please install Debian packages: $*" >&2; return 0; fi
    fi
    echo "setup: installing Debian packages: $*" >&2
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

need=()
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)   # Spark (pulsar-tap analyze)
command -v haproxy >/dev/null 2>&1 || need+=(haproxy)             # bench/proxy.py baseline
command -v tshark >/dev/null 2>&1 || need+=(tshark)               # pcap export check
command -v chromium >/dev/null 2>&1 || need+=(chromium)           # sequence-diagram screenshot check
if [ ${#need[@]} -gt 0 ]; then apt_install "${need[@]}"; fi
