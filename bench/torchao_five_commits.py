"""Issue 37's torchao commits through `optdrift check`: what each reads (verdict, first step, kind of
change, direction), one table.

    .venv/bin/python bench/torchao_five_commits.py [--only NAME ...]

torchao 0.18.0 as installed (the [test] extra), in tests/fixtures/torchao_project's configuration and
battery, as the scenario test makes it (tests/scenarios/test_real_library_torchao.py: base, a
comment-only commit, AdamW's weight decay after the update), plus three trees made here from base:
  reorder     sqrt(v) / sqrt(bc2) written sqrt(v / bc2) (same math)        expected: rounding-level
  block128    AdamW8bit's default block size 256 -> 128                   expected: quantization
  round_down  8-bit codes rounded down instead of to the nearest map entry expected: quantization, farther
Each is checked against base (comment and reorder: unchanged or rounding-level; the others changed
from step 1) in one OPTDRIFT_HOME, so the builds and the compile cache are shared after the first.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DENOM = "        denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps\n"
DENOM_REORDERED = "        denom = (exp_avg_sq_f32 / bias_correction2).sqrt() + eps\n"
BLOCK_8BIT = "        block_size=256,\n"
ROUND_NEAREST = "    codes = torch.where(residual >= (val_up - val_down) * 0.5, codes_up, codes)\n"


def _mutated(base: Path, into: Path, file: str, old: str, new: str, *, after: str) -> Path:
    """A copy of the tree `base` with the first `old` after `after` in `file` replaced by `new`."""
    shutil.copytree(base, into)
    path = into / file
    text = path.read_text()
    start = text.find(after)
    at = text.find(old, start) if start >= 0 else -1
    if at < 0:
        raise SystemExit(f"{file} has no {old!r} after {after!r}: not torchao 0.18.0")
    path.write_text(text[:at] + new + text[at + len(old):])
    return into


def trees(work: Path) -> dict[str, Path]:
    from tests.scenarios import test_real_library_torchao as scenario

    class Factory:
        def mktemp(self, name: str) -> Path:
            path = work / name
            path.mkdir()
            return path

    made = dict(scenario.history.__wrapped__(Factory()))
    base = made["base"]
    made["reorder"] = _mutated(base, work / "reorder", "torchao/optim/adam.py", DENOM, DENOM_REORDERED,
                               after="def single_param_adam")
    made["block128"] = _mutated(base, work / "block128", "torchao/optim/adam.py", BLOCK_8BIT,
                                "        block_size=128,\n", after="class AdamW8bit(")
    made["round_down"] = _mutated(base, work / "round_down", "torchao/optim/quant_utils.py", ROUND_NEAREST,
                                  "    codes = codes  # rounded down: the lower map entry, always\n",
                                  after="def quantize_8bit_with_qmap")
    return made


def summarize(name: str, code: int, document: dict, seconds: float) -> list[str]:
    cases = document["comparison"]["cases"]
    verdicts = collections.Counter(c["verdict"] for c in cases)
    changed = [c for c in cases if c["verdict"] == "changed"]
    first = collections.Counter(c["first_divergent_step"] for c in changed)
    directions = collections.Counter(c.get("direction") or "-" for c in changed)
    attribution = document.get("attribution") or {}
    kinds = collections.Counter((a.get("class") or ("error" if "error" in a else "listed"))
                                for a in attribution.values() if isinstance(a, dict))
    fmt = lambda counter: ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=str)) or "-"  # noqa: E731
    return [name, str(code), fmt(verdicts), fmt(first), fmt(kinds), fmt(directions), f"{seconds:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="commit names to check (default: all five)")
    args = parser.parse_args()
    from tests.scenarios import test_real_library_torchao as scenario

    work = Path(tempfile.mkdtemp(prefix="torchao-five-"))
    made = trees(work)
    home = work / "home"
    home.mkdir()
    rows = []
    for name in args.only or ["comment", "decay", "reorder", "block128", "round_down"]:
        began = time.monotonic()
        code, document, output = scenario.check(made, name, "base", home)
        rows.append(summarize(name, code, document, time.monotonic() - began))
        (work / f"{name}.out.txt").write_text(output)
        print(" | ".join(rows[-1]), flush=True)
    header = ["commit vs base", "exit", "verdicts", "first step (changed)", "attribution", "direction (changed)", "s"]
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\noutputs: {work}/*.out.txt")


if __name__ == "__main__":
    main()
