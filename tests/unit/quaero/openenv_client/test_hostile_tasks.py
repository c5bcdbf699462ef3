"""OpenEnv's Task API read by quaero (quaero/openenv_client/tasks.py) from a hostile env: discovery that
blocks is bounded by [env] reset_timeout_s and named, and a task count is strictly a non-negative int, in
process and over HTTP (a local stand-in server answering what OpenEnv's routes answer)."""
import math
import time

import pytest
from fixtures import hostile_tasks
from fixtures.rollout import make_cfg
from fixtures.taskenv import SumEnv

from quaero.config import ConfigError
from quaero.openenv_client.tasks import catalog_of, catalog_over_http, check_lines

pytestmark = pytest.mark.hostile


@pytest.fixture
def release():
    hostile_tasks.RELEASE.clear()
    yield
    hostile_tasks.RELEASE.set()  # the abandoned discovery threads end


@pytest.mark.parametrize("cls, method", [("BlockingSplitsEnv", "list_splits()"),
                                         ("BlockingCountEnv", "num_tasks('test')")])
def test_discovery_that_blocks_is_bounded_and_named_at_check(release, cls, method):
    cfg = make_cfg(env__entry=f"fixtures.hostile_tasks:{cls}", env__reset_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_lines(cfg)
    assert time.monotonic() - t0 < 3
    assert str(e.value).startswith(f"[env] {cls}.{method} (OpenEnv's Task API) did not answer within "
                                   "0.5s ([env] reset_timeout_s bounds task discovery)")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("count", [2.7, "3", math.nan, True, -1, None])
def test_a_task_count_that_is_not_a_non_negative_int_is_one_line_naming_it(count):
    with pytest.raises(ConfigError) as e:
        catalog_of(hostile_tasks.CountEnv(count))
    assert str(e.value) == (f"[env] CountEnv: num_tasks('train') returned {count!r} "
                            f"({type(count).__name__}), not "
                            "a non-negative int; return the split's task count as an int")


def test_a_good_env_still_reads():
    assert catalog_of(SumEnv(), timeout_s=5).splits == {"train": 5, "test": 3}


@pytest.mark.parametrize("count, shown", [(math.nan, "nan"), (2.7, "2.7"), ("3", "'3'")])
def test_over_http_a_task_count_that_is_not_an_int_is_named_not_blamed_on_the_server(http_server, count,
                                                                                     shown):
    def routes(method, path, body):
        return {"/list_environments": (200, ["sumenv"]), "/sumenv/splits": (200, ["train"]),
                "/sumenv/num_tasks": (200, {"num_tasks": count})}.get(path, (404, b""))

    url = http_server(routes)
    with pytest.raises(ConfigError) as e:
        catalog_over_http(url)
    assert str(e.value).startswith(f"[env] {url}: its Task API's num_tasks('train') returned {shown} (")
    assert "OpenEnv server running there" not in str(e.value)


def test_an_http_500_from_the_task_api_points_at_the_env_not_only_at_discovery(http_server):
    """A server whose env cannot be built answers every Task API route 500; the error blamed
    list_splits/num_tasks
    alone, though the construction failed."""
    url = http_server(lambda method, path, body: (200, ["sumenv"]) if path == "/list_environments"
                      else (500, b"Internal Server Error"))
    with pytest.raises(ConfigError) as e:
        catalog_over_http(url)
    assert str(e.value) == (f"[env] {url}: its Task API answered HTTP 500 (Internal Server Error): the env "
                            "raised "
                            "in the server, building an instance for the session or in "
                            "list_splits/num_tasks; the "
                            "server's log has the traceback")


@pytest.mark.hostile
def test_an_in_process_get_task_that_never_returns_is_abandoned_at_its_bound_and_logged_once():
    """The spec read was unbounded: a learning sampler keyed by `group` hung in its first draw forever."""
    import time

    import structlog
    from fixtures import hostile_samplers

    from quaero.openenv_client.loading import load_entry
    from quaero.openenv_client.tasks import TaskSpecs

    hostile_samplers.RELEASE.clear()
    try:
        specs = TaskSpecs(load_entry("fixtures.hostile_samplers:HangingSpecEnv"), timeout_s=0.3)
        t0 = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            assert specs("train", 0) == {} and specs("train", 1) == {} and specs("train", 2) == {}
        assert time.monotonic() - t0 < 2  # one bound, then no more waits
        (line,) = [e for e in logs if e["event"] == "task_specs_abandoned"]
        assert "get_task('train', 0) did not return within 0.3s ([env] reset_timeout_s)" in line["error"]
        specs.close()  # left to its stuck thread: returns at once
    finally:
        hostile_samplers.RELEASE.set()
