#!/usr/bin/env python3
"""Groups sources by the flags they compile with, for scripts/lint.sh.

Usage: tidy_groups.py COMPILE_COMMANDS OUT_DIR < sources (paths relative to the repository, one per line)

Sources compiled with the same command (one build target) become one file, OUT_DIR/group_N.cpp, that
includes each of them; OUT_DIR/compile_commands.json gives every group its target's command, and every
source its own (for lint.sh's file-by-file fallback). OUT_DIR/groups.tsv lists each group, a tab, then
its sources. A source missing from the database is a group of its own (clang-tidy infers its command); a
target built in unity batches is found through them.
"""
import json
import os
import shlex
import sys


def main() -> int:
    db_path, out_dir = sys.argv[1], sys.argv[2]
    with open(db_path, encoding="utf-8") as f:
        db = json.load(f)
    by_file = {os.path.realpath(e["file"]): e for e in db}
    # a target built in unity batches (CMake's UNITY_BUILD) lists its batches, not its sources: each source
    # a batch includes compiles with the batch's command
    for e in db:
        if "/Unity/unity_" in e["file"]:
            with open(e["file"], encoding="utf-8") as f:
                for line in f:
                    if line.startswith('#include "'):
                        by_file.setdefault(os.path.realpath(line.split('"')[1]), e)
    os.makedirs(out_dir, exist_ok=True)

    groups: dict[tuple[str, str], list[str]] = {}
    singles: list[str] = []
    for line in sys.stdin:
        rel = line.strip()
        if not rel:
            continue
        path = os.path.realpath(rel)
        entry = by_file.get(path)
        if entry is None:
            singles.append(path)
            continue
        # the command without its output and input: the same for every source of a target
        args = shlex.split(entry["command"])
        flags, skip = [], False
        for a in args:
            if skip:
                skip = False
            elif a in ("-o", "-c"):
                skip = True
            elif os.path.realpath(os.path.join(entry["directory"], a)) != os.path.realpath(entry["file"]):
                flags.append(a)
        groups.setdefault((entry["directory"], shlex.join(flags)), []).append(path)

    out_db, rows = list(db), []
    for i, ((directory, flags), files) in enumerate(sorted(groups.items())):
        group = os.path.realpath(os.path.join(out_dir, f"group_{i}.cpp"))
        with open(group, "w", encoding="utf-8") as f:
            f.write("// Sources of one build target, checked together (scripts/lint.sh).\n")
            f.write("// NOLINTBEGIN(bugprone-suspicious-include)\n")
            f.writelines(f'#include "{p}"\n' for p in files)
            f.write("// NOLINTEND(bugprone-suspicious-include)\n")
        out_db.append({"directory": directory, "command": f"{flags} -c {shlex.quote(group)}", "file": group})
        rows.append([group, *files])
    rows += [[p, p] for p in singles]
    with open(os.path.join(out_dir, "compile_commands.json"), "w", encoding="utf-8") as f:
        json.dump(out_db, f, indent=1)
    with open(os.path.join(out_dir, "groups.tsv"), "w", encoding="utf-8") as f:
        f.writelines("\t".join(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
