#!/usr/bin/env bash
# shellcheck disable=SC2016  # backticks in single quotes are Markdown, not command substitutions
# Checks that the documentation matches the tree, so that a doc cannot go stale silently (the ctest test
# docs.check runs it):
#
#   layout    every public header (include/kvcache/, runtime/, redis/) is named in README.md's Layout
#             table, in the row of its folder, and so is every docs/*.md and scripts/*.sh in theirs; every
#             file named in those rows exists
#   options   every option(KVC_...) of the CMake files is in README.md's "CMake options:" sentence, and
#             every KVC_ option named there exists
#   targets   docs/architecture.md's "Libraries and layers" table has a row per library or program the
#             build defines for the layers (CMakeLists.txt, cmake/, src/, tools/, python/; not INTERFACE
#             helpers nor aliases) and names no other; a count of build targets there, if any, is right
#   ranks     architecture.md's ranked list names every rank of KVC_INCLUDE_RANKS (cmake/layers.cmake)
#             and every header of each rank in its item, and only public headers; a count of layers in
#             README.md or architecture.md ("five layers") equals the layers of kvc_layer
#   decisions docs/design/decisions.md numbers its decisions D1..Dn without a gap (anchor and heading);
#             a range of decisions written in the docs (D1-D34, D1 to D34) names existing ones, and one
#             that starts at D1 ends at the last (except D1-D14, the original list, a fixed range)
#   paths     every path in backticks in README.md and docs/**/*.md that starts with include/ src/
#             tools/ tests/ scripts/ docs/ bench/ python/ examples/ cmake/ .ci/ exists (globs and
#             {a,b} must match something; placeholders such as <concept> or NAME are skipped), and
#             every relative link of those files points at a file or folder that exists
#   citations scripts/cite-design.sh --check
#
# Prints every problem as file:line: what, and exits 1; prints "check-docs: clean" otherwise. Needs git
# (it reads the tree from `git ls-files`): without git or outside a checkout it fails, unless
# KVC_DOCS_CHECK_OPTIONAL=1, which makes it skip (exit 0). Run from anywhere inside the repository.
set -euo pipefail

src=${BASH_SOURCE[0]}
[[ $src == */* ]] && here=${src%/*} || here=.
if ! command -v git >/dev/null 2>&1 || ! top=$(git -C "$here" rev-parse --show-toplevel 2>/dev/null); then
    echo "check-docs: needs git and a git checkout (the tree is read from git ls-files)" >&2
    if [[ ${KVC_DOCS_CHECK_OPTIONAL:-0} == 1 ]]; then
        echo "check-docs: skipped (KVC_DOCS_CHECK_OPTIONAL=1)" >&2
        exit 0
    fi
    exit 1
fi
cd "$top"

problems=()
problem() { problems+=("$1"); }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The tree: tracked and new (not ignored) files that exist in the working tree, and their folders ("x/").
git ls-files -co --exclude-standard | sort -u >"$tmp/listed"
git ls-files -d | sort -u >"$tmp/deleted"
comm -23 "$tmp/listed" "$tmp/deleted" >"$tmp/files"
awk -F/ '{ p = ""; for (i = 1; i < NF; i++) { p = p $i "/"; print p } }' "$tmp/files" | sort -u >"$tmp/dirs"
cat "$tmp/files" "$tmp/dirs" >"$tmp/tree"

readme=README.md
arch=docs/architecture.md
decisions=docs/design/decisions.md
layers=cmake/layers.cmake
mapfile -t docs < <(
    echo "$readme"
    grep -E '^docs/.*\.md$' "$tmp/files"
)

# Every span in backticks outside fenced code blocks, as "file<TAB>line<TAB>span".
spans() {
    local f
    for f in "$@"; do
        awk -v F="$f" '
            /^[ \t]*```/ { fence = !fence; next }
            !fence {
                s = $0
                while (match(s, /`[^`]+`/)) {
                    printf "%s\t%d\t%s\n", F, NR, substr(s, RSTART + 1, RLENGTH - 2)
                    s = substr(s, RSTART + RLENGTH)
                }
            }' "$f"
    done
}

number_of() {  # a count word or numeral as a number ("" if neither)
    case "${1,,}" in
        one) echo 1 ;; two) echo 2 ;; three) echo 3 ;; four) echo 4 ;; five) echo 5 ;; six) echo 6 ;;
        seven) echo 7 ;; eight) echo 8 ;; nine) echo 9 ;; ten) echo 10 ;; eleven) echo 11 ;; twelve) echo 12 ;;
        *) [[ $1 =~ ^[0-9]+$ ]] && echo "$1" || echo "" ;;
    esac
}
count_words='one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|[0-9]+'

# ---------------------------------------------------------------------------------------------------
# headers: README.md's Layout table, a row per folder of include/kvcache/ (`include/kvcache/`,
# `include/kvcache/runtime/`, ...) naming the folder's headers by file name (`gguf.h`); a header of a
# subfolder may also be named with its folder (`runtime/gguf.h`). version.h is generated from
# version.h.in and installed with the others.
{
    grep -E '^include/kvcache/.*\.h$' "$tmp/files"
    grep -E '^include/kvcache/.*\.h\.in$' "$tmp/files" | sed 's/\.in$//'
} | sed 's#^include/kvcache/##' | sort -u >"$tmp/headers"
awk -v R="$readme" '
    FILENAME == ARGV[1] { header[$0] = 1; order[++n] = $0; next }
    /^## Layout/ { layout = FNR }
    /^\| *`include\/kvcache\/[^`]*` *\|/ {
        rows++
        dir = $0; sub(/^\| *`include\/kvcache\//, "", dir); sub(/`.*/, "", dir)   # "" or "runtime/"
        row_of[dir] = FNR
        rest = $0; sub(/^\|[^|]*\|/, "", rest)
        while (match(rest, /`[A-Za-z0-9_.\/]+\.h`/)) {
            h = substr(rest, RSTART + 1, RLENGTH - 2); rest = substr(rest, RSTART + RLENGTH)
            rel = (h ~ /\//) ? h : dir h
            named[rel] = 1
            if (!(rel in header))
                printf "%s:%d: the Layout table names `%s`, but include/kvcache/%s does not exist\n", R, FNR, h, rel
        }
    }
    END {
        if (!rows) { printf "%s:%d: no row for `include/kvcache/` in the Layout table\n", R, layout + 0; exit }
        for (i = 1; i <= n; i++) {
            h = order[i]; if (h in named) continue
            dir = h; sub(/[^\/]*$/, "", dir)
            ln = (dir in row_of) ? row_of[dir] : layout
            printf "%s:%d: include/kvcache/%s is not named in the Layout table (row `include/kvcache/%s`)\n", R, ln, h, dir
        }
    }' "$tmp/headers" "$readme" >"$tmp/p_headers"
# The rows of docs/ and scripts/ in the same table name every document and every script of the folder
# (`architecture.md`, `lint.sh`), and only existing ones.
for spec in "docs/ md" "scripts/ sh"; do
    dir=${spec% *}
    ext=${spec#* }
    grep -E "^${dir}[^/]+\\.${ext}\$" "$tmp/files" | sed "s#^${dir}##" >"$tmp/layout_want" || true
    awk -v R="$readme" -v D="$dir" -v E="$ext" '
        FILENAME == ARGV[1] { want[$0] = 1; order[++n] = $0; next }
        FILENAME == ARGV[2] { have[$0] = 1; next }
        /^## Layout/ { layout = FNR }
        index($0, "| `" D "` |") == 1 {
            row = FNR
            rest = substr($0, length("| `" D "` |") + 1)
            while (match(rest, "`[A-Za-z0-9_./-]+\\." E "`")) {
                x = substr(rest, RSTART + 1, RLENGTH - 2); rest = substr(rest, RSTART + RLENGTH)
                if (index(x, D) == 1) x = substr(x, length(D) + 1)
                named[x] = 1
                if (!((D x) in have)) printf "%s:%d: the Layout table names `%s`, but %s%s does not exist\n", R, FNR, x, D, x
            }
        }
        END {
            if (!row) { printf "%s:%d: no row for `%s` in the Layout table\n", R, layout + 0, D; exit }
            for (i = 1; i <= n; i++)
                if (!(order[i] in named)) printf "%s:%d: %s%s is not named in the `%s` row of the Layout table\n", R, row, D, order[i], D
        }' "$tmp/layout_want" "$tmp/tree" "$readme" >>"$tmp/p_headers"
done
mapfile -t -O "${#problems[@]}" problems <"$tmp/p_headers"

# ---------------------------------------------------------------------------------------------------
# options: option(KVC_...) in the CMake files of the project (not examples/, which are built against the
# installed package, nor the build folders).
grep -E '^(CMakeLists\.txt|.*/CMakeLists\.txt|.*\.cmake)$' "$tmp/files" | grep -vE '^(examples|build[^/]*)/' \
    >"$tmp/cmake_files"
: >"$tmp/options"
while IFS= read -r f; do
    sed 's/#.*//' "$f" | grep -oE '\boption\( *KVC_[A-Z0-9_]+' | sed -E 's/.*(KVC_[A-Z0-9_]+)/\1/' >>"$tmp/options" || true
done <"$tmp/cmake_files"
sort -u -o "$tmp/options" "$tmp/options"
opt_line=$(grep -nE -m1 '^CMake options:' "$readme" | cut -d: -f1 || true)
if [[ -z $opt_line ]]; then
    problem "$readme:1: no \"CMake options:\" sentence"
else
    # the paragraph that starts there
    awk -v s="$opt_line" 'NR >= s { if ($0 ~ /^[ \t]*$/) exit; print }' "$readme" |
        grep -oE '\bKVC_[A-Z0-9_]+' | sort -u >"$tmp/options_named" || true
    comm -23 "$tmp/options" "$tmp/options_named" | while IFS= read -r o; do
        echo "$readme:$opt_line: CMake option $o is not in the \"CMake options:\" sentence"
    done >>"$tmp/p_options"
    comm -13 "$tmp/options" "$tmp/options_named" | while IFS= read -r o; do
        echo "$readme:$opt_line: the \"CMake options:\" sentence names $o, which no CMake file declares"
    done >>"$tmp/p_options"
fi
[[ -f $tmp/p_options ]] && mapfile -t -O "${#problems[@]}" problems <"$tmp/p_options"

# ---------------------------------------------------------------------------------------------------
# targets: what the build defines for the layers (the top-level CMakeLists.txt, cmake/, and the
# CMakeLists.txt of src/, tools/ and python/; tests, benchmarks, fuzz targets and examples are not layers).
: >"$tmp/targets"
while IFS= read -r f; do
    sed 's/#.*//' "$f" | tr '\n' ' ' |
        grep -oE '\b(add_library|add_executable|pybind11_add_module)\( *[A-Za-z0-9_:]+ +[A-Za-z0-9_${}]*' |
        awk '{ sub(/^[a-z0-9_]+\( */, ""); if ($2 != "INTERFACE" && $2 != "ALIAS" && $2 != "IMPORTED" && $1 !~ /[:$]/) print $1 }' \
            >>"$tmp/targets" || true
done < <(grep -E '^(CMakeLists\.txt|cmake/.*\.cmake|(src|tools|python)/(.*/)?CMakeLists\.txt)$' "$tmp/cmake_files")
sort -u -o "$tmp/targets" "$tmp/targets"

sec_start=$(grep -nE -m1 '^## Libraries and layers' "$arch" | cut -d: -f1 || true)
if [[ -z $sec_start ]]; then
    problem "$arch:1: no \"## Libraries and layers\" section"
else
    # the section: up to the next "## " heading
    awk -v s="$sec_start" 'NR > s && /^## / { exit } NR >= s { printf "%d\t%s\n", NR, $0 }' "$arch" >"$tmp/sec"
    # its first table: rows after the header and separator, "line<TAB>first cell"
    awk -F'\t' '
        $2 ~ /^\|/ { in_t = 1; n++; if (n > 2) { c = $2; sub(/^\|/, "", c); sub(/\|.*/, "", c); printf "%d\t%s\n", $1, c }; next }
        in_t { exit }' "$tmp/sec" >"$tmp/target_rows"
    rows=$(wc -l <"$tmp/target_rows")
    : >"$tmp/targets_named"
    while IFS=$'\t' read -r ln cell; do
        grep -oE '`[A-Za-z0-9_]+`' <<<"$cell" | tr -d '`' >>"$tmp/targets_named" || true
        first=$(grep -oE -m1 '`[^`]+`' <<<"$cell" | head -1 | tr -d '`' || true)
        grep -qxF -- "$first" "$tmp/targets" ||
            problem "$arch:$ln: the row's target \`$first\` is not a library or program the CMake files define"
    done <"$tmp/target_rows"
    while IFS= read -r t; do
        grep -qxF -- "$t" "$tmp/targets_named" ||
            problem "$arch:$sec_start: target $t (CMake) has no row in the \"Libraries and layers\" table"
    done <"$tmp/targets"
    # a count of build targets in the section's prose
    while IFS=$'\t' read -r ln text; do
        [[ $text == \|* ]] && continue
        while IFS= read -r w; do
            n=$(number_of "${w%% *}")
            [[ -n $n && $n != "$rows" ]] &&
                problem "$arch:$ln: \"$w\", but the table has $rows rows"
        done < <(grep -oiE "\\b($count_words) (build )?targets\\b" <<<"$text" || true)
    done <"$tmp/sec"
fi

# ---------------------------------------------------------------------------------------------------
# ranks: KVC_INCLUDE_RANKS against architecture.md's numbered list ("N. " items with their indented
# continuation lines).
awk '/^set\(KVC_INCLUDE_RANKS/ { on = 1; next } on && /^\)/ { exit }
     on { gsub(/^[ \t]*"|"[ \t]*$/, ""); print }' "$layers" >"$tmp/ranks"
[[ -s $tmp/ranks ]] || problem "$layers:1: no KVC_INCLUDE_RANKS"
awk '/^[0-9]+\. / { n = $1; sub(/\.$/, "", n); item = n; printf "%s\t%d\t%s\n", item, NR, $0; next }
     item != "" && /^   / { printf "%s\t%d\t%s\n", item, NR, $0; next }
     { item = "" }' "$arch" >"$tmp/rank_items"
list_line=$(head -1 "$tmp/rank_items" | cut -f2)
: "${list_line:=1}"
while read -r rank rest; do
    if ! grep -qE "^$rank	" "$tmp/rank_items"; then
        problem "$arch:$list_line: rank $rank of KVC_INCLUDE_RANKS ($layers) is not in the ranked list"
        continue
    fi
    item_line=$(grep -E "^$rank	" "$tmp/rank_items" | head -1 | cut -f2)
    grep -E "^$rank	" "$tmp/rank_items" | cut -f3- | grep -oE '`[^`]+`' | tr -d '`' >"$tmp/item_spans" || true
    for h in $rest; do
        grep -qxF -e "$h" -e "${h##*/}" -e "include/kvcache/$h" "$tmp/item_spans" ||
            problem "$arch:$item_line: rank $rank's item does not name \`${h##*/}\` ($h, in KVC_INCLUDE_RANKS)"
    done
done <"$tmp/ranks"
cut -f1 "$tmp/ranks" -d' ' >"$tmp/rank_numbers"
while IFS=$'\t' read -r item ln text; do
    grep -qxF -- "$item" "$tmp/rank_numbers" ||
        problem "$arch:$ln: item $item of the ranked list is not a rank of KVC_INCLUDE_RANKS ($layers)"
    while IFS= read -r h; do
        h=${h#include/kvcache/}
        if ! grep -qxF -- "$h" "$tmp/headers" && ! grep -qE "(^|/)${h//./\\.}$" "$tmp/headers"; then
            problem "$arch:$ln: the ranked list names \`$h\`, which is not a public header"
        fi
    done < <(grep -oE '`[A-Za-z0-9_./]+\.h`' <<<"$text" | tr -d '`' || true)
done <"$tmp/rank_items"

# a count of the layers (kvc_layer's layers: core, runtime, redis, capi, python) in the prose that
# describes them; elsewhere "layers" are a model's
n_layers=$(grep -cE 'layer STREQUAL "[a-z]+"' "$layers" || true)
for f in "$readme" "$arch"; do
    while IFS=: read -r ln text; do
        while IFS= read -r w; do
            n=$(number_of "${w%% *}")
            [[ -n $n && $n != "$n_layers" ]] &&
                problem "$f:$ln: \"$w\", but $layers has $n_layers (kvc_layer)"
        done < <(grep -oiE "\\b($count_words) layers\\b" <<<"$text" || true)
    done < <(grep -niE "\\b($count_words) layers\\b" "$f" || true)
done

# ---------------------------------------------------------------------------------------------------
# decisions: anchors <a id="dN"></a> each followed by the heading "### DN.", numbered 1..n.
awk '/<a id="d[0-9]+"><\/a>/ { match($0, /id="d[0-9]+"/); a = substr($0, RSTART + 5, RLENGTH - 6); al = NR; next }
     /^#+ D[0-9]+\./ { match($0, /D[0-9]+/); d = substr($0, RSTART + 1, RLENGTH - 1)
                      printf "%d\t%s\t%s\n", NR, d, (al == NR - 1 ? a : "") }' "$decisions" >"$tmp/decisions"
last_d=0
expect=1
while IFS=$'\t' read -r ln d a; do
    [[ $a == "$d" ]] || problem "$decisions:$ln: heading D$d has no <a id=\"d$d\"></a> on the line above"
    [[ $d == "$expect" ]] || problem "$decisions:$ln: D$d follows D$((expect - 1)) (decisions are numbered 1, 2, ... without a gap)"
    expect=$((d + 1))
    ((d > last_d)) && last_d=$d
done <"$tmp/decisions"
((last_d > 0)) || problem "$decisions:1: no decision headings (\"### D1. ...\")"
# Ranges written in the docs. D1-D14 is the original decision list (docs/design/README.md): numbers are
# never reused, so that range is fixed and may stay.
fixed_ranges=" 1-14 "
for f in "${docs[@]}"; do
    while IFS=: read -r ln text; do
        while IFS= read -r r; do
            lo=$(grep -oE '[0-9]+' <<<"$r" | head -1)
            hi=$(grep -oE '[0-9]+' <<<"$r" | tail -1)
            if ((lo < 1 || hi > last_d || lo >= hi)); then
                problem "$f:$ln: \"$r\", but $decisions has D1 to D$last_d"
            elif ((lo == 1 && hi != last_d)) && [[ $fixed_ranges != *" $lo-$hi "* ]]; then
                problem "$f:$ln: \"$r\" stops short of D$last_d, the last decision in $decisions"
            fi
        done < <(grep -oE '\bD[0-9]+ ?(-|–|—|to|\.\.) ?D[0-9]+\b' <<<"$text" || true)
    done < <(grep -nE '\bD[0-9]+ ?(-|–|—|to|\.\.) ?D[0-9]+\b' "$f" || true)
done

# ---------------------------------------------------------------------------------------------------
# paths in backticks. Allowed on purpose ("file path"): paths in other trees, not in this one.
allowed=(
    "docs/sim.md tools/server"            # llama.cpp's server, in llama.cpp's tree
    "docs/op-scripts.md tools/llama-peer" # the llama.cpp peer of the workplace, outside this repository
)
printf '%s\n' "${allowed[@]}" >"$tmp/allowed"
spans "${docs[@]}" >"$tmp/spans"
# One pass: the tree and the allowlist first, then each span. A path becomes an extended regular
# expression: * and ** are globs, ? one character; {a,b} gives one path per alternative, each checked.
awk -F'\t' '
    FILENAME == ARGV[1] { tree[$0] = 1; list[++n] = $0; next }
    FILENAME == ARGV[2] { allowed[$0] = 1; next }
    {
        f = $1; ln = $2; span = $3
        p = span; sub(/ .*/, "", p)                       # a command: its first word
        if (p !~ /^(include|src|tools|tests|scripts|docs|bench|python|examples|cmake|\.ci)(\/|$)/) next
        sub(/:[0-9].*$/, "", p)                           # file:line
        sub(/[,;.)]$/, "", p)
        # placeholders: <concept>, NAME, FILE, DIR, ..., variables
        if (p ~ /[<>$]|\.\.\.|…/ || p ~ /(^|\/)(NAME|FILE|DIR|PREFIX|TARGET)(\.|\/|$)/) next
        if ((f " " p) in allowed) next
        q = p; sub(/\/$/, "", q)
        # {a,b}: each alternative must match on its own
        k = 0
        if (match(q, /\{[^{}]*\}/)) {
            pre = substr(q, 1, RSTART - 1); post = substr(q, RSTART + RLENGTH)
            m = split(substr(q, RSTART + 1, RLENGTH - 2), alts, ",")
            for (j = 1; j <= m; j++) cand[++k] = pre alts[j] post
        } else cand[++k] = q
        for (j = 1; j <= k; j++) {
            c = cand[j]
            if ((c in tree) || ((c "/") in tree)) continue
            re = c
            gsub(/[][.+()|^$\\]/, "\\\\&", re)
            gsub(/\*\*/, "\001", re); gsub(/\*/, "[^/]*", re); gsub(/\001/, ".*", re); gsub(/\?/, "[^/]", re)
            re = "^" re "/?$"
            found = 0
            for (i = 1; i <= n && !found; i++) if (list[i] ~ re) found = 1
            if (!found) { printf "%s:%s: `%s`: no such path in the repository%s\n", f, ln, span, (c == q ? "" : " (" c ")"); break }
        }
    }' "$tmp/tree" "$tmp/allowed" "$tmp/spans" >"$tmp/p_paths"
mapfile -t -O "${#problems[@]}" problems <"$tmp/p_paths"

# relative links, [text](path) or [text](path#anchor), from the linking file's folder; links inside
# code spans are examples, not links
for f in "${docs[@]}"; do
    awk -v F="$f" '
        /^[ \t]*```/ { fence = !fence; next }
        !fence {
            s = $0; gsub(/`[^`]*`/, "", s)
            while (match(s, /\]\([^) ]+\)/)) {
                printf "%s\t%d\t%s\n", F, NR, substr(s, RSTART + 2, RLENGTH - 3); s = substr(s, RSTART + RLENGTH)
            }
        }' "$f"
done | awk -F'\t' '
    FILENAME == ARGV[1] { tree[$0] = 1; next }
    {
        link = $3; sub(/#.*/, "", link)
        if (link == "" || link ~ /^[a-z]+:/) next
        d = $1; sub(/\/?[^\/]*$/, "", d)
        t = (d == "" ? "" : d "/") link
        # normalise "./" and "a/../"
        n = split(t, parts, "/"); m = 0
        for (i = 1; i <= n; i++) {
            if (parts[i] == "." || parts[i] == "") continue
            if (parts[i] == ".." && m > 0) { m--; continue }
            out[++m] = parts[i]
        }
        t = ""; for (i = 1; i <= m; i++) t = t (i > 1 ? "/" : "") out[i]
        if (!(t in tree) && !((t "/") in tree)) printf "%s:%s: link (%s): no such file in the repository\n", $1, $2, $3
    }' "$tmp/tree" - >"$tmp/p_links"
mapfile -t -O "${#problems[@]}" problems <"$tmp/p_links"

# ---------------------------------------------------------------------------------------------------
# citations of the design notes
if ! bash scripts/cite-design.sh --check >"$tmp/cite" 2>&1; then
    while IFS= read -r l; do problem "cite-design: $l"; done <"$tmp/cite"
fi

if ((${#problems[@]})); then
    printf '%s\n' "${problems[@]}"
    echo "check-docs: ${#problems[@]} problem(s) (above)" >&2
    exit 1
fi
echo "check-docs: clean"
