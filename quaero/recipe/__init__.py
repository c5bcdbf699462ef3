"""The recipe and its run state: the training loop (train.py), what each torchrun rank does (ranks.py),
rollouts sampled ahead (ahead.py), the pre-flight judgement of a config (plan.py), checkpoints and the
state they hold (checkpoint.py), the run folder's lock (runlock.py), and what a run writes beside its
events: saved rows (saved_rows.py) and the model it hands over (model_folder.py)."""
