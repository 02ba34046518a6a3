#!/usr/bin/env bash
# Installs the Debian 12 packages kvcache needs. Idempotent, and silent when everything is already there.
# Uses sudo when not run as root. Only Debian packages.
#   scripts/install-deps.sh --demo  what `./kvc demo` needs: the compiler and the libraries kvcache builds on
#   scripts/install-deps.sh         also the tests, benchmarks and Python package (`./kvc test`)
#   scripts/install-deps.sh --ci    also the lint, fuzzing and documentation tools CI uses
# redis-server is for the tests, each of which starts its own on a free port: when this script installs
# it, it disables and stops the system service Debian starts with the package, so no daemon is left behind.
set -euo pipefail
profile=${1:---test}
case "$profile" in
  --demo | --test | --ci) ;;
  *) echo "install-deps: unknown option '$profile' (expected --demo, --test or --ci)" >&2; exit 2 ;;
esac

packages=(
  g++ cmake ninja-build pkg-config          # toolchain
  libfmt-dev libcli11-dev nlohmann-json3-dev  # formatting, CLI, JSON output
  libxxhash-dev libzstd-dev                 # session file checksums, compression
  libhiredis-dev                            # the Redis block store (kvcache_redis)
)
if [ "$profile" != --demo ]; then
  packages+=(
    libgtest-dev libgmock-dev make          # tests (make: examples/c's Makefile)
    redis-server redis-tools                # the Redis store's tests and benchmark
    libbenchmark-dev                        # benchmarks
    pybind11-dev python3-dev python3-numpy python3-pytest  # the Python package and its tests
    python3-pip python3-venv python3-setuptools python3-wheel  # `pip install .` offline (docs/python.md)
  )
fi
if [ "$profile" = --ci ]; then  # scripts/lint.sh, scripts/fuzz.sh, scripts/docs.sh
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
# apt's own output is long; what it sets up is enough to see it move (errors and warnings still show).
echo "install-deps: installing ${#missing[@]} Debian packages and what they need (about a minute the" \
  "first time): ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q | sed -un 's/^\(Err\|W\|E\):/install-deps: &/p'
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" |
  sed -un 's/^Setting up \([^ ]*\).*/install-deps: set up \1/p; s/^\(E\|W\):/install-deps: &/p'
for p in "${missing[@]}"; do
  if [ "$p" = redis-server ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    "${sudo[@]}" systemctl disable --now redis-server >/dev/null 2>&1 || true
    echo "install-deps: the tests start their own redis-server; Debian's redis-server service is disabled" \
      "and stopped (systemctl enable --now redis-server turns it back on)"
  fi
done
echo "install-deps: done in ${SECONDS} s"
