"""A run's memory plan, chosen from the engines' footprints (``run.py``), and the report a person reads before a
run (``report.py``)."""
