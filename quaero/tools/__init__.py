"""The tools users run after or beside training: `quaero review` (review.py), `quaero inspect rows`
(inspect_rows.py), `quaero export` (export.py), `quaero eval` (evaluate.py, with significance.py's
statistics), `quaero doctor` (doctor.py) and the throughput model (scaling.py, `quaero bench scaling`).
Tools import the run side (quaero/recipe/, quaero/rollout/, ...); nothing on the run side imports a tool."""
