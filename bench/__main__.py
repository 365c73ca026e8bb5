"""One entry point for every bench: run suites, keep their tables as JSON, render them.

    python -m bench list
    python -m bench run large convert s3 --json results.json [--pass large="--repeat 2"]
    python -m bench render results.json [--suite large]

Each suite is one module, ``bench/bench_<suite>.py``, run as its own process (a bench times
fresh processes, and a suite that fails must not take the others with it). ``run`` records
each suite's command, exit code and every markdown table it printed (the caption line above
the table, the header and the rows), with a description of the machine and the commit, in one
JSON document; ``render`` prints those tables again, which is how the README's table is made.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def suites() -> dict[str, Path]:
    return {p.stem.removeprefix("bench_"): p for p in sorted(HERE.glob("bench_*.py"))}


def machine() -> dict[str, Any]:
    """What the figures depend on: cores, memory, system, Python, the commit measured."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": memory,
        "system": platform.platform(),
        "python": platform.python_version(),
        "commit": commit or None,
    }


def tables_of(output: str) -> list[dict[str, Any]]:
    """The markdown tables in ``output``: each with the last non-table line before it (the
    suite's caption, e.g. ``source: ...``), its header cells and its rows of cells."""
    tables: list[dict[str, Any]] = []
    caption = ""
    current: dict[str, Any] | None = None
    for line in output.splitlines():
        text = line.strip()
        if text.startswith("|") and text.endswith("|"):
            cells = [c.strip() for c in text.strip("|").split("|")]
            if current is None:
                current = {"caption": caption, "header": cells, "rows": []}
                tables.append(current)
            elif not all(set(c) <= set("-: ") for c in cells):
                current["rows"].append(cells)
            continue
        current = None
        if text:
            caption = text
    return tables


def run_suite(name: str, script: Path, extra: list[str]) -> dict[str, Any]:
    command = [sys.executable, str(script), *extra]
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=HERE)
    sys.stderr.write(done.stdout[-4000:] + done.stderr[-2000:])
    return {
        "suite": name,
        "command": shlex.join(["python", f"bench/{script.name}", *extra]),
        "exit_code": done.returncode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "tables": tables_of(done.stdout),
        "output": done.stdout[-8000:],
    }


def render(document: dict[str, Any], only: str | None = None) -> str:
    lines: list[str] = []
    host = document.get("machine", {})
    for result in document.get("results", []):
        if only is not None and result["suite"] != only:
            continue
        if not result["tables"]:  # a suite that reports in prose
            lines += [f"`{result['command']}` ({result['started'][:10]}):", "", "```"]
            lines += [result["output"].rstrip(), "```", ""]
        for table in result["tables"]:
            lines.append(
                f"{table['caption']} ({host.get('cpus')} cores, "
                f"{host.get('memory_bytes', 0) / 1e9:.1f} GB RAM, commit {host.get('commit')}, "
                f"`{result['command']}`, {result['started'][:10]})"
            )
            lines.append("")
            lines.append("| " + " | ".join(table["header"]) + " |")
            lines.append("|" + "---|" * len(table["header"]))
            lines.extend("| " + " | ".join(row) + " |" for row in table["rows"])
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="The suites there are.")
    run = commands.add_parser("run", help="Run suites; print and keep their tables.")
    run.add_argument("suite", nargs="+", choices=sorted(suites()))
    run.add_argument("--json", type=Path, help="Write the results here.")
    run.add_argument(
        "--pass",
        dest="passed",
        action="append",
        default=[],
        metavar="SUITE=ARGS",
        help='Options for one suite, e.g. large="--repeat 2".',
    )
    show = commands.add_parser("render", help="Print the tables of a results file.")
    show.add_argument("results", type=Path)
    show.add_argument("--suite")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, script in suites().items():
            doc = (script.read_text().split('"""')[1:2] or [""])[0].strip().splitlines()
            print(f"{name:12} {doc[0] if doc else ''}")
        return 0
    if args.command == "render":
        print(render(json.loads(args.results.read_text()), args.suite))
        return 0
    extra: dict[str, list[str]] = {}
    for item in args.passed:
        name, _, text = item.partition("=")
        extra.setdefault(name, []).extend(shlex.split(text))
    document = {"machine": machine(), "results": []}
    for name in args.suite:
        document["results"].append(run_suite(name, suites()[name], extra.get(name, [])))
        if args.json:  # written after each suite: a long run interrupted keeps what it measured
            args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(render(document))
    return max((r["exit_code"] != 0 for r in document["results"]), default=False)


if __name__ == "__main__":
    sys.exit(main())
