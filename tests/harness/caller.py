"""The caller's sidecar: a plain Envoy (no filter) in front of a guarded Envoy, whose one route
retries as a mesh's outbound route does.

    caller = Caller(workdir, guarded.port, ISTIO_DEFAULT_RETRY).start()
    caller.request("POST", "/orders", headers={...})
    caller.retries()          # cluster.guarded.upstream_rq_retry
    caller.stop()

Every request goes to the cluster `guarded` (the guarded Envoy's listener) in the protocol it
came in (HTTP/1.1 stays HTTP/1.1, h2c gRPC stays HTTP/2), as a sidecar forwards it, under the
route's `retry_policy`. The listener and admin ports are the kernel's; the process is stopped
by its pid.

The policies Istio gives an outbound route that no VirtualService configures (istio/istio,
pilot/pkg/networking/core/route/retry/retry.go): two retries on `connect-failure`,
`refused-stream`, gRPC `unavailable` and `cancelled`, and `retriable-status-codes`, preferring
hosts not tried yet. Up to Istio 1.23 the status codes are `[503]` (`ISTIO_DEFAULT_RETRY`);
from 1.24 none by default (`ISTIO_124_DEFAULT_RETRY`; `EXCLUDE_UNSAFE_503_FROM_DEFAULT_RETRY`,
which `compatibilityVersion: 1.23` turns off), so there an HTTP `503` is retried only where a
VirtualService asks for it, while a gRPC `UNAVAILABLE` still is by default. `retry_policy()`
builds an operator's own.
"""

from __future__ import annotations

from pathlib import Path

from .envoy import DEFAULT_WASM, Envoy

CLUSTER = "guarded"

PREVIOUS_HOSTS = {
    "name": "envoy.retry_host_predicates.previous_hosts",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
    },
}


def retry_policy(retry_on: str, status_codes: list[int], num_retries: int = 2) -> dict:
    """A route's retry policy in the shape Istio writes it: `retry_on` and
    `retriable_status_codes` as given, the previous-hosts predicate, 5 host selections."""
    policy = {"retry_on": retry_on, "num_retries": num_retries,
              "retry_host_predicate": [PREVIOUS_HOSTS], "host_selection_retry_max_attempts": 5}
    if status_codes:
        policy["retriable_status_codes"] = list(status_codes)
    return policy


ISTIO_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
ISTIO_DEFAULT_RETRY = retry_policy(ISTIO_RETRY_ON, [503])
ISTIO_124_DEFAULT_RETRY = retry_policy(ISTIO_RETRY_ON, [])


def caller_config(target_port: int, policy: dict | None, suppress_envoy_headers: bool = False) -> dict:
    """The caller's Envoy config: one listener, every path to `guarded` under `policy` (none:
    no retries); `suppress_envoy_headers` on its router, as a mesh that turns Envoy's debug
    headers off has it."""
    route: dict = {"cluster": CLUSTER, "timeout": "15s"}
    if policy is not None:
        route["retry_policy"] = policy
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "caller",
        "codec_type": "AUTO",
        "route_config": {"name": "outbound", "virtual_hosts": [{
            "name": "guarded", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": suppress_envoy_headers}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "outbound",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": [{
                "name": CLUSTER,
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "use_downstream_protocol_config": {
                            "http_protocol_options": {}, "http2_protocol_options": {}},
                    }
                },
                "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {
                        "address": "127.0.0.1", "port_value": target_port}}}}]}]},
            }],
        },
    }


class Caller(Envoy):
    """The caller's Envoy process: `Envoy`'s start, stop, stats and request, on
    `caller_config` instead of the guarded template."""

    def __init__(self, workdir: Path, target_port: int, policy: dict | None, *,
                 suppress_envoy_headers: bool = False, concurrency: int = 1):
        # Not Envoy.__init__: that renders the guarded template (and reserves its ports).
        self.workdir = Path(workdir).resolve()
        self.process_env = None
        self.plugin_config = None
        self.wasm_path = DEFAULT_WASM
        self.concurrency = concurrency
        self.log_level = "info"
        self._dead_socket = None
        self.ports = {}
        self.config = caller_config(target_port, policy, suppress_envoy_headers)
        self.config_path = self.workdir / "envoy.yaml"
        self.admin_address_path = self.workdir / "admin.address"
        self.proc = None
        self.port = None
        self.admin_port = None

    def cluster_stat(self, name: str) -> int:
        """A counter of the cluster `guarded` (e.g. `upstream_rq_total`)."""
        return self.stat(f"cluster.{CLUSTER}.{name}")

    def retries(self) -> int:
        """How many times this caller sent a request again (`upstream_rq_retry`)."""
        return self.cluster_stat("upstream_rq_retry")
