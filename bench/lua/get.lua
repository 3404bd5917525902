-- GET /api/items as tenant "bench": one static request (wrk pre-builds it), used by plain
-- Envoy, the local_ratelimit anchor and the filter with no matching policy.
wrk.method = "GET"
wrk.path = "/api/items"
wrk.headers["x-tenant-id"] = "bench"
