-- GET /api/items as a tenant drawn at random from 10000 per request (rl_allowed): every
-- request hits one of 10000 counters. The requests are formatted once per thread in init(),
-- so the load generator's cost per request stays that of a table lookup. Arguments after the
-- first (the run's nonce) are headers every request carries, as "name: value".
local requests = {}

function init(args)
  math.randomseed(os.time() * 100 + (bench_thread or 0))
  local extra = {}
  for i = 2, #args do
    local name, value = args[i]:match("^([^:]+):%s*(.*)$")
    if name then extra[name] = value end
  end
  for i = 1, 10000 do
    local headers = { ["x-tenant-id"] = "tenant-" .. i }
    for name, value in pairs(extra) do headers[name] = value end
    requests[i] = wrk.format("GET", "/api/items", headers)
  end
end

function request()
  return requests[math.random(10000)]
end
