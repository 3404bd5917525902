-- GET /api/items, every request as one tenant named by the first script argument
-- (rl_rejected: a fresh tenant per run, far over its limit after the first requests).
wrk.method = "GET"
wrk.path = "/api/items"

function init(args)
  wrk.headers["x-tenant-id"] = args[1]
end
