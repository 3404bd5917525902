"""`make check PLUGIN=...`: the filter's own validation, natively, without Envoy.

Exit 0 with a summary for a valid configuration; exit 1 with exactly the error the filter logs
in Envoy (checked against real Envoy for the same file); exit 2 for a file it cannot read, or
that holds no plugin of this module, or only a template's placeholder.

The file is what a user deploys: the plugin JSON, a WasmPlugin (its pluginConfig and the
vmConfig.env its variables must be declared in), or an Envoy config (every Wasm filter of this
module, an EnvoyFilter's patches too); every one the repository ships is checked here.

Warnings (stderr, exit status unchanged) name what the file around the configuration gets
wrong: a WasmPlugin without a direction in `match` (it would guard the workload's outbound
calls too), one aimed at a gateway with only `mode: SERVER` (it would never run there), and a
module `sha256` of zeros. The shipped manifests carry that placeholder, so each of them is
warned about it, and about nothing else.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml  # PyYAML, from tests/requirements.txt

from harness.calendar import tzdata_rule
from harness.envoy import DEFAULT_WASM, PLUGIN_PLACEHOLDER, substitute, wasm_filter
from harness.proc import ROOT

DEMO_PLUGIN = ROOT / "envoy" / "demo-plugin.json"
WASMPLUGIN = ROOT / "deploy" / "istio" / "wasmplugin.yaml"
GATEWAY_WASMPLUGIN = ROOT / "deploy" / "istio" / "gateway" / "wasmplugin.yaml"
ENVOYFILTER = ROOT / "deploy" / "istio" / "body-fingerprints" / "envoyfilter.yaml"
TEMPLATES = [ROOT / "envoy" / "template.yaml", ROOT / "envoy" / "demo.yaml"]
# Shipped files that hold no coordination-guard plugin: checked, and said so (exit 2).
NO_PLUGIN = [ROOT / "envoy" / "redis-cluster-proxy.yaml", ROOT / "deploy" / "istio" / "webdis.yaml",
             ROOT / "deploy" / "istio" / "stats-bootstrap.yaml",
             ROOT / "deploy" / "istio" / "patches" / "workload.yaml",
             ROOT / "deploy" / "istio" / "patches" / "workload-undo.yaml",
             ROOT / "deploy" / "istio" / "namespaces.yaml", ROOT / "deploy" / "istio" / "redis.yaml",
             *(ROOT / "deploy" / "istio" / "gateway" / name
               for name in ("gateway.yaml", "requestauthentication.yaml", "webdis-access.yaml"))]


def make_check(plugin: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "check", f"PLUGIN={plugin}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def cg_check(plugin: str) -> subprocess.CompletedProcess:
    """The checker itself (make's own exit status is 2 for any failure)."""
    return subprocess.run(["cargo", "run", "--quiet", "--bin", "cg-check", "--", plugin], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_demo_config_is_valid_and_summarised():
    r = make_check(str(DEMO_PLUGIN))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith(f"{DEMO_PLUGIN}: valid\n"), out
    for want in ("redis: cluster redis_gateway", "policy 1 activate-order: POST, path /orders/*",
                 "lease on tenant + path_segment:2 (per tenant) for 10s, busy: 409",
                 "policy 2 create-order: POST, path /orders*",
                 "limit user-burst: 2 per 1s by tenant + principal (token bucket, burst 3)",
                 "idempotency: idempotency-key on POST (optional)",
                 "credential inline (shown in /config_dump: prefer authorization_env)"):
        assert want in out, (want, out)
    assert len(out.splitlines()) <= 30, "one screen"


def test_a_mistake_gives_the_filters_own_error_and_exit_1(tmp_path, stack_factory):
    plugin = json.loads(DEMO_PLUGIN.read_text())
    plugin["policies"][1]["rate_limits"][0]["window"] = "5x"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plugin))
    r = cg_check(str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    error = 'policies[1].rate_limits[0].window: "5x" is not a duration (use e.g. "250ms", "2s", "1m", "24h")'
    assert r.stderr.strip() == f"{path}: invalid plugin configuration: {error}", r.stderr
    made = make_check(str(path))
    assert made.returncode != 0 and f"invalid plugin configuration: {error}" in made.stderr
    # Envoy running the filter logs the same words.
    stack = stack_factory(None, envoys=0)
    plugin["redis"] = {**plugin["redis"], **stack.redis_section(key_prefix="cg:check")}
    code, log = stack.envoy_expect_failure(plugin)
    assert f"invalid plugin configuration: {error}" in log, log[-2000:]


def test_an_unreadable_file_is_exit_2(tmp_path):
    r = cg_check(str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr
    r = subprocess.run(["make", "--no-print-directory", "check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "usage: make check PLUGIN=" in r.stdout + r.stderr


# --- what a user deploys: every shipped manifest and Envoy config ----------------------------------

def shipped_files() -> set:
    """Every Envoy config, manifest and plugin JSON the repository ships (not the JSON schemas)."""
    return {*ROOT.glob("envoy/*.yaml"), *ROOT.glob("envoy/*.json"), *ROOT.glob("deploy/**/*.yaml")}


def test_every_shipped_file_is_covered_below():
    assert shipped_files() == {DEMO_PLUGIN, WASMPLUGIN, GATEWAY_WASMPLUGIN, ENVOYFILTER, *TEMPLATES, *NO_PLUGIN}


def headers(out: str, path) -> list[str]:
    return re.findall(rf"^{re.escape(str(path))}: (.*): valid$", out, flags=re.M)


def warnings(err: str) -> list[str]:
    """Every warning line of stderr, without the file and location before it."""
    return [line.split(": warning: ", 1)[1] for line in err.splitlines() if ": warning: " in line]


PLACEHOLDER = ("spec.sha256 is the placeholder of zeros: no module has that digest, so the proxies "
               "refuse the module and, until it holds the image's digest (`make oci` prints it), "
               "every request it should guard is refused (503)")
OUTBOUND_TOO = ("Istio then attaches the plugin to the workload's outbound listeners too "
                "(CLIENT_AND_SERVER), so the guard also acts on the calls the workload makes to "
                "other services (one without a tenant gets 401 from a policy it matches)")
NO_MATCH = (f"spec.match is missing: {OUTBOUND_TOO}; add `match: [{{mode: SERVER}}]` to guard only "
            "the requests the workload receives")
NEVER_ON_GATEWAY = ("spec.match selects only SERVER traffic, and Istio counts a gateway's listeners "
                    "as CLIENT: the plugin never runs on the gateway it targets; use `match: "
                    "[{mode: CLIENT}]`")


def test_the_shipped_wasmplugin_is_checked_with_its_env():
    r = make_check(str(WASMPLUGIN))
    assert r.returncode == 0, r.stderr
    assert headers(r.stdout, WASMPLUGIN) == ["document 1, WasmPlugin orders/coordination-guard"], r.stdout
    for want in ("redis: cluster outbound|7379||webdis.redis.svc.cluster.local",
                 "credential from $CG_GATEWAY_AUTHORIZATION in the VM's environment (from the "
                 "proxy's environment, not checked here)",
                 "policy 2 create-order: POST, path /orders*",
                 "fingerprint method + path + principal, processing 2m"):
        assert want in r.stdout, (want, r.stdout)
    # Its sha256 is the placeholder until `make oci` gives the digest: warned about, exit 0.
    at = f"{WASMPLUGIN}: document 1, WasmPlugin orders/coordination-guard"
    assert r.stderr.splitlines() == [f"{at}: warning: {PLACEHOLDER}"], r.stderr


def test_the_shipped_gateway_wasmplugin_is_checked_with_its_identity():
    r = make_check(str(GATEWAY_WASMPLUGIN))
    assert r.returncode == 0, r.stderr
    assert headers(r.stdout, GATEWAY_WASMPLUGIN) == ["document 1, WasmPlugin istio-ingress/coordination-guard"], r.stdout
    for want in ("identity: tenant from the tenant_id claim of a verified token, principal from the "
                 "sub claim of a verified token; no tenant: 401",
                 "key prefix cg:orders:edge",
                 "limit user-burst: 20 per 1s by tenant + principal (token bucket, burst 40)",
                 "limit global: 20000 per 1s by the whole policy (fixed window, leased slices)"):
        assert want in r.stdout, (want, r.stdout)
    assert warnings(r.stderr) == [PLACEHOLDER], r.stderr


def test_the_shipped_envoyfilter_is_checked_in_its_patch():
    r = make_check(str(ENVOYFILTER))
    assert r.returncode == 0, r.stderr
    assert headers(r.stdout, ENVOYFILTER) == [
        "document 1 (EnvoyFilter orders/coordination-guard), filter orders.coordination-guard"], r.stdout
    assert "fingerprint method + path + principal + body" in r.stdout, r.stdout
    assert "credential from $CG_GATEWAY_AUTHORIZATION in the VM's environment (from the proxy's" in r.stdout
    assert warnings(r.stderr) == [PLACEHOLDER.replace("spec.sha256", "vm_config.code.remote.sha256")], r.stderr


def render(template, tmp_path, plugin: dict | None = None):
    """The template as `make run` and the harness fill it: every port, the .wasm, the plugin."""
    text = template.read_text()
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    names = set(re.findall(r"__([A-Z_]+)__", code)) - {PLUGIN_PLACEHOLDER.strip("_")}
    values = {n: (str(DEFAULT_WASM) if n == "WASM_PATH" else 10000 + i) for i, n in enumerate(sorted(names))}
    path = tmp_path / template.name
    path.write_text(substitute(text, values, plugin or json.loads(DEMO_PLUGIN.read_text())))
    return path


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_a_shipped_envoy_template_is_checked_once_rendered(tmp_path, template):
    # As shipped, its configuration is a placeholder: nothing to check, and it says so.
    r = cg_check(str(template))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert (f"{template}: document 1, filter coordination-guard: not checked: its configuration is "
            f"the template placeholder {PLUGIN_PLACEHOLDER}") in r.stderr, r.stderr
    # Rendered, the filter is found by its code and checked.
    rendered = render(template, tmp_path)
    r = make_check(str(rendered))
    assert r.returncode == 0, r.stderr
    assert headers(r.stdout, rendered) == ["document 1, filter coordination-guard"], r.stdout
    assert "policy 2 create-order: POST, path /orders*" in r.stdout, r.stdout


@pytest.mark.parametrize("path", NO_PLUGIN, ids=lambda p: p.name)
def test_a_shipped_file_without_the_plugin_says_none_was_found(path):
    r = cg_check(str(path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"cg-check: {path}: no coordination-guard plugin found"), r.stderr


def test_a_wasmplugin_variable_not_in_vmconfig_env_is_warned_about(tmp_path):
    docs = list(yaml.safe_load_all(WASMPLUGIN.read_text()))
    [plugin] = [d for d in docs if d and d.get("kind") == "WasmPlugin"]
    plugin["spec"]["vmConfig"]["env"] = [{"name": "CG_OTHER", "valueFrom": "HOST"}]
    policy = plugin["spec"]["pluginConfig"]["policies"][1]
    policy["idempotency"]["encryption"] = {"key_env": "CG_RECORD_KEY"}
    path = tmp_path / "wasmplugin.yaml"
    # Another resource before it: the WasmPlugin is picked out of a multi-document file.
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}
    path.write_text(yaml.safe_dump_all([service, plugin]))
    r = make_check(str(path))
    assert r.returncode == 0, r.stderr
    at = f"{path}: document 2, WasmPlugin orders/coordination-guard"
    assert headers(r.stdout, path) == ["document 2, WasmPlugin orders/coordination-guard"], r.stdout
    consequence = "the Wasm VM will not have it, and the filter will refuse its configuration"
    assert (f"{at}: warning: redis.authorization_env names CG_GATEWAY_AUTHORIZATION, which "
            f"vmConfig.env does not declare: {consequence}") in r.stderr, r.stderr
    assert (f"{at}: warning: policies[1].idempotency.encryption.key_env names CG_RECORD_KEY, "
            f"which vmConfig.env does not declare: {consequence}") in r.stderr, r.stderr
    assert "(not declared in vmConfig.env)" in r.stdout
    # An inline value is checked as the filter would read it.
    plugin["spec"]["vmConfig"]["env"] = [{"name": "CG_GATEWAY_AUTHORIZATION", "valueFrom": "HOST"},
                                         {"name": "CG_RECORD_KEY", "value": "c2hvcnQ="}]
    path.write_text(yaml.safe_dump(plugin))
    r = cg_check(str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert (f"{path}: document 1, WasmPlugin orders/coordination-guard: invalid plugin configuration: "
            "policies[1].idempotency.encryption.key_env: environment variable CG_RECORD_KEY holds 5 "
            "bytes, not 32") in r.stderr, r.stderr


def shipped_copy(tmp_path, source, name: str, change) -> str:
    """A copy of a shipped WasmPlugin file with `change(spec)` applied."""
    plugin = yaml.safe_load(source.read_text())
    change(plugin["spec"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(plugin))
    return str(path)


DIGEST = "ab" * 32  # what `make oci` would print: no placeholder


def pinned(spec: dict) -> None:
    spec["sha256"] = DIGEST


@pytest.mark.parametrize("name, change, expected", [
    # The shipped sidecar plugin with its digest filled in: nothing to warn about.
    ("pinned", pinned, []),
    # Its placeholder back, with a fail strategy that lets requests through meanwhile.
    ("fail-open", lambda s: s.update(failStrategy="FAIL_OPEN"),
     [PLACEHOLDER.replace("every request it should guard is refused (503)",
                          "the requests it should guard pass unguarded")]),
    # No direction: Istio's CLIENT_AND_SERVER, the outbound calls guarded too.
    ("no-match", lambda s: (pinned(s), s.pop("match")), [NO_MATCH]),
    ("empty-match", lambda s: (pinned(s), s.update(match=[])), [NO_MATCH]),
    ("no-mode", lambda s: (pinned(s), s.update(match=[{"ports": [{"number": 8080}]}])),
     [f"spec.match[0] has no mode: {OUTBOUND_TOO}; set `mode: SERVER` to guard only the requests "
      "the workload receives"]),
    ("both-ways", lambda s: (pinned(s), s.update(match=[{"mode": "CLIENT_AND_SERVER"}])),
     [f"spec.match[0] has mode CLIENT_AND_SERVER: {OUTBOUND_TOO}; set `mode: SERVER` to guard only "
      "the requests the workload receives"]),
    # The workload's own calls only, on purpose (a shared dependency): no warning.
    ("client", lambda s: (pinned(s), s.update(match=[{"mode": "CLIENT"}])), []),
    # Both at once: each said.
    ("no-match-placeholder", lambda s: s.pop("match"), [NO_MATCH, PLACEHOLDER]),
])
def test_the_sidecar_wasmplugin_is_warned_about_exactly_what_is_wrong(tmp_path, name, change, expected):
    path = shipped_copy(tmp_path, WASMPLUGIN, f"{name}.yaml", change)
    r = cg_check(path)
    assert r.returncode == 0, r.stderr
    assert headers(r.stdout, path) == ["document 1, WasmPlugin orders/coordination-guard"], r.stdout
    assert sorted(warnings(r.stderr)) == sorted(expected), r.stderr
    assert all(line.startswith(f"{path}: document 1, WasmPlugin orders/coordination-guard: warning: ")
               for line in r.stderr.splitlines()), r.stderr


@pytest.mark.parametrize("name, change, expected", [
    ("pinned", pinned, []),
    # A gateway's listeners are CLIENT to Istio; without match it runs there too.
    ("no-match", lambda s: (pinned(s), s.pop("match")), []),
    ("server", lambda s: (pinned(s), s.update(match=[{"mode": "SERVER"}])), [NEVER_ON_GATEWAY]),
    # The Helm-installed gateway, by its pods' labels: the same.
    ("helm-server", lambda s: (pinned(s), s.pop("targetRefs"), s.update(
        selector={"matchLabels": {"istio": "ingressgateway"}}, match=[{"mode": "SERVER"}])), [NEVER_ON_GATEWAY]),
    # The Gateway API gateway's pods by their gateway-name label instead of targetRefs: the same.
    ("gateway-name-server", lambda s: (pinned(s), s.pop("targetRefs"), s.update(
        selector={"matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"}},
        match=[{"mode": "SERVER"}])), [NEVER_ON_GATEWAY]),
    ("gateway-name-client", lambda s: (pinned(s), s.pop("targetRefs"), s.update(
        selector={"matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"}})), []),
])
def test_the_gateway_wasmplugin_is_warned_about_exactly_what_is_wrong(tmp_path, name, change, expected):
    path = shipped_copy(tmp_path, GATEWAY_WASMPLUGIN, f"gateway-{name}.yaml", change)
    r = make_check(path)
    assert r.returncode == 0, r.stderr
    assert warnings(r.stderr) == expected, r.stderr


def test_a_cost_the_client_declares_with_nothing_to_correct_it_is_warned_about(tmp_path):
    """Issue 54: a `cost` read from the client's header and no `charge`: the client pays what
    it says. The check says so (the configuration is valid: a trusted layer may set the
    header), and summarises what a charge falls back to."""
    limit = {"name": "tokens", "by": ["tenant"], "algorithm": "fixed_window", "limit": 100000,
             "window": "1m", "cost": {"header": "x-request-cost", "max": 10000}}
    charged = {**limit, "name": "charged", "charge": {"response_json": "/usage/total_tokens"}}
    config = {"redis": {"cluster": "gw"},
              "policies": [{"name": "llm", "rate_limits": [limit, charged]}]}
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps(config))
    r = make_check(str(path))
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"{path}: warning: policies[0].rate_limits[0] (llm/tokens): the client declares its own "
        "cost in x-request-cost and no charge corrects it, so a client pays what it says (at "
        "least min, 1): add a charge read from the response, or let a layer the client cannot "
        "bypass set x-request-cost"], r.stderr
    assert ("limit charged: 100000 per 1m by tenant (fixed window, cost from header "
            "x-request-cost (default 1, max 10000), charged from the JSON body at "
            "/usage/total_tokens (up to 1048576 bytes), unreadable: 10000 (max))") in r.stdout, r.stdout
    assert "memory: 67108864 bytes per worker (memory_budget)" in r.stdout, r.stdout


def test_an_envoy_config_with_two_filters_checks_and_summarises_each(tmp_path):
    cfg = yaml.safe_load(render(TEMPLATES[0], tmp_path).read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    second = json.loads(DEMO_PLUGIN.read_text())
    second["redis"]["key_prefix"] = "cg:second"
    second["redis"].pop("authorization")
    second["redis"]["authorization_env"] = "CG_AUTH"
    two = wasm_filter(second, root_id="second")
    two["typed_config"]["config"]["vm_config"]["environment_variables"] = {"host_env_keys": ["CG_AUTH"]}
    other = wasm_filter({}, root_id="other")
    other["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = "/opt/other.wasm"
    hcm["http_filters"][1:1] = [two, other]
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = make_check(str(path))
    assert r.returncode == 0, r.stderr
    assert headers(r.stdout, path) == ["document 1, filter coordination-guard",
                                       "document 1, filter coordination-guard-second"], r.stdout
    first, later = r.stdout.split(f"{path}: document 1, filter coordination-guard-second: valid")
    assert "key prefix cg:demo" in first and "credential inline" in first, first
    assert "key prefix cg:second" in later, later
    assert "credential from $CG_AUTH in the VM's environment (from the proxy's environment" in later
    assert (f"{path}: skipped document 1, filter coordination-guard-other (code \"/opt/other.wasm\", "
            "root_id \"other\"): not coordination-guard") in r.stderr, r.stderr
    # One of them invalid: exit 1, the error under its header; the other still summarised.
    second["policies"][0]["lease"]["ttl"] = "soon"
    two["typed_config"]["config"]["configuration"]["value"] = json.dumps(second)
    path.write_text(yaml.safe_dump(cfg))
    r = cg_check(str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert headers(r.stdout, path) == ["document 1, filter coordination-guard"], r.stdout
    assert (f"{path}: document 1, filter coordination-guard-second: invalid plugin configuration: "
            "policies[0].lease.ttl: \"soon\" is not a duration") in r.stderr, r.stderr


def test_a_misspelt_field_is_named_with_the_field_it_was_meant_as(tmp_path):
    plugin = json.loads(DEMO_PLUGIN.read_text())
    limit = plugin["policies"][1]["rate_limits"][0]
    limit["windw"] = limit.pop("window")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(plugin))
    r = make_check(str(path))
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[0] == (
        f"{path}: invalid plugin configuration: policies[1].rate_limits[0].windw: unknown field "
        "(did you mean `window`?)"), r.stderr
    # The same in a WasmPlugin's pluginConfig.
    docs = yaml.safe_load(WASMPLUGIN.read_text())
    docs["spec"]["pluginConfig"]["redis"]["clustr"] = docs["spec"]["pluginConfig"]["redis"].pop("cluster")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(docs))
    r = cg_check(str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert ("invalid plugin configuration: redis.clustr: unknown field (did you mean `cluster`?)"
            in r.stderr), r.stderr


def test_a_file_neither_json_nor_yaml_is_exit_2(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("kind: [WasmPlugin\n")
    r = cg_check(str(path))
    assert r.returncode == 2 and r.stderr.startswith(f"cg-check: {path}: neither JSON nor YAML"), r.stderr


def test_make_zone_prints_a_calendar_limits_zone_from_this_machines_tzdata(tmp_path):
    """`make zone ZONE=...` (cg-check --zone) prints the `zone` object of a calendar quota: the
    name and the POSIX TZ rule its tzdata file ends with; the plugin with it checks valid and
    its summary names the zone and the rule."""
    r = subprocess.run(["make", "--no-print-directory", "zone", "ZONE=America/New_York"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    zone = json.loads(r.stdout)
    assert zone == {"name": "America/New_York", "rule": tzdata_rule("America/New_York")}, zone
    path = tmp_path / "calendar.json"
    path.write_text(json.dumps({"redis": {"cluster": "gw"}, "policies": [{"name": "api",
        "rate_limits": [{"name": "monthly", "by": ["tenant"], "algorithm": "fixed_window",
                         "limit": 10000, "window": "1mo", "align": "calendar", "zone": zone}]}]}))
    r = cg_check(str(path))
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert (f"limit monthly: 10000 per calendar month, America/New_York ({zone['rule']}) by "
            "tenant") in r.stdout, r.stdout
    for name, why in [("Nowhere/Atlantis", "No such file or directory"),
                      ("../../etc/passwd", "is not a time-zone name such as Europe/Berlin")]:
        r = cg_check_args("--zone", name)
        assert r.returncode == 2 and r.stderr.startswith(f"cg-check: no zone {name}: "), r.stderr
        assert why in r.stderr, r.stderr


def cg_check_args(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["cargo", "run", "--quiet", "--bin", "cg-check", "--", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
