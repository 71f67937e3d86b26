#!/usr/bin/env bash
# The peer channel's loopback ratio on a lent many-core machine, in one call that fits a session's
# device time (issues: the peer port's security, point 1; the race at any disk's speed, point 5).
#
# That machine reaches no package registry and comes with its own Python (3.12 and a CUDA torch so
# far), so the wheels the benches need beyond torch are fetched here first:
#
#   bash bench/device_peer.sh prepare          # here: wheels for CPython 3.10-3.13 into .bench-wheels/
#   bash bench/device_peer.sh run              # there, with carry [".bench-wheels"]: prints and saves
#                                              # every result under $OUT (or ./device-out)
#
# `run` installs the wheels into a scratch directory (nothing system-wide), prints the machine, then
# runs bench/peer_channel.py at 4 flows (5 runs) and 8 flows (3 runs), 2 GiB in 8 files, plain and
# protected interleaved, then bench/peer_open.py (a receiving worker's two orders of opening and
# writing a frame) and bench/peer_seal.py --beside (a sending worker's batches in two buffers against
# a frame-sized one), each bounded by its own timeout so that one slow bench leaves the next one its
# time. About 7-9 minutes on 16 cores. GIB=0.25 makes a quick check of the script itself.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.bench-wheels
PACKAGES=(aiohttp cryptography google-crc32c prometheus-client boto3)

prepare() {
    rm -rf "$WHEELS"
    for version in 3.10 3.11 3.12 3.13; do
        python3 -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version "$version" \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            "${PACKAGES[@]}"
    done
    du -sh "$WHEELS"
}

run() {
    local out=${OUT:-device-out} deps
    mkdir -p "$out"
    deps=$(mktemp -d)
    python3 -m pip install --quiet --no-index --find-links "$WHEELS" --target "$deps" "${PACKAGES[@]}"
    export PYTHONPATH="$PWD:$deps"
    {
        date -u
        python3 -V
        nproc
        python3 -c "import torch; print('torch', torch.__version__)"
        git log --oneline -1 2>/dev/null || true
    } | tee "$out/machine.txt"
    timeout 270 python3 bench/peer_channel.py --gib "${GIB:-2}" --files 8 --runs 5 --connections 4 2>&1 | tee "$out/peer-4.txt" || echo "4 flows: exit $?"
    cp bench/results/peer_channel.json "$out/peer-4.json" 2>/dev/null || true
    timeout 180 python3 bench/peer_channel.py --gib "${GIB:-2}" --files 8 --runs 3 --connections 8 2>&1 | tee "$out/peer-8.txt" || echo "8 flows: exit $?"
    cp bench/results/peer_channel.json "$out/peer-8.json" 2>/dev/null || true
    timeout 60 python3 bench/peer_open.py --gib "${GIB:-1}" --runs 5 2>&1 | tee "$out/peer-open.txt" || echo "open: exit $?"
    cp bench/results/peer_open.json "$out/peer-open.json" 2>/dev/null || true
    timeout 60 python3 bench/peer_seal.py --gib "${GIB:-1}" --runs 5 --beside 2>&1 | tee "$out/peer-seal.txt" || echo "seal: exit $?"
    cp bench/results/peer_seal.json "$out/peer-seal.json" 2>/dev/null || true
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
*)
    echo "usage: bash bench/device_peer.sh prepare|run" >&2
    exit 2
    ;;
esac
