"""kvcache demo as a user pipes it: each line arrives as it is printed (stdout is line-buffered even into
a pipe), and the session file the demo saves is kept where --session says, for `kvcache inspect`.
Usage: demo_output.py KVCACHE WORKDIR"""
import os
import subprocess
import sys

kvcache, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
session = os.path.join(work, "demo.kvc")
if os.path.exists(session):
    os.remove(session)

def run_demo():
    """The demo's whole output, and what of it had arrived when its title line came."""
    demo = subprocess.Popen([kvcache, "demo", "--session", session], stdout=subprocess.PIPE)
    fd = demo.stdout.fileno()
    early = b""
    while b"\n" not in early:  # the title line
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        early += chunk
    # What else is in the pipe now: the demo runs for seconds after its title line, so line by line its
    # end is not there yet; block-buffered, the whole report arrives in one write when it ends.
    os.set_blocking(fd, False)
    try:
        early += os.read(fd, 1 << 20)
    except BlockingIOError:
        pass
    os.set_blocking(fd, True)
    rest = (early + demo.stdout.read()).decode()
    demo.wait()
    assert demo.returncode == 0 and "cache == recompute" in rest, rest
    return rest, early


# A reader held off the CPU for the whole demo would see everything at once too: three tries.
for attempt in range(3):
    rest, early = run_demo()
    if b"cache == recompute" not in early:
        break
assert rest.startswith("kvcache"), f"first line: {rest[:80]!r}"
assert b"cache == recompute" not in early, "the demo's report arrived all at once at its end (stdout not flushed per line)"
assert f"kept in {session}" in rest, rest
assert os.path.isfile(session), f"{session} missing"
assert not [f for f in os.listdir(work) if f.startswith("demo.kvc.")], os.listdir(work)

inspect = subprocess.run([kvcache, "inspect", session], capture_output=True, text=True)
assert inspect.returncode == 0, inspect.stderr
print(inspect.stdout)
print("demo_output: lines arrive as printed; the session file is kept and inspect reads it")
