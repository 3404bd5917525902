//! Who is calling: the tenant and the principal a request names, from its headers or from
//! the claims Envoy verified (read from the request's metadata, see [`crate::http::claims`]).

use crate::config::{IdSource, Identity, MissingTenant};
use crate::http::claims::Claim;
use crate::http::request::{Repeated, Request};
use std::borrow::Cow;

/// Who is calling: the raw tenant and principal. These never leave the filter unhashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    /// Borrowed when anonymous: most requests name no principal.
    pub principal: Cow<'static, str>,
}

/// The tenant of requests without one (`missing_tenant: anonymous`), and the principal of
/// requests without one: a name no request can give (no header value or claim holds a NUL,
/// see [`identify`]), so no real tenant or principal shares their counters.
pub(crate) const ANONYMOUS: &str = "\0anonymous";

/// Why a request has no usable identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TenantError {
    /// Absent or empty, and `missing_tenant: reject`.
    Missing,
    /// Present, but it names no one tenant (a claim that is a fraction, a number a double
    /// cannot hold exactly, a boolean, a map, a list or null; a value with a NUL): refused
    /// whatever `missing_tenant` says.
    Unusable,
    /// The tenant header appears more than once: which tenant is calling is ambiguous.
    Repeated,
    /// The principal header appears more than once.
    PrincipalRepeated,
    /// The principal is present but names no one principal (as [`TenantError::Unusable`]).
    PrincipalUnusable,
}

/// Resolves the caller from its identity sources: headers, or claims read from the request's
/// metadata (then the header of that role is ignored entirely: a forged one changes nothing).
pub(crate) fn identify(identity: &Identity, req: &Request) -> Result<Caller, TenantError> {
    let tenant = match &identity.tenant {
        IdSource::Header(h) => req
            .single_header(h)
            .map_err(|Repeated| TenantError::Repeated)?,
        IdSource::Metadata(_) => claim(&req.tenant_claim).ok_or(TenantError::Unusable)?,
    };
    let tenant = match tenant.filter(|t| !t.is_empty()) {
        Some(t) if t.contains('\0') => return Err(TenantError::Unusable),
        Some(t) => t.to_string(),
        None if identity.missing_tenant == MissingTenant::Anonymous => ANONYMOUS.to_string(),
        None => return Err(TenantError::Missing),
    };
    let principal = match &identity.principal {
        IdSource::Header(h) => req
            .single_header(h)
            .map_err(|Repeated| TenantError::PrincipalRepeated)?,
        IdSource::Metadata(_) => {
            claim(&req.principal_claim).ok_or(TenantError::PrincipalUnusable)?
        }
    };
    let principal = match principal.filter(|p| !p.is_empty()) {
        Some(p) if p.contains('\0') => return Err(TenantError::PrincipalUnusable),
        Some(p) => Cow::Owned(p.to_string()),
        None => Cow::Borrowed(ANONYMOUS),
    };
    Ok(Caller { tenant, principal })
}

/// A claim as an identity's text (`Ok(None)`: absent); `None` when it names no one identity.
fn claim(claim: &Claim) -> Option<Option<&str>> {
    match claim {
        Claim::Absent => Some(None),
        Claim::Text(t) => Some(Some(t.as_str())),
        Claim::Unusable => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::tests::req;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn identity() {
        let mut id = Identity {
            tenant: IdSource::Header("x-tenant-id".into()),
            principal: IdSource::Header("x-user-id".into()),
            missing_tenant: MissingTenant::Reject,
        };
        let with = req("GET", "/", "h");
        let caller = identify(&id, &with).expect("tenant present");
        assert_eq!(caller.tenant, "acme");
        assert_eq!(caller.principal, ANONYMOUS);
        let mut without = with.clone();
        without.headers.retain(|n, _| n != "x-tenant-id");
        assert_eq!(identify(&id, &without), Err(TenantError::Missing));
        without.headers.push("x-tenant-id", "");
        assert_eq!(
            identify(&id, &without),
            Err(TenantError::Missing),
            "empty tenant is missing"
        );
        let mut twice = with.clone();
        twice.headers.push("x-tenant-id", "globex");
        assert_eq!(identify(&id, &twice), Err(TenantError::Repeated));
        let mut two_users = with.clone();
        two_users.headers.push("x-user-id", "alice");
        two_users.headers.push("x-user-id", "mallory");
        assert_eq!(
            identify(&id, &two_users),
            Err(TenantError::PrincipalRepeated)
        );
        id.missing_tenant = MissingTenant::Anonymous;
        assert_eq!(
            identify(&id, &without).expect("anonymous").tenant,
            ANONYMOUS
        );
        // No tenant a request names is the anonymous bucket.
        let mut named = with.clone();
        named.headers.retain(|n, _| n != "x-tenant-id");
        named.headers.push("x-tenant-id", "anonymous");
        assert_eq!(identify(&id, &named).expect("a tenant").tenant, "anonymous");
        assert_ne!(ANONYMOUS, "anonymous");
        named.headers.retain(|n, _| n != "x-tenant-id");
        named.headers.push("x-tenant-id", ANONYMOUS);
        assert_eq!(identify(&id, &named), Err(TenantError::Unusable));
    }

    #[test]
    fn identity_from_claims_ignores_the_headers() {
        let claims = Identity {
            tenant: IdSource::Metadata(vec!["f".into(), "payload".into(), "tid".into()]),
            principal: IdSource::Metadata(vec!["f".into(), "payload".into(), "sub".into()]),
            missing_tenant: MissingTenant::Reject,
        };
        let mut r = req("GET", "/", "h");
        r.headers.push("x-user-id", "mallory");
        r.headers.push("x-user-id", "again");
        assert_eq!(
            identify(&claims, &r),
            Err(TenantError::Missing),
            "no claim, header ignored"
        );
        r.tenant_claim = Claim::Text("tenant-a".into());
        let caller = identify(&claims, &r).expect("from the claim");
        assert_eq!(
            (caller.tenant.as_str(), caller.principal.as_ref()),
            ("tenant-a", ANONYMOUS)
        );
        r.principal_claim = Claim::Text("alice".into());
        assert_eq!(identify(&claims, &r).expect("claims").principal, "alice");
        r.principal_claim = Claim::Unusable;
        assert_eq!(identify(&claims, &r), Err(TenantError::PrincipalUnusable));
        r.principal_claim = Claim::Absent;
        // A claim that names no one tenant is refused, even where a missing one is anonymous.
        let mut anonymous = claims.clone();
        anonymous.missing_tenant = MissingTenant::Anonymous;
        r.tenant_claim = Claim::Unusable;
        assert_eq!(identify(&anonymous, &r), Err(TenantError::Unusable));
        r.tenant_claim = Claim::Absent;
        assert_eq!(
            identify(&anonymous, &r).expect("anonymous").tenant,
            ANONYMOUS
        );
        r.tenant_claim = Claim::Text("anonymous".into());
        assert_ne!(
            identify(&anonymous, &r).expect("a tenant").tenant,
            ANONYMOUS
        );
    }
}
