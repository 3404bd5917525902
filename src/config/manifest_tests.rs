//! The manifest reader's tests: plugin configurations found in WasmPlugin and Envoy YAML.

use super::*;
// As in every test module: built for wasm32-unknown-unknown, tests run under
// wasm_bindgen_test (this host-only reader's are never built there).
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn plugins(text: &str) -> Vec<Plugin> {
    read(text.as_bytes()).expect("found").plugins
}

#[test]
fn the_plugin_json_is_taken_as_it_is() {
    for text in [
        r#"{"redis": {"cluster": "gw"}}"#,
        "{",
        " [1]",
        "{\"kind\": 1}",
    ] {
        let found = plugins(text);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].shape, Shape::Plugin);
        assert_eq!(
            found[0].configuration,
            Configuration::Bytes(text.as_bytes().to_vec())
        );
        assert_eq!(found[0].env, None);
    }
}

#[test]
fn a_wasmplugin_gives_its_plugin_config_and_env() {
    let found = plugins(
            "apiVersion: v1\nkind: Service\nmetadata: {name: webdis}\n---\n\
             apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\n\
             metadata: {name: cg, namespace: orders}\n\
             spec:\n  url: oci://r.example/coordination-guard:1\n\
             \x20 vmConfig:\n    env:\n      - {name: A, valueFrom: HOST}\n      - {name: B, value: b}\n\
             \x20 pluginConfig:\n    redis: {cluster: gw, timeout: 50ms}\n    response_headers: true\n\
             ---\n",
        );
    assert_eq!(found.len(), 1);
    let p = &found[0];
    assert_eq!(p.shape, Shape::WasmPlugin);
    assert_eq!(p.location, "document 2, WasmPlugin orders/cg");
    let Configuration::Bytes(bytes) = &p.configuration else {
        panic!("bytes")
    };
    let json: Value = serde_json::from_slice(bytes).expect("json");
    assert_eq!(
        json,
        serde_json::json!({"redis": {"cluster": "gw", "timeout": "50ms"}, "response_headers": true})
    );
    let env = p.env.as_ref().expect("declared");
    assert_eq!(env.declared_in, "vmConfig.env");
    assert_eq!(env.vars.get("A"), Some(&EnvValue::Host));
    assert_eq!(env.vars.get("B"), Some(&EnvValue::Inline("b".into())));
}

const FILTER: &str = r#"
                - name: NAME
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
                    config:
                      root_id: ROOT
                      configuration:
                        "@type": type.googleapis.com/google.protobuf.StringValue
                        value: 'CONFIG'
                      vm_config:
                        environment_variables:
                          host_env_keys: [H]
                          key_values: {K: v}
                        code: {local: {filename: FILE}}"#;

fn filter(name: &str, root: &str, config: &str, file: &str) -> String {
    FILTER
        .replace("NAME", name)
        .replace("ROOT", root)
        .replace("CONFIG", config)
        .replace("FILE", file)
}

#[test]
fn every_wasm_filter_of_this_module_in_an_envoy_config() {
    let text = format!(
            "static_resources:\n  listeners:\n    - filter_chains:\n        - filters:\n            - typed_config:\n                http_filters:{}{}{}\n",
            filter("one", "x", "{\"a\": 1}", "/b/coordination_guard.wasm"),
            filter("other", "x", "{}", "/b/other.wasm"),
            filter("two", "coordination-guard", "__PLUGIN_CONFIG__", "__WASM_PATH__"),
        );
    let found = read(text.as_bytes()).expect("found");
    let names: Vec<&str> = found.plugins.iter().map(|p| p.location.as_str()).collect();
    assert_eq!(names, ["document 1, filter one", "document 1, filter two"]);
    assert_eq!(
        found.plugins[0].configuration,
        Configuration::Bytes(b"{\"a\": 1}".to_vec())
    );
    assert_eq!(
        found.plugins[1].configuration,
        Configuration::Placeholder("__PLUGIN_CONFIG__".into())
    );
    let env = found.plugins[0].env.as_ref().expect("declared");
    assert_eq!(env.declared_in, "vm_config.environment_variables");
    assert_eq!(env.vars.get("H"), Some(&EnvValue::Host));
    assert_eq!(env.vars.get("K"), Some(&EnvValue::Inline("v".into())));
    assert_eq!(
        found.skipped,
        ["document 1, filter other (code \"/b/other.wasm\", root_id \"x\")"]
    );
}

#[test]
fn a_typed_struct_and_an_envoyfilter_patch_are_found() {
    let text = r#"{"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
            "metadata": {"name": "cg", "namespace": "ns"},
            "spec": {"configPatches": [{"patch": {"value": {"name": "f", "typed_config": {
              "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
              "type_url": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
              "value": {"config": {"root_id": "coordination-guard",
                "configuration": {"@type": "type.googleapis.com/google.protobuf.BytesValue"}}}}}}}]}}"#;
    let found = plugins(text);
    assert_eq!(found.len(), 1);
    assert_eq!(
        found[0].location,
        "document 1 (EnvoyFilter ns/cg), filter f"
    );
    assert!(matches!(&found[0].configuration,
            Configuration::Unreadable(why) if why.starts_with("configuration is a type.googleapis.com/google.protobuf.BytesValue")));
    // No environment declared: the VM has none.
    assert_eq!(found[0].env.as_ref().map(|e| e.vars.len()), Some(0));
}

#[test]
fn what_holds_no_plugin_says_so() {
    for (text, want) in [
        ("a: [1\n", "neither JSON nor YAML"),
        (
            "apiVersion: v1\nkind: Service\n",
            "no coordination-guard plugin found",
        ),
        ("", "no coordination-guard plugin found"),
    ] {
        let err = read(text.as_bytes()).expect_err("nothing").to_string();
        assert!(err.starts_with(want), "{text:?}: {err}");
    }
    let other = filter("f", "other", "{}", "/x/other.wasm");
    let err = read(format!("http_filters:{other}").as_bytes())
        .expect_err("not this module")
        .to_string();
    assert!(
        err.ends_with(
            "; skipped: document 1, filter f (code \"/x/other.wasm\", root_id \"other\")"
        ),
        "{err}"
    );
}

#[test]
fn which_code_is_this_module() {
    for (location, ours) in [
        (
            "/work/target/wasm32-wasip1/release/coordination_guard.wasm",
            true,
        ),
        ("coordination_guard.wasm", true),
        ("oci://registry.example.com/coordination-guard:0.1.0", true),
        (
            "oci://127.0.0.1:5000/team/coordination-guard@sha256:00ff",
            true,
        ),
        ("https://example.com/coordination-guard.wasm?x=1", true),
        (
            "oci://registry.example.com/coordination-guard-fork:1",
            false,
        ),
        ("/var/lib/istio/data/0123/module.wasm", false),
        ("__WASM_PATH__", false),
        ("", false),
    ] {
        assert_eq!(is_this_module(location), ours, "{location}");
    }
}

#[test]
fn the_environment_variables_a_config_names() {
    let config = serde_json::json!({"redis": {"authorization_env": "A"}, "policies": [
            {"name": "p"},
            {"idempotency": {"encryption": {"key_env": "K", "previous_key_env": "O"}}}]});
    assert_eq!(
        env_references(&config),
        [
            ("redis.authorization_env".to_string(), "A".to_string()),
            (
                "policies[1].idempotency.encryption.key_env".into(),
                "K".into()
            ),
            (
                "policies[1].idempotency.encryption.previous_key_env".into(),
                "O".into()
            ),
        ]
    );
}

/// The warnings of a WasmPlugin whose spec is `spec` (YAML, indented by two).
fn wasmplugin_warnings(spec: &str) -> Vec<String> {
    let text = format!(
        "apiVersion: extensions.istio.io/v1alpha1\nkind: WasmPlugin\n\
         metadata: {{name: cg, namespace: orders}}\nspec:\n  pluginName: coordination-guard\n{spec}"
    );
    let found = plugins(&text);
    assert_eq!(found.len(), 1);
    found[0].warnings.clone()
}

#[test]
fn a_sidecar_plugin_without_a_direction_is_warned_about() {
    let sidecar = "  selector: {matchLabels: {app: orders}}\n";
    for spec in ["", sidecar] {
        let warnings = wasmplugin_warnings(spec);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with(
                "spec.match is missing: Istio then attaches the plugin to the workload's \
                 outbound listeners too (CLIENT_AND_SERVER)"
            ),
            "{warnings:?}"
        );
        assert!(
            warnings[0].ends_with(
                "add `match: [{mode: SERVER}]` to guard only the requests the workload receives"
            ),
            "{warnings:?}"
        );
    }
    assert_eq!(
        wasmplugin_warnings(&format!("{sidecar}  match: []\n")).len(),
        1
    );
    // A direction: SERVER (inbound), or CLIENT (the workload's calls, on purpose).
    for mode in ["SERVER", "CLIENT"] {
        let spec = format!("{sidecar}  match: [{{mode: {mode}}}]\n");
        assert_eq!(wasmplugin_warnings(&spec), Vec::<String>::new(), "{mode}");
    }
    // An entry without one, or with Istio's both-ways modes, fits the outbound listeners too.
    let spec = format!(
        "{sidecar}  match: [{{mode: SERVER}}, {{ports: [{{number: 8080}}]}}, \
         {{mode: CLIENT_AND_SERVER}}, {{mode: UNDEFINED}}]\n"
    );
    let warnings = wasmplugin_warnings(&spec);
    let heads: Vec<&str> = warnings
        .iter()
        .map(|w| w.split(':').next().unwrap_or_default())
        .collect();
    assert_eq!(
        heads,
        [
            "spec.match[1] has no mode",
            "spec.match[2] has mode CLIENT_AND_SERVER",
            "spec.match[3] has mode UNDEFINED"
        ]
    );
    assert!(warnings[0]
        .ends_with("set `mode: SERVER` to guard only the requests the workload receives"));
}

#[test]
fn a_gateway_plugin_that_would_never_run_is_warned_about() {
    let by_ref = "  targetRefs: [{group: gateway.networking.k8s.io, kind: Gateway, name: edge}]\n";
    let by_label = "  selector: {matchLabels: {istio: ingressgateway}}\n";
    // The pods Istio deploys for a Gateway API Gateway, by their label instead of targetRefs.
    let by_gateway_name =
        "  selector: {matchLabels: {gateway.networking.k8s.io/gateway-name: edge}}\n";
    for target in [by_ref, by_label, by_gateway_name] {
        // No match, or CLIENT: the gateway's listeners (CLIENT to Istio) get it.
        assert_eq!(wasmplugin_warnings(target), Vec::<String>::new());
        for ok in [
            "[{mode: CLIENT}]",
            "[{mode: CLIENT_AND_SERVER}]",
            "[{mode: SERVER}, {}]",
        ] {
            let spec = format!("{target}  match: {ok}\n");
            assert_eq!(wasmplugin_warnings(&spec), Vec::<String>::new(), "{ok}");
        }
        let spec = format!("{target}  match: [{{mode: SERVER}}]\n");
        assert_eq!(
            wasmplugin_warnings(&spec),
            ["spec.match selects only SERVER traffic, and Istio counts a gateway's listeners as \
              CLIENT: the plugin never runs on the gateway it targets; use `match: [{mode: CLIENT}]`"]
        );
    }
}

#[test]
fn a_digest_of_zeros_is_the_placeholder() {
    let zeros = "0".repeat(64);
    let spec = format!("  match: [{{mode: SERVER}}]\n  sha256: \"{zeros}\"\n");
    let warnings = wasmplugin_warnings(&spec);
    assert_eq!(
        warnings,
        [
            "spec.sha256 is the placeholder of zeros: no module has that digest, so the proxies \
          refuse the module and, until it holds the image's digest (`make oci` prints it), every \
          request it should guard is refused (503)"
        ]
    );
    let open = format!("{spec}  failStrategy: FAIL_OPEN\n");
    assert!(wasmplugin_warnings(&open)[0].ends_with("the requests it should guard pass unguarded"));
    for digest in [
        "0".repeat(63),
        format!("{}1", "0".repeat(63)),
        "a".repeat(64),
        String::new(),
    ] {
        let spec = format!("  match: [{{mode: SERVER}}]\n  sha256: \"{digest}\"\n");
        assert_eq!(wasmplugin_warnings(&spec), Vec::<String>::new(), "{digest}");
    }
    // The same in an Envoy config's remote code (an EnvoyFilter's extension config).
    let text = format!(
        r#"{{"name": "f", "typed_config": {{"@type": "{WASM_TYPE}", "config": {{
             "root_id": "coordination-guard",
             "vm_config": {{"code": {{"remote": {{"http_uri": {{"uri": "oci://r/coordination-guard:1"}},
                                                 "sha256": "{zeros}"}}}}}}}}}}}}"#
    );
    let found = plugins(&text);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].warnings.len(), 1);
    assert!(found[0].warnings[0]
        .starts_with("vm_config.code.remote.sha256 is the placeholder of zeros"));
    // The plugin JSON says nothing of where it runs.
    assert_eq!(
        plugins(r#"{"redis": {"cluster": "gw"}}"#)[0].warnings,
        Vec::<String>::new()
    );
}
