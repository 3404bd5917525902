//! What a selector (`by`, a lease's `resource`) reads of a request, and whether that input
//! reads more than one way: one resource has one name, and an input a service could read
//! otherwise is refused, not guessed.

use crate::config::Selector;
use crate::http::identity::Caller;
use crate::http::normalize::{query_pairs_semicolon, trim_slash};
use crate::http::request::Request;

/// The value a selector takes for this request; `None` when the request does not carry it.
/// Paths are canonical and query parameters decoded, so one resource has one name; a
/// repeated input is refused before (see [`ambiguous_input`]).
pub(crate) fn selector_value<'a>(
    sel: &Selector,
    caller: &'a Caller,
    req: &'a Request,
) -> Option<&'a str> {
    match sel {
        Selector::Tenant => Some(caller.tenant.as_str()),
        Selector::Principal => Some(caller.principal.as_ref()),
        Selector::ClientIp => req.client_ip.as_deref(),
        Selector::Method => Some(&req.method),
        Selector::Path => Some(trim_slash(req.path())),
        Selector::Header(h) => req.header(h),
        Selector::PathSegment(n) => req.path().split('/').nth(*n).filter(|s| !s.is_empty()),
        // The path fits the template: its policy matched it.
        Selector::PathParam(p) => p.value(req.path()),
        Selector::Query(name) => req
            .params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str()),
    }
}

/// Why a selector's input has more than one reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ambiguity {
    /// The request carries it more than once (a service may read the first, another the last).
    Repeated,
    /// A service that also splits the query on `;` reads another value of the parameter (or
    /// none, or more): `?id=8;` is `8;` here and `8` there.
    Semicolon,
}

/// The first of `selectors` whose input has more than one reading (a header or a query
/// parameter the request carries more than once, a query parameter a `;` changes), and why:
/// which value names the scope is ambiguous.
pub(crate) fn ambiguous_input<'s>(
    selectors: impl IntoIterator<Item = &'s Selector>,
    req: &Request,
) -> Option<(&'s Selector, Ambiguity)> {
    // The `;` reading, made once and only for a query that holds one.
    let mut semicolon: Option<Vec<(String, String)>> = None;
    selectors.into_iter().find_map(|sel| match sel {
        Selector::Header(h) if req.single_header(h).is_err() => Some((sel, Ambiguity::Repeated)),
        Selector::Query(q) if req.single_param(q).is_err() => Some((sel, Ambiguity::Repeated)),
        Selector::Query(q) if req.query.contains(';') => {
            let other = semicolon.get_or_insert_with(|| query_pairs_semicolon(&req.query));
            let values = |pairs: &[(String, String)]| -> Vec<String> {
                pairs
                    .iter()
                    .filter(|(n, _)| n == q)
                    .map(|(_, v)| v.clone())
                    .collect()
            };
            (values(&req.params) != values(other)).then_some((sel, Ambiguity::Semicolon))
        }
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::tests::req;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn selector_values() {
        let r = req("POST", "/orders/123/activate?mode=fast&x=&dry", "h");
        let caller = Caller {
            tenant: "t".into(),
            principal: "p".into(),
        };
        let cases = [
            (Selector::PathSegment(1), Some("orders")),
            (Selector::PathSegment(2), Some("123")),
            (Selector::PathSegment(3), Some("activate")),
            (Selector::PathSegment(4), None),
            (Selector::Query("mode".into()), Some("fast")),
            (Selector::Query("x".into()), Some("")),
            (Selector::Query("dry".into()), Some("")),
            (Selector::Query("missing".into()), None),
            (Selector::Header("x-tenant-id".into()), Some("acme")),
            (Selector::Method, Some("POST")),
            (Selector::Path, Some("/orders/123/activate")),
        ];
        for (sel, want) in cases {
            assert_eq!(selector_value(&sel, &caller, &r), want, "{sel:?}");
        }
        // One resource, one name: however the path and query are spelled.
        for (path, segment, id) in [
            ("/orders//123/activate/?id=8", "123", "8"),
            ("/orders/%31%32%33/activate?id=%38", "123", "8"),
            ("/x/../orders/123/./activate?i%64=8", "123", "8"),
            ("/%6Frders/12%33/activate?id=8&other=1", "123", "8"),
        ] {
            let r = req("POST", path, "h");
            assert_eq!(
                selector_value(&Selector::PathSegment(2), &caller, &r),
                Some(segment),
                "{path}"
            );
            assert_eq!(
                selector_value(&Selector::Query("id".into()), &caller, &r),
                Some(id),
                "{path}"
            );
            assert_eq!(
                selector_value(&Selector::Path, &caller, &r),
                Some("/orders/123/activate"),
                "{path}"
            );
        }
        let r = req("POST", "/orders/a%3Ab?q=a+b%2Bc", "h");
        assert_eq!(
            selector_value(&Selector::PathSegment(2), &caller, &r),
            Some("a:b")
        );
        assert_eq!(
            selector_value(&Selector::Query("q".into()), &caller, &r),
            Some("a b+c")
        );
    }

    /// `path_param:<name>` reads the canonical path as `path_segment:<n>` does: one
    /// resource, one name, however the path is spelled.
    #[test]
    fn path_params_read_the_canonical_path() {
        let config = crate::config::Config::parse(
            br#"{"redis": {"cluster": "gw"}, "policies": [
                {"name": "t", "match": {"path_template": "/accounts/{id}/transfer/{rest=**}"},
                 "lease": {"resource": ["path_param:id", "path_param:rest", "path_segment:2"]}}]}"#,
        )
        .expect("valid");
        let lease = config.policies[0].lease.as_ref().expect("lease");
        let [id, rest, segment] = &lease.resource[..] else {
            panic!("{:?}", lease.resource);
        };
        let caller = Caller {
            tenant: "t".into(),
            principal: "p".into(),
        };
        for (path, want_id, want_rest) in [
            ("/accounts/42/transfer/a/b", Some("42"), Some("a/b")),
            ("/accounts/42/transfer/a/b/", Some("42"), Some("a/b")),
            ("/accounts/%34%32/transfer/a/b", Some("42"), Some("a/b")),
            ("/accounts//42/transfer//a//b", Some("42"), Some("a/b")),
            ("/accounts/x/../42/transfer/a/./b", Some("42"), Some("a/b")),
            ("/accounts/42/transfer/%61%2Db", Some("42"), Some("a-b")),
            ("/accounts/a%20b/transfer/c%3Ad", Some("a b"), Some("c:d")),
            ("/accounts/42/transfer/", Some("42"), Some("")),
            // Not the template: absent (the policy does not guard such a request).
            ("/accounts/42/close/a", None, None),
            ("/accounts/42/transfer", None, None),
        ] {
            let r = req("POST", path, "h");
            assert_eq!(selector_value(id, &caller, &r), want_id, "{path}");
            assert_eq!(selector_value(rest, &caller, &r), want_rest, "{path}");
            if want_id.is_some() {
                assert_eq!(
                    selector_value(id, &caller, &r),
                    selector_value(segment, &caller, &r),
                    "{path}: the same segment, the same value"
                );
            }
        }
    }

    #[test]
    fn repeated_inputs_are_ambiguous() {
        let mut r = req("POST", "/orders/1?id=1&id=2&one=1", "h");
        r.headers.push("x-a", "1");
        r.headers.push("x-a", "2");
        r.headers.push("x-b", "1");
        let q = Selector::Query("id".into());
        let a = Selector::Header("x-a".into());
        type Found<'s> = Option<(&'s Selector, Ambiguity)>;
        let repeated = |s| Some((s, Ambiguity::Repeated));
        let cases: [(&[Selector], Found<'_>); 6] = [
            (&[Selector::Tenant, Selector::PathSegment(2)], None),
            (&[Selector::Query("one".into())], None),
            (&[Selector::Header("x-b".into())], None),
            (&[Selector::Tenant, q.clone()], repeated(&q)),
            (std::slice::from_ref(&a), repeated(&a)),
            (&[Selector::Query("absent".into())], None),
        ];
        for (sels, want) in cases {
            assert_eq!(ambiguous_input(sels, &r), want, "{sels:?}");
        }
        // Repeated once decoded: `i%64` is `id`.
        let r = req("POST", "/orders/1?id=1&i%64=1", "h");
        assert_eq!(ambiguous_input(std::slice::from_ref(&q), &r), repeated(&q));
    }

    #[test]
    fn a_semicolon_that_changes_a_query_selector_is_ambiguous() {
        let q = Selector::Query("id".into());
        let semicolon = Some((&q, Ambiguity::Semicolon));
        for (query, want) in [
            ("id=8;", semicolon),
            ("id=8;id=9", semicolon),
            ("x=1;id=9", semicolon),
            ("id=8;x=1", semicolon),
            ("id=8&x=1;id=9", semicolon),
            ("x=a;b&id=8", None),
            ("id=8&x=a;b", None),
            ("id=8%3B", None),
            ("x=a;b", None),
            ("id=8&id=8;", Some((&q, Ambiguity::Repeated))),
        ] {
            let r = req("POST", &format!("/orders/1?{query}"), "h");
            assert_eq!(
                ambiguous_input(std::slice::from_ref(&q), &r),
                want,
                "{query}"
            );
        }
        // Other selectors never mind a `;`.
        let r = req("POST", "/orders/1?id=8;", "h");
        assert_eq!(ambiguous_input(&[Selector::PathSegment(2)], &r), None);
    }
}
