"""Interchange with other frameworks: `cleaner export` (purified data for TRL, ATIF, verl, with a dataset card)
and `cleaner import` (ATIF, TRL completions and verl rollout dumps into raw shards of a run of their own).

A pure core per format (functions over Arrow tables, row dicts and the `atif` package's models: `trl.py`,
`atif.py`, `verl.py`, `dataset_card.py`, `importers.py`), the selection of committed shards and the staged
output folder in `source.py`; the commands (`flows/export_cmd.py`, `flows/import_cmd.py`) are thin adapters.
What each format keeps and loses: docs/formats.md.
"""
