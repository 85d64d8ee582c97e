"""Command line: ``python -m simulations list`` and ``python -m simulations run``."""

from __future__ import annotations

import argparse
import json
import sys

from simulations.sweep import SweepTotals, failure_report, scenarios_named, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the scenarios")
    run = commands.add_parser("run", help="run scenarios over seeds")
    run.add_argument(
        "scenarios", nargs="*", default=["all"], help="scenario names, or 'all' (the default)"
    )
    run.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    run.add_argument("--count", type=int, default=1, help="number of seeds (default 1)")
    run.add_argument("--verbose", action="store_true", help="print each run's summary")
    run.add_argument(
        "--log-lines",
        type=int,
        default=40,
        help="server log lines shown for a failing run (default 40)",
    )
    run.add_argument(
        "--max-failures",
        type=int,
        default=5,
        help="stop a scenario after this many failing seeds (default 5)",
    )
    args = parser.parse_args(argv)

    if args.command == "list":
        for scenario in scenarios_named(["all"]):
            print(f"{scenario.name:24} {scenario.summary}")
        return 0

    try:
        scenarios = scenarios_named(args.scenarios)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    failed = False
    for scenario in scenarios:
        totals = SweepTotals(scenario.name)
        for result, seconds in sweep(scenario, range(args.seed, args.seed + args.count)):
            totals.add(result, seconds)
            if args.verbose:
                print(
                    f"{scenario.name} seed {result.seed}: "
                    f"{'ok' if result.ok else 'FAIL'} {json.dumps(result.summary)}"
                )
            if not result.ok:
                print(failure_report(result, log_lines=args.log_lines), flush=True)
                if len(totals.failures) >= args.max_failures:
                    break
        print(totals.line(), flush=True)
        failed |= bool(totals.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
