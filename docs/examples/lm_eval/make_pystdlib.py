"""Writes pystdlib.jsonl: 40 lines of Python's standard library cut in two, each with its own
second half and three other lines' as choices (seeded: the same file every time). The data of
the lm-eval tasks beside it, made locally since no dataset hub is reachable."""

import json
import pathlib
import random
import sysconfig

rng = random.Random(0)
lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
lines = []
for name in ["textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py", "shlex.py"]:
    for line in (lib / name).read_text().splitlines():
        s = line.rstrip()
        if 30 <= len(s.strip()) <= 90 and not s.strip().startswith("#") and '"""' not in s:
            lines.append(s)
rng.shuffle(lines)


def split(s: str) -> tuple[str, str]:
    """At the first delimiter past the middle of the line's code (never inside its indent)."""
    indent = len(s) - len(s.lstrip())
    cut = indent + (len(s) - indent) // 2
    while cut < len(s) and s[cut] not in " (.,=[":
        cut += 1
    return s[:cut], s[cut:]


items = []
for s in lines:
    context, right = split(s)
    if len(right) < 4 or not context.strip():  # lm-eval needs a non-blank context
        continue
    others = [split(o)[1] for o in rng.sample(lines, 3)]
    if any(len(o) < 4 or o == right for o in others):
        continue
    choices = [right] + others
    rng.shuffle(choices)
    items.append({"context": context, "choices": choices, "label": choices.index(right)})
    if len(items) == 40:
        break
with open(pathlib.Path(__file__).with_name("pystdlib.jsonl"), "w") as f:
    for item in items:
        f.write(json.dumps(item) + "\n")
print(f"{len(items)} items")
