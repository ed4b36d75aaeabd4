"""Peak memory and time of the data stage on many tiny records, and what checking the cache costs.

    python scripts/bench_data_memory.py                                   # 1M records (about 20 min on 2 cores)
    python scripts/bench_data_memory.py --records 1000000 10000000
    python scripts/bench_data_memory.py --records 200000 --tree /tmp/old  # another checkout, side by side
    python scripts/bench_data_memory.py --records 20000 50000 --words 150  # long samples: memory a token
    python scripts/bench_data_memory.py --records --parts 20000           # only the near-duplicate parts

For each size: a JSONL file of N distinct one-turn records (about 50 bytes a line, like a
file of 10 million records in 504 MB), then `python -m finetune mode=data data.path=FILE` in a child
process (its VmHWM, read as `finetune/rundir/machine.py` reads it, and its process tree's RSS sampled; the tiny model's tokenizer, the default data settings: deduplication, near-duplicate removal,
PII scrubbing, a 10% held-out split), run twice: a cache miss, then a hit (the entry checked and copied
into a second run directory). The child's process tree's resident memory is sampled every 0.1 s.
Prints one row per run (records, file size, kept samples, tokens, peak RSS, bytes per record, seconds and
the child's CPU seconds),
then the checksums the cache could use, over the largest entry's files read from the page cache, and
near-duplicate removal on `--parts` keys both ways: datasketch's MinHash objects and MinHashLSH index
(what the stage ran before) against `finetune.data.clean`'s signature rows and numpy buckets (its
bands and values): time, peak Python allocations (tracemalloc, a separate run) and whether they agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write_records(path: Path, n: int, words: int = 0) -> None:
    """N distinct prompt/completion records: about 50 bytes a line, or (`words` > 0) a completion of that
    many random words from a 2,000-word vocabulary (long samples: memory per token)."""
    import random

    vocab = [f"word{i}" for i in range(2000)]
    with path.open("w") as f:
        for start in range(0, n, 10_000):
            lines = []
            for i in range(start, min(n, start + 10_000)):
                if words:
                    text = " ".join(random.Random(i).choices(vocab, k=words))
                    lines.append(json.dumps({"prompt": f"tell me story {i}", "completion": text}) + "\n")
                else:
                    lines.append(f'{{"prompt": "count to {i * 7919 % 10_000_000}", "completion": "{i}"}}\n')
            f.write("".join(lines))


def peak_rss(proc: subprocess.Popen, stop: threading.Event, out: list[int]) -> None:
    """The largest sum of RSS over `proc` and its children, sampled every 0.1 s until `stop`."""
    import psutil

    root = psutil.Process(proc.pid)
    peak = 0
    while not stop.is_set():
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        stop.wait(0.1)
    out.append(peak)


# The stage run as `python -m finetune` runs it, then its own VmHWM (rundir/machine.py's peak_rss_bytes,
# read the same way here so that an older tree without it is measured alike) written to a file.
_CHILD = """
import sys
from finetune.pipeline.cli import main
try:
    code = main(sys.argv[2:])
finally:
    with open("/proc/self/status") as status:
        hwm = next(int(x.split()[1]) * 1024 for x in status if x.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as out:
        out.write(str(hwm))
sys.exit(code)
"""


def run_stage(tree: Path, data: Path, run_dir: Path, cache: Path, models: Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "FINETUNE_CACHE": str(models), "OMP_NUM_THREADS": "1"}
    hwm_file = run_dir.with_name(run_dir.name + ".vmhwm")
    argv = [
        sys.executable,
        "-c",
        _CHILD,
        str(hwm_file),
        "mode=data",
        f"data.path={data}",
        f"run_dir={run_dir}",
    ]
    argv += [f"data.cache_dir={cache}", *extra]
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stop, peak = threading.Event(), []
    sampler = threading.Thread(target=peak_rss, args=(proc, stop, peak))
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"mode=data failed ({proc.returncode}):\n{err[-3000:]}")
    stats = json.loads((run_dir / "data_stats.json").read_text())
    return {
        "kept": stats["num_train"] + stats["num_eval"],
        "tokens": stats["tokens"]["train_total"] + stats["tokens"]["eval_total"],
        "hit": stats["cache"]["hit"],
        "entry": Path(stats["cache"]["dir"]),
        "peak": peak[0],
        "vmhwm": int(hwm_file.read_text()),
        "seconds": seconds,
        # CPU seconds of the child (user + system): what a shared, loaded machine's wall time hides
        "cpu": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime,
    }


def hash_rates(files: list[Path]) -> list[tuple[str, float]]:
    """GB/s of each checksum over `files` (best of three, from the page cache)."""
    import xxhash

    total = sum(p.stat().st_size for p in files)
    rates = []
    for name, make in (
        ("sha256", hashlib.sha256),
        ("blake2b", hashlib.blake2b),
        ("xxh3_128 (used)", xxhash.xxh3_128),
    ):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for p in files:
                h = make()
                with p.open("rb") as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
                h.hexdigest()
            best = min(best, time.perf_counter() - t0)
        rates.append((name, total / best / 1e9))
    return rates


def _near_keys(n: int) -> list[str]:
    """n conversation keys of a dozen words, every tenth a near duplicate of the one before (a word added)."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    keys: list[str] = []
    for i in range(n):
        if i % 10 == 9:
            keys.append(keys[-1] + " indeed")
        else:
            keys.append(
                "user: "
                + " ".join(rng.choices(words, k=8))
                + "\nassistant: "
                + " ".join(rng.choices(words, k=6))
            )
    return keys


def _library_way(keys: list[str], threshold: float) -> list[bool]:
    """What the stage ran before: a MinHash object a key (MinHash.bulk) and datasketch's in-memory LSH index."""
    from datasketch import MinHash, MinHashLSH

    from finetune.data.clean import NUM_PERM, _shingles

    hashes = MinHash.bulk((_shingles(k) for k in keys), num_perm=NUM_PERM)
    lsh = MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
    dup = []
    for i, mh in enumerate(hashes):
        hit = any(hashes[j].jaccard(mh) >= threshold for j in lsh.query(mh))
        dup.append(hit)
        if not hit:
            lsh.insert(i, mh)
    return dup


def _our_way(keys: list[str], threshold: float) -> list[bool]:
    from finetune.data import clean

    return clean.near_duplicates(clean.Signatures.of(clean.signatures(keys), threshold)).tolist()


def near_dup_parts(n: int, threshold: float = 0.85) -> list[tuple[str, float, float, bool]]:
    """(way, seconds, peak MB of Python allocations, agrees with the library) for each way."""
    import tracemalloc

    keys = _near_keys(n)
    rows, reference = [], None
    for name, way in (
        ("datasketch MinHash.bulk + MinHashLSH", _library_way),
        ("signature rows + numpy buckets", _our_way),
    ):
        t0 = time.perf_counter()
        dup = way(keys, threshold)
        seconds = time.perf_counter() - t0
        tracemalloc.start()
        way(keys, threshold)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        reference = dup if reference is None else reference
        rows.append((f"{name} ({sum(dup):,} near duplicates)", seconds, peak / 1e6, dup == reference))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, nargs="*", default=[1_000_000])
    ap.add_argument(
        "--parts", type=int, default=0, help="keys for the near-duplicate comparison (0: skip it)"
    )
    ap.add_argument("--words", type=int, default=0, help="words a completion (0: tiny records)")
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout to run (default: this one)")
    ap.add_argument(
        "--work", type=Path, default=None, help="where the files go (default: a temporary folder)"
    )
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-data-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, largest = [], None
    # Long samples need the tiny model's whole context (the recipe's 256 would drop them).
    extra = ["train.seq_len=1024"] if args.words else []
    for n in args.records:
        name = f"{n}-w{args.words}" if args.words else str(n)
        data = work / f"records-{name}.jsonl"
        if not data.is_file():
            write_records(data, n, args.words)
        for attempt in ("miss", "hit"):
            r = run_stage(
                args.tree,
                data,
                work / f"run-{name}-{attempt}",
                work / f"cache-{name}",
                work / "models",
                extra,
            )
            rows.append((n, data.stat().st_size, r))
            print(
                f"  {n:,} records, cache {'hit' if r['hit'] else 'miss'}: VmHWM {r['vmhwm'] / 1e9:.2f} GB, "
                f"{r['seconds']:.0f} s ({r['cpu']:.0f} CPU s)",
                file=sys.stderr,
            )
        largest = rows[-1][2]["entry"]
    if rows:
        shape = f"{args.words}-word completions, seq_len 1024" if args.words else "tiny records"
        print(f"data stage, {shape} ({args.tree}, {os.cpu_count()} CPUs)")
        _table(rows)
    if largest is not None:
        files = sorted(p for p in largest.rglob("*.arrow"))
        size = sum(p.stat().st_size for p in files)
        print(f"\nchecksums over the {size / 1e6:,.0f} MB of arrow files in {largest.name}")
        print("| checksum | GB/s |")
        print("|---|---:|")
        for name, rate in hash_rates(files):
            print(f"| {name} | {rate:.2f} |")
    if args.parts:
        print(f"\nnear duplicates of {args.parts:,} keys (threshold 0.85, 128 permutations)")
        print("| way | seconds | peak MB (tracemalloc) | bytes a key | same answers |")
        print("|---|---:|---:|---:|---|")
        for name, seconds, peak, same in near_dup_parts(args.parts):
            print(f"| {name} | {seconds:.1f} | {peak:.1f} | {peak * 1e6 / args.parts:,.0f} | {same} |")


def _table(rows: list) -> None:
    print(
        "| records | file MB | cache | kept | tokens | VmHWM GB | sampled tree RSS GB | bytes/record "
        "| bytes/token | seconds | CPU seconds |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, size, r in rows:
        print(
            f"| {n:,} | {size / 1e6:,.0f} | {'hit' if r['hit'] else 'miss'} | {r['kept']:,} | {r['tokens']:,} "
            f"| {r['vmhwm'] / 1e9:.2f} | {r['peak'] / 1e9:.2f} | {r['vmhwm'] / n:,.0f} "
            f"| {r['vmhwm'] / max(r['tokens'], 1):,.0f} | {r['seconds']:,.0f} | {r['cpu']:,.0f} |"
        )


if __name__ == "__main__":
    main()
