-- GET /api/items as a tenant drawn at random from 10000 per request (rl_allowed): every
-- request hits one of 10000 counters. The requests are formatted once per thread in init(),
-- so the load generator's cost per request stays that of a table lookup.
local requests = {}

function init(args)
  math.randomseed(os.time() * 100 + (bench_thread or 0))
  for i = 1, 10000 do
    requests[i] = wrk.format("GET", "/api/items", { ["x-tenant-id"] = "tenant-" .. i })
  end
end

function request()
  return requests[math.random(10000)]
end
