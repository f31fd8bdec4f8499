"""Shared fixtures: every test gets its own catalog ($STREAMRL_HOME) and runs root.

Helpers live in tests/support/helpers.py; the tiers (unit / e2e / slurm) are set here from each
test's folder, with each tier's timeout and xdist group (see pytest_collection_modifyitems)."""

from __future__ import annotations

import os
import signal

import pytest
from support.helpers import rendezvous_in_thread, slurm_up

# Tests press Ctrl-C (SIGINT) on the processes they start. A shell starts a background command
# (`bash .ci/run &`) with SIGINT ignored, and an ignored signal stays ignored in every child, so
# those processes would never see it: take the default handler back, for this process and its
# children (exec resets a handled signal to the default; only an ignored one is inherited).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionstart(session):
    """Before any worker starts, make the models the shipped recipes build on first use (cached in
    ~/.cache/streamrl/models: nothing to do after the first run on a machine). On a fresh machine
    (CI) the first run that needed one warmed it up under the full suite's load: the agent recipe's
    800 supervised steps took ~60 s alone and 7.5 min inside the suite, holding up its worker.
    Only when the session includes engine tests, and only once (the controller, or a lone process)."""
    config = session.config
    if hasattr(config, "workerinput") or "not slow" in (config.getoption("markexpr") or ""):
        return
    targets = config.args or ["tests"]
    if not any(t.rstrip("/") in ("tests", ".", "tests/e2e", "tests/slurm") for t in targets):
        return
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.models.warmup import ensure_model
    from streamrl_cli.recipe.load import load

    say = config.pluginmanager.get_plugin("terminalreporter")
    for recipe in ("local", "local-agent"):
        r = load(recipe).recipe
        if os.path.exists(os.path.expanduser(r.model.path)):
            continue
        if say is not None:
            say.write_line(f"making {r.model.name} for the suite (first run on this machine): {r.model.path}")
        try:
            ensure_model(r.model, r.task)
        except (StreamRLError, OSError, RuntimeError, ValueError) as e:  # the tests that need it will say so
            if say is not None:
                say.write_line(f"could not make {r.model.name}: {e}")


@pytest.fixture(autouse=True)
def streamrl_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("STREAMRL_HOME", str(home))
    return home


@pytest.fixture
def runs_root(tmp_path):
    """Where a test's runs go; whatever a test leaves running (a failed assertion) is cancelled."""
    root = tmp_path / "runs"
    yield root
    from streamrl_cli.errors import StreamRLError
    from streamrl_cli.launch.run import cancel
    from streamrl_cli.rundir import RunDir

    for run_dir in root.glob("*/run.json"):
        run = RunDir(run_dir.parent)
        if run.info().get("state") in ("running", "created"):
            try:
                cancel(run, reason="test teardown")
            except StreamRLError:
                pass


@pytest.fixture(scope="module")
def rendezvous_server(tmp_path_factory):
    """A real rendezvous server on loopback shared by a module's tests: (authenticated client, run dir)."""
    run_dir = tmp_path_factory.mktemp("rendezvous")
    with rendezvous_in_thread(run_dir) as http:
        yield http, run_dir


@pytest.fixture
def refused_port():
    """A port on loopback where nothing listens, held by the test: connections to it are refused."""
    from support.weights_broadcast import closed_port

    with closed_port() as port:
        yield port


@pytest.fixture
def slurm():
    """The local test cluster. CI starts it (scripts/slurm-test-cluster.sh start): there it must be up."""
    if not slurm_up():
        if os.environ.get("CI"):
            pytest.fail("SLURM test cluster is not running: scripts/slurm-test-cluster.sh start")
        pytest.skip("SLURM test cluster is not running: scripts/slurm-test-cluster.sh start")


@pytest.fixture
def slurm_remote(slurm):
    if not slurm_up("remote"):
        if os.environ.get("CI"):
            pytest.fail("second SLURM test cluster `remote` is not running")
        pytest.skip("second SLURM test cluster `remote` is not running")


# The tiers, from each test's folder (docs/contributing.md):
#   tests/unit/   no SLURM; most need no engine (the fast tier: `make test-fast`, `-m "not slow"`)
#   tests/e2e/    real vLLM, DeepSpeed and local runs               -> marker slow
#   tests/slurm/  real runs on the two SLURM test clusters          -> markers slurm, slow
# A test that starts real engines or processes is `slow` wherever it lives; slow tests get a longer
# timeout (each scenario also checks its own deadline step by step).
SLOW_TIMEOUT_S = 900
TIER_ORDER = {"slurm": 0, "e2e": 1, "unit": 2}


def tier(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIER_ORDER else "unit"


# `make test` (-n 2) hands out scopes, longest first, to whichever worker is nearly done with its own
# (pytest_xdist_make_scheduler): the SLURM tier as one scope (two SLURM runs at once waited for each
# other's jobs to leave the test clusters' nodes and raced their timeouts), then the e2e modules in
# this order (the longest first, as summed from full runs' --durations; a module not listed comes
# after them), then the unit modules. The two workers then end within one short unit module of each
# other, whatever a machine makes of each module's length.
E2E_LONGEST_FIRST = tuple(
    f"tests/e2e/{m}.py"
    for m in (
        "test_local_faults",
        "test_agent_e2e",
        "test_long_tail_e2e",
        "test_distill_e2e",
        "test_trainer_e2e",
        "test_generator_elastic",
        "test_user_task_e2e",
        "test_planner_profile",
        "test_member_failures",
        "test_generator_role",
        "test_generator_relay",
        "test_generator_engine",
        "test_sampling",
        "test_skew_lpt",
        "test_generator_lora",
        "test_trainer_learner",
        "test_chaos",
        "test_trainer_lora",
        "test_install",
        "test_export",
    )
)
# The modules on the session's shared engine (tests/e2e/conftest.py): one scope, one engine start.
SHARED_ENGINE = frozenset(
    f"tests/e2e/{m}.py" for m in ("test_generator_engine", "test_sampling", "test_skew_lpt")
)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def order(nodeid: str) -> tuple[int, int]:
    t, module = tier(nodeid), module_of(nodeid)
    if t != "e2e":
        return TIER_ORDER[t], 0
    known = module in E2E_LONGEST_FIRST
    return TIER_ORDER[t], E2E_LONGEST_FIRST.index(module) if known else len(E2E_LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    for item in items:
        t = tier(item.nodeid)
        if t == "slurm":
            item.add_marker(pytest.mark.slurm)
        if t in ("e2e", "slurm"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    # SLURM, then e2e longest first, then unit: the order scopes go out in (stable: a module's tests
    # keep their file order)
    items.sort(key=lambda item: order(item.nodeid))


def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (make test): scopes go out in collection order (the sort above), each to the worker
    that is nearly through its own: the SLURM tier is one scope, the shared-engine e2e modules one,
    every other module its own (a module's tests stay on one worker: some run in order on one
    module fixture). One worker takes the SLURM scope first; the other takes the e2e modules, longest
    first, and the unit modules; when the SLURM scope is done its worker takes what is left.
    `make test-fast` (unit tier only) spreads the modules over both workers the same way."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):  # type: ignore[no-untyped-def]
            config.option.loadscopereorder = False  # keep collection order: the longest first
            super().__init__(config, log)

        def _split_scope(self, nodeid: str) -> str:
            module = module_of(nodeid)
            if tier(nodeid) == "slurm":
                return "slurm"
            return "shared-engine" if module in SHARED_ENGINE else module

    return TierScheduling(config, log)
