-- acquire.lua: one atomic "acquire" for one hash slot: check n rate limits and consume from
-- them, then, if they admitted the request, acquire its idempotency record, then its lease.
--
-- KEYS[1..n]   rate-limit counters, KEYS[i] for limit i (n = ARGV[1]; may be 0)
-- KEYS[n+1]    idempotency record, present iff the idempotency section is on
-- then, iff the lease section is on, two more keys after the record (if any):
--   lease key   the lease, a string holding the owner token
--   fence key   the fencing counter, a string holding the last fencing token issued
--              All keys share one hash tag and the script touches no other key, so it is
--              Redis Cluster safe.
-- ARGV[1]      n: number of rate limits (integer >= 0)
-- ARGV[2]      cost: integer >= 1, units this request consumes from every limit
-- ARGV[3]      nonce: string unique per request (makes sliding_log members unique)
-- ARGV[4 .. 3+5n]  five values per limit i, starting at ARGV[4 + (i-1)*5]:
--   algo       "fw" fixed_window | "sw" sliding_window | "sl" sliding_log | "tb" token_bucket
--              | "lq" leased quota: a fixed window that hands out slices (see below)
--   limit      integer > 0
--   window_ms  integer > 0
--   burst      integer > 0, token bucket capacity (ignored by fw/sw/sl)
--   shadow     "1": reported but never rejects | "0"
-- ARGV[4+5n]   "1": idempotency section on | "0": off (then ARGV[5+5n..7+5n] may be omitted)
-- ARGV[5+5n]   fingerprint ("sha256:<64 hex>")
-- ARGV[6+5n]   owner token (32 hex)
-- ARGV[7+5n]   processing_ttl_ms: integer > 0, lease of the PROCESSING record
-- ARGV[L]      "1": lease section on | "0" or absent: off (then nothing follows);
--              L = 5+5n when the idempotency section is off, 8+5n when it is on
-- ARGV[L+1]    lease owner token (32 hex; must not be empty)
-- ARGV[L+2]    lease_ttl_ms: integer > 0
-- ARGV[L+3]    fence_ttl_ms: integer > 0, TTL of the fence key, set again at every ACQUIRED
--
-- Reply: flat array
--   [1]  admitted: 1 if every non-shadow limit allows the request, else 0 (1 when n = 0)
--   then 4 integers per limit i, at 2 + (i-1)*4:
--     allowed         1/0, this limit's own verdict
--     remaining       units left, after consumption if admitted, else as of now; >= 0
--                     ("lq" when admitted: the size of the slice granted, >= cost)
--     reset_ms        ms until this limit's quota is fully restored if nothing else arrives
--                     (fw: until the window ends, window_ms if no window is open); >= 0
--     retry_after_ms  if allowed == 0: ms until a request of this cost would be allowed, >= 1;
--                     else 0
--   then, iff the idempotency section is on, 3 more values at 2 + 4n:
--     code     integer: 0 SKIPPED (rate limits did not admit; nothing written)
--                       1 ACQUIRED (PROCESSING record created, owned by ARGV[6+5n])
--                       2 IN_PROGRESS (same fingerprint, state PROCESSING)
--                       3 COMPLETED (same fingerprint)
--                       4 CONFLICT (different fingerprint, any state)
--                       5 UNREADABLE (the value is not a record we can read: not JSON, not an
--                         object, no string fingerprint, state neither PROCESSING nor
--                         COMPLETED, or not a string key at all)
--     pttl_ms  integer: the record's PTTL after the call (-2 if absent, -1 if it has no TTL)
--     record   bulk string: the stored record JSON for code 3, else "" (never for CONFLICT)
--   then, iff the lease section is on, 2 more values (after the idempotency values, if any):
--     code     0 SKIPPED (rate limits did not admit, or the idempotency section is on and its
--                code is not 1 ACQUIRED; nothing written for the lease)
--              1 ACQUIRED (SET lease <owner> NX PX lease_ttl_ms succeeded)
--              2 BUSY (the lease exists, held by another owner or by this one: no re-entrancy)
--     value    ACQUIRED: the fencing token, as a decimal STRING; BUSY: the lease's PTTL in
--              ms, >= 1 (1 if it has no TTL, which is left as it is); SKIPPED: 0
--   The reply never holds a nil (webdis would drop it), and no integer of more than 10
--   digits: webdis 0.1.9 crashes on one inside an array (and truncates a top-level one), so
--   the ~16-digit fencing token travels as a string.
--
-- Order: rate limits first, then idempotency. Phase 1 checks every limit without writing;
-- only if admitted, phase 2 consumes `cost` from every limit whose own verdict is allow, and
-- then the idempotency record is acquired. So a rejected request consumes nothing anywhere
-- and writes no record, and a duplicate (codes 2-5) has still consumed its rate limits.
-- The one write outside that rule: a fw counter found without a TTL gets one, because it
-- would otherwise reject forever. An existing record is never written. The lease is taken
-- last, only by a request that was admitted and (with idempotency on) acquired its record, so
-- a replay, a duplicate in progress or a conflict never holds it.
--
-- Fencing token: token = max(stored + 1, now_us), stored = the fence key's value (0 if
-- absent, or not a non-negative integer below 2^53), now_us = Redis TIME in µs; then
-- SET fence token PX fence_ttl_ms. Tokens of one fence key strictly increase, also after the
-- key expired or was evicted, as long as Redis TIME does not go backwards (e.g. a failover
-- to a replica whose clock is behind). The resource the lease protects must check them.
--
-- The PROCESSING record, compact JSON, TTL processing_ttl_ms:
--   {"schema_version":1,"state":"PROCESSING","fingerprint":"sha256:..","owner":"..",
--    "created_ms":<Redis TIME, ms>,"updated_ms":<same>}
--
-- Arguments are validated before anything is read or written; a bad one is a script error.
--
-- Time comes from redis.call('TIME') so every proxy agrees; it is kept in microseconds
-- (about 1.7e15, exact in a double) and every reply value is converted to whole ms.

local function bad(what) error('acquire.lua: ' .. what, 0) end

local function count_arg(i, min)
  local v = tonumber(ARGV[i])
  if v == nil or v ~= math.floor(v) or v < min or v == math.huge then
    bad('ARGV[' .. i .. '] must be an integer >= ' .. min .. ', got ' .. tostring(ARGV[i]))
  end
  return v
end

local n = count_arg(1, 0)
local cost = count_arg(2, 1)
local nonce = ARGV[3] or bad('ARGV[3] (nonce) is missing')
local idem_flag = ARGV[4 + 5 * n]
if idem_flag ~= '0' and idem_flag ~= '1' then
  bad('ARGV[' .. (4 + 5 * n) .. '] (idempotency flag) must be "0" or "1", got '
      .. tostring(idem_flag))
end
local idem = idem_flag == '1'
local idem_key, fingerprint, owner, processing_ttl_ms
if idem then
  idem_key = KEYS[n + 1]
  fingerprint = ARGV[5 + 5 * n] or bad('fingerprint is missing')
  owner = ARGV[6 + 5 * n] or bad('owner token is missing')
  processing_ttl_ms = count_arg(7 + 5 * n, 1)
end
local L = (idem and 8 or 5) + 5 * n
local lease_flag = ARGV[L]
if lease_flag ~= nil and lease_flag ~= '0' and lease_flag ~= '1' then
  bad('ARGV[' .. L .. '] (lease flag) must be "0" or "1", got ' .. tostring(lease_flag))
end
local lease = lease_flag == '1'
local lease_key, fence_key, lease_owner, lease_ttl_ms, fence_ttl_ms
if lease then
  lease_key = KEYS[n + (idem and 1 or 0) + 1]
  fence_key = KEYS[n + (idem and 1 or 0) + 2]
  lease_owner = ARGV[L + 1]
  if lease_owner == nil or lease_owner == '' then
    bad('ARGV[' .. (L + 1) .. '] (lease owner) is missing')
  end
  lease_ttl_ms = count_arg(L + 2, 1)
  fence_ttl_ms = count_arg(L + 3, 1)
end

if #KEYS ~= n + (idem and 1 or 0) + (lease and 2 or 0) then
  bad(#KEYS .. ' keys for ' .. n .. ' limits, idempotency ' .. (idem and 'on' or 'off')
      .. ', lease ' .. (lease and 'on' or 'off'))
end
if lease then
  for i = 1, #KEYS - 2 do
    if KEYS[i] == lease_key or KEYS[i] == fence_key then bad('KEYS[' .. i .. '] is reused') end
  end
  if lease_key == fence_key then bad('the lease key and the fence key are the same') end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- Integer-valued string of a big double: tostring() would keep only 14 digits.
local function int(x) return string.format('%.0f', x) end
-- µs span -> whole ms, rounded up so waiting that long is always enough.
local function ms(us) return math.max(0, math.ceil(us / 1000)) end
local function retry_ms(us) return math.max(1, math.ceil(us / 1000)) end

-- Each algorithm: check(key, p) reads state and returns it with ok / remaining / reset_ms /
-- retry_ms as of now; consume(key, p, s) writes and returns remaining, reset_ms afterwards.
-- p = { algo, limit, window_ms, w (window in µs), burst, shadow }.
local algos = {}

-- Fixed window: one counter; the window opens at its first consumption.
algos.fw = {
  check = function(key, p)
    local count = tonumber(redis.call('GET', key)) or 0
    local ttl = redis.call('PTTL', key)
    if ttl == -1 then
      redis.call('PEXPIRE', key, p.window_ms)
      ttl = p.window_ms
    end
    local reset = ttl >= 0 and ttl or p.window_ms
    return { count = count, reset = reset,
             ok = count + cost <= p.limit,
             remaining = math.max(0, p.limit - count),
             reset_ms = reset,
             retry_ms = math.max(1, reset) }
  end,
  consume = function(key, p, s)
    local n = redis.call('INCRBY', key, cost)
    if n == cost then redis.call('PEXPIRE', key, p.window_ms) end
    return math.max(0, p.limit - n), s.reset
  end,
}

-- Leased quota: the fixed-window counter of a limit in `mode: leased`. Instead of one unit the
-- caller takes a slice of what is left, admits this request from it and the rest locally. A
-- slice never exceeds what is left, so all the slices of a window never exceed the limit; it
-- is an eighth of what is left (at least `cost`), so slices shrink as the window fills and
-- the units idle in other callers' slices when the counter runs out stay small.
algos.lq = {
  check = algos.fw.check,
  consume = function(key, p, s)
    local left = p.limit - s.count
    local slice = math.min(left, math.max(cost, math.floor(left / 8)))
    local n = redis.call('INCRBY', key, slice)
    if n == slice then redis.call('PEXPIRE', key, p.window_ms) end
    return slice, s.reset
  end,
}

-- Sliding window: counts of the current and previous aligned windows; the previous one is
-- weighted by the share of it still inside the sliding window. Constant memory, approximate.
-- reset_ms: when the estimate reaches 0, i.e. the end of the next window if the current one
-- has hits (they then fade out as "previous"), the end of the current one if only the
-- previous has hits, else 0. Never more than 2 windows, the key's TTL.
local function sw_reset(cur, prev, left, w)
  if cur > 0 then return ms(left + w) end
  if prev > 0 then return ms(left) end
  return 0
end

algos.sw = {
  check = function(key, p)
    local w = p.w
    local idx = math.floor(now / w)
    local h = redis.call('HMGET', key, 'w', 'c', 'p')
    local stored, cur, prev = tonumber(h[1]), tonumber(h[2]) or 0, tonumber(h[3]) or 0
    if stored == idx - 1 then
      prev, cur = cur, 0
    elseif stored ~= idx then
      prev, cur = 0, 0
    end
    local elapsed = now - idx * w
    local left = w - elapsed
    local est = prev * (1 - elapsed / w) + cur
    local s = { idx = idx, cur = cur, prev = prev, left = left, est = est,
                ok = est + cost <= p.limit,
                remaining = math.max(0, math.floor(p.limit - est)),
                reset_ms = sw_reset(cur, prev, left, w) }
    if not s.ok then
      local room = p.limit - cost - cur
      local wait
      if room >= 0 then
        -- cur fits: wait until prev's weighted share decays to room (before this window ends)
        wait = w * (1 - room / prev) - elapsed
      elseif p.limit >= cost then
        -- cur alone is too high: in the next window cur becomes prev and decays from there
        wait = left + w * (1 - (p.limit - cost) / cur)
      else
        wait = left + w -- cost > limit never fits; the caller validates this away
      end
      s.retry_ms = retry_ms(wait)
    end
    return s
  end,
  consume = function(key, p, s)
    redis.call('HSET', key, 'w', int(s.idx), 'c', int(s.cur + cost), 'p', int(s.prev))
    redis.call('PEXPIRE', key, 2 * p.window_ms)
    local remaining = math.max(0, math.floor(p.limit - s.est - cost))
    return remaining, sw_reset(s.cur + cost, s.prev, s.left, p.w)
  end,
}

-- Sliding log: one ZSET member per unit, scored by its time in µs; an entry counts while
-- score > now - window. Exact, memory grows with the limit.
-- reset_ms: when the newest entry leaves the window (window_ms right after consuming),
-- 0 when the window is empty.
algos.sl = {
  check = function(key, p)
    local since = '(' .. int(now - p.w)
    local count = redis.call('ZCOUNT', key, since, '+inf')
    local s = { count = count,
                ok = count + cost <= p.limit,
                remaining = math.max(0, p.limit - count),
                reset_ms = 0 }
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if newest[2] then s.reset_ms = ms(tonumber(newest[2]) + p.w - now) end
    if not s.ok then
      -- the k oldest entries in the window have to leave; the k-th leaves at score + window
      local k = count + cost - p.limit
      local wait = p.w -- cost > limit never fits; the caller validates this away
      if k <= count then
        local e = redis.call('ZRANGEBYSCORE', key, since, '+inf', 'WITHSCORES', 'LIMIT', k - 1, 1)
        wait = tonumber(e[2]) + p.w - now
      end
      s.retry_ms = retry_ms(wait)
    end
    return s
  end,
  consume = function(key, p, s)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - p.w))
    local args, score = {}, int(now)
    for i = 1, cost do
      args[#args + 1] = score
      args[#args + 1] = score .. ':' .. nonce .. ':' .. i
    end
    redis.call('ZADD', key, unpack(args))
    redis.call('PEXPIRE', key, p.window_ms)
    return math.max(0, p.limit - s.count - cost), p.window_ms
  end,
}

-- Token bucket as GCRA: the key holds the theoretical arrival time (TAT, µs). A request is
-- admitted while TAT after it is at most tau = burst * T ahead of now, T = window / limit.
-- TAT is stored rounded to whole µs; a 1 µs tolerance keeps the verdict and `remaining`
-- from disagreeing over that rounding.
local function tb_tokens(tat, T, tau, burst)
  return math.min(burst, math.max(0, math.floor((tau - (tat - now) + 1) / T)))
end

algos.tb = {
  check = function(key, p)
    local T = p.w / p.limit
    local tau = T * p.burst
    local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
    local new_tat = tat + T * cost
    local s = { T = T, tau = tau, new_tat = new_tat,
                ok = new_tat - tau <= now + 1,
                remaining = tb_tokens(tat, T, tau, p.burst),
                reset_ms = ms(tat - now) }
    if not s.ok then s.retry_ms = retry_ms(new_tat - tau - now) end
    return s
  end,
  consume = function(key, p, s)
    local ahead = s.new_tat - now
    redis.call('SET', key, int(s.new_tat), 'PX', math.max(1, math.ceil(ahead / 1000)))
    return tb_tokens(s.new_tat, s.T, s.tau, p.burst), ms(ahead)
  end,
}

-- Arguments of every limit, parsed before anything is read or written.
local limits, states = {}, {}
for i = 1, n do
  local a = 4 + (i - 1) * 5
  local p = { algo = algos[ARGV[a]] or bad('unknown algo ' .. tostring(ARGV[a])),
              limit = count_arg(a + 1, 1),
              window_ms = count_arg(a + 2, 1), burst = count_arg(a + 3, 1),
              shadow = ARGV[a + 4] == '1' }
  if ARGV[a + 4] ~= '0' and ARGV[a + 4] ~= '1' then
    bad('ARGV[' .. (a + 4) .. '] (shadow) must be "0" or "1", got ' .. tostring(ARGV[a + 4]))
  end
  p.w = p.window_ms * 1000
  limits[i] = p
end

-- Phase 1: check everything; nothing is written but the fw TTL repair.
local admitted = true
for i = 1, n do
  local p = limits[i]
  local s = p.algo.check(KEYS[i], p)
  if not s.ok and not p.shadow then admitted = false end
  states[i] = s
end

-- Phase 2: consume only if admitted, and only where this limit's own verdict is allow.
local reply = { admitted and 1 or 0 }
for i = 1, n do
  local p, s = limits[i], states[i]
  local remaining, reset = s.remaining, s.reset_ms
  if admitted and s.ok then remaining, reset = p.algo.consume(KEYS[i], p, s) end
  reply[#reply + 1] = s.ok and 1 or 0
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = s.ok and 0 or s.retry_ms
end

-- Idempotency: create the PROCESSING record if absent, else report what is there.
local SKIPPED, ACQUIRED, IN_PROGRESS, COMPLETED, CONFLICT, UNREADABLE = 0, 1, 2, 3, 4, 5

-- Decoded record, or nil if the value is not one we can read.
local function decode(raw)
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec.fingerprint) ~= 'string' then return nil end
  if rec.state ~= 'PROCESSING' and rec.state ~= 'COMPLETED' then return nil end
  return rec
end

local function acquire()
  if not admitted then return SKIPPED, '' end
  local kind = redis.call('TYPE', idem_key)
  kind = type(kind) == 'table' and kind.ok or kind
  if kind == 'none' then
    local now_ms = int(math.floor(now / 1000))
    local record = '{"schema_version":1,"state":"PROCESSING","fingerprint":'
      .. cjson.encode(fingerprint) .. ',"owner":' .. cjson.encode(owner)
      .. ',"created_ms":' .. now_ms .. ',"updated_ms":' .. now_ms .. '}'
    redis.call('SET', idem_key, record, 'PX', int(processing_ttl_ms), 'NX')
    return ACQUIRED, ''
  end
  if kind ~= 'string' then return UNREADABLE, '' end
  local raw = redis.call('GET', idem_key)
  local rec = decode(raw)
  if rec == nil then return UNREADABLE, '' end
  if rec.fingerprint ~= fingerprint then return CONFLICT, '' end
  if rec.state == 'PROCESSING' then return IN_PROGRESS, '' end
  return COMPLETED, raw
end

local idem_code = SKIPPED
if idem then
  local record
  idem_code, record = acquire()
  reply[#reply + 1] = idem_code
  reply[#reply + 1] = redis.call('PTTL', idem_key)
  reply[#reply + 1] = record
end
if not lease then return reply end

-- Lease: SET NX PX with the owner token; a fencing token for every acquisition.
local LEASE_SKIPPED, LEASE_ACQUIRED, LEASE_BUSY = 0, 1, 2
local MAX_EXACT = 9007199254740992 -- 2^53

-- The last token issued under the fence key, 0 if it is absent or not one we wrote.
local function last_token()
  local kind = redis.call('TYPE', fence_key)
  kind = type(kind) == 'table' and kind.ok or kind
  if kind ~= 'string' then return 0 end
  local v = tonumber(redis.call('GET', fence_key))
  if v == nil or v ~= math.floor(v) or v < 0 or v >= MAX_EXACT then return 0 end
  return v
end

local function take_lease()
  if not admitted or (idem and idem_code ~= ACQUIRED) then return LEASE_SKIPPED, 0 end
  if not redis.call('SET', lease_key, lease_owner, 'NX', 'PX', int(lease_ttl_ms)) then
    return LEASE_BUSY, math.max(1, redis.call('PTTL', lease_key))
  end
  local token = math.max(last_token() + 1, now)
  redis.call('SET', fence_key, int(token), 'PX', int(fence_ttl_ms))
  return LEASE_ACQUIRED, int(token)
end

local lease_code, lease_value = take_lease()
reply[#reply + 1] = lease_code
reply[#reply + 1] = lease_value
return reply
