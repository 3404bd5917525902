-- ratelimit.lua: check n rate limits and consume from them in one atomic call.
--
-- KEYS[i]  counter key of limit i, i = 1..n (n = #KEYS). All keys share one hash tag and
--          the script touches no other key, so it is Redis Cluster safe.
-- ARGV[1]  cost: integer >= 1, units this request consumes from every limit
-- ARGV[2]  nonce: string unique per request (makes sliding_log members unique)
-- then 5 values per limit i, starting at ARGV[3 + (i-1)*5]:
--   algo       "fw" fixed_window | "sw" sliding_window | "sl" sliding_log | "tb" token_bucket
--   limit      integer > 0
--   window_ms  integer > 0
--   burst      integer > 0, token bucket capacity (ignored by fw/sw/sl)
--   shadow     "1": reported but never rejects | "0"
--
-- Reply: flat array of 1 + 4n integers
--   [1]  admitted: 1 if every non-shadow limit allows the request, else 0
--   then per limit i, at 2 + (i-1)*4:
--     allowed         1/0, this limit's own verdict
--     remaining       units left, after consumption if admitted, else as of now; >= 0
--     reset_ms        ms until this limit's quota is fully restored if nothing else arrives
--                     (fw: until the window ends, window_ms if no window is open); >= 0
--     retry_after_ms  if allowed == 0: ms until a request of this cost would be allowed, >= 1;
--                     else 0
--
-- Two phases: check every limit without writing, then, only if admitted, consume `cost` from
-- every limit whose own verdict is allow. A rejected request consumes nothing anywhere.
-- The one write outside that rule: a fw counter found without a TTL gets one, because it
-- would otherwise reject forever.
--
-- Time comes from redis.call('TIME') so every proxy agrees; it is kept in microseconds
-- (about 1.7e15, exact in a double) and every reply value is converted to whole ms.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local nonce = ARGV[2]

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

-- Phase 1: check everything; nothing is written but the fw TTL repair.
local limits, states = {}, {}
local admitted = true
for i = 1, #KEYS do
  local a = 3 + (i - 1) * 5
  local p = { algo = algos[ARGV[a]] or error('ratelimit.lua: unknown algo ' .. tostring(ARGV[a])),
              limit = tonumber(ARGV[a + 1]),
              window_ms = tonumber(ARGV[a + 2]), burst = tonumber(ARGV[a + 3]),
              shadow = ARGV[a + 4] == '1' }
  p.w = p.window_ms * 1000
  local s = p.algo.check(KEYS[i], p)
  if not s.ok and not p.shadow then admitted = false end
  limits[i], states[i] = p, s
end

-- Phase 2: consume only if admitted, and only where this limit's own verdict is allow.
local reply = { admitted and 1 or 0 }
for i = 1, #KEYS do
  local p, s = limits[i], states[i]
  local remaining, reset = s.remaining, s.reset_ms
  if admitted and s.ok then remaining, reset = p.algo.consume(KEYS[i], p, s) end
  reply[#reply + 1] = s.ok and 1 or 0
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = s.ok and 0 or s.retry_ms
end
return reply
