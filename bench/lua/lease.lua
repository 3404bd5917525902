-- POST /orders/<id>/activate with a new <id> per request (lease): every request takes the lease
-- of a resource nobody holds, so it always acquires (never 409) and releases on the response.
local nonce, thread_id, n = "", "0", 0
local headers = { ["x-tenant-id"] = "bench" }

function init(args)
  nonce = args[1]
  thread_id = tostring(bench_thread or 0)
end

function request()
  n = n + 1
  local path = "/orders/" .. nonce .. "-" .. thread_id .. "-" .. n .. "/activate"
  return wrk.format("POST", path, headers)
end
