#!/usr/bin/env bash
# Fetch the llama.cpp sources vendored by the npm package llama.rn@0.12.9
# (llama.cpp build 10256, commit 6c8dcaa, MIT; ggml symbols renamed to lm_ggml)
# and extract its cpp/ folder to <dest>/cpp.
#
# Usage: scripts/fetch-llama-cpp.sh [dest]   (default: build/llama.cpp-src,
#        relative to the repository root)
#
# Uses `npm pack` only (the registry client); installs nothing. The tarball is
# checked against the sha512 below (== `npm view llama.rn@0.12.9 dist.integrity`,
# which is the same digest in base64). Idempotent: a stamp file holding the
# digest marks a finished extraction.
set -euo pipefail

PKG="llama.rn@0.12.9"
TARBALL="llama.rn-0.12.9.tgz"
SHA512="b91b13540469d4a9c3903834d05bce188acde9265f32a61525f08e77137d152c86b9f2c2f8069dea815665510ef2f9ad36abbe24196c0867af3f8b091a27c0be"
# base64 form, as the registry reports it:
# sha512-uRsTVARp1KnDkDg00FvOGIrN6SZfMqYVJfCOdxN9FSyGufLC+Aad6oFWZVEO8vmtNqu+JBlsCGevP4sJGifAvg==

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-build/llama.cpp-src}"
case "$DEST" in
    /*) ;;
    *) DEST="$ROOT/$DEST" ;;
esac
STAMP="$DEST/.fetched-llama.rn-0.12.9.sha512"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SHA512" ] && [ -f "$DEST/cpp/llama.h" ]; then
    echo "fetch-llama-cpp: $DEST/cpp already holds $PKG (stamp matches sha512); nothing to do."
    exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
    echo "fetch-llama-cpp: error: 'npm' not found. Install it first (Debian: apt-get install npm)." >&2
    exit 1
fi
for tool in tar sha512sum; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "fetch-llama-cpp: error: '$tool' not found." >&2
        exit 1
    fi
done

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "fetch-llama-cpp: npm pack $PKG ..."
(cd "$TMP" && npm pack "$PKG" --silent --no-audit --no-fund >/dev/null)
if [ ! -f "$TMP/$TARBALL" ]; then
    echo "fetch-llama-cpp: error: npm pack did not produce $TARBALL." >&2
    exit 1
fi

GOT="$(sha512sum "$TMP/$TARBALL" | cut -d' ' -f1)"
if [ "$GOT" != "$SHA512" ]; then
    echo "fetch-llama-cpp: error: sha512 mismatch for $TARBALL; refusing to extract." >&2
    echo "  expected $SHA512" >&2
    echo "  got      $GOT" >&2
    exit 1
fi
echo "fetch-llama-cpp: sha512 verified ($TARBALL, $(wc -c <"$TMP/$TARBALL") bytes)."

rm -rf "$DEST/cpp" "$STAMP"
mkdir -p "$DEST"
tar -xzf "$TMP/$TARBALL" -C "$TMP" package/cpp
mv "$TMP/package/cpp" "$DEST/cpp"
printf '%s\n' "$SHA512" >"$STAMP"
echo "fetch-llama-cpp: extracted $(find "$DEST/cpp" -type f | wc -l) files to $DEST/cpp"
