"""Where the test suite's time goes: the log of `bash scripts/test.sh --durations=0` summed per file and per test.

    .venv/bin/python docs/results/suite-time/durations.py LOG [N]     # N: how many tests to list (default 50)
"""

import collections
import re
import sys

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)")


def main(log: str, top: int = 50) -> None:
    per_file, per_test, per_phase = collections.Counter(), collections.Counter(), collections.Counter()
    for line in open(log).read().splitlines():
        m = LINE.match(line)
        if m:
            seconds, phase, node = float(m[1]), m[2], m[3]
            per_file[node.split("::")[0]] += seconds
            per_test[(phase, node)] += seconds
            per_phase[phase] += seconds
    print(f"total {sum(per_file.values()):.0f} s;", ", ".join(f"{k} {v:.0f} s" for k, v in per_phase.items()))
    for name, seconds in per_file.most_common(30):
        print(f"{seconds:8.0f}  {name}")
    print()
    for (phase, node), seconds in per_test.most_common(top):
        print(f"{seconds:7.0f} {phase:8s} {node}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
