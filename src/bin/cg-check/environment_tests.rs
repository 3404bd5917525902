//! cg-check and the VM's environment: variables a WasmPlugin or Envoy config declares, or
//! does not.

use super::*;
use coordination_guard::config::manifest::{EnvValue, VmEnv};
// As in every test module: built for wasm32-unknown-unknown, tests run under
// wasm_bindgen_test (this host-only tool's are never built there).
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CONFIG: &str = r#"{"redis": {"cluster": "gw", "authorization_env": "CG_AUTH"},
        "policies": [{"name": "p", "idempotency": {"encryption":
            {"key_env": "CG_KEY", "previous_key_env": "CG_OLD"}}}]}"#;

fn declared(vars: &[(&str, EnvValue)]) -> VmEnv {
    VmEnv {
        declared_in: "vmConfig.env",
        vars: vars
            .iter()
            .map(|(k, v)| ((*k).to_string(), v.clone()))
            .collect(),
    }
}

#[test]
fn an_undeclared_variable_is_warned_about() {
    let env = declared(&[("CG_AUTH", EnvValue::Host)]);
    let (summary, warnings) = check(CONFIG.as_bytes(), &Environment(Some(&env))).expect("valid");
    assert!(summary.contains("credential from $CG_AUTH in the VM's environment (from the proxy's environment, not checked here)"), "{summary}");
    assert!(
        summary.contains(
            "with the key in $CG_KEY, opened also with $CG_OLD (not declared in vmConfig.env)"
        ),
        "{summary}"
    );
    assert_eq!(
            warnings,
            [
                "policies[0].idempotency.encryption.key_env names CG_KEY, which vmConfig.env does not declare: the Wasm VM will not have it, and the filter will refuse its configuration",
                "policies[0].idempotency.encryption.previous_key_env names CG_OLD, which vmConfig.env does not declare: the Wasm VM will not have it, and the filter will refuse its configuration",
            ]
        );
}

#[test]
fn a_value_given_in_the_file_is_checked() {
    let good = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let env = declared(&[
        ("CG_AUTH", EnvValue::Inline("Basic eDp5".into())),
        ("CG_KEY", EnvValue::Inline(good.into())),
        ("CG_OLD", EnvValue::Host),
    ]);
    let (summary, warnings) = check(CONFIG.as_bytes(), &Environment(Some(&env))).expect("valid");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(summary.contains("with the key in $CG_KEY (its value inline in vmConfig.env, checked; a secret there is visible in the config), opened also with $CG_OLD (from the proxy's environment, not checked here)"), "{summary}");
    let bad = declared(&[
        ("CG_AUTH", EnvValue::Host),
        ("CG_KEY", EnvValue::Inline("short".into())),
        ("CG_OLD", EnvValue::Host),
    ]);
    let err = check(CONFIG.as_bytes(), &Environment(Some(&bad))).expect_err("a bad key");
    assert!(
        err.starts_with("policies[0].idempotency.encryption.key_env: environment variable CG_KEY"),
        "{err}"
    );
}
