import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.cluster import ClusterBackend  # noqa: E402
from harness.proc import RedisServer, stop_all  # noqa: E402
from harness.stack import Stack  # noqa: E402

# --- topologies ---------------------------------------------------------------------------------
# A suite marked `pytestmark = pytest.mark.topologies("single", "cluster")` runs every test that
# builds its stacks through the `topology` fixture (stack_factory does) once per topology:
#   single   one redis-server behind one webdis (a stack of its own)
#   cluster  Redis Cluster (3 masters, 3 replicas) behind Envoy's redis_proxy behind two webdis,
#            started once per module and emptied for each stack (harness/cluster.py)
# A test (or a parametrize case, through pytest.param marks) marked `topologies("single")` runs
# on that topology only; the reason goes in the marker's `reason`. `--topology` picks one.
TOPOLOGIES = ("single", "cluster")


def pytest_addoption(parser):
    parser.addoption("--topology", choices=("all", *TOPOLOGIES), default="all",
                     help="run the topology-parametrised e2e suites on this topology only")


def pytest_configure(config):
    config.addinivalue_line("markers", "topologies(*names, reason=''): the Redis topologies a "
                            "suite or test runs on (single, cluster)")


def _module_topologies(module) -> tuple[str, ...]:
    marks = getattr(module, "pytestmark", [])
    marks = marks if isinstance(marks, list) else [marks]
    for mark in marks:
        if mark.name == "topologies":
            return tuple(mark.args)
    return ()


def pytest_generate_tests(metafunc):
    if "topology" not in metafunc.fixturenames:
        return
    names = _module_topologies(metafunc.module)
    if names:
        unknown = set(names) - set(TOPOLOGIES)
        if unknown:
            raise ValueError(f"unknown topologies {sorted(unknown)}; known: {TOPOLOGIES}")
        metafunc.parametrize("topology", names, indirect=True, scope="module")


def pytest_collection_modifyitems(config, items):
    chosen = config.getoption("--topology")
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("topology") if callspec else None
        marker = item.get_closest_marker("topologies")
        if name is not None and ((chosen != "all" and name != chosen)
                                 or (marker is not None and name not in marker.args)):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class Topology:
    """What a stack is built on: `Stack(..., **topology.stack_kwargs)`."""

    def __init__(self, name: str, cluster: ClusterBackend | None = None):
        self.name, self.cluster = name, cluster

    @property
    def stack_kwargs(self) -> dict:
        return {"cluster": self.cluster} if self.cluster is not None else {}

    def __repr__(self) -> str:
        return self.name


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """Redis Cluster behind redis_proxy behind two webdis, for one module."""
    backend = ClusterBackend(tmp_path_factory.mktemp("redis-cluster")).start()
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def topology(request) -> Topology:
    """The topology of the module's current parametrisation (`single` where not parametrised)."""
    name = getattr(request, "param", "single")
    if name == "cluster":
        return Topology(name, request.getfixturevalue("redis_cluster"))
    return Topology(name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def gateway(redis_server, redis_client):
    """redis-py as the gateway user (keys `cg:*`, only GATEWAY_COMMANDS), on an empty Redis:
    a script it runs has exactly the permissions the filter's scripts have through webdis."""
    client = redis_server.gateway_client()
    yield client
    client.close()


@pytest.fixture
def stack_factory(tmp_path, topology):
    """`stack_factory(plugin_config=None, envoys=1, **Stack kwargs)` -> a started Stack.

    Each stack lives under tmp_path, on the module's topology; all of them are stopped at
    teardown, also on failure.
    """
    stacks: list[Stack] = []

    def make(plugin_config=None, envoys: int = 1, **kwargs) -> Stack:
        kwargs = {**topology.stack_kwargs, **kwargs}
        stack = Stack(tmp_path / f"stack-{len(stacks)}", plugin_config, envoys, **kwargs)
        stacks.append(stack)
        return stack.start()

    yield make
    errors = []
    for stack in reversed(stacks):
        try:
            stack.stop()
        except Exception as e:  # stop the others before reporting
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture
def sidecars():
    """`sidecars(stack, plugin_config, key_prefix, **variant) -> Envoy`: one more Envoy on a
    (shared) stack for this test, with `envoy.key_prefix`; stopped and taken off the stack when
    the test ends, also on failure. `variant` goes to the Envoy (routes, extra clusters, ...)."""
    started = []

    def add(stack: Stack, plugin_config: dict, key_prefix: str, **variant):
        envoy = stack.add_envoy(plugin_config, **variant)
        envoy.key_prefix = key_prefix
        started.append((stack, envoy))
        return envoy

    yield add
    for stack, envoy in reversed(started):
        envoy.stop()
        if envoy in stack.envoys:
            stack.envoys.remove(envoy)


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_run():
    """Safety net: whatever a test started and did not stop is stopped (by pid) at the end."""
    yield
    leftovers = stop_all()
    if leftovers:
        print(f"\nharness: stopped processes left running by tests: {', '.join(leftovers)}",
              file=sys.stderr)
