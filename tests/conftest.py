import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.proc import RedisServer, stop_all  # noqa: E402
from harness.stack import Stack  # noqa: E402


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
def stack_factory(tmp_path):
    """`stack_factory(plugin_config=None, envoys=1, **Stack kwargs)` -> a started Stack.

    Each stack lives under tmp_path; all of them are stopped at teardown, also on failure.
    """
    stacks: list[Stack] = []

    def make(plugin_config=None, envoys: int = 1, **kwargs) -> Stack:
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
