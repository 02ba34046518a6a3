"""kvcache sim's default output fits 100 columns with plain headers; --wide adds the serving and memory
columns. Usage: sim_width.py KVCACHE WORKDIR"""
import os
import subprocess
import sys

kvcache, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
base = ["sim", "--generate", "multi-turn", "--groups", "6", "--prompts", "4", "--budget", "60%"]
runs = {
    "kv": [],
    "hybrid": ["--memory", "hybrid"],
    "iswa": ["--memory", "iswa", "--window", "128"],
    "instances and a tier": ["--instances", "2", "--tier", "disk:" + os.path.join(work, "tier"), "--policy",
                             "kvcache"],
}
for name, extra in runs.items():
    out = subprocess.run([kvcache] + base + extra, capture_output=True, text=True, check=True).stdout
    widest = max(out.splitlines(), key=len)
    assert len(widest) <= 100, f"{name}: a line of {len(widest)} characters: {widest!r}"
    assert "hit rate" in out and "prefill tokens" in out and "pk/end" not in out, f"{name}:\n{out}"
wide = subprocess.run([kvcache] + base + ["--wide"], capture_output=True, text=True, check=True).stdout
assert "committed pk/end" in wide and "wait mean/max" in wide, wide
print("sim_width: the default tables fit 100 columns; --wide has every column")
