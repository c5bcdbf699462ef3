"""Review a quaero run from Python: the same summary (a `RunSummary`, quaero/telemetry/summary.py) and proofs
as `quaero review`, plus a check of
your own (here: the ECHO share of trained tokens and the worst sampler-vs-trainer log-prob gap).

    python examples/review_metrics.py runs/toolbench
"""
import sys

from quaero.telemetry import proofs
from quaero.tools import review


def main(run_dir: str) -> int:
    run = review.load_run(run_dir)
    summary = review.summarize(run)
    for check in proofs.run_checks(summary):
        print(f"{check.status.upper():4s}  {check.name}: {check.detail}")
    trained = summary.action_tokens + summary.echo_tokens
    if summary.row_tokens:
        print(f"targets are {trained / summary.row_tokens:.1%} of row tokens "
              f"(ECHO {summary.echo_tokens}, action {summary.action_tokens}): the sparse regime the "
              "selective path is built for")
    print(f"worst sampler-vs-trainer log-prob gap: {summary.sampler_logprob_gap_max}")
    per_step = [(s["step"], s.get("echo_loss")) for s in run.steps]
    print("ECHO loss by step:", ", ".join(f"{k}:{v:.3f}" for k, v in per_step if v is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/toolbench"))
