#!/usr/bin/env python3
"""Runs the code blocks of the docs (the ctest test docs.snippets), so that none goes stale silently.

    python3 scripts/doc_snippets.py BUILD_DIR [-j N] [--keep] [--werror] [-v] [DOC.md ...]

Every fenced block tagged ```python, ```c or ```cpp in README.md and docs/**/*.md runs, with the compilers,
options and libraries of BUILD_DIR (read from its CMakeCache.txt):

  python  The python blocks of one Markdown file run in order in one interpreter session (the build's
          Python, the build's package on PYTHONPATH, a fresh temporary working directory): a block may use
          the names an earlier block defined, as doctest does.
  c, cpp  A block that defines main is a program: compiled against the build's libraries and run (exit
          status 0). Any other block goes into a harness, a file the doc names that holds the includes and
          the objects the block uses; the block replaces the harness's lines `// SNIPPET` (or
          `/* SNIPPET */`), one per block that names the harness, in the doc's order, and the program is
          compiled and run.

An HTML comment right before a block (blank lines may come between) says how it runs:

  <!-- snippet: harness tests/doc_snippets/NAME.c -->   C/C++: in that harness (see above)
  <!-- snippet: prelude                                 python: code run in the session before the block
  cache = kvcache.KVCache(...)                          (setup the reader does not need to see)
  -->
  <!-- snippet: same as docs/examples/NAME.cpp -->      the block is that file, character for character
                                                        (the file is built and run by its own ctest test)
  <!-- snippet: not run (why) -->                       skipped, and the reason printed

A python block without a comment simply runs; a C/C++ block without main and without a harness, a
failing block, a block that differs from its file and a malformed comment all fail the run. Failures show
the doc file and line (compiler messages and Python tracebacks point into the doc itself) and the output.
Python blocks are skipped, saying so, when the build has no Python package (KVC_BUILD_PYTHON=OFF, or a
sanitizer build), and blocks that use kvcache_redis when the build has none (KVC_BUILD_REDIS=OFF).

Prints one line per block and a summary ("doc-snippets: N run, ... skipped"); exits 1 if anything failed.
Standard library only.
"""
import argparse
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAGS = {"python", "c", "cpp"}
FENCE = re.compile(r"^( {0,3})(`{3,})\s*([A-Za-z0-9_+-]*)\s*$")
MAIN = re.compile(r"^\s*int\s+main\s*\(", re.M)
SLOT = re.compile(r"^\s*(//\s*SNIPPET|/\*\s*SNIPPET\s*\*/)\s*$")
TIMEOUT = 120  # seconds, per compile, per program and per Python session


class Block:
    def __init__(self, doc, line, tag, code):
        self.doc, self.line, self.tag, self.code = doc, line, tag, code  # line: the first line of code
        self.mode = None    # "python", "program", "harness", "same", "skip"
        self.arg = None     # harness or file path, skip reason, python prelude (text, first line)
        self.status = None  # "ran", "same", "skipped", "failed"
        self.note = ""
        self.output = ""

    def where(self):
        return f"{self.doc}:{self.line - 1}"  # the fence line


def rel(path):
    return os.path.relpath(path, ROOT)


# ---------------------------------------------------------------------------------------------------
# Markdown: blocks and their comments


def parse_doc(path, errors):
    """The tagged blocks of a Markdown file, each with the mode its comment asks for."""
    doc = rel(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks = []
    pending = None  # (first line, comment text) of a snippet comment not yet followed by a block
    i = 0
    while i < len(lines):
        text = lines[i]
        if text.lstrip().startswith("<!--") and re.match(r"\s*<!--\s*snippet\b", text):
            start = i
            while "-->" not in lines[i] and i + 1 < len(lines):
                i += 1
            body = "\n".join(lines[start:i + 1])
            if pending:
                errors.append(f"{doc}:{pending[0] + 1}: snippet comment not followed by a code block")
            pending = (start, body)
            i += 1
            continue
        m = FENCE.match(text)
        if m:
            indent, ticks, tag = len(m.group(1)), m.group(2), m.group(3)
            j = i + 1
            while j < len(lines) and not re.match(r"^ {0,3}" + ticks + r"\s*$", lines[j]):
                j += 1
            code = "\n".join(ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1:j]) + "\n"
            if tag in TAGS:
                b = Block(doc, i + 2, tag, code)
                if pending:
                    read_comment(b, pending)
                blocks.append(b)
            elif pending:
                errors.append(f"{doc}:{pending[0] + 1}: snippet comment before a block tagged '{tag}' "
                              f"(only {', '.join(sorted(TAGS))} blocks run)")
            pending = None
            i = j + 1
            continue
        if pending and text.strip():
            errors.append(f"{doc}:{pending[0] + 1}: snippet comment not followed by a code block")
            pending = None
        i += 1
    if pending:
        errors.append(f"{doc}:{pending[0] + 1}: snippet comment not followed by a code block")
    for b in blocks:
        if b.mode is None:
            if b.tag == "python":
                b.mode = "python"
            elif MAIN.search(b.code):
                b.mode = "program"
            else:
                b.mode = "failed"
                b.status, b.note = "failed", "no main and no harness (<!-- snippet: harness FILE --> or not run)"
    return blocks


def read_comment(b, pending):
    """Sets the block's mode from the snippet comment before it; a bad comment fails the block."""
    start, body = pending
    inner = re.sub(r"^\s*<!--\s*snippet\s*:?\s*", "", body, count=1)
    inner = re.sub(r"\s*-->\s*$", "", inner)
    first, _, rest = inner.partition("\n")
    first = first.strip()
    m_skip = re.fullmatch(r"not run\s*(?:\((.+)\)|:\s*(.+))", inner.strip(), re.S)
    problem = None
    if m_skip:
        b.mode, b.arg = "skip", " ".join((m_skip.group(1) or m_skip.group(2)).split())
    elif first.startswith("harness ") and not rest.strip():
        b.mode, b.arg = "harness", first.split(None, 1)[1]
        if b.tag == "python":
            problem = "a harness is for C/C++ blocks (python blocks take a prelude)"
        elif not os.path.isfile(os.path.join(ROOT, b.arg)):
            problem = f"harness {b.arg}: no such file"
    elif first.startswith("same as ") and not rest.strip():
        b.mode, b.arg = "same", first.split(None, 2)[2]
        if not os.path.isfile(os.path.join(ROOT, b.arg)):
            problem = f"same as {b.arg}: no such file"
    elif first == "prelude" and rest.strip():
        b.mode, b.arg = "python", (rest, start + 2)
        if b.tag != "python":
            problem = "a prelude is for python blocks (C/C++ blocks take a harness)"
    else:
        problem = ("unknown snippet comment: want 'not run (why)', 'harness FILE', 'same as FILE', or 'prelude' "
                   "and code")
    if problem:
        b.mode, b.status, b.note = "failed", "failed", f"{b.doc}:{start + 1}: {problem}"


# ---------------------------------------------------------------------------------------------------
# The build


def read_cache(build_dir):
    cache = {}
    path = os.path.join(build_dir, "CMakeCache.txt")
    with open(path, encoding="utf-8") as f:
        for ln in f:
            m = re.match(r"^([A-Za-z0-9_.+-]+):[A-Z_]+=(.*)$", ln.rstrip("\n"))
            if m:
                cache[m.group(1)] = m.group(2)
    return cache


def on(cache, name, default=False):
    v = cache.get(name)
    if v is None:
        return default
    return v.upper() not in ("", "0", "OFF", "NO", "FALSE", "N", "IGNORE", "NOTFOUND") and not v.endswith("-NOTFOUND")


class Build:
    def __init__(self, build_dir):
        self.dir = os.path.abspath(build_dir)
        c = read_cache(self.dir)
        self.cxx = c.get("CMAKE_CXX_COMPILER") or "c++"
        self.cc = c.get("CMAKE_C_COMPILER") or c.get("KVC_C_COMPILER") or "cc"
        self.shared = on(c, "KVC_BUILD_SHARED", True)
        self.redis = on(c, "KVC_BUILD_REDIS", True)
        self.werror = on(c, "KVC_WERROR")
        sanitize, tsan, fuzz = on(c, "KVC_SANITIZE"), on(c, "KVC_SANITIZE_THREAD"), on(c, "KVC_BUILD_FUZZ")
        self.python = c.get("Python_EXECUTABLE") or "python3"
        if not on(c, "KVC_BUILD_PYTHON", True):
            self.no_python = "KVC_BUILD_PYTHON is OFF in this build"
        elif sanitize or tsan or fuzz:
            self.no_python = "a sanitizer build has no Python package"
        else:
            self.no_python = None
        self.python_dir = os.path.join(self.dir, "python")
        # the build's flags for programs that link the library (as the examples': tests/CMakeLists.txt)
        self.flags = ["-Wall", "-Wextra", "-Wpedantic"] + (["-Werror"] if self.werror else [])
        self.link = []
        if sanitize:
            self.flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
            self.link += ["-fsanitize=address,undefined"]
        if tsan:
            self.flags += ["-fsanitize=thread"]
            self.link += ["-fsanitize=thread"]
        self.clang = "clang" in os.path.basename(self.cxx)
        self.sanitize = sanitize
        self.includes = ["-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(self.dir, "include")]

    def library(self, name):
        ext = ".so" if self.shared else ".a"
        path = os.path.join(self.dir, "lib" + name + ext)
        return path if os.path.exists(path) else None

    def libraries(self, redis):
        """The link line's libraries, or a reason why there are none."""
        names = ["kvcache_runtime"] + (["kvcache_redis"] if redis else []) + ["kvcache"]
        paths = []
        for n in names:
            p = self.library(n)
            if p is None:
                return None, f"lib{n}{'.so' if self.shared else '.a'} is not in {self.dir} (build the target {n})"
            paths.append(p)
        extra = []
        if self.shared:
            extra.append("-Wl,-rpath," + self.dir)
        else:
            extra += (["-lhiredis"] if redis else []) + ["-lfmt", "-lxxhash", "-lzstd", "-lstdc++", "-lm", "-pthread"]
        return paths + extra, None


# ---------------------------------------------------------------------------------------------------
# C and C++


def line_directive(n, path):
    return f'#line {n} "{path}"\n'


def c_units(blocks):
    """Translation units to compile and run: (name, lang, source, [blocks])."""
    units, harnesses = [], {}
    for b in blocks:
        if b.tag not in ("c", "cpp") or b.status:
            continue
        if b.mode == "program":
            units.append([f"{b.doc}:{b.line}", b.tag, line_directive(b.line, b.doc) + b.code, [b]])
        elif b.mode == "harness":
            harnesses.setdefault(b.arg, []).append(b)
    for path, bs in harnesses.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            lines = f.read().split("\n")
        slots = [i for i, ln in enumerate(lines) if SLOT.match(ln)]
        tags = {b.tag for b in bs}
        lang = "c" if path.endswith(".c") else "cpp"
        if len(slots) != len(bs) or tags != {lang}:
            why = (f"{path} has {len(slots)} SNIPPET line(s) and {len(bs)} block(s) name it"
                   if len(slots) != len(bs) else f"{path} is {lang}, the block is {'/'.join(sorted(tags))}")
            for b in bs:
                b.status, b.note = "failed", why
            continue
        out = []
        prev = 0
        for slot, b in zip(slots, bs):
            out += [line_directive(prev + 1, path)] + [ln + "\n" for ln in lines[prev:slot]]
            out += [line_directive(b.line, b.doc), b.code]
            prev = slot + 1
        out += [line_directive(prev + 1, path)] + [ln + "\n" for ln in lines[prev:]]
        units.append([path, lang, "".join(out), bs])
    return units


def run_unit(unit, build, work):
    name, lang, source, bs = unit
    redis = "kvcache/redis/" in source
    if redis and not build.redis:
        return "skipped", "uses kvcache_redis: KVC_BUILD_REDIS is OFF in this build", ""
    libs, why = build.libraries(redis)
    if libs is None:
        return "failed", why, ""
    d = tempfile.mkdtemp(prefix="unit-", dir=work)
    src = os.path.join(d, "snippet." + lang)
    with open(src, "w", encoding="utf-8") as f:
        f.write(source)
    exe = os.path.join(d, "snippet")
    includes = build.includes + (["-I" + os.path.join(ROOT, os.path.dirname(name))] if bs[0].mode == "harness" else [])
    if lang == "c":
        cmd = [build.cc, "-std=c11"] + build.flags + includes + [src, "-o", exe] + libs + build.link
        if build.sanitize and build.clang:
            cmd += ["-fsanitize-link-c++-runtime", "-lstdc++"]
    else:
        cmd = [build.cxx, "-std=c++20"] + build.flags + includes + [src, "-o", exe] + libs + build.link
    try:
        p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return "failed", f"compiling took more than {TIMEOUT} s", ""
    if p.returncode != 0:
        return "failed", "does not compile", "$ " + " ".join(cmd) + "\n" + p.stdout
    try:
        r = subprocess.run([exe], cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return "failed", f"ran for more than {TIMEOUT} s", ""
    if r.returncode != 0:
        return "failed", f"exit status {r.returncode}", p.stdout + r.stdout
    return "ran", "harness " + name if len(bs) > 1 or bs[0].mode == "harness" else "program", r.stdout


# ---------------------------------------------------------------------------------------------------
# Python

DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
env = {"__name__": "__main__"}
for i, b in enumerate(blocks):
    try:
        for code, path, line in b:
            exec(compile("\n" * (line - 1) + code, path, "exec"), env)
    except BaseException as e:
        sys.stdout.flush()
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the doc's frame on
        sys.stderr.flush()
        print("\n@@doc-snippet %d failed" % i, flush=True)
        sys.exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    print("\n@@doc-snippet %d ok" % i, flush=True)
"""


def run_python(doc, bs, build, work):
    """Runs the python blocks of one doc in one session; sets each block's status."""
    d = tempfile.mkdtemp(prefix="python-", dir=work)
    todo = []
    for b in bs:
        parts = []
        if b.arg:
            prelude, line = b.arg
            parts.append([prelude, os.path.join(ROOT, b.doc), line])
        parts.append([b.code, os.path.join(ROOT, b.doc), b.line])
        todo.append(parts)
    with open(os.path.join(d, "blocks.json"), "w", encoding="utf-8") as f:
        json.dump(todo, f)
    with open(os.path.join(d, "driver.py"), "w", encoding="utf-8") as f:
        f.write(DRIVER)
    env = dict(os.environ)
    env["PYTHONPATH"] = build.python_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    run_dir = os.path.join(d, "cwd")
    os.mkdir(run_dir)
    try:
        p = subprocess.run([build.python, os.path.join(d, "driver.py"), os.path.join(d, "blocks.json")],
                           cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=TIMEOUT)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
    pieces = re.split(r"\n?@@doc-snippet (\d+) (ok|failed)\n", out)
    done = {}
    for k in range(1, len(pieces) - 1, 3):
        done[int(pieces[k])] = (pieces[k + 1], pieces[k - 1])
    tail = pieces[-1]
    for i, b in enumerate(bs):
        if i in done:
            state, text = done[i]
            b.status, b.output = ("ran", text) if state == "ok" else ("failed", text)
            b.note = "python session" if state == "ok" else "raised"
        elif any(done.get(k, ("",))[0] == "failed" for k in range(i)):
            b.status, b.note = "failed", "not reached (an earlier block of the session failed)"
        else:
            b.status = "failed"
            b.note = (f"the session ran for more than {TIMEOUT} s" if rc is None else
                      f"the interpreter exited with status {rc}")
            b.output, tail = tail, ""


# ---------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir", help="a configured and built build tree (CMakeCache.txt, libkvcache)")
    ap.add_argument("docs", nargs="*", help="Markdown files (default: README.md and docs/**/*.md)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2, help="compiles at once")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (sources, programs)")
    ap.add_argument("--werror", action="store_true", help="warnings are errors (default: as KVC_WERROR)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the output of every block that ran")
    args = ap.parse_args()
    t0 = time.monotonic()
    build = Build(args.build_dir)
    if args.werror and "-Werror" not in build.flags:
        build.flags.append("-Werror")

    docs = [os.path.abspath(d) for d in args.docs] or (
        [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)))
    errors, blocks = [], []
    for d in docs:
        blocks += parse_doc(d, errors)

    work = tempfile.mkdtemp(prefix="kvc-doc-snippets-")
    try:
        for b in blocks:
            if b.mode == "skip":
                b.status, b.note = "skipped", b.arg
            elif b.mode == "same":
                with open(os.path.join(ROOT, b.arg), encoding="utf-8") as f:
                    same = f.read() == b.code
                b.status = "same" if same else "failed"
                b.note = f"same as {b.arg}" if same else f"differs from {b.arg} (copy the file into the block)"
            elif b.mode == "python" and build.no_python:
                b.status, b.note = "skipped", build.no_python
            elif b.mode == "python" and not glob.glob(os.path.join(build.python_dir, "kvcache", "_kvcache*")):
                b.status, b.note = "failed", f"no Python module in {build.python_dir} (build the target kvcache_python)"
        units = c_units(blocks)
        py_docs = {}
        for b in blocks:
            if b.mode == "python" and not b.status:
                py_docs.setdefault(b.doc, []).append(b)
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            py_jobs = [pool.submit(run_python, doc, bs, build, work) for doc, bs in py_docs.items()]
            c_jobs = {pool.submit(run_unit, u, build, work): u for u in units}
            for job, u in c_jobs.items():
                status, note, output = job.result()
                for b in u[3]:
                    b.status, b.note, b.output = status, note, output
            for job in py_jobs:
                job.result()
    finally:
        if args.keep:
            print(f"doc-snippets: sources and programs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    shown = set()
    for b in blocks:
        print(f"{b.where()}: {b.tag}: {b.status} ({b.note})" if b.note else f"{b.where()}: {b.tag}: {b.status}")
        if args.verbose and b.status == "ran" and b.output.strip() and id(b.output) not in shown:
            shown.add(id(b.output))  # a harness's output once
            print("    " + b.output.rstrip().replace("\n", "\n    "))
    failed = [b for b in blocks if b.status == "failed"]
    printed = {}
    for b in failed:
        print(f"\n---- {b.where()}: {b.tag} block failed: {b.note}")
        if id(b.output) in printed:  # the blocks of one harness share one program
            print(f"(one program with {printed[id(b.output)]}: its output is above)")
        elif b.output.strip():
            printed[id(b.output)] = b.where()
            print(b.output.rstrip())
    for e in errors:
        print(e)
    count = {s: sum(b.status == s for b in blocks) for s in ("ran", "same", "skipped", "failed")}
    reasons = sorted({b.note for b in blocks if b.status == "skipped"})
    print(f"\ndoc-snippets: {count['ran']} run, {count['same']} identical to a file a test runs, "
          f"{count['skipped']} skipped, {count['failed']} failed, {len(errors)} comment error(s) "
          f"({len(blocks)} blocks, {time.monotonic() - t0:.1f} s)")
    for r in reasons:
        print(f"  skipped: {r} ({sum(b.status == 'skipped' and b.note == r for b in blocks)})")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
