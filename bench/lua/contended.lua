-- POST /hot/<nonce>/go: every request of the run on one resource guarded by a lease with
-- `on_busy: wait`, each taking CONTENDED_OP_MS at the upstream (bench/run.py, lease_contended).
local headers = { ["x-tenant-id"] = "bench" }
local path = "/hot/x/go"

function init(args)
  path = "/hot/" .. args[1] .. "/go"
  headers["x-upstream-delay-ms"] = args[2]
end

function request()
  return wrk.format("POST", path, headers)
end

