#!/usr/bin/env bash
# Installs the Debian 12 packages kvcache needs to build, test and benchmark (--ci: also the lint and
# fuzzing tools CI uses). Idempotent, and silent when everything is already there. Uses sudo when not run as
# root. Only Debian packages.
set -euo pipefail

packages=(
  g++ cmake ninja-build pkg-config          # toolchain
  libfmt-dev libcli11-dev nlohmann-json3-dev  # formatting, CLI, JSON output
  libxxhash-dev libzstd-dev                 # session file checksums, compression
  libhiredis-dev redis-server redis-tools   # the Redis block store (kvcache_redis), its tests and benchmark
  libgtest-dev libgmock-dev                 # tests
  libbenchmark-dev                          # benchmarks
  pybind11-dev python3-dev python3-numpy python3-pytest  # the Python package and its tests
  python3-pip python3-venv python3-setuptools python3-wheel  # `pip install .` offline (docs/python.md)
)
if [ "${1:-}" = --ci ]; then  # scripts/lint.sh, scripts/fuzz.sh, scripts/docs.sh
  packages+=(clang-format clang-tidy git clang-14 libclang-rt-14-dev doxygen)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
