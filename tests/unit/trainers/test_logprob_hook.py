"""`TrainerSpec.logprob_fn`, the trainer's log-prob hook (trainers/step.py): another function of
`selected_logprobs`' signature in its place, resolved once when the trainer is built; a name that is no
function fails there, in one line. tests/integration/test_bench.py runs a whole step through it."""
import pytest

from trainers.selective import selected_logprobs
from trainers.step import logprob_function


def test_no_name_is_the_selective_path_and_a_name_is_its_function():
    assert logprob_function("") is selected_logprobs
    assert logprob_function("trainers.selective:full_logprobs").__name__ == "full_logprobs"


def test_a_logprob_hook_that_names_no_function_fails_in_one_line():
    for name, missing in (("trainers.selective:nothing", "has no attribute 'nothing'"),
                          ("no_such_module:f", "cannot import module 'no_such_module'"),
                          ("trainers.selective", "expected 'package.module:Name'"),
                          ("trainers.selective:AUTO_CHUNK_ROWS", ("is a int, not a function with the "
                                                                 "signature"))):
        with pytest.raises(ValueError, match=f"TrainerSpec.logprob_fn={name!r}: ") as e:
            logprob_function(name)
        assert missing in str(e.value) and "\n" not in str(e.value)
