"""Where a profiled program's GPU time goes: the kernels of a perfetto trace
(`jax.profiler.trace(..., create_perfetto_trace=True)`, e.g. `sampler.py --trace DIR`) summed
by name, busiest first, per step.

    python benchmarks/trace_kernels.py DIR --steps 32 --top 25 --module decode_segment

Reads every `perfetto_trace.json.gz` under DIR. Device events are those of processes whose name
says GPU (XLA names them "/device:GPU:0" and its streams); host events are left out. Each
program's (`hlo_module`'s) total comes first; `--module` keeps the kernels of the programs whose
name contains it (e.g. the sampler's decode loop apart from its prefill).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path


def device_kernels(trace: dict) -> list[dict]:
    """The complete ("X") events of GPU device processes."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "GPU" in name or "gpu" in name}
    if not gpu:
        raise SystemExit(f"no GPU process in the trace; processes: {sorted(set(names.values()))}")
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def module(event: dict) -> str:
    return event.get("args", {}).get("hlo_module", "?")


def summarise(kernels: list[dict], steps: int, top: int) -> str:
    total = collections.defaultdict(float)
    count = collections.Counter()
    for e in kernels:
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    start = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e["dur"]) for e in kernels)
    busy = sum(total.values())
    lines = [f"{len(kernels)} kernels, {len(total)} distinct; busy {busy / steps:.1f} µs per step "
             f"({steps} steps; the trace spans {(end - start) / 1e3:.1f} ms)",
             "| kernel | calls/step | µs/step | µs/call | share |", "|---|---:|---:|---:|---:|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name[:60]}` | {count[name] / steps:.1f} | {us / steps:.1f} | "
                     f"{us / count[name]:.2f} | {us / busy:.1%} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--steps", type=int, default=1, help="divide the totals by this many steps")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--module", default=None, help="only programs whose name contains this")
    args = p.parse_args()
    files = sorted(args.dir.rglob("perfetto_trace.json.gz"))
    if not files:
        raise SystemExit(f"no perfetto_trace.json.gz under {args.dir}")
    for path in files:
        with gzip.open(path) as f:
            kernels = device_kernels(json.load(f))
        programs = collections.defaultdict(float)
        for e in kernels:
            programs[module(e)] += float(e["dur"]) / 1e3
        print(f"## {path}\n\nms on the GPU per program: "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(programs.items(), key=lambda kv: -kv[1])))
        if args.module:
            kernels = [e for e in kernels if args.module in module(e)]
        print(summarise(kernels, args.steps, args.top))


if __name__ == "__main__":
    main()
