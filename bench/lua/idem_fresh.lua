-- POST /orders with a small JSON body and a new Idempotency-Key per request (idem_fresh):
-- "<run nonce>-<thread>-<n>", unique across threads and runs.
local nonce, thread_id, n = "", "0", 0
local headers = {
  ["x-tenant-id"] = "bench",
  ["content-type"] = "application/json",
}
local body = '{"customer":"c-123","items":[{"sku":"SKU-1","qty":2}],"currency":"EUR"}'

function init(args)
  nonce = args[1]
  thread_id = tostring(bench_thread or 0)
end

function request()
  n = n + 1
  headers["idempotency-key"] = nonce .. "-" .. thread_id .. "-" .. n
  return wrk.format("POST", "/orders", headers, body)
end
