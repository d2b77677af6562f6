"""The pure core every process speaks: the API, the command, the worker and the sandboxed kernel
host. pydantic (and numpy for the speed statistics) only; no database, torch, Celery or settings,
and nothing else of ours (the import contract in pyproject.toml says so; tests/project/test_import_contracts.py
checks it).

    results.py         what a case and a run produce (CaseResult, RunResult) and how two compare
    verdicts.py        the comparison of a run with its baseline, and its summary
    outcomes.py        a run's outcomes and the exit codes: one table every surface reads
    project_config.py  a tree's optdrift.toml: how to build it, which adapter, which battery
    archives.py        source archives: checked, summarised, extracted safely
    speed_noise.py     kernel timings: the noise model a speed change is judged against
"""
