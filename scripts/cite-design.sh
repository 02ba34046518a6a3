#!/usr/bin/env bash
# Rewrites citations of the project's old research notes ("decision 9", "spec kv-core §3.5",
# "spec batch-recurrent §4.5", "spec §4.7", "spec kv-core B.6", ...) into citations of the design notes
# in docs/design/ ("design D9", "design/kv-cache.md §3.5", "design/recurrent.md §4.5", ...), in every
# .cpp, .h, .c, .ops and .md file of the repository except docs/design/ itself. Idempotent: the new forms
# match none of the rules. docs/design/README.md explains the forms.
#
#   scripts/cite-design.sh           rewrite, then check
#   scripts/cite-design.sh --check   only check: list citations of documents that are not in the
#                                    repository and design citations without a target; exit 1 if any
#
# Run from anywhere inside the repository.
set -euo pipefail

cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null || echo "$(dirname "$0")/..")"
design=docs/design

files() {
    find . \( -path ./.git -o -path './build*' -o -path "./$design" \) -prune -o -type f \
        \( -name '*.cpp' -o -name '*.h' -o -name '*.c' -o -name '*.ops' -o -name '*.md' \) -print0
}

# Rules, applied in this order (GNU sed, extended regular expressions). batch-recurrent's §1-3 are
# batch.md's, its §4-5 recurrent.md's; a bare "spec §N" has always meant batch-recurrent.
rules=$(cat <<'EOF'
s/\bdecisions ([0-9]+) and ([0-9]+)\b/design D\1 and D\2/g
s/\bDecisions ([0-9]+) and ([0-9]+)\b/Design D\1 and D\2/g
s/\bdecision ([0-9]+)\b/design D\1/g
s/\bDecision ([0-9]+)\b/Design D\1/g
s/\b[Ss]pec kv-core Appendix B\b/design\/kv-cache.md Appendix B/g
s/\b[Ss]pec kv-core (B\.[0-9]+)/design\/kv-cache.md \1/g
s/\b[Ss]pec Appendix B\b/design\/kv-cache.md Appendix B/g
s/^\/\/\/ kv_cache_iswa: interleaved sliding-window attention \(llama.cpp's llama_kv_cache_iswa, spec kv-core §8\)$/\/\/\/ kv_cache_iswa: interleaved sliding-window attention (llama_kv_cache_iswa, design\/kv-cache.md §8)/
s/\b[Ss]pec kv-core §/design\/kv-cache.md §/g
s/\b[Ss]pec batch-recurrent §([123])([^0-9]|$)/design\/batch.md §\1\2/g
s/\b[Ss]pec batch-recurrent §([45])([^0-9]|$)/design\/recurrent.md §\1\2/g
s/\b[Ss]pec §([123])([^0-9]|$)/design\/batch.md §\1\2/g
s/\b[Ss]pec §([45])([^0-9]|$)/design\/recurrent.md §\1\2/g
s/^([ ]*)(EXPECT_EQ\(decode\(m, .*\);)  \/\/ primaries 2,3 then 0,1 \(§3\.5\)$/\1\/\/ primaries 2,3 then 0,1 (design\/batch.md §3.5)\n\1\2/
s/then 0,1 \(§3\.5\)/then 0,1 (design\/batch.md §3.5)/g
s/\bspec opscript(\.md)?/docs\/op-scripts.md/g
s/I1-I4 of the spec\b/I1-I4 of design\/recurrent.md §4.2/g
s/with the spec's recommendations applied/with the recommendations of the design notes applied/g
EOF
)

rewrite() {
    local f before
    local -a changed=()
    while IFS= read -r -d '' f; do
        if grep -qE '[Dd]ecisions? [0-9]|[Ss]pec |§' "$f"; then
            before=$(sha1sum <"$f")
            sed -i -E "$rules" "$f"
            [[ $(sha1sum <"$f") == "$before" ]] || { echo "rewrote $f"; changed+=("$f"); }
        fi
    done < <(files)
    echo "${#changed[@]} file(s) rewritten"
    # Longer citations can push a comment past the column limit: let clang-format (as scripts/lint.sh
    # runs it) rewrap the C and C++ files that changed.
    local -a code=()
    for f in "${changed[@]}"; do [[ $f == *.h || $f == *.cpp || $f == *.c ]] && code+=("$f"); done
    if ((${#code[@]})); then
        if command -v clang-format >/dev/null; then
            clang-format -i "${code[@]}"
            # a citation the rewrap split ("design/x.md" | "/// §8") moves whole to the next line
            for _ in 1 2 3; do
                perl -0pi -e 's{ (design/[a-z-]+\.md)\n([ \t]*//[/!<]?) §}{\n$2 $1 §}g' "${code[@]}"
                clang-format -i "${code[@]}"
            done
            echo "clang-format: ${#code[@]} file(s) formatted"
        else
            echo "cite-design: clang-format not found; run it on the rewritten sources" >&2
        fi
    fi
}

check() {
    local bad=0 f line
    # 1. citations of documents that are not in the repository: what is left once the valid forms are
    #    taken out of each line
    while IFS= read -r -d '' f; do
        while IFS= read -r line; do
            local rest
            rest=$(sed -E 's#design/(kv-cache|batch|recurrent)\.md\)? §[0-9][0-9.-]*(, §[0-9][0-9.-]*)*##g' <<<"${line#*:}")
            if grep -qE '\b[Dd]ecisions? [0-9]|\b[Ss]pec (kv-core|batch-recurrent|opscript|Appendix|§)|§[0-9]|DESIGN\.md|\b[Tt]he specs?\b|\bspecs\b|\bspec.s\b' <<<"$rest"; then
                echo "$f:$line"
                bad=1
            fi
        done < <(grep -nE '[Dd]ecisions? [0-9]|[Ss]pec|§|DESIGN\.md' "$f" || true)
    done < <(files)
    # 2. design citations whose target does not exist
    local n
    while IFS= read -r n; do
        grep -q "<a id=\"d$n\"></a>" "$design/decisions.md" || { echo "no decision D$n in $design/decisions.md"; bad=1; }
    done < <(files | xargs -0 grep -ohE '[Dd]esign D[0-9]+( and D[0-9]+)?|decisions\.md#d[0-9]+' | grep -oE '[0-9]+' | sort -un)
    local cite note sec
    while IFS= read -r cite; do
        note=${cite%% *}
        while IFS= read -r sec; do
            sec=${sec%%-*}
            sec=${sec%.}
            grep -qE "^#+ §${sec//./\\.}( |$)" "docs/$note" || { echo "no §$sec in docs/$note"; bad=1; }
        done < <(grep -oE '§[0-9][0-9.-]*' <<<"$cite" | tr -d '§')
    done < <(files | xargs -0 grep -ohE 'design/(kv-cache|batch|recurrent)\.md\)? §[0-9][0-9.-]*(, §[0-9][0-9.-]*)*' |
        tr -d ')' | sort -u)
    while IFS= read -r cite; do
        grep -qE "^\*\*${cite//./\\.} " "$design/kv-cache.md" || { echo "no $cite in $design/kv-cache.md"; bad=1; }
    done < <(files | xargs -0 grep -ohE 'design/kv-cache\.md\)? B\.[0-9]+' | grep -oE 'B\.[0-9]+' | sort -u)
    if ((bad)); then
        echo "cite-design: citations without a target (above)" >&2
        return 1
    fi
    echo "cite-design: every citation has a target"
}

case "${1:-}" in
    --check) check ;;
    "") rewrite && check ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
