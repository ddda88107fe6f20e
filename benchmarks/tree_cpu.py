"""Where a command's wall time goes on a small machine: the command's process tree's CPU use (cores busy) every half
second, from its start to its end, and its wall time. On 2 cores a phase at 1.0 is one core idle (start-up, a serial
step), at 2.0 both busy; wall = (CPU in the busy phases) / cores + the serial phases.

    uv run python benchmarks/tree_cpu.py -- python -m anyfit prepare CFG data.num_proc=2 data.cache_dir=EMPTY
    uv run python benchmarks/tree_cpu.py -- python benchmarks/prep_floor.py MODEL_DIR DATA.jsonl

psutil reads each live process of the tree (the command and every descendant) at each sample; a process's CPU is
kept after it ends, so the sum never falls. The command's own output is discarded. A benchmark, not a test.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import psutil

SAMPLE_S = 0.5


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    start = time.monotonic()
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended: list[float] = []  # the wall time, once the command has ended (a thread waits for it: exact, not sampled)

    def wait() -> None:
        child.wait()
        ended.append(time.monotonic() - start)

    threading.Thread(target=wait, daemon=True).start()
    root = psutil.Process(child.pid)
    seen: dict[int, float] = {}  # pid -> CPU seconds at its last reading
    samples: list[tuple[float, float, int]] = []
    while not ended:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for proc in tree:
            try:
                times = proc.cpu_times()
                seen[proc.pid] = times.user + times.system
            except psutil.Error:
                pass
        samples.append((time.monotonic() - start, sum(seen.values()), len(tree)))
        time.sleep(SAMPLE_S)
    wall = ended[0]
    print(f"wall {wall:.2f} s, exit {child.returncode}, CPU of the tree at the last sample {sum(seen.values()):.1f} s")
    print("t (s): cores busy (processes)")
    print(" ".join(f"{a:.1f}:{(c1 - c0) / (b - a):.1f}({n})" for (a, c0, _), (b, c1, n) in itertools.pairwise(samples)))


if __name__ == "__main__":
    main()
