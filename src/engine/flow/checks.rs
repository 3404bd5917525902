//! The request's own problems, answered before any guard runs: a path that reads more than
//! one way, a missing or repeated tenant, a repeated selector input, a missing lease resource.

use crate::config::IdSource;
use crate::guards::context::Pcx;
use crate::guards::ratelimit::charge::parse_units;
use crate::http::identity::TenantError;
use crate::http::local_reply::{self, LocalResponse, Member, Problem};
use crate::http::request::Request;
use crate::http::selectors::{ambiguous_input, Ambiguity};

/// A request whose path reads more than one way: refused, since the service may read it the
/// way the guard did not.
/// `types` is the configuration's `problem_type_base`.
pub(crate) fn ambiguous_path(types: &str) -> LocalResponse {
    local_reply::problem(
        types,
        Problem::AmbiguousPath,
        "the request path has more than one reading (an encoded '/', a '\\', a NUL, a \
         broken or double escape, ';' parameters or '..' after '//'); send it in its \
         plain form",
        &[],
        Vec::new(),
    )
}

/// The tenant (or principal) could not be told, counted.
pub(crate) fn tenant_problem(at: &Pcx<'_>, err: TenantError) -> LocalResponse {
    let identity = &at.rt.config.identity;
    match err {
        TenantError::Missing | TenantError::Unusable => {
            at.m.increment(at.pm.missing_tenant);
            let tenant = identity.tenant.describe();
            let detail = if err == TenantError::Missing {
                format!("this operation requires {tenant}")
            } else {
                format!(
                    "{tenant} names no one tenant: it must be a string or an integer from \
                     -(2^53 - 1) to 2^53 - 1"
                )
            };
            // A 401 carries a challenge (RFC 9110): the scheme names what is missing.
            let challenge = match &identity.tenant {
                IdSource::Header(header) => format!("Tenant header=\"{header}\""),
                IdSource::Metadata(_) => "Bearer".to_string(),
            };
            local_reply::problem(
                types(at),
                Problem::MissingTenant,
                &detail,
                &[],
                vec![("www-authenticate".into(), challenge)],
            )
        }
        TenantError::Repeated => {
            at.m.increment(at.pm.missing_tenant);
            let detail = format!("{} must appear once", identity.tenant.describe());
            local_reply::problem(
                types(at),
                Problem::AmbiguousTenant,
                &detail,
                &[],
                Vec::new(),
            )
        }
        TenantError::PrincipalRepeated => {
            at.m.increment(at.pm.ambiguous_input);
            let detail = format!("{} must appear once", identity.principal.describe());
            local_reply::problem(
                types(at),
                Problem::AmbiguousPrincipal,
                &detail,
                &[],
                Vec::new(),
            )
        }
        TenantError::PrincipalUnusable => {
            at.m.increment(at.pm.ambiguous_input);
            let detail = format!(
                "{} names no one principal: it must be a string or an integer from -(2^53 - 1) \
                 to 2^53 - 1",
                identity.principal.describe()
            );
            local_reply::problem(
                types(at),
                Problem::AmbiguousPrincipal,
                &detail,
                &[],
                Vec::new(),
            )
        }
    }
}

/// An input a limit or the lease is keyed by appears more than once, counted.
pub(crate) fn repeated_selector(at: &Pcx<'_>, req: &Request) -> Option<LocalResponse> {
    let selectors = at
        .policy
        .rate_limits
        .iter()
        .flat_map(|l| &l.by)
        .chain(at.policy.lease.iter().flat_map(|l| &l.resource));
    let (sel, why) = ambiguous_input(selectors, req)?;
    Some(ambiguous_selector(at, &sel.spelling(), why))
}

/// The `400` for an input (`spelling`, e.g. `header:x-cost`) that has more than one reading,
/// counted.
fn ambiguous_selector(at: &Pcx<'_>, spelling: &str, why: Ambiguity) -> LocalResponse {
    at.m.increment(at.pm.ambiguous_input);
    let detail = match why {
        Ambiguity::Repeated => format!("{spelling} must appear at most once in the request"),
        Ambiguity::Semicolon => format!(
            "{spelling} reads otherwise where ';' separates query parameters too; send the \
             query without ';' (or encode it as %3B)"
        ),
    };
    local_reply::problem(
        types(at),
        Problem::AmbiguousSelector,
        &detail,
        &[("selector", Member::Str(spelling))],
        Vec::new(),
    )
}

/// The request lacks the input that names the lease's resource, counted.
pub(crate) fn lease_resource_missing(at: &Pcx<'_>, missing: &str) -> LocalResponse {
    if let Some(lm) = at.pm.lease.as_ref() {
        at.m.increment(lm.missing_resource);
    }
    let detail = format!(
        "this operation needs the lease resource {missing}, which the request does not carry"
    );
    local_reply::problem(
        types(at),
        Problem::LeaseResourceMissing,
        &detail,
        &[("missing-selector", Member::Str(missing))],
        Vec::new(),
    )
}

/// The request's cost to each rate limit: its `cost` header (once, a whole number from `min`
/// to `max`), `default` without it, 1 for a limit without `cost`; empty (each limit 1) when no
/// limit has a `cost`, the usual policy. `Err`: the answer.
pub(crate) fn costs(at: &Pcx<'_>, req: &Request) -> Result<Vec<u64>, LocalResponse> {
    if at.policy.rate_limits.iter().all(|l| l.cost.is_none()) {
        return Ok(Vec::new());
    }
    let mut costs = Vec::with_capacity(at.policy.rate_limits.len());
    for limit in &at.policy.rate_limits {
        let Some(cost) = limit.cost.as_ref() else {
            costs.push(1);
            continue;
        };
        let value = req.single_header(&cost.header).map_err(|_| {
            let spelling = format!("header:{}", cost.header);
            ambiguous_selector(at, &spelling, Ambiguity::Repeated)
        })?;
        match value.map(|v| parse_units(v.trim())) {
            None => costs.push(cost.default),
            Some(Some(n)) if (cost.min..=cost.max).contains(&n) => costs.push(n),
            Some(_) => {
                let detail = format!(
                    "{} must be a whole number of units from {} to {} (rate limit \"{}\")",
                    cost.header, cost.min, cost.max, limit.name
                );
                return Err(local_reply::problem(
                    types(at),
                    Problem::InvalidCost,
                    &detail,
                    &[("header", Member::Str(&cost.header))],
                    Vec::new(),
                ));
            }
        }
    }
    Ok(costs)
}

/// The configuration's `problem_type_base`, which every problem's `type` starts with.
fn types<'a>(at: &'a Pcx<'_>) -> &'a str {
    &at.rt.config.problem_type_base
}
