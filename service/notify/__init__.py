"""Verdicts sent where maintainers work: GitHub check runs and a PR comment updated in place
(github.py), outgoing webhooks with a signed body (webhooks.py), started from the points where a run
starts and where its verdict is stored (hooks.py). Nothing here can change a verdict or fail a run:
every failure is recorded on the notification's own row (service/db/notify_models.py).
"""
