-- POST /orders with the same Idempotency-Key (first script argument) and body on every request
-- (idem_replay): after the warm-up request that stored the response, every request is a replay.
wrk.method = "POST"
wrk.path = "/orders"
wrk.headers["x-tenant-id"] = "bench"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"customer":"c-123","items":[{"sku":"SKU-1","qty":2}],"currency":"EUR"}'

function init(args)
  wrk.headers["idempotency-key"] = args[1]
end
