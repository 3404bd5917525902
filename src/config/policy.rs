//! A policy: its match and its sections (rate limits, idempotency, lease), and the caller's
//! identity.

use crate::config::fields::{failure_mode, header_name, methods, name, one_of};
use crate::config::reader::{index, Obj, Result};
use crate::config::{
    idempotency::idempotency, lease::lease, rate_limit::rate_limits, Algorithm, ConfigError, Env,
    FailureMode, Lease, Limits, PathTemplate, Policy, RateLimit, Selector,
};
use serde_json::Value;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingTenant {
    /// `401` problem+json.
    Reject,
    /// The request is treated as tenant `anonymous`.
    Anonymous,
}

/// Where a role of the caller (tenant, principal) comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdSource {
    /// A request header (lower case), which something the operator trusts sets.
    Header(String),
    /// A leaf of the request's dynamic metadata, e.g. a claim of the payload Envoy's
    /// `jwt_authn` verified: `[filter, key, claim...]`. The header of the same role is then
    /// ignored entirely.
    Metadata(Vec<String>),
}

impl IdSource {
    /// How a message to the client names it: "the x-tenant-id header", "the tid claim".
    pub fn describe(&self) -> String {
        match self {
            IdSource::Header(h) => format!("the {h} header"),
            IdSource::Metadata(path) => format!(
                "the {} claim of a verified token",
                path.last().map_or("", String::as_str)
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub tenant: IdSource,
    pub principal: IdSource,
    pub missing_tenant: MissingTenant,
}

impl Identity {
    /// The metadata paths the request must be read at (the adapter reads them only then).
    pub fn uses_metadata(&self) -> bool {
        matches!(self.tenant, IdSource::Metadata(_))
            || matches!(self.principal, IdSource::Metadata(_))
    }
}

/// A condition on a request header of `match.headers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderMatch {
    /// Lower case.
    pub name: String,
    pub test: HeaderTest,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderTest {
    Exact(String),
    Prefix(String),
    /// `true`: the header is there (once or more); `false`: it is not.
    Present(bool),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    /// Upper-case methods; empty = any.
    pub methods: Vec<String>,
    pub path_prefix: Option<String>,
    pub path_exact: Option<String>,
    /// `path_template`, compiled; shared with the policy's `path_param` selectors.
    pub path_template: Option<Arc<PathTemplate>>,
    /// Lower-case host without port.
    pub host: Option<String>,
    /// Conditions on request headers, all of which must hold.
    pub headers: Vec<HeaderMatch>,
}

impl Match {
    /// The match in a few words, as the host tools show it: `POST, path /orders/*`, or
    /// `every request`.
    pub fn describe(&self) -> String {
        let m = self;
        let mut parts = Vec::new();
        if !m.methods.is_empty() {
            parts.push(m.methods.join("|"));
        }
        match (&m.path_exact, &m.path_prefix, &m.path_template) {
            (Some(e), _, _) => parts.push(format!("path = {e}")),
            (None, Some(p), _) => parts.push(format!("path {p}*")),
            (None, None, Some(t)) if t.names().next().is_none() => {
                parts.push(format!("path template {}", t.as_str()))
            }
            (None, None, Some(t)) => parts.push(format!(
                "path template {} ({})",
                t.as_str(),
                t.describe_variables()
            )),
            _ => {}
        }
        if let Some(h) = &m.host {
            parts.push(format!("host {h}"));
        }
        for h in &m.headers {
            parts.push(match &h.test {
                HeaderTest::Exact(v) => format!("header {} = {v:?}", h.name),
                HeaderTest::Prefix(v) => format!("header {} starts with {v:?}", h.name),
                HeaderTest::Present(true) => format!("header {} present", h.name),
                HeaderTest::Present(false) => format!("header {} absent", h.name),
            });
        }
        if parts.is_empty() {
            "every request".into()
        } else {
            parts.join(", ")
        }
    }
}

const IDENTITY_FIELDS: &[&str] = &[
    "tenant",
    "tenant_header",
    "principal",
    "principal_header",
    "missing_tenant",
];

const POLICY_FIELDS: &[&str] = &[
    "name",
    "match",
    "failure_mode",
    "rate_limits",
    "idempotency",
    "lease",
];

pub fn identity(v: &Value, path: &str) -> Result<Identity> {
    let mut o = Obj::new(v, path, IDENTITY_FIELDS)?;
    let tenant = id_source(&mut o, "tenant", "tenant_header", "x-tenant-id")?;
    let principal = id_source(&mut o, "principal", "principal_header", "x-user-id")?;
    let missing_tenant = one_of(
        &mut o,
        "missing_tenant",
        &[
            ("reject", MissingTenant::Reject),
            ("anonymous", MissingTenant::Anonymous),
        ],
    )?
    .unwrap_or(MissingTenant::Reject);
    Ok(Identity {
        tenant,
        principal,
        missing_tenant,
    })
}

/// A role's source: `<role>: {"header": ...}` or `{"metadata": [...]}`, or the short form
/// `<short>: "<header>"`; not both.
fn id_source(
    o: &mut Obj<'_>,
    role: &'static str,
    short: &'static str,
    default: &str,
) -> Result<IdSource> {
    let header = header_name(o, short)?;
    let Some(v) = o.get(role) else {
        return Ok(IdSource::Header(header.unwrap_or_else(|| default.into())));
    };
    let path = o.field_path(role);
    if header.is_some() {
        return Err(ConfigError::new(
            path,
            format!("give either {role} or {short}, not both"),
        ));
    }
    let mut src = Obj::new(v, &path, &["header", "metadata"])?;
    let header = header_name(&mut src, "header")?;
    let meta_path = src.field_path("metadata");
    let metadata = src.opt_str_list("metadata")?;
    match (header, metadata) {
        (Some(h), None) => Ok(IdSource::Header(h)),
        (None, Some(m)) => {
            if m.len() < 2 || m.len() > 8 || m.iter().any(|p| p.is_empty()) {
                return Err(ConfigError::new(
                    meta_path,
                    "must be 2 to 8 non-empty names: [filter, key, ...], e.g. \
                     [\"envoy.filters.http.jwt_authn\", \"payload\", \"sub\"]",
                ));
            }
            Ok(IdSource::Metadata(
                m.iter().map(|p| p.to_string()).collect(),
            ))
        }
        _ => Err(ConfigError::new(
            path,
            "must be {\"header\": \"<name>\"} or {\"metadata\": [path...]}",
        )),
    }
}

pub fn policy(
    v: &Value,
    path: &str,
    default_failure: FailureMode,
    limits: Limits,
    env: Env<'_>,
) -> Result<Policy> {
    let mut o = Obj::new(v, path, POLICY_FIELDS)?;
    let name = name(&mut o, "name")?;
    let matcher = match o.get("match") {
        Some(m) => matcher(m, &o.field_path("match"))?,
        None => Match::default(),
    };
    let failure_mode = failure_mode(&mut o, "failure_mode")?.unwrap_or(default_failure);
    let mut rate_limits = rate_limits(&mut o, "rate_limits", limits)?;
    let idempotency = match o.get("idempotency") {
        Some(v) => Some(idempotency(v, &o.field_path("idempotency"), limits, env)?),
        None => None,
    };
    let mut lease = match o.get("lease") {
        Some(v) => Some(lease(v, &o.field_path("lease"))?),
        None => None,
    };
    bind_path_params(path, &matcher, &mut rate_limits, lease.as_mut())?;
    let uses_client_ip = rate_limits
        .iter()
        .flat_map(|l| &l.by)
        .chain(lease.iter().flat_map(|l| &l.resource))
        .any(|s| *s == Selector::ClientIp);
    let needs_tokens = idempotency.is_some()
        || lease.is_some()
        || rate_limits
            .iter()
            .any(|l| matches!(l.algorithm, Algorithm::SlidingLog | Algorithm::Concurrency));
    Ok(Policy {
        uses_client_ip,
        needs_tokens,
        name,
        matcher,
        failure_mode,
        rate_limits,
        idempotency,
        lease,
    })
}

/// Binds every `path_param:<name>` of the policy's limits and lease to the variable of its
/// template; a name the template does not define (or a policy without one) is refused,
/// naming the selector.
fn bind_path_params(
    path: &str,
    matcher: &Match,
    rate_limits: &mut [RateLimit],
    lease: Option<&mut Lease>,
) -> Result<()> {
    let limits = rate_limits.iter_mut().enumerate().flat_map(|(i, l)| {
        let at = index(&format!("{path}.rate_limits"), i);
        l.by.iter_mut()
            .enumerate()
            .map(move |(j, s)| (index(&format!("{at}.by"), j), s))
    });
    let resource = lease.into_iter().flat_map(|l| {
        l.resource
            .iter_mut()
            .enumerate()
            .map(|(j, s)| (index(&format!("{path}.lease.resource"), j), s))
    });
    for (at, sel) in limits.chain(resource) {
        let Selector::PathParam(p) = sel else {
            continue;
        };
        let Some(template) = &matcher.path_template else {
            return Err(ConfigError::new(
                at,
                format!(
                    "path_param:{} reads a variable of match.path_template, and this policy's \
                     match has none (e.g. \"path_template\": \"/accounts/{{{}}}/transfer\")",
                    p.name, p.name
                ),
            ));
        };
        let Some(i) = template.variable_index(&p.name) else {
            let names: Vec<&str> = template.names().collect();
            return Err(ConfigError::new(
                at,
                format!(
                    "path_param:{} names no variable of match.path_template {:?} ({})",
                    p.name,
                    template.as_str(),
                    if names.is_empty() {
                        "it defines none".to_string()
                    } else {
                        format!("it defines {}", names.join(", "))
                    }
                ),
            ));
        };
        p.bound = Some((Arc::clone(template), i));
    }
    Ok(())
}

fn matcher(v: &Value, path: &str) -> Result<Match> {
    let known = &[
        "methods",
        "path_prefix",
        "path_exact",
        "path_template",
        "host",
        "headers",
    ];
    let mut o = Obj::new(v, path, known)?;
    let methods = methods(&mut o, "methods")?.unwrap_or_default();
    let path_prefix = request_path(&mut o, "path_prefix")?;
    let path_exact = request_path(&mut o, "path_exact")?;
    let path_template = match o.opt_str("path_template")? {
        Some(t) => Some(Arc::new(PathTemplate::parse(t).map_err(|why| {
            ConfigError::new(
                o.field_path("path_template"),
                format!("{t:?} is not a path template: {why}"),
            )
        })?)),
        None => None,
    };
    // One way to match the path: two would both have to hold, which is never what was meant.
    let given: Vec<&str> = [
        ("path_prefix", path_prefix.is_some()),
        ("path_exact", path_exact.is_some()),
        ("path_template", path_template.is_some()),
    ]
    .into_iter()
    .filter_map(|(f, given)| given.then_some(f))
    .collect();
    if let [first, second, ..] = given[..] {
        return Err(ConfigError::new(
            o.field_path(second),
            format!("give one of path_prefix, path_exact and path_template, not {first} and {second} both"),
        ));
    }
    let host = match o.opt_str("host")? {
        Some(h) if h.is_empty() || h.contains(char::is_whitespace) => {
            return Err(ConfigError::new(
                o.field_path("host"),
                format!("{h:?} is not a host name"),
            ))
        }
        h => h.map(str::to_ascii_lowercase),
    };
    let mut headers = Vec::new();
    let headers_path = o.field_path("headers");
    if let Some(items) = o.opt_array("headers")? {
        for (i, item) in items.iter().enumerate() {
            headers.push(header_match(item, &index(&headers_path, i))?);
        }
    }
    Ok(Match {
        methods,
        path_prefix,
        path_exact,
        path_template,
        host,
        headers,
    })
}

/// `{"name": ..., "exact" | "prefix": "...", "present": true|false}`: one test per entry.
fn header_match(v: &Value, path: &str) -> Result<HeaderMatch> {
    let mut o = Obj::new(v, path, &["name", "exact", "prefix", "present"])?;
    let name = header_name(&mut o, "name")?
        .ok_or_else(|| ConfigError::new(o.field_path("name"), "is required"))?;
    let exact = o
        .opt_str("exact")?
        .map(|v| HeaderTest::Exact(v.to_string()));
    let prefix = o
        .opt_str("prefix")?
        .map(|v| HeaderTest::Prefix(v.to_string()));
    let present = o.opt_bool("present")?.map(HeaderTest::Present);
    let mut tests = [exact, prefix, present].into_iter().flatten();
    match (tests.next(), tests.next()) {
        (Some(test), None) => Ok(HeaderMatch { name, test }),
        _ => Err(ConfigError::new(
            path,
            "must have exactly one of exact, prefix, present",
        )),
    }
}

/// A path of a match: requests are matched in their canonical form, so the path must be
/// written in it too (else it could never match).
fn request_path(o: &mut Obj<'_>, field: &'static str) -> Result<Option<String>> {
    match o.opt_str(field)? {
        Some(p) if !p.starts_with('/') => Err(ConfigError::new(
            o.field_path(field),
            format!("{p:?} must start with '/'"),
        )),
        Some(p) => {
            let form = crate::support::normalize::normalize_path(p);
            if form.ambiguous || form.canonical != p {
                let hint = if form.ambiguous {
                    "spell it without encoded '/', '\\', NUL, ';' or '..'".to_string()
                } else {
                    format!("write {:?}", form.canonical)
                };
                return Err(ConfigError::new(
                    o.field_path(field),
                    format!(
                        "{p:?} is not a normalised path (requests are matched decoded, with \
                         slashes merged and dot segments removed): {hint}"
                    ),
                ));
            }
            Ok(Some(p.to_string()))
        }
        None => Ok(None),
    }
}
