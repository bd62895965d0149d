#!/usr/bin/env bash
# Installs pulsar-tap with everything it needs into ./.venv (safe to run again).
#   bash scripts/setup.sh
# Python packages come pinned from pyproject.toml; system tools (a JDK for Spark
# and the real peers, Maven) come from Debian's packages when missing.  The real
# peers of the tests (tests/peers/: Apache Pulsar's broker and proxy, the Java and
# Go clients) are resolved with Maven and the Go toolchain into the git-ignored
# tests/peers/.resolved/, each part again only when its pinned inputs change.
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
    # wait for another package manager (an unattended upgrade, a second setup) to finish
    local wait=(-o DPkg::Lock::Timeout=600)
    $sudo apt-get "${wait[@]}" update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get "${wait[@]}" install -y -qq "$@" >/dev/null
}

need=()
command -v javac >/dev/null 2>&1 || need+=(openjdk-17-jdk-headless)  # Spark, the real broker, the Java client
command -v mvn >/dev/null 2>&1 || need+=(maven)                       # resolves tests/peers/pom.xml
command -v haproxy >/dev/null 2>&1 || need+=(haproxy)             # bench/proxy.py baseline
command -v tshark >/dev/null 2>&1 || need+=(tshark)               # pcap export check
command -v chromium >/dev/null 2>&1 || need+=(chromium)           # sequence-diagram screenshot check
if [ ${#need[@]} -gt 0 ]; then apt_install "${need[@]}"; fi

# --- the real peers (tests/peers/) -------------------------------------------------------
peers=tests/peers
resolved=$peers/.resolved
mkdir -p "$resolved"

# build_part NAME INPUT... -- COMMAND...: runs COMMAND unless the inputs' hash is the one
# stamped by its last successful run (so an unchanged part costs nothing)
build_part() {
    local name=$1; shift
    local inputs=()
    while [ "$1" != "--" ]; do inputs+=("$1"); shift; done; shift
    local stamp="$resolved/.$name.stamp" want
    want=$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    echo "setup: building the real peers: $name" >&2
    rm -f "$stamp"
    "$@"
    echo "$want" > "$stamp"
}

resolve_maven_profile() {  # PROFILE DIR: the profile's jars (transitively) into DIR
    rm -rf "$2.new"
    # (Maven's quiet mode still prints colour resets: only real messages pass)
    mvn -B -q -f "$peers/pom.xml" -P "$1" dependency:copy-dependencies -DoutputDirectory="$PWD/$2.new" \
        2>&1 | sed -e 's/\x1b\[[0-9;]*m//g' | grep -v '^$' >&2 || [ "${PIPESTATUS[0]}" = 0 ]
    rm -rf "$2" && mv "$2.new" "$2"
}

build_java_client() {
    rm -rf "$resolved/java-client" && mkdir -p "$resolved/java-client"
    javac -nowarn -d "$resolved/java-client" -cp "$resolved/client-lib/*" "$peers/java-client/PeerClient.java"
}

build_go_client() {
    command -v go >/dev/null 2>&1 || { echo "setup: the Go toolchain (1.24 or later) is needed for tests/peers/go-client" >&2; exit 1; }
    (cd "$peers/go-client" && go build -o ../.resolved/go-client.new .) && mv "$resolved/go-client.new" "$resolved/go-client"
}

build_part broker "$peers/pom.xml" -- resolve_maven_profile broker "$resolved/broker-lib"
build_part client "$peers/pom.xml" -- resolve_maven_profile client "$resolved/client-lib"
build_part java-client "$peers/pom.xml" "$peers/java-client/PeerClient.java" -- build_java_client
build_part go-client "$peers/go-client/go.mod" "$peers/go-client/go.sum" "$peers/go-client/main.go" -- build_go_client

# --- compiled modules (mypyc) --------------------------------------------------------------
# A few pure, typed modules are compiled with mypyc (part of the pinned mypy; gcc and the Python
# headers are needed) into C extensions next to their sources, git-ignored.  Each package's
# mypyc.stamp lists the sha256 of the sources its extensions were built from: Python runs the
# source instead of a stale build (proxy/compiled.py), and this step rebuilds only when a
# source, or the installed packages, changed (another mypy compiles differently).
# group_stamp DIR PATH...: DIR's mypyc.stamp when its members of the group PATH... are current
group_stamp() {
    local dir=$1 path installed; shift
    installed=$(cat "$stamp")
    (cd "$dir" && sha256sum $(for path in "$@"; do [ "$(dirname "$path")" = "$dir" ] && basename "$path"; done) \
        && echo "$installed  (installed packages)")
}
# mypyc_group NAME PATH...: compile the modules at PATHs into one extension, the shared library
# NAME__mypyc beside the package NAME names (a shim per module beside its source): calls between
# them are C calls, not Python calls.  Each package's stamp lists its members, and one stale
# member runs the whole group from source (proxy/compiled.py).  A module compiled alone is a
# group of one named after it.
mypyc_group() {
    local name=$1; shift
    local library="${name//.//}__mypyc" dir dirs stale=0 log=build/mypyc.log
    dirs=$(for path in "$@"; do dirname "$path"; done | sort -u)
    for dir in $dirs; do
        [ -f "$dir/mypyc.stamp" ] && [ "$(cat "$dir/mypyc.stamp")" = "$(group_stamp "$dir" "$@")" ] || stale=1
    done
    compgen -G "$library.*.so" >/dev/null || stale=1
    [ "$stale" = 1 ] || return 0
    echo "setup: compiling with mypyc into one extension, $library: $*" >&2
    mkdir -p build
    # (unlinked first, not overwritten: a process still running the old build keeps its copy)
    for path in "$@"; do
        rm -f "$(dirname "$path")/mypyc.stamp" "${path%.py}".*.so "${path%.py}__mypyc".*.so
    done
    rm -f "$library".*.so
    printf '%s\n' "import sys" "from setuptools import setup" "from mypyc.build import mypycify" \
        "setup(name='$name', ext_modules=mypycify(sys.argv.pop(1).split(), group_name='$name'))" \
        > build/mypyc_group.py
    .venv/bin/python build/mypyc_group.py "$*" build_ext --inplace >"$log" 2>&1 \
        || { cat "$log" >&2; echo "setup: mypyc failed on the group $name" >&2; exit 1; }
    for dir in $dirs; do group_stamp "$dir" "$@" > "$dir/mypyc.stamp"; done
}

mypyc_group proxy.analytics.decode proxy/analytics/decode.py
mypyc_group proxy.rules.sampling proxy/rules/sampling.py
# telemetry's per message: the walk of the SENDs and receipts it takes in bulk, the latency histogram's record
mypyc_group proxy.telemetry.message_lane proxy/telemetry/bulk_forms.py proxy/telemetry/histogram_cells.py
# the relay's lane: what runs per relayed read (the reactor's hop, its socket calls, the pipeline,
# the header scanner and its walk of the plain command forms), one extension
mypyc_group proxy.relay_lane proxy/server/hop.py proxy/server/plain_socket.py proxy/core/pipeline.py \
    proxy/core/scanner.py proxy/protocol/plain_forms.py
