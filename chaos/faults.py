"""The faults of a chaos run, each drawn from a seeded random source and undone on demand.

    fault = FAULTS["redis_pause_long"](rng, target)   # parameters drawn from rng now
    params = fault.inject()                           # the fault starts; params go to the history
    ...                                               # the workload runs meanwhile
    fault.heal()                                      # undone; idempotent
    target.healthy(60)                                # once every fault of a schedule healed

A fault draws everything it will do (which node, how long, which variant) in its constructor,
from the `random.Random` it is given and nothing else, so a schedule drawn from a printed seed
does the same again. A Redis process is drawn by its place among the target's nodes (a new
cluster's first three are its masters), never by its port, which differs from run to run. Keyword arguments to the constructor fix a parameter instead of drawing it
(for tests, and to replay one fault); the parameters are `fault.params`. Fixing one does not
draw the others again.

What a fault promises beyond the interface (`kind`, `topologies`, `data_loss`, `inject`,
`heal`):

- `fault.resource` names the part it takes (`redis:<port>`, `webdis:<i>`, `envoy:<i>`,
  `gateway`, `scripts`, `config`). Two faults on one resource at once are allowed (every
  kill and start is a no-op on a process already down or up) but make a weaker schedule (a
  heal of one undoes the other's), so a run should not draw them together. Faults on
  different resources combine freely.
- `heal()` undoes its own fault and waits until its own part is back (the process runs, the
  pause is over); it does not wait for parts another fault still holds down. Once every fault
  of a schedule healed, `target.healthy(timeout)` waits until the whole stack works again.
- `data_loss` is set per fault (a class default, refined once the parameters are drawn): true
  where the fault may lose writes Redis acknowledged, the documented weaker case: a Redis
  restarted without persistence, a cluster master killed (a failover promotes a replica that
  may lack its last writes), a cluster node restarted empty.

The kinds (`FAULTS`):

| kind | topologies | what it does |
|---|---|---|
| `redis_pause_short` | both | `CLIENT PAUSE` (ALL or WRITE; EVAL waits either way) shorter than the filter's Redis timeout; cluster: one master |
| `redis_pause_long` | both | the same, 3 to 30 times the timeout (at most 3 s): the filter gives up. Heal lifts a WRITE pause at once and waits for the end of an ALL pause (CLIENT UNPAUSE waits behind it) |
| `redis_restart_persistent` | both | SIGKILL one Redis process (cluster: any node), started again on heal with its append-only file (every acknowledged write) |
| `redis_restart_volatile` | both | the same, its data removed before the start: it comes back empty |
| `cluster_failover` | cluster | SIGKILL a master; on heal, once its replica took over, the old master starts again and rejoins as a replica |
| `webdis_restart` | both | SIGKILL one webdis, started again on its port on heal |
| `gateway_delay` | both | the network between the Envoys and webdis delays every piece each way, shorter or longer than the timeout in all (`beyond_timeout`), with jitter |
| `gateway_cut` | both | that network cut: connections reset (`reset`), or nothing passing until the heal delivers it late (`hold`, a partition) |
| `envoy_restart` | both | SIGKILL one Envoy, started again on its ports on heal |
| `script_flush` | both | `SCRIPT FLUSH` on every Redis process (SYNC or ASYNC); nothing to heal |
| `config_reload` | both | a new filter configuration for one or both Envoys through ECDS: the same one spelled otherwise, the same in a new VM, or one of `target.config_variants`; heal hands back the configuration in force |

Client resets are the workload's, not faults here.
"""

from __future__ import annotations

import json
import random
import time

import chaos  # noqa: F401  (tests/ on sys.path)
from chaos.target import TOPOLOGIES, Target
from harness.cluster import SLOTS
from harness.proc import RedisServer

BOTH = frozenset(TOPOLOGIES)
# The longest CLIENT PAUSE: a pause in ALL mode cannot be lifted early (CLIENT UNPAUSE waits
# behind it like every other command), so its heal waits for its end.
MAX_PAUSE_MS = 3000


class Fault:
    """One fault of a schedule: parameters drawn at construction, `inject()`, `heal()`."""

    kind = ""
    topologies: frozenset[str] = BOTH
    data_loss = False

    def __init__(self, rng: random.Random, target: Target, **fixed):
        if target.topology not in self.topologies:
            raise ValueError(f"{self.kind} does not apply to the {target.topology} topology")
        self.rng = rng
        self.target = target
        self.params: dict = {}
        self.resource = ""
        self.injected = False
        self.healed = False
        self.draw()
        unknown = set(fixed) - set(self.params)
        if unknown:
            raise TypeError(f"{self.kind} has no parameters {sorted(unknown)}; "
                            f"it has {sorted(self.params)}")
        self.params.update(fixed)
        self.settle()

    def draw(self) -> None:
        """Fill `self.params` from `self.rng` (subclasses)."""

    def settle(self) -> None:
        """Derive what follows from the parameters (the resource, data_loss)."""

    def inject(self) -> dict:
        """Start the fault; its parameters for the history."""
        if self.injected:
            raise RuntimeError(f"{self.kind} was injected already")
        self.injected = True
        self.started = time.monotonic()
        self._inject()
        return {"kind": self.kind, "resource": self.resource, "data_loss": self.data_loss,
                **self.params}

    def heal(self) -> None:
        """Undo the fault (idempotent; nothing if it was never injected)."""
        if not self.injected or self.healed:
            return
        self._heal()
        self.healed = True

    def _inject(self) -> None:
        raise NotImplementedError

    def _heal(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{self.kind}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    # --- helpers -----------------------------------------------------------------------------

    # Redis processes are drawn by their place in `target.redis_nodes()` (a cluster's first
    # three nodes start as its masters), not by port: ports differ from run to run, places
    # and roles do not, so a seed draws the same nodes again.

    @property
    def node(self) -> RedisServer:
        """The Redis process of the fault (parameter `node`, its place)."""
        return self.target.redis_nodes()[self.params["node"]]

    def _master_places(self) -> list[int]:
        masters = {n.port for n in self.target.masters()}
        return [i for i, n in enumerate(self.target.redis_nodes()) if n.port in masters]

    def _settle_node(self) -> None:
        self.params["port"] = self.node.port
        self.resource = f"redis:{self.node.port}"


def _command(node: RedisServer, *args, timeout: float = 5.0):
    """One command on one Redis process as the admin user; None if it is unreachable."""
    import redis

    client = node.client()
    client.connection_pool.connection_kwargs["socket_timeout"] = timeout
    try:
        return client.execute_command(*args)
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return None
    finally:
        client.close()


# --- Redis paused ------------------------------------------------------------------------------


class _RedisPause(Fault):
    # Of the filter's Redis timeout: (low, high) factors of the pause.
    factors = (0.0, 0.0)

    def draw(self) -> None:
        timeout_ms = self.target.redis_timeout * 1000
        low, high = self.factors
        pause = self.rng.uniform(low * timeout_ms, high * timeout_ms)
        self.params = {"node": self.rng.choice(self._master_places()),
                       "pause_ms": max(1, min(MAX_PAUSE_MS, int(pause))),
                       "mode": self.rng.choice(["ALL", "WRITE"])}

    def settle(self) -> None:
        self._settle_node()

    def _inject(self) -> None:
        _command(self.node, "CLIENT", "PAUSE", self.params["pause_ms"],
                 self.params["mode"])

    def _heal(self) -> None:
        node = self.node
        end = self.started + self.params["pause_ms"] / 1000
        if self.params["mode"] == "WRITE":
            _command(node, "CLIENT", "UNPAUSE")
        else:
            time.sleep(max(0.0, end - time.monotonic()))
        # Over once a command runs again (or the node is down: another fault's).
        _command(node, "PING", timeout=MAX_PAUSE_MS / 1000 + 2)


class RedisPauseShort(_RedisPause):
    """Shorter than the filter's timeout: calls are slow, none should fail."""

    kind = "redis_pause_short"
    factors = (0.2, 0.5)


class RedisPauseLong(_RedisPause):
    """Longer than the filter's timeout: calls fail, and may still run once it ends."""

    kind = "redis_pause_long"
    factors = (3.0, 30.0)


# --- Redis killed and started again ------------------------------------------------------------


class _RedisRestart(Fault):
    keep_data = True

    def draw(self) -> None:
        self.params = {"node": self.rng.randrange(len(self.target.redis_nodes()))}

    def settle(self) -> None:
        self._settle_node()
        if self.target.topology == "single":
            self.data_loss = not self.keep_data
        else:
            # A master down longer than the node timeout is failed over to its replica, which
            # may lack its last writes; one that comes back empty in time empties its replica.
            # A replica restarted empty copies its master again: nothing is lost.
            master = self.params["node"] in self._master_places()
            self.data_loss = master
            self.params["role"] = "master" if master else "replica"

    def _inject(self) -> None:
        self.target.kill_redis(self.node)

    def _heal(self) -> None:
        self.target.start_redis(self.node, keep_data=self.keep_data)


class RedisRestartPersistent(_RedisRestart):
    kind = "redis_restart_persistent"
    keep_data = True


class RedisRestartVolatile(_RedisRestart):
    kind = "redis_restart_volatile"
    keep_data = False


class ClusterFailover(Fault):
    """A master killed; its replica takes over; the old master rejoins as a replica."""

    kind = "cluster_failover"
    topologies = frozenset({"cluster"})
    data_loss = True

    def draw(self) -> None:
        self.params = {"node": self.rng.choice(self._master_places())}

    def settle(self) -> None:
        self._settle_node()

    def _inject(self) -> None:
        node = self.node
        self.slots = self.target.cluster.masters().get(node.port, [])
        self.target.kill_redis(node)

    def _heal(self) -> None:
        cluster = self.target.cluster
        port = self.node.port
        # The replica is elected after the node timeout (and up to a second or two more); if it
        # cannot be (it is down too), the old master comes back as the master it was.
        deadline = time.monotonic() + self.target.node_timeout_ms / 1000 + 10
        self.params["promoted"] = None
        while time.monotonic() < deadline:
            try:
                masters = cluster.masters()
                covered = sum(hi - lo + 1 for ranges in masters.values() for lo, hi in ranges)
                if port not in masters and covered == SLOTS:
                    self.params["promoted"] = next(
                        (p for p, r in masters.items() if self.slots and self.slots[0] in r), None)
                    break
            except Exception:  # a node's view while it changes
                pass
            time.sleep(0.1)
        node = self.node
        self.target.start_redis(node, keep_data=True)
        # Until it knows its new role: a replica whose link is up (or the master it still is).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            info = _command(node, "INFO", "replication") or {}
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                return
            if info.get("role") == "master" and self.params["promoted"] is None:
                return
            time.sleep(0.1)


# --- webdis, the gateway's network, Envoy ------------------------------------------------------


class WebdisRestart(Fault):
    kind = "webdis_restart"

    def draw(self) -> None:
        self.params = {"webdis": self.rng.randrange(len(self.target.webdis))}

    def settle(self) -> None:
        self.resource = f"webdis:{self.params['webdis']}"

    def _inject(self) -> None:
        self.target.kill_webdis(self.params["webdis"])

    def _heal(self) -> None:
        self.target.start_webdis(self.params["webdis"])


class GatewayDelay(Fault):
    """Every piece of data between the Envoys and webdis held a while, each way."""

    kind = "gateway_delay"

    def draw(self) -> None:
        timeout_ms = self.target.redis_timeout * 1000
        beyond = self.rng.random() < 0.5
        # A call crosses the network twice: the delay each way is half the round trip's.
        round_trip = self.rng.uniform(1.5, 6.0) if beyond else self.rng.uniform(0.1, 0.5)
        delay = round_trip * timeout_ms / 2
        self.params = {"beyond_timeout": beyond, "delay_ms": round(delay, 1),
                       "jitter_ms": round(self.rng.uniform(0, delay / 5), 1)}

    def settle(self) -> None:
        self.resource = "gateway"

    def _inject(self) -> None:
        self.target.netproxy.delay(self.params["delay_ms"], self.params["jitter_ms"])

    def _heal(self) -> None:
        self.target.netproxy.passing()


class GatewayCut(Fault):
    kind = "gateway_cut"

    def draw(self) -> None:
        self.params = {"how": self.rng.choice(["reset", "hold"])}

    def settle(self) -> None:
        self.resource = "gateway"

    def _inject(self) -> None:
        self.target.netproxy.cut(self.params["how"])

    def _heal(self) -> None:
        self.target.netproxy.passing()


class EnvoyRestart(Fault):
    kind = "envoy_restart"

    def draw(self) -> None:
        self.params = {"envoy": self.rng.randrange(len(self.target.envoys))}

    def settle(self) -> None:
        self.resource = f"envoy:{self.params['envoy']}"

    def _inject(self) -> None:
        self.target.kill_envoy(self.params["envoy"])

    def _heal(self) -> None:
        self.target.start_envoy(self.params["envoy"])


# --- scripts and configuration -----------------------------------------------------------------


class ScriptFlush(Fault):
    kind = "script_flush"

    def draw(self) -> None:
        self.params = {"mode": self.rng.choice(["SYNC", "ASYNC"])}

    def settle(self) -> None:
        self.resource = "scripts"

    def _inject(self) -> None:
        for node in self.target.redis_nodes():
            if node.alive():
                _command(node, "SCRIPT", "FLUSH", self.params["mode"])


class ConfigReload(Fault):
    """The filter's configuration handed again through ECDS, while requests run."""

    kind = "config_reload"

    def draw(self) -> None:
        variants = ["reformatted", "new_vm"]
        if self.target.config_variants:
            variants.append("changed")
        variant = self.rng.choice(variants)
        envoys = list(range(len(self.target.envoys)))
        chosen = envoys if self.rng.random() < 0.5 else [self.rng.choice(envoys)]
        # Both drawn whatever the variant, so fixing the variant finds them.
        self.params = {"variant": variant, "envoys": chosen,
                       "changed": (self.rng.randrange(len(self.target.config_variants))
                                   if self.target.config_variants else None),
                       "vm_id": f"coordination-guard-{self.rng.randrange(1 << 30):08x}"}

    def settle(self) -> None:
        self.resource = "config"
        if self.params["variant"] != "new_vm":
            self.params["vm_id"] = None
        if self.params["variant"] != "changed":
            self.params["changed"] = None

    def _inject(self) -> None:
        variant = self.params["variant"]
        if variant == "changed":
            config = self.target.config_variants[self.params["changed"]]
        else:
            # The configuration in force, spelled otherwise (keys sorted, other white space):
            # another resource to Envoy, the same configuration to the filter.
            config = json.dumps(self.target.plugin_config, sort_keys=True, indent=1)
        self.target.reload_config(config, self.params["envoys"], vm_id=self.params["vm_id"])

    def _heal(self) -> None:
        self.target.reload_config(None, self.params["envoys"])


FAULTS: dict[str, type[Fault]] = {cls.kind: cls for cls in (
    RedisPauseShort, RedisPauseLong, RedisRestartPersistent, RedisRestartVolatile,
    ClusterFailover, WebdisRestart, GatewayDelay, GatewayCut, EnvoyRestart, ScriptFlush,
    ConfigReload,
)}


def kinds_for(topology: str) -> list[str]:
    """The kinds that apply to `topology`, in FAULTS's order."""
    return [kind for kind, cls in FAULTS.items() if topology in cls.topologies]
