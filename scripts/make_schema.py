"""Write the JSON Schema of the generations request, reply and error body (serve_graph.wire_schema) to docs/schema/.

python scripts/make_schema.py           # (re)write the files
python scripts/make_schema.py --check   # exit 1 when a committed file differs from what the models give
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the server packages live at the repository root

from serve_graph.wire_schema import render, schema_documents  # noqa: E402

SCHEMA_DIR = ROOT / "docs" / "schema"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, document in schema_documents().items():
        path = SCHEMA_DIR / name
        text = render(document)
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            SCHEMA_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python scripts/make_schema.py", file=sys.stderr)
        return 1
    print(("stale: " if args.check else "wrote: ") + (", ".join(stale) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
