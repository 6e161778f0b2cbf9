"""Merge ``--suite network`` runs of different levels into one report (goals and plot recomputed).

    python -m specsplit.bench.merge_network bench/results/network-ngram.json PART.json [PART.json ...]

Each level of a network run is self-contained (a fresh orchestrator, its own
target-only passes before and after), so levels measured in separate runs (to
keep each run short) can sit in one table; the report lists the runs it was
merged from (``merged_from``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specsplit.bench.network import goals, plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("parts", nargs="+")
    args = parser.parse_args()
    parts = [Path(p) for p in args.parts]
    reports = [json.loads(p.read_text()) for p in parts]
    if len({(r["drafters"] and tuple(r["drafters"]), r["prompt_set"], r["max_new_tokens"]) for r in reports}) > 1:
        raise SystemExit("the runs differ in drafters, prompt set or max new tokens; merge only like runs")
    out = dict(reports[0])
    out["levels"] = sorted((lv for r in reports for lv in r["levels"]), key=lambda lv: lv["added_rtt_ms"])
    out["link_rtt_ms"] = [lv["added_rtt_ms"] for lv in out["levels"]]
    out["goals"] = goals(out["levels"], out["drafters"])
    out["duration_s"] = round(sum(r["duration_s"] for r in reports), 1)
    out["merged_from"] = [{"json": str(p), "link_rtt_ms": r["link_rtt_ms"], "duration_s": r["duration_s"]}
                          for p, r in zip(parts, reports)]
    path = Path(args.out)
    path.write_text(json.dumps(out, indent=2) + "\n")
    plot(out, path.with_suffix(".png"))
    print(f"goals: {out['goals']} -> {path}")


if __name__ == "__main__":
    main()
