"""The worker's jobs, each over one workspace (workspace.py: fetch -> prepare -> build):

- run.py     a run: claim, build, the battery's cases stored in batches, done, the verdict
- corun.py   a judged run's changed cases on both builds: per-step |commit - baseline|, attribution
- environment_attribution.py  a build variant's changed cases against its base environment's build
- pair.py    the two builds side by side that both co-run jobs share (hosts, builds, co-run, attribution)
- timing.py  a finished run's kernels timed
- follow_ups.py  what a run sends after its verdict (the co-runs, the timing), and their order
- yielding.py  how a job beside the runs (co-run, attribution, training impact) yields to them and is queued again

worker/tasks.py is the Celery face that calls them; every database access goes through
service.run_store, every task sent through worker.celery_app.
"""
