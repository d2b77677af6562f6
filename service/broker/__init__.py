"""The broker: what the API and the worker both say to Celery, and nothing of the database.

`queueing` holds the one Celery configuration, the queue names and `send_run`; `filesystem` the
kombu transport of the embedded default. Marking a run as sent (`dispatched_at`) is the database's
part, written once in service/domain/dispatch.py (the worker reaches it through service/run_store.py).
"""
