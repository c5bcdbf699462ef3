"""The rollout: episodes played on env sessions and turned into training rows.

driver.py (`EpisodeDriver`: reset -> render -> sample -> parse -> step -> capture -> bridge), render.py (the
renderer adapter: prompts, action parsing, the exact bridge), rows.py (how episodes become rows: `EchoRow`s,
the contract in quaero/rows.py), tasks.py (which task, split and seed an episode resets to) and traces.py
(OpenEnv's token formats, rows in and out). What the rollout counts is quaero/telemetry/counts.py's.
"""
