#!/usr/bin/env python3
"""Turns bench_kernels JSON output into the markdown tables of docs/kernels.md.

Usage:
  build/bench/bench_kernels --benchmark_format=json --benchmark_out=main.json
  build/bench/bench_kernels --cpu-kernels=avx2 --benchmark_filter='MatVecHot|MatMul/.*/512/1' \
      --benchmark_format=json --benchmark_out=avx2.json          (optional)
  bench/report.py main.json [avx2.json]
Rates use wall-clock time; "cpu" columns divide the work by the process CPU time instead
(equal to wall time on an idle machine; higher when other processes take the cores).
"""
import json
import sys

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ2_XS", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4"]
BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5, "Q5_0": 5.5, "Q5_1": 6,
        "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "IQ2_XS": 2.3125,
        "IQ3_S": 3.4375, "IQ4_XS": 4.25, "IQ4_NL": 4.5, "MXFP4": 4.25}


def load(path):
    with open(path) as f:
        j = json.load(f)
    out = {}
    for b in j["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        out[b["name"].replace("/real_time", "").replace("/process_time", "")] = b
    return j["context"], out


def rate(b, key, cpu=False):
    if b is None:
        return None
    v = b[key]
    if cpu:  # counters are per wall second; rescale to per CPU second of one thread
        v = v * b["real_time"] / b["cpu_time"]
    return v


def f(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


def main():
    ctx, m = load(sys.argv[1])
    alt = load(sys.argv[2])[1] if len(sys.argv) > 2 else {}
    print(f"Run: {ctx.get('date', '?')}, {ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz, "
          f"load average {', '.join(f'{x:.1f}' for x in ctx.get('load_avg', []))}, "
          f"kernels `{ctx.get('cpu_kernels', '?')}`.\n")
    print("| memory probe | 1 thread GB/s | 2 threads GB/s |")
    print("|---|---|---|")
    for n in ["MemRead", "Memcpy"]:
        print(f"| {n} | {f(rate(m.get(n + '/1'), 'GB/s'))} | {f(rate(m.get(n + '/2'), 'GB/s'))} |")
    mem1 = rate(m.get("MemRead/1"), "GB/s")
    mem2 = rate(m.get("MemRead/2"), "GB/s")
    print()
    print("Matrix-vector (1 token, 1 GiB of weights, 4096 columns): GB/s of weight bytes, and the share of "
          "MemRead in the same run. Hot: the same on 1 MiB of weights (L2), the decode+FMA ceiling.\n")
    hdr = "| type | bits/w | 1T GB/s | 1T % mem | 2T GB/s | 2T % mem | 1T Gw/s | 1T cpu GB/s | hot Gw/s |"
    if alt:
        hdr += " hot Gw/s avx2 |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for t in TYPES:
        b1, b2, h = m.get(f"MatVec/{t}/1"), m.get(f"MatVec/{t}/2"), m.get(f"MatVecHot/{t}")
        g1, g2 = rate(b1, "GB/s"), rate(b2, "GB/s")
        row = (f"| {t} | {BITS[t]:g} | {f(g1)} | {f(100 * g1 / mem1 if g1 and mem1 else None, 0)} | {f(g2)} | "
               f"{f(100 * g2 / mem2 if g2 and mem2 else None, 0)} | {f(rate(b1, 'Gweights/s'), 2)} | "
               f"{f(rate(b1, 'GB/s', True))} | {f(rate(h, 'Gweights/s'), 2)} |")
        if alt:
            row += f" {f(rate(alt.get(f'MatVecHot/{t}'), 'Gweights/s'), 2)} |"
        print(row)
    print()
    print("Matrix-matrix (prefill): 1024 x 4096 weights, GFLOP/s = 2 * rows * cols * tokens / wall time.\n")
    hdr = "| type | 64 tok 1T | 64 tok 2T | 256 tok 1T | 256 tok 2T | 512 tok 1T | 512 tok 2T | 512 tok 1T cpu |"
    if alt:
        hdr += " 512 tok 1T avx2 |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for t in TYPES:
        cells = []
        for n in (64, 256, 512):
            for th in (1, 2):
                cells.append(f(rate(m.get(f"MatMul/{t}/{n}/{th}"), "GFLOP/s")))
        cells.append(f(rate(m.get(f"MatMul/{t}/512/1"), "GFLOP/s", True)))
        if alt:
            cells.append(f(rate(alt.get(f"MatMul/{t}/512/1"), "GFLOP/s")))
        print(f"| {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
