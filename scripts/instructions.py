#!/usr/bin/env python3
"""Instructions per request, counted by valgrind's callgrind: a figure that does not
move with the machine's other load, for comparing two builds of the hop.

Each configuration runs twice under `mcpgw-bench compare` at one session (a short and
a long window) with every `mcpgw` process under callgrind; the difference between the
two runs' instruction totals, divided by the difference in requests, is what one more
request costs each worker, without start-up, certificates or the first TLS handshake.
The worker that served the client's HTTP (the edge) is told apart from the other by
how much of its profile runs the front door.

    scripts/instructions.py --bin-dir target/release [--configs sticky,tcp] [--out DIR]

Writes DIR/report.md and keeps the profiles (DIR/<config>-<seconds>s/cg.<pid>.out) for
`callgrind_annotate`. Wall-clock figures under valgrind mean nothing; only the counts do.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

WINDOWS_S = (6, 18)
TOTALS = re.compile(r"^totals: (\d+)", re.M)


def worker_profiles(directory):
    """(instructions, is the edge) of each worker process's profile."""
    found = []
    for path in sorted(directory.glob("cg.*.out")):
        text = path.read_text(errors="replace")
        if "mcpgw worker" not in text[:4000]:
            continue  # the `serve` supervisor or `certs`
        totals = TOTALS.search(text)
        if not totals:
            raise SystemExit(f"{path}: no totals line (did the worker exit cleanly?)")
        inclusive = subprocess.run(
            ["callgrind_annotate", "--auto=no", "--inclusive=yes", str(path)],
            capture_output=True, text=True, check=True,
        ).stdout
        front = re.search(r"^\s*([\d,]+) .*mcpgw::front::handle", inclusive, re.M)
        front_ir = int(front.group(1).replace(",", "")) if front else 0
        found.append((int(totals.group(1)), front_ir))
    # The edge is the worker that ran the front door most (start-up alone, which every
    # worker pays, can outweigh a short window's requests).
    busiest = max((front for _, front in found), default=0)
    return [(total, front == busiest and front > 0) for total, front in found]


def run_window(args, config, seconds, out):
    directory = out / f"{config}-{seconds}s"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    wrapper_dir = directory / "bin"
    wrapper_dir.mkdir()
    real = Path(args.bin_dir).resolve()
    wrapper = wrapper_dir / "mcpgw"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec valgrind --tool=callgrind --trace-children=yes "
        f"--callgrind-out-file={directory}/cg.%p.out {real}/mcpgw \"$@\"\n"
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    os.symlink(real / "mcpgw-bench", wrapper_dir / "mcpgw-bench")
    report = directory / "bench"
    command = [
        str(real / "mcpgw-bench"), "compare", "--configs", config, "--concurrency", "1",
        "--duration", f"{seconds}s", "--idle-sessions", "0", "--refine-steps", "0",
        "--bin-dir", str(wrapper_dir), "--out", str(report),
    ]
    log = directory / "bench.log"
    with log.open("w") as sink:
        subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=True)
    measured = json.loads((report / "report.json").read_text())
    run = measured["configurations"][0]["runs"][0]
    if run["requests"] == 0 or run["ok"] != run["requests"]:
        raise SystemExit(f"{config}: {run['ok']} of {run['requests']} requests answered; see {log}")
    return run["requests"], worker_profiles(directory)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", default="target/release")
    parser.add_argument("--configs", default="sticky,tcp")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    out = Path(args.out or f"build/instructions/{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        (short_n, short), (long_n, long) = (run_window(args, config, s, out) for s in WINDOWS_S)
        edge = [total for total, is_edge in long if is_edge]
        if len(short) != len(long) or len(edge) != 1:
            raise SystemExit(f"{config}: cannot pair the workers of the two runs")
        per_request = {}
        for role in (True, False):
            a = sum(total for total, is_edge in short if is_edge == role)
            b = sum(total for total, is_edge in long if is_edge == role)
            per_request[role] = (b - a) / (long_n - short_n)
        rows.append((config, long_n - short_n, per_request[True], per_request[False]))
        print(f"{config}: {per_request[True]:,.0f} at the edge, {per_request[False]:,.0f} "
              f"at the other worker per request ({long_n - short_n} requests apart)")
    local = next((edge + other for name, _, edge, other in rows if name == "sticky"), None)
    lines = [
        "# Instructions per request (callgrind, one session)",
        "",
        f"`{' '.join(sys.argv)}`",
        "",
        "| configuration | requests apart | edge worker | other worker | both | × sticky |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, apart, edge, other in rows:
        ratio = f"{(edge + other) / local:.2f}" if local else "—"
        lines.append(f"| {name} | {apart:,} | {edge:,.0f} | {other:,.0f} | {edge + other:,.0f} | {ratio} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    main()
