"""The recipe and its run state: the training loop (train.py) and the parts it holds, a module each: what
the run is wired from (parts.py) and what moves every step (progress.py), a step's groups into rows
(groups.py), rollouts sampled ahead (ahead.py), the weight sync (weight_sync.py), evaluation
(evaluation.py), checkpoints and resume (run_state.py, over checkpoint.py's format) and the rules that stop
a run early (stop.py); what each torchrun rank does (ranks.py), the pre-flight judgement of a config
(plan.py, memory_plan.py), the run folder's lock (runlock.py), and what a run writes beside its events:
saved rows (saved_rows.py) and the model it hands over (model_folder.py)."""
