//! The plugin configurations in what a user deploys, read on the host (never in the filter):
//! `cg-check` reads them, and any host tool may.
//!
//! Three shapes, told apart by their content:
//! - the plugin JSON itself (what the filter receives): any JSON that is neither of the others,
//!   or that is not JSON at all but starts like it (the filter's own error then says so);
//! - an Istio `WasmPlugin` (YAML or JSON, one document of several): its `spec.pluginConfig`,
//!   as istiod hands it to the filter (JSON), and `spec.vmConfig.env`, the VM's environment;
//! - an Envoy config (a bootstrap, an `EnvoyFilter` whose patches carry the filter, a
//!   `/config_dump`; YAML or JSON, one document of several): every Wasm filter
//!   (`envoy.extensions.filters.http.wasm.v3.Wasm`, also inside a `TypedStruct`) anywhere in
//!   it, with its `configuration` (a `google.protobuf.StringValue` holding the JSON) and
//!   `vm_config.environment_variables` (`host_env_keys`, `key_values`).
//!
//! Which Wasm filters and WasmPlugins are this module's ([`is_this_module`]): those whose code
//! is a file named `coordination_guard.wasm` or an image (`oci://`, `https://`) whose last
//! path segment, without its tag, digest or `.wasm`, is `coordination-guard` or
//! `coordination_guard`; and those whose `root_id` (a WasmPlugin's `pluginName`) is
//! `coordination-guard`, as in every configuration this repository ships (it also finds the
//! filter once istio-agent has rewritten an image to a local `module.wasm`). Others are
//! skipped and listed.
//!
//! What the file says about where and whether the plugin runs, beside its configuration, is
//! told as [`Plugin::warnings`] ([`deployment_warnings`], [`placeholder_digest`]): a WasmPlugin
//! whose `match` leaves the direction to Istio's default (CLIENT_AND_SERVER: the guard would
//! also answer the workload's own outbound calls), one aimed at a gateway with only `mode:
//! SERVER` (a gateway's listeners are CLIENT to Istio: it would never run), and a `sha256` of
//! zeros (the shipped placeholder: proxies refuse the module).

use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;

/// The `@type` of Envoy's Wasm HTTP filter.
pub const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
/// The `@type` of a configuration Envoy hands to the filter as its text.
pub const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";
const TYPED_STRUCTS: [&str; 2] = [
    "type.googleapis.com/udpa.type.v1.TypedStruct",
    "type.googleapis.com/xds.type.v3.TypedStruct",
];
/// The `root_id` (a WasmPlugin's `pluginName`) of every shipped configuration.
pub const ROOT_ID: &str = "coordination-guard";
/// The module's file, as `make build` writes it.
pub const MODULE_FILE: &str = "coordination_guard.wasm";

/// Which of the three shapes a plugin was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// The plugin JSON itself.
    Plugin,
    /// An Istio `WasmPlugin`.
    WasmPlugin,
    /// A Wasm filter of an Envoy config (or of an `EnvoyFilter`).
    Envoy,
}

/// A variable of the Wasm VM's environment, as the file declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvValue {
    /// Its value is in the file (`value:` of `vmConfig.env`, `key_values`).
    Inline(String),
    /// Taken from the proxy's own environment (`valueFrom: HOST`, `host_env_keys`): not in
    /// the file.
    Host,
}

/// The Wasm VM's environment a file declares: no other variable is set in the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmEnv {
    /// Where the file declares it: `vmConfig.env` or `vm_config.environment_variables`.
    pub declared_in: &'static str,
    pub vars: BTreeMap<String, EnvValue>,
}

/// What the filter would receive as its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Configuration {
    /// These bytes (empty when the file gives none).
    Bytes(Vec<u8>),
    /// A template's placeholder (`__PLUGIN_CONFIG__`): nothing to check until it is filled.
    Placeholder(String),
    /// A form the filter cannot read (it would refuse it): why.
    Unreadable(String),
}

/// One plugin configuration found in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugin {
    pub shape: Shape,
    /// Where in the file (`document 1, WasmPlugin orders/coordination-guard`); empty for the
    /// plugin JSON.
    pub location: String,
    pub configuration: Configuration,
    /// The VM's environment the file declares; `None` when it says nothing of it (the plugin
    /// JSON).
    pub env: Option<VmEnv>,
    /// What the file around the configuration gets wrong (see the module's documentation),
    /// one sentence each.
    pub warnings: Vec<String>,
}

/// What a file holds: this module's plugins, and the other Wasm modules' (where, and why they
/// were taken for another module's).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Found {
    pub plugins: Vec<Plugin>,
    pub skipped: Vec<String>,
}

/// Why nothing could be checked in a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadError {
    /// Neither JSON nor YAML.
    Unreadable(String),
    /// JSON or YAML, but no plugin of this module in it.
    NoPlugin(String),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Unreadable(why) | ReadError::NoPlugin(why) => f.write_str(why),
        }
    }
}

/// The plugins of this module in `bytes`, the content of a file of any of the three shapes.
pub fn read(bytes: &[u8]) -> Result<Found, ReadError> {
    let text = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
    let first = text.iter().find(|b| !b.is_ascii_whitespace());
    let documents = if matches!(first, Some(b'{' | b'[')) {
        match serde_json::from_slice::<Value>(text) {
            Ok(value) if is_deployment(&value) => vec![value],
            // The plugin JSON, or a file that means to be (the filter's error says what is
            // wrong with it).
            _ => return Ok(plain(bytes)),
        }
    } else {
        yaml_documents(text)?
    };
    let mut found = Found::default();
    for (i, document) in documents.iter().enumerate() {
        from_document(document, &format!("document {}", i + 1), &mut found);
    }
    if found.plugins.is_empty() {
        let mut why = format!(
            "no {ROOT_ID} plugin found: expected the plugin JSON, a WasmPlugin, or an Envoy \
             config with a Wasm filter ({WASM_TYPE}) whose vm_config.code is {MODULE_FILE} or \
             an image named {ROOT_ID}, or whose root_id is {ROOT_ID}"
        );
        if !found.skipped.is_empty() {
            why.push_str("; skipped: ");
            why.push_str(&found.skipped.join("; "));
        }
        return Err(ReadError::NoPlugin(why));
    }
    Ok(found)
}

/// The plugin JSON file as it is.
fn plain(bytes: &[u8]) -> Found {
    Found {
        plugins: vec![Plugin {
            shape: Shape::Plugin,
            location: String::new(),
            configuration: Configuration::Bytes(bytes.to_vec()),
            env: None,
            warnings: Vec::new(),
        }],
        skipped: Vec::new(),
    }
}

/// A JSON document that is a Kubernetes resource or holds a Wasm filter: not the plugin JSON.
fn is_deployment(value: &Value) -> bool {
    let resource = value.get("apiVersion").is_some() && value.get("kind").is_some();
    resource || {
        let mut found = Found::default();
        walk(value, "", &mut found);
        !(found.plugins.is_empty() && found.skipped.is_empty())
    }
}

/// Every document of a YAML stream (`---` between them), empty ones left out.
fn yaml_documents(text: &[u8]) -> Result<Vec<Value>, ReadError> {
    let mut documents = Vec::new();
    for (i, document) in serde_yaml::Deserializer::from_slice(text).enumerate() {
        let value = Value::deserialize(document).map_err(|e| {
            ReadError::Unreadable(format!("neither JSON nor YAML (document {}: {e})", i + 1))
        })?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

fn from_document(document: &Value, at: &str, found: &mut Found) {
    let kind = document.get("kind").and_then(Value::as_str);
    let api = document
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    match kind {
        Some("List") => {
            for (j, item) in items(document.get("items")).iter().enumerate() {
                from_document(item, &format!("{at}, item {}", j + 1), found);
            }
        }
        Some("WasmPlugin") if api.starts_with("extensions.istio.io/") => {
            wasm_plugin(document, at, found);
        }
        Some(kind) => {
            let at = format!("{at} ({kind} {})", resource_name(document));
            walk(document, &at, found);
        }
        None => walk(document, at, found),
    }
}

fn items(value: Option<&Value>) -> &[Value] {
    value.and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

fn str_at<'v>(value: &'v Value, pointer: &str) -> Option<&'v str> {
    value.pointer(pointer).and_then(Value::as_str)
}

/// `namespace/name` of a Kubernetes resource (`name` without a namespace).
fn resource_name(document: &Value) -> String {
    let name = str_at(document, "/metadata/name").unwrap_or("(unnamed)");
    match str_at(document, "/metadata/namespace") {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

fn wasm_plugin(document: &Value, at: &str, found: &mut Found) {
    let at = format!("{at}, WasmPlugin {}", resource_name(document));
    let url = str_at(document, "/spec/url").unwrap_or_default();
    let plugin_name = str_at(document, "/spec/pluginName");
    if !is_this_module(url) && plugin_name != Some(ROOT_ID) {
        found.skipped.push(format!(
            "{at} (url {url:?}, pluginName {:?})",
            plugin_name.unwrap_or_default()
        ));
        return;
    }
    let configuration = match document.pointer("/spec/pluginConfig") {
        None | Some(Value::Null) => Configuration::Bytes(Vec::new()),
        // istiod hands the filter pluginConfig as JSON text.
        Some(config) => match serde_json::to_vec(config) {
            Ok(bytes) => Configuration::Bytes(bytes),
            Err(e) => Configuration::Unreadable(format!("spec.pluginConfig: {e}")),
        },
    };
    let mut vars = BTreeMap::new();
    for var in items(document.pointer("/spec/vmConfig/env")) {
        let Some(name) = var.get("name").and_then(Value::as_str) else {
            continue;
        };
        let value = if var.get("valueFrom").and_then(Value::as_str) == Some("HOST") {
            EnvValue::Host
        } else {
            EnvValue::Inline(str_at(var, "/value").unwrap_or_default().to_string())
        };
        vars.insert(name.to_string(), value);
    }
    let failing_open = str_at(document, "/spec/failStrategy") == Some("FAIL_OPEN");
    let mut warnings = deployment_warnings(document.get("spec").unwrap_or(&Value::Null));
    warnings.extend(placeholder_digest(
        "spec.sha256",
        str_at(document, "/spec/sha256"),
        failing_open,
    ));
    found.plugins.push(Plugin {
        shape: Shape::WasmPlugin,
        location: at,
        configuration,
        env: Some(VmEnv {
            declared_in: "vmConfig.env",
            vars,
        }),
        warnings,
    });
}

/// Istio's traffic directions (`WorkloadMode`) a WasmPlugin's `match[].mode` names.
const SERVER: &str = "SERVER";
const CLIENT: &str = "CLIENT";

/// The label Istio puts on the pods of a gateway it deploys for a Gateway API `Gateway`, whose
/// value is the Gateway's name: a `selector` on it picks that gateway's pods, as `targetRefs`
/// to the Gateway does.
const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

/// Where a WasmPlugin's `spec` makes the guard run, when that is not where it should.
///
/// istiod attaches a plugin to a listener when one entry of `match` fits it (every listener
/// when there is none); an entry fits a listener whose class has its mode: a sidecar's
/// inbound listener is SERVER, its outbound listeners are CLIENT, and so are a gateway's
/// listeners. An entry without a mode, or with UNDEFINED or CLIENT_AND_SERVER, fits both.
/// A plugin aimed at a gateway (`targetRefs` to a Gateway or GatewayClass, or a `selector`
/// on a gateway's pod label: `istio` of Istio's gateway charts, or [`GATEWAY_NAME_LABEL`] of a
/// Gateway API gateway's pods) runs only where an entry is not SERVER; any
/// other plugin is a sidecar's, meant for what the workload receives: one that fits its
/// outbound listeners too guards the calls the workload makes.
pub fn deployment_warnings(spec: &Value) -> Vec<String> {
    let targets_gateway = items(spec.get("targetRefs"))
        .iter()
        .chain(spec.get("targetRef"))
        .any(|r| matches!(str_at(r, "/kind"), Some("Gateway" | "GatewayClass")))
        || spec
            .pointer("/selector/matchLabels")
            .and_then(Value::as_object)
            .is_some_and(|labels| {
                labels.contains_key("istio") || labels.contains_key(GATEWAY_NAME_LABEL)
            });
    let selectors = items(spec.get("match"));
    let mode = |s: &Value| str_at(s, "/mode").unwrap_or("UNDEFINED").to_string();
    if targets_gateway {
        if !selectors.is_empty() && selectors.iter().all(|s| mode(s) == SERVER) {
            return vec![format!(
                "spec.match selects only {SERVER} traffic, and Istio counts a gateway's listeners \
                 as {CLIENT}: the plugin never runs on the gateway it targets; use `match: \
                 [{{mode: {CLIENT}}}]`"
            )];
        }
        return Vec::new();
    }
    let outbound_too = "Istio then attaches the plugin to the workload's outbound listeners too \
                        (CLIENT_AND_SERVER), so the guard also acts on the calls the workload \
                        makes to other services (one without a tenant gets 401 from a policy it \
                        matches)";
    if selectors.is_empty() {
        return vec![format!(
            "spec.match is missing: {outbound_too}; add `match: [{{mode: {SERVER}}}]` to guard \
             only the requests the workload receives"
        )];
    }
    selectors
        .iter()
        .enumerate()
        .filter(|(_, s)| mode(s) != SERVER && mode(s) != CLIENT)
        .map(|(i, s)| {
            let named = match str_at(s, "/mode") {
                None => "has no mode".to_string(),
                Some(m) => format!("has mode {m}"),
            };
            format!(
                "spec.match[{i}] {named}: {outbound_too}; set `mode: {SERVER}` to guard only \
                 the requests the workload receives"
            )
        })
        .collect()
}

/// A module digest (`field`, e.g. `spec.sha256`) of 64 zeros: the placeholder the shipped
/// manifests carry until the image's digest is filled in. No module has it, so the proxy (or
/// istio-agent) refuses the module and the plugin does not load.
pub fn placeholder_digest(field: &str, digest: Option<&str>, failing_open: bool) -> Option<String> {
    let digest = digest?;
    if digest.len() != 64 || digest.bytes().any(|b| b != b'0') {
        return None;
    }
    let meanwhile = if failing_open {
        "the requests it should guard pass unguarded"
    } else {
        "every request it should guard is refused (503)"
    };
    Some(format!(
        "{field} is the placeholder of zeros: no module has that digest, so the proxies refuse \
         the module and, until it holds the image's digest (`make oci` prints it), {meanwhile}"
    ))
}

/// The Wasm filter's `config` (a `PluginConfig`) when `value` is a Wasm filter's typed config.
fn wasm_config(value: &Map<String, Value>) -> Option<&Value> {
    match value.get("@type").and_then(Value::as_str)? {
        WASM_TYPE => value.get("config"),
        t if TYPED_STRUCTS.contains(&t) => (value.get("type_url").and_then(Value::as_str)?
            == WASM_TYPE)
            .then(|| value.get("value")?.get("config"))?,
        _ => None,
    }
}

/// Finds every Wasm filter in `value`; `at` names the document.
fn walk(value: &Value, at: &str, found: &mut Found) {
    match value {
        Value::Object(map) => {
            if let Some(config) = wasm_config(map) {
                // A typed config on its own (an ECDS resource): named by its config.
                wasm_filter(config, None, at, found);
                return;
            }
            for (key, child) in map {
                let typed = child.as_object().and_then(wasm_config);
                match (key.as_str(), typed) {
                    ("typed_config", Some(config)) => {
                        let name = map.get("name").and_then(Value::as_str);
                        wasm_filter(config, name, at, found);
                    }
                    _ => walk(child, at, found),
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                walk(item, at, found);
            }
        }
        _ => {}
    }
}

fn wasm_filter(config: &Value, name: Option<&str>, at: &str, found: &mut Found) {
    let name = name
        .or_else(|| str_at(config, "/name"))
        .unwrap_or("(unnamed)");
    let at = if at.is_empty() {
        format!("filter {name}")
    } else {
        format!("{at}, filter {name}")
    };
    let code = [
        "/vm_config/code/local/filename",
        "/vm_config/code/remote/http_uri/uri",
    ]
    .iter()
    .find_map(|p| str_at(config, p))
    .unwrap_or_default();
    let root_id = str_at(config, "/root_id");
    if !is_this_module(code) && root_id != Some(ROOT_ID) {
        found.skipped.push(format!(
            "{at} (code {code:?}, root_id {:?})",
            root_id.unwrap_or_default()
        ));
        return;
    }
    let mut vars = BTreeMap::new();
    let declared = config.pointer("/vm_config/environment_variables");
    for key in items(declared.and_then(|d| d.get("host_env_keys"))) {
        if let Some(key) = key.as_str() {
            vars.insert(key.to_string(), EnvValue::Host);
        }
    }
    if let Some(pairs) = declared
        .and_then(|d| d.get("key_values"))
        .and_then(Value::as_object)
    {
        for (key, value) in pairs {
            let value = value.as_str().unwrap_or_default().to_string();
            vars.insert(key.clone(), EnvValue::Inline(value));
        }
    }
    let failing_open = str_at(config, "/failure_policy") == Some("FAIL_OPEN");
    let warnings = placeholder_digest(
        "vm_config.code.remote.sha256",
        str_at(config, "/vm_config/code/remote/sha256"),
        failing_open,
    )
    .into_iter()
    .collect();
    found.plugins.push(Plugin {
        shape: Shape::Envoy,
        location: at,
        configuration: configuration(config.get("configuration")),
        env: Some(VmEnv {
            declared_in: "vm_config.environment_variables",
            vars,
        }),
        warnings,
    });
}

/// What the filter receives from a Wasm filter's `configuration`.
fn configuration(value: Option<&Value>) -> Configuration {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Configuration::Bytes(Vec::new());
    };
    match value.get("@type").and_then(Value::as_str) {
        Some(STRING_VALUE) => {
            let text = value.get("value").and_then(Value::as_str).unwrap_or("");
            let trimmed = text.trim();
            let placeholder = trimmed.len() > 4
                && trimmed.starts_with("__")
                && trimmed.ends_with("__")
                && trimmed
                    .bytes()
                    .all(|b| b == b'_' || b.is_ascii_uppercase() || b.is_ascii_digit());
            if placeholder {
                Configuration::Placeholder(trimmed.to_string())
            } else {
                Configuration::Bytes(text.as_bytes().to_vec())
            }
        }
        Some(other) => Configuration::Unreadable(format!(
            "configuration is a {other}, not a {STRING_VALUE}: the filter reads its \
             configuration as JSON text"
        )),
        None => Configuration::Unreadable(format!(
            "configuration has no @type: give it as a {STRING_VALUE} whose value is the plugin JSON"
        )),
    }
}

/// Whether a module's location (a file path or an image URL) names this module: a file
/// named `coordination_guard.wasm`, or a last path segment that is `coordination-guard` or
/// `coordination_guard` once its tag (`:0.1.0`), digest (`@sha256:...`) and `.wasm` are cut.
pub fn is_this_module(location: &str) -> bool {
    let last = location.rsplit('/').next().unwrap_or_default();
    let base = last.split(['@', ':', '?', '#']).next().unwrap_or_default();
    let base = base.strip_suffix(".wasm").unwrap_or(base);
    base == "coordination-guard" || base == "coordination_guard"
}

/// The VM environment variables a plugin configuration names: (field path, variable), as
/// the filter reads them (`redis.authorization_env`, the record keys of
/// `idempotency.encryption`).
pub fn env_references(config: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(name) = str_at(config, "/redis/authorization_env") {
        out.push(("redis.authorization_env".to_string(), name.to_string()));
    }
    for (i, policy) in items(config.get("policies")).iter().enumerate() {
        for field in ["key_env", "previous_key_env"] {
            if let Some(name) = str_at(policy, &format!("/idempotency/encryption/{field}")) {
                out.push((
                    format!("policies[{i}].idempotency.encryption.{field}"),
                    name.to_string(),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
#[path = "manifest_tests.rs"]
mod tests;
