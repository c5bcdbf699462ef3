"""The names a run's writers and readers share, each declared once: the run folder's files and folders, and
every metric a step or an evaluation logs, with how it totals over a run and what it means.

Writers (the trainer step, the rollout counts, the recipe) and readers (`quaero review`, the proofs, the
console, the sinks) import a name from here instead of spelling it. docs/reference.md's metric tables are
generated from these declarations (scripts/gen_reference.py), and its check fails when a name a writer emits
is not declared here, or a declared one is no longer emitted. No torch here: `trainers/` imports this module.

How a metric totals over a run, and the declarations these tables are made of: quaero/telemetry/metrics.py.

The `local_train_*` names are retrain's ECHO metric names, kept exactly so a quaero run reads like a retrain
run.
"""
from __future__ import annotations

from quaero.telemetry.metrics import Table

# ── the run folder (runs/NAME/) ─────────────────────────────────────────────────────────────────────────────

EVENTS = "events.jsonl"  # the run log, one JSON object per line (quaero/telemetry/runlog.py)
CONFIG = "config.json"  # the resolved config the run was started with
CHECKPOINTS = "checkpoints"  # checkpoints/step-NNNNNN/ (quaero/recipe/checkpoint.py)
FINAL = "final"  # the model a finished run hands over, a Hugging Face folder (quaero/recipe/model_folder.py)
ROWS_DIR = "rows"  # saved rows, rows/step-NNNNNN.jsonl ([logging] save_rows; quaero/recipe/saved_rows.py)
ENV_SERVERS = "env-servers"  # logs of the env servers quaero starts
SAMPLER_SERVERS = "sampler-servers"  # logs of the vLLM servers quaero starts


def step_folder_name(step: int) -> str:
    """A checkpoint's folder (and a saved-rows file's stem): `step-000008`."""
    return f"step-{step:06d}"


TABLES: list[Table] = []


def _table(title: str, owner: str) -> Table:
    TABLES.append(Table(title, owner))
    return TABLES[-1]


# ── the trainer step's branch counters (retrain's names, kept for compatibility)

_branch = _table("Branch counters (retrain's names, kept for compatibility)", "quaero/telemetry/proofs.py")
SELECTIVE_SUFFIX_LOGITS = _branch.latest("local_train_selective_suffix_logits",
                                         "the selective target-mask mode is enabled")
SPARSE_SUFFIX_SKIPS = _branch.count("local_train_selective_sparse_suffix_skips",
                                    "microbatches whose sparse long suffix skipped the suffix-logits "
                                    "shortcut")
HIDDEN_BATCHES = _branch.count("local_train_selective_hidden_logprob_batches",
                               "microbatches on the exact selected-hidden-token path")
COMPILED_CE_BATCHES = _branch.count("local_train_selective_compiled_ce_batches",
                                    "of those, microbatches whose CE ran through `torch.compile`")
SUFFIX_BATCHES = _branch.count("local_train_selective_suffix_logprob_batches",
                               "microbatches on the suffix `logits_to_keep` shortcut")
FALLBACK_BATCHES = _branch.count("local_train_selective_fallback_logprob_batches",
                                 "microbatches where selective was asked for and full logits ran")
CHUNKED_BATCHES = _branch.count("local_train_selective_chunked_logprob_batches",
                                "hidden-path microbatches that ran chunked")
DENSE_BATCHES = _branch.count("local_train_selective_dense_logprob_batches",
                              "microbatches with selective off (full logits by choice)")
COMPILE_MODE = _branch.latest("local_train_compile_selective_ce_mode", "`off`, `auto` or `require`")
COMPILE_FALLBACK_REASON = _branch.latest("local_train_compile_selective_ce_fallback_reason",
                                         "why compiled CE did not run in `auto` mode")
SAVE_ON_CPU = _branch.latest("local_train_save_on_cpu", "saved-tensor CPU offload is on")
SELECTIVE_METRICS = (SELECTIVE_SUFFIX_LOGITS, SPARSE_SUFFIX_SKIPS, HIDDEN_BATCHES, COMPILED_CE_BATCHES,
                     SUFFIX_BATCHES, FALLBACK_BATCHES, COMPILE_MODE, COMPILE_FALLBACK_REASON)

# ── the trainer step (trainers/step.py `step_metrics`, with each loss term's own: trainers/terms.py)

_step = _table("Trainer step", "trainers/step.py, trainers/terms.py")
LOSS = _step.per_step("loss", "RL (or SFT) term + ECHO term")
RL_LOSS = _step.per_step("rl_loss", "the policy-gradient term (0 on warm-start steps)")
SFT_LOSS = _step.per_step("sft_loss", "the warm start's NLL term (0 on RL steps)")
ECHO_LOSS = _step.per_step("echo_loss", "the ECHO term")
ACTION_TOKENS = _step.count("action_tokens",
                            "the RL/SFT term's denominator: action tokens trained (0 when nothing trained)")
ECHO_TOKENS = _step.count("echo_tokens", "the ECHO term's denominator: environment tokens trained")
ROWS = _step.count("rows", "rows trained")
ECHO_WEIGHT = _step.per_step("echo_weight", "the ECHO weight of the step (after `[echo] schedule`; 0 with "
                                            "ECHO off)")
LOSS_AGGREGATION = _step.latest("loss_aggregation", "the RL term's average (`token_mean` on warm-start "
                                                    "steps)")
ECHO_NORMALIZATION = _step.latest("echo_normalization", "the ECHO term's average")
ROW_TOKENS = _step.count("row_tokens", "tokens of the trained rows")
PADDED_TOKENS = _step.count("padded_tokens", "tokens of the microbatches, padding included")
GRAD_NORM = _step.per_step("grad_norm", "the gradient norm before clipping")
GRAD_CLIPPED = _step.latest("grad_clipped", "the norm exceeded `max_grad_norm`")
OPTIMIZER_STEPPED = _step.latest("optimizer_stepped", "the optimizer stepped (false on a non-finite "
                                                      "gradient)")
OPTIMIZER_STEPS = _step.count("optimizer_steps", "optimizer steps taken (a rollout batch takes "
                              "steps_per_generation x num_iterations)")
NONFINITE_GRAD_SKIPS = _step.count("nonfinite_grad_skips", "1 when a non-finite gradient skipped the step")
LR = _step.per_step("lr", "the learning rate of the step")
FORWARD_PASSES = _step.count("forward_passes", "backbone forwards")
MICROBATCHES = _step.count("microbatches", "microbatches built")
LM_HEAD_SKIPPED_MICROBATCHES = _step.count("lm_head_skipped_microbatches",
                                           "microbatches no loss reads: no forward at all")
FORWARD_PASSES_PER_MICROBATCH = _step.per_step("forward_passes_per_microbatch", "the shared-forward "
                                                                                "invariant: 1")
TREE_PACKING = _step.latest("local_train_tree_packing", "`train_tree_packing`: `off`, `auto` or `on`")
TREE_BATCHES = _step.count("local_train_tree_batches",
                           "microbatches forwarded once as a token trie (trainers/tree.py)")
TREE_UNIQUE_TOKENS = _step.count("local_train_tree_unique_tokens",
                                 "the tries' unique tokens, over the microbatches packing considered")
TREE_ROW_TOKENS = _step.count("local_train_tree_row_tokens", "those microbatches' row tokens")
TREE_TOKEN_RATIO = _step.per_step("local_train_tree_token_ratio",
                                  "unique / row tokens of the step's tries (1: nothing shared; none with "
                                  "packing off)")
TREE_FALLBACK_BATCHES = _step.count("local_train_tree_fallback_batches",
                                    "microbatches packing was asked for and the rows ran (the model cannot "
                                    "take the ancestor mask)")
TREE_FALLBACK_REASON = _step.latest("local_train_tree_fallback_reason", "why, the latest given")
TREE_METRICS = (TREE_PACKING, TREE_BATCHES, TREE_UNIQUE_TOKENS, TREE_ROW_TOKENS, TREE_TOKEN_RATIO,
                TREE_FALLBACK_BATCHES, TREE_FALLBACK_REASON)
SAMPLER_LOGPROB_GAP_MEAN = _step.per_step("sampler_logprob_gap_mean", "mean absolute sampler-vs-trainer "
                                          "log-prob gap on sampled action tokens")
SAMPLER_LOGPROB_GAP_MAX = _step.per_step("sampler_logprob_gap_max", "its maximum")
IMPORTANCE_RATIO_MEAN = _step.per_step("importance_ratio_mean",
                                       "mean ratio r on trained action tokens: trainer / sampler, or trainer "
                                       "/ its own recorded log-probs under a `sampler_correction` (GSPO: s)")
CLIP_FRACTION = _step.per_step("clip_fraction", "fraction of those tokens whose ratio was clipped")
POLICY_LOSS = _step.latest("policy_loss", "the RL term's variant: `ppo_clip`, `gspo`, `cispo`, `sapo` or a "
                                          "custom loss's `module:Class` (`[loss.policy] type`; `sft` on "
                                          "warm-start steps)")
CLIP_LOW_FRACTION = _step.per_step("clip_low_fraction", "fraction of RL tokens whose ratio fell below "
                                   "1 - clip_eps_low with A < 0 (the clip binds: no gradient)")
CLIP_HIGH_FRACTION = _step.per_step("clip_high_fraction", "fraction above 1 + clip_eps_high with A > 0 "
                                    "(CISPO: whose weight was truncated there, either sign)")
SAMPLER_CORRECTION = _step.latest("sampler_correction", "the sampler-mismatch weight: `none`, "
                                  "`token_truncate`, `token_mask`, `sequence_truncate`, `sequence_mask`")
SAMPLER_IS_WEIGHT_MEAN = _step.per_step("sampler_is_weight_mean", "mean trainer/sampler weight "
                                        "exp(lp_old - lp_sampler) on RL tokens, before truncation "
                                        "(None without a correction)")
SAMPLER_IS_WEIGHT_MAX = _step.per_step("sampler_is_weight_max", "its maximum")
SAMPLER_IS_CUT_FRACTION = _step.per_step("sampler_is_cut_fraction", "fraction of RL tokens whose weight "
                                         "was past the cap (truncated, or masked to 0)")
SEQUENCE_RATIO_MEAN = _step.per_step("sequence_ratio_mean", "mean sequence ratio over rows "
                                     "(importance_sampling_level = `sequence`, GSPO; None otherwise)")
SEQUENCE_RATIO_MIN = _step.per_step("sequence_ratio_min", "its minimum")
SEQUENCE_RATIO_MAX = _step.per_step("sequence_ratio_max", "its maximum")
KL_LOSS = _step.per_step("kl_loss", "the KL penalty's loss: β x its per-token estimate, averaged "
                         "(`[loss] beta`; 0 without a reference)")
KL_TOKENS = _step.count("kl_tokens", "the KL term's targets: sampled action tokens of an RL step with a "
                        "reference")
KL_MEAN = _step.per_step("kl_mean", "mean per-token KL estimate to the frozen reference (`kl_estimator`; "
                         "None without one)")
KL_MAX = _step.largest("kl_max", "its maximum")
REFERENCE_FORWARD_S = _step.per_step("reference_forward_s", "seconds of the reference's no-grad forwards per "
                                     "rollout batch (None without a reference)")
GUIDED_ACTION_TOKENS = _step.count("guided_action_tokens", "RL tokens a guide chose (`[guidance] mode`: "
                                   "the env's oracle played them), trained with policy shaping")
ONPOLICY_ACTION_TOKENS = _step.count("onpolicy_action_tokens", "RL tokens the policy sampled (the ratio's)")
GUIDANCE_SHAPING_MEAN = _step.per_step("guidance_shaping_mean", "mean policy-shaping weight f(π) = π / (π + "
                                       "γ) on guided tokens (None without any)")
GUIDANCE_SHAPING_MIN = _step.per_step("guidance_shaping_min", "its minimum")
GUIDANCE_SHAPING_MAX = _step.per_step("guidance_shaping_max", "its maximum")
CONTEXT_ROWS_CROPPED = _step.count("context_rows_cropped", "rows cropped by "
                                                           "`train_supervised_context_tokens`")
CONTEXT_TOKENS_REMOVED = _step.count("context_tokens_removed", "tokens those crops removed")
SAVE_ON_CPU_OFFLOADED_TENSORS = _step.count("save_on_cpu_offloaded_tensors", "tensors offloaded to CPU")
SAVE_ON_CPU_OFFLOADED_MB = _step.per_step("save_on_cpu_offloaded_mb", "MiB offloaded to CPU")
STEP_TIME_S = _step.per_step("step_time_s", "the trainer step's seconds")
PEAK_MEM_MB = _step.largest("peak_mem_mb", "peak memory of the trainer step (forward, backward, update)")
PEAK_MEM_SOURCE = _step.latest("peak_mem_source", "what measured it: `cuda_max_allocated` (the allocator's), "
                               "`rss_since_reset` (the process's RSS peak over the step, Linux) or "
                               "`process_peak_rss` (since the process started, where the peak cannot be "
                               "reset)")
RANKS = _step.latest("ranks", "torchrun ranks (more than one only)")
RANK_ROWS = _step.per_step("rank_rows", "rows per rank")
RANK_ROW_TOKENS = _step.per_step("rank_row_tokens", "row tokens per rank")
RANK_FORWARD_PASSES = _step.per_step("rank_forward_passes", "forwards per rank")
RANK_PADDING_MICROBATCHES = _step.per_step("rank_padding_microbatches",
                                           "zero-loss forwards per rank that keep it in step with the others")
RANK_PEAK_MEM_MB = _step.per_step("rank_peak_mem_mb", "peak memory per rank")

# ── the rollout (quaero/telemetry/counts.py `RolloutCounts`: the sessions and the driver count into it)

_rollout = _table("Rollout", "quaero/telemetry/counts.py")
EPISODES = _rollout.count("episodes", "episodes run (dropped ones included)")
EPISODES_DROPPED = _rollout.count("episodes_dropped", "episodes dropped (also counted as "
                                                      "`drop_reason_<kind>`)")
EPISODES_ENDED_AT_RESET = _rollout.count("episodes_ended_at_reset", "resets that answered done=True: no "
                                         "episode (never sampled or trained, not in `episodes`); the env's "
                                         "reason is logged as `env_reset_ended`")
EPISODES_TRUNCATED = _rollout.count("episodes_truncated",
                                    "episodes cut by `max_turns` or the context: never a success")
EPISODES_SUCCEEDED = _rollout.count("episodes_succeeded", "successful episodes")
TURNS = _rollout.count("turns", "assistant turns")
MALFORMED_ACTIONS = _rollout.count("malformed_actions",
                                   "replies that are no valid action (answered with a corrective message)")
UNPARSABLE_ACTIONS = _rollout.count("unparsable_actions", "of those, replies the renderer's parser raised on")
TRUNCATED_COMPLETIONS = _rollout.count("truncated_completions", "completions cut by `max_tokens`")
DEMO_REASONING_DROPPED = _rollout.count("demo_reasoning_dropped", "scripted turns (demos) rendered without "
                                        "their reasoning: the template renders none where a model samples "
                                        "(thinking off)")
OBSERVATIONS_TRUNCATED = _rollout.count("observations_truncated", "env messages cut to "
                                                                  "`max_observation_tokens`")
ENV_RESPONSES_CLIPPED = _rollout.count("env_responses_clipped", "bridged responses cut at the context's end")
CONTEXT_EXHAUSTED = _rollout.count("context_exhausted",
                                   "episodes ended because the next prompt left no room to sample")
ENV_RESPONSES = _rollout.count("env_responses", "environment responses")
ENV_RESPONSES_CAPTURED = _rollout.count("env_responses_captured",
                                        "of those, captured in a row right after `step` (terminal included)")
TERMINAL_RESPONSES = _rollout.count("terminal_responses", "terminal responses")
BRIDGE_FALLBACKS = _rollout.count("bridge_fallbacks", "turns the renderer could not bridge exactly: trained "
                                  "action-only (also `bridge_fallback_reason_<reason>`)")
PREFIX_MISMATCHES = _rollout.count("prefix_mismatches",
                                   "turns whose prompt was not an exact extension of the previous row")
ROWS_PACKED = _rollout.count("rows_packed", "rows holding a whole episode")
ROWS_TRANSITION = _rollout.count("rows_transition", "rows holding one transition")
PACKING_BREAKS = _rollout.count("packing_breaks", "places where an episode needed a new row (exact: the next "
                                "prompt starts it whole; also `packing_break_reason_<reason>`)")
ROLLOUT_ROW_TOKENS = _rollout.count("rollout_row_tokens", "tokens the rows hold")
ROLLOUT_ROW_TOKENS_PER_TRANSITION_LAYOUT = _rollout.count("rollout_row_tokens_per_transition_layout",
                                                          "tokens one row per transition would have held")
ROLLOUT_ACTION_TOKENS = _rollout.count("rollout_action_tokens", "action tokens the rows hold")
ROLLOUT_ECHO_TOKENS = _rollout.count("rollout_echo_tokens", "ECHO tokens the rows hold")
ENV_STEPS = _rollout.count("env_steps", "env `step` calls")
ENV_RESETS = _rollout.count("env_resets", "env `reset` calls")
ENV_RETRIES = _rollout.count("env_retries", "retried env calls")
ENV_TIMEOUTS = _rollout.count("env_timeouts", "env calls past their timeout")
ENV_RESTARTS = _rollout.count("env_restarts", "env servers restarted")
ENV_REPLAYED_STEPS = _rollout.count("env_replayed_steps", "steps replayed on a new session")
ENV_TOOL_ERRORS = _rollout.count("env_tool_errors", "MCP tool calls that returned an error")
ENV_REJECTED_CALLS = _rollout.count("env_rejected_calls",
                                    "MCP tool calls the server refused (the model is shown why)")
ENV_REJECTED_ACTIONS = _rollout.count("env_rejected_actions", "actions the env raised on twice with the same "
                                      "error, on the session that answered: answered as an invalid action "
                                      "(`malformed_reward`, the env's message)")
ENV_INVALID_REPLIES = _rollout.count("env_invalid_replies", "env replies that failed validation (the episode "
                                                            "drops)")
GROUPS = _rollout.count("groups", "kept groups (RL steps)")
GROUPS_ZERO_ADVANTAGE = _rollout.count("groups_zero_advantage", "of those, groups whose rewards are all "
                                       "equal: no RL signal, ECHO only")
GROUPS_NONFINITE_ADVANTAGE = _rollout.count("groups_nonfinite_advantage", "groups left out: their rewards' "
                                            "spread overflows a float (an episode whose rewards overflow "
                                            "when summed drops as `nonfinite_reward`)")
GROUPS_RESAMPLED = _rollout.count("groups_resampled", "dynamic sampling's further groups")
DYNAMIC_SAMPLING_BOUND_HITS = _rollout.count("dynamic_sampling_bound_hits", "steps its bound cut short of "
                                             "`tasks_per_step` groups with spread")
GROUPS_GUIDED = _rollout.count("groups_guided", "RL groups whose kept episodes all failed that got guided "
                               "members (`[guidance] mode`)")
GUIDED_MEMBERS = _rollout.count("guided_members", "episodes the guide (the env's oracle, or recordings) "
                                "played in their place (kept)")
GUIDED_MEMBERS_SUCCEEDED = _rollout.count("guided_members_succeeded", "of those, the successes")
GUIDED_MEMBERS_DROPPED = _rollout.count("guided_members_dropped", "guided episodes lost (a dead server, a "
                                        "timeout): never trained, their group kept")
GUIDES_FAILED = _rollout.count("guides_failed", "of those, a guide (the env's oracle) raised: its member "
                               "dropped, never the run")
GUIDES_TIMED_OUT = _rollout.count("guides_timed_out", "of those, a guide's call ran past `[guidance] "
                                  "timeout_s`: its member dropped, never the run")
GUIDES_UNMATCHED = _rollout.count("guides_unmatched", "of those, a recorded guide (`[guidance] "
                                  "traces`) had no action for the member's prompt (a task not "
                                  "recorded, an env that answered otherwise): its member dropped")
SAMPLER_PREFILL_TOKENS = _rollout.count("sampler_prefill_tokens", "prompt tokens the `hf` sampler ran "
                                        "through the model (with `[sampler] hf_kv_cache_mib` > 0)")
SAMPLER_REUSED_TOKENS = _rollout.count("sampler_reused_tokens", "prompt tokens whose KV it reused: another "
                                       "member's copy of the prompt, or a sequence it ran before")
SAMPLER_PREFIX_HITS = _rollout.count("sampler_prefix_hits", "prompts that reused any KV")
ROLLOUT_COUNTERS = tuple(_rollout.names)  # every counter above, in the order a snapshot lists them
REWARD_MEAN = _rollout.per_step("reward_mean", "mean reward of the kept episodes")
SUCCESS_RATE = _rollout.per_step("success_rate", "success rate of the kept episodes")
TURNS_MEAN = _rollout.per_step("turns_mean", "mean turns of the kept episodes")
ROLLOUT_ROW_TOKENS_PER_EPISODE = _rollout.per_step("rollout_row_tokens_per_episode", "row tokens per kept "
                                                                                     "episode")
GROUPS_ZERO_ADVANTAGE_SHARE = _rollout.per_step("groups_zero_advantage_share", "their share of the groups")
DROP_REASON = _rollout.count_family("drop_reason_", "kind",
                                    "dropped episodes by reason (e.g. `timeout`, `nonfinite_reward`)")
PACKING_BREAK_REASON = _rollout.count_family(
    "packing_break_reason_", "reason", "packing breaks by where the next prompt leaves the row: "
    "`history_rerendered`, `reply_rerendered`, `response_rerendered`, `packing_off`")
BRIDGE_FALLBACK_REASON = _rollout.count_family("bridge_fallback_reason_", "reason", "bridge fallbacks by "
                                                                                    "reason")

# ── the recipe, per step (quaero/recipe/train.py, and its weight sync: quaero/recipe/weight_sync.py)

_recipe = _table("Recipe, per step", "quaero/recipe/train.py, quaero/recipe/weight_sync.py")
PHASE = _recipe.latest("phase", "`sft` (warm start on demos), `traces_rl` (warm start on recorded traces "
                       "with the RL loss off-policy, `[data] traces_loss = \"rl\"`) or `rl` (the policy's "
                       "own rollouts)")
# a step's phase: what its rows are and which loss trains them (also each saved row's `phase`)
PHASE_SFT, PHASE_TRACES_RL, PHASE_RL = "sft", "traces_rl", "rl"
WARM_START_PHASES = (PHASE_SFT, PHASE_TRACES_RL)
WEIGHTS_PUSHED = _recipe.count("weights_pushed", "1 when the weights were pushed to the sampler before it "
                                                 "sampled")
WEIGHT_SYNC_S = _recipe.per_step("weight_sync_s", "the push's seconds")
WEIGHT_SYNC_PEAK_MEM_MB = _recipe.largest("weight_sync_peak_mem_mb",
                                          "peak memory of the push (as `peak_mem_mb`)")
WEIGHT_TRANSFER = _recipe.latest("weight_transfer", "how it went (`file`, `nccl`, `ipc`, or the engine's "
                                                    "own)")
ROLLOUT_TIME_S = _recipe.per_step("rollout_time_s", "the rollout's seconds")
ROLLOUT_PEAK_MEM_MB = _recipe.largest("rollout_peak_mem_mb", "peak memory of the rollout (as `peak_mem_mb`; "
                                      "not with `max_off_policy_steps`, where it overlaps the trainer step)")
PROCESS_PEAK_MEM_MB = _recipe.largest("process_peak_mem_mb", "the process's peak memory since it started, "
                                      "every phase (checkpoints, pushes, evaluations) included")
PROCESS_RSS_MB = _recipe.latest("process_rss_mb", "the process's resident memory (host RAM, MiB) at the "
                                "step's end, on any device (Linux; absent elsewhere): `quaero review` flags "
                                "a run whose RSS grows (\"process memory flat\")")
PROCESS_MALLOC_IN_USE_MB = _recipe.latest("process_malloc_in_use_mb", "malloc's memory in use at the step's "
                                          "end (MiB; glibc): RSS that grows while it is flat was freed")
TOTAL_STEP_TIME_S = _recipe.per_step("total_step_time_s", "the whole step's seconds")
TOKENS_PER_S = _recipe.per_step("tokens_per_s", "trained row tokens per second of the whole step")
POLICY_STALENESS = _recipe.largest("policy_staleness", "how many policy versions older than the trained "
                                   "weights the weights that sampled the rows were (0 on-policy; "
                                   "cumulatively the run's largest); `importance_ratio_mean` and "
                                   "`clip_fraction` show what the lag did to the ratio")
ROLLOUT_WAIT_S = _recipe.per_step("rollout_wait_s",
                                  "with `max_off_policy_steps >= 1`: how long the step waited for its "
                                  "rollout")

# ── the learning signal and the task samplers, per RL step (quaero/recipe/groups.py `signal_metrics`)

_signal = _table("Learning signal and task samplers, per RL step", "quaero/recipe/groups.py")
SIGNAL_GROUPS = _signal.count("signal_groups", "groups whose rewards differ: they carry an RL signal")
GENERATED_TOKENS = _signal.count("generated_tokens", "tokens the policy generated in the kept episodes (the "
                                 "curriculum's cost)")
SIGNAL_GROUPS_PER_EPISODE = _signal.per_step("signal_groups_per_episode", "groups with signal per kept "
                                                                          "episode")
SIGNAL_GROUPS_PER_1K_TOKENS = _signal.per_step("signal_groups_per_1k_tokens",
                                               "groups with signal per 1,000 generated tokens (guided "
                                               "tokens counted in the cost)")
SIGNAL_GROUPS_GUIDED = _signal.count("signal_groups_guided", "of the groups with signal, those guided "
                                     "(`[guidance] mode`: their spread is a guide's, the policy's own "
                                     "all failed)")
GUIDED_TOKENS = _signal.count("guided_tokens", "action tokens of the kept guided episodes (a prefix's "
                              "continuation included; not in `generated_tokens`: counted in "
                              "`signal_groups_per_1k_tokens`'s cost)")
GUIDANCE_MEMBERS = _signal.latest("guidance_members", "the guidance schedule's members per all-fail group at "
                                  "this step (`[guidance] members` annealed to 0 at `[guidance] until_step`)")
TASKS_UNSEEN = _signal.latest("tasks_unseen", "a learning task sampler's keys (tasks, or their spec's group "
                              "/ difficulty) with an empty outcome memory")
TASKS_LEARNABLE = _signal.latest("tasks_learnable", "keys whose discounted success estimate is between 0.05 "
                                                    "and 0.95")
TASKS_SATURATED = _signal.latest("tasks_saturated", "keys at or above 0.95")
TASKS_HOPELESS = _signal.latest("tasks_hopeless", "keys at or below 0.05")
SPLIT_COVERAGE = _signal.latest("split_coverage", "share of the train split's tasks played in RL groups so "
                                "far (learning samplers; sequential keeps no memory: null)")
EPISODES_LOST = _signal.per_step("episodes_lost", "in `by_env`: the env's episodes dropped this step (a dead "
                                 "server, a timeout), never trained")
BY_ENV = _signal.per_step("by_env", "a mixture's figures per env: `{env: {groups, groups_zero_advantage, "
                          "signal_groups, generated_tokens, signal_groups_per_episode, "
                          "signal_groups_per_1k_tokens, tasks_<pool>, split_coverage, episodes_lost}}` (the "
                          "pooled ones are the step's own)")

# ── saved rows, per step (quaero/recipe/saved_rows.py)

_rows = _table("Saved rows, per step", "quaero/recipe/saved_rows.py")
ROWS_SAVED = _rows.count("rows_saved", "rows written to `runs/NAME/rows/`")
ROWS_SAVE_FAILURES = _rows.count("rows_save_failures", "1 when writing them failed (a warning, never a "
                                                       "stopped run)")

# ── evaluation (`eval` events, quaero/recipe/evaluation.py)

_eval = _table("Evaluation (`eval` events)", "quaero/recipe/evaluation.py")
EVAL_REWARD = _eval.per_step("eval_reward", "mean reward of the evaluation's episodes")
EVAL_SUCCESS_RATE = _eval.per_step("eval_success_rate", "their success rate")
EVAL_EPISODES = _eval.per_step("eval_episodes", "episodes evaluated")
EVAL_DROPPED = _eval.per_step("eval_dropped", "episodes dropped")
EVAL_TRUNCATED = _eval.per_step("eval_truncated", "episodes truncated")
EVAL_GUIDED_TOKENS = _eval.per_step("eval_guided_tokens", "action tokens a guide chose in its episodes: 0, "
                                    "evals never guide (`quaero review` checks it before judging RL over the "
                                    "warm start)")
EVAL_TIME_S = _eval.per_step("eval_time_s", "the evaluation's seconds")
EVAL_PEAK_MEM_MB = _eval.per_step("eval_peak_mem_mb", "its peak memory (as `peak_mem_mb`)")
EVAL_DROP_REASONS = _eval.per_step("eval_drop_reasons", "dropped episodes by reason")
EVAL_RESULTS = _eval.per_step("eval_results",
                              "per task, for paired comparisons (`quaero review`): `[index, success, "
                              "reward]`")
EVAL_FORMATS = _eval.per_step("eval_formats", "per task, its episode's format: `[index, malformed actions, "
                              "actions]` (a mixture's entries end with the env's name)")
EVAL_WELL_FORMED = _eval.per_step("eval_well_formed", "the share of its episodes with no malformed action: "
                                  "`quaero review` and `quaero eval --compare` split a success gain into "
                                  "format (this share) and task (success among well-formed episodes)")
EVAL_SUCCESS_SE = _eval.per_step("eval_success_se", "the standard error of `eval_success_rate` over its "
                                 "episodes, sqrt(p (1 - p) / n)")
EVAL_FORMAT_FAILURES = _eval.per_step("eval_format_failures", "the share of its episodes that failed with a "
                                      "malformed action (a format failure)")
EVAL_WRONG_ANSWERS = _eval.per_step("eval_wrong_answers", "the share that failed with every action well "
                                    "formed (a wrong answer)")
EVAL_PASS_K = _eval.per_step("eval_pass_k", "[training] eval_pass_k when above 1: k episodes per task "
                             "sampled at the sampler's temperature, after the greedy ones (which the "
                             "figures above count alone)")
EVAL_PASS_AT_1 = _eval.per_step("eval_pass_at_1", "the sampled episodes' success rate (pass@1 at the "
                                "temperature), the mean over tasks")
EVAL_PASS_AT_K = _eval.per_step("eval_pass_at_k", "pass@k, the mean over tasks of the unbiased "
                                "1 - C(n - c, k) / C(n, k) (n samples, c successes)")
EVAL_PASS_AT_K_SE = _eval.per_step("eval_pass_at_k_se", "its standard error over tasks")
EVAL_PASS_RESULTS = _eval.per_step("eval_pass_results", "per task, its sampled episodes: `[index, successes, "
                                   "samples]` (a mixture's entries end with the env's name)")
EVAL_TASK_GROUPS = _eval.per_step("eval_task_groups", "per task, its spec from the env's Task API: `[index, "
                                  "group, difficulty]` (toolbench: template and tier; absent where the env "
                                  "has no `get_task`): `quaero review --plots` draws a curve per group and "
                                  "tier")
SAMPLE_TRANSCRIPT = _eval.per_step("sample_transcript", "the first episode's messages, shortened")
EVAL_BY_ENV = _eval.per_step("eval_by_env", "a mixture's: `{env: {eval_success_rate, eval_reward, "
                             "eval_episodes, eval_dropped}}` (each `eval_results` entry then ends with its "
                             "env's name)")

# ── event names (the `event` field) that readers select on ──────────────────────────────────────────────────

TRAIN_STEP_EVENT = "train_step"
EVAL_EVENT = "eval"
RUN_END_EVENT = "run_end"
# a checkpoint written: {path, seconds, peak_mem_mb (the write's, as a step's)}
CHECKPOINT_SAVED_EVENT = "checkpoint_saved"
# a resume's checkpoint read: {path, seconds, peak_mem_mb}
CHECKPOINT_READ_EVENT = "checkpoint_read"
# a resume under another config than the run's last: {checkpoint_step, changes: {key: [old, new]}, trained}
RESUME_CONFIG_CHANGED_EVENT = "resume_config_changed"
TASKS_DRAWN_EVENT = "tasks_drawn"  # each step's tasks per env, with the weights they were drawn with
# [training] rl_token_budget reached: this step is the last
RL_TOKEN_BUDGET_SPENT_EVENT = "rl_token_budget_spent"
# each RL step's groups: env, task, spec group, successes, episodes, ...
TASK_OUTCOMES_EVENT = "task_outcomes"

# ── every other event a run logs, by the module that logs it (tests/unit/quaero/telemetry/test_names.py
# fails on an event name spelled as a literal anywhere else) ────────────────────────────────────────────────

# the run log itself (quaero/telemetry/runlog.py, quaero/telemetry/sinks.py, quaero/telemetry/outcomes.py)
EVENTS_FILE_RECREATED_EVENT = "events_file_recreated"
EVENTS_LOST_EVENT = "events_lost"
SINK_FAILED_EVENT = "sink_failed"
SINK_SUMMARY_EVENT = "sink_summary"
SINK_HUNG_EVENT = "sink_hung"
RL_NO_SIGNAL_EVENT = "rl_no_signal"
RL_SIGNAL_EVENT = "rl_signal"
# their totals over the run's RL steps, beside the step counters they sum (action_tokens, echo_tokens, groups,
# groups_zero_advantage, the rollout's RL_EPISODE_COUNTERS): RL steps, those that trained action tokens, and
# the actions played (turns) and the valid ones among them (turns less malformed actions)
RL_STEPS, RL_STEPS_WITH_SIGNAL = "rl_steps", "rl_steps_with_signal"
# RL steps whose update never reached the weights (a non-finite gradient skipped the optimizer)
RL_STEPS_WITHOUT_UPDATE = "rl_steps_without_update"
RL_ACTIONS, RL_VALID_ACTIONS = "actions", "valid_actions"
# the trainer (trainers/base.py, trainers/memory.py)
TRAINER_READY_EVENT = "trainer_ready"
SAVE_ON_CPU_NOOP_EVENT = "save_on_cpu_noop"
# the env sessions and servers (quaero/openenv_client/)
ENV_POOL_OPENED_EVENT = "env_pool_opened"
ENV_RESET_PARAMS_UNKNOWN_EVENT = "env_reset_params_unknown"
ENV_RESET_PARAMS_IGNORED_EVENT = "env_reset_params_ignored"
ENV_INPROCESS_NOT_CONCURRENT_EVENT = "env_inprocess_not_concurrent"
ENV_RESETS_REPRODUCIBLE_EVENT = "env_resets_reproducible"
ENV_RESETS_NOT_REPRODUCIBLE_EVENT = "env_resets_not_reproducible"
ENV_ACTION_REJECTED_EVENT = "env_action_rejected"
ENV_RETRY_EVENT = "env_retry"
ENV_EPISODE_DROPPED_EVENT = "env_episode_dropped"
ENV_SERVE_EXPOSED_EVENT = "env_serve_exposed"
ENV_SERVE_SINGLE_SESSION_EVENT = "env_serve_single_session"
ENV_SERVER_STARTED_EVENT = "env_server_started"
ENV_SERVER_DIED_EVENT = "env_server_died"
# the samplers (quaero/sampling/)
SAMPLER_FALLBACK_EVENT = "sampler_fallback"
SAMPLER_SERVER_STARTED_EVENT = "sampler_server_started"
SAMPLER_WAIT_STOPPED_EVENT = "sampler_wait_stopped"
SAMPLER_REQUEST_RETRIED_EVENT = "sampler_request_retried"
# the rollout (quaero/rollout/driver.py, quaero/rollout/traces.py)
OBSERVATION_TRUNCATED_EVENT = "observation_truncated"
UNPARSABLE_ACTION_EVENT = "unparsable_action"
ENV_RESET_ENDED_EVENT = "env_reset_ended"
TRACE_RECORD_REFUSED_EVENT = "trace_record_refused"
TRACES_LOADED_EVENT = "traces_loaded"
# the run's files (quaero/recipe/checkpoint.py, quaero/recipe/model_folder.py, quaero/recipe/saved_rows.py)
CHECKPOINT_ORPHAN_REMOVED_EVENT = "checkpoint_orphan_removed"
CHECKPOINT_CORRUPT_LEFT_EVENT = "checkpoint_corrupt_left"
CHECKPOINT_NEWER_LEFT_EVENT = "checkpoint_newer_left"
CHECKPOINT_SKIPPED_EVENT = "checkpoint_skipped"
FINAL_SAVED_EVENT = "final_saved"
ROWS_SAVE_FAILED_EVENT = "rows_save_failed"
# the embedded models (quaero/models/cache.py): a named model built into the cache on its first use, announced
# with its size before the build starts {model, folder, params, disk_gb, memory_gb}
MODEL_BUILD_EVENT = "model_build"
# the tools (quaero/tools/export.py)
EXPORTED_EVENT = "exported"

# ── the recipe's other events (quaero/recipe/): what a reader of events.jsonl sees happen ───────────────────

RUN_START_EVENT = "run_start"  # {source, run_dir, config, ranks (under torchrun)}
APPROXIMATION_EVENT = "approximation"  # an option that trains an approximation of the exact loss
RUN_LOCK_TAKEN_OVER_EVENT = "run_lock_taken_over"  # a dead process's run-folder lock, taken over
STOP_REQUESTED_EVENT = "stop_requested"  # the first Ctrl-C or SIGTERM: the step finishes, then the run stops
RESUMED_EVENT = "resumed"  # {path, step, seconds}: the checkpoint the run goes on from
AUTO_RESUME_EVENT = "auto_resume"  # checkpoints found without --resume: resuming anyway
RESUME_WITHOUT_CHECKPOINT_EVENT = "resume_without_checkpoint"  # --resume with nothing to resume
RESTART_EVENT = "restart"  # --restart: the old checkpoints set aside
TASK_SAMPLER_CHANGED_EVENT = "task_sampler_changed"  # a warm start's checkpoint resumed with another sampler
CHECKPOINT_FAILED_EVENT = "checkpoint_failed"
CHECKPOINT_AFTER_FAILURE_FAILED_EVENT = "checkpoint_after_failure_failed"  # saving a failed run's last step
DYNAMIC_SAMPLING_ROUND_EVENT = "dynamic_sampling_round"  # further groups drawn for want of spread
DYNAMIC_SAMPLING_STOPPED_EVENT = "dynamic_sampling_stopped"  # a stop request ended the rounds
GUIDE_FAILED_EVENT = "guide_failed"  # the oracle raised while guiding: its members dropped, the groups kept
GUIDE_UNMATCHED_EVENT = "guide_unmatched"  # a recorded guide had no action for a member's prompt: dropped
GUIDE_DROPPED_EVENT = "guide_dropped"  # a guide raised or timed out on a member: that member dropped
ROLLOUT_AHEAD_DISCARDED_EVENT = "rollout_ahead_discarded"  # a rollout sampled ahead that failed at the end
# a call into a user's code (a task sampler, an env's get_task; quaero/bounded.py) still running: {call,
# elapsed_s, bound_s, what it has done}; one a stop request ended; an env's get_task past its bound
USER_CALL_WAITING_EVENT = "user_call_waiting"
USER_CALL_STOPPED_EVENT = "user_call_stopped"
TASK_SPECS_ABANDONED_EVENT = "task_specs_abandoned"
EVAL_PROGRESS_EVENT = "eval_progress"  # {done, tasks, elapsed_s}: a long evaluation is never silent
