"""Where ``anyfit prepare``'s CPU goes, process by process (issue 55, part 4): every process of the command (the
parent, the fork server, each worker) under cProfile, and the CPU seconds of the whole tree, without the profiler,
against ``benchmarks/prep_floor.py``'s on the same records.

    uv run python benchmarks/prep_profile.py --rows 50000 --num-proc 2
    uv run python benchmarks/prep_profile.py --stages 6144      # the workers' work, stage by stage, in one process
    (--work: data_scale.py's folder, whose data, tokenizer and config it reuses; --runs N: unprofiled CPU runs;
    --hooked floor,prepare: the commands run once more with each process's CPU seconds printed)

The hook lives only here: a ``sitecustomize.py`` written into a temporary folder put first on the children's
PYTHONPATH. It starts cProfile when the interpreter starts, restarts it in every process ``multiprocessing``
forks (the fork server's workers: ``multiprocessing.util.register_after_fork``), and writes one .prof per process
when it ends (atexit, or multiprocessing's own exit finalizers in a forked worker). anyfit is run unchanged.

Unprofiled CPU: the ``RUSAGE_CHILDREN`` of this process before and after each command, which counts every process
of the tree once it is reaped. The fork server outlives the command for a moment and is reparented; this process
makes itself the subreaper of its descendants (Linux ``PR_SET_CHILD_SUBREAPER``), so it is reparented here and
reaped, with the workers it reaped.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_scale import ROOT, child_env, dataset, tiny_model, tokenizer_dir, write_config

HOOK = '''
import atexit, cProfile, os, sys, time
_DIR = os.environ.get("PREP_PROFILE_DIR")
if _DIR:
    class _Holder:
        prof = None

    _HOLDER = _Holder()

    def _dump(role):
        with open(os.path.join(_DIR, f"{role}-{os.getpid()}.cpu"), "w") as f:
            t = os.times()
            f.write(str(t.user + t.system - _HOLDER.cpu0))
        prof = _HOLDER.prof
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.path.join(_DIR, f"{role}-{os.getpid()}.prof"))
            _HOLDER.prof = None

    def _start(role):
        t = os.times()
        _HOLDER.cpu0 = t.user + t.system if role == "worker" else 0.0  # a forked worker: its own CPU only
        if os.environ.get("PREP_PROFILE_CPU_ONLY"):
            return
        _HOLDER.prof = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
        _HOLDER.prof.enable()

    _start("main")
    # The command's own process is the first to start; any other interpreter (the fork server) is its child.
    _ROLE = "child" if os.environ.get("PREP_PROFILE_MAIN") else "main"
    os.environ["PREP_PROFILE_MAIN"] = str(os.getpid())
    atexit.register(_dump, _ROLE)

    def _after_fork(holder):
        import multiprocessing.util as mu
        if holder.prof is not None:
            holder.prof.disable()
        _start("worker")
        mu.Finalize(None, _dump, args=("worker",), exitpriority=0)

    import multiprocessing.util as _mu
    _mu.register_after_fork(_HOLDER, _after_fork)
'''


def cpu_of(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall, user + system CPU of the whole process tree, max RSS of one process in GiB) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    while True:  # the fork server, orphaned when the command ends, is ours to reap (a subreaper: see main)
        try:
            os.wait()
        except ChildProcessError:
            break
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, after.ru_maxrss / 2**20


def commands(work: Path, rows: int, num_proc: int, seed: int = 0) -> dict[str, list[str]]:
    tok = tokenizer_dir(work)
    model = tiny_model(work, tok)
    data, _ = dataset(work, rows, seed, tok)
    config = write_config(work, rows, model, data)
    cache = Path(tempfile.mkdtemp(prefix="prep-profile-cache-"))
    return {"floor": [sys.executable, str(ROOT / "benchmarks" / "prep_floor.py"), str(model), str(data),
                      str(num_proc)],
            "prepare": [sys.executable, "-m", "anyfit", "prepare", str(config), f"data.num_proc={num_proc}",
                        f"data.cache_dir={cache}"]}


def fresh(cmd: list[str]) -> list[str]:
    """The command with an empty data.cache_dir (a cold build each time)."""
    return [c if not c.startswith("data.cache_dir=") else f"data.cache_dir={tempfile.mkdtemp(prefix='pp-')}"
            for c in cmd]


def hooked(cmd: list[str], env: dict[str, str], profile: bool) -> Path:
    """Run ``cmd`` with the hook; print each process's CPU seconds (by role); the folder of its .prof files."""
    hook, out = Path(tempfile.mkdtemp(prefix="pp-hook-")), Path(tempfile.mkdtemp(prefix="pp-prof-"))
    (hook / "sitecustomize.py").write_text(HOOK)
    env = {**env, "PREP_PROFILE_DIR": str(out), "PYTHONPATH": f"{hook}{os.pathsep}{env.get('PYTHONPATH', '')}"}
    if not profile:
        env["PREP_PROFILE_CPU_ONLY"] = "1"
    wall, cpu, _ = cpu_of(cmd, env)
    cpus = {f.stem: float(f.read_text()) for f in sorted(out.glob("*.cpu"))}
    print(f"  {'profiled' if profile else 'hooked, unprofiled'}: wall {wall:.1f} s, tree CPU {cpu:.1f} s; per process "
          "(CPU s): " + ", ".join(f"{k} {v:.1f}" for k, v in cpus.items()))
    return out


def profiled(cmd: list[str], env: dict[str, str], top: int) -> None:
    """Print each role's profile: total, and the top functions by own CPU time."""
    out = hooked(cmd, env, True)
    roles: dict[str, list[Path]] = collections.defaultdict(list)
    for f in sorted(out.glob("*.prof")):
        roles[f.name.split("-")[0]].append(f)
    for role, files in roles.items():
        stats = pstats.Stats(*map(str, files))
        total = sum(v[2] for v in stats.stats.values())  # own time of every function: the profile's total
        print(f"  [{role}] {len(files)} process(es), {total:.2f} s profiled")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
        for (file, line, name), (cc, nc, tt, ct, _) in rows:
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if file != "~" else "builtin"
            print(f"    {tt:7.2f} own {ct:7.2f} cum {nc:>9} x {name} ({where})")


def stages(work: Path, rows: int, count: int) -> None:
    """In this process, on the first ``count`` records (after the first batch) of the ``rows`` data set: the floor's
    per-batch work against the store worker's, whole and stage by stage, in CPU milliseconds a record."""
    import itertools
    import json
    import pickle

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in both kinds of worker
    import prep_floor
    from transformers import AutoTokenizer

    from anyfit.config import load_config
    from anyfit.data import store
    from anyfit.data.audit import MaskAudit
    from anyfit.data.formats import resolve_fields, to_examples
    from anyfit.data.sources import iter_records
    from anyfit.data.store_writer import Packed
    from anyfit.data.templates import render
    from anyfit.data.tokenization import (
        _length_policy,
        _offset_ranges,
        _tokenize_renderings,
        _tokenize_whole,
        _trained_spans,
        tokenize_each,
    )

    commands(work, rows, 1)  # the data, tokenizer and config, made if missing
    cfg = load_config(work / f"config-{rows}.yaml").data
    tok = AutoTokenizer.from_pretrained(work / "tiny-qwen2")
    batches = list(itertools.islice(iter_records(cfg, 1024), 1 + -(-count // 1024)))[1:]  # as a worker gets them
    with open(cfg.path, encoding="utf-8") as f:
        lines = list(itertools.islice(f, 1024, 1024 + sum(map(len, batches))))
    n = len(lines)
    rest = resolve_fields(batches[0][0], cfg)
    store._init_worker(tok, rest, None)
    prep_floor._TOK = tok
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn, *args):
        t0 = time.process_time()
        out = fn(*args)
        spent[name] += time.process_time() - t0
        return out

    def floor_whole():
        return [prep_floor._work(lines[i:i + 1024]) for i in range(0, n, 1024)]

    def anyfit_whole():
        return [store._tokenize_in_worker(list(b), store._places(b), 1024 * (k + 1)) for k, b in enumerate(batches)]

    def sent(batch, first):  # what the parent sends a worker
        return pickle.dumps((list(batch), store._places(batch), first))

    def rendered(examples):
        return [r for e in examples for r in render(e, tok, rest)]

    def floor_rendered(part):
        return [tok.apply_chat_template(json.loads(line)["messages"], tokenize=False) for line in part]

    backend = tok.backend_tokenizer
    for rep in (1, 2):  # whole, twice in turn
        timed(f"floor: prep_floor._work ({rep})", floor_whole)
        timed(f"anyfit: store._tokenize_in_worker ({rep})", anyfit_whole)
    for k, b in enumerate(batches):
        first = 1024 * (k + 1)
        blob = timed("anyfit: pickle the batch (parent)", sent, b, first)
        timed("anyfit: unpickle it (worker)", pickle.loads, blob)
        examples = timed("anyfit: to_examples", to_examples, b, rest, first)
        renderings = timed("anyfit: render (chat_parts)", rendered, examples)
        timed("floor: render", floor_rendered, lines[k * 1024:(k + 1) * 1024])
        texts = ["".join(s.text for s in r.segments) for r in renderings]
        # in turn which goes first: the second finds the words in the BPE model's cache
        for name, encode in [("anyfit: encode_batch (offsets)", backend.encode_batch),
                             ("floor: encode_batch_fast", backend.encode_batch_fast)][::1 if k % 2 else -1]:
            timed(name, encode, texts, False)
        whole = [r for r in renderings if r.whole]
        spans = [_trained_spans(r) for r in whole]
        timed("anyfit: ranges from offsets (whole)", _offset_ranges, [texts[i] for i, r in enumerate(renderings)
                                                                       if r.whole], spans, tok)
        timed("anyfit: ranges from byte lengths (whole)", _tokenize_whole, whole, tok)
        pairs = timed("anyfit: _tokenize_renderings", _tokenize_renderings, renderings, tok, rest)
        timed("anyfit: mask audit (scan)", MaskAudit.of(tok, rest).scan, pairs, [False] * len(pairs), False)
        timed("anyfit: length policy", lambda done: [_length_policy(pair, rest) for pair in done], pairs)
        results = timed("anyfit: tokenize_each", tokenize_each, examples, tok, rest)
        timed("anyfit: Packed.of", Packed.of, results, b, rest.source_column)
    print(f"{n:,} records, CPU ms a record")
    for name, seconds in spent.items():
        print(f"  {name:40s} {1000 * seconds / n:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50000)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--work", default="/tmp/anyfit_data_scale")
    p.add_argument("--runs", type=int, default=1, help="unprofiled CPU measurements of each command")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--hooked", default="floor,prepare", help="commands run with the per-process CPU hook")
    p.add_argument("--stages", type=int, default=0, metavar="RECORDS", help="instead: the workers' work by stage")
    args = p.parse_args()
    if args.stages:
        stages(Path(args.work), args.rows, args.stages)
        return
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)
    work = Path(args.work)
    cmds = commands(work, args.rows, args.num_proc)
    env = child_env(work)
    print(f"{args.rows:,} records, {args.num_proc} process(es); load {os.getloadavg()[0]:.1f}")
    for _ in range(args.runs):
        for name, cmd in cmds.items():
            wall, cpu, _ = cpu_of(fresh(cmd), env)
            print(f"  {name}: wall {wall:.1f} s, tree CPU {cpu:.1f} s = {1000 * cpu / args.rows:.3f} ms a record, "
                  f"load {os.getloadavg()[0]:.1f}")
    for name in args.hooked.split(","):
        if name:
            print(f"  {name}:")
            hooked(fresh(cmds[name]), env, False)
    if not args.no_profile:
        profiled(fresh(cmds["prepare"]), env, args.top)


if __name__ == "__main__":
    main()
