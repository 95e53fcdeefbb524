#!/usr/bin/env python
"""Write a JSONL file's articles (XSum or CNN/DailyMail, the hub's layout) as a haystack folder of .txt files.

The folder is ``task.haystack_dir`` for ``task=niah`` and RULER's essay haystacks offline. Nothing is written if
the folder already holds text files.

    .venv/bin/python scripts/make_haystack.py ../shared/data/xsum/test.jsonl outputs/haystack_xsum
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIELDS = ("document", "article")  # XSum's and CNN/DailyMail's text column


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=200, help="articles to write")
    args = ap.parse_args()
    if args.out.is_dir() and any(args.out.glob("*.txt")):
        print(f"{args.out}: already a haystack folder; left as it is")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with args.jsonl.open(encoding="utf-8") as lines:
        for i, line in zip(range(args.n), lines):
            row = json.loads(line)
            text = next((row[f] for f in FIELDS if f in row), None)
            if text is None:
                raise SystemExit(f"{args.jsonl}: a row has none of the text columns {FIELDS}")
            (args.out / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(list(args.out.glob('*.txt')))} articles of {args.jsonl}")


if __name__ == "__main__":
    main()
