"""docs/SECURITY.md stays the entry point of the security reference, and no section of it is lost.

- Every page under docs/security/ is linked from docs/SECURITY.md (a markdown link to
  `security/<page>.md`), so a reader of the threat model reaches every rule.
- Every section heading the single page had (OLD_HEADINGS, the page before it was split into
  docs/security/) is a section heading in exactly one page of the set: a section renamed, dropped
  or copied into two pages fails here, and a citation like `docs/security/SANDBOX.md, "The sandbox"`
  keeps a section to name.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.project.test_named_paths import REPO_ROOT

ENTRY = REPO_ROOT / "docs" / "SECURITY.md"
PAGES = REPO_ROOT / "docs" / "security"

# The `## ` headings of docs/SECURITY.md while it was one page, in its order.
OLD_HEADINGS = (
    "Assets",
    "Attackers",
    "Authentication and authorisation (`service/domain/auth.py`, `service/api/auth.py`)",
    "Requests (`service/api/request_guard.py`, `service/api/params.py`, `service/domain/submission_rules.py`)",
    "Archives and patches (`service/core/archives.py`, `service/domain/patches.py`)",
    "Submitted trees and git; source digests (`service/domain/patches.py`, `archives.py`, `storage.py`)",
    "The verify quota (`service/domain/verify_quota.py`)",
    "Notifications, secrets at rest and slow clients (`service/notify/`, `service/home_modes.py`, "
    "`service/api/slow_clients.py`)",
    "The build cache: trust and disk (`worker/build/cache.py`)",
    "The GitHub Action files only the tree it uploads (`action.yml`)",
    "Queue fairness: verify runs yield to commit runs (`service/broker/queueing.py`, "
    "`service/broker/filesystem.py`, `service/domain/verify_quota.py`)",
    "The sandbox (`worker/sandbox/__init__.py`, `worker/sandbox/mounts.py`)",
    "Files a box wrote (`worker/sandbox/boxfiles.py`)",
    "The worker's own rights (`worker/sandbox/privilege.py`)",
    "No run can wedge a worker (`worker/jobs/watchdog.py`, `service/domain/runs.py`)",
    "Compiler flags are an allow-list (`service/core/compiler_flags.py`)",
    "Bounded batteries and bounded answers (`service/core/battery_limits.py`, `service/api/paging.py`)",
    "Training impact (`worker/training/runner.py`, `service/domain/training_impacts.py`)",
    "CI's feed is CI's (`service/domain/verdict_store.py`, `service/api/routes/commits.py`)",
    "What a run stores (`service/domain/redaction.py`, `worker/sandbox/log_tail.py`)",
    "Budgets (`worker/jobs/run.py` `RunBudget`, `service/settings.py`)",
    "The hostile corpus (`tests/scenarios/test_hostile_corpus.py`, `tests/fixtures/hostile/`)",
    "Surviving faults",
    "Operator-registered adapters and build variants (`worker/adapters/registry.py`, "
    "`service/core/environments.py`)",
    "What is open",
    "Load (`bench/load_test.py`)",
)


def security_pages() -> list[Path]:
    return sorted(PAGES.glob("*.md"))


def headings(page: Path) -> list[str]:
    return [line[3:].rstrip() for line in page.read_text().splitlines() if line.startswith("## ")]


def test_every_security_page_is_linked_from_the_entry_page():
    pages = security_pages()
    assert pages, "docs/security/ holds no page"
    links = set(re.findall(r"\]\((security/[^)#\s]+\.md)(?:#[^)]*)?\)", ENTRY.read_text()))
    unlinked = [f"security/{p.name}" for p in pages if f"security/{p.name}" not in links]
    assert not unlinked, f"docs/SECURITY.md does not link to: {unlinked}"


def test_every_old_section_heading_is_in_exactly_one_page():
    found: dict[str, list[str]] = {heading: [] for heading in OLD_HEADINGS}
    for page in [ENTRY, *security_pages()]:
        for heading in headings(page):
            if heading in found:
                found[heading].append(str(page.relative_to(REPO_ROOT)))
    wrong = {heading: where for heading, where in found.items() if len(where) != 1}
    assert not wrong, f"old sections not in exactly one page (heading: pages holding it): {wrong}"
