"""A run's plan: a value (``plan.py``) chosen by one search (``search.py``) over what every engine offers under the
pins (``candidates.py``: each engine's own footprint and step time), the report a person reads before a run
(``report.py``), and the fine-tuning run's side of it (``run.py``)."""
